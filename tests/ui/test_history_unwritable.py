"""Issue 41, row 4: the TUI never loses what the user typed when its files cannot be written.

A history database that stops taking writes (read-only, disk full, locked by another program) gives one visible
notice; the conversation goes on in memory and the app keeps answering. An export that cannot be written is a notice
too. Each failure is SQLite's (or the file system's) own: `PRAGMA query_only` is SQLite's read-only state
(SQLITE_READONLY), `PRAGMA max_page_count` its full disk (SQLITE_FULL), a second connection's open write transaction
its lock (SQLITE_BUSY); file modes are used where the tests do not run as root (root writes through them).
"""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatapp.engine.reply import Reply
from chatapp.settings import data_dir
from chatapp.ui import ChatApp
from chatapp.ui.history import HistoryStore, open_history
from chatapp.ui.widgets.prompt import PromptInput
from chatapp.ui.widgets.transcript import AssistantMessage, UserMessage
from tests.ui.conftest import SIZE, FixedClock, send_and_wait, wait_until
from tests.ui.scripted import ScriptedBackend, calculator_answer, greeting

ANSWER = Reply.of(greeting()).content
LONG = " ".join(["a message longer than the pages the database may still take"] * 200)  # ~12 KB: new pages


def _texts(app: ChatApp) -> list[tuple[str, str]]:
    out = []
    for widget in app.transcript.children:
        if isinstance(widget, UserMessage):
            out.append(("user", widget.text))
        elif isinstance(widget, AssistantMessage):
            out.append(("assistant", Reply.of(widget.events).content))
    return out


def _history_notices(app: ChatApp) -> list[str]:
    return [n.message for n in app._notifications if n.title == "History not saved"]


def _prepared_db(path: Path) -> Path:
    """A history database that already exists (as after an earlier session), then closed."""
    store = HistoryStore(path, clock=FixedClock())
    store.create_conversation("earlier", model="m")
    store.close()
    return path


@pytest.fixture
def file_connections(monkeypatch):
    """Run `pragma` on every connection to a history file (not the in-memory copy) as it opens: the state SQLite is
    in when the file cannot take writes."""

    def install(pragma: str) -> None:
        connect = sqlite3.connect

        def hostile_connect(database, *args, **kwargs):
            db = connect(database, *args, **kwargs)
            if str(database) != ":memory:":
                db.execute(pragma if "{pages}" not in pragma else pragma.format(pages=_pages(db)))
            return db

        monkeypatch.setattr(sqlite3, "connect", hostile_connect)

    return install


def _pages(db: sqlite3.Connection) -> int:
    return db.execute("PRAGMA page_count").fetchone()[0]


async def _two_messages_survive(app: ChatApp, first: str) -> None:
    """Send `first` and a second message to an app whose history is `_prepared_db`'s: both stay in the transcript
    with their answers, one notice says the history is not saved (with its fix), and the header keeps saying so."""
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, first)
        assert _texts(app) == [("user", first), ("assistant", ANSWER)]
        (notice,) = _history_notices(app)
        assert "cannot be written" in notice and "\n  fix: " in notice
        assert "history not saved" in app.sub_title
        await send_and_wait(pilot, "and a second one")
        assert _texts(app) == [
            ("user", first),
            ("assistant", ANSWER),
            ("user", "and a second one"),
            ("assistant", ANSWER),
        ]
        assert len(_history_notices(app)) == 1  # said once, not per write
        # The conversation goes on in memory: what the history screen and an export read holds all of it.
        stored = app.store.load(app.conversation_id)
        assert [m.role for m in stored.messages] == ["user", "assistant", "user", "assistant"]
        assert stored.messages[0].content == first
        # What the file held was copied to memory: the history screen still lists the earlier session.
        assert [c.title for c in app.store.list_conversations()][-1] == "earlier"
    assert app.return_code in (None, 0)


@pytest.mark.parametrize(
    ("pragma", "reason"),
    [
        ("PRAGMA query_only = ON", "attempt to write a readonly database"),
        ("PRAGMA max_page_count = {pages}", "database or disk is full"),
    ],
    ids=["read-only", "disk-full"],
)
@pytest.mark.asyncio
async def test_a_database_that_takes_no_writes_costs_no_message(build_app, tmp_path, file_connections, pragma, reason):
    db = _prepared_db(tmp_path / "history.sqlite3")
    file_connections(pragma)
    app = build_app(ScriptedBackend([greeting(), greeting()]), db=db)
    await _two_messages_survive(app, LONG if "max_page_count" in pragma else "hi there")
    assert reason in _history_notices(app)[0]
    # What the file held is intact (a full disk took what fitted before it filled: the new conversation's row).
    titles = [c.title for c in HistoryStore(db).list_conversations()]
    assert titles[-1] == "earlier" and (len(titles) == 1 or reason == "database or disk is full")


