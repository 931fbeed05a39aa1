"""The layer lens in the TUI (f7, or a click on the inspector): the selected token's layers view, the heatmap's depth
row and the stats panel's depth split, from the backend's `lens` (plain data; the scripted backend's is
`scripted_lens`). Keyboard and mouse both drive it."""

from __future__ import annotations

import pytest

from chatapp.ui.widgets.heatmap import RoutingHeatmap
from chatapp.ui.widgets.panels import StatsPanel, TokenInspector
from tests.ui.conftest import SIZE, ready, send_and_wait, submit, wait_until
from tests.ui.scripted import STT_LAYERS, ScriptedBackend, greeting

pytestmark = pytest.mark.asyncio


def inspector_text(app) -> str:
    return str(app.query_one(TokenInspector).render())


async def test_f7_shows_the_selected_tokens_layers_and_follows_the_cursor(build_app) -> None:
    backend = ScriptedBackend([greeting()])
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        answer = app.transcript.answers()[-1]
        answer.focus()
        await pilot.press("home", "right", "right", "right")
        assert "layers ·" not in inspector_text(app)
        await pilot.press("f7")
        await wait_until(pilot, lambda: "decided at layer" in inspector_text(app), what="the layers view")
        request = backend.lens_requests[-1]
        assert request.answer == 0 and request.detail == 3
        assert request.tokens == tuple(event.token for event in answer.events)
        assert request.computed == tuple(event.computed for event in answer.events)
        text = inspector_text(app)
        assert "layers · raw lens · #3" in text and "▲" in text
        heatmap = app.query_one(RoutingHeatmap)
        assert heatmap.depths is not None and len(heatmap.depths) == len(answer.events)
        assert heatmap.grid_rows == len(STT_LAYERS) // 2 + 2  # layer rows, surprise, depth
        stats = str(app.query_one(StatsPanel).render())
        assert "decision depth (raw)" in stats and all(f"L{layer}" in stats for layer in STT_LAYERS)

        await pilot.press("right")  # token 4 settles at layer (3 * 4) mod 9 = 3
        await wait_until(pilot, lambda: backend.lens_requests[-1].detail == 4, what="the next token's lens")
        await wait_until(pilot, lambda: "decided at layer 3" in inspector_text(app), what="token 4's layers")

        await pilot.press("f7")
        await wait_until(pilot, lambda: "layers ·" not in inspector_text(app), what="the token view again")
        assert "#4" in inspector_text(app) and heatmap.depths is None


async def test_a_click_on_the_inspector_toggles_the_lens(build_app) -> None:
    backend = ScriptedBackend([greeting()])
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        await pilot.click(app.transcript.answers()[-1].query_one("TokenRun"), offset=(0, 0))
        await wait_until(pilot, lambda: "#0" in inspector_text(app), what="the first token selected")
        await pilot.click("#inspector")
        await wait_until(pilot, lambda: app.lens_on and "layers ·" in inspector_text(app), what="the layers view")
        await pilot.click("#inspector")
        await wait_until(pilot, lambda: not app.lens_on and "layers ·" not in inspector_text(app))


async def test_a_token_never_settled_says_so(build_app) -> None:
    backend = ScriptedBackend([greeting()])
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        answer = app.transcript.answers()[-1]
        answer.focus()
        await pilot.press("f7", "home", *["right"] * 3)  # token 3: (3 * 3) mod 9 = 0 → settled at layer 0
        await wait_until(pilot, lambda: "decided at layer 0" in inspector_text(app))
        await pilot.press("right", "right", "right")  # token 6: (3 * 6) mod 9 = 0; token 8: 24 mod 9 = 6
        await pilot.press("right", "right")
        await wait_until(pilot, lambda: backend.lens_requests[-1].detail == 8)
        await wait_until(pilot, lambda: "decided at layer 6" in inspector_text(app))


async def test_the_lens_waits_for_a_selected_token_and_the_answers_end(build_app) -> None:
    backend = ScriptedBackend([greeting()])
    backend.hold_after = 4  # the stream stops after 4 steps until released
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f7")
        await wait_until(pilot, lambda: "select a token" in inspector_text(app), what="the hint to select a token")
        await submit(pilot, "hi")
        await wait_until(pilot, backend.held.is_set, what="the stream to hold")
        await wait_until(pilot, lambda: app.transcript.answers() and app.transcript.answers()[-1].events)
        answer = app.transcript.answers()[-1]
        answer.focus()
        await pilot.press("home")
        await wait_until(pilot, lambda: "once the answer is done" in inspector_text(app))
        assert backend.lens_requests == []
        backend.release.set()
        # The answer's end reads its layers at once, for the token already selected.
        await wait_until(pilot, lambda: "#0" in inspector_text(app) and "decided at layer" in inspector_text(app))
        assert [r.detail for r in backend.lens_requests] == [0]
        await pilot.press("right")
        await wait_until(pilot, lambda: "#1" in inspector_text(app), what="the next token's layers")
        assert [r.detail for r in backend.lens_requests] == [0, 1]
