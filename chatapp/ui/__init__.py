"""chatapp.ui: the Textual chat TUI (`chatapp run`) and its SQLite history.

`make_app` builds the app for the CLI and the tests; the app drives a `ChatBackend` and sees generation only as
`Step` events.
"""

from chatapp.ui.app import ChatApp, make_app

__all__ = ["ChatApp", "make_app"]
