"""chatapp.ui: the Textual chat TUI (`chatapp run`) and its SQLite history.

`make_app` builds the app for the CLI and the tests; the app drives a `ChatBackend` and sees generation only as
`Step` events.

The exports load on first use: the engine process imports `chatapp.ui.process` from this package, and importing
Textual's app there (~0.5 s) would delay the model, which the first answer waits for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatapp.ui.app import ChatApp, make_app

__all__ = ["ChatApp", "make_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from chatapp.ui import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