@pytest.mark.asyncio
async def test_a_locked_database_costs_no_message(tmp_path):
    """Another program holds a write transaction past the store's wait: the session goes on in memory."""
    db = _prepared_db(tmp_path / "history.sqlite3")
    other = sqlite3.connect(db)
    other.execute("BEGIN IMMEDIATE")
    try:
        store = HistoryStore(db, clock=FixedClock(), timeout=0.05)
        app = ChatApp(ScriptedBackend([greeting(), greeting()]), store, cursor_blink=False)
        await _two_messages_survive(app, "hi there")
        assert "database is locked" in _history_notices(app)[0]
    finally:
        other.rollback()
        other.close()


def _mode_bits_hold() -> bool:
    """Whether this process is refused a write by a file's mode (not so for root with its override capability)."""
    with tempfile.TemporaryDirectory() as directory:
        probe = Path(directory) / "probe"
        probe.touch(mode=0o444)
        try:
            probe.open("a").close()
        except PermissionError:
            return True
    return False


@pytest.mark.asyncio
async def test_a_database_locked_from_the_start_costs_no_message(tmp_path):
    """Another program holds the database (rollback journal, exclusive lock) as the app starts: the app starts in
    memory with what the file held, says so at once, and answers."""
    db = _prepared_db(tmp_path / "history.sqlite3")
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("PRAGMA journal_mode=DELETE")
    other.execute("BEGIN EXCLUSIVE")
    try:
        store = open_history(db, clock=FixedClock(), timeout=0.05)
        assert store.unsaved is not None
        app = ChatApp(ScriptedBackend([greeting(), greeting()]), store, cursor_blink=False)
        await _two_messages_survive(app, "hi there")
        assert "database is locked" in _history_notices(app)[0]
    finally:
        other.rollback()
        other.close()
    assert [c.title for c in HistoryStore(db).list_conversations()] == ["earlier"]


@pytest.mark.skipif(not _mode_bits_hold(), reason="this process writes through mode bits (root's override)")
@pytest.mark.asyncio
async def test_a_read_only_history_directory_costs_no_message(build_app, tmp_path):
    """The database and its directory read-only, as a closed session left them: the app starts in memory."""
    folder = tmp_path / "ro"
    folder.mkdir()
    db = _prepared_db(folder / "history.sqlite3")
    db.chmod(0o444)
    folder.chmod(0o555)
    try:
        app = build_app(ScriptedBackend([greeting(), greeting()]), db=db)
        await _two_messages_survive(app, "hi there")
    finally:
        folder.chmod(0o755)


@pytest.mark.skipif(not _mode_bits_hold(), reason="this process writes through mode bits (root's override)")
@pytest.mark.asyncio
async def test_a_read_only_database_file_costs_no_message(build_app, tmp_path):
    db = _prepared_db(tmp_path / "history.sqlite3")
    for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        if path.exists():
            path.chmod(0o444)
    app = build_app(ScriptedBackend([greeting(), greeting()]), db=db)
    await _two_messages_survive(app, "hi there")


@pytest.mark.asyncio
async def test_a_database_that_fails_mid_answer_keeps_the_answer(build_app, tmp_path):
    """The database stops taking writes while an answer streams: every token stays, and the next answer too."""
    backend = ScriptedBackend([greeting(), calculator_answer()])
    backend.hold_after = 3
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.click("#prompt")
        app.query_one(PromptInput).insert("hi")
        await pilot.press("enter")
        await wait_until(pilot, backend.held.is_set, what="the answer to be half shown")
        await pilot.pause(0.2)  # a batch or more of it drawn and saved
        # The file turns read-only under the running app (the store's own connection: SQLite's read-only state).
        app.store._db.execute("PRAGMA query_only = ON")
        backend.release.set()
        await wait_until(pilot, lambda: not app.is_generating, what="the first answer to finish")
        await send_and_wait(pilot, "what is 37*45?")
        assert [role for role, _ in _texts(app)] == ["user", "assistant", "user", "assistant"]
        assert _texts(app)[1] == ("assistant", ANSWER)
        assert len(_history_notices(app)) == 1
        assert app.store.load(app.conversation_id).messages[1].content == ANSWER


