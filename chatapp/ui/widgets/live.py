"""A Static for content that changes many times a second while keeping its size most of the time."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static


class LiveStatic(Static):
    """`show(content)` re-renders, and asks for a layout pass only when the content's height changed.

    `Static.update` lays out the whole screen on every call, because new content may change the widget's size.
    Streaming updates the same few widgets ~30 times a second and their height rarely changes (a line wraps, a
    row is added), so re-laying out every time would spend the UI thread, and the GIL the generation thread needs,
    on work that changes nothing.
    """

    _shown_height: int | None = None

    def show_content(self, content: Content) -> None:
        width = self.content_size.width
        height = content.get_height(self.styles, width) if width else None
        self.update(content, layout=height is None or height != self._shown_height)
        self._shown_height = height
