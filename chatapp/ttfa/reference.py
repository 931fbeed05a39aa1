"""The per-row reference interpreter: the seed's transitions written as plain Python, one row at a time.

This is the oracle the batched automaton is tested against. It is deliberately the most direct reading of
`docs/ttfa.md` (plus the extensions documented in `program.py`): no tensors, no tables, one `if` per rule.
It is also how a host-side automaton works (vLLM's think-budget processor is this loop over rows), which is what
the benchmark compares against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chatapp.ttfa.program import Program


@dataclass
class ReferenceRow:
    """One row's automaton. `pc`, `ptr` and `gen` are as in the seed; `ptr` indexes `program.data`."""

    program: Program
    pc: int = 0
    ptr: int = 0
    gen: int = 0
    _started: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not self._started:
            self._enter(self.pc)
            self._started = True

    @property
    def halted(self) -> bool:
        return self.pc == self.program.halt

    def pending_feed(self) -> int:
        """Feed tokens emitted before the model's next token: the rest of this zone's feed, and on through the
        zones a forced-only zone hands over to."""
        program, total, z, ptr = self.program, 0, self.pc, self.ptr
        while z != program.halt:
            total += program.end(z) - ptr
            if program.budget(z) != 0 or program.end(z) == program.start(z):
                break  # the model speaks next (an empty forced-only zone times out on the model's token)
            z += 1
            ptr = program.start(z)
        return total

    def tags(self) -> tuple[str, ...]:
        """Tags of the current zone (HALT has none)."""
        return () if self.halted else self.program.zones[self.pc].tags

    def step(self, token: int) -> tuple[int, bool, tuple[str, ...]]:
        """Consume the model's `token`; return the emitted token, whether it was forced, and its tags."""
        program = self.program
        if self.halted:
            return program.pad, True, ()
        z = self.pc
        zone = program.zones[z]
        self.gen += 1
        if self.ptr < program.end(z):  # feeding: the model's token is replaced, no transition can fire
            out = program.data[self.ptr]
            self.ptr += 1
            if program.budget(z) == 0 and self.ptr == program.end(z):
                self._enter(z + 1)
            return out, True, zone.tags
        if zone.jump_to is not None and token in zone.jump_on:
            self._enter(zone.jump_to)
            return token, False, zone.tags
        if token in zone.until:
            self._enter(z + 1)
            return token, False, zone.tags
        if self.gen >= program.budget(z):  # timeout: force the exit token and take the step transition
            self._enter(z + 1)
            forced_exit = zone.timeout_token if zone.timeout_token is not None else program.pad
            return forced_exit, True, zone.tags
        return token, False, zone.tags

    def _enter(self, z: int) -> None:
        self.pc = z
        self.ptr = self.program.start(z)
        self.gen = 0
