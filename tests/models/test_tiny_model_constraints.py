"""End to end on the shipped tiny model: sampled outputs under a regex or JSON-schema constraint always match
it, for many seeds, and every emitted token was one the grammar allowed where it was emitted."""

from __future__ import annotations

import json
import re

import pytest

from chatapp.engine.engine import Engine
from chatapp.models import load_engine
from chatapp.settings import GenerationSettings
from chatapp.trie import Constraint, ConstraintVocab

SEEDS = range(12)
# Temperature 1: the model's own distribution, so the grammar (not a greedy habit) is what keeps outputs valid.
SAMPLED = GenerationSettings(max_tokens=48, temperature=1.0)
SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "maxLength": 16}, "answer": {"type": "string", "maxLength": 24}},
    "required": ["topic", "answer"],
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine("tiny")


@pytest.fixture(scope="module")
def vocab(engine: Engine) -> ConstraintVocab:
    return ConstraintVocab.from_tokenizer(engine.tokenizer, engine.model.config.vocab_size)


def replay(template: Constraint, tokens: list[int]) -> None:
    """Consume the emitted tokens in a fresh copy of the grammar: raises ConstraintError on any disallowed one."""
    Constraint(template.vocab, template.dfa, template.end_token).consume_tokens(tokens)


def generate(engine: Engine, prompt: str, constraint) -> list:
    settings = [SAMPLED.with_(seed=seed) for seed in SEEDS]
    return engine.generate_batch([prompt] * len(settings), settings, constraints=[constraint] * len(settings))


@pytest.mark.parametrize(
    ("prompt", "pattern"),
    [("What is 12+30?", r"[0-9]{1,4}"), ("Is the sky blue?", r"(yes|no)\. [A-Za-z ]{1,20}\.")],
)
def test_regex_constrained_samples_match(engine: Engine, vocab: ConstraintVocab, prompt: str, pattern: str) -> None:
    end = engine.chat_format.assistant_end_id
    results = generate(engine, prompt, pattern)
    for result in results:
        assert result.finish_reason in ("stop", "length")
        if result.finish_reason == "stop":
            assert re.fullmatch(pattern, result.text), result.text
            replay(Constraint.regex(pattern, vocab, end), [*result.tokens, result.stop_token])
        else:  # ran out of tokens: still a prefix the grammar allowed
            replay(Constraint.regex(pattern, vocab, end), list(result.tokens))
    assert sum(r.finish_reason == "stop" for r in results) >= len(results) // 2


def test_json_schema_constrained_samples_parse(engine: Engine, vocab: ConstraintVocab) -> None:
    end = engine.chat_format.assistant_end_id
    results = generate(engine, "What is the capital of France? Answer in JSON.", Constraint.json_schema(SCHEMA, vocab, end))
    finished = [r for r in results if r.finish_reason == "stop"]
    assert len(finished) >= len(results) // 2
    for result in finished:
        value = json.loads(result.text)
        assert set(value) == {"topic", "answer"} and all(isinstance(v, str) for v in value.values())
