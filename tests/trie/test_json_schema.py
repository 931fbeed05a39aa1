"""JSON schema -> regex: valid instances (in chatapp's layout) match, invalid ones do not, unsupported input errs."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.errors import ConstraintError
from chatapp.trie.json_schema import json_literal, schema_to_regex
from chatapp.trie.regex import compile_regex

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string"}, "answer": {"type": "string"}},
    "required": ["topic", "answer"],
    "additionalProperties": False,
}

MIXED_SCHEMA = {
    "title": "annotations are ignored",
    "type": "object",
    "properties": {
        "a": {"type": "integer"},
        "b": {"type": "number"},
        "c": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 2},
        "d": {"enum": ["x", 1, None, True]},
        "e": {"type": ["string", "null"]},
        "f": {"anyOf": [{"type": "boolean"}, {"const": [1, 2]}]},
    },
    "required": ["b"],
}

mixed_instances = st.fixed_dictionaries(
    {"b": st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False))},
    optional={
        "a": st.integers(),
        "c": st.lists(st.text(max_size=3), min_size=1, max_size=2),
        "d": st.sampled_from(["x", 1, None, True]),
        "e": st.one_of(st.none(), st.text(max_size=5)),
        "f": st.one_of(st.booleans(), st.just([1, 2])),
    },
).map(lambda d: {k: d[k] for k in "abcdef" if k in d})


def test_default_model_answer_format_matches():
    dfa = compile_regex(schema_to_regex(ANSWER_SCHEMA))
    assert dfa.accepts(b'{"topic": "math", "answer": "42"}')
    assert not dfa.accepts(b'{"topic":"math","answer":"42"}')  # fixed layout: one space after ':' and ','
    assert not dfa.accepts(b'{"answer": "42", "topic": "math"}')  # declared order
    assert not dfa.accepts(b'{"topic": "math"}')  # required
    assert dfa.forced_bytes(dfa.start) == b'{"topic": "'


@settings(max_examples=60)
@given(mixed_instances)
def test_valid_instances_match(instance):
    dfa = compile_regex(schema_to_regex(MIXED_SCHEMA))
    assert dfa.accepts(json_literal(instance).encode()), json_literal(instance)


@pytest.mark.parametrize(
    "text",
    [
        "{}",  # b is required
        '{"b": 01}',
        '{"b": 1.}',
        '{"b": 1, "c": []}',  # minItems
        '{"b": 1, "c": ["a", "b", "c"]}',  # maxItems
        '{"b": 1, "c": ["abcd"]}',  # maxLength
        '{"b": 1, "d": "y"}',
        '{"b": 1, "zz": 1}',  # no other keys
        '{"a": 1.5, "b": 1}',  # integer
        '{"b": 1, "e": "\x01"}',  # raw control character in a string
    ],
)
def test_invalid_instances_do_not_match(text):
    assert not compile_regex(schema_to_regex(MIXED_SCHEMA)).accepts(text.encode())


def test_string_escapes_match():
    dfa = compile_regex(schema_to_regex({"type": "string"}))
    assert dfa.accepts(json.dumps('quote " backslash \\ tab \t é \u0001').encode())
    assert not dfa.accepts(b'"\\x"')


@pytest.mark.parametrize(
    ("schema", "fragment"),
    [
        ({"type": "string", "pattern": "a+"}, "keyword 'pattern'"),
        ({"type": "object", "properties": {}, "additionalProperties": True}, "additionalProperties"),
        ({"type": "date"}, "unsupported type 'date'"),
        ({"type": "object", "properties": {"x": {}}}, "#/properties/x allows any value"),
        ({"type": "array"}, "items"),
        ({"type": "object", "required": ["q"]}, "'q' is not in properties"),
        ("{not json", "not valid JSON"),
        ({"properties": {}}, "no type"),
    ],
)
def test_unsupported_schemas_name_the_problem(schema, fragment):
    with pytest.raises(ConstraintError, match="JSON schema") as err:
        schema_to_regex(schema)
    assert fragment in str(err.value)
