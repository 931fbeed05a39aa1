"""Parsing batch input lines: every kind of bad line becomes an error naming the line, never an exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatapp.batch.requests import BatchDefaults, LineError, LineRequest, parse_line, parse_lines
from chatapp.settings import GenerationSettings

DEFAULTS = BatchDefaults(settings=GenerationSettings(temperature=0.5, max_tokens=9, seed=3), samples=2, program="chat")


def test_a_minimal_line_takes_every_default() -> None:
    request = parse_line(4, '{"id": "a", "prompt": "hi"}', DEFAULTS)
    assert request == LineRequest(
        line=4,
        id="a",
        prompt="hi",
        messages=None,
        samples=2,
        settings=DEFAULTS.settings,
        program="chat",
        regex=None,
        json_schema=None,
    )


def test_line_fields_override_the_defaults() -> None:
    line = {
        "id": 7,
        "messages": [{"role": "user", "content": "hi"}],
        "samples": 3,
        "temperature": 1,
        "top_k": 5,
        "top_p": 0.9,
        "max_tokens": 20,
        "seed": 11,
        "program": "think",
        "json_schema": {"type": "object"},
    }
    request = parse_line(1, json.dumps(line), DEFAULTS)
    assert isinstance(request, LineRequest)
    assert request.id == 7
    assert request.messages == ({"role": "user", "content": "hi"},)
    assert request.samples == 3
    assert request.settings == GenerationSettings(temperature=1.0, top_k=5, top_p=0.9, max_tokens=20, seed=11)
    assert request.program == "think"
    assert request.json_schema == {"type": "object"}


@pytest.mark.parametrize(
    ("text", "expected_id", "reason"),
    [
        ("{not json", None, "invalid JSON"),
        ('{"id": 1, "prompt": NaN}', None, "NaN is not valid JSON"),
        ("[1, 2]", None, "must be a JSON object, got an array"),
        ('{"prompt": "hi"}', None, 'missing required field "id"'),
        ('{"id": true, "prompt": "hi"}', None, '"id" must be a string or an integer, got a boolean'),
        ('{"id": 1.5, "prompt": "hi"}', None, '"id" must be a string or an integer, got a number'),
        ('{"id": "", "prompt": "hi"}', None, '"id" must not be empty'),
        ('{"id": 1}', 1, 'exactly one of "prompt"'),
        ('{"id": 1, "prompt": "a", "messages": []}', 1, 'exactly one of "prompt"'),
        ('{"id": 1, "prompt": 5}', 1, '"prompt" must be a string, got a number'),
        ('{"id": 1, "messages": []}', 1, '"messages" must be a non-empty array'),
        ('{"id": 1, "messages": ["hi"]}', 1, '"messages"[0] must be an object, got a string'),
        ('{"id": 1, "prompt": "a", "temprature": 1}', 1, 'unknown field(s) "temprature"'),
        ('{"id": 1, "prompt": "a", "samples": 0}', 1, '"samples" must be between 1 and 1024'),
        ('{"id": 1, "prompt": "a", "samples": "2"}', 1, '"samples" must be an integer, got a string'),
        ('{"id": 1, "prompt": "a", "max_tokens": 2.0}', 1, '"max_tokens" must be an integer, got a number'),
        ('{"id": 1, "prompt": "a", "max_tokens": 0}', 1, "max_tokens must be between 1 and"),
        ('{"id": 1, "prompt": "a", "temperature": -1}', 1, "temperature must be >= 0"),
        ('{"id": 1, "prompt": "a", "temperature": 1e999}', 1, '"temperature" must be a finite number'),
        ('{"id": 1, "prompt": "a", "temperature": false}', 1, '"temperature" must be a number, got a boolean'),
        ('{"id": 1, "prompt": "a", "top_p": 0}', 1, "top_p must be in (0, 1]"),
        ('{"id": 1, "prompt": "a", "seed": -1}', 1, 'seed must be between 0 and 9223372036854775807'),
        ('{"id": 1, "prompt": "a", "program": 3}', 1, '"program" must be a string'),
        ('{"id": 1, "prompt": "a", "logprobs": 21}', 1, "logprobs must be between 0 and 20, got 21"),
        ('{"id": 1, "prompt": "a", "logprobs": -1}', 1, "logprobs must be between 0 and 20"),
        ('{"id": 1, "prompt": "a", "logprobs": true}', 1, '"logprobs" must be an integer, got a boolean'),
        ('{"id": 1, "prompt": "a", "logprobs": 2.5}', 1, '"logprobs" must be an integer, got a number'),
        ('{"id": 1, "prompt": "a", "logprobs": "5"}', 1, '"logprobs" must be an integer, got a string'),
        ('{"id": 1, "prompt": "a", "regex": ["x"]}', 1, '"regex" must be a string'),
        ('{"id": 1, "prompt": "a", "json_schema": "obj"}', 1, '"json_schema" must be an object'),
        ('{"id": 1, "prompt": "a", "regex": "x", "json_schema": {}}', 1, 'both "regex" and "json_schema"'),
    ],
)
def test_each_kind_of_bad_line_is_an_error_with_its_reason(text: str, expected_id: object, reason: str) -> None:
    error = parse_line(12, text, DEFAULTS)
    assert isinstance(error, LineError)
    assert error.line == 12
    assert error.id == expected_id
    assert reason in error.error
    assert error.record() == {"id": expected_id, "line": 12, "error": error.error}


def test_invalid_utf8_is_an_error_for_that_line_only() -> None:
    parsed = list(parse_lines([b'{"id": 1, "prompt": "\xff"}', b'{"id": 2, "prompt": "ok"}'], DEFAULTS))
    assert isinstance(parsed[0], LineError)
    assert "not valid UTF-8" in parsed[0].error
    assert isinstance(parsed[1], LineRequest)


def test_blank_lines_are_skipped_and_numbering_stays_physical() -> None:
    parsed = list(parse_lines(['{"id": 1, "prompt": "a"}', "", "   ", '{"id": 2, "prompt": "b"}'], DEFAULTS))
    assert [item.line for item in parsed] == [1, 4]


def test_a_repeated_id_is_an_error_on_the_later_line() -> None:
    lines = [
        '{"id": 1, "prompt": "a", "samples": 0}',  # invalid, but it still claims id 1
        '{"id": "1", "prompt": "b"}',  # a string id is a different id
        '{"id": 1, "prompt": "c"}',
    ]
    first, second, third = parse_lines(lines, DEFAULTS)
    assert isinstance(first, LineError)
    assert isinstance(second, LineRequest)
    assert isinstance(third, LineError)
    assert third.id == 1
    assert third.error == "duplicate id 1 (first used on line 1); fix: give every line its own id"


@given(st.text(max_size=60))
def test_arbitrary_text_never_raises(text: str) -> None:
    assert isinstance(parse_line(1, text, DEFAULTS), LineRequest | LineError)


_valid_lines = st.fixed_dictionaries(
    {
        "id": st.one_of(st.integers(), st.text(min_size=1, max_size=8)),
        "prompt": st.text(min_size=1, max_size=20).filter(str.strip),  # an empty prompt is an error
    },
    optional={
        "samples": st.integers(1, 8),
        "temperature": st.floats(0, 4, allow_nan=False),
        "top_k": st.integers(0, 100),
        "top_p": st.floats(0.01, 1.0),
        "max_tokens": st.integers(1, 4096),
        "seed": st.integers(0, 2**63 - 1),
        "logprobs": st.integers(0, 20),
        "program": st.sampled_from(["chat", "think", "calc", "json", "x.toml"]),
        "regex": st.text(max_size=10),
    },
)


@given(_valid_lines)
def test_valid_lines_round_trip_through_json(line: dict) -> None:
    request = parse_line(1, json.dumps(line), DEFAULTS)
    assert isinstance(request, LineRequest), request
    assert request.id == line["id"]
    assert request.prompt == line["prompt"]
    assert request.samples == line.get("samples", DEFAULTS.samples)
    for name in ("temperature", "top_k", "top_p", "max_tokens", "seed", "logprobs"):
        assert getattr(request.settings, name) == line.get(name, getattr(DEFAULTS.settings, name))
    assert request.program == line.get("program", DEFAULTS.program)
    assert request.regex == line.get("regex")
