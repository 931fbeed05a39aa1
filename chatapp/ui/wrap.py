"""Word wrap for text that only ever grows at its end, re-wrapping just the last line on each append.

A streamed answer gains a few characters ~30 times a second. Wrapping it afresh each time costs the whole answer
per batch; but greedy word wrap decides a line's breaks from that line's own text only, and appended text can only
make the last word longer or add words, which never moves an earlier break. So wrapping resumes at the last line
that starts a word (normally the last line; further back only inside a word folded over several lines).

The rule is the one Textual's `Content` uses (greedy by words, a word's trailing spaces stay on its line, a word
longer than a line is folded), so a run of tokens wraps exactly as the same text in a `Static` would; the tests
check that against `Content.wrap` directly.
"""

from __future__ import annotations

import re
from bisect import bisect_right

from rich.cells import cell_len, chop_cells

_WORD = re.compile(r"\s*\S+\s*")

Line = tuple[int, int]
"""A visual line as `[start, end)` character offsets into the text (no newline; a wrapped line's trailing spaces
dropped)."""


def break_offsets(paragraph: str, width: int) -> list[int]:
    """Offsets at which a paragraph (text without newlines) breaks into lines of at most `width` cells."""
    breaks: list[int] = []
    used = 0  # cells taken on the current line
    for match in _WORD.finditer(paragraph):
        start, word = match.start(), match.group()
        length = cell_len(word.rstrip())  # trailing spaces may hang past the edge
        if width - used >= length:
            used += cell_len(word)
        elif length > width:  # too long for any line: fold it, continuing on the current line's last piece
            pieces = chop_cells(word, width)
            for piece in pieces:
                if start:
                    breaks.append(start)
                start += len(piece)
            used = cell_len(pieces[-1])
        elif used and start:
            breaks.append(start)
            used = cell_len(word)
    return breaks


class WrappedText:
    """A growing text and its visual lines at `width` cells (no lines until a width is set)."""

    def __init__(self, width: int | None = None) -> None:
        self.text = ""
        self.width = width
        self.lines: list[Line] = []
        if width is not None:
            self.rewrap(width)

    def append(self, more: str) -> int:
        """Append `more`; return the index of the first line that may have changed (lines before it did not)."""
        self.text += more
        if self.width is None:
            return 0
        first = len(self.lines) - 1
        while first > 0 and not self._starts_word(self.lines[first][0]):
            first -= 1
        self._wrap_from(first)
        return first

    def rewrap(self, width: int) -> None:
        """Wrap the whole text at a new width."""
        self.width = max(width, 1)
        self.lines = []
        self._wrap_from(0)

    def line_of(self, offset: int) -> int:
        """The index of the line that shows the character at `offset` (or the line a hidden space trails)."""
        return max(bisect_right(self.lines, offset, key=lambda line: line[0]) - 1, 0)

    def _starts_word(self, offset: int) -> bool:
        """Whether a word starts at `offset`: wrapping resumed there breaks exactly as wrapping the whole text.

        A line can also start inside a word (a folded word, or spaces folded off a paragraph's first word); wrapping
        from there would group the characters into words differently.
        """
        text = self.text
        if offset == 0 or text[offset - 1] == "\n":
            return True
        if offset == len(text) or not text[offset - 1].isspace() or text[offset].isspace():
            return False
        # A paragraph's leading spaces belong to its first word: a word starts here only after some other word.
        paragraph = text.rfind("\n", 0, offset) + 1
        return not text[paragraph:offset].isspace()

    def _wrap_from(self, index: int) -> None:
        """Re-wrap from the start of line `index`, which starts a word (or the text)."""
        assert self.width is not None
        start = self.lines[index][0] if index < len(self.lines) else 0
        del self.lines[index:]
        text = self.text
        while True:
            newline = text.find("\n", start)
            end = len(text) if newline < 0 else newline
            paragraph = text[start:end]
            cuts = [0, *break_offsets(paragraph, self.width)]
            ends = [*cuts[1:], len(paragraph)]
            for a, b in zip(cuts, ends, strict=True):
                # A line that wrapped drops its trailing spaces; the paragraph's last line keeps them.
                piece = paragraph[a:b] if b == len(paragraph) else paragraph[a:b].rstrip()
                self.lines.append((start + a, start + a + len(piece)))
            if newline < 0:
                return
            start = newline + 1
