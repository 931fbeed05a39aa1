"""TTFA programs in the decode loop: one batched automaton per device batch, stepped on every emitted token.

Rows of a request may run different programs, or none: a row without a program runs a one-zone passthrough
program (no feed, no trigger, no budget, no tags), so the whole batch steps with one gather-only call and no
Python branch per row. The automaton sees every token a row emits — the model's, and the tool machine's forced
output — so zone budgets count exactly what the transcript shows, and it may replace any of them (a feed token or
a timeout's exit token), which the engine then reports as forced.

A zone's feed is known ahead (`pending_feed`), so when the engine fast-forwards, a row with two or more pending
feed tokens emits them all in one ragged forward: `peek` shows them (with their tags and zones) and
`step_and_advance` moves those rows by `advance(n)` while the other rows take an ordinary `step` — the state is
exactly the one the same tokens stepped one by one would leave. While a program runs, tool output is fed one
token per step so that each of its tokens passes through the automaton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chatapp.ttfa import Automaton, Program, TTFAState
from chatapp.ttfa.program import UNLIMITED, Zone

_PASSTHROUGH_LABEL = ""


class ProgramRunner:
    """The automaton of one device batch plus the host-side names the events need."""

    def __init__(self, programs: Sequence[Program | None], device: torch.device) -> None:
        real = [p for p in programs if p is not None]
        first = real[0]
        passthrough = Program(
            name="(no program)",
            zones=(Zone(label=_PASSTHROUGH_LABEL, budget=UNLIMITED),),
            tag_names=(),
            pad=first.pad,
            vocab_size=first.vocab_size,
        )
        linked: list[Program] = [passthrough]
        for program in real:
            if all(program is not p for p in linked):
                linked.append(program)
        row_program = [0 if p is None else next(i for i, q in enumerate(linked) if q is p) for p in programs]
        self.automaton = Automaton(linked, row_program, device)
        self.tag_names = tuple(self.automaton.tag_names)

    def step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(emitted tokens, forced by the program, tags [B, N], zone row the tokens were emitted in) for the
        rows' proposed `tokens`; all on the device, no host sync."""
        pc = self.automaton.pc
        tokens, forced, tags = self.automaton.step(tokens)
        return tokens, forced, tags, pc

    def pending_feed(self) -> torch.Tensor:
        """[B] feed tokens each row emits before the model's next token."""
        return self.automaton.pending_feed()

    def peek(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next `k` feed tokens per row [B, k], their tags [B, k, N] and zone rows [B, k] (pad past a row's
        pending feed)."""
        automaton = self.automaton
        tables = automaton.tables
        offsets = torch.arange(k, device=automaton.device)
        positions = (automaton.ptr[:, None] + offsets).clamp(max=tables.data.numel() - 1)
        return automaton.peek_feed(k), automaton.peek_feed_tags(k), tables.data_zone[positions]

    def step_and_advance(
        self, tokens: torch.Tensor, feed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`step` for rows with `feed == 0`; rows with `feed > 0` emit that many feed tokens instead (shown by
        `peek`), and only the step's results of the other rows are meaningful."""
        automaton = self.automaton
        before = automaton.state
        out = self.step(tokens)
        stepped = automaton.state
        automaton.state = before
        automaton.advance(feed)
        take = feed > 0
        automaton.state = TTFAState(*(torch.where(take, a, b) for a, b in zip(automaton.state, stepped, strict=True)))
        return out

    def halted(self) -> torch.Tensor:
        return self.automaton.halted()

    def select_rows(self, index: torch.Tensor) -> None:
        self.automaton.select_rows(index)

    def zone_labels(self, pcs: Sequence[int]) -> list[str | None]:
        """Zone labels for host-side zone rows (None for rows without a program)."""
        labels = self.automaton.zone_labels(torch.tensor(list(pcs), dtype=torch.long))
        return [label or None for label in labels]

    def tag_tuple(self, flags: Sequence[bool]) -> tuple[str, ...]:
        return tuple(name for name, on in zip(self.tag_names, flags, strict=True) if on)
