"""`stop` strings against a brute-force reference: however the text is split into pieces, what is released is the
text before the first stop string (all of it when there is none), and no piece released so far is ever more than
that (a stream never shows text a stop string takes back)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from chatapp.serve.stops import StopMatcher

ALPHABET = "ab\n<|>é"


def reference(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


@given(
    pieces=st.lists(st.text(ALPHABET, max_size=5), max_size=12),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=0, max_size=4).map(tuple),
)
def test_released_text_is_the_text_before_the_first_stop(pieces, stops) -> None:
    matcher = StopMatcher(stops)
    released = ""
    stopped = False
    seen = ""
    for piece in pieces:
        seen += piece
        check = matcher.push(piece)
        released += check.text
        cut, _ = reference(seen, stops)
        assert cut.startswith(released)  # never more than the final answer allows
        if check.stopped:
            stopped = True
            break
        assert released + matcher.held == seen
    if not stopped:
        released += matcher.flush()
    assert (released, stopped) == reference(seen, stops)


def test_a_stop_string_across_pieces_is_held_then_dropped() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.push("hello ST").text == "hello "
    assert matcher.held == "ST"
    check = matcher.push("OP more")
    assert (check.text, check.stopped) == ("", True)


def test_held_text_that_is_not_a_stop_is_released() -> None:
    matcher = StopMatcher(("STOP",))
    matcher.push("a ST")
    assert matcher.push("ar").text == "STar"
