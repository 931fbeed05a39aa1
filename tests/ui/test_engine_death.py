"""Issue 17: an answer that ended before the engine process was killed is shown (and stored) as finished; only a
genuinely unfinished answer is interrupted. A dead engine process is a notification, never a traceback."""

from __future__ import annotations

import pytest

from chatapp.errors import ChatappError
from chatapp.ui.history import HistoryStore
from tests.ui.conftest import SIZE, send_and_wait, wait_until
from tests.ui.scripted import ScriptedBackend, greeting

pytestmark = pytest.mark.asyncio

DIED = ChatappError(
    "the engine process stopped (exit code -9); its output is in engine.log", hint="start chatapp again"
)


async def test_an_answer_finished_before_the_engine_died_is_shown_finished(build_app, tmp_path):
    backend = ScriptedBackend([greeting()])
    backend.fail_after = DIED  # every step (the stop token included) arrives, then the pipe breaks
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        answer = app.transcript.answers()[-1]
        assert answer.events == greeting()
        assert answer.status == "complete"
        assert answer._status_text == ""  # no "interrupted", no "error"
        # The engine's death is still reported, once, beside the answer.
        assert any("engine process stopped" in n.message for n in app._notifications)
        # ctrl+n on a dead engine process: a notification, not a traceback.
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.is_running
        assert any(n.title == "Cannot start the conversation" for n in app._notifications)
    stored = HistoryStore(tmp_path / "history.sqlite3").load(1).messages[1]
    assert stored.status == "complete"


async def test_an_answer_cut_by_the_engine_dying_is_not_finished(build_app, tmp_path):
    backend = ScriptedBackend([greeting()[:4]])  # no stop token: the engine died mid-answer
    backend.fail_after = DIED
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        answer = app.transcript.answers()[-1]
        assert answer.status == "error" and "engine process stopped" in answer._status_text
    assert HistoryStore(tmp_path / "history.sqlite3").load(1).messages[1].status == "interrupted"


async def test_history_reads_a_finished_answer_left_streaming_as_complete(tmp_path):
    """The app died between the answer's last token and its status write: the tokens say it had finished."""
    store = HistoryStore(tmp_path / "history.sqlite3")
    conversation = store.create_conversation("hi", model="m")
    store.add_message(conversation, "user", "hi")
    finished = store.add_message(conversation, "assistant", "", status="streaming")
    store.append_tokens(finished, 0, greeting())
    cut = store.add_message(conversation, "assistant", "", status="streaming")
    store.append_tokens(cut, 0, greeting()[:3])
    statuses = [m.status for m in store.load(conversation).messages]
    store.close()
    assert statuses == ["complete", "complete", "interrupted"]


async def test_f2_and_f3_wait_for_the_answer(build_app):
    backend = ScriptedBackend([greeting()])
    backend.hold_after = 2
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        app.query_one("#prompt").insert("hi")
        app.query_one("#prompt").focus()
        await pilot.press("enter")
        await wait_until(pilot, backend.held.is_set)
        for key in ("f2", "f3"):
            await pilot.press(key)
            await pilot.pause()
            assert app.screen is app.screen_stack[0]
        backend.release.set()
        await wait_until(pilot, lambda: not app.is_generating)
