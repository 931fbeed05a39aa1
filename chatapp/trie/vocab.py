"""`ConstraintVocab`: everything constraints need from one tokenizer, built once and shared by every row.

Holds the token bytes, the trie, a compiled walker (for masks under a prefix), a sliced walker (for next-token
masks: `slices.py`), a bounded cache of masks per (DFA, state, healing prefix), and
the canonical tokenizer for fast-forward. Building it for a 150k vocabulary takes a fraction of a second.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from chatapp.errors import ConstraintError
from chatapp.trie.bitmask import set_bit
from chatapp.trie.dfa import ByteDFA
from chatapp.trie.slices import SlicedWalker
from chatapp.trie.token_bytes import SPECIAL_TOKEN_MARKER, VocabBytes, vocab_bytes
from chatapp.trie.toktrie import TokTrie
from chatapp.trie.walk import CompiledWalker

MASK_CACHE_SIZE = 2048
"""Masks kept per vocabulary (LRU). A 150k-token mask is 19 KB, so the cache stays under 40 MB."""


FF_CACHE_SIZE = 65536
"""Fast-forward results kept per vocabulary (LRU); each is a few small tuples."""


class LruDict(OrderedDict):
    """A dict that forgets its least recently written entries beyond `capacity`."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


@dataclass(eq=False, repr=False)
class ConstraintVocab:
    """A tokenizer's bytes, trie and mask machinery. Not thread-safe (one walker scratch buffer)."""

    tokenizer: Tokenizer = field(repr=False)
    bytes: VocabBytes = field(repr=False)
    trie: TokTrie = field(repr=False)
    walker: CompiledWalker = field(repr=False)
    sliced: SlicedWalker = field(repr=False)
    ff_cache: LruDict = field(default_factory=lambda: LruDict(FF_CACHE_SIZE), repr=False)
    """Fast-forward results per (DFA, state, context, lookback), shared by all rows (see `Constraint`)."""
    _singles: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _masks: OrderedDict[tuple[ByteDFA, int, bytes, int | None], np.ndarray] = field(
        default_factory=OrderedDict, repr=False
    )

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int | None = None) -> ConstraintVocab:
        """Index `tokenizer`; `vocab_size` may exceed the tokenizer's (a model head padded to a multiple of 64)."""
        vb = vocab_bytes(tokenizer, vocab_size)
        # A raw 0xFF byte token (byte-level `ÿ`, `<0xFF>`) is never valid UTF-8 and would be a proper prefix of
        # every special token's bytes: leave it out of the trie, so only whole special tokens can match 0xFF.
        marker = bytes([SPECIAL_TOKEN_MARKER])
        usable = [b"" if t[:1] == marker and i not in vb.special_ids else t for i, t in enumerate(vb.tokens)]
        trie = TokTrie.build(usable)
        sliced = SlicedWalker(usable, vb.vocab_size)
        return cls(tokenizer=tokenizer, bytes=vb, trie=trie, walker=CompiledWalker(trie), sliced=sliced)

    def __repr__(self) -> str:
        return f"ConstraintVocab(vocab_size={self.vocab_size}, trie_nodes={self.trie.num_nodes})"

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        """Keep pretty-printers (Hypothesis' failure reports) from dumping the whole tokenizer."""
        printer.text(repr(self))

    @property
    def vocab_size(self) -> int:
        return self.bytes.vocab_size

    def token_bytes(self, token: int) -> bytes:
        return self.bytes.tokens[token] if 0 <= token < self.vocab_size else b""

    def token_id(self, name: str) -> int:
        """Id of a token by its name in the tokenizer (e.g. `<|assistant_end|>`); KeyError if absent."""
        token = self.tokenizer.token_to_id(name)
        if token is None:
            raise KeyError(name)
        return token

    def mask(self, dfa: ByteDFA, state: int, prefix: bytes = b"", extra_token: int | None = None) -> np.ndarray:
        """Packed mask of tokens that start with `prefix` and keep `dfa` alive from `state` (cached, read-only).

        `state` is the DFA state *before* `prefix`; the walk starts at the trie node of `prefix` with the state
        after it (empty when no token starts with `prefix`). `extra_token` (the end token once the output is
        complete) is added to the cached copy, so a constraint's mask is one dictionary lookup when warm.
        """
        key = (dfa, state, prefix, extra_token)  # the DFA itself (hashed by identity): an entry keeps it alive
        cached = self._masks.get(key)
        if cached is not None:
            self._masks.move_to_end(key)
            return cached
        if extra_token is not None:
            result = self.mask(dfa, state, prefix).copy()
            set_bit(result, extra_token)
        elif not prefix:
            result = self.sliced.mask(dfa, state)
        else:
            node = self.trie.node_for(prefix)
            if node is None:
                result = np.zeros((self.vocab_size + 31) // 32, dtype=np.uint32)
            else:
                result = self.walker.mask(dfa, dfa.step(state, prefix), node)
        result.setflags(write=False)
        self._masks[key] = result
        if len(self._masks) > MASK_CACHE_SIZE:
            self._masks.popitem(last=False)
        return result

    def special_token_id(self, name: str) -> int:
        """Id of special token `name`; `ConstraintError` if the tokenizer has no such special token."""
        token = self.tokenizer.token_to_id(name)
        if token is None or token not in self.bytes.special_ids:
            raise ConstraintError(
                f"{name!r} is not a special token of this tokenizer",
                hint="name one of: "
                + ", ".join(sorted(self.token_bytes(i)[1:].decode() for i in self.bytes.special_ids)),
            )
        return token

    def special_prefix(self, data: bytes) -> int | None:
        """The special token whose bytes (0xFF + name) start `data`, if any (longest name wins)."""
        found = [i for i in self.bytes.special_ids if data.startswith(self.bytes.tokens[i])]
        return max(found, key=lambda i: len(self.bytes.tokens[i])) if found else None

    def single_token_mask(self, token: int) -> np.ndarray:
        """A read-only mask allowing only `token` (cached: forced tokens repeat across rows and steps)."""
        mask = self._singles.get(token)
        if mask is None:
            mask = np.zeros((self.vocab_size + 31) // 32, dtype=np.uint32)
            set_bit(mask, token)
            mask.setflags(write=False)
            if len(self._singles) < MASK_CACHE_SIZE:
                self._singles[token] = mask
        return mask

    def encode(self, text: str) -> list[int]:
        """Canonical tokenization of plain text (special-token names in it stay text where the tokenizer allows)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids
