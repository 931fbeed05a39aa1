"""Token bytes: every tokenizer scheme round-trips text through the bytes of its tokens; llguidance agrees."""

from __future__ import annotations

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.trie.token_bytes import SPECIAL_TOKEN_MARKER, vocab_bytes

from .conftest import UNICODE_SAMPLES

TEXTS = ["def f(x):\n    return x + 1\n", "  two  spaces\tand tab", *UNICODE_SAMPLES]


def _joined(vb, ids) -> bytes:
    return b"".join(vb.tokens[i] for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_concatenate_to_the_text(source_tokenizer, text):
    vb = vocab_bytes(source_tokenizer)
    assert _joined(vb, source_tokenizer.encode(text).ids) == text.encode()


@pytest.mark.parametrize("text", TEXTS)
def test_byte_fallback_tokens_concatenate_to_the_text(byte_fallback_tokenizer, text):
    vb = vocab_bytes(byte_fallback_tokenizer)
    ids = byte_fallback_tokenizer.encode(text).ids
    # Metaspace (prepend_scheme "always") writes spaces as `▁` and prepends one unless the text starts with one.
    expected = text if text.startswith(" ") else " " + text
    assert _joined(vb, ids) == expected.encode()


def test_byte_fallback_pieces_are_single_bytes(byte_fallback_tokenizer):
    vb = vocab_bytes(byte_fallback_tokenizer)
    for b in range(256):
        token_id = byte_fallback_tokenizer.token_to_id(f"<0x{b:02X}>")
        assert vb.tokens[token_id] == bytes([b])
    assert vb.tokens[byte_fallback_tokenizer.token_to_id("▁")] == b" "


@settings(max_examples=40)
@given(st.text(st.characters(exclude_characters="|", codec="utf-8"), min_size=1, max_size=30))
def test_any_text_round_trips_through_byte_level_tokens(source_tokenizer, text):
    vb = vocab_bytes(source_tokenizer)
    assert _joined(vb, source_tokenizer.encode(text, add_special_tokens=False).ids) == text.encode()


def test_special_tokens_are_marked_and_unreachable_from_text(source_tokenizer):
    vb = vocab_bytes(source_tokenizer)
    end = source_tokenizer.token_to_id("<|assistant_end|>")
    assert end in vb.special_ids
    assert vb.tokens[end] == bytes([SPECIAL_TOKEN_MARKER]) + b"<|assistant_end|>"
    assert vb.special_bytes("<|assistant_end|>") == vb.tokens[end]
    # Typed text that spells a special token's name is ordinary bytes, never the marker.
    assert bytes([SPECIAL_TOKEN_MARKER]) not in _joined(vb, source_tokenizer.encode("<|assistant_end|>").ids[1:])


def test_model_vocab_padding_gives_empty_tokens(seed_tokenizer):
    size = seed_tokenizer.get_vocab_size()
    vb = vocab_bytes(seed_tokenizer, vocab_size=size + 7)
    assert vb.vocab_size == size + 7
    assert vb.tokens[size:] == [b""] * 7


@pytest.mark.parametrize("name", ["source_tokenizer", "byte_fallback_tokenizer", "seed_tokenizer"])
def test_token_bytes_equal_llguidance(request, name):
    """llguidance reads tokenizer.json its own way (Rust); both must give each token the same bytes.

    llguidance's `decode_bytes` drops special tokens' 0xFF marker (we keep it) and gives byte-level `ÿ` (the raw
    byte 0xFF, which it reserves as its marker) no bytes; everything else must be identical.
    """
    tokenizer = request.getfixturevalue(name)
    vb = vocab_bytes(tokenizer)
    ll = llguidance.LLTokenizer(tokenizer.to_str())
    assert ll.vocab_size == vb.vocab_size
    for token_id, ours in enumerate(vb.tokens):
        theirs = ll.decode_bytes([token_id])
        if token_id in vb.special_ids:
            assert ll.is_special_token(token_id)
            assert ours == bytes([SPECIAL_TOKEN_MARKER]) + theirs
        elif ours == bytes([SPECIAL_TOKEN_MARKER]):
            assert theirs == b""
        else:
            assert ours == theirs, token_id
