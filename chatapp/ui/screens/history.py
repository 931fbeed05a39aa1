"""The saved conversations: resume (Enter), rename (r), delete (d). Times are absolute, formatted from the stored
timestamps, so the list is the same whenever it is drawn."""

from __future__ import annotations

import time
from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from chatapp.ui.history import ConversationSummary, HistoryStore
from chatapp.ui.screens import match_cursor_blink


@dataclass(frozen=True)
class ResumeChoice:
    conversation_id: int


def format_time(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(timestamp))


def _prompt(summary: ConversationSummary) -> Content:
    program = f" · {summary.program}" if summary.program else ""
    return Content.assemble(
        (summary.title, "bold"),
        "\n",
        (f"{format_time(summary.updated)} UTC · {summary.messages} messages · {summary.model}{program}", "dim"),
    )


class HistoryScreen(ModalScreen[ResumeChoice | None]):
    """Browse saved chats. Renames and deletes apply at once; resuming dismisses with the chosen id."""

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("r", "rename", "Rename"),
        Binding("d,delete", "delete", "Delete"),
    ]

    def __init__(self, store: HistoryStore, *, current: int | None = None) -> None:
        super().__init__()
        self._store = store
        self._current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog history") as dialog:
            dialog.border_title = "history"
            dialog.border_subtitle = "enter resume · r rename · d delete · esc close"
            yield OptionList(id="conversations")
            yield Label("no saved conversations yet", id="empty")
            yield Input(id="rename", placeholder="new title, Enter to save", compact=True)

    def on_mount(self) -> None:
        match_cursor_blink(self)
        self.query_one("#rename").display = False
        self._reload()

    def _reload(self, highlight: int | None = None) -> None:
        options = self.query_one(OptionList)
        summaries = self._store.list_conversations()
        options.clear_options()
        options.add_options(Option(_prompt(s), id=str(s.id)) for s in summaries)
        self.query_one("#empty").display = not summaries
        if summaries:
            options.highlighted = min(highlight or 0, len(summaries) - 1)
            options.focus()

    def _highlighted_id(self) -> int | None:
        options = self.query_one(OptionList)
        if options.highlighted is None:
            return None
        option_id = options.get_option_at_index(options.highlighted).id
        return int(option_id) if option_id is not None else None

    @on(OptionList.OptionSelected)
    def resume(self, event: OptionList.OptionSelected) -> None:
        if event.option.id is not None:
            self.dismiss(ResumeChoice(int(event.option.id)))

    def action_rename(self) -> None:
        conversation_id = self._highlighted_id()
        if conversation_id is None:
            return
        title = self._store.load(conversation_id).summary.title
        rename = self.query_one("#rename", Input)
        rename.value = title
        rename.display = True
        rename.focus()

    @on(Input.Submitted, "#rename")
    def save_rename(self, event: Input.Submitted) -> None:
        conversation_id = self._highlighted_id()
        title = event.value.strip()
        if conversation_id is not None and title:
            self._store.rename(conversation_id, title)
        event.input.display = False
        self._reload(self.query_one(OptionList).highlighted)

    def action_delete(self) -> None:
        conversation_id = self._highlighted_id()
        if conversation_id is None or self.query_one("#rename").has_focus:
            return
        self._store.delete(conversation_id)
        self._reload(self.query_one(OptionList).highlighted)

    def action_close(self) -> None:
        rename = self.query_one("#rename", Input)
        if rename.display:
            rename.display = False
            self.query_one(OptionList).focus()
            return
        self.dismiss(None)
