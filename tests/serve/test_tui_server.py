"""`chatapp run --server URL`: the TUI over a running server shows what it shows over the engine in its own process:
the same tokens, forced flags, per-layer routing (the heatmap), tool events and log-probs, from the stream's
extension field; and a second turn continues the conversation."""

from __future__ import annotations

import pytest

from chatapp.engine.reply import Reply
from chatapp.errors import SettingsError
from chatapp.settings import GenerationSettings
from chatapp.ui import make_app
from chatapp.ui.remote import ServerBackend
from tests.ui.conftest import SIZE, FixedClock, send_and_wait

GREEDY = GenerationSettings(max_tokens=24, logprobs=3)


def shown_fields(event) -> tuple:
    logprobs = event.logprobs
    return (
        event.token,
        event.forced,
        event.text,
        event.special,
        event.router_probs,
        event.computed,
        event.tool,
        event.finish_reason,
        None if logprobs is None else (logprobs.logprob, logprobs.entropy, logprobs.top),
    )


@pytest.mark.asyncio
async def test_the_tui_over_a_server_shows_what_the_engine_generates(served, tmp_path) -> None:
    backend = ServerBackend(served.root)
    backend.configure(GREEDY, None)
    assert backend.info.stt_layers == tuple(served.engine.stt_layers)
    engine = served.engine
    expected = [e for step in engine.session().send("What is 2+3?", GREEDY) for e in step.tokens]
    # The second turn's oracle is the whole conversation prefilled at once, as the server gets it (a local session
    # prefills only the new turn into the cache it kept: the same tokens, float32 sums in another order).
    conversation = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": Reply.of(expected, engine.tool_markers).content},
        {"role": "user", "content": "And 3+4?"},
    ]
    ids = engine.chat_format.render_for_completion(conversation)
    expected_next = [e for step in engine.generate([ids], GREEDY) for e in step.tokens]

    app = make_app(backend=backend, db_path=tmp_path / "h.sqlite3", clock=FixedClock(), cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "What is 2+3?")
        shown = app.transcript.answers()[-1].events
        assert [shown_fields(e) for e in shown] == [shown_fields(e) for e in expected]
        assert any(e.forced for e in shown) and any(e.tool for e in shown)
        await send_and_wait(pilot, "And 3+4?")
        shown = app.transcript.answers()[-1].events
        assert [shown_fields(e) for e in shown] == [shown_fields(e) for e in expected_next]


def test_what_needs_the_model_here_is_refused_with_the_reason(served) -> None:
    backend = ServerBackend(served.root)
    with pytest.raises(SettingsError, match="TTFA programs"):
        backend.switch_program("think")
    with pytest.raises(SettingsError, match="regex"):
        backend.configure(GREEDY, "[0-9]+")
    with pytest.raises(SettingsError, match="routing"):
        backend.compare_last()
