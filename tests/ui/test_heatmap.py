"""The routing heatmap while an answer streams: new columns are painted at most every `PAINT_INTERVAL`, and the
answer's end paints whatever was held back."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult

from chatapp.ui.widgets.heatmap import PAINT_INTERVAL, RoutingHeatmap
from tests.ui.scripted import STT_LAYERS, greeting

pytestmark = pytest.mark.asyncio


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class HeatmapApp(App):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def compose(self) -> ComposeResult:
        yield RoutingHeatmap(STT_LAYERS, clock=self.clock)


async def test_streamed_columns_are_painted_at_most_every_interval_and_all_at_the_end():
    clock = Clock()
    app = HeatmapApp(clock)
    async with app.run_test(size=(60, 20)) as pilot:
        heatmap = app.query_one(RoutingHeatmap)
        heatmap.start(expected=200)
        events = greeting() * 20  # far wider than the view
        heatmap.extend(events[:5])  # an answer's first tokens are painted at once
        await pilot.pause()
        narrow = heatmap.virtual_size.width
        # Checked before the app runs again (a paint sizes the grid at once; a held-back one waits for a timer).
        heatmap.extend(events[5:150])  # within the interval: held back
        assert len(heatmap.columns) == 150 and heatmap.virtual_size.width == narrow
        clock.now += PAINT_INTERVAL
        heatmap.extend(events[150:160])  # the interval is up: everything so far is painted
        assert heatmap.virtual_size.width > narrow
        await pilot.pause()
        visible = heatmap.scrollable_content_region.width - len("-log p ")
        assert heatmap.scroll_x <= 159 < heatmap.scroll_x + visible  # the view followed the newest column
        heatmap.extend(events[160:])  # held back again, until the answer ends
        heatmap.settle()
        await pilot.pause()
        assert heatmap.scroll_x == len(events) - visible  # the newest token at the right edge
