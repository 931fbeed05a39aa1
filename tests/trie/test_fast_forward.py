"""Fast-forward tokens are canonical: driving a constraint along the canonical tokenization of valid outputs,
every forced run is exactly the next canonical tokens, and every canonical token is allowed by the healed mask."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.trie.bitmask import allowed_ids, is_allowed
from chatapp.trie.constraint import Constraint
from chatapp.trie.fast_forward import tokenize_forced
from chatapp.trie.json_schema import json_literal
from chatapp.trie.vocab import ConstraintVocab
from tests.trie.local_tokenizers import handmade_bpe

from .conftest import SEED_TOKENS
from .strategies import regexes

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string"},
        "answer": {"type": "string"},
        "count": {"type": "integer"},
        "kind": {"enum": ["return None", "self.assertEqual", "def"]},
        "flags": {"type": "array", "items": {"type": "boolean"}},
    },
    "required": ["topic", "answer"],
}

_text = st.text(st.sampled_from(list("abcdefghij klmnop_().:,'\"\\/é漢0123456789\n")), max_size=12)
instances = st.fixed_dictionaries(
    {"topic": _text, "answer": _text},
    optional={
        "count": st.integers(-(10**6), 10**6),
        "kind": st.sampled_from(SCHEMA["properties"]["kind"]["enum"]),
        "flags": st.lists(st.booleans(), max_size=3),
    },
).map(lambda d: {k: d[k] for k in SCHEMA["properties"] if k in d})  # declared order, as the regex requires


@pytest.fixture(scope="module")
def vocab(source_tokenizer) -> ConstraintVocab:
    return ConstraintVocab.from_tokenizer(source_tokenizer)


def drive(vocab: ConstraintVocab, constraint: Constraint, text: str) -> int:
    """Walk the canonical tokens of `text`; check ff runs and masks on the way; return how many were forced."""
    canonical = vocab.encode(text)
    pos = forced = 0
    while pos < len(canonical):
        ff = constraint.ff_tokens()
        if ff:
            assert ff == canonical[pos : pos + len(ff)], f"non-canonical forcing at token {pos} of {text!r}"
            constraint.consume_tokens(ff)
            pos += len(ff)
            forced += len(ff)
            continue
        token = canonical[pos]
        assert is_allowed(constraint.allowed_mask(), token), f"canonical token {pos} of {text!r} masked out"
        constraint.consume(token)
        pos += 1
    assert constraint.is_accepting()
    assert is_allowed(constraint.allowed_mask(), constraint.end_token)
    return forced


@settings(max_examples=40)
@given(instances)
def test_forced_runs_are_canonical_for_json(vocab, instance):
    c = Constraint.json_schema(SCHEMA, vocab, vocab.token_id("<|assistant_end|>"))
    drive(vocab, c, json_literal(instance))


def test_fast_forward_forces_a_good_share_of_json(vocab):
    instance = {"topic": "numbers", "answer": "forty two", "count": 42, "kind": "return None", "flags": [True]}
    c = Constraint.json_schema(SCHEMA, vocab, vocab.token_id("<|assistant_end|>"))
    text = json_literal(instance)
    assert drive(vocab, c, text) >= len(vocab.encode(text)) // 3


def test_forced_bytes_with_merging_context_are_cut_cleanly():
    """`": ` after a sampled `"` must not reuse the context's bytes: the forced tokens cover only forced bytes."""
    vocab = ConstraintVocab.from_tokenizer(handmade_bpe(SEED_TOKENS))
    assert [vocab.token_bytes(t) for t in tokenize_forced(vocab, b"_of_the", context=b"name")] == [b"_of", b"_the"]
    # `{"` merges across the boundary between context `{` and forced `"`: fall back to tokenizing alone.
    assert [vocab.token_bytes(t) for t in tokenize_forced(vocab, b'"name', context=b"{")] == [b'"', b"name"]


def test_forced_bytes_inside_a_character(seed_tokenizer):
    """Forced bytes that end inside a character stay unforced; ones that finish a character get the context."""
    vocab = ConstraintVocab.from_tokenizer(seed_tokenizer)
    c = Constraint.regex("(é|è)x", vocab)
    assert c.forced_bytes() == b"\xc3"  # both start with 0xC3, then the choice
    assert c.ff_tokens() == []
    assert c.healing_prefix() == b"\xc3"
    c = Constraint.regex("éx", vocab)
    c.consume(vocab.bytes.tokens.index(b"\xc3"))
    assert c.forced_bytes() == b"\xa9x"
    assert [vocab.token_bytes(t) for t in c.ff_tokens()] == [b"\xa9", b"x"]


def _generate(vocab: ConstraintVocab, constraint: Constraint, seed: int, fast_forward: bool, steps: int) -> list[int]:
    """A stand-in model: picks an allowed token by a seeded hash; forces ff tokens when `fast_forward`."""
    out: list[int] = []
    while len(out) < steps and not constraint.is_finished():
        ff = constraint.ff_tokens() if fast_forward else []
        if ff:
            constraint.consume_tokens(ff)
            out += ff
            continue
        allowed = allowed_ids(constraint.allowed_mask(), vocab.vocab_size)
        if len(allowed) == 0:
            break
        token = int(allowed[hash((seed, len(out))) % len(allowed)])
        constraint.consume(token)
        out.append(token)
    return out[:steps]


@settings(max_examples=25)
@given(regexes, st.integers(0, 2**16))
def test_fast_forwarding_emits_the_same_tokens_as_stepping(vocab, rx, seed):
    """DESIGN: the multi-token fast-forward path must emit exactly the tokens of the one-per-step path."""
    end = vocab.token_id("<|assistant_end|>")
    stepped = _generate(vocab, Constraint.regex(rx, vocab, end), seed, fast_forward=False, steps=12)
    forced = _generate(vocab, Constraint.regex(rx, vocab, end), seed, fast_forward=True, steps=12)
    assert forced == stepped
