"""Widgets that change many times a second while an answer streams: a Static that keeps its size most of the time,
and the throttle that paints a streaming widget a few times a second."""

from __future__ import annotations

from collections.abc import Callable

from textual.content import Content
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Static

from chatapp.ui.streaming import BATCH_INTERVAL


class LiveStatic(Static):
    """`show(content)` re-renders, and asks for a layout pass only when the content's height changed.

    `Static.update` lays out the whole screen on every call, because new content may change the widget's size.
    Streaming updates the same few widgets ~30 times a second and their height rarely changes (a line wraps, a
    row is added), so re-laying out every time would spend the UI thread, and the GIL the generation thread needs,
    on work that changes nothing.
    """

    _shown_height: int | None = None

    def show_content(self, content: Content) -> None:
        width = self.content_size.width
        height = content.get_height(self.styles, width) if width else None
        self.update(content, layout=height is None or height != self._shown_height)
        self._shown_height = height


class PaintThrottle:
    """Paints a streaming widget at most every `interval` seconds of `clock`, in the frames the transcript draws.

    Textual repaints the box that bounds every region changed in a frame, so a side panel widget that changes in
    the transcript's frame repaints the whole side panel with it (the heatmap, the stats, the inspector): ~6 ms of
    the UI's ~7 ms a frame in a 160x48 terminal, CPU the engine process's threads wait for. `request` paints at once
    when the interval is up (in the frame of the batch that asked); earlier, the paint is held back for the first
    request after the interval, in that batch's frame, and a timer one batch interval later paints it should no
    batch come (the stream paused). A timer at the interval itself would beat the next batch to it, and cost a frame
    of its own."""

    def __init__(self, widget: Widget, interval: float, paint: Callable[[], None], clock: Callable[[], float]) -> None:
        self._widget, self._interval, self._paint, self._clock = widget, interval, paint, clock
        self._painted_at = -interval
        self._held_back: Timer | None = None

    def request(self) -> None:
        wait = self._interval - (self._clock() - self._painted_at)
        if wait <= 0:
            self._paint()
        elif self._held_back is None:
            self._held_back = self._widget.set_timer(wait + BATCH_INTERVAL, self._paint)

    def painted(self) -> None:
        """Called by the paint (requested or not): what was held back is shown, the interval starts again."""
        self.cancel()
        self._painted_at = self._clock()

    def cancel(self) -> None:
        if self._held_back is not None:
            self._held_back.stop()
            self._held_back = None
