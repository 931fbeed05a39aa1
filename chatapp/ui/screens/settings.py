"""The settings modal: sampling, routing threshold and a regex constraint, validated before they apply.

Numbers are parsed here (a typo names its field); ranges are `GenerationSettings`' own validation; the regex is
compiled by the backend. Nothing changes unless everything is valid. Beside each sampling value, where it comes from:
the model's own defaults (its generation_config.json), chatapp's built-in default, or set here.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from chatapp.errors import ChatappError, SettingsError, user_message
from chatapp.settings import SAMPLING_FIELDS, GenerationSettings, with_model_defaults
from chatapp.ui.backend import TUI_SETTINGS, ChatBackend
from chatapp.ui.screens import match_cursor_blink


@dataclass(frozen=True)
class _Field:
    name: str
    label: str
    kind: Callable[[str], object]
    optional: bool = False  # blank means None


def _strings(text: str) -> tuple[str, ...]:
    """A JSON list of strings, as the sequence breakers are written in the form."""
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(text) from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(text)
    return tuple(value)


def _shown(value: object) -> str:
    if value is None:
        return ""
    return json.dumps(list(value)) if isinstance(value, tuple) else str(value)


_KIND_NAMES = {int: "a whole number", float: "a number", _strings: 'a JSON list of strings, e.g. ["\\n", ":"]'}

_FIELDS = (
    _Field("temperature", "temperature (0 = greedy)", float),
    _Field("top_k", "top-k (0 = off)", int),
    _Field("top_p", "top-p (1 = off)", float),
    _Field("min_p", "min-p (0 = off)", float),
    _Field("repetition_penalty", "repetition penalty (1 = off)", float),
    _Field("presence_penalty", "presence penalty (0 = off)", float),
    _Field("frequency_penalty", "frequency penalty (0 = off)", float),
    _Field("repeat_last_n", "penalties' window (-1 = all)", int),
    _Field("dry_multiplier", "DRY multiplier (0 = off)", float),
    _Field("dry_base", "DRY base", float),
    _Field("dry_allowed_length", "DRY allowed length", int),
    _Field("dry_penalty_last_n", "DRY window (-1 = all)", int),
    _Field("dry_sequence_breakers", "DRY sequence breakers", _strings),
    _Field("max_tokens", "max tokens", int),
    _Field("seed", "seed", int),
    _Field("routing_threshold", "routing threshold (blank = model's)", float, optional=True),
    _Field("routing_level", "routing level (off, or the model's; blank = its default)", str, optional=True),
)


@dataclass(frozen=True)
class SettingsChoice:
    settings: GenerationSettings
    constraint: str | None


def parse_settings(
    base: GenerationSettings, values: dict[str, str], levels: tuple[str, ...] | None = None
) -> GenerationSettings:
    """Settings from the form's text values; `SettingsError` naming the field on a bad number or range, or on a
    routing level that is not one of the model's `levels`."""
    changes: dict[str, object] = {}
    for spec in _FIELDS:
        if spec.name not in values:  # a field the form does not show keeps its value
            continue
        raw = values[spec.name].strip()
        if not raw and spec.optional:
            changes[spec.name] = None
            continue
        try:
            changes[spec.name] = spec.kind(raw)
        except ValueError:
            kind = _KIND_NAMES[spec.kind]
            raise SettingsError(f"{spec.label}: {raw!r} is not {kind}", hint=f"type {kind}") from None
    level = changes.get("routing_level")
    if levels is not None and level is not None and level not in levels:
        raise SettingsError(f"routing level: this model has no level {level!r}", hint=f"type one of: {', '.join(levels)}")
    return base.with_(**changes)


class SettingsScreen(ModalScreen[SettingsChoice | None]):
    """Edit generation settings; dismisses with the new choice, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, backend: ChatBackend) -> None:
        super().__init__()
        self._backend = backend
        self._cancel: threading.Event | None = None  # set while a regex compiles in the worker

    def compose(self) -> ComposeResult:
        settings = self._backend.settings
        with Vertical(id="dialog", classes="dialog settings") as dialog:
            dialog.border_title = "settings"
            with Grid(id="settings-grid"):
                for spec in _FIELDS:
                    yield Label(spec.label)
                    yield Input(_shown(getattr(settings, spec.name)), id=f"set-{spec.name}", compact=True)
                    yield Label(self._source(spec.name), classes="source")
                yield Label("constraint regex (blank = none)")
                yield Input(self._backend.constraint or "", id="set-constraint", compact=True)
                yield Label("")
            yield Static(id="error", classes="error")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def _source(self, name: str) -> str:
        """Where the value of sampling setting `name` comes from (blank for the other settings)."""
        if name not in SAMPLING_FIELDS:
            return ""
        model_defaults = dict(self._backend.info.sampling_defaults)
        default = with_model_defaults(TUI_SETTINGS, model_defaults)
        if getattr(self._backend.settings, name) != getattr(default, name):
            return "set here"
        return "model's" if name in model_defaults else "built-in"

    def on_mount(self) -> None:
        match_cursor_blink(self)
        self.query_one("#error").display = False

    @on(Button.Pressed, "#save")
    @on(Input.Submitted)
    def save(self) -> None:
        values = {spec.name: self.query_one(f"#set-{spec.name}", Input).value for spec in _FIELDS}
        constraint = self.query_one("#set-constraint", Input).value.strip() or None
        if self._cancel is not None:
            return  # a compile is already running
        try:
            settings = parse_settings(self._backend.settings, values, self._backend.info.routing_levels)
        except ChatappError as err:
            self.show_error(err)
            return
        if constraint is None:
            self._apply(settings, constraint)
            return
        # A regex may take seconds to compile (within its budget): never on the UI thread, and esc cancels it.
        self._cancel = threading.Event()
        error = self.query_one("#error", Static)
        error.update("compiling the regex... (esc cancels)")
        error.display = True
        self._compile(settings, constraint, self._cancel)

    @work(thread=True, exclusive=True, group="compile-regex")
    def _compile(self, settings: GenerationSettings, constraint: str, cancel: threading.Event) -> None:
        from chatapp.trie.budget import CompileBudget, metered
        from chatapp.trie.regex import compile_regex

        try:
            with metered(f"regex {constraint!r}", CompileBudget(cancel=cancel)):
                compile_regex(constraint)
        except ChatappError as err:
            if not cancel.is_set():
                self.app.call_from_thread(self._compiled, settings, constraint, err)
            return
        if not cancel.is_set():
            self.app.call_from_thread(self._compiled, settings, constraint, None)

    def _compiled(self, settings: GenerationSettings, constraint: str, err: ChatappError | None) -> None:
        self._cancel = None
        if err is not None:
            self.show_error(err)
            return
        self._apply(settings, constraint)

    def _apply(self, settings: GenerationSettings, constraint: str | None) -> None:
        try:
            self._backend.configure(settings, constraint)  # the regex, if any, is compiled and cached by now
        except ChatappError as err:
            self.show_error(err)
            return
        self.dismiss(SettingsChoice(settings, constraint))

    def show_error(self, err: ChatappError) -> None:
        error = self.query_one("#error", Static)
        error.update(user_message(err).text())
        error.display = True

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()  # the worker stops at its compile's next tick
            self._cancel = None
        self.dismiss(None)
