"""The conversation: user messages and streamed assistant answers drawn token by token.

An assistant answer owns its token events and a token cursor. It shows them as segments: runs of text
(`TokenRun`) and tool calls (`ToolCallBlock`, collapsible). Sampled tokens are plain; forced tokens are coloured
AND underlined (a cue that survives a colour-blind reader or a monochrome terminal); special tokens are readable
markers like ⟨python⟩. Every token span carries its index as style meta, so a click resolves to a token without
any layout arithmetic; the keyboard cursor (←/→ while the answer is focused) does the same.

With the app's probability colouring on (`ChatApp.probability_colours`, f6), sampled tokens get a background by
their probability under the model (`probability.py`: likely tokens stay plain, unlikely ones warm up); forced tokens
keep their own style, whose underline tells them apart without colour.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from functools import lru_cache

from rich.segment import Segment
from rich.style import Style as RichStyle
from textual import events
from textual.binding import Binding
from textual.color import Color
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import Reactive
from textual.selection import Selection
from textual.strip import Strip
from textual.style import Style
from textual.widget import Widget
from textual.widgets import Collapsible, Static

from chatapp.engine.events import TokenEvent
from chatapp.engine.reply import Reply
from chatapp.engine.reply import Segment as TokenSegment
from chatapp.tools import TOOLS
from chatapp.tools.base import NANOCHAT_TOOL_MARKERS, ToolMarkers
from chatapp.ui.tokens import display_text
from chatapp.ui.widgets.probability import probability_background
from chatapp.ui.wrap import WrappedText

_STATUS_TEXT = {
    "streaming": "",
    "complete": "",
    "interrupted": "⏹ interrupted",
    "error": "✖ error",
}


# Textual lays the screen out again whenever a widget's virtual size changes. For a widget that does not scroll, that
# is just its size, set by the layout pass that has already placed it: the second pass would double the cost of
# every message mounted and every line a streamed answer gains. (Scrolling containers keep the default.)
_SIZE_WITHOUT_RELAYOUT: Reactive[Size] = Reactive(Size(0, 0), layout=False)


class UserMessage(Static):
    """A message the user sent."""

    virtual_size = _SIZE_WITHOUT_RELAYOUT

    def __init__(self, text: str, *, message_id: int) -> None:
        super().__init__(Content(text))
        self.text = text
        self.message_id = message_id  # its row in the history database
        self.border_title = "you"


class PendingMessage(Static):
    """A message sent while the model was still loading: shown at once, sent (and saved, as a `UserMessage`) when
    the model is ready."""

    virtual_size = _SIZE_WITHOUT_RELAYOUT

    def __init__(self, text: str) -> None:
        super().__init__(Content(text))
        self.text = text
        self.border_title = "you"
        self.border_subtitle = "waiting: loading the model…"


GROWTH = 3  # lines a streaming run's height grows by at a time


class TokenRun(Widget):
    """A run of an answer's tokens (`start:end` into the answer's events), drawn line by line.

    Streaming appends tokens ~30 times a second. A `Static` would re-wrap and re-style the whole run for each
    batch; this widget wraps incrementally (`WrappedText`: only the last line can change) and keeps one rendered
    `Strip` per line, so a batch re-renders just the lines it touched. Its height changes (a whole-screen layout)
    only when the text outgrows it: while streaming it grows `GROWTH` lines at a time. Each token's segment carries
    its index as style meta, for clicks, and its place in the unwrapped text, for mouse selection.
    """

    DEFAULT_CSS = "TokenRun { height: auto; }"
    virtual_size = _SIZE_WITHOUT_RELAYOUT

    def __init__(
        self, answer: AssistantMessage, start: int, end: int, *, classes: str = "", growing: bool = False
    ) -> None:
        super().__init__(classes=classes)
        self.growing = growing  # streaming: the height grows in steps (see `_height`)
        self._answer = answer
        self.start = start
        self.end = end
        self._wrapped = WrappedText()
        self._offsets: list[int] = []  # where each token's text starts in the run's text
        self._token_styles: list[RichStyle | None] = []  # each token's rendered style, made when first drawn
        self._strips: dict[int, Strip] = {}  # rendered lines
        self._cursor: int | None = None  # the token (run-relative) drawn reversed
        # The widget style, theme and probability colouring the caches were rendered with.
        self._base: tuple[Style, str, bool] | None = None
        self._kind_styles: dict[tuple[bool, bool], Style] = {}  # (special, forced) -> style, theme resolved

    @property
    def text(self) -> str:
        """The run as shown (markers for special tokens, control characters dropped)."""
        return self._wrapped.text

    def refresh_tokens(self) -> None:
        """Take in tokens added to the run and the answer's cursor; redraw the lines that changed."""
        events = self._answer.events
        wrapped = self._wrapped
        height = self._height()
        changed: set[int] = set()
        pieces: list[str] = []
        length = len(wrapped.text)
        for index in range(self.start + len(self._offsets), self.end):
            self._offsets.append(length)
            self._token_styles.append(None)
            piece = _shown(events[index])
            pieces.append(piece)
            length += len(piece)
        if pieces:
            first = wrapped.append("".join(pieces))
            changed.update(range(first, len(wrapped.lines)))
        cursor = self._answer.cursor - self.start
        cursor = cursor if 0 <= cursor < len(self._offsets) else None
        if cursor != self._cursor:
            for token in (self._cursor, cursor):
                if token is not None:
                    self._token_styles[token] = None
                    changed.update(self._lines_of(token))
            self._cursor = cursor
        for line in changed:
            self._strips.pop(line, None)
        if self._height() != height or wrapped.width is None:
            self.refresh(layout=True)
        elif changed:
            top = min(changed)
            self.refresh(Region(0, top, wrapped.width, max(changed) - top + 1))

    def _lines_of(self, token: int) -> range:
        if self._wrapped.width is None:
            return range(0)
        start = self._offsets[token]
        end = self._offsets[token + 1] if token + 1 < len(self._offsets) else len(self._wrapped.text)
        return range(self._wrapped.line_of(start), self._wrapped.line_of(max(end - 1, start)) + 1)

    # --- rendering ------------------------------------------------------------------------------------------------
    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        self._wrap_at(width)
        return self._height()

    def _height(self) -> int:
        """Lines of text; while streaming, rounded up to whole steps of `GROWTH` lines: each time the run grows,
        the screen is laid out and the transcript scrolls and repaints, so it grows a few lines at a time."""
        lines = len(self._wrapped.lines) if self._offsets else 0
        return -(-max(lines, 1) // GROWTH) * GROWTH if self.growing else lines

    def stop_growing(self) -> None:
        """The answer is finished: fit the text exactly."""
        if self.growing:
            self.growing = False
            self.refresh(layout=True)

    def _wrap_at(self, width: int) -> None:
        if width != self._wrapped.width:
            self._wrapped.rewrap(width)
            self._strips.clear()

    def render_line(self, y: int) -> Strip:
        width = self.content_size.width
        self._wrap_at(width)
        base = (self.visual_style, self.app.theme, self._probability_colours)
        if base != self._base:  # a new theme, CSS that changed this widget's colours, or colouring toggled
            self._base = base
            self._token_styles = [None] * len(self._token_styles)
            self._kind_styles.clear()  # theme variables ($accent) may have changed with it
            self._strips.clear()
        if y >= len(self._wrapped.lines):
            return Strip.blank(width, self.visual_style.rich_style)
        if self.text_selection is not None:  # rare and short-lived: drawn afresh, not cached
            return self._render_text_line(y, self.text_selection)
        strip = self._strips.get(y)
        if strip is None:
            strip = self._strips[y] = self._render_text_line(y)
        return strip

    def _render_text_line(self, y: int, selection: Selection | None = None) -> Strip:
        """One wrapped line: a segment per token piece on it (a token may continue on the next line), the part in
        the mouse selection highlighted. Segments carry their position in the unwrapped text as Textual's selection
        expects (offset in the paragraph, paragraph index), so selecting across wrapped lines copies the text as
        written."""
        text, offsets = self._wrapped.text, self._offsets
        start, end = self._wrapped.lines[y]
        paragraph_start = text.rfind("\n", 0, start) + 1
        paragraph = text.count("\n", 0, start)
        selected = range(0)
        if selection is not None and (span := selection.get_span(paragraph)) is not None:
            paragraph_end = text.find("\n", start) % (len(text) + 1)  # -1 (last paragraph) becomes len(text)
            selected = range(paragraph_start + span[0], paragraph_end if span[1] == -1 else paragraph_start + span[1])
        highlight = self.screen.get_component_rich_style("screen--selection") if selected else None
        segments: list[Segment] = []
        token = max(bisect_right(offsets, start) - 1, 0)
        while token < len(offsets) and offsets[token] < end:
            token_end = offsets[token + 1] if token + 1 < len(offsets) else len(text)
            a, b = max(start, offsets[token]), min(end, token_end)
            style = self._token_style(token)
            # Up to three pieces: before, inside and after the selection.
            for lo, hi, piece_style in (
                (a, min(b, selected.start), style),
                (max(a, selected.start), min(b, selected.stop), style + highlight if highlight else style),
                (max(a, selected.stop), b, style),
            ):
                if lo < hi:
                    segments.append(Segment(text[lo:hi], piece_style))
            token += 1
        strip = Strip(segments).crop(0, self.content_size.width)  # a line's trailing spaces may hang over the edge
        return strip.apply_offsets(start - paragraph_start, paragraph)

    def get_selection(self, selection: Selection) -> tuple[str, str] | None:
        """The selected text, as written (wrapping undone)."""
        return selection.extract(self.text), "\n"

    def selection_updated(self, selection: Selection | None) -> None:
        self._strips.clear()
        self.refresh()

    def _token_style(self, token: int) -> RichStyle:
        style = self._token_styles[token]
        if style is None:
            index = self.start + token
            event = self._answer.events[index]
            visual = self.visual_style + self._kind_style(event.special, event.forced)
            if self._probability_colours and not event.forced and not event.special and event.logprobs is not None:
                visual += _probability_style(event.logprobs.probability)
            if token == self._cursor:
                visual += Style(reverse=True)
            style = self._token_styles[token] = (visual + Style.from_meta({"token": index})).rich_style
        return style

    @property
    def _probability_colours(self) -> bool:
        return bool(getattr(self.app, "probability_colours", False))

    def _kind_style(self, special: bool, forced: bool) -> Style:
        style = self._kind_styles.get((special, forced))
        if style is None:
            spec = _KIND_STYLES[special, forced]
            style = self._kind_styles[special, forced] = self.app.stylesheet.parse_style(spec) if spec else Style()
        return style

    def on_click(self, event: events.Click) -> None:
        index = event.style.meta.get("token")
        if index is not None:
            event.stop()
            self._answer.select(int(index))


# Sampled tokens plain; forced ones coloured and underlined; special tokens (markers) bold.
_KIND_STYLES = {
    (False, False): "",
    (False, True): "underline $accent",
    (True, False): "bold $primary",
    (True, True): "bold underline $accent",
}

def _probability_style(p: float) -> Style:
    background = probability_background(p)
    return _background_style(background) if background else Style()


@lru_cache(maxsize=16)
def _background_style(colour: str) -> Style:
    return Style(background=Color.parse(colour))


# Control characters would move the terminal's cursor: tabs become spaces, the rest are dropped (as Content does).
_CONTROL = {code: None for code in (*range(0x09), *range(0x0B, 0x20), 0x7F)} | {0x09: "    "}


def _shown(event: TokenEvent) -> str:
    """A token's text in the transcript; empty for a token whose UTF-8 character completes in a later token."""
    return display_text(event).translate(_CONTROL)


class ToolCallBlock(Collapsible):
    """One tool call: the title says expression and result; expanded it shows the call's own tokens."""

    virtual_size = _SIZE_WITHOUT_RELAYOUT

    def __init__(self, answer: AssistantMessage, segment: TokenSegment) -> None:
        self._segment = segment
        self._run = TokenRun(answer, segment.start, segment.end, classes="tool-tokens")
        self._outcome = Static(classes="tool-outcome")
        self._shown_outcome: Content | None = None
        super().__init__(self._run, self._outcome, title=self._describe(), collapsed=True, classes="tool-call")

    def refresh_segment(self) -> None:
        """Take in the segment's new tokens; the title and outcome line change only when the call's state does
        (a new outcome text costs a layout pass)."""
        self._run.start, self._run.end = self._segment.start, self._segment.end
        self._run.refresh_tokens()
        self.title = self._describe()
        outcome = self._segment.outcome
        if outcome is None:
            shown = Content("running…" if self._segment.call else "")
        elif outcome.kind == "refusal":
            shown = Content.assemble(("refused: ", "bold $error"), outcome.output or "")
        else:
            shown = Content.assemble(("result: ", "bold $success"), outcome.output or "")
        if self._shown_outcome is None or not shown.is_same(self._shown_outcome):
            self._shown_outcome = shown
            self._outcome.update(shown)
        self.set_class(outcome is not None and outcome.kind == "refusal", "-refused")

    def _describe(self) -> str:
        """The call's title, by its tool's own renderer (`Tool.describe`)."""
        call, outcome = self._segment.call, self._segment.outcome
        if call is None:
            return "tool call …"
        refused = outcome is not None and outcome.kind == "refusal"
        output = None if outcome is None or refused else outcome.output
        return TOOLS.describe(call.tool, call.expression, output, refused)


class AssistantMessage(Vertical, can_focus=True):
    """A streamed answer: its token events, segments and token cursor."""

    virtual_size = _SIZE_WITHOUT_RELAYOUT

    BINDINGS = [
        Binding("left", "move(-1)", "Prev token", show=False),
        Binding("right", "move(1)", "Next token", show=False),
        Binding("home", "move_to(0)", "First token", show=False),
        Binding("end", "move_to(-1)", "Last token", show=False),
    ]

    class TokenSelected(Message):
        """The user selected a token of this answer (click or cursor)."""

        def __init__(self, answer: AssistantMessage, index: int, event: TokenEvent) -> None:
            super().__init__()
            self.answer = answer
            self.index = index
            self.event = event

    def __init__(
        self,
        events: Sequence[TokenEvent] = (),
        *,
        message_id: int,
        status: str = "streaming",
        markers: ToolMarkers = NANOCHAT_TOOL_MARKERS,
        reply: Reply | None = None,
    ) -> None:
        """`reply`: the live answer's fold, which the app grows and this widget draws (`show_new`); without it the
        widget folds `events` (a stored answer) into a reply of its own."""
        # Born in its state: a class or text changed after mounting costs another style or layout pass.
        super().__init__(classes="-streaming" if status == "streaming" else "")
        self.message_id = message_id  # its row in the history database
        self.border_title = "assistant"
        self.reply = reply if reply is not None else Reply.of(events, markers)
        self._drawn = 0  # events of the reply already drawn
        self.cursor = -1
        self.status = status
        self._views: dict[int, TokenRun | ToolCallBlock] = {}
        self._first_run = TokenRun(self, 0, 0, growing=status == "streaming")
        self._status_text = ""
        self._status_detail: str | None = None  # kept for `on_mount`: a stream may end before the widget mounts
        self._status_line = Static(classes="status")
        self._status_line.display = False

    def compose(self):
        # The first text run comes with the message: mounting it with the first token would lay the screen out
        # and repaint all of it once more per answer. While streaming it holds a few blank lines for the text.
        yield self._first_run
        yield self._status_line

    def on_mount(self) -> None:
        self.show_new()
        self.set_status(self.status, self._status_detail)

    @property
    def events(self) -> list[TokenEvent]:
        """Every token of the answer (the reply's events)."""
        return self.reply.events

    def extend(self, new_events: Sequence[TokenEvent]) -> None:
        """Fold tokens into the answer's reply and draw them."""
        for event in new_events:
            self.reply.add(event)
        self.show_new()

    def show_new(self) -> None:
        """Draw the reply's tokens not drawn yet, redrawing only the segments they touched."""
        touched = self.reply.segments_since(self._drawn)
        self._drawn = len(self.reply.events)
        for segment in touched:
            view = self._views.get(segment.start)
            if view is None and segment.kind == "text" and segment.start == 0:
                view = self._views[0] = self._first_run
            elif view is None:
                if segment.kind == "tool":
                    view = ToolCallBlock(self, segment)
                    if segment.start == 0:  # the answer opens with a tool call: no text before it
                        self._first_run.stop_growing()
                else:
                    view = TokenRun(self, segment.start, 0, growing=self.status == "streaming")
                self._views[segment.start] = view
                self.mount(view, before=self._status_line)
            if isinstance(view, ToolCallBlock):
                view.refresh_segment()
            else:
                view.end = segment.end
                view.refresh_tokens()

    def set_status(self, status: str, detail: str | None = None) -> None:
        self.status, self._status_detail = status, detail
        text = _STATUS_TEXT.get(status, status)
        if detail:
            text = f"{text}: {detail}" if text else detail
        if text != self._status_text:
            self._status_text = text
            self._status_line.update(Content(text))
            self._status_line.display = bool(text)
        self.set_class(status == "streaming", "-streaming")
        if status != "streaming":
            for run in [self._first_run, *self._views.values()]:
                if isinstance(run, TokenRun):
                    run.stop_growing()

    @property
    def segments(self) -> list[TokenSegment]:
        return self.reply.segments

    def select(self, index: int) -> None:
        """Move the token cursor to `index` and tell the app which token is selected."""
        if not self.events:
            return
        index = max(0, min(index, len(self.events) - 1))
        previous, self.cursor = self.cursor, index
        self._refresh_views_at(previous, index)
        self.post_message(self.TokenSelected(self, index, self.events[index]))

    def action_move(self, delta: int) -> None:
        self.select((self.cursor if self.cursor >= 0 else len(self.events)) + delta)

    def action_move_to(self, index: int) -> None:
        self.select(index if index >= 0 else len(self.events) - 1)

    def _refresh_views_at(self, *indices: int) -> None:
        for segment in self.segments:
            if any(segment.start <= i < segment.end for i in indices):
                view = self._views[segment.start]
                if isinstance(view, ToolCallBlock):
                    view.refresh_segment()
                else:
                    view.refresh_tokens()


class Transcript(VerticalScroll):
    """The scrolling conversation. Follows new tokens only while the reader is already at the bottom."""

    def add(self, *widgets: Widget) -> None:
        follow = self.is_at_bottom
        self.mount(*widgets)
        if follow:
            self.scroll_end(animate=False, immediate=False)

    @property
    def is_at_bottom(self) -> bool:
        return self.scroll_y >= self.max_scroll_y - 1

    def follow_if(self, was_at_bottom: bool) -> None:
        if was_at_bottom:
            self.scroll_end(animate=False, immediate=False)

    def answers(self) -> list[AssistantMessage]:
        return list(self.query(AssistantMessage))
