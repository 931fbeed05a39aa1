"""Help: the keys (read from the app's own bindings, so the list cannot go stale) and where files live."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static


@dataclass(frozen=True)
class HelpFacts:
    """What the help screen lists besides the keys."""

    keys: tuple[tuple[str, str], ...]
    paths: tuple[tuple[str, str], ...]


# Keys handled inside widgets rather than by app bindings.
WIDGET_KEYS = (
    ("enter", "send the message"),
    ("ctrl+j", "new line in the message"),
    ("up / down", "previous / next prompt (from the first / last line)"),
    ("shift+tab", "focus the last answer; ←/→ move the token cursor"),
    ("click a token", "inspect it: id, forced or sampled, zone tags, routing, probability and alternatives"),
    ("click the inspector", "the layer lens (f7): the token's probability through the layers, top 3, decision"),
)


def binding_keys(bindings: Iterable[Binding]) -> tuple[tuple[str, str], ...]:
    return tuple((b.key_display or b.key, b.description) for b in bindings if b.description)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "close", "Close")]

    def __init__(self, facts: HelpFacts) -> None:
        super().__init__()
        self._facts = facts

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog", classes="dialog help") as dialog:
            dialog.border_title = "help"
            dialog.border_subtitle = "esc close"
            yield Static(self._content())

    def _content(self) -> Content:
        parts: list[str | tuple[str, str]] = [("Keys", "bold"), "\n"]
        width = max(len(k) for k, _ in self._facts.keys) + 2
        for key, what in self._facts.keys:
            parts += [(f"  {key:<{width}}", "$accent"), what, "\n"]
        parts += ["\n", ("Files", "bold"), "\n"]
        width = max(len(k) for k, _ in self._facts.paths) + 2
        for name, path in self._facts.paths:
            parts += [(f"  {name:<{width}}", "$accent"), path, "\n"]
        parts += [
            "\n",
            ("Tokens: ", "bold"),
            "plain = sampled by the model, ",
            ("underlined", "underline $accent"),
            " = forced by the program or a tool, ⟨markers⟩ = special tokens.\n",
        ]
        parts += [
            ("Heatmap: ", "bold"),
            "two STT layers per row (▀ upper, ▄ lower); an empty half or · = skipped; "
            "colour = router probability (dark low, yellow high).",
        ]
        return Content.assemble(*parts)

    def action_close(self) -> None:
        self.dismiss(None)
