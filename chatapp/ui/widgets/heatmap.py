"""The routing heatmap: STT layers down, tokens across, router probability as colour.

Two layers share a row through the upper half block: `▀` draws the upper layer in the foreground and the lower
layer in the background. A layer that skipped a token leaves its half empty (`▄` when only the lower layer
computed, `·` when both skipped), so "computed or skipped" reads from the shape alone and colour only adds the
probability. Tokens that never went through the model (the final stop token) are blank. Under the layers, the
surprise row shades each token's column by -log p under the model (` ░▒▓█`, see `probability.py`; forced tokens
underlined; blank without log-probs), so a column reads as "which layers computed it, and how surprised the model
was". With the layer lens on (`set_depths`), a depth row under it draws each token's decision depth (the first
layer from which the logit lens's top token stays the emitted one; `chatapp.engine.lens`) as a block, taller for a
later decision. It is a `ScrollView` that renders only the visible lines, follows new tokens while scrolled to the
right end, and marks the selected token's column with `▲` under the grid.

While an answer streams, its new columns are drawn at most every `PAINT_INTERVAL`, in the transcript's frames
(`live.PaintThrottle`, which says why), rather than with every batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Region, Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from chatapp.engine.events import TokenEvent
from chatapp.engine.lens import depth_block
from chatapp.ui.widgets.live import PaintThrottle
from chatapp.ui.widgets.probability import surprise_colour, surprise_shade

# A perceptual ramp (viridis' end points and middle) for router probability 0 → 1.
_RAMP = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
_CHUNK = 32  # columns added to the virtual width at a time
# Seconds between two paints of a streaming answer's new columns: 10 a second still reads as a stream, in a third of
# the frames.
PAINT_INTERVAL = 0.1
Column = tuple[tuple[float, ...], tuple[bool, ...]] | None
SURPRISE_LABEL = "-log p"
DEPTH_LABEL = "depth"


def skip_mode_caption(skip_mode: str, level: str | None = None) -> str:
    """The heatmap's bottom border title: the routing level answers run at, and the model's skip mode, what a token
    a layer skipped leaves there ("strict": nothing; "kv": its keys and values; "predict": those and a predicted
    update). Below, because the top title already fills the side panel's width."""
    return f"skip mode: {skip_mode}" if level is None else f"{level} · skip mode: {skip_mode}"


