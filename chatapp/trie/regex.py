"""Regular expressions to byte-level DFAs.

`interegular` parses the regex (Python `re` syntax, fully anchored: the whole output must match) and builds an FSM
over *characters*, where each transition is labelled with a class of characters. Model tokens are bytes, so every
character transition is rewritten as the UTF-8 byte sequences of its class: a chain of intermediate states per
lead byte, shared whenever all code points under a UTF-8 prefix go to the same place (so `.` or `[^"]` costs a few
states, not one per code point). The result is pruned and minimised (`dfa.finish_dfa`).

Differences from Python's `re`: `\\d`, `\\w`, `\\s` are ASCII-only (as with `re.ASCII`); look-arounds must stay inside
the match. What interegular rejects (back-references, `\\b`, `^`/`$`, unicode properties), what Python cannot parse,
and look-arounds reaching past either end raise `ConstraintError` naming the regex. Very large explicit classes
(`[à-鿿]`) compile slowly: interegular enumerates their characters.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from functools import lru_cache

import interegular
import numpy as np
from interegular.fsm import FSM, anything_else
from interegular.patterns import _Repeated

from chatapp.errors import ConstraintError
from chatapp.trie.budget import active_meter, check_states, metered, tick
from chatapp.trie.dfa import DEAD, ByteDFA, finish_dfa, stitch
from chatapp.trie.token_bytes import SPECIAL_TOKEN_MARKER

# UTF-8 shape per lead byte: total length and the range of the second byte (restricted for E0, ED, F0, F4 so
# that overlong encodings and surrogates are never produced).
_CONT = (0x80, 0xBF)
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _utf8_length(lead: int) -> int:
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0  # continuation bytes, C0/C1 and F5..FF never start a character


def _next_byte_range(prefix: tuple[int, ...]) -> tuple[int, int]:
    if len(prefix) == 1 and prefix[0] in _SECOND_BYTE:
        return _SECOND_BYTE[prefix[0]]
    return _CONT


def _code_point_range(prefix: tuple[int, ...], length: int) -> tuple[int, int]:
    """All code points whose UTF-8 encoding (of `length` bytes) starts with the valid `prefix`."""
    value = prefix[0] & (0x7F >> length)
    for byte in prefix[1:]:
        value = (value << 6) | (byte & 0x3F)
    free_bits = 6 * (length - len(prefix))
    lo = value << free_bits
    return lo, lo + (1 << free_bits) - 1


@dataclass
class _CharFunction:
    """One FSM state's transition function over code points: explicit characters plus a default for the rest."""

    explicit: list[int]  # sorted code points the regex names
    targets: list[object]  # FSM target per explicit code point (None: no transition)
    default: object  # FSM target for every other code point (None: no transition)

    def target(self, cp: int) -> object:
        i = bisect.bisect_left(self.explicit, cp)
        if i < len(self.explicit) and self.explicit[i] == cp:
            return self.targets[i]
        return self.default

    def targets_in(self, lo: int, hi: int) -> set[object]:
        i0 = bisect.bisect_left(self.explicit, lo)
        i1 = bisect.bisect_right(self.explicit, hi)
        found = set(self.targets[i0:i1])
        if i1 - i0 < hi - lo + 1:
            found.add(self.default)
        return found


