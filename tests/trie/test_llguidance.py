"""Differential tests against llguidance (a test-only dependency): same tokenizer, same regex, same masks and
fast-forward tokens.

Comparable subset: llguidance uses Rust regex syntax, where `\\d`, `\\w`, `\\s` are Unicode classes (ours are
ASCII), so the generated regexes spell classes out. Both anchor the regex at both ends. llguidance allows its EOS
token when the output is complete; our constraint gets the same token as its end token. Our token healing
restricts masks further than llguidance after a non-empty forced prefix, so it is off here (tested on its own
in test_constraint.py and test_fast_forward.py).
"""

from __future__ import annotations

import llguidance
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.trie.bitmask import bitmask_to_bools
from chatapp.trie.constraint import Constraint
from chatapp.trie.json_schema import json_literal, schema_to_regex
from chatapp.trie.vocab import ConstraintVocab

from .strategies import regexes_over

COMPARABLE_ATOMS = ["a", "b", "c", "0", "7", "é", "漢", '"', " ", "[0-9]", ".", "[ab]", "[^a]", "[a-c0-2]", r"\.", "x"]

SCHEMAS = [
    (
        {
            "type": "object",
            "properties": {
                "topic": {"type": "string"},
                "answer": {"type": "string"},
                "count": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "return None"]}},
                "ok": {"type": "boolean"},
            },
            "required": ["topic", "answer"],
        },
        {"topic": "def foo(self):", "answer": "The value is None", "count": 12, "tags": ["return None"], "ok": True},
    ),
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1},
                "nested": {"type": "object", "properties": {"flag": {"type": ["boolean", "null"]}}},
            },
            "required": ["name", "scores", "nested"],
        },
        {"name": "self.assert", "scores": [1.5, -2, 3e10], "nested": {"flag": None}},
    ),
]


@pytest.fixture(scope="module")
def vocab(source_tokenizer) -> ConstraintVocab:
    return ConstraintVocab.from_tokenizer(source_tokenizer)


@pytest.fixture(scope="module")
def ll_tokenizer(source_tokenizer, vocab):
    return llguidance.LLTokenizer(source_tokenizer.to_str(), eos_token=vocab.token_id("<|assistant_end|>"))


class Pair:
    """Our constraint and llguidance's matcher for one regex, advanced together."""

    def __init__(self, vocab: ConstraintVocab, ll_tokenizer, rx: str) -> None:
        self.vocab = vocab
        self.ours = Constraint.regex(rx, vocab, vocab.token_id("<|assistant_end|>"), token_healing=False)
        self.theirs = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_regex(rx), log_level=0)
        assert not self.theirs.is_error(), self.theirs.get_error()

    def masks(self) -> tuple[np.ndarray, np.ndarray]:
        ours = bitmask_to_bools(self.ours.allowed_mask(), self.vocab.vocab_size)
        theirs = np.frombuffer(self.theirs.compute_logit_bias(), dtype=np.uint8)[: self.vocab.vocab_size] > 0
        return ours, theirs

    def check(self, where: str) -> np.ndarray:
        ours, theirs = self.masks()
        diff = [self.vocab.token_bytes(int(t)) for t in np.flatnonzero(ours != theirs)[:8]]
        assert (ours == theirs).all(), f"{where}: masks differ on {diff}"
        words = self.ours.allowed_mask()
        packed = np.frombuffer(self.theirs.compute_bitmask(), dtype="<u4")  # llguidance pads with one more word
        assert (packed[: len(words)] == words).all() and not packed[len(words) :].any(), f"{where}: bitmasks differ"
        assert self.ours.ff_tokens() == self.theirs.compute_ff_tokens(), where
        assert self.ours.forced_bytes() == self.theirs.compute_ff_bytes(), where
        return ours

    def consume(self, token: int) -> None:
        self.ours.consume(token)
        assert self.theirs.consume_token(token), self.theirs.get_error()


@settings(max_examples=30)
@given(regexes_over(COMPARABLE_ATOMS), st.lists(st.integers(0, 10**6), max_size=4))
def test_masks_and_ff_tokens_equal_llguidance_for_generated_regexes(vocab, ll_tokenizer, rx, picks):
    pair = Pair(vocab, ll_tokenizer, rx)
    end = pair.ours.end_token
    for step, pick in enumerate(picks):
        allowed = np.flatnonzero(pair.check(f"{rx!r} step {step}"))
        allowed = allowed[allowed != end]
        if len(allowed) == 0:
            return
        pair.consume(int(allowed[pick % len(allowed)]))
    pair.check(f"{rx!r} final")


@pytest.mark.parametrize(("schema", "instance"), SCHEMAS)
def test_json_schema_paths_equal_llguidance(vocab, ll_tokenizer, schema, instance):
    """Along the canonical tokens of a valid instance, every mask and fast-forward set agrees with llguidance."""
    pair = Pair(vocab, ll_tokenizer, schema_to_regex(schema))
    for i, token in enumerate(vocab.encode(json_literal(instance))):
        pair.check(f"token {i}")
        pair.consume(token)
    pair.check("end")
    assert pair.ours.is_accepting() and pair.theirs.is_accepting()


def test_tokenize_partial_agrees_on_the_seed_cases(seed_tokenizer):
    """llguidance's grammar-free `tokenize_partial` leaves the same bytes unforced as our grammar-aware rule."""
    from chatapp.trie.fast_forward import tokenize_forced

    vocab = ConstraintVocab.from_tokenizer(seed_tokenizer)
    ll = llguidance.LLTokenizer(seed_tokenizer.to_str())
    tokens, rest = ll.tokenize_partial(b"order")
    assert (tokens, rest) == ([], b"order")
    recent = ll.tokenize_bytes(b'{"')
    tokens, rest = ll.tokenize_partial(b'name_of_the_person"', recent_tokens=recent)
    assert rest == b'"'
    assert tokens == tokenize_forced(vocab, b"name_of_the_person", context=b'{"')
