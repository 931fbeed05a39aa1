"""Programs as humans write them: a TOML file or the Python builder, both producing a `ProgramSource`.

A program is a list of zones; the TOML form is

```toml
name = "think"
tags = ["think", "answer"]          # every tag a zone may carry, declared up front
max_genned_per_zone = 1024           # optional default budget of every zone
pad = "<|assistant_end|>"            # optional; emitted once the program has halted

[[zones]]
label = "think"
force = "<think>"                   # text forced at the start of the zone (tokenized canonically)
until = "</think>"                  # step trigger: a token, a list of tokens, or {contains = "text"}
timeout_token = "</think>"          # optional: emitted on timeout (default: the first `until` token)
jump_on = ["<|python_start|>"]      # optional second exit ...
goto = "tool"                       # ... to this zone's label, or "halt"
budget = 256                        # optional: most tokens in the zone, feed and exit token included; 0 = forced-only
tags = ["think"]
```

Token names are the tokens' texts ("</think>", "\\n", " the"); `{contains = "\\n"}` means every ordinary token whose
text contains "\\n", so a newline still triggers when BPE merged it into ".\\n" or "\\n\\n".
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from chatapp.errors import ProgramError


@dataclass(frozen=True)
class Contains:
    """A token set: every ordinary (non-special) token whose text contains `text`."""

    text: str


TokenSpec = str | tuple[str, ...] | Contains
"""One token by its text, a list of tokens, or a `Contains` set."""


@dataclass(frozen=True)
class ZoneSource:
    label: str
    force: str = ""
    until: TokenSpec | None = None
    timeout_token: str | None = None
    jump_on: TokenSpec | None = None
    goto: str | None = None
    tags: tuple[str, ...] = ()
    budget: int | None = None
    line: int | None = None  # of the zone's `[[zones]]` header
    key_lines: dict[str, int] = field(default_factory=dict, compare=False)  # key -> line, for messages

    def line_of(self, key: str) -> int | None:
        """The line of `key` in this zone (the zone's header line when the key is not written)."""
        return self.key_lines.get(key, self.line)


@dataclass(frozen=True)
class ProgramSource:
    name: str
    zones: tuple[ZoneSource, ...]
    tags: tuple[str, ...] = ()
    max_genned_per_zone: int | None = None
    pad: str | None = None
    description: str = ""
    file: str | None = None
    key_lines: dict[str, int] = field(default_factory=dict, compare=False)


class ProgramBuilder:
    """Build a program in Python with the TOML fields: `ProgramBuilder("p", tags=["a"]).zone("z", ...)`."""

    def __init__(
        self,
        name: str,
        *,
        tags: list[str] | tuple[str, ...] = (),
        max_genned_per_zone: int | None = None,
        pad: str | None = None,
        description: str = "",
    ) -> None:
        self._program = ProgramSource(name, (), tuple(tags), max_genned_per_zone, pad, description)

    def zone(
        self,
        label: str,
        *,
        force: str = "",
        until: str | list[str] | tuple[str, ...] | Contains | None = None,
        timeout_token: str | None = None,
        jump_on: str | list[str] | tuple[str, ...] | Contains | None = None,
        goto: str | None = None,
        tags: list[str] | tuple[str, ...] = (),
        budget: int | None = None,
    ) -> ProgramBuilder:
        """Append a zone; returns the builder so calls chain."""
        zone = ZoneSource(
            label, force, _freeze(until), timeout_token, _freeze(jump_on), goto, tuple(tags), budget, line=None
        )
        self._program = replace(self._program, zones=(*self._program.zones, zone))
        return self

    def build(self) -> ProgramSource:
        return self._program


def _freeze(spec: str | list[str] | tuple[str, ...] | Contains | None) -> TokenSpec | None:
    return tuple(spec) if isinstance(spec, list) else spec


# -- TOML ----------------------------------------------------------------------------------------------------------

_PROGRAM_KEYS = {"name", "description", "tags", "max_genned_per_zone", "pad", "zones"}
_ZONE_KEYS = {"label", "force", "until", "timeout_token", "jump_on", "goto", "tags", "budget"}
_EXAMPLES = {
    "name": 'name = "think"',
    "description": 'description = "Think, then answer."',
    "tags": 'tags = ["think", "answer"]',
    "max_genned_per_zone": "max_genned_per_zone = 512",
    "pad": 'pad = "<|assistant_end|>"',
    "label": 'label = "think"',
    "force": 'force = "<think>"',
    "until": 'until = "</think>", until = [".", "!"] or until = {contains = "\\n"}',
    "jump_on": 'jump_on = "<|python_start|>"',
    "timeout_token": 'timeout_token = "</think>"',
    "goto": 'goto = "answer" or goto = "halt"',
    "budget": "budget = 256",
}
_ZONE_HEADER = re.compile(r"^\s*\[\[\s*zones\s*\]\]")
_TABLE_HEADER = re.compile(r"^\s*\[")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=")


def parse_program_toml(text: str, file: str | None = None, default_name: str = "program") -> ProgramSource:
    """Parse a program file. Type errors are reported with the file and line of the offending key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        line = _decode_error_line(err)
        raise ProgramError(f"not valid TOML: {err}", hint="fix the TOML syntax", file=file, line=line) from None
    except RecursionError:
        raise ProgramError("arrays or tables nested too deeply", hint="programs need no nesting", file=file) from None
    top_lines, zone_lines = _key_lines(text)

    def check(table: dict, allowed: set[str], lines: dict[str, int], header: int | None, zone: str | None) -> None:
        """Unknown keys and wrongly typed values of one table, located at their line."""
        if unknown := sorted(set(table) - allowed):
            key = unknown[0]
            raise ProgramError(
                f"unknown key {key!r}",
                hint=f"the keys are {sorted(allowed)}",
                file=file,
                line=lines.get(key),
                zone=zone,
            )
        for key, value in table.items():
            expected, valid = _TYPES[key]
            if not valid(value):
                raise ProgramError(
                    f"{key} must be {expected}",
                    hint=f"for example: {_EXAMPLES[key]}",
                    file=file,
                    line=lines.get(key, header),
                    zone=zone,
                )

    check({k: v for k, v in data.items() if k != "zones"}, _PROGRAM_KEYS, top_lines, None, None)
    zones_data = data.get("zones")
    if not isinstance(zones_data, list) or not zones_data or not all(isinstance(z, dict) for z in zones_data):
        raise ProgramError(
            "the program declares no [[zones]]",
            hint="add at least one [[zones]] table",
            file=file,
            line=top_lines.get("zones"),
        )
    zones = []
    for index, zone in enumerate(zones_data):
        header, keys = zone_lines[index] if index < len(zone_lines) else (None, {})
        label = zone.get("label") if isinstance(zone.get("label"), str) else None
        check(zone, _ZONE_KEYS, keys, header, label)
        if not label:
            raise ProgramError(
                "the zone has no label", hint='add label = "<name>"', file=file, line=keys.get("label", header)
            )
        zones.append(
            ZoneSource(
                label=label,
                force=zone.get("force", ""),
                until=_token_spec(zone.get("until")),
                timeout_token=zone.get("timeout_token"),
                jump_on=_token_spec(zone.get("jump_on")),
                goto=zone.get("goto"),
                tags=tuple(zone.get("tags", ())),
                budget=zone.get("budget"),
                line=header,
                key_lines=keys,
            )
        )
    return ProgramSource(
        name=data.get("name", default_name),
        zones=tuple(zones),
        tags=tuple(data.get("tags", ())),
        max_genned_per_zone=data.get("max_genned_per_zone"),
        pad=data.get("pad"),
        description=data.get("description", ""),
        file=file,
        key_lines=top_lines,
    )


def load_program_source(path: Path) -> ProgramSource:
    """Read and parse a program file."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ProgramError(
            f"cannot read program file {path}: {err.strerror}", hint="pass a built-in name or a .toml path"
        ) from None
    if len(data) > MAX_PROGRAM_BYTES:
        raise ProgramError(
            f"the file is {len(data):,} bytes, more than the limit of {MAX_PROGRAM_BYTES:,} for a program",
            hint="pass a program .toml file", file=str(path),
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ProgramError(
            f"not valid UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start})",
            hint="save the program as UTF-8",
            file=str(path),
            line=line,
        ) from None
    return parse_program_toml(text, file=str(path), default_name=path.stem)


def _is_string(value: object) -> bool:
    return isinstance(value, str)


MAX_PROGRAM_BYTES = 1 << 20
"""Largest program file: programs are a few zones; anything bigger is not one."""

MAX_BUDGET = 1 << 30
"""Largest zone budget (`budget`, `max_genned_per_zone`): far above any generation, far below int64 overflow."""


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_budget(value: object) -> bool:
    return _is_integer(value) and value <= MAX_BUDGET


def _is_string_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_token_spec(value: object) -> bool:
    if isinstance(value, list):
        return bool(value) and _is_string_list(value)
    if isinstance(value, dict):
        return set(value) == {"contains"} and isinstance(value["contains"], str)
    return isinstance(value, str)


_TOKEN_SPEC = 'a token, a list of tokens or {contains = "text"}'
# What each key holds, in both program and zone tables: (description for messages, check).
_TYPES: dict[str, tuple[str, Callable[[object], bool]]] = {
    "name": ("a string", _is_string),
    "description": ("a string", _is_string),
    "tags": ("a list of strings", _is_string_list),
    "max_genned_per_zone": ("an integer no larger than 2**30", _is_budget),
    "pad": ("a token (string)", _is_string),
    "label": ("a string", _is_string),
    "force": ("a string", _is_string),
    "until": (_TOKEN_SPEC, _is_token_spec),
    "jump_on": (_TOKEN_SPEC, _is_token_spec),
    "timeout_token": ("a token (string)", _is_string),
    "goto": ('a zone label or "halt"', _is_string),
    "budget": ("an integer no larger than 2**30", _is_budget),
}


def _token_spec(value: str | list[str] | dict | None) -> TokenSpec | None:
    if isinstance(value, dict):
        return Contains(value["contains"])
    return tuple(value) if isinstance(value, list) else value


def _key_lines(text: str) -> tuple[dict[str, int], list[tuple[int, dict[str, int]]]]:
    """Lines of top-level keys, and per `[[zones]]` table its header line and key lines (1-based).

    tomllib keeps no positions, so this scans the source: enough for the flat layout programs use (top-level
    keys, then `[[zones]]` tables of `key = value` lines).
    """
    top: dict[str, int] = {}
    zones: list[tuple[int, dict[str, int]]] = []
    current: dict[str, int] | None = top
    for number, line in enumerate(text.splitlines(), start=1):
        if _ZONE_HEADER.match(line):
            zones.append((number, {}))
            current = zones[-1][1]
        elif _TABLE_HEADER.match(line):
            current = None  # some other table: its keys are not ours
        elif current is not None and (match := _KEY.match(line)):
            current.setdefault(match.group(1), number)
    return top, zones


def _decode_error_line(err: tomllib.TOMLDecodeError) -> int | None:
    line = getattr(err, "lineno", None)
    if line is None and (match := re.search(r"line (\d+)", str(err))):
        line = int(match.group(1))
    return line
