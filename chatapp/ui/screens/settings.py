"""The settings modal: sampling, routing threshold and a regex constraint, validated before they apply.

Numbers are parsed here (a typo names its field); ranges are `GenerationSettings`' own validation; the regex is
compiled by the backend. Nothing changes unless everything is valid.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from chatapp.errors import ChatappError, SettingsError
from chatapp.settings import GenerationSettings
from chatapp.ui.backend import ChatBackend
from chatapp.ui.screens import match_cursor_blink


@dataclass(frozen=True)
class _Field:
    name: str
    label: str
    kind: type
    optional: bool = False  # blank means None


_FIELDS = (
    _Field("temperature", "temperature (0 = greedy)", float),
    _Field("top_k", "top-k (0 = off)", int),
    _Field("top_p", "top-p (1 = off)", float),
    _Field("max_tokens", "max tokens", int),
    _Field("seed", "seed", int),
    _Field("routing_threshold", "routing threshold (blank = model's)", float, optional=True),
)


@dataclass(frozen=True)
class SettingsChoice:
    settings: GenerationSettings
    constraint: str | None


def parse_settings(base: GenerationSettings, values: dict[str, str]) -> GenerationSettings:
    """Settings from the form's text values; `SettingsError` naming the field on a bad number or range."""
    changes: dict[str, object] = {}
    for spec in _FIELDS:
        raw = values.get(spec.name, "").strip()
        if not raw and spec.optional:
            changes[spec.name] = None
            continue
        try:
            changes[spec.name] = spec.kind(raw)
        except ValueError:
            kind = "a whole number" if spec.kind is int else "a number"
            raise SettingsError(f"{spec.label}: {raw!r} is not {kind}", hint=f"type {kind}") from None
    return base.with_(**changes)


class SettingsScreen(ModalScreen[SettingsChoice | None]):
    """Edit generation settings; dismisses with the new choice, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, backend: ChatBackend) -> None:
        super().__init__()
        self._backend = backend

    def compose(self) -> ComposeResult:
        settings = self._backend.settings
        with Vertical(id="dialog", classes="dialog") as dialog:
            dialog.border_title = "settings"
            with Grid(id="settings-grid"):
                for spec in _FIELDS:
                    value = getattr(settings, spec.name)
                    yield Label(spec.label)
                    yield Input("" if value is None else str(value), id=f"set-{spec.name}", compact=True)
                yield Label("constraint regex (blank = none)")
                yield Input(self._backend.constraint or "", id="set-constraint", compact=True)
            yield Static(id="error", classes="error")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        match_cursor_blink(self)
        self.query_one("#error").display = False

    @on(Button.Pressed, "#save")
    @on(Input.Submitted)
    def save(self) -> None:
        values = {spec.name: self.query_one(f"#set-{spec.name}", Input).value for spec in _FIELDS}
        constraint = self.query_one("#set-constraint", Input).value.strip() or None
        try:
            settings = parse_settings(self._backend.settings, values)
            self._backend.configure(settings, constraint)
        except ChatappError as err:
            self.show_error(err)
            return
        self.dismiss(SettingsChoice(settings, constraint))

    def show_error(self, err: ChatappError) -> None:
        error = self.query_one("#error", Static)
        error.update(str(err))
        error.display = True

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
