"""Switch the TTFA program: a built-in from the list, none, or a `.toml` file. A program that fails to load
shows its error here (and as a notification) and leaves the active program unchanged.

A program compiles against the model's tokenizer, which can take seconds for a large file (within the compiler's
budget): it compiles in a thread worker, never on the UI thread, with a "compiling" line; esc cancels it (and so
does quitting), and the dialog closes once the backend has answered, so what it reports is what is active.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from chatapp.errors import ChatappError
from chatapp.ui.backend import ChatBackend, ProgramInfo
from chatapp.ui.screens import match_cursor_blink

_NONE = "(none)"


@dataclass(frozen=True)
class ProgramChoice:
    program: ProgramInfo | None


class ProgramScreen(ModalScreen[ProgramChoice | None]):
    """Pick a program; dismisses with the loaded program (already active in the backend), or None if cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    class Compiled(Message):
        """The worker's answer: the switched-to program, or the error that refused it (`cancel`: its flag)."""

        def __init__(
            self, cancel: threading.Event, program: ProgramInfo | None, error: ChatappError | None
        ) -> None:
            super().__init__()
            self.cancel, self.program, self.error = cancel, program, error

    def __init__(self, backend: ChatBackend) -> None:
        super().__init__()
        self._backend = backend
        self._cancel: threading.Event | None = None  # set while a program compiles in the worker

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

    @property
    def compiling(self) -> bool:
        return self._cancel is not None

    def _load(self, name_or_path: str | None) -> None:
        if self._cancel is not None:
            return  # one compile at a time
        self._cancel = threading.Event()
        self._show(f"compiling {name_or_path or 'no program'}... (esc cancels)", error=False)
        self._compile(name_or_path, self._cancel)

    @work(thread=True, exclusive=True, group="compile-program", exit_on_error=False)
    def _compile(self, name_or_path: str | None, cancel: threading.Event) -> None:
        try:
            program = self._backend.switch_program(name_or_path, cancel)
        except ChatappError as err:
            self.post_message(self.Compiled(cancel, None, err))
            return
        except Exception as err:  # a bug: reported in the dialog rather than leaving it "compiling" for ever
            failure = ChatappError(
                f"loading {name_or_path} failed: {type(err).__name__}: {err}",
                hint="this is a chatapp bug: please report it; pick another program meanwhile",
            )
            self.post_message(self.Compiled(cancel, None, failure))
            return
        self.post_message(self.Compiled(cancel, program, None))

    @on(Compiled)
    def _compiled(self, message: Compiled) -> None:
        if message.cancel is not self._cancel:
            return  # not the compile this screen is waiting for
        cancelled = message.cancel.is_set()
        self._cancel = None
        if message.error is None:
            # Switched, even if esc came too late to stop it: the dialog reports what is active.
            self.dismiss(ProgramChoice(message.program))
        elif cancelled:
            self.dismiss(None)
        else:
            self._show(str(message.error), error=True)
            self.app.notify(str(message.error), title="Program not loaded", severity="error", timeout=10)

    def _show(self, text: str, *, error: bool) -> None:
        line = self.query_one("#error", Static)
        line.update(text)
        line.set_class(error, "error")
        line.set_class(not error, "status")
        line.display = True

    def action_cancel(self) -> None:
        """Esc: stop a running compile (the dialog closes when the backend confirms), or close the dialog."""
        if self._cancel is not None:
            self._cancel.set()
            self._show("cancelling...", error=False)
            return
        self.dismiss(None)

    def on_unmount(self) -> None:
        # Quitting (ctrl+q) while a program compiles: stop the compile, or the app's exit would wait for it.
        if self._cancel is not None:
            self._cancel.set()
