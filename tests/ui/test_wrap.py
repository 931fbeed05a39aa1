"""Incremental word wrap (`chatapp.ui.wrap`) against the oracle: Textual's own `Content.wrap` of the whole text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len
from textual.content import Content

from chatapp.ui.wrap import WrappedText, break_offsets

# Words, runs of spaces, newlines and double-width characters: everything that moves a line break.
_PIECES = st.text(alphabet="ab xyz  \n世é", max_size=6)


def _shown_lines(wrapped: WrappedText) -> list[str]:
    """The lines as a terminal shows them: trailing spaces past the edge are cut off (as `Content.wrap` does)."""
    lines = []
    for start, end in wrapped.lines:
        line = wrapped.text[start:end]
        while cell_len(line) > wrapped.width and line.endswith(" "):
            line = line[:-1]
        lines.append(line)
    return lines


def _oracle(text: str, width: int) -> list[str]:
    return [line.plain for line in Content(text).wrap(width)]


@settings(max_examples=300)
@given(pieces=st.lists(_PIECES, max_size=14), width=st.integers(min_value=2, max_value=14))
def test_appending_piece_by_piece_wraps_like_content(pieces, width):
    wrapped = WrappedText(width)
    for piece in pieces:
        before = list(wrapped.lines)
        first = wrapped.append(piece)
        assert wrapped.lines[:first] == before[:first]  # lines before the reported one did not move
    assert _shown_lines(wrapped) == _oracle("".join(pieces), width)


@settings(max_examples=100)
@given(text=st.text(alphabet="ab xyz  \n世é", max_size=60), width=st.integers(min_value=2, max_value=14))
def test_rewrap_at_a_new_width_matches_content(text, width):
    wrapped = WrappedText(40)
    wrapped.append(text)
    wrapped.rewrap(width)
    assert _shown_lines(wrapped) == _oracle(text, width)


def test_usual_prose_resumes_at_the_last_line():
    wrapped = WrappedText(10)
    wrapped.append("The quick brown fox jumps")
    assert _shown_lines(wrapped) == ["The quick", "brown fox", "jumps"]
    assert wrapped.append(" over") == 2
    assert wrapped.append(" the lazy dog") == 2
    assert _shown_lines(wrapped) == ["The quick", "brown fox", "jumps over", "the lazy", "dog"]


def test_a_word_longer_than_a_line_is_folded_and_rewrapped_from_its_start():
    wrapped = WrappedText(4)
    wrapped.append("ab abcdefg")
    assert _shown_lines(wrapped) == ["ab", "abcd", "efg"]
    assert wrapped.append("hij") == 1  # the folded word is re-wrapped from the line it starts on
    assert _shown_lines(wrapped) == ["ab", "abcd", "efgh", "ij"]
    assert break_offsets("abcdefghij", 4) == [4, 8]


def test_line_of_finds_the_line_showing_an_offset():
    wrapped = WrappedText(6)
    wrapped.append("hello world\nbye")
    assert wrapped.lines == [(0, 5), (6, 11), (12, 15)]
    assert [wrapped.line_of(i) for i in (0, 4, 5, 6, 12, 14)] == [0, 0, 0, 1, 2, 2]


def test_no_width_yet_keeps_text_until_wrapped():
    wrapped = WrappedText()
    wrapped.append("some text")
    assert wrapped.lines == []
    wrapped.rewrap(4)
    assert _shown_lines(wrapped) == ["some", "text"]
