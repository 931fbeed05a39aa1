"""The tokenizer trainer's options (single digits, isolated characters, spelled quoted words); text still round-trips."""

from __future__ import annotations

from chatapp.recipes.tiny.tokenizer import CHAT_SPECIAL_TOKENS, train_bpe_tokenizer

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


QUOTED = ['How many r in "strawberry"? "strawberry".count("r") {"topic": "a-b", "answer": "x"}'] * 50


def test_isolated_characters_are_never_merged() -> None:
    tok = train_bpe_tokenizer(QUOTED, vocab_size=400, isolated='"-')
    assert not [t for t in tok.get_vocab() if len(t) > 1 and ('"' in t or "-" in t)]
    # The quoted word in the question and in the call are the same ids, each after the same `"` id.
    question = tok.encode(' "strawberry"?').tokens
    call = tok.encode('"strawberry".count("r")').tokens
    assert question[1:3] == call[:2] == ['"', "strawberry"]
    text = 'say "hi" - now, "ok"-ish'
    assert tok.decode(tok.encode(text).ids) == text


def test_without_isolation_quotes_merge_with_their_neighbours() -> None:
    tok = train_bpe_tokenizer(QUOTED, vocab_size=400)
    assert any(len(t) > 1 and '"' in t for t in tok.encode(' "strawberry"?').tokens)


def test_spelled_quoted_words_are_one_id_per_letter_in_question_and_call() -> None:
    tok = train_bpe_tokenizer(QUOTED, vocab_size=400, spell_quoted_words=True)
    question = tok.encode('How many r in "strawberry"?').tokens
    call = tok.encode('"strawberry".count("r")').tokens
    spelled = ['"', *"strawberry", '"']
    assert question[question.index('"') :][: len(spelled)] == spelled
    assert call[: len(spelled)] == spelled
    # Unquoted words still merge (the corpus repeats them, so BPE learned them whole).
    assert "Ġmany" in question and "count" in call
    for text in ['say "hi there" and "ok"', '"Paris" is "capital of France"', 'x"y"z', '""""', 'it "ends here"']:
        assert tok.decode(tok.encode(text).ids) == text


def test_words_are_not_spelled_unless_asked() -> None:
    tok = train_bpe_tokenizer(QUOTED, vocab_size=400)
    assert "strawberry" in tok.encode('"strawberry".count("r")').tokens
