"""Parsing and validating the lines of a batch input file.

Validation happens in two stages. `parse_lines` checks what can be checked from the JSON alone (syntax, field
names, types, settings ranges, duplicate ids) and needs no model, so a malformed file is reported before any model
is loaded. Resolving programs, constraints and prompt tokens needs the tokenizer and happens later, in the runner.
Every line that fails either stage becomes a `LineError` carrying its line number: no input is silently dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from chatapp.errors import ChatappError, InputLineError, user_message
from chatapp.settings import GenerationSettings
from chatapp.validation import (
    MAX_SAMPLES,
    blank,
    check_regex_source,
    check_schema_source,
    find_lone_surrogate,
    strings_in,
)

RequestId = str | int
"""A line's `id`: echoed in every output record of the line, and the key `--resume` matches on."""

# Settings a line may override, with the JSON type each must have. `bool` is excluded explicitly because it is an
# `int` to Python but never what a user means by a number.
_INT_SETTINGS = ("top_k", "max_tokens", "seed", "logprobs", "repeat_last_n", "dry_allowed_length", "dry_penalty_last_n")
_FLOAT_SETTINGS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "dry_multiplier",
    "dry_base",
)
_LIST_SETTINGS = ("dry_sequence_breakers",)
KNOWN_FIELDS = frozenset(
    {
        "id",
        "prompt",
        "messages",
        "samples",
        "program",
        "regex",
        "json_schema",
        *_INT_SETTINGS,
        *_FLOAT_SETTINGS,
        *_LIST_SETTINGS,
    }
)


@dataclass(frozen=True)
class BatchDefaults:
    """What a line gets for every field it leaves out (the command-line options, over the model's defaults)."""

    settings: GenerationSettings = field(default_factory=GenerationSettings)
    chosen: frozenset[str] = frozenset()  # the sampling options the user set: the model's defaults do not replace them
    samples: int = 1
    program: str | None = None


@dataclass(frozen=True)
class LineRequest:
    """One valid input line: what to generate and how."""

    line: int  # 1-based line number in the input
    id: RequestId
    prompt: str | None  # exactly one of prompt / messages is set
    messages: tuple[dict[str, Any], ...] | None
    samples: int
    settings: GenerationSettings
    program: str | None  # built-in program name or .toml path
    regex: str | None
    json_schema: dict[str, Any] | None

    @property
    def id_key(self) -> str:
        return id_key(self.id)


@dataclass(frozen=True)
class LineError:
    """A line that cannot be generated, with the reason. Written to the output as an error record."""

    line: int
    id: RequestId | None
    error: str

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "line": self.line, "error": self.error}


def id_key(request_id: RequestId) -> str:
    """A hashable key that keeps `1` and `"1"` apart (they are different ids in JSON)."""
    return json.dumps(request_id)


class _Invalid(InputLineError):
    """A validation failure inside this module; becomes a `LineError` (its message and fix on one line)."""


_ID_HINT = 'give each line an "id": a non-empty string or an integer, used by no other line'
_MESSAGES_HINT = 'write "messages" as [{"role": "user", "content": "..."}, ...]'
_LINE_HINT = 'write each line as one JSON object, e.g. {"id": 1, "prompt": "Hi"}'


def _reject_constant(name: str) -> float:
    # json.loads accepts NaN and Infinity by default; they are not JSON and no setting accepts them.
    raise _Invalid(f"{name} is not valid JSON", hint="write a number, or leave the field out for the default")


def _read_id(obj: dict[str, Any]) -> RequestId:
    if "id" not in obj:
        raise _Invalid('missing required field "id"', hint=_ID_HINT)
    value = obj["id"]
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _Invalid(f'"id" must be a string or an integer, got {_json_type(value)}', hint=_ID_HINT)
    if isinstance(value, str) and not value:
        raise _Invalid('"id" must not be empty', hint=_ID_HINT)
    return value


def _json_type(value: object) -> str:
    """The JSON name of a value's type, for error messages."""
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int() | float():
            return "a number"
        case str():
            return "a string"
        case list():
            return "an array"
        case dict():
            return "an object"
    return type(value).__name__


def _read_int(obj: dict[str, Any], name: str) -> int:
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(
            f'"{name}" must be an integer, got {_json_type(value)}', hint=f'write "{name}" as a whole number'
        )
    return value


def _read_float(obj: dict[str, Any], name: str) -> float:
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(f'"{name}" must be a number, got {_json_type(value)}', hint=f'write "{name}" as a number')
    # A literal like 1e999 parses to infinity, which no setting accepts.
    if not math.isfinite(value):
        raise _Invalid(f'"{name}" must be a finite number, got {value}', hint=f'write "{name}" as a finite number')
    return float(value)


def _read_strings(obj: dict[str, Any], name: str) -> tuple[str, ...]:
    value = obj[name]
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise _Invalid(
            f'"{name}" must be an array of non-empty strings, got {_json_type(value)}',
            hint=f'write "{name}" as e.g. ["\\n", ":"], or [] for none',
        )
    return tuple(value)


def _read_str(obj: dict[str, Any], name: str) -> str | None:
    if name not in obj:
        return None
    value = obj[name]
    if not isinstance(value, str):
        raise _Invalid(f'"{name}" must be a string, got {_json_type(value)}', hint=f'write "{name}" as a JSON string')
    return value


