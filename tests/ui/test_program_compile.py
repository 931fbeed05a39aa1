"""F3 compiles a program off the UI thread (issue 17): the app keeps answering keys while a program compiles, esc
cancels the compile, ctrl+q quits at once, and a program over the compile budget is refused with a notification
naming the file and the fix. The programs compile for real (the TTFA compiler and its budget, the tiny model's
tokenizer); only the chat is scripted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from chatapp.models.registry import tiny_model_dir
from chatapp.ui.screens.program import ProgramScreen
from chatapp.ui.widgets.prompt import PromptInput
from tests.ui.conftest import SIZE, wait_until
from tests.ui.scripted import ScriptedBackend

pytestmark = pytest.mark.asyncio


def slow_program(path: Path, zones: int = 3000) -> Path:
    """A valid program that takes long to compile: forced text after forced-only zones is tokenized together with
    everything before it, so the work grows with the square of the zones (minutes for this one, unbudgeted)."""
    body = "".join(f'[[zones]]\nlabel = "z{i}"\nbudget = 0\nforce = "{"word " * 20}"\n' for i in range(zones))
    path.write_text(body + '[[zones]]\nlabel = "end"\nuntil = "<|assistant_end|>"\n')
    return path


@pytest.fixture
def compiling_backend() -> ScriptedBackend:
    backend = ScriptedBackend()
    backend.tokenizer = Tokenizer.from_file(str(tiny_model_dir() / "tokenizer.json"))
    backend.switch_program("calc")
    return backend


async def _enter_program(pilot, path: Path) -> ProgramScreen:
    await pilot.press("f3")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, ProgramScreen), what="the program dialog")
    screen = pilot.app.screen
    screen.query_one("#program-path").value = str(path)
    screen.query_one("#program-path").focus()
    await pilot.press("enter")
    return screen


async def test_a_long_compile_leaves_the_ui_responsive_and_esc_cancels_it(build_app, compiling_backend, tmp_path):
    slow = slow_program(tmp_path / "slow.toml")
    app = build_app(compiling_backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _enter_program(pilot, slow)
        assert screen.compiling
        assert "compiling" in str(screen.query_one("#error").render())
        # The UI thread is free: keys reach the dialog's input while the program compiles (on the UI thread they
        # would wait for the compile's end: `compiling` would be over by the time they are handled).
        await pilot.press("end", "x")
        assert screen.query_one("#program-path").value.endswith("slow.tomlx")
        assert screen.compiling
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, ProgramScreen), timeout=10, what="the cancel")
        assert compiling_backend.compiles == [(str(slow), True)]
        assert compiling_backend.program.name == "calc"  # unchanged
        assert "program: calc" in app.sub_title
        assert isinstance(app.focused, PromptInput)


async def test_ctrl_q_quits_promptly_during_a_compile(build_app, compiling_backend, tmp_path):
    slow = slow_program(tmp_path / "slow.toml")
    app = build_app(compiling_backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _enter_program(pilot, slow)
        assert screen.compiling
        started = time.monotonic()
        await pilot.press("ctrl+q")
    # The compile was cancelled when the dialog went away (not finished, not stopped by its 10 s budget), so the
    # app did not wait for it. The worker thread records the cancel as it unwinds, which may be just after the app
    # has gone: wait for the record rather than race it.
    deadline = time.monotonic() + 10
    while not compiling_backend.compiles and time.monotonic() < deadline:
        time.sleep(0.01)
    assert compiling_backend.compiles == [(str(slow), True)]
    assert time.monotonic() - started < 60  # a hang guard only: well under a second on a quiet machine


async def test_a_program_over_the_compile_budget_is_a_notification_naming_it(build_app, compiling_backend, tmp_path):
    slow = slow_program(tmp_path / "slow.toml")
    compiling_backend.compile_seconds = 0.2
    app = build_app(compiling_backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _enter_program(pilot, slow)
        await wait_until(pilot, lambda: not screen.compiling, timeout=60, what="the budget to run out")
        notes = [n for n in app._notifications if n.severity == "error"]
        assert len(notes) == 1
        message = notes[0].message
        assert str(slow) in message and "CPU time to compile (the limit)" in message and "fix: use fewer zones" in message
        assert "(the limit)" in str(screen.query_one("#error").render())
        assert isinstance(app.screen, ProgramScreen)  # still open: type another path or press esc
        assert compiling_backend.program.name == "calc"
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, ProgramScreen))


async def test_a_good_program_file_still_switches(build_app, compiling_backend, tmp_path):
    good = slow_program(tmp_path / "small.toml", zones=2)
    app = build_app(compiling_backend)
    async with app.run_test(size=SIZE) as pilot:
        await _enter_program(pilot, good)
        await wait_until(pilot, lambda: not isinstance(app.screen, ProgramScreen), timeout=20)
        assert compiling_backend.program.name == str(good)
        assert f"program: {good}" in app.sub_title
