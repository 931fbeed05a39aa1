"""The engine in its own process: the same events as the in-process backend, cancellation, errors, a dead child."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatapp.errors import ChatappError, ConstraintError, ModelDirError, ProgramError
from chatapp.settings import GenerationSettings
from chatapp.ui import make_app
from chatapp.ui.app import close_backend
from chatapp.ui.backend import EngineBackend
from chatapp.ui.process import SEND_INTERVAL, ProcessBackend, _pump
from tests.ui.conftest import SIZE, FixedClock, send_and_wait, wait_until

GREEDY = GenerationSettings(max_tokens=12)
SAMPLED = GenerationSettings(max_tokens=10, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def remote(routed_model_dir: Path) -> Iterator[ProcessBackend]:
    """One engine process for the module (spawning one costs a few seconds: a fresh interpreter loads torch)."""
    with ProcessBackend(routed_model_dir, device="cpu") as backend:
        yield backend


@pytest.fixture
def local(routed_model_dir: Path) -> EngineBackend:
    return EngineBackend.load(routed_model_dir, device="cpu")


def _events(stream) -> list:
    return [event for step in stream for event in step.tokens]


def test_streams_exactly_what_the_in_process_backend_does(remote: ProcessBackend, local: EngineBackend) -> None:
    assert remote.info == local.info and remote.builtin_programs() == local.builtin_programs()
    for backend in (remote, local):
        backend.new_session()
        backend.configure(SAMPLED, None)
    turns = [
        (lambda b: b.send("What is 37*45?")),
        (lambda b: b.send("And the letters in strawberry?")),  # the session continues the conversation
        (lambda b: b.regenerate()),
        (lambda b: b.edit_last("How many r in strawberry?")),
    ]
    for turn in turns:
        assert _events(turn(remote)) == _events(turn(local))


def test_cancel_ends_the_stream_with_the_steps_in_flight_and_the_session_keeps_them(
    remote: ProcessBackend, local: EngineBackend
) -> None:
    for backend in (remote, local):
        backend.new_session()
        backend.configure(GenerationSettings(max_tokens=60), None)
    stream = remote.send("Tell me a story.")
    shown = [event for _, step in zip(range(3), stream, strict=False) for event in step.tokens]
    remote.cancel(stream)
    shown += _events(stream)  # the steps already in flight, then the end
    assert 3 <= len(shown) < 60 and all(event.finish_reason is None for event in shown)
    # The in-process backend stopped after the same tokens holds the same partial answer: the conversations agree.
    stream = local.send("Tell me a story.")
    partial = [event for _, step in zip(range(len(shown)), stream, strict=False) for event in step.tokens]
    local.cancel(stream)
    assert partial == shown
    assert _events(remote.send("Go on.")) == _events(local.send("Go on."))


def test_a_stream_closed_early_is_stopped_and_drained(remote: ProcessBackend) -> None:
    remote.new_session()
    remote.configure(GenerationSettings(max_tokens=60), None)
    stream = remote.send("Tell me a story.")
    next(stream)
    stream.close()
    assert _events(remote.send("Again"))  # the pipe holds nothing of the old answer


def test_a_stream_closed_before_it_was_read_is_stopped_too(remote: ProcessBackend) -> None:
    remote.new_session()
    remote.configure(GenerationSettings(max_tokens=40), None)
    remote.send("Tell me a story.").close()  # never iterated, but the child is already generating it
    events = _events(remote.send("Go on."))  # not refused as "still streaming", and nothing of the old answer
    assert events and events[-1].finish_reason is not None
    assert sum(event.finish_reason is not None for event in events) == 1


def test_user_errors_cross_the_process_boundary_with_their_type_and_leave_state_alone(remote: ProcessBackend) -> None:
    remote.new_session()
    remote.configure(GREEDY, "[0-9]+")
    with pytest.raises(ConstraintError, match=r"\(\[0-9\]"):
        remote.configure(GenerationSettings(max_tokens=3), "([0-9]")
    assert remote.settings == GREEDY and remote.constraint == "[0-9]+"
    with pytest.raises(ProgramError, match=r"missing\.toml"):
        remote.switch_program("missing.toml")
    assert remote.program is None
    info = remote.switch_program("chat")
    assert info is not None and info.name == "chat" and info.tags and remote.program == info
    assert remote.switch_program(None) is None
    remote.configure(GREEDY, None)
    assert _events(remote.send("Hi"))  # still serving


def test_a_program_compile_in_the_engine_process_can_be_cancelled(remote: ProcessBackend, tmp_path: Path) -> None:
    """Issue 17: esc in F3 (or quitting) stops a long compile in the engine process; the old program stays and the
    process goes on serving."""
    import threading

    from chatapp.ttfa.compiler import ProgramCancelled
    from tests.ui.test_program_compile import slow_program

    remote.switch_program("chat")
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(ProgramCancelled, match=r"slow\.toml was cancelled"):
        remote.switch_program(str(slow_program(tmp_path / "slow.toml")), cancel)
    assert time.monotonic() - started < 120  # a hang guard: the compile alone takes minutes (its budget: 10 s CPU)
    assert remote.program is not None and remote.program.name == "chat"
    assert remote.switch_program(None) is None  # the stray "cancel" was skipped; calls line up again
    remote.configure(GREEDY, None)
    assert _events(remote.send("Hi"))


def test_a_second_request_while_streaming_is_refused(remote: ProcessBackend) -> None:
    remote.new_session()
    remote.configure(GREEDY, None)
    stream = remote.send("Hello")
    next(stream)
    with pytest.raises(RuntimeError, match="still streaming"):
        remote.send("Again")
    stream.close()
    assert _events(remote.send("Again"))


def test_a_broken_model_directory_is_reported_when_the_engine_has_tried_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    backend = ProcessBackend(tmp_path, device="cpu")  # returns at once: the child loads while the app draws
    try:
        assert not backend.ready and backend.model_path == str(tmp_path)
        with pytest.raises(ModelDirError, match=str(tmp_path)):
            backend.wait_ready()
        assert not backend.ready and backend.pid is None
        with pytest.raises(ModelDirError, match=str(tmp_path)):  # and so is every later use
            backend.new_session()
    finally:
        backend.close()


def test_an_engine_that_does_not_load_in_time_is_stopped(routed_model_dir: Path) -> None:
    backend = ProcessBackend(routed_model_dir, device="cpu", start_timeout=0.2)
    try:
        assert backend.wait_ready(0.0) is False  # not yet, and not an error yet
        with pytest.raises(ModelDirError, match=r"did not load .* within"):
            backend.wait_ready()
        assert backend.pid is None
    finally:
        backend.close()


def test_an_engine_process_killed_while_loading_is_reported(routed_model_dir: Path) -> None:
    backend = ProcessBackend(routed_model_dir, device="cpu")
    try:
        os.kill(backend._process.pid, signal.SIGKILL)
        with pytest.raises(ChatappError, match="engine process stopped"):
            backend.wait_ready()
    finally:
        backend.close()


def test_closing_while_the_model_loads_stops_the_engine_at_once(routed_model_dir: Path) -> None:
    backend = ProcessBackend(routed_model_dir, device="cpu")
    started = time.monotonic()
    backend.close()
    assert backend.pid is None and time.monotonic() - started < 5
    with pytest.raises(ChatappError):
        backend.wait_ready()


def test_a_start_up_program_is_switched_to_as_the_engine_loads(routed_model_dir: Path, tmp_path: Path) -> None:
    with ProcessBackend(routed_model_dir, device="cpu", program="think") as backend:
        assert backend.wait_ready()
        assert backend.program is not None and backend.program.name == "think" and backend.program.tags
    missing = tmp_path / "missing.toml"
    with (
        ProcessBackend(routed_model_dir, device="cpu", program=str(missing)) as backend,
        pytest.raises(ProgramError, match=r"missing\.toml"),
    ):
        backend.wait_ready()


def test_a_dead_engine_process_is_reported_not_hung_on(routed_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "logs" / "engine.log"
    backend = ProcessBackend(routed_model_dir, device="cpu", log_path=log)
    try:
        assert backend.wait_ready()
        assert backend.pid is not None and log.is_file()  # the child's output goes there, not to the terminal
        os.kill(backend.pid, signal.SIGKILL)
        with pytest.raises(ChatappError, match=f"engine process stopped.*{re.escape(str(log))}"):
            _events(backend.send("Hello"))
    finally:
        backend.close()
    assert backend.pid is None


def _print_everywhere(log: str) -> None:
    """Run in a spawned child: redirect as the engine process does, then write through Python and the raw fds."""
    from chatapp.ui.process import _redirect_output

    _redirect_output(log)
    print("from python stdout")
    print("from python stderr", file=sys.stderr)
    os.write(2, b"from fd 2 (C++ code writes here)\n")


def test_the_engine_process_output_goes_to_the_log_appended(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "engine.log"
    log.parent.mkdir()
    log.write_text("earlier run\n")
    child = multiprocessing.get_context("spawn").Process(target=_print_everywhere, args=(str(log),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier run"  # appended, never truncated
    assert set(lines[1:]) == {"from python stdout", "from python stderr", "from fd 2 (C++ code writes here)"}


def test_an_engine_log_that_cannot_be_written_costs_only_the_log(tmp_path: Path, capfd) -> None:
    """A directory where the log should be: the engine runs on, its output dropped, none of it on the terminal."""
    log = tmp_path / "engine.log"
    log.mkdir()
    child = multiprocessing.get_context("spawn").Process(target=_print_everywhere, args=(str(log),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert list(log.iterdir()) == []
    shown = capfd.readouterr()
    assert "from" not in shown.out + shown.err  # the terminal the TUI draws on got none of it


@pytest.mark.asyncio
async def test_the_app_on_an_engine_process(routed_model_dir: Path, local: EngineBackend, tmp_path: Path) -> None:
    """`chatapp run`'s default: make_app spawns the engine process; the TUI shows what the engine generates."""
    app = make_app(model_dir=routed_model_dir, device="cpu", db_path=tmp_path / "h.sqlite3", clock=FixedClock())
    try:
        app.backend.configure(GREEDY, None)
        async with app.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, "What is 37*45?")
            shown = app.transcript.answers()[-1].events
    finally:
        close_backend(app.backend)
    local.configure(GREEDY, None)
    assert shown == _events(local.send("What is 37*45?"))


