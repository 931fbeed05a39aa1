"""The tokenizer trainer's digit option: numbers become one id per digit, and text still round-trips."""

from __future__ import annotations

from chatapp.models.tokenizer import CHAT_SPECIAL_TOKENS, train_bpe_tokenizer

TEXTS = ["What is 37*45? 37*45 is 1665. The year 2024 had 366 days."] * 50


def test_individual_digits_gives_one_token_per_digit() -> None:
    tok = train_bpe_tokenizer(TEXTS, vocab_size=400, individual_digits=True)
    encoding = tok.encode("It is 1665 and 37*45.")
    digit_tokens = [t for t in encoding.tokens if any(ch.isdigit() for ch in t)]
    assert digit_tokens == list("1665") + list("3745")


def test_default_tokenizer_still_merges_digits() -> None:
    tok = train_bpe_tokenizer(TEXTS, vocab_size=400)
    assert any(sum(ch.isdigit() for ch in t) > 1 for t in tok.encode("It is 1665.").tokens)


def test_individual_digits_round_trips_and_keeps_special_ids() -> None:
    specials = (*CHAT_SPECIAL_TOKENS, "<think>", "</think>")
    tok = train_bpe_tokenizer(TEXTS, vocab_size=400, special_tokens=specials, individual_digits=True)
    assert [tok.token_to_id(s) for s in specials] == list(range(len(specials)))
    text = "  x = 3.14159 * -12 ;\n\ttabs and ünïcödé 99 "
    assert tok.decode(tok.encode(text).ids) == text