class _ByteTableBuilder:
    """Grows a raw byte transition table (DEAD = row 0) from an interegular FSM."""

    def __init__(self, fsm: FSM) -> None:
        self.fsm = fsm
        mapping = fsm.alphabet._symbol_mapping
        self.chars = sorted((ord(ch), symbol) for ch, symbol in mapping.items() if ch is not anything_else)
        self.other_symbol = mapping.get(anything_else)
        self.state_ids = {state: 1 + i for i, state in enumerate(sorted(fsm.states, key=repr))}
        self.rows: list[np.ndarray] = [np.zeros(256, dtype=np.int32) for _ in range(1 + len(self.state_ids))]
        self.chains: dict[tuple[object, int, int, int], int] = {}

    def build(self) -> tuple[np.ndarray, np.ndarray, int]:
        for state, row_id in self.state_ids.items():
            self._fill_state(row_id, self._char_function(state))
            check_states(len(self.rows), "byte")
        accepting = np.zeros(len(self.rows), dtype=bool)
        for state in self.fsm.finals:
            accepting[self.state_ids[state]] = True
        return np.stack(self.rows), accepting, self.state_ids[self.fsm.initial]

    def _char_function(self, state: object) -> _CharFunction:
        moves = self.fsm.map.get(state, {})
        return _CharFunction(
            explicit=[cp for cp, _ in self.chars],
            targets=[moves.get(symbol) for _, symbol in self.chars],
            default=moves.get(self.other_symbol) if self.other_symbol is not None else None,
        )

    def _new_row(self) -> int:
        tick()
        self.rows.append(np.zeros(256, dtype=np.int32))
        return len(self.rows) - 1

    def _fsm_row(self, target: object) -> int:
        return DEAD if target is None else self.state_ids[target]

    def _fill_state(self, row_id: int, fn: _CharFunction) -> None:
        row = self.rows[row_id]
        for byte in range(256):
            length = _utf8_length(byte)
            if length == 1:
                row[byte] = self._fsm_row(fn.target(byte))
            elif length:
                row[byte] = self._prefix_row(fn, (byte,), length)

    def _prefix_row(self, fn: _CharFunction, prefix: tuple[int, ...], length: int) -> int:
        """The row reached after the incomplete UTF-8 `prefix`: shared if every code point under it agrees."""
        lo, hi = _code_point_range(prefix, length)
        if len(prefix) == 1:  # clip to valid scalar values (overlong and surrogate encodings excluded)
            first, last = _next_byte_range(prefix)
            lo, _ = _code_point_range((*prefix, first), length)
            _, hi = _code_point_range((*prefix, last), length)
        targets = fn.targets_in(lo, hi)
        remaining = length - len(prefix)
        if len(targets) == 1:
            (target,) = targets
            if target is None:
                return DEAD
            return self._chain_row(target, remaining, _next_byte_range(prefix))
        row_id = self._new_row()
        first, last = _next_byte_range(prefix)
        for byte in range(first, last + 1):
            if remaining == 1:
                lo_cp, _ = _code_point_range((*prefix, byte), length)
                self.rows[row_id][byte] = self._fsm_row(fn.target(lo_cp))
            else:
                self.rows[row_id][byte] = self._prefix_row(fn, (*prefix, byte), length)
        return row_id

    def _chain_row(self, target: object, remaining: int, byte_range: tuple[int, int]) -> int:
        """A row expecting `remaining` continuation bytes (the first within `byte_range`), then the FSM `target`."""
        key = (target, remaining, *byte_range)
        if key not in self.chains:
            row_id = self._new_row()
            self.chains[key] = row_id
            nxt = self._fsm_row(target) if remaining == 1 else self._chain_row(target, remaining - 1, _CONT)
            self.rows[row_id][byte_range[0] : byte_range[1] + 1] = nxt
        return self.chains[key]


@lru_cache(maxsize=256)
def compile_regex(pattern: str, special_tokens: tuple[str, ...] = ()) -> ByteDFA:
    """Compile a fully anchored regex to a pruned, minimised byte DFA; `ConstraintError` if it cannot be used.

    Each name in `special_tokens` that occurs verbatim in the pattern stands for that special token (bytes
    0xFF + name), e.g. `[0-9+*]+<|python_end|>`. Names are split out before parsing, so they must sit at the top
    level of the pattern (between complete regexes, not inside a group or class).

    The compile runs under the active `CompileBudget` (`budget.metered`; the default one otherwise): too many
    states, too long or a cancel raise `ConstraintError` instead of running on.
    """
    with metered(f"regex {_shown(pattern)}"):
        try:
            return _compile(pattern, special_tokens)
        except RecursionError:
            raise ConstraintError(
                f"regex {_shown(pattern)} is nested too deeply to compile", hint="use fewer nested groups"
            ) from None


