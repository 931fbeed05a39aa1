"""Switch the TTFA program: a built-in from the list, none, or a `.toml` file. A program that fails to load
shows its error here and leaves the active program unchanged."""

from __future__ import annotations

from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from chatapp.errors import ProgramError
from chatapp.ui.backend import ChatBackend, ProgramInfo
from chatapp.ui.screens import match_cursor_blink

_NONE = "(none)"


@dataclass(frozen=True)
class ProgramChoice:
    program: ProgramInfo | None


class ProgramScreen(ModalScreen[ProgramChoice | None]):
    """Pick a program; dismisses with the loaded program (already active in the backend), or None if cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, backend: ChatBackend) -> None:
        super().__init__()
        self._backend = backend

    def compose(self) -> ComposeResult:
        current = self._backend.program.name if self._backend.program else _NONE
        names = [_NONE, *self._backend.builtin_programs()]
        with Vertical(id="dialog", classes="dialog") as dialog:
            dialog.border_title = "TTFA program"
            yield Label(f"active: {current}")
            yield OptionList(*(Option(name, id=name) for name in names), id="programs")
            yield Label("or a program file (.toml), Enter to load:")
            yield Input(placeholder="path/to/program.toml", id="program-path", compact=True)
            yield Static(id="error", classes="error")

    def on_mount(self) -> None:
        match_cursor_blink(self)
        self.query_one("#error").display = False
        options = self.query_one(OptionList)
        current = self._backend.program.name if self._backend.program else _NONE
        index = next((i for i in range(options.option_count) if options.get_option_at_index(i).id == current), 0)
        options.highlighted = index

    @on(OptionList.OptionSelected, "#programs")
    def choose_builtin(self, event: OptionList.OptionSelected) -> None:
        name = event.option.id
        self._load(None if name == _NONE else name)

    @on(Input.Submitted, "#program-path")
    def choose_file(self, event: Input.Submitted) -> None:
        if path := event.value.strip():
            self._load(path)

    def _load(self, name_or_path: str | None) -> None:
        try:
            program = self._backend.switch_program(name_or_path)
        except ProgramError as err:
            error = self.query_one("#error", Static)
            error.update(str(err))
            error.display = True
            return
        self.dismiss(ProgramChoice(program))

    def action_cancel(self) -> None:
        self.dismiss(None)
