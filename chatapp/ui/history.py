"""Chat history in SQLite: conversations, messages, and every assistant token with its forced flag and zone tags.

Written incrementally: an assistant message is created as `streaming` before its first token and its tokens are
appended batch by batch as the UI shows them, so a crash or a kill mid-answer loses nothing that was on screen.
Append-only: a batch writes its tokens and the text the content gained (`content_pieces`, from the reply fold's
`pieces_since`), never the whole content again, so an answer costs writes linear in its length; the finished
message's content is written once, when it ends, and its pieces dropped.
A message still marked `streaming` when read back was cut off and is reported as `interrupted`, unless its last
stored token ends the answer (`answer_finished`: only the status write was lost). WAL mode keeps
those small frequent commits cheap and lets a second instance read while one writes.

A database that stops taking writes mid-session (made read-only, disk full, locked by another program) never costs
the conversation: the store goes on in an in-memory copy and says so once (`HistoryStore.on_unsaved`).

A database deleted while the app runs (`rm history.sqlite3`) would go on taking writes: the open connection writes
into the unlinked file, and everything vanishes when the app closes. So before each transaction (and at close) the
store checks that its path still names the file it opened (a `stat`: microseconds, against a transaction's
milliseconds), and when it is gone writes what it held into a new database at the same path, saying so once
(`HistoryStore.on_notice`). A path that names another file by then is not the store's to write: it goes on in memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from chatapp.engine.events import TokenEvent, ToolEvent
from chatapp.engine.reply import ContentPiece, parts_content
from chatapp.errors import HistoryError
from chatapp.tools.parts import Content

MessageStatus = Literal["complete", "streaming", "interrupted"]

FINISHED_REASONS = frozenset({"stop", "length", "program", "context"})
"""Finish reasons of an answer that ended by itself: whatever happened after its last token (the engine process
killed, the app closed, esc pressed too late) did not cut it short."""


def answer_finished(events: Sequence[TokenEvent]) -> bool:
    """Whether an answer's tokens end it (its last token carries a finish reason other than cancelled / error)."""
    return bool(events) and events[-1].finish_reason in FINISHED_REASONS

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    model TEXT NOT NULL DEFAULT '',
    program TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,            -- JSON: a string, or a list of {"type", "text"} parts
    status TEXT NOT NULL DEFAULT 'complete',
    created REAL NOT NULL,
    UNIQUE (conversation_id, position)
);
CREATE TABLE IF NOT EXISTS tokens (
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    token INTEGER NOT NULL,
    text TEXT NOT NULL,
    forced INTEGER NOT NULL,
    special INTEGER NOT NULL,
    zone TEXT,
    tags TEXT NOT NULL,               -- JSON list of zone tags
    router_probs TEXT,                -- JSON list, one per STT layer, or NULL
    computed TEXT,                    -- '1'/'0' per STT layer, or NULL
    tool TEXT,                        -- JSON ToolEvent, or NULL
    finish_reason TEXT,
    error TEXT,
    PRIMARY KEY (message_id, position)
);
CREATE TABLE IF NOT EXISTS content_pieces (  -- a streaming message's content, appended batch by batch
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    part INTEGER NOT NULL,            -- index of the content part the text is appended to
    type TEXT NOT NULL,               -- that part's type
    text TEXT NOT NULL,
    PRIMARY KEY (message_id, seq)
);
"""


@dataclass(frozen=True)
class ConversationSummary:
    """One row of the history list."""

    id: int
    title: str
    model: str
    program: str | None
    created: float
    updated: float
    messages: int


@dataclass
class StoredMessage:
    """A message read back from the store; assistant messages carry their tokens."""

    id: int
    role: str
    content: str | list[dict[str, str]]
    status: MessageStatus
    tokens: list[TokenEvent] = field(default_factory=list)

    def chat_message(self) -> dict[str, Any]:
        """The message as the chat format wants it (for resuming the conversation in a backend)."""
        return {"role": self.role, "content": self.content}


@dataclass
class Conversation:
    summary: ConversationSummary
    messages: list[StoredMessage]


_T = TypeVar("_T")


def storage_failure(err: sqlite3.Error) -> bool:
    """Whether `err` is the storage's doing, not the query's: read-only (SQLITE_READONLY), disk full (SQLITE_FULL),
    locked or busy past the timeout, an I/O error, a file damaged under the app. An integrity or programming error is
    a bug and is not one of these."""
    return type(err) in (sqlite3.OperationalError, sqlite3.DatabaseError)


class HistoryStore:
    """All access to the history database. Used from the UI thread only (sqlite3 connections are per thread).

    Every query goes through `_use`: when the database fails under it (`storage_failure`), the store moves to an
    in-memory copy of what it held, runs the query there, and goes on in memory until it is closed. `unsaved` then
    says why (a `HistoryError` with its fix), and `on_unsaved`, when set, is called with it once.
    """

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time, timeout: float = 5.0) -> None:
        self.path = Path(path)
        self._clock = clock
        self.notice: str | None = None  # set by `open_history` when it moved a damaged database aside
        self.unsaved: HistoryError | None = None
        self.on_unsaved: Callable[[HistoryError], None] | None = None
        self.on_notice: Callable[[str], None] | None = None  # called with what the store did on its own (re-saved)
        self._timeout = timeout
        self._opened: tuple[int, int] | None = None  # (device, inode) of the file the connection has open
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = self._open(timeout)
        except sqlite3.Error as err:
            if not storage_failure(err):
                raise HistoryError(
                    f"cannot open the history database {self.path}: {err}",
                    hint="pass --db with another file path (a new one is created), or move this one away",
                ) from None
            # It cannot be written (read-only, full, locked): the session starts in memory, with what it holds.
            self._db = _readable(self.path)
            self._go_on_in_memory(err)
        except OSError as err:  # its directory cannot be made: more likely a wrong --db than a full disk
            raise HistoryError(
                f"cannot open the history database {self.path}: {err}",
                hint="pass --db with a writable file path, or fix the permissions",
            ) from None

    def _open(self, timeout: float) -> sqlite3.Connection:
        # `timeout`: how long a write waits for another instance's transaction before the store goes on in memory.
        db = sqlite3.connect(self.path, timeout=timeout)
        try:
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            # NORMAL is durable against a killed process (what we guard against) without an fsync per batch.
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
            db.executescript(_SCHEMA)
            db.commit()
        except sqlite3.Error:
            db.close()
            raise
        self._opened = _file_identity(self.path)
        return db

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error, OSError):
            self._check_file()  # deleted after the last write: what it held is written again before the app ends
        self._db.close()

    def _check_file(self) -> None:
        """Make sure the connection writes the file at `self.path` (module docstring): re-save into a new one when
        the file was deleted, go on in memory when another file took its place."""
        if self._opened is None or self.unsaved is not None:
            return  # in memory already
        now = _file_identity(self.path)
        if now == self._opened:
            return
        memory = sqlite3.connect(":memory:")
        memory.row_factory = sqlite3.Row
        self._db.backup(memory)  # the unlinked file (and its WAL) stays readable through the open connection
        memory.execute("PRAGMA foreign_keys=ON")
        if now is not None:
            # Another file is at the path now. Closing the old connection would let SQLite delete "<path>-wal" by its
            # name, the new file's own journal: it is kept open (and unused) until the process ends instead.
            _KEPT_OPEN.append(self._db)
            self._db, self._opened = memory, None
            self._moved_to_memory(f"it was replaced by another file while chatapp ran ({self.path})")
            return
        # Closed first: SQLite checkpoints it into the unlinked file and removes its -wal and -shm by name, which
        # must not be left for the new database at the same path to read as its own.
        with contextlib.suppress(sqlite3.Error):
            self._db.close()
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(OSError):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = self._open(self._timeout)
            memory.backup(db)
        except (sqlite3.Error, OSError) as err:
            self._db, self._opened = memory, None
            self._moved_to_memory(f"it was deleted while chatapp ran and cannot be written again ({err})")
            return
        memory.close()
        self._db = db
        if self.on_notice is not None:
            self.on_notice(
                f"the history database {self.path} was deleted while chatapp ran; everything it held, this session "
                "included, was written into a new one at the same path"
            )

    def _use(self, query: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run `query` in one transaction, on disk while the database takes it and in memory after it failed."""
        try:
            self._check_file()
        except (sqlite3.Error, OSError) as err:
            if self.unsaved is None:
                self._go_on_in_memory(sqlite3.OperationalError(str(err)))
        try:
            with self._db:
                return query(self._db)
        except sqlite3.Error as err:
            if self.unsaved is not None or not storage_failure(err):
                raise
            self._go_on_in_memory(err)
        with self._db:
            return query(self._db)

    def _go_on_in_memory(self, err: sqlite3.Error) -> None:
        """Move to an in-memory copy of the database (its committed rows, so ids go on; an empty one when even
        reading fails) and say why."""
        memory = sqlite3.connect(":memory:")
        memory.row_factory = sqlite3.Row
        try:
            self._db.backup(memory)
        except sqlite3.Error:
            pass  # not even readable: rows the app refers to stayed on disk, so none can be required here
        else:
            memory.execute("PRAGMA foreign_keys=ON")
        memory.executescript(_SCHEMA)
        with contextlib.suppress(sqlite3.Error):
            self._db.close()
        self._db, self._opened = memory, None
        self._moved_to_memory(f"cannot be written ({err})")

    def _moved_to_memory(self, why: str) -> None:
        self.unsaved = HistoryError(
            f"the history database {self.path} {why}; this session is kept in memory only and "
            "is lost when the app closes",
            hint="export the conversation now (ctrl+s), then free disk space or fix the file's permissions, or pass "
            "--db with a writable file next time",
        )
        if self.on_unsaved is not None:
            self.on_unsaved(self.unsaved)

    # --- conversations ------------------------------------------------------------------------------------------
    def create_conversation(self, title: str, *, model: str = "", program: str | None = None) -> int:
        now = self._clock()
        cursor = self._use(
            lambda db: db.execute(
                "INSERT INTO conversations (title, model, program, created, updated) VALUES (?, ?, ?, ?, ?)",
                (title, model, program, now, now),
            )
        )
        return int(cursor.lastrowid or 0)

    def list_conversations(self) -> list[ConversationSummary]:
        rows = self._use(
            lambda db: db.execute(
                """SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n
                   FROM conversations c ORDER BY c.updated DESC, c.id DESC"""
            ).fetchall()
        )
        return [self._summary(row) for row in rows]

    def rename(self, conversation_id: int, title: str) -> None:
        self._use(lambda db: db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id)))

    def set_program(self, conversation_id: int, program: str | None) -> None:
        self._use(
            lambda db: db.execute("UPDATE conversations SET program = ? WHERE id = ?", (program, conversation_id))
        )

    def delete(self, conversation_id: int) -> None:
        self._use(lambda db: db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,)))

    def load(self, conversation_id: int) -> Conversation:
        conversation = self._use(lambda db: self._load(db, conversation_id))
        if conversation is None:
            raise KeyError(conversation_id)
        return conversation

    def _load(self, db: sqlite3.Connection, conversation_id: int) -> Conversation | None:
        row = db.execute(
            """SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n
               FROM conversations c WHERE c.id = ?""",
            (conversation_id,),
        ).fetchone()
        if row is None:
            return None
        messages = []
        for m in db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY position", (conversation_id,)
        ).fetchall():
            tokens = _tokens(db, m["id"])
            content = _pieces_content(db, m["id"])
            status = m["status"]
            if status == "streaming":
                status = "complete" if answer_finished(tokens) else "interrupted"
            messages.append(
                StoredMessage(
                    id=m["id"],
                    role=m["role"],
                    content=json.loads(m["content"]) if content is None else content,
                    status=status,
                    tokens=tokens,
                )
            )
        return Conversation(self._summary(row), messages)

    def recent_prompts(self, limit: int = 200) -> list[str]:
        """The user's last prompts across all conversations, oldest first (seeds the input's up/down history)."""
        rows = self._use(
            lambda db: db.execute(
                "SELECT content FROM messages WHERE role = 'user' ORDER BY created DESC, id DESC LIMIT ?", (limit,)
            ).fetchall()
        )
        prompts = [json.loads(row["content"]) for row in reversed(rows)]
        return [p for p in prompts if isinstance(p, str)]

    # --- messages -----------------------------------------------------------------------------------------------
    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str | list[dict[str, str]],
        *,
        status: MessageStatus = "complete",
    ) -> int:
        now = self._clock()

        def add(db: sqlite3.Connection) -> sqlite3.Cursor:
            (position,) = db.execute(
                "SELECT COALESCE(MAX(position) + 1, 0) FROM messages WHERE conversation_id = ?", (conversation_id,)
            ).fetchone()
            cursor = db.execute(
                "INSERT INTO messages (conversation_id, position, role, content, status, created)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, position, role, json.dumps(content), status, now),
            )
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
            return cursor

        return int(self._use(add).lastrowid or 0)

    def append_tokens(
        self,
        message_id: int,
        first_position: int,
        events: Sequence[TokenEvent],
        pieces: Sequence[ContentPiece] = (),
    ) -> None:
        """Append a batch of an answer's tokens and the content it added (`Reply.pieces_since`), in one
        transaction."""

        def append(db: sqlite3.Connection) -> None:
            db.executemany(
                "INSERT OR REPLACE INTO tokens VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [_token_row(message_id, first_position + i, event) for i, event in enumerate(events)],
            )
            if pieces:
                (seq,) = db.execute(
                    "SELECT COALESCE(MAX(seq) + 1, 0) FROM content_pieces WHERE message_id = ?", (message_id,)
                ).fetchone()
                db.executemany(
                    "INSERT INTO content_pieces VALUES (?, ?, ?, ?, ?)",
                    [(message_id, seq + i, p.part, p.type, p.text) for i, p in enumerate(pieces)],
                )

        self._use(append)

    def finish_message(self, message_id: int, status: MessageStatus, content: Content | None = None) -> None:
        """Set the message's status; with `content`, write its final content (once) in place of its pieces."""

        def finish(db: sqlite3.Connection) -> None:
            if content is not None:
                db.execute("UPDATE messages SET content = ? WHERE id = ?", (json.dumps(content), message_id))
                db.execute("DELETE FROM content_pieces WHERE message_id = ?", (message_id,))
            db.execute("UPDATE messages SET status = ? WHERE id = ?", (status, message_id))

        self._use(finish)

    def delete_message(self, message_id: int) -> None:
        self._use(lambda db: db.execute("DELETE FROM messages WHERE id = ?", (message_id,)))

    # --- internals ----------------------------------------------------------------------------------------------
    @staticmethod
    def _summary(row: sqlite3.Row) -> ConversationSummary:
        return ConversationSummary(
            id=row["id"],
            title=row["title"],
            model=row["model"],
            program=row["program"],
            created=row["created"],
            updated=row["updated"],
            messages=row["n"],
        )


