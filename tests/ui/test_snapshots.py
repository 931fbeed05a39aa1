"""SVG snapshots of the chat app (pytest-textual-snapshot). Regenerate with `pytest tests/ui --snapshot-update`.

Everything on screen is deterministic: the scripted backend's tokens and step timings, a fixed clock for stored
timestamps, no cursor blink, no animations (TEXTUAL_ANIMATIONS=none in tests/conftest.py), no toasts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from chatapp.engine.reply import Reply
from chatapp.ui.history import HistoryStore
from chatapp.ui.screens.compare import CompareScreen
from chatapp.ui.widgets.transcript import AssistantMessage
from tests.ui.conftest import SIZE, FixedClock, ready, send_and_wait, submit, wait_until
from tests.ui.scripted import ScriptedBackend, answer, calculator_answer, greeting, think_answer


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "history.sqlite3"


def _answer(pilot, index: int = -1) -> AssistantMessage:
    return pilot.app.transcript.answers()[index]


def test_empty_app(snap_compare, build_app):
    assert snap_compare(build_app(), terminal_size=SIZE)


def test_forced_and_sampled_tokens(snap_compare, build_app):
    backend = ScriptedBackend([greeting(), think_answer()])

    async def run_before(pilot) -> None:
        await send_and_wait(pilot, "hi")
        await send_and_wait(pilot, "What is the capital of France?")

    assert snap_compare(build_app(backend), terminal_size=SIZE, run_before=run_before)


def test_expanded_tool_call(snap_compare, build_app):
    backend = ScriptedBackend([calculator_answer()])

    async def run_before(pilot) -> None:
        await send_and_wait(pilot, "What is 37*45?")
        await pilot.click("ToolCallBlock CollapsibleTitle")
        await wait_until(pilot, lambda: not pilot.app.query_one("ToolCallBlock").collapsed)

    assert snap_compare(build_app(backend), terminal_size=SIZE, run_before=run_before)


def test_routing_heatmap_with_selected_token(snap_compare, build_app):
    backend = ScriptedBackend([greeting() * 3])

    async def run_before(pilot) -> None:
        await send_and_wait(pilot, "Say hello three times")
        answer = _answer(pilot)
        answer.focus()
        await pilot.press("home", *["right"] * 12)

    assert snap_compare(build_app(backend), terminal_size=SIZE, run_before=run_before)


def test_zone_tags_under_think_program(snap_compare, build_app):
    backend = ScriptedBackend([think_answer()])
    backend.switch_program("think")

    async def run_before(pilot) -> None:
        await send_and_wait(pilot, "What is the capital of France?")
        answer = _answer(pilot)
        answer.focus()
        await pilot.press("home", "right", "right")  # a token inside the think zone

    assert snap_compare(build_app(backend), terminal_size=SIZE, run_before=run_before)


def test_settings_screen(snap_compare, build_app):
    assert snap_compare(build_app(), terminal_size=SIZE, press=["f2"])


def test_history_list(snap_compare, build_app, db):
    clock = FixedClock()
    store = HistoryStore(db, clock=clock)
    for title, program, events in (
        ("What is 37*45?", "calc", calculator_answer()),
        ("Capital of France", "think", think_answer()),
        ("hi", None, greeting()),
    ):
        cid = store.create_conversation(title, model="scripted-8L", program=program)
        store.add_message(cid, "user", title)
        mid = store.add_message(cid, "assistant", "", status="streaming")
        store.append_tokens(mid, 0, events, Reply.of(events).pieces_since(0)[0])
        store.finish_message(mid, "complete")
    store.close()
    assert snap_compare(build_app(db=db, clock=clock), terminal_size=SIZE, press=["f4"])


def test_bad_program_file_error(snap_compare, build_app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the error names the path as typed: keep it short and fixed
    Path("bad.toml").write_text("zones = [[[")

    async def run_before(pilot) -> None:
        await ready(pilot)
        await pilot.press("f3")
        await wait_until(pilot, lambda: pilot.app.screen.query("#program-path"))
        await pilot.click("#program-path")
        await pilot.press(*"bad.toml", "enter")
        error = pilot.app.screen.query_one("#error")
        await wait_until(pilot, lambda: "not valid TOML" in str(error.render()), what="the compile's error")
        pilot.app.clear_notifications()  # the same error's toast (tested in test_program_compile): no toasts here

    assert snap_compare(build_app(), terminal_size=SIZE, run_before=run_before)


def test_interrupted_answer(snap_compare, build_app):
    backend = ScriptedBackend([greeting()])
    backend.hold_after = 5

    async def run_before(pilot) -> None:
        await submit(pilot, "hi")
        await wait_until(pilot, backend.held.is_set)
        await pilot.press("escape")
        backend.release.set()
        await wait_until(pilot, lambda: not pilot.app.is_generating)

    assert snap_compare(build_app(backend), terminal_size=SIZE, run_before=run_before)


@pytest.mark.parametrize("size", [(40, 12), (80, 24)], ids=["40x12", "80x24"])
def test_small_terminal_keeps_transcript_and_input(snap_compare, build_app, size):
    """Issue 17: at 40x12 the side panels hide (and the header goes) so the transcript and the input stay; at 80x24
    the side panels narrow beside them."""
    backend = ScriptedBackend([greeting()])

    async def run_before(pilot) -> None:
        await send_and_wait(pilot, "hi")
        app = pilot.app
        for selector in ("#transcript", "#prompt"):
            region = app.query_one(selector).region
            assert region.width >= size[0] // 2 and region.height >= 3, (selector, region)
        assert app.query_one("#side").display == (size[0] >= 60)
        assert app.transcript.answers()[-1].region.height >= 3  # the answer itself is on screen

    assert snap_compare(build_app(backend), terminal_size=size, run_before=run_before)


TALL = (120, 52)  # room for the inspector's alternatives under the heatmap


def test_inspector_alternatives_and_surprise_row(snap_compare, build_app):
    """The inspector lists the selected token's alternatives with bars, log p, p and entropy; the heatmap's
    surprise row shades every column by -log p (forced tokens underlined); the stats split surprise by layer."""
    backend = ScriptedBackend([calculator_answer(with_logprobs=True)])

    async def run_before(pilot) -> None:
        await send_and_wait(pilot, "What is 37*45?")
        answer = _answer(pilot)
        answer.focus()
        await pilot.press("home", *["right"] * 4)  # ' that' (p 0.03 in the script): a surprising token

    assert snap_compare(build_app(backend), terminal_size=TALL, run_before=run_before)


def test_probability_colouring(snap_compare, build_app):
    """f6 tints sampled tokens by probability; forced tokens (the tool's output) keep their underlined style."""
    backend = ScriptedBackend([calculator_answer(with_logprobs=True)])

    async def run_before(pilot) -> None:
        await send_and_wait(pilot, "What is 37*45?")
        await pilot.click("ToolCallBlock CollapsibleTitle")
        await wait_until(pilot, lambda: not pilot.app.query_one("ToolCallBlock").collapsed)
        await pilot.press("f6")
        await wait_until(pilot, lambda: pilot.app.probability_colours)

    assert snap_compare(build_app(backend), terminal_size=SIZE, run_before=run_before)


def test_compare_with_routing_off(snap_compare, build_app):
    """f5 answers again with routing off and marks the first token where the answers part."""
    backend = ScriptedBackend([greeting(with_logprobs=True)])
    backend.compare_answer = answer("Hello", "!", " How", " can", " I", " assist", " you", "?")

    async def run_before(pilot) -> None:
        await send_and_wait(pilot, "hi")
        await pilot.press("f5")
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, CompareScreen), what="the compare screen")

    assert snap_compare(build_app(backend), terminal_size=SIZE, run_before=run_before)


def test_layer_lens_view(snap_compare, build_app):
    """f7: the selected token's layers (its probability at each layer's reading, each routed layer ran ● or
    skipped ○, the decision layer ▲, the top 3 at the first, middle, decision and last layers), the heatmap's depth
    row and the stats panel's decision depth by routing."""
    backend = ScriptedBackend([greeting(with_logprobs=True)])

    async def run_before(pilot) -> None:
        await send_and_wait(pilot, "hi")
        answer = _answer(pilot)
        answer.focus()
        await pilot.press("home", "right", "right", "f7")
        await wait_until(pilot, lambda: "decided at layer" in str(pilot.app.query_one("#inspector").render()))

    assert snap_compare(build_app(backend), terminal_size=TALL, run_before=run_before)
