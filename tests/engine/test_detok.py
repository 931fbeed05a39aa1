"""Incremental detokenization: deltas never hold a broken character and add up to the tokenizer's own decode."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from chatapp.engine.detok import Detokenizer, TokenBytes

# Letters from the sample text plus characters a 512-token byte-level BPE must split into several byte tokens.
ALPHABET = st.sampled_from(list("abcdefgh xyz.,!?0123456789\n\t") + list("éßñ中文字日本語한국🙂🚀👍🏽💡€"))


def stream(detok: Detokenizer, ids: list[int]) -> list[tuple[str, bool]]:
    return [detok.push(token) for token in ids]


@given(text=st.text(ALPHABET, max_size=40))
def test_deltas_are_whole_characters_and_join_to_the_text(chat_tokenizer, text: str) -> None:
    ids = chat_tokenizer.encode(text, add_special_tokens=False).ids
    deltas = stream(Detokenizer(TokenBytes(chat_tokenizer)), ids)
    for delta, special in deltas:
        assert not special
        assert "\ufffd" not in delta
        delta.encode("utf-8")  # no lone surrogates either
    assert "".join(d for d, _ in deltas) == text == chat_tokenizer.decode(ids)


def test_incomplete_bytes_wait_for_the_completing_token(chat_tokenizer) -> None:
    ids = chat_tokenizer.encode("🙂", add_special_tokens=False).ids
    assert len(ids) > 1  # the emoji is split across byte tokens in this small vocabulary
    deltas = [d for d, _ in stream(Detokenizer(TokenBytes(chat_tokenizer)), ids)]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🙂"


def test_special_tokens_decode_to_their_names_and_flush_pending_bytes(chat_tokenizer) -> None:
    detok = Detokenizer(TokenBytes(chat_tokenizer))
    partial = chat_tokenizer.encode("🙂", add_special_tokens=False).ids[:1]
    end = chat_tokenizer.token_to_id("<|assistant_end|>")
    assert stream(detok, partial) == [("", False)]
    text, special = detok.push(end)
    assert special
    assert text == "\ufffd<|assistant_end|>"  # the byte that can never complete is shown, not lost
    assert detok.push(chat_tokenizer.token_to_id("<|python_start|>")) == ("<|python_start|>", True)


def test_flush_renders_a_dangling_byte_once(chat_tokenizer) -> None:
    detok = Detokenizer(TokenBytes(chat_tokenizer))
    stream(detok, chat_tokenizer.encode("中", add_special_tokens=False).ids[:1])
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""
