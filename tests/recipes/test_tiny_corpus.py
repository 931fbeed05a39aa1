"""The default model's synthetic corpus: deterministic, well-formed, and a held-out split that is truly held out."""

from __future__ import annotations

import json
import re

import pytest
from tokenizers import pre_tokenizers

from chatapp.chat import ChatFormat
from chatapp.recipes.tiny.corpus import THINK_CLOSE, THINK_OPEN, Conversation, conversation_text, generate_corpus
from chatapp.recipes.tiny.tokenizer import CHAT_SPECIAL_TOKENS, train_bpe_tokenizer

N_TRAIN = 4000
N_HELDOUT = 1000


@pytest.fixture(scope="module")
def train() -> list[Conversation]:
    return generate_corpus(N_TRAIN, "train", seed=0)


@pytest.fixture(scope="module")
def heldout() -> list[Conversation]:
    return generate_corpus(N_HELDOUT, "heldout", seed=0)


def _parts(conv: Conversation) -> list[dict[str, str]]:
    content = conv.messages[-1]["content"]
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def _operands(expression: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", expression)]


def _word(expression: str) -> str:
    match = re.fullmatch(r'"([a-z]+)"\.count\("([a-z])"\)', expression)
    assert match, expression
    return match.group(1)


def test_same_seed_same_corpus_and_prefix_stable(train: list[Conversation]) -> None:
    again = generate_corpus(N_TRAIN, "train", seed=0)
    assert [c.messages for c in again] == [c.messages for c in train]
    # A shorter corpus is a prefix of a longer one: growing the corpus never changes what was already there.
    assert [c.messages for c in generate_corpus(100, "train", seed=0)] == [c.messages for c in train[:100]]
    assert [c.messages for c in generate_corpus(100, "train", seed=1)] != [c.messages for c in train[:100]]


def test_heldout_shares_no_question_operand_or_word_with_train(
    train: list[Conversation], heldout: list[Conversation]
) -> None:
    assert not {c.question for c in train} & {c.question for c in heldout}
    train_numbers = {n for c in train if c.kind == "arithmetic" for n in _operands(c.expression or "")}
    heldout_numbers = {n for c in heldout if c.kind == "arithmetic" for n in _operands(c.expression or "")}
    assert heldout_numbers and not train_numbers & heldout_numbers
    train_words = {_word(c.expression or "") for c in train if c.kind == "letters"}
    heldout_words = {_word(c.expression or "") for c in heldout if c.kind == "letters"}
    assert heldout_words and not train_words & heldout_words


def test_every_kind_and_format_is_covered(train: list[Conversation], heldout: list[Conversation]) -> None:
    for split in (train, heldout):
        assert {c.kind for c in split} == {"arithmetic", "letters", "fact", "smalltalk"}
        assert any(c.think for c in split) and any(c.json_answer for c in split)
        assert any(len(c.messages) > 2 for c in split)  # some multi-turn conversations


def test_tool_outputs_match_python(train: list[Conversation], heldout: list[Conversation]) -> None:
    """Differential check: the recorded calculator output equals Python's own evaluation of the expression."""
    for conv in [*train, *heldout]:
        if conv.expression is None:
            continue
        parts = _parts(conv)
        if parts[0]["type"] == "python":  # no preface: the tool call opens the answer (as the calc program forces)
            parts = [{"type": "text", "text": ""}, *parts]
        assert [p["type"] for p in parts] == ["text", "python", "python_output", "text"]
        assert parts[1]["text"] == conv.expression
        value = eval(conv.expression, {"__builtins__": {}})  # corpus expressions are digits, operators, .count
        assert parts[2]["text"] == conv.expected and float(conv.expected) == value
        assert re.fullmatch(r"-?\d+", conv.expected)  # division is exact: every result is a whole number
        assert re.search(rf"(?<![\d-]){conv.expected}(?!\d)", parts[3]["text"])


def test_json_answers_have_the_exact_shape(train: list[Conversation]) -> None:
    answers = [c for c in train if c.json_answer]
    for conv in answers:
        text = conv.messages[-1]["content"]
        parsed = json.loads(text)
        assert list(parsed) == ["topic", "answer"] and all(isinstance(v, str) for v in parsed.values())
        assert text == json.dumps(parsed, ensure_ascii=False) == conv.expected
        assert "json" in conv.question.lower()


def test_think_answers_open_and_close_once_before_the_answer(train: list[Conversation]) -> None:
    for conv in (c for c in train if c.think):
        parts = _parts(conv)
        first = parts[0]["text"]
        assert first.startswith(THINK_OPEN) and first.count(THINK_OPEN) == first.count(THINK_CLOSE) == 1
        after = first.split(THINK_CLOSE, 1)[1]
        assert after.strip() or parts[1:2] == [{"type": "python", "text": conv.expression}]  # an answer follows
    assert all(THINK_OPEN not in conversation_text(c) for c in train if not c.think)


def test_conversations_render_short_with_the_chat_format(train: list[Conversation]) -> None:
    texts = [conversation_text(c) for c in train[:1000]]
    tokenizer = train_bpe_tokenizer(
        texts, 1024, (*CHAT_SPECIAL_TOKENS, THINK_OPEN, THINK_CLOSE), individual_digits=True
    )
    chat = ChatFormat(tokenizer)
    think_id = tokenizer.token_to_id(THINK_OPEN)
    for conv in train[:1000]:
        ids, mask = chat.render_conversation(conv.messages)
        assert len(ids) <= 160
        assert (think_id in ids) == conv.think
        assert sum(mask) > 0


def test_word_pieces_build_invented_words_and_stay_out_of_heldout(train: list[Conversation]) -> None:
    pieces = ("qqa", "zzb", "xxc")  # pieces no real or random word would produce together
    with_pieces = generate_corpus(N_TRAIN, "train", seed=0, word_pieces=pieces)
    assert generate_corpus(N_TRAIN, "train", seed=0, word_pieces=tuple(reversed(pieces))) == with_pieces
    words = [_word(c.expression or "") for c in with_pieces if c.kind == "letters"]
    built = [w for w in words if re.fullmatch(r"(qqa|zzb|xxc)+", w)]
    # About a third of letter-counting words: 60% are invented, half of those from pieces.
    assert 0.2 < len(built) / len(words) < 0.4
    assert {len(w) // 3 for w in built} == {1, 2, 3}
    # The mix of kinds is unchanged (the random stream itself diverges at the first invented word).
    kinds = [c.kind for c in with_pieces]
    assert abs(kinds.count("letters") - [c.kind for c in train].count("letters")) < N_TRAIN * 0.03
    heldout = generate_corpus(300, "heldout", word_pieces=pieces)
    heldout_words = {_word(c.expression or "") for c in heldout if c.kind == "letters"}
    assert not any(re.fullmatch(r"(qqa|zzb|xxc)+", w) for w in heldout_words)


@pytest.mark.parametrize("bad", [("Abc",), ("ab1",), ("ünï",), ("a b",)])
def test_word_pieces_must_be_lowercase_letters(bad: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="lowercase ASCII letters"):
        generate_corpus(10, "train", word_pieces=bad)


def _question_words(conv: Conversation) -> set[str]:
    """The words of a conversation's question as the tokenizer's pre-tokenizer cuts them (` add` and `Add` differ),
    without the operands, the quoted word and the letter, which the held-out split draws apart on purpose."""
    text = re.sub(r'"[a-z]+"|\d+', " ", conv.question)
    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True).pre_tokenize_str(text)
    return {p for p, _ in pieces if sum(ch.isalpha() for ch in p) > 1}


@pytest.mark.parametrize("kind", ["arithmetic", "letters"])
def test_heldout_phrasings_are_new_but_made_of_words_training_uses(
    train: list[Conversation], heldout: list[Conversation], kind: str
) -> None:
    """Held-out tool questions are phrased in ways training never uses, from words training does use: a model built
    from this corpus alone can only know what `Multiply` means from training questions that say it."""
    known = set().union(*(_question_words(c) for c in train if c.kind == kind))
    for conv in heldout:
        if conv.kind == kind:
            assert _question_words(conv) <= known, (conv.question, sorted(_question_words(conv) - known))