def _shown(pattern: str) -> str:
    """The pattern for a message: quoted, and cut short when long."""
    return repr(pattern) if len(pattern) <= 200 else repr(pattern[:200]) + f"... ({len(pattern):,} characters)"


def _compile(pattern: str, special_tokens: tuple[str, ...]) -> ByteDFA:
    names = sorted({n for n in special_tokens if n and n in pattern}, key=len, reverse=True)
    if names:
        parts = re.split("(" + "|".join(map(re.escape, names)) + ")", pattern)
        try:
            pieces = [compile_regex(part) for part in parts[0::2]]
        except ConstraintError as err:
            raise ConstraintError(
                f"regex {_shown(pattern)}: the text around its special tokens {names} must be whole regexes: "
                f"{err.message}",
                hint="put special-token names at the top level of the pattern, outside groups and classes",
            ) from None
        bridges = [bytes([SPECIAL_TOKEN_MARKER]) + name.encode() for name in parts[1::2]]
        dfa = stitch(pieces, bridges, source=f"regex {pattern!r}")
        if dfa.start == DEAD:
            raise ConstraintError(f"regex {_shown(pattern)} matches nothing", hint="a constraint must allow some output")
        return dfa
    return _compile_plain(pattern)


def unrolled_size(parsed: object) -> int:
    """Positions of a parsed regex with every counted repetition written out (`a{1000}`: 1000; `x*`: 2x)."""
    if isinstance(parsed, _Repeated):
        base = unrolled_size(parsed.base)
        count = parsed.max if parsed.max is not None else parsed.min + 1
        return base * max(count, 1)
    for name in ("options", "parts"):
        children = getattr(parsed, name, None)
        if children is not None:
            return sum(unrolled_size(child) for child in children) or 1
    inner = getattr(parsed, "inner", None)
    return unrolled_size(inner) if inner is not None else 1


def _compile_plain(pattern: str) -> ByteDFA:
    shown = _shown(pattern)
    try:
        re.compile(pattern)  # Python's parser gives the clearest syntax errors (position included)
    except re.error as err:
        raise ConstraintError(f"regex {shown} does not parse: {err}", hint="check the regex syntax") from None
    except OverflowError:
        raise ConstraintError(f"regex {shown} has a repetition count too large to parse", hint="use smaller {n}") from None
    try:
        parsed = interegular.parse_pattern(pattern)
    except (interegular.InvalidSyntax, interegular.Unsupported) as err:
        raise ConstraintError(
            f"regex {shown} is not supported: {err or type(err).__name__}",
            hint="use Python `re` syntax without back-references, anchors, \\b or unicode properties",
        ) from None
    if parsed.prefix_postfix != (0, 0):
        raise ConstraintError(
            f"regex {shown} uses a look-around that reaches outside the match, which a constraint cannot express",
            hint="constraints match the whole output: keep look-arounds between characters of the match, or drop them",
        )
    meter = active_meter()
    limit = meter.budget.max_unrolled if meter is not None else None
    if meter is not None and limit is not None and (size := unrolled_size(parsed)) > limit:
        raise ConstraintError(
            f"{meter.source} unrolls to {size:,} positions (counted repetitions written out), more than the limit "
            f"of {limit:,}",
            hint="use smaller {n} counts, or * and + where any count will do",
        )
    try:
        fsm = parsed.to_fsm()
    except interegular.Unsupported as err:
        raise ConstraintError(
            f"regex {shown} is not supported: {err}", hint="write the regex without lookaround or backreferences"
        ) from None
    transitions, accepting, start = _ByteTableBuilder(fsm).build()
    dfa = finish_dfa(transitions, accepting, start, source=f"regex {pattern!r}")
    if dfa.start == DEAD:
        raise ConstraintError(f"regex {shown} matches nothing", hint="a constraint must allow some output")
    return dfa
