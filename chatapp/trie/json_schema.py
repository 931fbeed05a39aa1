"""A JSON-schema subset compiled to a regex (then to a byte DFA like any regex constraint).

Whitespace is fixed, not flexible: one space after `:` and `,`, none inside brackets — exactly the format the
default model is trained on (`{"topic": "…", "answer": "…"}`). A fixed layout makes every separator forced
bytes, which fast-forward then emits without sampling.

Supported: `type` (object, array, string, integer, number, boolean, null, or a list of them), `properties` (emitted
in declared order), `required`, `additionalProperties: false` (the only behaviour: no other keys), `enum`, `const`,
`anyOf` / `oneOf` (as alternatives), `items`, `minItems` / `maxItems`, `minLength` / `maxLength`. Annotations
(`title`, `description`, `$schema`, `default`, `examples`, `$id`, `$comment`) are ignored. Anything else raises
`ConstraintError` naming the keyword and where it is, instead of silently allowing more or less than asked.
"""

from __future__ import annotations

import json
from typing import Any

from chatapp.errors import ConstraintError

ITEM_SEPARATOR = ", "
KEY_SEPARATOR = ": "

STRING_CHAR = r'(?:[^"\\\x00-\x1f\x7f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
"""One JSON string character: anything but quote, backslash and controls, or an escape."""
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = "(?:true|false)"
NULL = "null"

_ANNOTATIONS = frozenset({"title", "description", "$schema", "default", "examples", "$id", "$comment"})
_KEYWORDS_BY_TYPE = {
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
    "string": {"minLength", "maxLength"},
    "integer": set(),
    "number": set(),
    "boolean": set(),
    "null": set(),
}
_REGEX_SPECIALS = frozenset(".^$*+?{}[]\\|()")


def regex_literal(text: str) -> str:
    """`text` as a regex matching exactly it (escapes only what interegular treats as special)."""
    out = []
    for ch in text:
        if ch in _REGEX_SPECIALS:
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def json_literal(value: Any) -> str:
    """The JSON text of `value` in this module's layout."""
    return json.dumps(value, ensure_ascii=False, separators=(ITEM_SEPARATOR, KEY_SEPARATOR))


