"""The conversation: user messages and streamed assistant answers drawn token by token.

An assistant answer owns its token events and a token cursor. It shows them as segments: runs of text
(`TokenRun`) and tool calls (`ToolCallBlock`, collapsible). Sampled tokens are plain; forced tokens are coloured
AND underlined (a cue that survives a colour-blind reader or a monochrome terminal); special tokens are readable
markers like ⟨python⟩. Every token span carries its index as style meta, so a click resolves to a token without
any layout arithmetic; the keyboard cursor (←/→ while the answer is focused) does the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from textual import events
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.message import Message
from textual.style import Style
from textual.widget import Widget
from textual.widgets import Collapsible, Static

from chatapp.engine.events import TokenEvent
from chatapp.ui.tokens import Segment, Segmenter, display_text
from chatapp.ui.widgets.live import LiveStatic

_STATUS_TEXT = {
    "streaming": "",
    "complete": "",
    "interrupted": "⏹ interrupted",
    "error": "✖ error",
}


class UserMessage(Static):
    """A message the user sent."""

    def __init__(self, text: str, *, message_id: int) -> None:
        super().__init__(Content(text))
        self.text = text
        self.message_id = message_id  # its row in the history database
        self.border_title = "you"


class TokenRun(LiveStatic):
    """A run of an answer's tokens rendered as styled spans (`start:end` into the answer's events)."""

    def __init__(self, answer: AssistantMessage, start: int, end: int, *, classes: str = "") -> None:
        super().__init__(classes=classes)
        self._answer = answer
        self.start = start
        self.end = end
        # One styled span per token (None for a token with no text yet), built once when the token arrives: a
        # streamed repaint then only assembles them instead of re-deriving every token's style.
        self._spans: list[tuple[str, Style] | None] = []
        self._styles: dict[tuple[bool, bool], Style] = {}

    def notify_style_update(self) -> None:
        """The theme changed: rebuild spans with the new colours."""
        super().notify_style_update()
        self._spans, self._styles = [], {}

    def refresh_tokens(self) -> None:
        events = self._answer.events
        for index in range(self.start + len(self._spans), self.end):
            self._spans.append(self._span(index, events[index]))
        self.show_content(self._content())

    def _style(self, special: bool, forced: bool) -> Style:
        key = (special, forced)
        if key not in self._styles:
            spec = {
                (False, False): "",
                (False, True): "underline $accent",
                (True, False): "bold $primary",
                (True, True): "bold underline $accent",
            }[key]
            self._styles[key] = self.app.stylesheet.parse_style(spec) if spec else Style()
        return self._styles[key]

    def _span(self, index: int, event: TokenEvent) -> tuple[str, Style] | None:
        text = display_text(event)
        if not text:
            return None  # an incomplete UTF-8 character: its bytes show with a later token
        return text, self._style(event.special, event.forced) + Style.from_meta({"token": index})

    def _content(self) -> Content:
        spans = list(self._spans)
        cursor = self._answer.cursor - self.start
        if 0 <= cursor < len(spans) and (span := spans[cursor]) is not None:
            spans[cursor] = (span[0], span[1] + Style(reverse=True))
        return Content.assemble(*(span for span in spans if span is not None))

    def on_click(self, event: events.Click) -> None:
        index = event.style.meta.get("token")
        if index is not None:
            event.stop()
            self._answer.select(int(index))


class ToolCallBlock(Collapsible):
    """One tool call: the title says expression and result; expanded it shows the call's own tokens."""

    def __init__(self, answer: AssistantMessage, segment: Segment) -> None:
        self._segment = segment
        self._run = TokenRun(answer, segment.start, segment.end, classes="tool-tokens")
        self._outcome = Static(classes="tool-outcome")
        super().__init__(self._run, self._outcome, title=self._describe(), collapsed=True, classes="tool-call")

    def refresh_segment(self) -> None:
        self._run.start, self._run.end = self._segment.start, self._segment.end
        self._run.refresh_tokens()
        self.title = self._describe()
        outcome = self._segment.outcome
        if outcome is None:
            self._outcome.update(Content("running…" if self._segment.call else ""))
        elif outcome.kind == "refusal":
            self._outcome.update(Content.assemble(("refused: ", "bold $error"), outcome.output or ""))
        else:
            self._outcome.update(Content.assemble(("result: ", "bold $success"), outcome.output or ""))
        self.set_class(outcome is not None and outcome.kind == "refusal", "-refused")

    def _describe(self) -> str:
        call, outcome = self._segment.call, self._segment.outcome
        if call is None:
            return "calculator …"
        if outcome is None:
            return f"{call.tool}: {call.expression}"
        if outcome.kind == "refusal":
            return f"{call.tool}: {call.expression}  ✗ refused"
        return f"{call.tool}: {call.expression} = {outcome.output}"


class AssistantMessage(Vertical, can_focus=True):
    """A streamed answer: its token events, segments and token cursor."""

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

    def __init__(self, events: Sequence[TokenEvent] = (), *, message_id: int, status: str = "streaming") -> None:
        super().__init__()
        self.message_id = message_id  # its row in the history database
        self.border_title = "assistant"
        self.events: list[TokenEvent] = []
        self.cursor = -1
        self.status = status
        self._segmenter = Segmenter()
        self._views: dict[int, TokenRun | ToolCallBlock] = {}
        self._status_line = Static(classes="status")
        self._initial = list(events)

    def compose(self):
        yield self._status_line

    def on_mount(self) -> None:
        if self._initial:
            self.extend(self._initial)
        self.set_status(self.status)

    def extend(self, new_events: Sequence[TokenEvent]) -> None:
        """Append streamed tokens and redraw only the segments they touched."""
        self.events.extend(new_events)
        for segment in self._segmenter.feed(new_events):
            view = self._views.get(segment.start)
            if view is None:
                view = ToolCallBlock(self, segment) if segment.kind == "tool" else TokenRun(self, segment.start, 0)
                self._views[segment.start] = view
                self.mount(view, before=self._status_line)
            if isinstance(view, ToolCallBlock):
                view.refresh_segment()
            else:
                view.end = segment.end
                view.refresh_tokens()

    def set_status(self, status: str, detail: str | None = None) -> None:
        self.status = status
        text = _STATUS_TEXT.get(status, status)
        if detail:
            text = f"{text}: {detail}" if text else detail
        self._status_line.update(Content(text))
        self._status_line.display = bool(text)
        self.set_class(status == "streaming", "-streaming")

    @property
    def segments(self) -> list[Segment]:
        return self._segmenter.segments

    def tool_blocks(self) -> list[ToolCallBlock]:
        return list(self.query(ToolCallBlock))

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

    def add(self, widget: Widget) -> None:
        follow = self.is_at_bottom
        self.mount(widget)
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

    def clear(self) -> None:
        self.remove_children()
