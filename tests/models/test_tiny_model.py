"""The tiny model as shipped in the package: loads offline, generates, and uses the calculator on held-out questions."""

from __future__ import annotations

import json

import pytest

from chatapp.engine.engine import Engine
from chatapp.models import load_engine
from chatapp.models.registry import tiny_model_dir
from chatapp.recipes.tiny.corpus import Conversation, generate_corpus
from chatapp.recipes.tiny.evaluate import answer_from_tokens
from chatapp.settings import GenerationSettings
from chatapp.tools.calculator import evaluate

GREEDY = GenerationSettings(max_tokens=80)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine("tiny")  # shipped in the package: no network (conftest sets HF_HUB_OFFLINE)


@pytest.fixture(scope="module")
def heldout() -> list[Conversation]:
    return generate_corpus(60, "heldout", seed=7)


def test_shipped_files_are_small_and_complete() -> None:
    files = {p.name: p.stat().st_size for p in tiny_model_dir().iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "MODEL_CARD.md"} <= set(files)
    assert sum(files.values()) <= 30 * 2**20
    assert json.loads((tiny_model_dir() / "config.json").read_text())["routing_trained"] is True


def test_calls_the_calculator_for_a_heldout_arithmetic_question(engine: Engine, heldout: list[Conversation]) -> None:
    """Greedy, student routing: the model writes an expression, the calculator runs inline and its result is forced
    into the reply, and the model then finishes its turn. (Whether the expression copies the operands correctly is
    the held-out accuracy in MODEL_CARD.md.)"""
    conv = next(c for c in heldout if c.kind == "arithmetic" and len(c.messages) == 2)
    [result] = engine.generate_batch([engine.chat_format.render_for_completion(conv.prompt)], GREEDY)
    [call] = [e for e in result.tool_events if e.kind == "call"]
    [output] = [e for e in result.tool_events if e.kind == "result"]
    assert output.expression == call.expression and output.output == evaluate(call.expression).text
    assert any(op in call.expression for op in "+-*/")
    assert result.finish_reason == "stop"
    answer = answer_from_tokens(result.tokens, engine.chat_format)
    assert answer.tool_called and answer.final_text.strip()


def test_uses_the_calculator_for_heldout_tool_questions(engine: Engine, heldout: list[Conversation]) -> None:
    """A batch of held-out arithmetic and letter-counting questions (unseen numbers, words and phrasings): the model
    reaches for the calculator. How often its answers are right is measured by `chatapp eval` (see MODEL_CARD.md)."""
    convs = [c for c in heldout if c.expression is not None][:16]
    prompts = [engine.chat_format.render_for_completion(c.prompt) for c in convs]
    results = engine.generate_batch(prompts, GREEDY)
    called = [any(e.kind == "call" for e in r.tool_events) for r in results]
    assert sum(called) >= 0.75 * len(convs), [engine.chat_format.decode(r.tokens) for r in results]
    assert all(r.finish_reason in ("stop", "length") for r in results)


def test_routing_skips_tokens_when_generating(engine: Engine) -> None:
    steps = list(engine.generate(["What is 12*34?"], GREEDY))
    computed = [event.computed for step in steps for event in step.tokens if event.computed is not None]
    fraction = sum(sum(c) for c in computed) / sum(len(c) for c in computed)
    assert 0.1 < fraction < 0.9


def test_json_request_gives_the_exact_shape(engine: Engine, heldout: list[Conversation]) -> None:
    conv = next(c for c in heldout if c.json_answer)
    [result] = engine.generate_batch([engine.chat_format.render_for_completion(conv.prompt)], GREEDY)
    value = json.loads(answer_from_tokens(result.tokens, engine.chat_format).full_text)
    assert list(value) == ["topic", "answer"]
