"""A compiled TTFA program: zones at the token level, as the automaton and the reference interpreter read them.

A program is a list of zones followed by one implicit HALT row (index `len(zones)`). Each zone owns a slice of the
program's flat feed array (`data`), the ragged-tensor layout of the seed: zone `z` feeds `data[start(z):end(z)]`.
Everything a human writes (text, labels, token names) has been resolved away by the compiler; what is left is
plain integers, so tests can also build programs here directly, including ones the compiler would reject.

Semantics, per row (`chatapp/ttfa/reference.py` is the executable statement of them):

* On entering zone `z`: `ptr = start(z)`, `gen = 0`.
* Each step: while `ptr < end(z)` the feed token `data[ptr]` is emitted (forced) and `ptr += 1`; afterwards the
  model's token passes through. `gen += 1` either way, so `gen` counts every token emitted in the zone.
* Only tokens the model produced fire transitions (a forced feed token never does):
  a token in `jump_on` (when the zone has a `jump_to`) enters `jump_to`; a token in `until` enters `z + 1`
  (a token in both sets jumps); otherwise, if this token is the `budget`-th of the zone (`gen` reaches the budget),
  `timeout_token` is emitted in its place, flagged forced, and the row enters `z + 1`.
* A zone with budget 0 is forced-only: it enters `z + 1` right after emitting its last feed token.
* Entering `len(zones)` (paging off the end, or a jump to HALT) halts the row: it emits `pad`, forced, with no
  tags, forever.
* The tags of an emitted token are those of the zone it was emitted in (a trigger carries the zone it closes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

UNLIMITED = 1 << 40
"""The budget of a zone with no limit: larger than any generation, small enough for int64 arithmetic."""


@dataclass(frozen=True)
class Zone:
    """One compiled zone. `jump_to` is a zone index of the same program, or `len(zones)` for HALT."""

    label: str
    feed: tuple[int, ...] = ()
    until: frozenset[int] = frozenset()
    jump_on: frozenset[int] = frozenset()
    jump_to: int | None = None
    # Emitted in place of the model's token on timeout; None emits the program's pad (the compiler always sets
    # it for zones that can time out, so None is only reached by hand-built tables).
    timeout_token: int | None = None
    tags: tuple[str, ...] = ()
    # Most tokens the zone emits, counting its feed and its exit token; None = the program's default.
    budget: int | None = None
    # 1-based line of the zone in its TOML source, for messages; None for built or hand-made programs.
    line: int | None = None


@dataclass(frozen=True)
class Program:
    """A compiled program: zones, declared tags, pad token and the default per-zone budget."""

    name: str
    zones: tuple[Zone, ...]
    tag_names: tuple[str, ...]
    pad: int
    vocab_size: int
    max_genned_per_zone: int | None = None
    source: str | None = None
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        self._check_tables()

    @property
    def halt(self) -> int:
        """Index of the HALT row."""
        return len(self.zones)

    @cached_property
    def data(self) -> tuple[int, ...]:
        """All feeds, concatenated in zone order."""
        return tuple(token for zone in self.zones for token in zone.feed)

    @cached_property
    def _starts(self) -> tuple[int, ...]:
        starts = [0]
        for zone in self.zones:
            starts.append(starts[-1] + len(zone.feed))
        return tuple(starts)

    def start(self, z: int) -> int:
        """Offset of zone `z`'s feed in `data`; the HALT row starts (and ends) at `len(data)`."""
        return self._starts[z]

    def end(self, z: int) -> int:
        """One past zone `z`'s last feed token in `data`."""
        return self._starts[z + 1] if z < self.halt else self._starts[z]

    def budget(self, z: int) -> int:
        """Effective budget of zone `z`: its own, else the program's default, else unlimited."""
        own = self.zones[z].budget
        if own is not None:
            return own
        return self.max_genned_per_zone if self.max_genned_per_zone is not None else UNLIMITED

    def _check_tables(self) -> None:
        """Structural invariants of the tables (violations are bugs in the caller, not user errors)."""
        tokens = [self.pad]
        for zone in self.zones:
            tokens += [*zone.feed, *zone.until, *zone.jump_on]
            if zone.timeout_token is not None:
                tokens.append(zone.timeout_token)
            if zone.jump_to is not None and not 0 <= zone.jump_to <= self.halt:
                raise ValueError(f"zone {zone.label!r}: jump_to {zone.jump_to} outside 0..{self.halt}")
            if zone.jump_on and zone.jump_to is None:
                raise ValueError(f"zone {zone.label!r}: jump_on without jump_to")
            if zone.budget is not None and zone.budget < 0:
                raise ValueError(f"zone {zone.label!r}: negative budget")
            if unknown := set(zone.tags) - set(self.tag_names):
                raise ValueError(f"zone {zone.label!r}: undeclared tags {sorted(unknown)}")
        if bad := [t for t in tokens if not 0 <= t < self.vocab_size]:
            raise ValueError(f"program {self.name!r}: token ids {bad} outside the vocabulary 0..{self.vocab_size - 1}")
        if self.max_genned_per_zone is not None and self.max_genned_per_zone < 0:
            raise ValueError("max_genned_per_zone must be >= 0")
