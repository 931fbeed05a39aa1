"""Vocabulary slices: skip most of the trie walk when a grammar state allows a whole class of tokens (llguidance).

Dense states (inside a JSON string, free text) allow nearly every token, and a full walk visits every trie node.
llguidance's answer, reproduced here: split the vocabulary into *slices* by simple regexes (whitespace runs, text
without quotes/backslashes/control characters up to 10, up to 30, any length), each with its own trie, plus a trie
of the remaining tokens. For a DFA state, a slice is *universal* when every string of the slice's language keeps
the DFA alive — decided by a breadth-first search over pairs (grammar state, slice state) that stops at the first
pair where the grammar dies while the slice string could go on. A universal slice contributes its precomputed
token mask (a word-wise OR); the others are walked as usual. The verdict is cached per (DFA, state).

Each token belongs to the first slice whose regex matches it all; the walk over slices gives exactly the mask of
the single full trie (tests hold them equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from chatapp.trie.bitmask import bitmask_from_bools
from chatapp.trie.dfa import DEAD, ByteDFA
from chatapp.trie.regex import compile_regex
from chatapp.trie.toktrie import TokTrie
from chatapp.trie.walk import TokenColumns, walk_into

GENERAL_SLICES = (
    r"[\x20\x0A\x0D\x09]+",
    r'[^"\\\x00-\x1F\x7F]{1,10}',
    r'[^"\\\x00-\x1F\x7F]{1,30}',
    r'[^"\\\x00-\x1F\x7F]+',
)
"""llguidance's `general_slices()`: whitespace, then text without quote, backslash or control characters."""


@njit(cache=True, nogil=True)
def _is_universal(
    transitions: np.ndarray, state: int, slice_transitions: np.ndarray, slice_start: int, queue: np.ndarray
) -> bool:
    """Whether every string the slice DFA accepts (or can still extend) keeps `transitions` alive from `state`."""
    n_slice = slice_transitions.shape[0]
    visited = np.zeros(transitions.shape[0] * n_slice, dtype=np.uint8)
    start = state * n_slice + slice_start
    visited[start] = 1
    queue[0] = start
    head, tail = 0, 1
    while head < tail:
        pair = queue[head]
        head += 1
        s = pair // n_slice
        q = pair % n_slice
        for byte in range(256):
            q2 = slice_transitions[q, byte]
            if q2 == DEAD:
                continue
            s2 = transitions[s, byte]
            if s2 == DEAD:
                return False
            nxt = s2 * n_slice + q2
            if visited[nxt] == 0:
                visited[nxt] = 1
                queue[tail] = nxt
                tail += 1
    return True


@dataclass(frozen=True, eq=False)
class Slice:
    dfa: ByteDFA
    trie: TokTrie
    members: np.ndarray  # packed mask of the tokens in this slice


class SlicedWalker:
    """Drop-in for `CompiledWalker.mask` at the root: OR of universal slices' masks plus walks of the rest."""

    def __init__(self, token_bytes: list[bytes] | tuple[bytes, ...], vocab_size: int, patterns=GENERAL_SLICES):
        self.vocab_size = vocab_size
        tokens = list(token_bytes) + [b""] * (vocab_size - len(token_bytes))
        columns = TokenColumns.build(tokens)
        remaining = np.array([bool(t) for t in tokens])
        self.slices: list[Slice] = []
        for pattern in patterns:
            dfa = compile_regex(pattern)
            member = remaining & dfa.accepting[columns.final_states(dfa, dfa.start)]
            remaining &= ~member
            subset = [t if keep else b"" for t, keep in zip(tokens, member.tolist(), strict=True)]
            self.slices.append(Slice(dfa, TokTrie.build(subset, vocab_size), bitmask_from_bools(member)))
        rest = [t if keep else b"" for t, keep in zip(tokens, remaining.tolist(), strict=True)]
        self.rest = TokTrie.build(rest, vocab_size)
        tries = [s.trie for s in self.slices] + [self.rest]
        self._stack = np.zeros(max(t.max_depth for t in tries) + 2, dtype=np.int32)
        self._words = np.zeros((vocab_size + 1 + 31) // 32, dtype=np.uint32)
        self._universal: dict[tuple[ByteDFA, int], tuple[bool, ...]] = {}
        # implied_by[i]: slices whose universality implies slice i's (every string of i is a prefix of one of theirs)
        self._implied_by = [
            [j for j, wide in enumerate(self.slices) if j != i and self._covers(wide.dfa, narrow.dfa)]
            for i, narrow in enumerate(self.slices)
        ]

    @staticmethod
    def _covers(wide: ByteDFA, narrow: ByteDFA) -> bool:
        queue = np.empty(wide.num_states * narrow.num_states, dtype=np.int64)
        return bool(_is_universal(wide.transitions, wide.start, narrow.transitions, narrow.start, queue))

    def universal(self, dfa: ByteDFA, state: int) -> tuple[bool, ...]:
        """Per slice, whether `dfa` in `state` allows all of it (cached; nested slices reuse the widest verdict)."""
        key = (dfa, state)
        verdict = self._universal.get(key)
        if verdict is None:
            queue = np.empty(dfa.num_states * max(s.dfa.num_states for s in self.slices), dtype=np.int64)
            flags = [False] * len(self.slices)
            for i in reversed(range(len(self.slices))):  # widest first: a universal wide slice settles narrow ones
                if any(flags[j] for j in self._implied_by[i]):
                    flags[i] = True
                else:
                    piece = self.slices[i].dfa
                    flags[i] = bool(_is_universal(dfa.transitions, state, piece.transitions, piece.start, queue))
            verdict = tuple(flags)
            self._universal[key] = verdict
        return verdict

    def forget(self, dfa: ByteDFA, state: int) -> None:
        """Drop the cached slice verdicts of one state (benchmarks time first visits with it)."""
        self._universal.pop((dfa, state), None)

    def mask(self, dfa: ByteDFA, state: int) -> np.ndarray:
        """Packed mask of the tokens `dfa` allows from `state` (a new array), equal to a full-trie walk."""
        words = self._words
        words.fill(0)
        if state != DEAD:
            for flag, piece in zip(self.universal(dfa, state), self.slices, strict=True):
                if flag:
                    words[: len(piece.members)] |= piece.members
                else:
                    self._walk(piece.trie, dfa, state, words)
            self._walk(self.rest, dfa, state, words)
        return words[: (self.vocab_size + 31) // 32].copy()

    def _walk(self, trie: TokTrie, dfa: ByteDFA, state: int, words: np.ndarray) -> None:
        if trie.num_nodes > 1:
            walk_into(trie, dfa, state, 0, self._stack, words)
