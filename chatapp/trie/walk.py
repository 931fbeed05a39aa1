"""The compiled trie walk for DFA recognizers: the seed's loop over flat arrays, in numba.

`TokTrie.walk` runs the same loop in Python against any recognizer (~200 ns per node); here the recognizer is a
transition table and the stack an int32 array indexed by depth, so a node costs a few table reads and the only
unpredictable branch is the one on `try_push_byte`, as in llguidance. Tests hold both walks to the same masks.

`cache=True` stores the machine code next to this module (or in `NUMBA_CACHE_DIR`); with a cold or unwritable
cache numba compiles on first use (about a second) and carries on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from chatapp.trie.dfa import DEAD, ByteDFA
from chatapp.trie.toktrie import TokTrie, padded_token_matrix


@njit(cache=True, nogil=True)
def _walk_kernel(
    node_byte: np.ndarray,
    node_token: np.ndarray,
    subtree_size: np.ndarray,
    num_parents: np.ndarray,
    transitions: np.ndarray,
    state: int,
    node: int,
    node_depth: int,
    stack: np.ndarray,
    words: np.ndarray,
) -> None:
    """Set the bit of every token in `node`'s subtree whose bytes keep the DFA alive, starting from `state`.

    `stack[d]` is the DFA state after the first `d` bytes of the current path; pops only move the depth `sp`, and
    the last node of a subtree may pop above `node` harmlessly (nothing is read after the loop).
    """
    token = node_token[node]
    words[token >> 5] |= np.uint32(1) << np.uint32(token & 31)
    sp = node_depth
    stack[sp] = state
    p = node + 1
    end = node + subtree_size[node]
    while p < end:
        nxt = transitions[stack[sp], node_byte[p]]
        if nxt != DEAD:
            sp += 1
            stack[sp] = nxt
            token = node_token[p]
            words[token >> 5] |= np.uint32(1) << np.uint32(token & 31)
            if subtree_size[p] == 1:
                sp -= num_parents[p]
            p += 1
        else:
            sp -= num_parents[p] - 1
            p += subtree_size[p]


@njit(cache=True, nogil=True)
def _finish_kernel(words: np.ndarray, bogus: int, duplicate_ids: np.ndarray, primary_ids: np.ndarray) -> None:
    """Clear the interior-node id's bit and copy each primary token's bit to its duplicates."""
    words[bogus >> 5] &= ~(np.uint32(1) << np.uint32(bogus & 31))
    for i in range(len(duplicate_ids)):
        src = primary_ids[i]
        dst = duplicate_ids[i]
        bit = (words[src >> 5] >> np.uint32(src & 31)) & np.uint32(1)
        words[dst >> 5] |= bit << np.uint32(dst & 31)


@njit(cache=True, nogil=True)
def _any_token_below_kernel(
    node_byte: np.ndarray,
    node_token: np.ndarray,
    subtree_size: np.ndarray,
    num_parents: np.ndarray,
    transitions: np.ndarray,
    state: int,
    node: int,
    node_depth: int,
    stack: np.ndarray,
    bogus: int,
) -> bool:
    """The walk of `_walk_kernel`, stopping at the first allowed token strictly below `node`.

    Its own copy of the loop, not a flag on `_walk_kernel`: the mask walk, the hot one, keeps an inner loop with no
    early-exit test (numba compiles one body per function)."""
    sp = node_depth
    stack[sp] = state
    p = node + 1
    end = node + subtree_size[node]
    while p < end:
        nxt = transitions[stack[sp], node_byte[p]]
        if nxt != DEAD:
            if node_token[p] != bogus:
                return True
            sp += 1
            stack[sp] = nxt
            if subtree_size[p] == 1:
                sp -= num_parents[p]
            p += 1
        else:
            sp -= num_parents[p] - 1
            p += subtree_size[p]
    return False


def walk_into(trie: TokTrie, dfa: ByteDFA, state: int, node: int, stack: np.ndarray, words: np.ndarray) -> None:
    """Set in `words` (packed, one spare bit for the interior-node id) the bit of every token below `node` that `dfa`
    allows from `state` (not DEAD), duplicates included; bits already set stay set. `stack` holds the trie's depth."""
    _walk_kernel(
        trie.node_byte,
        trie.node_token,
        trie.subtree_size,
        trie.num_parents,
        dfa.transitions,
        state,
        node,
        int(trie.node_depth[node]),
        stack,
        words,
    )
    _finish_kernel(words, trie.vocab_size, trie.duplicate_ids, trie.primary_ids)


class CompiledWalker:
    """Reusable scratch space (mask words, depth stack) for compiled walks of one trie."""

    def __init__(self, trie: TokTrie) -> None:
        self.trie = trie
        self._stack = np.zeros(trie.max_depth + 2, dtype=np.int32)
        self._words = np.zeros((trie.vocab_size + 1 + 31) // 32, dtype=np.uint32)

    def mask(self, dfa: ByteDFA, state: int, node: int = 0) -> np.ndarray:
        """Packed mask (uint32[ceil(V/32)]) of tokens below `node` that `dfa` allows from `state` (a new array).

        `state` is the DFA state after the bytes of `node`'s path; `node` 0 (the root) gives the full next-token
        mask, a deeper node the mask restricted to tokens that start with its bytes (token healing).
        """
        words = self._words
        words.fill(0)
        if state != DEAD:
            walk_into(self.trie, dfa, state, node, self._stack, words)
        return words[: (self.trie.vocab_size + 31) // 32].copy()

    def any_token_below(self, dfa: ByteDFA, state: int, node: int) -> bool:
        """Whether some token strictly longer than `node`'s path starts with it and keeps `dfa` alive from `state`
        (the DFA state after `node`'s path). Stops at the first one: fast-forward asks this several times a step."""
        trie = self.trie
        if state == DEAD or trie.subtree_size[node] == 1:
            return False
        return bool(
            _any_token_below_kernel(
                trie.node_byte,
                trie.node_token,
                trie.subtree_size,
                trie.num_parents,
                dfa.transitions,
                state,
                node,
                int(trie.node_depth[node]),
                self._stack,
                trie.vocab_size,
            )
        )


@dataclass(frozen=True, eq=False)
class TokenColumns:
    """All tokens' bytes as a zero-padded matrix, longest first, for running a DFA over the whole vocabulary.

    With tokens sorted by length the ones still running at column `k` are the first `running[k]` rows, so each
    column costs one slice instead of a boolean mask over the vocabulary.
    """

    matrix: np.ndarray  # uint8[V, max_len], rows in `order`
    order: np.ndarray  # token id of each row
    running: list[int]  # rows with more than k bytes, per column k
    nonempty: np.ndarray  # bool per token id

    @classmethod
    def build(cls, tokens: list[bytes] | tuple[bytes, ...]) -> TokenColumns:
        matrix, lengths = padded_token_matrix(tokens)
        order = np.argsort(-lengths, kind="stable")
        sorted_lengths = lengths[order]
        running = np.searchsorted(-sorted_lengths, -np.arange(1, matrix.shape[1] + 1), side="right")
        return cls(matrix[order], order, [int(r) for r in running if r > 0], lengths > 0)

    def final_states(self, dfa: ByteDFA, state: int) -> np.ndarray:
        """The DFA state after each token's bytes from `state`, indexed by token id (DEAD stays DEAD)."""
        states = np.full(len(self.order), state, dtype=np.int32)
        table = dfa.transitions
        for col, count in enumerate(self.running):
            states[:count] = table[states[:count], self.matrix[:count, col]]
        result = np.empty_like(states)
        result[self.order] = states
        return result
