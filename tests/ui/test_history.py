"""The SQLite history store: round trips, incremental writes, crash recovery, rename and delete."""

from __future__ import annotations

import sqlite3

from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.engine.reply import Reply
from chatapp.ui.export import export_conversation, to_json, to_markdown
from chatapp.ui.history import HistoryStore
from tests.ui.conftest import FixedClock
from tests.ui.scripted import calculator_answer, greeting, think_answer, tok


def _store(tmp_path) -> HistoryStore:
    return HistoryStore(tmp_path / "h.sqlite3", clock=FixedClock())


def test_wal_mode_and_round_trip(tmp_path):
    store = _store(tmp_path)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    cid = store.create_conversation("maths", model="m", program="calc")
    store.add_message(cid, "user", "what is 37*45?")
    events = calculator_answer()
    mid = store.add_message(cid, "assistant", "", status="streaming")
    store.append_tokens(mid, 0, events, Reply.of(events).pieces_since(0)[0])
    store.finish_message(mid, "complete")
    store.close()

    conversation = HistoryStore(tmp_path / "h.sqlite3").load(cid)
    assert conversation.summary.title == "maths" and conversation.summary.program == "calc"
    user, assistant = conversation.messages
    assert user.chat_message() == {"role": "user", "content": "what is 37*45?"}
    assert assistant.status == "complete"
    assert assistant.content == Reply.of(events).content
    # Token-level data survives exactly (router probabilities to the stored precision).
    for stored, original in zip(assistant.tokens, events, strict=True):
        assert (stored.token, stored.text, stored.forced, stored.special, stored.tags, stored.zone, stored.tool) == (
            original.token, original.text, original.forced, original.special, original.tags, original.zone,
            original.tool,
        )  # fmt: skip
        assert stored.computed == original.computed


@settings(max_examples=20)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_incremental_batches_equal_one_write(tmp_path_factory, batch_sizes):
    """Appending an answer in any batch sizes stores the same tokens as appending it at once."""
    events = think_answer()
    store = HistoryStore(tmp_path_factory.mktemp("h") / "h.sqlite3")
    cid = store.create_conversation("t")
    mid = store.add_message(cid, "assistant", "", status="streaming")
    written = mark = 0
    reply = Reply()
    for size in batch_sizes:
        batch = events[written : written + size]
        if not batch:
            break
        for event in batch:
            reply.add(event)
        pieces, mark = reply.pieces_since(mark)
        store.append_tokens(mid, written, batch, pieces)
        written += len(batch)
    stored = store.load(cid).messages[0]
    assert [t.token for t in stored.tokens] == [e.token for e in events[:written]]
    assert stored.content == Reply.of(events[:written]).content


def test_streaming_message_reads_back_as_interrupted(tmp_path):
    """A process killed mid-answer leaves a `streaming` row: the partial answer is kept and marked interrupted."""
    store = _store(tmp_path)
    cid = store.create_conversation("hi")
    mid = store.add_message(cid, "assistant", "", status="streaming")
    partial = greeting()[:4]
    store.append_tokens(mid, 0, partial, Reply.of(partial).pieces_since(0)[0])
    # No close, no finish: read it from another connection as a restarted app would.
    message = HistoryStore(tmp_path / "h.sqlite3").load(cid).messages[0]
    assert message.status == "interrupted"
    assert message.content == "Hello! How can"
    assert len(message.tokens) == 4


def test_rename_delete_and_listing_order(tmp_path):
    store = _store(tmp_path)
    first = store.create_conversation("first")
    second = store.create_conversation("second")
    store.add_message(first, "user", "bump")  # most recently updated comes first
    assert [c.title for c in store.list_conversations()] == ["first", "second"]
    store.rename(second, "renamed")
    mid = store.add_message(second, "assistant", "x")
    store.append_tokens(mid, 0, greeting())
    store.delete(second)
    assert [c.title for c in store.list_conversations()] == ["first"]
    # Deleting cascades to messages and tokens.
    db = sqlite3.connect(tmp_path / "h.sqlite3")
    assert db.execute("SELECT COUNT(*) FROM tokens").fetchone()[0] == 0
    assert db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (second,)).fetchone()[0] == 0


