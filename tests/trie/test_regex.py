"""Regex -> byte DFA against Python's `re`, and its error messages."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.errors import ConstraintError
from chatapp.trie.dfa import DEAD
from chatapp.trie.regex import compile_regex

from .strategies import REGEX_CHARS, regexes


@settings(max_examples=60)
@given(regexes, st.lists(st.text(REGEX_CHARS, max_size=6), min_size=10, max_size=10))
def test_dfa_accepts_what_python_re_fullmatches(rx, texts):
    dfa = compile_regex(rx)
    for text in texts:
        assert dfa.accepts(text.encode()) == bool(re.fullmatch(rx, text, re.ASCII)), (rx, text)


@settings(max_examples=60)
@given(regexes, st.text(REGEX_CHARS, max_size=6))
def test_live_states_are_exactly_completable_prefixes(rx, text):
    """Pruning leaves no state that cannot reach acceptance: a non-dead prefix always has a completion."""
    dfa = compile_regex(rx)
    state = dfa.step(dfa.start, text.encode())
    if state != DEAD:
        completion = _some_completion(dfa, state)
        assert dfa.accepts(text.encode() + completion)


def _some_completion(dfa, state: int) -> bytes:
    """Breadth-first shortest byte string from `state` to acceptance."""
    frontier = {state: b""}
    while True:
        for s, path in frontier.items():
            if dfa.accepting[s]:
                return path
        nxt = {}
        for s, path in frontier.items():
            for byte in range(256):
                t = int(dfa.transitions[s, byte])
                if t != DEAD and t not in nxt:
                    nxt[t] = path + bytes([byte])
        assert nxt, "a live state must reach acceptance"
        frontier = nxt


def test_utf8_is_valid_and_complete():
    dot = compile_regex(".*")
    assert dot.accepts("a\u07ff\u0800\ud7ff\ue000\U0010ffff".encode())
    for invalid in (b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82"):
        assert not dot.accepts(invalid)
    assert not dot.accepts(b"\n")


def test_minimal_state_counts():
    assert compile_regex("[0-9]+").num_states == 3  # dead, start, digits
    assert compile_regex("(a|b)*").num_states == 2


def test_forced_bytes_stop_at_a_choice():
    dfa = compile_regex('\\{"name": "[a-z]+", "age": [0-9]+\\}')
    assert dfa.forced_bytes(dfa.start) == b'{"name": "'
    after = dfa.step(dfa.start, b'{"name": "bob')
    assert dfa.forced_bytes(after) == b""
    after_quote = dfa.step(dfa.start, b'{"name": "bob"')
    assert dfa.forced_bytes(after_quote) == b', "age": '


@pytest.mark.parametrize(
    ("rx", "fragment"),
    [
        ("(a", "does not parse"),
        (r"(a)\1", "not supported"),
        (r"\bword", "not supported"),
        ("^ab", "not supported"),
        ("(?<=a)b", "look-around"),
        ("a(?=b)", "look-around"),
    ],
)
def test_bad_regexes_raise_constraint_error_naming_them(rx, fragment):
    with pytest.raises(ConstraintError) as err:
        compile_regex(rx)
    assert repr(rx) in str(err.value)
    assert fragment in str(err.value)
