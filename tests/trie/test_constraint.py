"""Constraint behaviour on the seed's hand-made vocabulary: fast-forward, token healing, end token, errors."""

from __future__ import annotations

import pytest

from chatapp.errors import ConstraintError
from chatapp.trie.bitmask import allowed_ids, bitmask_to_bools, is_allowed
from chatapp.trie.constraint import Constraint, batch_bitmask
from chatapp.trie.vocab import ConstraintVocab
from tests.trie.local_tokenizers import handmade_bpe

from .conftest import END_TOKEN, SEED_TOKENS

ORDER_SCHEMA = {
    "type": "object",
    "properties": {"orderId": {"type": "string"}, "orderName": {"type": "string"}},
    "required": [],
    "additionalProperties": False,
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name_of_the_person": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name_of_the_person", "age"],
}


@pytest.fixture(scope="module")
def vocab(seed_tokenizer) -> ConstraintVocab:
    return ConstraintVocab.from_tokenizer(seed_tokenizer)


def _pieces(vocab: ConstraintVocab, ids) -> list[bytes]:
    return [vocab.token_bytes(int(t)) for t in ids]


def _allowed(c: Constraint) -> list[bytes]:
    return _pieces(c.vocab, allowed_ids(c.allowed_mask(), c.vocab.vocab_size))


def test_order_is_not_forced_because_order_id_spans_it(vocab):
    c = Constraint.json_schema(ORDER_SCHEMA, vocab, vocab.token_id(END_TOKEN))
    c.consume_tokens(vocab.encode('{"'))
    assert c.forced_bytes() == b"order"
    assert c.ff_tokens() == []
    assert c.healing_prefix() == b"order"
    assert _allowed(c) == [b"order", b"orderId"]  # not o, or, ord, orde: non-canonical splits


def test_healing_off_gives_the_plain_mask(vocab):
    c = Constraint.json_schema(ORDER_SCHEMA, vocab, vocab.token_id(END_TOKEN), token_healing=False)
    c.consume_tokens(vocab.encode('{"'))
    expected = [t for t in vocab.bytes.tokens if t and (b'orderId"'.startswith(t) or b'orderName"'.startswith(t))]
    assert _allowed(c) == sorted(expected, key=vocab.bytes.tokens.index)
    assert b"o" in expected and b"or" in expected


def test_name_of_the_person_forces_all_but_the_quote(vocab):
    """The seed's example (flexible whitespace): `"` is left for the model because `":` is a token."""
    c = Constraint.regex(r'\{"name_of_the_person" ?: ?"[a-z ]*", "age": [0-9]+\}', vocab, vocab.token_id(END_TOKEN))
    c.consume_tokens(vocab.encode('{"'))
    assert c.forced_bytes() == b'name_of_the_person"'
    ff = c.ff_tokens()
    assert _pieces(vocab, ff) == [b"name", b"_of", b"_the", b"_person"]
    assert _allowed(c) == [b"name"]  # while fast-forward tokens exist, only the first is allowed
    c.consume_tokens(ff)
    assert c.ff_tokens() == []
    assert c.healing_prefix() == b'"'
    assert _allowed(c) == [b'"', b'":', b'": ']


def test_compact_json_forces_the_key_separator_and_heals_the_quote(vocab):
    """In chatapp's JSON layout `": ` is forced too; the string's opening quote is healed (`":` could start it)."""
    c = Constraint.json_schema(PERSON_SCHEMA, vocab, vocab.token_id(END_TOKEN))
    c.consume_tokens(vocab.encode('{"'))
    assert c.forced_bytes() == b'name_of_the_person": "'
    assert _pieces(vocab, c.ff_tokens()) == [b"name", b"_of", b"_the", b"_person", b'": ']
    c.consume_tokens(c.ff_tokens())
    assert c.healing_prefix() == b'"'
    assert _allowed(c) == [b'"', b'":', b'": ']