def test_recent_prompts_oldest_first(tmp_path):
    store = _store(tmp_path)
    cid = store.create_conversation("c")
    for text in ("one", "two", "three"):
        store.add_message(cid, "user", text)
        store.add_message(cid, "assistant", "ok")
    assert store.recent_prompts() == ["one", "two", "three"]
    assert store.recent_prompts(limit=2) == ["two", "three"]


def test_export_markdown_and_json(tmp_path):
    store = _store(tmp_path)
    cid = store.create_conversation("What is 37*45?", model="m")
    store.add_message(cid, "user", "What is 37*45?")
    events = calculator_answer()
    mid = store.add_message(cid, "assistant", Reply.of(events).content)
    store.append_tokens(mid, 0, events, Reply.of(events).pieces_since(0)[0])
    conversation = store.load(cid)
    markdown = to_markdown(conversation)
    assert markdown.startswith("# What is 37*45?\n")
    assert "## user\n\nWhat is 37*45?" in markdown
    assert "```python\n37*45\n```" in markdown and "```text\n1665\n```" in markdown
    data = to_json(conversation)
    tokens = data["messages"][1]["tokens"]
    assert [t["forced"] for t in tokens] == [e.forced for e in events]
    md_path, json_path = export_conversation(conversation, tmp_path / "exports", now=0.0)
    assert md_path.name == "what-is-37-45-19700101-000000.md"
    assert md_path.read_text() == markdown and json_path.exists()


class _CountingConnection:
    """Wraps the store's sqlite3 connection and counts the bytes of text bound to its statements: what the store
    asks SQLite to write."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self.written = 0

    def _count(self, values) -> None:
        self.written += sum(len(v.encode()) if isinstance(v, str) else 8 for v in values if v is not None)

    def execute(self, sql, params=()):
        self._count(params)
        return self._db.execute(sql, params)

    def executemany(self, sql, rows):
        rows = list(rows)
        for row in rows:
            self._count(row)
        return self._db.executemany(sql, rows)

    def __enter__(self):
        return self._db.__enter__()

    def __exit__(self, *exc):
        return self._db.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._db, name)


def _stream_answer(tmp_path, tokens: int, batch: int = 8) -> list[int]:
    """Store a `tokens`-long answer (prose with a tool call every 500 tokens) batch by batch, as the app does
    (`Reply.pieces_since`); the bytes written after each 1,000 tokens."""
    store = HistoryStore(tmp_path / f"h{tokens}.sqlite3")
    counting = store._db = _CountingConnection(store._db)
    cid = store.create_conversation("long")
    mid = store.add_message(cid, "assistant", "", status="streaming")
    one_call = calculator_answer()
    events = []
    while len(events) < tokens:
        events += [tok(f" word{len(events) % 97}", position=len(events)) for _ in range(500 - len(one_call))]
        events += [e for e in one_call if e.finish_reason is None]
    events = events[:tokens]
    reply, mark, checkpoints = Reply(), 0, []
    for start in range(0, tokens, batch):
        for event in events[start : start + batch]:
            reply.add(event)
        pieces, mark = reply.pieces_since(mark)
        store.append_tokens(mid, start, events[start : start + batch], pieces)
        if (start + batch) % 1000 == 0:
            checkpoints.append(counting.written)
    store.finish_message(mid, "complete", reply.content)
    assert store.load(cid).messages[0].content == Reply.of(events).content
    return checkpoints


def test_an_8000_token_answer_costs_writes_linear_in_its_length(tmp_path):
    """Each batch appends its tokens and the text the content gained, never the whole content again: every 1,000
    tokens cost about the same bytes (rewriting the content per batch would make the last thousand cost ~8x the
    first)."""
    checkpoints = _stream_answer(tmp_path, 8000)
    per_thousand = [b - a for a, b in zip([0, *checkpoints], checkpoints, strict=False)]
    assert len(per_thousand) == 8
    assert max(per_thousand) < 1.3 * min(per_thousand), per_thousand
    # And per token: a token row plus its text once, well under 1 KB.
    assert checkpoints[-1] / 8000 < 1000
