"""The line-based answer text (`TokenRun`): what streaming draws equals what the whole text would show."""

from __future__ import annotations

import pytest
from textual.content import Content
from textual.geometry import Offset
from textual.selection import Selection

from chatapp.ui.widgets.heatmap import RoutingHeatmap
from chatapp.ui.widgets.transcript import GROWTH, AssistantMessage, TokenRun
from tests.ui.conftest import SIZE, send_and_wait, submit, wait_until
from tests.ui.scripted import ScriptedBackend, answer, greeting, tok

pytestmark = pytest.mark.asyncio


def _lines(run: TokenRun) -> list[str]:
    """The run's text as drawn, line by line."""
    return [run.render_line(y).text.rstrip() for y in range(run.size.height)]


def _content_lines(text: str, width: int) -> list[str]:
    """The oracle: the same text wrapped by Textual's Content, as a Static would show it."""
    return [line.plain.rstrip() for line in Content(text).wrap(width)]


async def test_streamed_answer_draws_like_the_whole_text(build_app):
    long_answer = greeting() * 12  # many lines, arriving over many batches
    app = build_app(ScriptedBackend([long_answer], delay=0.001))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        streamed = app.transcript.answers()[-1]
        run = streamed.query_one(TokenRun)
        assert run.size.height > 5
        expected = _content_lines(run.text, run.size.width)
        assert _lines(run) == expected
        # The same answer drawn at once (as a resumed conversation is) gives the same lines.
        await app.transcript.mount(AssistantMessage(long_answer, message_id=0, status="complete"))
        await pilot.pause()
        assert _lines(app.transcript.answers()[-1].query_one(TokenRun)) == expected


async def test_resizing_rewraps_the_answer(build_app):
    app = build_app(ScriptedBackend([greeting() * 6]))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        run = app.transcript.answers()[-1].query_one(TokenRun)
        await pilot.resize_terminal(90, 36)
        await pilot.pause()
        assert run.size.width < SIZE[0] - 50
        assert _lines(run) == _content_lines(run.text, run.size.width)


async def test_clicking_a_token_on_a_wrapped_line_selects_it(build_app):
    app = build_app(ScriptedBackend([greeting() * 6]))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        message = app.transcript.answers()[-1]
        run = message.query_one(TokenRun)
        second_line = _lines(run)[1]
        await pilot.click(run, offset=(0, 1))
        await pilot.pause()
        # The token under the click is the one whose text starts the second line.
        event = message.events[message.cursor]
        assert second_line.startswith(event.text.strip())
        assert event.text.strip()


async def test_control_characters_never_reach_the_terminal(build_app):
    events = answer("tab\there", " bell\x07 esc\x1b[2J done")
    app = build_app(ScriptedBackend([events]))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        run = app.transcript.answers()[-1].query_one(TokenRun)
        assert run.text == "tab    here bell esc[2J done⟨end⟩"
        assert not any(ord(c) < 32 for c in "".join(_lines(run)))


async def test_cursor_reverses_only_the_selected_token(build_app):
    events = [tok("one", position=0), tok(" two", position=1), tok(" three", position=2)]
    app = build_app(ScriptedBackend([events]))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        message = app.transcript.answers()[-1]
        message.focus()
        await pilot.press("home", "right")
        run = message.query_one(TokenRun)
        reversed_text = "".join(s.text for s in run.render_line(0) if s.style and s.style.reverse)
        assert reversed_text == " two"
        await pilot.press("right")
        reversed_text = "".join(s.text for s in run.render_line(0) if s.style and s.style.reverse)
        assert reversed_text == " three"


async def test_a_new_theme_recolours_the_drawn_tokens(build_app):
    events = [tok("sampled", position=0), tok(" forced", forced=True, position=1)]
    app = build_app(ScriptedBackend([events]))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        run = app.transcript.answers()[-1].query_one(TokenRun)

        def forced_colour() -> str:
            (segment,) = [s for s in run.render_line(0) if s.text == " forced"]
            return segment.style.color.triplet.hex

        before = forced_colour()
        app.theme = "gruvbox" if app.theme != "gruvbox" else "nord"
        await pilot.pause()
        assert forced_colour() != before
        assert forced_colour() == app.theme_variables["accent"].lower()


async def test_a_streaming_answer_grows_in_steps_and_fits_when_done(build_app):
    backend = ScriptedBackend([greeting() * 8])
    backend.hold_after = 60  # several lines in, still streaming
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await submit(pilot, "hi")
        await wait_until(pilot, backend.held.is_set)
        answer = app.transcript.answers()[-1]
        await wait_until(pilot, lambda: len(answer.events) == 60 and answer.query(TokenRun), what="60 tokens shown")
        run = answer.query_one(TokenRun)
        await pilot.pause()  # nothing more arrives while the stream is held: let the last batch's layout happen
        text_lines = len(_content_lines(run.text, run.size.width))
        assert run.size.height % GROWTH == 0 and text_lines <= run.size.height < text_lines + GROWTH
        backend.release.set()
        await wait_until(pilot, lambda: not app.is_generating)
        await pilot.pause()
        assert run.size.height == len(_content_lines(run.text, run.size.width))


async def test_mouse_selection_copies_the_text_as_written(build_app):
    """Selection offsets are positions in the unwrapped text: a selection across wrapped lines copies the words
    with their spaces, not the line breaks the screen added; the selected part is drawn highlighted."""
    app = build_app(ScriptedBackend([greeting() * 6]))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        run = app.transcript.answers()[-1].query_one(TokenRun)
        first, second = _lines(run)[:2]
        # Segments say where they are: line 1 starts right after line 0 and the space it dropped.
        assert run.render_line(1)._segments[0].style.meta["offset"] == (len(first) + 1, 0)
        app.screen.selections = {run: Selection.from_offsets(Offset(6, 0), Offset(len(first) + 6, 0))}
        await pilot.pause()
        assert app.screen.get_selected_text() == run.text[6 : len(first) + 6]
        assert "\n" not in app.screen.get_selected_text()
        selection_colour = app.screen.get_component_rich_style("screen--selection").bgcolor
        highlighted = "".join(s.text for s in run.render_line(1) if s.style.bgcolor == selection_colour)
        assert highlighted == second[:5]


async def test_heatmap_follows_a_long_answer_and_ends_at_its_newest_token(build_app):
    backend = ScriptedBackend([greeting() * 10], delay=0.002)
    backend.hold_after = 70
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await submit(pilot, "hi")
        await wait_until(pilot, backend.held.is_set)
        heatmap = app.query_one(RoutingHeatmap)
        await wait_until(pilot, lambda: len(heatmap.columns) == 70, what="70 columns")
        visible = heatmap.scrollable_content_region.width - len("-log p ")  # the grid right of the labels (the widest: the surprise row)
        # Painting is throttled (a slow first run paints later), so the view follows at the next paint, not at once.
        await wait_until(
            pilot, lambda: heatmap.scroll_x <= 69 < heatmap.scroll_x + visible, what="the newest column in view"
        )
        backend.release.set()
        await wait_until(pilot, lambda: not app.is_generating)
        await wait_until(pilot, lambda: heatmap.scroll_x == 100 - visible, what="the newest token at the right edge")
        assert heatmap.virtual_size.width == len("-log p ") + 128  # 100 columns, in chunks of 32
