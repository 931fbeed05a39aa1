"""The token trie laid out flat in DFS preorder, and its non-recursive walk (`docs/trie.md`).

Every node is one index into four parallel arrays: the byte on the edge from its parent, the token that ends there
(or the bogus id `vocab_size` for interior nodes, so the walk writes a bit without branching), `subtree_size`
(the node itself included) and `num_parents` (how many stack entries to pop after the node's subtree to reach the
parent of the node that follows it). Node 0 is the root (the empty string). Siblings are in ascending byte order.

Building never creates per-node Python objects: sorting the token byte strings puts them in DFS preorder, the
longest common prefix (LCP) of neighbours says which of a token's prefixes are new nodes, and subtree ends come
from one vectorised search per depth.

Several ids can share one byte string (tokenizers have duplicates, e.g. an added token equal to a merged one);
the trie holds the smallest id and `duplicate_ids` / `primary_ids` copy its bit to the others after a walk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numba import njit

from chatapp.trie.bitmask import empty_bitmask


class Recognizer(Protocol):
    """A byte-level recognizer with a stack of states: what the trie walk needs (llguidance's `Recognizer`)."""

    def try_push_byte(self, byte: int) -> bool:
        """If `byte` can extend the current prefix, push the new state and return True; else change nothing."""
        ...

    def pop_bytes(self, n: int) -> None:
        """Pop the `n` most recently pushed states."""
        ...


@dataclass(frozen=True, eq=False)
class TokTrie:
    """Flat DFS-ordered token trie over `vocab_size` token ids (see module docstring for the node fields)."""

    vocab_size: int
    node_byte: np.ndarray  # uint8[N]
    node_token: np.ndarray  # int32[N], vocab_size for nodes that end no token
    subtree_size: np.ndarray  # int32[N]
    num_parents: np.ndarray  # int32[N]
    node_depth: np.ndarray  # int32[N], bytes from the root
    duplicate_ids: np.ndarray  # int32[D], tokens whose bytes equal an earlier (primary) token's
    primary_ids: np.ndarray  # int32[D]
    token_bytes: tuple[bytes, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.node_byte)

    @property
    def max_depth(self) -> int:
        return int(self.node_depth.max(initial=0))

    @classmethod
    def build(cls, token_bytes: Sequence[bytes], vocab_size: int | None = None) -> TokTrie:
        """Build the trie for `token_bytes[id]`; tokens with empty bytes are left out (never allowed)."""
        vocab_size = len(token_bytes) if vocab_size is None else vocab_size
        all_lengths = np.fromiter(map(len, token_bytes), dtype=np.int64, count=len(token_bytes))
        ids = np.flatnonzero(all_lengths)
        padded = _padded_matrix(b"".join(token_bytes), all_lengths[ids])
        by_bytes = _lexicographic_order(padded, all_lengths[ids])
        order = ids[by_bytes]
        padded = padded[by_bytes]
        lengths = all_lengths[order]
        lcp = _neighbour_lcp(padded, lengths)

        duplicate = lcp == lengths  # equal to the previous string (a proper prefix would have sorted first)
        new_nodes = np.where(duplicate, 0, lengths - lcp)
        first_node = 1 + np.cumsum(new_nodes) - new_nodes
        num_nodes = 1 + int(new_nodes.sum())

        owner = np.repeat(np.arange(len(order)), new_nodes)  # sorted token whose insertion created each node
        depth = np.empty(num_nodes, dtype=np.int64)
        depth[0] = 0
        depth[1:] = np.arange(1, num_nodes) - np.repeat(first_node, new_nodes) + np.repeat(lcp + 1, new_nodes)

        node_byte = np.zeros(num_nodes, dtype=np.uint8)
        node_byte[1:] = padded[owner, depth[1:] - 1]
        node_token = np.full(num_nodes, vocab_size, dtype=np.int32)
        ends_token = depth[1:] == lengths[owner]
        node_token[1:][ends_token] = order[owner[ends_token]]

        subtree_end = np.empty(num_nodes, dtype=np.int64)
        subtree_end[0] = num_nodes
        subtree_end[1:] = _subtree_ends(depth[1:], owner, np.where(duplicate, np.iinfo(np.int64).max, lcp), first_node)
        depth_after = np.append(depth, 1)[subtree_end]  # a virtual depth-1 node closes the walk at the root
        subtree_size = (subtree_end - np.arange(num_nodes)).astype(np.int32)
        num_parents = (depth - depth_after + 1).astype(np.int32)
        num_parents[0] = 0

        primary_rank = np.maximum.accumulate(np.where(duplicate, 0, np.arange(len(order))))
        return cls(
            vocab_size=vocab_size,
            node_byte=node_byte,
            node_token=node_token,
            subtree_size=subtree_size,
            num_parents=num_parents,
            node_depth=depth.astype(np.int32),
            duplicate_ids=order[duplicate].astype(np.int32),
            primary_ids=order[primary_rank[duplicate]].astype(np.int32),
            token_bytes=tuple(token_bytes),
        )

    def node_for(self, prefix: bytes) -> int | None:
        """The node whose path from the root spells `prefix`, or None if no token starts with `prefix`."""
        found = _find_node(self.node_byte, self.subtree_size, 0, np.frombuffer(prefix, dtype=np.uint8))
        return None if found < 0 else int(found)

    def copy_duplicates(self, bitmask: np.ndarray) -> None:
        """Give every duplicate token the bit of its primary (the walk only marks primaries)."""
        if len(self.duplicate_ids) == 0:
            return
        primary_bits = (bitmask[self.primary_ids >> 5] >> (self.primary_ids & 31).astype(np.uint32)) & 1
        np.bitwise_or.at(bitmask, self.duplicate_ids >> 5, primary_bits << (self.duplicate_ids & 31).astype(np.uint32))

    def walk(self, recognizer: Recognizer, node: int = 0) -> np.ndarray:
        """Packed mask of the tokens below `node` (the node itself included) that `recognizer` accepts as prefixes.

        The recognizer must already be in the state for `node`'s path; it is left as it was found. This is the
        seed's loop verbatim, in plain Python, so it works for any recognizer (the compiled walk in `walk.py` is
        the fast path for DFAs and must give the same mask).
        """
        words = empty_bitmask(self.vocab_size + 1)  # one spare bit for the bogus interior-node id
        node_byte = self.node_byte.tolist()
        node_token = self.node_token.tolist()
        subtree_size = self.subtree_size.tolist()
        num_parents = self.num_parents.tolist()
        token = node_token[node]
        words[token >> 5] |= 1 << (token & 31)
        height = 0  # states this walk has pushed and not yet popped
        p = node + 1
        end = node + subtree_size[node]
        while p < end:
            if recognizer.try_push_byte(node_byte[p]):
                token = node_token[p]
                words[token >> 5] |= 1 << (token & 31)
                height += 1
                pops = num_parents[p] if subtree_size[p] == 1 else 0
                p += 1
            else:
                pops = num_parents[p] - 1
                p += subtree_size[p]
            # Only the last node of a subtree walk pops past `node` (toward the root); the caller owns those states.
            pops = min(pops, height)
            height -= pops
            recognizer.pop_bytes(pops)
        return self._finish(words)

    def _finish(self, words: np.ndarray) -> np.ndarray:
        """Drop the bogus id's bit, trim to the vocabulary's words and copy primaries' bits to duplicates."""
        bogus = self.vocab_size
        words[bogus >> 5] &= ~np.uint32(1 << (bogus & 31))
        mask = words[: (self.vocab_size + 31) // 32].copy()
        self.copy_duplicates(mask)
        return mask


@njit(cache=True, nogil=True)
def _find_node(node_byte: np.ndarray, subtree_size: np.ndarray, node: int, path: np.ndarray) -> int:
    """Follow `path` down from `node` (scanning each sibling list, ascending bytes); -1 if it leaves the trie.

    Compiled because fast-forward asks it for every suffix of the forced bytes, and the root has ~256 children.
    """
    for byte in path:
        p = node + 1
        end = node + subtree_size[node]
        node = -1
        while p < end:
            b = node_byte[p]
            if b == byte:
                node = p
                break
            if b > byte:
                break
            p += subtree_size[p]
        if node < 0:
            return -1
    return node


def padded_token_matrix(tokens: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """`(uint8[V, max_len] zero-padded rows, int64[V] lengths)`: all tokens as one array for vectorised scans."""
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    return _padded_matrix(b"".join(tokens), lengths), lengths


def _padded_matrix(joined: bytes, lengths: np.ndarray) -> np.ndarray:
    """`uint8[len(lengths), max_len]`: the concatenated strings in `joined`, one per row, left-aligned, zero padded."""
    width = int(lengths.max(initial=1))
    flat = np.frombuffer(joined, dtype=np.uint8)
    starts = np.cumsum(lengths) - lengths
    rows = np.repeat(np.arange(len(lengths)), lengths)
    cols = np.arange(len(flat)) - np.repeat(starts, lengths)
    padded = np.zeros((len(lengths), width), dtype=np.uint8)
    padded[rows, cols] = flat
    return padded


def _lexicographic_order(padded: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Stable lexicographic argsort of the padded rows (the DFS preorder of the trie).

    numpy's fixed-width bytes compare like memcmp with zero padding, so a string ending in NUL bytes ties with its
    NUL-less prefix; the length key breaks that tie the right way (prefix first), the row index keeps duplicates
    in ascending id order.
    """
    keys = np.ascontiguousarray(padded).view(f"S{padded.shape[1]}").ravel()
    return np.lexsort((np.arange(len(lengths)), lengths, keys))


def _neighbour_lcp(padded: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Length of the common prefix of each sorted string with the one before it (0 for the first)."""
    lcp = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) < 2:
        return lcp
    shorter = np.minimum(lengths[1:], lengths[:-1])
    within = np.arange(padded.shape[1])[None, :] < shorter[:, None]
    differs = ~((padded[1:] == padded[:-1]) & within)
    differs = np.concatenate((differs, np.ones((len(shorter), 1), dtype=bool)), axis=1)
    lcp[1:] = np.argmax(differs, axis=1)
    return lcp


def _subtree_ends(depth: np.ndarray, owner: np.ndarray, closing_lcp: np.ndarray, first_node: np.ndarray) -> np.ndarray:
    """Index one past each non-root node's subtree: the first later node at the same or a smaller depth.

    In token terms, the subtree of a depth-`d` node created by sorted token `i` ends where the first later token
    `j` with `lcp[j] < d` starts its new nodes (`closing_lcp` is `lcp` with duplicates, which create no nodes, set
    to infinity). That "first later element below d" is found for all nodes at once by binary lifting over a
    sparse table of range minima: about log2(V) vectorised steps instead of a Python loop over nodes.
    """
    num_tokens = len(closing_lcp)
    levels = max(1, int(num_tokens).bit_length())
    minima = [np.append(closing_lcp, -1)]  # minima[k][x] = min(closing_lcp[x : x + 2**k]); index num_tokens = stop
    for k in range(1, levels):
        prev = minima[-1]
        shifted = np.append(prev[1 << (k - 1) :], np.full(1 << (k - 1), -1))
        minima.append(np.minimum(prev, shifted))
    pos = owner + 1
    for k in reversed(range(levels)):
        jump = minima[k][np.minimum(pos, num_tokens)] >= depth
        pos = pos + (jump.astype(np.int64) << k)
    node_starts = np.append(first_node, len(depth) + 1)  # "no closer": the end of the whole trie
    return node_starts[np.minimum(pos, num_tokens)]
