"""Linking compiled programs into one set of device tables, as a linker relocates object files.

Every program contributes its zones plus its own HALT row; zone indices are relocated by the program's base row
and feed offsets by its base in the shared flat `data`. Rows of one batch can then run different programs with
the same gathers.

The layout is chosen so one step is a handful of gathers (on a CPU each PyTorch op costs microseconds whatever
its size, so the op count is the cost):

* `rows[R, 6]`: everything about a zone that `step` reads, fetched with one `index_select`.
* `flat`: per row a block `[stay, next, jump, class(token 0), ..., class(token V)]`. The token's class (0 none,
  1 step trigger, 2 jump trigger) is one gather, so a trigger *set* costs what one token costs, and the class is
  also the index of the transition taken: `next_pc = flat[block + class]`. Column `V` is all zeros and catches
  every token id outside the vocabulary.
* Budgets are normalised so that one comparison `gen + 1 >= budget` covers both the timeout and the exit of a
  forced-only zone after its last feed token (see `normalized_budget`).
* Feed runs across forced-only zones: a forced-only zone is followed by the next zone in program order, whose
  feed comes next in `data` too, so the feed tokens known ahead (`run_after`) are one contiguous slice.
* A HALT row has no feed, no triggers, budget 0, `pad` as timeout token and itself as every successor: each step
  "times out" into the same state and emits pad, forced. So `step` has no special case for halted rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from chatapp.ttfa.program import Program

NO_CLASS, STEP_CLASS, JUMP_CLASS = 0, 1, 2
STAY, NEXT, JUMP = 0, 1, 2  # offsets of the transition targets in a row's block of `flat`; equal to the classes
BLOCK_HEADER = 3

# Columns of `Tables.rows`.
START, FEED_LEN, BUDGET, TIMEOUT, CLASS_BASE, BLOCK_BASE = range(6)


class Tables(NamedTuple):
    """Device tables indexed by the global row `pc`. A NamedTuple so `torch.compile` sees plain tensor leaves."""

    rows: torch.Tensor  # [R, 6] int64: START, FEED_LEN, BUDGET (normalised), TIMEOUT, CLASS_BASE, BLOCK_BASE
    flat: torch.Tensor  # [R * (3 + width)] int64: per row [stay, next, jump, classes...]
    halt: torch.Tensor  # [R] bool
    pad: torch.Tensor  # [R] int64, the pad of the row's program
    tags: torch.Tensor  # [R, N] bool
    data: torch.Tensor  # [D + 1] int64; the trailing pad keeps gathers in bounds
    data_zone: torch.Tensor  # [D + 1] int64: the row whose feed holds each data position (for feed tags)
    run_after: torch.Tensor  # [R] int64: feed tokens that follow this zone's feed with no model token between
    width: int  # vocabulary size + 1 (the last column catches out-of-vocabulary ids)
    hops: int  # most forced-only zones one run of feed crosses (bounds the loop in `advance`)


def normalized_budget(budget: int, feed_len: int) -> int:
    """The budget as `step` compares it: `gen + 1 >= budget` fires exactly where the semantics leave the zone.

    A forced-only zone (budget 0) leaves with its last feed token, the `feed_len`-th (an empty one times out on
    its first step, as budget 0 says). Otherwise feed tokens never time out, so a budget inside the feed acts at
    the first model token, `feed_len + 1`.
    """
    return feed_len if budget == 0 else max(budget, feed_len + 1)


@dataclass(frozen=True)
class Linked:
    """Linked tables plus the host-side metadata the automaton needs for labels and entry points."""

    tables: Tables
    entry: tuple[int, ...]  # global row of each program's first zone (its HALT row if it has no zones)
    labels: tuple[str, ...]  # per global row, "halt" for HALT rows
    tag_names: tuple[str, ...]  # union of the programs' tags, in first-declared order
    zone_base: torch.Tensor  # [R] global row of the row's program's zone 0 (local pc = pc - zone_base[pc])
    data_base: torch.Tensor  # [R] offset of the row's program's data (local ptr = ptr - data_base[pc])


def link(programs: Sequence[Program], device: torch.device | str = "cpu") -> Linked:
    """Concatenate and relocate `programs` into one set of tables on `device`."""
    if not programs:
        raise ValueError("link needs at least one program")
    tag_names = tuple(dict.fromkeys(name for program in programs for name in program.tag_names))
    width = max(program.vocab_size for program in programs) + 1

    block = BLOCK_HEADER + width
    rows: list[list[int]] = []
    halt: list[bool] = []
    pad: list[int] = []
    labels: list[str] = []
    zone_base: list[int] = []
    data_base: list[int] = []
    entry: list[int] = []
    data: list[int] = []
    tag_rows: list[list[bool]] = []
    data_zone: list[int] = []
    run_after: list[int] = []
    hops = 0
    targets: list[int] = []  # [stay, next, jump] per row
    step_slots: list[int] = []  # flat indices into `flat` of step-trigger classes
    jump_slots: list[int] = []

    for program in programs:
        row0, d0 = len(labels), len(data)
        entry.append(row0)
        data.extend(program.data)
        after, program_hops = _feed_runs(program)
        run_after += after
        hops = max(hops, program_hops)
        for z in range(program.halt + 1):
            row = row0 + z
            base = row * block
            zone = program.zones[z] if z < program.halt else None
            feed_len = program.end(z) - program.start(z)
            if zone is None:
                rows.append([d0 + program.start(z), 0, 0, program.pad, base + BLOCK_HEADER, base])
                targets += [row, row, row]
                tags: set[str] = set()
            else:
                timeout = zone.timeout_token if zone.timeout_token is not None else program.pad
                budget = normalized_budget(program.budget(z), feed_len)
                rows.append([d0 + program.start(z), feed_len, budget, timeout, base + BLOCK_HEADER, base])
                targets += [row, row + 1, row0 + zone.jump_to if zone.jump_to is not None else row]
                tags = set(zone.tags)
                step_slots += [base + BLOCK_HEADER + token for token in zone.until]
                if zone.jump_to is not None:
                    jump_slots += [base + BLOCK_HEADER + token for token in zone.jump_on]
            halt.append(zone is None)
            pad.append(program.pad)
            labels.append("halt" if zone is None else zone.label)
            zone_base.append(row0)
            data_base.append(d0)
            tag_rows.append([name in tags for name in tag_names])
            data_zone += [row] * feed_len

    flat = torch.zeros(len(rows), block, dtype=torch.int64)
    flat[:, :BLOCK_HEADER] = torch.tensor(targets, dtype=torch.int64).reshape(len(rows), BLOCK_HEADER)
    flat = flat.reshape(-1)
    # `until` first, then `jump_on` overwrites: a token in both sets takes the jump.
    flat[torch.tensor(step_slots, dtype=torch.int64)] = STEP_CLASS
    flat[torch.tensor(jump_slots, dtype=torch.int64)] = JUMP_CLASS
    data.append(programs[0].pad)
    data_zone.append(len(rows) - 1)  # the sentinel belongs to a HALT row: no tags

    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    tables = Tables(
        rows=longs(rows).reshape(len(rows), 6),
        flat=flat.to(device),
        halt=torch.tensor(halt, dtype=torch.bool, device=device),
        pad=longs(pad),
        tags=torch.tensor(tag_rows, dtype=torch.bool, device=device).reshape(len(rows), len(tag_names)),
        data=longs(data),
        data_zone=longs(data_zone),
        run_after=longs(run_after),
        width=width,
        hops=hops,
    )
    return Linked(
        tables=tables,
        entry=tuple(entry),
        labels=tuple(labels),
        tag_names=tag_names,
        zone_base=longs(zone_base),
        data_base=longs(data_base),
    )


def _feed_runs(program: Program) -> tuple[list[int], int]:
    """Per row (zones and HALT): feed tokens emitted after this zone's own before the model's next token, and the
    most forced-only zones such a run crosses. Only a forced-only zone with feed hands over without a model token
    (an empty one times out on its first step instead)."""
    zones = range(program.halt)
    passes_on = [program.budget(z) == 0 and program.end(z) > program.start(z) for z in zones]
    after, hops = [0] * (program.halt + 1), [0] * (program.halt + 1)
    for z in reversed(zones):
        if passes_on[z]:
            after[z] = program.end(z + 1) - program.start(z + 1) + after[z + 1]
            hops[z] = 1 + hops[z + 1]
    return after, max(hops)