def schema_to_regex(schema: dict[str, Any] | str) -> str:
    """Compile a schema (a dict or its JSON text) to a regex; `ConstraintError` for anything outside the subset."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ConstraintError(f"JSON schema is not valid JSON: {err}", hint="pass a JSON object") from None
    try:
        return _SchemaCompiler().compile(schema, "#")
    except RecursionError:
        raise ConstraintError("JSON schema is nested too deeply to compile", hint="flatten the schema") from None


MAX_COUNT = 10_000
"""Largest minItems / maxItems / minLength / maxLength: each is unrolled into the automaton."""


def _count(schema: dict[str, Any], key: str, where: str) -> int | None:
    """A non-negative integer keyword (None when absent)."""
    if key not in schema:
        return None
    value = schema[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 0:
        raise ConstraintError(
            f"JSON schema at {where}: {key} must be a non-negative integer, got {json_literal(value)}",
            hint="use a whole number of 0 or more",
        )
    if value > MAX_COUNT:
        raise ConstraintError(
            f"JSON schema at {where}: {key} is {int(value):,}, more than the limit of {MAX_COUNT:,}",
            hint=f"use a {key} of at most {MAX_COUNT:,}",
        )
    return int(value)


class _SchemaCompiler:
    def compile(self, schema: Any, where: str) -> str:
        if schema is True or schema == {}:
            raise ConstraintError(
                f"JSON schema at {where} allows any value, which this subset cannot express",
                hint="give it a type, enum or const",
            )
        if not isinstance(schema, dict):
            raise ConstraintError(
                f"JSON schema at {where} must be an object, got {json_literal(schema)}",
                hint="write each (sub)schema as a JSON object",
            )
        if "const" in schema:
            self._check_keywords(schema, where, {"const"})
            return regex_literal(json_literal(schema["const"]))
        if "enum" in schema:
            self._check_keywords(schema, where, {"enum", "type"})
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise ConstraintError(
                    f"JSON schema at {where}: enum must be a non-empty list",
                    hint='list the allowed values, e.g. "enum": ["a", "b"]',
                )
            return _alternatives([regex_literal(json_literal(v)) for v in values])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                self._check_keywords(schema, where, {key})
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise ConstraintError(
                        f"JSON schema at {where}: {key} must be a non-empty list", hint="list the alternative schemas"
                    )
                return _alternatives([self.compile(s, f"{where}/{key}/{i}") for i, s in enumerate(options)])
        kind = schema.get("type")
        if kind is None:
            raise ConstraintError(f"JSON schema at {where} has no type, enum, const or anyOf", hint='add e.g. "type"')
        kinds = kind if isinstance(kind, list) else [kind]
        unknown = [k for k in kinds if not isinstance(k, str) or k not in _KEYWORDS_BY_TYPE]
        if unknown:
            raise ConstraintError(
                f"JSON schema at {where}: unsupported type {unknown[0]!r}",
                hint="use string, number, integer, boolean, null, object or array",
            )
        allowed = {"type"}.union(*(_KEYWORDS_BY_TYPE[k] for k in kinds))
        self._check_keywords(schema, where, allowed)
        return _alternatives([self._typed(k, schema, where) for k in kinds])

    def _check_keywords(self, schema: dict[str, Any], where: str, allowed: set[str]) -> None:
        extra = sorted(set(schema) - allowed - _ANNOTATIONS)
        if extra:
            raise ConstraintError(
                f"JSON schema at {where}: keyword {extra[0]!r} is not supported here",
                hint=f"supported here: {', '.join(sorted(allowed))}",
            )

    def _typed(self, kind: str, schema: dict[str, Any], where: str) -> str:
        if kind == "object":
            return self._object(schema, where)
        if kind == "array":
            return self._array(schema, where)
        if kind == "string":
            return '"' + _repeat(STRING_CHAR, schema, "minLength", "maxLength", where) + '"'
        return {"integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}[kind]

    def _object(self, schema: dict[str, Any], where: str) -> str:
        if schema.get("additionalProperties", False) is not False:
            raise ConstraintError(
                f"JSON schema at {where}: additionalProperties must be false (only declared keys can be generated)",
                hint='set "additionalProperties": false',
            )
        properties = schema.get("properties", {})
        if not isinstance(properties, dict):
            raise ConstraintError(
                f"JSON schema at {where}: properties must be an object",
                hint='write properties as {"name": schema, ...}',
            )
        required_list = schema.get("required", [])
        if not isinstance(required_list, list) or not all(isinstance(name, str) for name in required_list):
            raise ConstraintError(
                f"JSON schema at {where}: required must be a list of property names",
                hint='write required as ["name", ...]',
            )
        required = set(required_list)
        missing = sorted(required - set(properties))
        if missing:
            raise ConstraintError(
                f"JSON schema at {where}: required key {missing[0]!r} is not in properties",
                hint="add it to properties, or drop it from required",
            )
        members = [
            (
                regex_literal(json_literal(name) + KEY_SEPARATOR) + self.compile(sub, f"{where}/properties/{name}"),
                name in required,
            )
            for name, sub in properties.items()
        ]
        return r"\{" + _ordered_members(members) + r"\}"

    def _array(self, schema: dict[str, Any], where: str) -> str:
        if "items" not in schema:
            raise ConstraintError(f"JSON schema at {where}: arrays need an items schema", hint='add "items"')
        item = "(?:" + self.compile(schema["items"], f"{where}/items") + ")"
        low = _count(schema, "minItems", where) or 0
        high = _count(schema, "maxItems", where)
        if high is not None and high < low:
            raise ConstraintError(
                f"JSON schema at {where}: maxItems is below minItems", hint="make maxItems at least minItems"
            )
        sep = regex_literal(ITEM_SEPARATOR)
        if high == 0:
            return r"\[\]"
        rest_high = "" if high is None else str(high - 1)
        body = f"{item}(?:{sep}{item}){{{max(low - 1, 0)},{rest_high}}}"
        return r"\[" + (body if low > 0 else f"(?:{body})?") + r"\]"


def _alternatives(options: list[str]) -> str:
    return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"


def _repeat(unit: str, schema: dict[str, Any], low_key: str, high_key: str, where: str) -> str:
    low = _count(schema, low_key, where) or 0
    high = _count(schema, high_key, where)
    if high is not None and high < low:
        raise ConstraintError(
            f"JSON schema at {where}: {high_key} is below {low_key}", hint="make the upper bound at least the lower one"
        )
    if low == 0 and high is None:
        return unit + "*"
    return f"{unit}{{{low},{'' if high is None else high}}}"


def _ordered_members(members: list[tuple[str, bool]]) -> str:
    """Members in declared order, each optional unless required, with separators only between present ones.

    After the first present member every later one is `(, m)?` or `, m`: linear size. The first present member
    is an alternative over the leading run of optional members (quadratic at worst, never exponential).
    """
    sep = regex_literal(ITEM_SEPARATOR)

    def tail(start: int) -> str:
        return "".join(f"{sep}{m}" if req else f"(?:{sep}{m})?" for m, req in members[start:])

    firsts = []
    for i, (member, req) in enumerate(members):
        firsts.append(member + tail(i + 1))
        if req:
            break
    else:
        firsts.append("")  # every member optional: the empty object
    return _alternatives(firsts) if firsts else ""
