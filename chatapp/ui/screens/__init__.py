"""Modal screens of the chat TUI: settings, program, history, help."""

from __future__ import annotations

from textual.screen import Screen
from textual.widgets import Input


def match_cursor_blink(screen: Screen) -> None:
    """Make a screen's text inputs follow the app's cursor-blink choice (off in tests and without animations):
    a blinking cursor would make what is on screen depend on timing."""
    blink = getattr(screen.app, "cursor_blink", True)
    for field in screen.query(Input):
        field.cursor_blink = blink