def _read_messages(obj: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """Shape checks only; roles, order and content parts are checked by the chat format when rendering."""
    value = obj["messages"]
    if not isinstance(value, list) or not value:
        raise _Invalid('"messages" must be a non-empty array of message objects', hint=_MESSAGES_HINT)
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise _Invalid(f'"messages"[{index}] must be an object, got {_json_type(message)}', hint=_MESSAGES_HINT)
    return tuple(value)


def _read_settings(obj: dict[str, Any], defaults: GenerationSettings) -> GenerationSettings:
    changes: dict[str, object] = {}
    for name in _INT_SETTINGS:
        if name in obj:
            changes[name] = _read_int(obj, name)
    for name in _FLOAT_SETTINGS:
        if name in obj:
            changes[name] = _read_float(obj, name)
    for name in _LIST_SETTINGS:
        if name in obj:
            changes[name] = _read_strings(obj, name)
    try:
        return defaults.with_(**changes)
    except ChatappError as err:  # SettingsError: a value out of range
        raise _Invalid(err.message, hint=err.hint) from None


def _parse_object(line: int, obj: dict[str, Any], defaults: BatchDefaults, request_id: RequestId) -> LineRequest:
    unknown = sorted(set(obj) - KNOWN_FIELDS)
    if unknown:
        names = ", ".join(f'"{name}"' for name in unknown)
        raise _Invalid(
            f"unknown field(s) {names}", hint=f"remove them; the known fields are {', '.join(sorted(KNOWN_FIELDS))}"
        )
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise _Invalid(
            'the line has both "prompt" and "messages"' if has_prompt else 'the line has no "prompt" or "messages"',
            hint='give exactly one of "prompt" (a string) or "messages" (a chat message array)',
        )
    prompt = _read_str(obj, "prompt") if has_prompt else None
    if prompt is not None and (what := blank(prompt)) is not None:
        raise _Invalid(f'"prompt" is {what}', hint="write what the model should answer")
    messages = _read_messages(obj) if has_messages else None

    samples = _read_int(obj, "samples") if "samples" in obj else defaults.samples
    if not 1 <= samples <= MAX_SAMPLES:
        shown = samples if len(str(samples)) <= 30 else f"a {len(str(samples))}-digit number"
        fix = "split the line into several lines" if samples > MAX_SAMPLES else "ask for 1 or more samples"
        raise _Invalid(f'"samples" must be between 1 and {MAX_SAMPLES}, got {shown}', hint=fix)

    regex = _read_str(obj, "regex")
    json_schema = obj.get("json_schema")
    if json_schema is not None and not isinstance(json_schema, dict):
        raise _Invalid(
            f'"json_schema" must be an object (a JSON Schema), got {_json_type(json_schema)}',
            hint='write the schema itself, e.g. {"type": "object"}',
        )
    if regex is not None and json_schema is not None:
        raise _Invalid('the line has both "regex" and "json_schema"', hint="keep one of them")
    try:  # size limits before anything compiles: a huge pattern fails here, in microseconds
        if regex is not None:
            check_regex_source(regex)
        if json_schema is not None:
            check_schema_source(json_schema)
    except ChatappError as err:
        field_name = "regex" if regex is not None else "json_schema"
        raise _Invalid(f'"{field_name}": {err.message}', hint=err.hint) from None

    program = _read_str(obj, "program") if "program" in obj else defaults.program
    return LineRequest(
        line=line,
        id=request_id,
        prompt=prompt,
        messages=messages,
        samples=samples,
        settings=_read_settings(obj, defaults.settings),
        program=program,
        regex=regex,
        json_schema=json_schema,
    )


def _check_unicode(obj: dict[str, Any]) -> None:
    """Reject a line holding a lone surrogate (`"\\ud800"`): it is valid JSON but not text a tokenizer or a UTF-8
    output file can take."""
    for text in strings_in(obj):
        index = find_lone_surrogate(text)
        if index is not None:
            raise _Invalid(
                f"a string holds the lone surrogate \\u{ord(text[index]):04x}, which is not a Unicode character",
                hint="escape characters outside the BMP as surrogate pairs",
            )


def parse_line(line: int, text: str | bytes, defaults: BatchDefaults) -> LineRequest | LineError:
    """Parse one non-blank input line. Never raises for bad input: returns a `LineError` instead."""
    request_id: RequestId | None = None
    try:
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _Invalid(f"not valid UTF-8 (byte {err.start + 1})", hint="save the input file as UTF-8") from None
        try:
            obj = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as err:
            raise _Invalid(f"invalid JSON: {err.msg} (column {err.colno})", hint=_LINE_HINT) from None
        except RecursionError:
            raise _Invalid(
                "invalid JSON: arrays or objects nested too deeply for this reader", hint="nest less deeply"
            ) from None
        if not isinstance(obj, dict):
            raise _Invalid(f"each line must be a JSON object, got {_json_type(obj)}", hint=_LINE_HINT)
        _check_unicode(obj)
        request_id = _read_id(obj)
        return _parse_object(line, obj, defaults, request_id)
    except _Invalid as err:
        return LineError(line=line, id=request_id, error=user_message(err).one_line())


def parse_lines(lines: Iterable[str | bytes], defaults: BatchDefaults) -> Iterator[LineRequest | LineError]:
    """Parse an input file's lines in order (1-based numbering), skipping blank lines.

    Lines may be bytes (as read from a file): each is decoded on its own, so one line of bad UTF-8 is one error
    record rather than a failed run.

    An id used by an earlier line makes the later line an error: the output could not tell their records apart, and
    `--resume` could not know which one is done. The first line carrying an id claims it even if it is otherwise
    invalid, so the error record of that line is unambiguous.
    """
    first_line_of: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        parsed = parse_line(number, text, defaults)
        if parsed.id is None:
            yield parsed
            continue
        key = id_key(parsed.id)
        if key in first_line_of:
            first = first_line_of[key]
            duplicate = InputLineError(
                f"duplicate id {key} (first used on line {first})", hint="give every line its own id"
            )
            yield LineError(line=number, id=parsed.id, error=user_message(duplicate).one_line())
            continue
        first_line_of[key] = number
        yield parsed
