"""Grammar constraints in the engine: every emitted token is one the grammar allowed, outputs match, rows keep
their own grammar state, and a forced token the grammar rejects ends the row with an error."""

from __future__ import annotations

import json
import re

import pytest

from chatapp.settings import GenerationSettings
from chatapp.trie.constraint import Constraint
from chatapp.trie.vocab import ConstraintVocab
from chatapp.ttfa import compile_program, parse_program_toml

SAMPLED = GenerationSettings(max_tokens=40, temperature=1.0, seed=4, routing="off")


@pytest.fixture(scope="module")
def vocab(chat_tokenizer, stt_model) -> ConstraintVocab:
    return ConstraintVocab.from_tokenizer(chat_tokenizer, stt_model.config.vocab_size)


def replay(constraint: Constraint, tokens: list[int]) -> None:
    """Consume `tokens` in a fresh copy of the grammar: raises if any was not allowed where it was emitted."""
    Constraint(constraint.vocab, constraint.dfa, constraint.end_token).consume_tokens(tokens)


@pytest.mark.parametrize("pattern", [r"[0-9]{3}", r"(yes|no), because [a-z ]{1,12}\."])
def test_regex_outputs_match_and_every_token_was_allowed(engine, chat_format, vocab, pattern) -> None:
    results = engine.generate_batch(["Hello", "What is 37*45?"], SAMPLED, num_samples=2, constraints=[pattern] * 2)
    for result in results:
        assert result.finish_reason == "stop" and result.stop_token == chat_format.assistant_end_id
        assert re.fullmatch(pattern, result.text)
        replay(Constraint.regex(pattern, vocab, chat_format.assistant_end_id), [*result.tokens, result.stop_token])
    assert len({r.text for r in results}) > 1  # rows sampled independently, each with its own grammar state


def test_a_json_schema_constraint_object_is_copied_per_row(engine, chat_format, vocab) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}}, "required": ["answer"]}
    constraint = Constraint.json_schema(schema, vocab, chat_format.assistant_end_id)
    results = engine.generate_batch(["Hi"], SAMPLED.with_(max_tokens=60), num_samples=3, constraints=[constraint])
    for result in results:
        assert result.finish_reason == "stop"
        assert set(json.loads(result.text)) == {"answer"}
    assert constraint.tokens == []  # the caller's object was never advanced


def test_a_constrained_chat_turn(engine) -> None:
    session = engine.session()
    text = "".join(e.text for s in session.send("Pick", SAMPLED, constraint="(red|green|blue)") for e in s.tokens)
    assert session.messages[-1]["content"] in ("red", "green", "blue")
    assert text.startswith(session.messages[-1]["content"])


def test_a_forced_token_the_grammar_rejects_ends_the_row(engine, chat_tokenizer) -> None:
    program = compile_program(
        parse_program_toml(
            'name = "x"\npad = "<|assistant_end|>"\n[[zones]]\nlabel = "a"\nforce = "abc"\nuntil = "<|assistant_end|>"\n'
        ),
        chat_tokenizer,
    )
    result = engine.generate_batch(["Hi"], SAMPLED, programs=[program], constraints=[r"[0-9]+"])[0]
    assert result.finish_reason == "error" and "not allowed" in result.error


def test_tokens_the_grammar_decides_are_forced_and_fast_forwarded(scripted, chat_format) -> None:
    pattern = r"(yes|no), because [a-z ]{1,12}\."
    engine, model = scripted({}, fast_forward="always")
    runs = {}
    for fast_forward in (False, True):
        model.calls.clear()
        model.step_calls.clear()
        results = engine.generate_batch(
            ["Hello", "Paris"], SAMPLED.with_(fast_forward=fast_forward), constraints=[pattern] * 2
        )
        runs[fast_forward] = [(r.tokens, r.forced, r.text) for r in results]
        widths = [width for _, width in model.step_calls]
        assert (max(widths) > 1) == fast_forward
    assert runs[True] == runs[False]
    for tokens, forced, _ in runs[True]:
        forced_text = chat_format.decode([t for t, f in zip(tokens, forced, strict=True) if f])
        assert "because" in forced_text  # the literal part of the grammar was forced, not sampled
        assert not forced[0]  # "yes" / "no" is the model's choice