@pytest.mark.asyncio
async def test_an_export_that_cannot_be_written_is_a_notice(build_app, tmp_path):
    """The exports directory cannot be made (a file stands in its place): a notice with its fix, no partial files,
    and the app goes on."""
    app = build_app(ScriptedBackend([greeting(), greeting()]))
    data_dir().mkdir(parents=True, exist_ok=True)
    (data_dir() / "exports").write_text("not a directory")
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        await pilot.press("ctrl+s")
        await pilot.pause()
        (notice,) = [n.message for n in app._notifications if n.title == "Not exported"]
        assert str(data_dir() / "exports") in notice and "\n  fix: " in notice
        await send_and_wait(pilot, "still here?")
        assert len(_texts(app)) == 4
    assert (data_dir() / "exports").read_text() == "not a directory"


@pytest.fixture(scope="module")
def history_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("history") / "h.sqlite3"
    store = HistoryStore(path, clock=FixedClock())
    conversation = store.create_conversation("x")
    for _ in range(40):
        store.add_message(conversation, "user", "hello " * 50)
    store.close()
    return path.read_bytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_history_damaged_anywhere_is_moved_aside_or_used(tmp_path_factory, history_bytes: bytes, data) -> None:
    """A real history with bytes changed or cut off: moved aside (the default location) or opened and usable;
    never a traceback (SQLite's report on some damage quotes bytes that are not UTF-8)."""
    damaged = bytearray(history_bytes)
    for _ in range(data.draw(st.integers(1, 20))):
        damaged[data.draw(st.integers(16, len(damaged) - 1))] = data.draw(st.integers(0, 255))
    damaged = damaged[: data.draw(st.integers(100, len(damaged)))]
    path = tmp_path_factory.mktemp("db") / "history.sqlite3"
    path.write_bytes(bytes(damaged))
    store = open_history(path)
    store.list_conversations()
    store.add_message(store.create_conversation("after"), "user", "still works")
    assert store.load(store.list_conversations()[0].id) is not None
    store.close()


WRITES = {
    "create_conversation": lambda store, ids: store.create_conversation("new"),
    "add_message": lambda store, ids: store.add_message(ids["conversation"], "user", "typed"),
    "append_tokens": lambda store, ids: store.append_tokens(ids["answer"], 0, greeting()),
    "finish_message": lambda store, ids: store.finish_message(ids["answer"], "complete", "Hello"),
    "rename": lambda store, ids: store.rename(ids["conversation"], "renamed"),
    "set_program": lambda store, ids: store.set_program(ids["conversation"], "think"),
    "delete_message": lambda store, ids: store.delete_message(ids["answer"]),
    "delete": lambda store, ids: store.delete(ids["conversation"]),
}


@pytest.mark.parametrize("write", WRITES, ids=list(WRITES))
def test_every_write_goes_on_in_memory_and_says_so_once(tmp_path, write: str) -> None:
    """Whichever write meets the read-only database first, it takes effect (in memory), and so does the next."""
    store = HistoryStore(tmp_path / "h.sqlite3", clock=FixedClock())
    told: list[str] = []
    store.on_unsaved = lambda err: told.append(err.message)
    conversation = store.create_conversation("first")
    store.add_message(conversation, "user", "hi")
    ids = {"conversation": conversation, "answer": store.add_message(conversation, "assistant", "", status="streaming")}
    store._db.execute("PRAGMA query_only = ON")  # SQLite's read-only state, on the store's own connection
    WRITES[write](store, ids)
    store.create_conversation("after")
    assert len(told) == 1 and "attempt to write a readonly database" in told[0]
    titles = [c.title for c in store.list_conversations()]
    assert titles[0] == "after" and ("new" in titles) == (write == "create_conversation")
    if write != "delete":
        messages = store.load(conversation).messages
        assert ("typed" in [m.content for m in messages]) == (write == "add_message")
        assert (len(messages) == 1) == (write == "delete_message")
    store.close()
    on_disk = HistoryStore(tmp_path / "h.sqlite3")
    assert [c.title for c in on_disk.list_conversations()] == ["first"]  # nothing reached the file after it failed