@pytest.mark.asyncio
async def test_the_app_on_an_engine_that_cannot_load_closes_with_the_error(routed_model_dir: Path, tmp_path: Path):
    """The model directory passes the CLI's quick look but fails to load in the engine process: the app, already
    drawn, closes and leaves the error to the CLI."""
    import shutil

    broken = Path(shutil.copytree(routed_model_dir, tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    app = make_app(model_dir=broken, device="cpu", db_path=tmp_path / "h.sqlite3", clock=FixedClock())
    try:
        async with app.run_test(size=SIZE) as pilot:
            assert app.loading
            await wait_until(pilot, lambda: app.engine_error is not None, timeout=120, what="the load error")
    finally:
        close_backend(app.backend)
    assert isinstance(app.engine_error, ModelDirError) and app.return_code == 1
    assert "num_attention_heads must be a positive integer" in str(app.engine_error)


def test_run_prints_what_stopped_the_engine_and_exits_non_zero(routed_model_dir: Path, tmp_path: Path, monkeypatch):
    """`chatapp run` end to end (the app headless): the error is printed as every CLI error is, no traceback."""
    import shutil

    from textual.app import App
    from typer.testing import CliRunner

    from chatapp.cli import app as cli
    from chatapp.ui.app import ChatApp

    monkeypatch.setattr(ChatApp, "run", lambda self: App.run(self, headless=True, size=SIZE))
    broken = Path(shutil.copytree(routed_model_dir, tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 0}))
    result = CliRunner().invoke(cli, ["run", "--model", str(broken), "--device", "cpu", "--db", str(tmp_path / "h")])
    assert result.exit_code == 1, result.output
    assert "max_position_embeddings must be a positive integer" in result.output
    assert "Traceback" not in result.output


class _ScriptedStream:
    """A StepStream stand-in: `steps` fake steps (`tokens` set from `first_tokens` on), `delay` seconds apart,
    raising `error` after the last one if given."""

    def __init__(self, steps: int, delay: float, first_tokens: int = 1, error: Exception | None = None) -> None:
        self.steps, self.delay, self.first_tokens, self.error = steps, delay, first_tokens, error
        self.closed = False

    def __iter__(self):
        from types import SimpleNamespace

        for index in range(self.steps):
            if self.delay:
                time.sleep(self.delay)
            yield SimpleNamespace(index=index, tokens=[index] if index >= self.first_tokens else [])
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed = True


def _pumped(stream: _ScriptedStream) -> list[tuple[str, object]]:
    parent, child = multiprocessing.Pipe()
    _pump(child, None, stream)
    messages = []
    while parent.poll():
        messages.append(parent.recv())
    return messages


def test_the_child_sends_steps_in_batches_with_the_first_tokens_at_once() -> None:
    stream = _ScriptedStream(steps=400, delay=0.0, first_tokens=2)
    messages = _pumped(stream)
    assert messages[-1] == ("end", None) and stream.closed
    batches = [payload for kind, payload in messages[:-1]]
    assert all(kind == "steps" for kind, _ in messages[:-1])
    assert [step.index for batch in batches for step in batch] == list(range(400))  # every step, in order
    # Until the answer's first tokens, every step goes alone (the user is waiting); then they are batched.
    assert [len(batch) for batch in batches[:3]] == [1, 1, 1]
    assert len(batches) < 50


def test_a_slow_engine_sends_every_step_without_waiting_for_the_next() -> None:
    messages = _pumped(_ScriptedStream(steps=5, delay=SEND_INTERVAL))
    assert [len(payload) for kind, payload in messages[:-1]] == [1, 1, 1, 1, 1]


def test_steps_before_an_error_are_sent_before_it() -> None:
    messages = _pumped(_ScriptedStream(steps=50, delay=0.0, error=ConstraintError("bad")))
    kind, error = messages[-1]
    assert kind == "error" and isinstance(error, ConstraintError)
    assert [step.index for _, batch in messages[:-1] for step in batch] == list(range(50))
