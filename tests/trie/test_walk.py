"""The compiled (numba) walk equals brute force and the Python walk, from start and mid-match states."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.trie.bitmask import allowed_ids, bitmask_to_bools
from chatapp.trie.dfa import DEAD
from chatapp.trie.regex import compile_regex
from chatapp.trie.slices import SlicedWalker
from chatapp.trie.token_bytes import vocab_bytes
from chatapp.trie.toktrie import TokTrie
from chatapp.trie.walk import CompiledWalker, TokenColumns

from .strategies import regexes


class Vocab:
    """A tokenizer's trie, walker and the token byte columns brute force needs."""

    def __init__(self, tokenizer) -> None:
        self.bytes = vocab_bytes(tokenizer)
        self.trie = TokTrie.build(self.bytes.tokens)
        self.walker = CompiledWalker(self.trie)
        self.columns = TokenColumns.build(self.bytes.tokens)

    def brute(self, dfa, state) -> np.ndarray:
        """The oracle: every token's bytes run through the DFA, O(V x max_len), no trie."""
        return (self.columns.final_states(dfa, state) != DEAD) & self.columns.nonempty


@pytest.fixture(scope="module")
def source_vocab(source_tokenizer) -> Vocab:
    return Vocab(source_tokenizer)


@pytest.fixture(scope="module")
def fallback_vocab(byte_fallback_tokenizer) -> Vocab:
    return Vocab(byte_fallback_tokenizer)


def _states_along(vocab: Vocab, dfa, picks: list[int]) -> list[int]:
    """The start state and the states after consuming allowed tokens chosen by `picks` (indices into the mask)."""
    states = [dfa.start]
    for pick in picks:
        allowed = np.flatnonzero(vocab.brute(dfa, states[-1]))
        if len(allowed) == 0:
            break
        token = int(allowed[pick % len(allowed)])
        states.append(dfa.step(states[-1], vocab.bytes.tokens[token]))
    return states


@settings(max_examples=40)
@given(regexes, st.lists(st.integers(0, 10**6), max_size=3))
def test_compiled_walk_equals_brute_force(source_vocab, rx, picks):
    dfa = compile_regex(rx)
    for state in _states_along(source_vocab, dfa, picks):
        mask = source_vocab.walker.mask(dfa, state)
        assert (bitmask_to_bools(mask, source_vocab.bytes.vocab_size) == source_vocab.brute(dfa, state)).all(), rx


@settings(max_examples=25)
@given(regexes, st.lists(st.integers(0, 10**6), max_size=2))
def test_python_walk_equals_compiled_walk(fallback_vocab, rx, picks):
    dfa = compile_regex(rx)
    for state in _states_along(fallback_vocab, dfa, picks):
        assert (fallback_vocab.trie.walk(dfa.recognizer(state)) == fallback_vocab.walker.mask(dfa, state)).all(), rx


@pytest.mark.parametrize("rx", [r"[0-9]+", r"(.|\n)*", r'"([^"\\]|\\.)*"', r"def [a-z_]+\(\):"])
def test_python_walk_equals_compiled_walk_on_32k(source_vocab, rx):
    dfa = compile_regex(rx)
    assert (source_vocab.trie.walk(dfa.recognizer()) == source_vocab.walker.mask(dfa, dfa.start)).all()


def test_subtree_walk_is_the_mask_of_tokens_with_that_prefix(source_vocab):
    dfa = compile_regex(r"(.|\n)*")
    node = source_vocab.trie.node_for(b"def")
    state = dfa.step(dfa.start, b"def")
    got = allowed_ids(source_vocab.walker.mask(dfa, state, node), source_vocab.bytes.vocab_size)
    expected = [i for i, t in enumerate(source_vocab.bytes.tokens) if t.startswith(b"def") and dfa.accepts(t)]
    assert got.tolist() == expected
    assert len(expected) > 3


def test_dead_state_allows_nothing(source_vocab):
    dfa = compile_regex("abc")
    assert not source_vocab.walker.mask(dfa, DEAD).any()


def test_special_tokens_never_allowed_by_text_regexes(source_vocab):
    dfa = compile_regex(r"[\s\S]*")
    allowed = set(allowed_ids(source_vocab.walker.mask(dfa, dfa.start), source_vocab.bytes.vocab_size).tolist())
    assert not allowed & source_vocab.bytes.special_ids
    assert len(allowed) > 0.9 * source_vocab.bytes.vocab_size


def test_cold_numba_cache_compiles_and_agrees(tmp_path):
    """A fresh process with an empty cache directory compiles the kernels and computes the right mask."""
    script = textwrap.dedent(
        """
        from chatapp.trie.bitmask import allowed_ids
        from chatapp.trie.regex import compile_regex
        from chatapp.trie.toktrie import TokTrie
        from chatapp.trie.walk import CompiledWalker
        tokens = [b"1", b"12", b"a", b"1a", b"123", b"9"]
        dfa = compile_regex("[0-9]+")
        mask = CompiledWalker(TokTrie.build(tokens)).mask(dfa, dfa.start)
        print(allowed_ids(mask, len(tokens)).tolist())
        """
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[0, 1, 4, 5]"
    assert any((tmp_path / "numba").rglob("*.nbi")), "the compiled kernels were cached"


@pytest.fixture(scope="module")
def source_slices(source_vocab) -> SlicedWalker:
    return SlicedWalker(source_vocab.bytes.tokens, source_vocab.bytes.vocab_size)


@settings(max_examples=40)
@given(regexes, st.lists(st.integers(0, 10**6), max_size=3))
def test_sliced_walk_equals_full_walk(source_vocab, source_slices, rx, picks):
    dfa = compile_regex(rx)
    for state in _states_along(source_vocab, dfa, picks):
        assert (source_slices.mask(dfa, state) == source_vocab.walker.mask(dfa, state)).all(), rx


@pytest.mark.parametrize(
    ("rx", "prefix", "universal"),
    [
        (r'"([^"\\]|\\.)*"', b'"', (True, True, True, True)),  # inside a JSON string: every text slice
        (r"[\s\S]*", b"", (True, True, True, True)),
        (r"[^\n]*\n", b"", (False, True, True, True)),  # newline (in the whitespace slice) ends the line
        (r"[0-9]+", b"", (False, False, False, False)),
        (r"[a-z ]{0,12}", b"", (False, False, False, False)),  # bounded: no slice fits entirely
    ],
)
def test_slice_universality(source_slices, rx, prefix, universal):
    dfa = compile_regex(rx)
    assert source_slices.universal(dfa, dfa.step(dfa.start, prefix)) == universal