def test_end_token_only_when_accepting(vocab):
    end = vocab.token_id(END_TOKEN)
    c = Constraint.regex("[0-9]+", vocab, end)
    assert not is_allowed(c.allowed_mask(), end)
    with pytest.raises(ConstraintError, match="before the output matched"):
        c.consume(end)
    c.consume(vocab.encode("7")[0])
    assert c.is_accepting() and not c.is_finished()
    assert is_allowed(c.allowed_mask(), end)
    c.consume(end)
    assert c.is_finished()
    assert not c.allowed_mask().any()
    with pytest.raises(ConstraintError, match="after the end token"):
        c.consume(vocab.encode("7")[0])


def test_finished_without_end_token_when_nothing_can_follow(vocab):
    c = Constraint.regex("(ab|a)", vocab)
    c.consume(vocab.encode("a")[0])
    assert c.is_accepting() and c.can_extend() and not c.is_finished()
    c.consume(vocab.encode("b")[0])
    assert c.is_finished()


def test_disallowed_token_raises_naming_the_constraint(vocab):
    c = Constraint.regex("[0-9]+", vocab)
    with pytest.raises(ConstraintError, match=r"not allowed by regex '\[0-9\]\+'"):
        c.consume(vocab.encode("a")[0])
    assert c.tokens == []


def test_special_tokens_only_as_end(vocab):
    c = Constraint.regex("[a-z ]*", vocab)
    allowed = set(allowed_ids(c.allowed_mask(), vocab.vocab_size).tolist())
    assert not allowed & vocab.bytes.special_ids


def test_reset_returns_to_the_start(vocab):
    c = Constraint.regex("ab", vocab)
    c.consume(vocab.encode("a")[0])
    c.reset()
    assert c.state == c.dfa.start and c.tokens == []


def test_batch_bitmask_masks_constrained_rows_only(vocab):
    digits = Constraint.regex("[0-9]+", vocab)
    words = batch_bitmask([digits, None], vocab.vocab_size)
    assert words.shape == (2, (vocab.vocab_size + 31) // 32)
    assert (words[0] == digits.allowed_mask()).all()
    assert bitmask_to_bools(words[1], vocab.vocab_size).all()


@pytest.fixture(scope="module")
def tool_vocab() -> ConstraintVocab:
    return ConstraintVocab.from_tokenizer(handmade_bpe([*SEED_TOKENS, "37", "ok"], [END_TOKEN, "<|python_end|>"]))


def test_named_special_token_is_allowed_only_where_the_regex_puts_it(tool_vocab):
    vocab = tool_vocab
    py_end = vocab.special_token_id("<|python_end|>")
    raw_ff = vocab.bytes.tokens.index(b"\xff")  # byte-level `ÿ`: a proper prefix of every special's bytes
    c = Constraint.regex("[0-9*]+<|python_end|> ?ok", vocab, special_tokens=["<|python_end|>"])
    assert not is_allowed(c.allowed_mask(), py_end)
    c.consume(vocab.encode("37")[0])
    mask = c.allowed_mask()
    assert is_allowed(mask, py_end) and not is_allowed(mask, raw_ff)
    assert not is_allowed(mask, vocab.token_id(END_TOKEN))
    c.consume(py_end)
    assert c.forced_bytes() == b""  # " ok" or "ok": a choice
    c.consume(vocab.encode("ok")[0])
    assert c.is_finished()


def test_fast_forward_runs_through_a_forced_special_token(tool_vocab):
    vocab = tool_vocab
    c = Constraint.regex("order<|python_end|>37", vocab, special_tokens=["<|python_end|>"])
    assert _pieces(vocab, c.ff_tokens()) == [b"order", b"\xff<|python_end|>", b"37"]
    c.consume_tokens(c.ff_tokens())
    assert c.is_finished()


def test_special_token_names_are_checked(tool_vocab):
    with pytest.raises(ConstraintError, match="not a special token"):
        Constraint.regex("a<|nope|>", tool_vocab, special_tokens=["<|nope|>"])
    with pytest.raises(ConstraintError, match="top level"):
        Constraint.regex("(a<|python_end|>)?", tool_vocab, special_tokens=["<|python_end|>"])
    # Without naming it, the text of a special token's name is ordinary text, never the token.
    c = Constraint.regex("<\\|python_end\\|>", tool_vocab)
    assert not is_allowed(c.allowed_mask(), tool_vocab.special_token_id("<|python_end|>"))
