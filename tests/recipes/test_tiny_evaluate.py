"""Task-metric judging: reference answers always pass, and each kind of wrong answer fails its metric."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from chatapp.chat import ChatFormat
from chatapp.recipes.tiny.corpus import THINK_CLOSE, THINK_OPEN, Conversation, conversation_text, generate_corpus
from chatapp.recipes.tiny.evaluate import TaskReport, answer_from_tokens, evaluate_tasks, json_shape_ok, judge
from chatapp.recipes.tiny.tokenizer import CHAT_SPECIAL_TOKENS, train_bpe_tokenizer


@pytest.fixture(scope="module")
def heldout() -> list[Conversation]:
    return generate_corpus(400, "heldout", seed=3)


@pytest.fixture(scope="module")
def chat(heldout: list[Conversation]) -> ChatFormat:
    texts = [conversation_text(c) for c in generate_corpus(800, "train", seed=0) + heldout]
    specials = (*CHAT_SPECIAL_TOKENS, THINK_OPEN, THINK_CLOSE)
    return ChatFormat(train_bpe_tokenizer(texts, 1024, specials, individual_digits=True))


def reply_tokens(chat: ChatFormat, messages: list[dict]) -> list[int]:
    """The assistant reply's ids as a model would emit them (through <|assistant_end|>)."""
    ids, _ = chat.render_conversation(messages)
    return ids[len(chat.render_for_completion(messages)) :]


def with_final_text(conv: Conversation, text: str) -> list[dict]:
    parts = [dict(p) for p in conv.messages[-1]["content"]]
    parts[-1]["text"] = text
    return [*conv.prompt, {"role": "assistant", "content": parts}]


def test_reference_answers_pass_every_metric(heldout: list[Conversation], chat: ChatFormat) -> None:
    report = TaskReport()
    for conv in heldout:
        assert judge(conv, answer_from_tokens(reply_tokens(chat, conv.messages), chat), report), conv.messages[-1]
    for _, tally in report.rows():
        assert tally.total > 0 and tally.correct == tally.total


def test_wrong_number_or_missing_tool_call_fails(heldout: list[Conversation], chat: ChatFormat) -> None:
    tool_convs = [c for c in heldout if c.expression is not None]
    for conv in tool_convs[:50]:
        wrong = str(int(conv.expected) + 1)
        messages = with_final_text(conv, f"The answer is {wrong}.")
        assert not judge(conv, answer_from_tokens(reply_tokens(chat, messages), chat), TaskReport())
        # A longer number that merely contains the right digits is not the right answer.
        messages = with_final_text(conv, f"The answer is {conv.expected}7.")
        assert not judge(conv, answer_from_tokens(reply_tokens(chat, messages), chat), TaskReport())
        # Right number, but stated without calling the calculator.
        no_tool = [*conv.prompt, {"role": "assistant", "content": f"The answer is {conv.expected}."}]
        assert not judge(conv, answer_from_tokens(reply_tokens(chat, no_tool), chat), TaskReport())


def test_number_in_tool_output_alone_does_not_count(heldout: list[Conversation], chat: ChatFormat) -> None:
    conv = next(c for c in heldout if c.kind == "arithmetic")
    messages = with_final_text(conv, "Done.")
    answer = answer_from_tokens(reply_tokens(chat, messages), chat)
    assert answer.tool_called and conv.expected in answer.full_text
    assert not judge(conv, answer, TaskReport())


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"topic": "capital of Peru", "answer": "Lima"}', True),
        ('{"topic":"x","answer":"y"}', True),
        ('{"answer": "Lima", "topic": "capital of Peru"}', False),
        ('{"topic": "capital of Peru", "answer": 3}', False),
        ('{"topic": "capital of Peru", "answer": "Lima"', False),
        ('{"topic": "a", "answer": "b", "extra": "c"}', False),
        ('["topic", "answer"]', False),
    ],
)
def test_json_shape(text: str, ok: bool) -> None:
    assert json_shape_ok(text) is ok


@dataclass
class _Result:
    tokens: list[int]
    tool_events: list = field(default_factory=list)


class _ScriptedEngine:
    """Answers every prompt with its reference reply (or a wrong one for every third prompt)."""

    def __init__(self, chat: ChatFormat, convs: list[Conversation]) -> None:
        self.chat_format = chat
        self.replies = {tuple(chat.render_for_completion(c.prompt)): reply_tokens(chat, c.messages) for c in convs}
        self.calls = 0

    def generate_batch(self, prompts, settings):
        self.calls += 1
        return [
            _Result(self.replies[tuple(p)] if i % 3 else [self.chat_format.assistant_end_id])
            for i, p in enumerate(prompts)
        ]


def test_evaluate_tasks_batches_and_counts(heldout: list[Conversation], chat: ChatFormat) -> None:
    convs = heldout[:90]
    engine = _ScriptedEngine(chat, convs)
    report = evaluate_tasks(engine, convs, batch_size=32, keep_failures=5)  # type: ignore[arg-type]
    assert engine.calls == 3
    total = sum(t.total for _, t in report.rows()) - report.json_exact.total
    correct = sum(t.correct for _, t in report.rows()) - report.json_exact.correct
    assert total == 90 and correct == sum(1 for i in range(90) if (i % 32) % 3)
    assert len(report.failures) == 5
    assert json.dumps(report.as_dict())


def test_small_talk_accepts_any_reply_of_the_intent(heldout: list[Conversation], chat: ChatFormat) -> None:
    conv = next(c for c in heldout if c.kind == "smalltalk" and not c.json_answer and not c.think)
    other = next(reply for reply in conv.alternatives if reply != conv.expected)
    messages = [*conv.prompt, {"role": "assistant", "content": other}]
    assert judge(conv, answer_from_tokens(reply_tokens(chat, messages), chat), TaskReport())
    messages = [*conv.prompt, {"role": "assistant", "content": "The capital of Peru is Lima."}]
    assert not judge(conv, answer_from_tokens(reply_tokens(chat, messages), chat), TaskReport())
