"""TokTrie layout against a naive prefix-set reference, and the Python walk against brute force."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.trie.bitmask import allowed_ids
from chatapp.trie.token_bytes import vocab_bytes
from chatapp.trie.toktrie import TokTrie

vocabularies = st.lists(st.binary(min_size=0, max_size=5).map(lambda b: bytes(x % 4 for x in b)), max_size=60)
"""Small alphabets force deep sharing, duplicates and empty tokens."""


def _reference_nodes(tokens: list[bytes]) -> list[bytes]:
    """Every distinct non-empty prefix of every token, in the trie's DFS preorder (= lexicographic order)."""
    prefixes = {t[:k] for t in tokens for k in range(1, len(t) + 1)}
    return [b"", *sorted(prefixes)]


class PrefixOf:
    """A recognizer without a DFA: accepts bytes while they are a prefix of one of `targets`."""

    def __init__(self, targets: list[bytes]) -> None:
        self.targets = targets
        self.stack = [b""]

    def try_push_byte(self, byte: int) -> bool:
        grown = self.stack[-1] + bytes([byte])
        if any(t.startswith(grown) for t in self.targets):
            self.stack.append(grown)
            return True
        return False

    def pop_bytes(self, n: int) -> None:
        assert 0 <= n < len(self.stack)
        del self.stack[len(self.stack) - n :]


class BalancedParens:
    """A counter recognizer (not regular beyond its bound): parentheses nested at most `limit` deep."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stack = [0]

    def try_push_byte(self, byte: int) -> bool:
        depth = self.stack[-1] + {ord("("): 1, ord(")"): -1}.get(byte, 0)
        if byte not in b"()x" or not 0 <= depth <= self.limit:
            return False
        self.stack.append(depth)
        return True

    def pop_bytes(self, n: int) -> None:
        del self.stack[len(self.stack) - n :]


def _accepts_all_prefixes(recognizer_factory, data: bytes) -> bool:
    rec = recognizer_factory()
    return all(rec.try_push_byte(b) for b in data)


@settings(max_examples=80)
@given(vocabularies)
def test_layout_matches_reference(tokens):
    trie = TokTrie.build(tokens)
    nodes = _reference_nodes(tokens)
    assert trie.num_nodes == len(nodes)
    paths = [b""]
    for p in range(1, trie.num_nodes):
        paths.append(paths[p - 1][: trie.node_depth[p] - 1] + bytes([trie.node_byte[p]]))
    assert paths == nodes
    for p, path in enumerate(nodes):
        below = [q for q in nodes if q.startswith(path)]
        assert trie.subtree_size[p] == len(below)
        primary = min((i for i, t in enumerate(tokens) if t == path and t), default=len(tokens))
        assert trie.node_token[p] == primary
        if p:
            after = p + trie.subtree_size[p]
            depth_after = len(nodes[after]) if after < len(nodes) else 1
            assert trie.num_parents[p] == len(path) - depth_after + 1
    dups = sorted(zip(trie.duplicate_ids.tolist(), trie.primary_ids.tolist(), strict=True))
    expected = sorted((i, tokens.index(t)) for i, t in enumerate(tokens) if t and tokens.index(t) != i)
    assert dups == expected


@settings(max_examples=80)
@given(vocabularies, st.lists(st.binary(max_size=6).map(lambda b: bytes(x % 4 for x in b)), min_size=1, max_size=4))
def test_python_walk_equals_brute_force(tokens, targets):
    trie = TokTrie.build(tokens)
    rec = PrefixOf(targets)
    mask = trie.walk(rec)
    assert rec.stack == [b""], "the walk must leave the recognizer as it found it"
    expected = [i for i, t in enumerate(tokens) if t and any(g.startswith(t) for g in targets)]
    assert allowed_ids(mask, len(tokens)).tolist() == expected


@settings(max_examples=40)
@given(vocabularies, st.binary(min_size=1, max_size=2).map(lambda b: bytes(x % 4 for x in b)))
def test_subtree_walk_restricts_to_a_prefix(tokens, prefix):
    trie = TokTrie.build(tokens)
    node = trie.node_for(prefix)
    targets = [prefix + b"\x00\x01", prefix + b"\x02"]
    expected = [i for i, t in enumerate(tokens) if t.startswith(prefix) and any(g.startswith(t) for g in targets)]
    if node is None:
        assert not any(t.startswith(prefix) for t in tokens)
        return
    rec = PrefixOf(targets)
    for b in prefix:
        assert rec.try_push_byte(b)
    mask = trie.walk(rec, node)
    assert len(rec.stack) == len(prefix) + 1
    assert allowed_ids(mask, len(tokens)).tolist() == expected


def test_counter_recognizer_on_a_real_vocabulary(source_tokenizer):
    vb = vocab_bytes(source_tokenizer)
    trie = TokTrie.build(vb.tokens)
    mask = trie.walk(BalancedParens(limit=2))
    expected = [i for i, t in enumerate(vb.tokens) if t and _accepts_all_prefixes(lambda: BalancedParens(2), t)]
    assert allowed_ids(mask, vb.vocab_size).tolist() == expected
    assert source_tokenizer.token_to_id("((") in expected
    assert source_tokenizer.token_to_id("(((") not in expected


def test_real_vocabulary_layout_invariants(source_tokenizer):
    vb = vocab_bytes(source_tokenizer)
    trie = TokTrie.build(vb.tokens)
    assert trie.subtree_size[0] == trie.num_nodes
    # Siblings ascend: a node's next sibling (p + subtree_size) at the same depth has a larger byte.
    nxt = np.arange(1, trie.num_nodes) + trie.subtree_size[1:]
    inside = nxt < trie.num_nodes
    p = np.arange(1, trie.num_nodes)[inside]
    same_depth = trie.node_depth[nxt[inside]] == trie.node_depth[p]
    assert (trie.node_byte[nxt[inside]][same_depth] > trie.node_byte[p][same_depth]).all()
    # Every token id with bytes appears exactly once (as a node or as a duplicate).
    marked = np.concatenate((trie.node_token[trie.node_token < trie.vocab_size], trie.duplicate_ids))
    assert sorted(marked.tolist()) == [i for i, t in enumerate(vb.tokens) if t]
