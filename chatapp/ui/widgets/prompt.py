"""The message input: Enter sends, ctrl+j inserts a newline, up/down walk the prompt history.

Up recalls an older prompt only when the cursor is already on the first line (and down a newer one on the last
line), so moving around inside a multi-line draft still works. The draft being typed is kept while browsing.
"""

from __future__ import annotations

from collections.abc import Sequence

from textual import events
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    """A multi-line input that posts `Submitted` on Enter."""

    class Submitted(Message):
        def __init__(self, prompt: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    def __init__(self, history: Sequence[str] = (), *, id: str | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus", compact=True)
        self.prompt_history: list[str] = list(history)
        self._browse: int | None = None  # index into history while browsing it
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.submit()
            return
        if event.key == "ctrl+j":
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self.replace("\n", start, end, maintain_selection_offset=False)
            return
        await super()._on_key(event)

    def submit(self) -> None:
        text = self.text.strip()
        if not text:
            return
        if not self.prompt_history or self.prompt_history[-1] != text:
            self.prompt_history.append(text)
        self._browse = None
        self._draft = ""
        self.clear()
        self.post_message(self.Submitted(self, text))

    def action_cursor_up(self, select: bool = False) -> None:
        if select or not self.cursor_at_first_line or not self.prompt_history:
            super().action_cursor_up(select)
            return
        if self._browse is None:
            self._draft = self.text
            self._browse = len(self.prompt_history)
        if self._browse > 0:
            self._browse -= 1
            self._show(self.prompt_history[self._browse])

    def action_cursor_down(self, select: bool = False) -> None:
        if select or not self.cursor_at_last_line or self._browse is None:
            super().action_cursor_down(select)
            return
        self._browse += 1
        if self._browse >= len(self.prompt_history):
            self._browse = None
            self._show(self._draft)
        else:
            self._show(self.prompt_history[self._browse])

    def set_text(self, text: str) -> None:
        """Replace the draft (e.g. with the message being edited) and put the cursor at its end."""
        self._browse = None
        self._show(text)

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)
