"""The SQLite history store: round trips, incremental writes, crash recovery, rename and delete."""

from __future__ import annotations

import sqlite3

from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.ui.export import export_conversation, to_json, to_markdown
from chatapp.ui.history import HistoryStore
from chatapp.ui.tokens import message_content
from tests.ui.conftest import FixedClock
from tests.ui.scripted import calculator_answer, greeting, think_answer


def _store(tmp_path) -> HistoryStore:
    return HistoryStore(tmp_path / "h.sqlite3", clock=FixedClock())


def test_wal_mode_and_round_trip(tmp_path):
    store = _store(tmp_path)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    cid = store.create_conversation("maths", model="m", program="calc")
    store.add_message(cid, "user", "what is 37*45?")
    events = calculator_answer()
    mid = store.add_message(cid, "assistant", "", status="streaming")
    store.append_tokens(mid, 0, events, message_content(events))
    store.finish_message(mid, "complete")
    store.close()

    conversation = HistoryStore(tmp_path / "h.sqlite3").load(cid)
    assert conversation.summary.title == "maths" and conversation.summary.program == "calc"
    user, assistant = conversation.messages
    assert user.chat_message() == {"role": "user", "content": "what is 37*45?"}
    assert assistant.status == "complete"
    assert assistant.content == message_content(events)
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
    written = 0
    for size in batch_sizes:
        batch = events[written : written + size]
        if not batch:
            break
        store.append_tokens(mid, written, batch, message_content(events[: written + len(batch)]))
        written += len(batch)
    stored = store.load(cid).messages[0]
    assert [t.token for t in stored.tokens] == [e.token for e in events[:written]]
    assert stored.content == message_content(events[:written])


def test_streaming_message_reads_back_as_interrupted(tmp_path):
    """A process killed mid-answer leaves a `streaming` row: the partial answer is kept and marked interrupted."""
    store = _store(tmp_path)
    cid = store.create_conversation("hi")
    mid = store.add_message(cid, "assistant", "", status="streaming")
    partial = greeting()[:4]
    store.append_tokens(mid, 0, partial, message_content(partial))
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
    store.append_tokens(mid, 0, greeting(), "x")
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
    mid = store.add_message(cid, "assistant", message_content(events))
    store.append_tokens(mid, 0, events, message_content(events))
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
