"""The app on the real engine: a tiny random STT checkpoint, the embedded default model, and `chatapp run` errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp.cli import app as cli
from chatapp.engine.reply import Reply
from chatapp.errors import ConstraintError, ProgramError
from chatapp.models import registry
from chatapp.settings import GenerationSettings
from chatapp.ui import make_app
from chatapp.ui.app import close_backend
from chatapp.ui.backend import EngineBackend
from chatapp.ui.history import HistoryStore
from tests.ui.conftest import SIZE, FixedClock, send_and_wait, wait_until


@pytest.fixture(scope="module")
def tiny_model_dir(routed_model_dir: Path) -> Path:
    return routed_model_dir


GREEDY = GenerationSettings(max_tokens=12)


def _bare_engine_answer(model_dir: Path, text: str) -> list:
    """The oracle: the same turn through a bare ChatSession, no UI."""
    backend = EngineBackend.load(model_dir, device="cpu")
    session = backend._engine.session()
    return [event for step in session.send(text, GREEDY) for event in step.tokens]


@pytest.mark.asyncio
async def test_tui_shows_exactly_what_the_engine_generates(tiny_model_dir, tmp_path):
    backend = EngineBackend.load(tiny_model_dir, device="cpu")
    backend.configure(GREEDY, None)
    app = make_app(backend=backend, db_path=tmp_path / "h.sqlite3", clock=FixedClock(), cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "What is 37*45?")
        shown = app.transcript.answers()[-1].events
        assert shown == _bare_engine_answer(tiny_model_dir, "What is 37*45?")
        assert backend.info.stt_layers == (1, 3)
        assert all(e.router_probs is None or len(e.router_probs) == 2 for e in shown)
        # The session now holds the exchange, so the next turn continues the conversation.
        assert backend._session.messages[-1] == {"role": "assistant", "content": Reply.of(shown).content}


async def _resume_latest(pilot) -> None:
    """Open the history screen and resume the most recent conversation."""
    app = pilot.app
    await pilot.press("f4")
    await wait_until(pilot, lambda: app.screen.query("#conversations"))
    await pilot.press("enter")
    await wait_until(pilot, lambda: app.conversation_id is not None and app.transcript.answers())


@pytest.mark.asyncio
async def test_resumed_chat_can_be_regenerated_and_edited_at_once(tiny_model_dir, tmp_path):
    """Resume from history, then regenerate / edit before sending anything: the session re-prefills the restored
    conversation, so the answers are exactly what a bare session gives for the same turn."""
    db = tmp_path / "h.sqlite3"
    first = make_app(backend=_greedy_backend(tiny_model_dir), db_path=db, clock=FixedClock(), cursor_blink=False)
    async with first.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "What is 37*45?")
        original = list(first.transcript.answers()[-1].events)

    app = make_app(backend=_greedy_backend(tiny_model_dir), db_path=db, clock=FixedClock(), cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        await _resume_latest(pilot)
        resumed = app.transcript.answers()[-1]
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: resumed not in app.transcript.answers(), what="the old answer to go")
        await wait_until(pilot, lambda: not app.is_generating and app.transcript.answers(), what="the regeneration")
        await pilot.pause()
        (regenerated,) = app.transcript.answers()
        assert regenerated.status == "complete"
        assert regenerated.events == original  # greedy: the same turn gives the same answer

        await pilot.press("ctrl+e")
        app.query_one("#prompt").text = "Paris"
        await pilot.press("enter")
        await wait_until(pilot, lambda: not app.is_generating and not app.editing, what="the edited turn")
        await pilot.pause()
        edited = app.transcript.answers()[-1]
        assert edited.status == "complete"
        assert edited.events == _bare_engine_answer(tiny_model_dir, "Paris")
    stored = HistoryStore(db).load(1).messages
    assert [(m.role, m.content) for m in stored] == [("user", "Paris"), ("assistant", Reply.of(edited.events).content)]


def _greedy_backend(model_dir: Path) -> EngineBackend:
    backend = EngineBackend.load(model_dir, device="cpu")
    backend.configure(GREEDY, None)
    return backend


def test_engine_backend_validates_programs_and_constraints(tiny_model_dir, tmp_path):
    backend = EngineBackend.load(tiny_model_dir, device="cpu")
    assert set(backend.builtin_programs()) >= {"chat", "think", "calc", "json"}
    program = backend.switch_program("calc")
    assert program is not None and (program.name, program.tags) == ("calc", ("tool", "answer"))
    bad = tmp_path / "bad.toml"
    bad.write_text("this is [not toml")
    with pytest.raises(ProgramError):
        backend.switch_program(str(bad))
    assert backend.program == program  # unchanged after a failed switch
    with pytest.raises(ConstraintError):
        backend.configure(GREEDY, "[a-z")
    backend.configure(GREEDY, "[a-z]+")
    assert backend.constraint == "[a-z]+"


def test_run_reports_a_bad_model_dir(tmp_path):
    result = CliRunner().invoke(cli, ["run", "--model", str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert "does not exist" in result.output and "Traceback" not in result.output


def test_run_reports_a_bad_program_file(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("zones = [[[")
    result = CliRunner().invoke(cli, ["run", "--model", str(tiny_model_dir), "--program", str(bad)])
    assert result.exit_code == 1
    assert "bad.toml" in result.output and "Traceback" not in result.output


DEFAULT_MODEL = registry.tiny_model_dir()


@pytest.mark.skipif(
    not (DEFAULT_MODEL / "config.json").is_file(),
    reason="the embedded default model (chatapp/models/tiny/) has not been trained yet: `make train-default`",
)
@pytest.mark.asyncio
async def test_default_model_answers_headless(tmp_path):
    """`chatapp run` with no arguments: the default model answers a short greedy question in the TUI."""
    app = make_app(db_path=tmp_path / "h.sqlite3", clock=FixedClock(), cursor_blink=False)  # an engine process
    try:
        app.backend.configure(GenerationSettings(max_tokens=24), None)
        async with app.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, "What is the capital of France?")
            answer = app.transcript.answers()[-1]
    finally:
        close_backend(app.backend)
    assert answer.status == "complete"
    assert answer.events and Reply.of(answer.events).content
    assert answer.events == _bare_engine_answer(DEFAULT_MODEL, "What is the capital of France?")[: len(answer.events)]


def test_compare_last_regenerates_with_routing_off_and_keeps_the_session(tiny_model_dir) -> None:
    """The routing-off answer is what a fresh routing-off generation of the same turn gives, and the session's
    conversation is untouched; with routing already off the two answers are identical."""
    backend = EngineBackend.load(tiny_model_dir, device="cpu")
    backend.configure(GenerationSettings(max_tokens=8, logprobs=2), None)
    routed = [e for step in backend.send("What is 37*45?") for e in step.tokens]
    messages = [dict(m) for m in backend._session.messages]
    unrouted = [e for step in backend.compare_last() for e in step.tokens]
    assert backend._session.messages == messages
    assert unrouted and all(e.computed is None and e.logprobs is not None for e in unrouted)
    assert all(e.computed is not None for e in routed[:-1])
    backend.configure(GenerationSettings(max_tokens=8, routing="off"), None)
    first = [e.token for step in backend.regenerate() for e in step.tokens]
    assert [e.token for step in backend.compare_last() for e in step.tokens] == first


@pytest.mark.asyncio
async def test_the_tui_starts_from_the_models_own_sampling_and_says_where_each_value_comes_from(
    tiny_model_dir, tmp_path
):
    import json
    import shutil

    from chatapp.ui.screens.settings import SettingsScreen

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = model_dir / "generation_config.json"
    given = json.loads(config.read_text()) if config.is_file() else {}
    config.write_text(json.dumps({**given, "do_sample": True, "temperature": 0.6, "min_p": 0.05}))
    backend = EngineBackend.load(model_dir, device="cpu")
    assert (backend.settings.temperature, backend.settings.min_p, backend.settings.top_k) == (0.6, 0.05, 0)
    backend.configure(backend.settings.with_(top_k=40), None)
    app = make_app(backend=backend, db_path=tmp_path / "h.sqlite3", clock=FixedClock(), cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen) and app.screen.query(".source"))
        sources = [str(label.render()) for label in app.screen.query(".source")]
        assert sources[:5] == ["model's", "set here", "built-in", "model's", "built-in"]
