"""The routing comparison: the answer as generated and as generated with routing off, the divergence marked."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

from chatapp.engine.events import TokenEvent
from chatapp.ui.compare import Comparison
from chatapp.ui.tokens import display_text


def answer_content(events: Sequence[TokenEvent], divergence: int | None) -> Content:
    """An answer's text: tokens before the divergence plain, the diverging token reversed (a cue that needs no
    colour), what follows it dim; forced tokens underlined as in the transcript."""
    parts: list[str | tuple[str, str]] = []
    for index, event in enumerate(events):
        text = display_text(event)
        if divergence is not None and index == divergence:
            style = "bold reverse $warning"
            text = text or "∅"
        elif divergence is not None and index > divergence:
            style = "dim"
        else:
            style = ""
        if event.forced:
            style = f"{style} underline".strip()
        parts.append((text, style) if style else text)
    if divergence is not None and divergence >= len(events):
        parts.append(("⏎ (ends here)", "bold reverse $warning"))
    return Content.assemble(*parts)


class CompareScreen(ModalScreen[None]):
    """Both answers one above the other, with the one-line summary as the title."""

    BINDINGS = [Binding("escape,q,f5", "close", "Close")]

    def __init__(self, comparison: Comparison) -> None:
        super().__init__()
        self.comparison = comparison

    def compose(self) -> ComposeResult:
        comparison = self.comparison
        with VerticalScroll(id="dialog", classes="dialog compare") as dialog:
            dialog.border_title = f"routing on vs off · {comparison.summary}"
            dialog.border_subtitle = "esc close"
            yield Static(Content.styled("routing on (the answer shown)", "bold"), classes="compare-heading")
            yield Static(answer_content(comparison.routed, comparison.divergence), id="routed")
            yield Static(Content.styled("routing off (same seed and settings)", "bold"), classes="compare-heading")
            yield Static(answer_content(comparison.unrouted, comparison.divergence), id="unrouted")

    def action_close(self) -> None:
        self.dismiss(None)