# Connections to a history database whose path another file took (`HistoryStore._check_file`): never closed.
_KEPT_OPEN: list[sqlite3.Connection] = []


def _file_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`, or None when there is none."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def _pieces_content(db: sqlite3.Connection, message_id: int) -> Content | None:
    """A message's content rebuilt from its appended pieces (None: it has none, `messages.content` holds it)."""
    rows = db.execute(
        "SELECT part, type, text FROM content_pieces WHERE message_id = ? ORDER BY seq", (message_id,)
    ).fetchall()
    if not rows:
        return None
    parts: list[dict[str, str]] = []
    for row in rows:
        if row["part"] >= len(parts):
            parts.append({"type": row["type"], "text": ""})
        parts[row["part"]]["text"] += row["text"]
    return parts_content(parts)


def _tokens(db: sqlite3.Connection, message_id: int) -> list[TokenEvent]:
    rows = db.execute("SELECT * FROM tokens WHERE message_id = ? ORDER BY position", (message_id,))
    return [_token_event(row) for row in rows]


def _readable(path: Path) -> sqlite3.Connection:
    """A read-only connection to what `path` holds, to copy into memory when it cannot be written. A WAL database in
    a directory that cannot be written is read as immutable (its shared-memory file cannot be made; nobody can be
    writing it either)."""
    for flags in ("mode=ro", "mode=ro&immutable=1"):
        db = sqlite3.connect(f"{path.resolve().as_uri()}?{flags}", uri=True, timeout=0)  # writes waited already
        try:
            db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return db
        except sqlite3.Error:
            db.close()
    return sqlite3.connect(":memory:")


def _token_row(message_id: int, position: int, event: TokenEvent) -> tuple[Any, ...]:
    tool = event.tool
    return (
        message_id,
        position,
        event.token,
        event.text,
        int(event.forced),
        int(event.special),
        event.zone,
        json.dumps(list(event.tags)),
        None if event.router_probs is None else json.dumps([round(p, 4) for p in event.router_probs]),
        None if event.computed is None else "".join("1" if c else "0" for c in event.computed),
        None if tool is None else json.dumps([tool.kind, tool.tool, tool.expression, tool.output]),
        event.finish_reason,
        event.error,
    )


def _token_event(row: sqlite3.Row) -> TokenEvent:
    tool = None
    if row["tool"] is not None:
        kind, name, expression, output = json.loads(row["tool"])
        tool = ToolEvent(kind, name, expression, output)
    return TokenEvent(
        row=0,
        token=row["token"],
        forced=bool(row["forced"]),
        text=row["text"],
        special=bool(row["special"]),
        tags=tuple(json.loads(row["tags"])),
        zone=row["zone"],
        router_probs=None if row["router_probs"] is None else tuple(json.loads(row["router_probs"])),
        computed=None if row["computed"] is None else tuple(c == "1" for c in row["computed"]),
        tool=tool,
        finish_reason=row["finish_reason"],
        error=row["error"],
    )


SQLITE_HEADER = b"SQLite format 3\x00"
_COLUMNS = {
    "conversations": {"id", "title", "model", "program", "created", "updated"},
    "messages": {"id", "conversation_id", "position", "role", "content", "status", "created"},
    "tokens": {"message_id", "position", "token", "text", "forced", "special", "zone", "tags", "router_probs",
               "computed", "tool", "finish_reason", "error"},
    "content_pieces": {"message_id", "seq", "part", "type", "text"},
}


def history_problem(path: Path, *, timeout: float = 5.0) -> tuple[str, str] | None:
    """Why `path` cannot be used as this app's history, without changing it: ("damaged" | "foreign", detail), or
    None when it is fine (missing, empty, or a history database)."""
    try:
        if not path.exists() or path.stat().st_size == 0:
            return None
        with path.open("rb") as handle:
            header = handle.read(len(SQLITE_HEADER))
    except OSError as err:
        raise HistoryError(
            f"cannot read the history database {path}: {err.strerror}",
            hint="pass --db with a readable file, or fix the permissions",
        ) from None
    if header != SQLITE_HEADER:
        return "damaged", "it is not an SQLite database"
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout)
    except sqlite3.OperationalError:
        return None  # it cannot be opened here (permissions, a lock), which is not damage: the store goes on in memory
    except sqlite3.Error as err:
        return "damaged", str(err)
    try:
        check = db.execute("PRAGMA quick_check(1)").fetchone()
        if not check or check[0] != "ok":
            return "damaged", f"SQLite's integrity check says {check[0] if check else 'nothing'}"
        tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            if table.startswith("sqlite_"):
                continue
            if table not in _COLUMNS:
                return "foreign", f"it has a table {table!r} that chatapp does not write"
            columns = {row[1] for row in db.execute(f'PRAGMA table_info("{table}")')}
            if missing := sorted(_COLUMNS[table] - columns):
                return "foreign", f"its table {table!r} has no column {missing[0]!r}"
    except sqlite3.OperationalError:
        return None  # read-only without its shared-memory file, or locked: not damage (see above)
    except sqlite3.Error as err:
        return "damaged", str(err)
    except UnicodeDecodeError:  # SQLite's report on a damaged file quoted bytes that are not text
        return "damaged", "SQLite's integrity check reports damage it cannot name"
    finally:
        db.close()
    return None


def open_history(
    path: Path, *, clock: Callable[[], float] = time.time, move_aside: bool = True, timeout: float = 5.0
) -> HistoryStore:
    """The history store at `path`, never deleting or overwriting what is there.

    A directory, or another program's SQLite database, is refused with the fix. A damaged file (not SQLite, failing
    SQLite's check) is renamed to `NAME.damaged-TIMESTAMP` with its -wal/-shm files and a fresh database started,
    with `store.notice` saying so, when `move_aside` (the default location); refused otherwise (a `--db` the user
    named is more likely a wrong path than a database to replace).
    """
    path = Path(path)
    if path.is_dir():
        raise HistoryError(
            f"the history database {path} is a directory",
            hint="pass --db with a file path, or move the directory away",
        )
    problem = history_problem(path, timeout=timeout)
    notice = None
    if problem is not None:
        kind, detail = problem
        if kind == "foreign" or not move_aside:
            raise HistoryError(
                f"{path} is not a chatapp history database ({detail}); it was left untouched",
                hint="pass --db with another file (a new one is created), or move that file away",
            )
        moved = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        try:
            for suffix in ("", "-wal", "-shm"):
                side = Path(f"{path}{suffix}")
                if side.exists():
                    side.rename(f"{moved}{suffix}")
        except OSError as err:
            raise HistoryError(
                f"the history database {path} is damaged ({detail}) and could not be moved aside: {err.strerror}",
                hint=f"move {path} away yourself, or pass --db with another file",
            ) from None
        notice = f"the history database {path} was damaged ({detail}); it was moved to {moved} and a new one started"
    store = HistoryStore(path, clock=clock, timeout=timeout)
    store.notice = notice
    return store