def probability_colour(p: float) -> str:
    """Hex colour of a router probability on the ramp (clamped to [0, 1])."""
    p = min(max(p, 0.0), 1.0) * (len(_RAMP) - 1)
    i = min(int(p), len(_RAMP) - 2)
    t = p - i
    lo, hi = _RAMP[i], _RAMP[i + 1]
    r, g, b = (round(a + (b - a) * t) for a, b in zip(lo, hi, strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def cell(upper: tuple[float, bool] | None, lower: tuple[float, bool] | None) -> tuple[str, str | None, str | None]:
    """Glyph, foreground and background colours of one cell holding two layers of one token."""
    up = upper is not None and upper[1]
    down = lower is not None and lower[1]
    if up and down:
        return "▀", probability_colour(upper[0]), probability_colour(lower[0])  # type: ignore[index]
    if up:
        return "▀", probability_colour(upper[0]), None  # type: ignore[index]
    if down:
        return "▄", probability_colour(lower[0]), None  # type: ignore[index]
    if upper is None and lower is None:
        return " ", None, None
    return "·", None, None


class RoutingHeatmap(ScrollView, can_focus=True):
    """STT layers × tokens of one answer (the one streaming, or the one whose token is selected)."""

    def __init__(
        self, stt_layers: Sequence[int] = (), *, id: str | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(id=id)
        self.stt_layers = tuple(stt_layers)
        self.depths: tuple[int | None, ...] | None = None  # per token, with the layer lens on (`set_depths`)
        self.columns: list[Column] = []
        # Each row's cells, rendered once when their token arrives: a column never changes afterwards, so a
        # repaint only slices these lists (streaming repaints ~30 times a second).
        self._cells: list[list[Segment]] = [[] for _ in range(self.grid_rows)]
        self._painted: list[list[Segment]] = []  # `_cells` on the widget's style, made as they are first drawn
        self._painted_on: Style | None = None  # the widget style `_painted` was made with
        self.selected: int | None = None
        self._room = 0  # columns the virtual width keeps for the answer being streamed
        self._gutter = max(len(self._label(r)) for r in range(self.grid_rows)) + 1
        self._painted_columns = 0  # columns drawn so far; `extend` adds columns, `_paint_new` draws them
        self._throttle = PaintThrottle(self, PAINT_INTERVAL, self._paint_new, clock)
        self._base = Style()  # the widget's own style, read once per repaint (`render_lines`)

    def on_mount(self) -> None:
        self._fit_height()

    def _fit_height(self) -> None:
        # Exactly the grid, the ruler and the horizontal scrollbar: the layer count is fixed for a model.
        self.styles.height = self.grid_rows + 1 + self.styles.scrollbar_size_horizontal + self.styles.gutter.height

    def set_layers(self, stt_layers: Sequence[int]) -> None:
        """The model's STT layers, given once it has loaded (the app draws before it has), on an empty grid."""
        self.stt_layers = tuple(stt_layers)
        self._gutter = max(len(self._label(r)) for r in range(self.grid_rows)) + 1
        self.set_tokens([])
        if self.is_mounted:
            self._fit_height()

    @property
    def rows(self) -> int:
        """Layer rows: two layers per row."""
        return (len(self.stt_layers) + 1) // 2

    @property
    def grid_rows(self) -> int:
        """Rows drawn from the columns: the layer rows, the surprise row, the depth row with the lens on (the
        selection ruler follows)."""
        return self.rows + 1 + (self.depths is not None)

    def _label(self, row: int) -> str:
        if row == self.rows:
            return SURPRISE_LABEL
        if row == self.rows + 1:
            return DEPTH_LABEL
        layers = self.stt_layers[2 * row : 2 * row + 2]
        return "/".join(f"L{layer}" for layer in layers)

    def set_depths(self, depths: Sequence[int | None] | None, num_layers: int = 1) -> None:
        """Show the shown answer's decision depths in a row of their own (None: no depth row)."""
        had_row = self.depths is not None
        self.depths = None if depths is None else tuple(depths)
        self._gutter = max(len(self._label(r)) for r in range(self.grid_rows)) + 1
        self._cells = self._cells[: self.rows + 1]
        if self.depths is not None:
            style = Style(bold=True)
            self._cells.append([Segment(depth_block(depth, num_layers), style) for depth in self.depths])
        self._painted_on = None
        if self.is_mounted and had_row != (self.depths is not None):
            self._fit_height()
            self._set_virtual_width(len(self.columns))
        self.refresh()

    def set_tokens(self, events: Sequence[TokenEvent], selected: int | None = None) -> None:
        """Show a whole answer (e.g. a resumed one, or the answer whose token was selected); a depth row is kept
        empty until `set_depths` fills it for this answer."""
        self._throttle.cancel()
        self.columns = []
        self._cells = [[] for _ in range(self.grid_rows)]
        self._painted_on = None
        self._append(events)
        self._painted_columns = len(self.columns)
        self.selected = selected
        self._set_virtual_width(len(self.columns))
        if selected is None:
            self.scroll_to(x=self._follow_x, animate=False, force=True)
        else:
            self.scroll_to_column(selected)
        self.refresh()

    def start(self, expected: int) -> None:
        """Clear the grid for an answer of up to about `expected` tokens. Once the answer overflows the view, the
        grid is sized for all of them at once: a new virtual size means a layout of the whole screen, which should
        not happen every few tokens (nor at all for an answer that fits, whose grid keeps its size)."""
        self.set_tokens([])
        self._room = expected

    def extend(self, events: Sequence[TokenEvent]) -> None:
        """Append streamed tokens; they are drawn at most every `PAINT_INTERVAL` (`_paint_new`)."""
        self._append(events)
        self._throttle.request()

    def _paint_new(self) -> None:
        """Draw the columns appended since the last paint, following the newest while it is in view.

        The view follows in jumps (the newest token lands mid-view) rather than one column per paint: a scroll
        repaints the whole grid, while between jumps a paint repaints only its own new columns.
        """
        self._throttle.painted()
        first, count = self._painted_columns, len(self.columns)
        self._painted_columns = count
        visible = self._visible_columns
        # At the right end of the grid counts as following too: the grid may not have grown to its new size yet.
        following = first <= self.scroll_x + visible or self.scroll_x >= self.max_scroll_x
        if count > visible:  # plus room for a jump ahead (the scroll position is clamped to the width)
            self._set_virtual_width(max(count, self._room) + visible)
        if following and count > self.scroll_x + visible:
            # Forced: the scrollbar of a grid that has just outgrown the view appears only with the next layout.
            self.scroll_to(x=count - visible // 2, animate=False, force=True)
        else:
            self._refresh_columns(first, count)

    def settle(self) -> None:
        """The answer is complete: draw what is held back, drop the room kept for it and, if following, end at the
        newest token."""
        if self._painted_columns < len(self.columns):
            self._paint_new()
        following = len(self.columns) <= self.scroll_x + self._visible_columns or self.scroll_x >= self.max_scroll_x
        self._room = 0
        self._set_virtual_width(len(self.columns))
        if following:
            self.scroll_to(x=self._follow_x, animate=False, force=True)
        self.refresh()

    @property
    def _visible_columns(self) -> int:
        return max(self.scrollable_content_region.width - self._gutter, 1)

    @property
    def _follow_x(self) -> int:
        """The scroll position that shows the newest token at the right edge."""
        return max(len(self.columns) - self._visible_columns, 0)

    def _append(self, events: Sequence[TokenEvent]) -> None:
        surprise = self._cells[self.rows]
        for event in events:
            column = self._column(event)
            self.columns.append(column)
            for row, cells in enumerate(self._cells[: self.rows]):
                cells.append(_cell_segment(column, row))
            surprise.append(_surprise_segment(event))

    def select(self, index: int | None) -> None:
        self.selected = index
        if index is not None:
            self.scroll_to_column(index)
        self.refresh()

    def scroll_to_column(self, index: int) -> None:
        visible = self._visible_columns
        if not self.scroll_x <= index < self.scroll_x + visible:
            self.scroll_to(x=max(index - visible // 2, 0), animate=False, force=True)

    def _set_virtual_width(self, columns: int) -> None:
        """Size the grid for `columns`, in chunks: a new virtual size lays out the whole screen, which ~30 times a
        second would cost the UI thread far more than drawing the new cells does."""
        width = self._gutter + -(-columns // _CHUNK) * _CHUNK
        if width != self.virtual_size.width or self.grid_rows + 1 != self.virtual_size.height:
            self.virtual_size = Size(width, self.grid_rows + 1)

    def _refresh_columns(self, start: int, end: int) -> None:
        """Repaint the grid cells of columns `start:end` (where in view); the labels and ruler stay."""
        left = max(start, int(self.scroll_x))
        right = min(end, int(self.scroll_x) + self._visible_columns)
        if left < right:
            self.refresh(Region(self._gutter + left - int(self.scroll_x), 0, right - left, self.grid_rows))

    @staticmethod
    def _column(event: TokenEvent) -> Column:
        if event.router_probs is None or event.computed is None:
            return None
        return event.router_probs, event.computed

    def render_lines(self, crop: Region) -> list[Strip]:
        # The widget's colours under the cells' own: `rich_style` walks the widget's ancestors, so once a repaint,
        # not once a line.
        self._base = self.rich_style
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        row = y + scroll_y
        width = self.scrollable_content_region.width
        visible = max(width - self._gutter, 0)
        columns = range(scroll_x, min(scroll_x + visible, len(self.columns)))
        base = self._base
        if row == self.grid_rows:
            ruler = "".join("▲" if i == self.selected else " " for i in columns)
            segments = [Segment(" " * self._gutter, base), Segment(ruler, base + Style(bold=True))]
        elif row < self.grid_rows:
            segments = [Segment(self._label(row).ljust(self._gutter), base + Style(dim=True))]
            segments += self._painted_cells(row, base)[columns.start : columns.stop]
        else:
            segments = []
        used = self._gutter + len(columns) if row <= self.grid_rows else 0
        if used < width:
            segments.append(Segment(" " * (width - used), base))
        return Strip(segments, max(width, used))

    def _painted_cells(self, row: int, base: Style) -> list[Segment]:
        """The row's cells on the widget's style, combined once per cell (the grid repaints ~30 times a second)."""
        if base != self._painted_on:
            self._painted_on, self._painted = base, [[] for _ in range(self.grid_rows)]
        painted, cells = self._painted[row], self._cells[row]
        painted += [Segment(cell.text, base + cell.style) for cell in cells[len(painted) :]]
        return painted


def _cell_segment(column: Column, row: int) -> Segment:
    """The cell of one token (`column`) in one grid row (two layers)."""
    if column is None:
        return Segment(" ")
    probs, computed = column
    upper = (probs[2 * row], computed[2 * row]) if 2 * row < len(probs) else None
    lower = (probs[2 * row + 1], computed[2 * row + 1]) if 2 * row + 1 < len(probs) else None
    glyph, fg, bg = cell(upper, lower)
    return Segment(glyph, _cell_style(fg, bg, glyph == "·"))


def _surprise_segment(event: TokenEvent) -> Segment:
    """The token's cell in the surprise row: shaded by -log p, underlined when forced (a cue beyond colour)."""
    if event.logprobs is None:
        return Segment(" ")
    surprise = event.logprobs.surprise
    return Segment(surprise_shade(surprise), _surprise_style(surprise_colour(surprise), event.forced))


@lru_cache(maxsize=64)
def _surprise_style(colour: str | None, forced: bool) -> Style:
    return Style(color=colour or "#b0b0b0", underline=forced)


@lru_cache(maxsize=4096)
def _cell_style(fg: str | None, bg: str | None, dim: bool) -> Style:
    """Styles are shared between cells: the ramp has a bounded number of colours after rounding."""
    return Style(color=fg, bgcolor=bg, dim=dim)
