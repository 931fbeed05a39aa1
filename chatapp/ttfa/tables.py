"""Linking compiled programs into one set of device tables, as a linker relocates object files.

Every program contributes its zones plus its own HALT row; zone indices (`next_pc`, `jump_pc`) are relocated by
the program's base row and feed offsets by its base in the shared flat `data`. Rows of one batch can then run
different programs with the same gathers. Triggers become a per-row token class table `classes[R, V + 1]`
(0 = none, 1 = step, 2 = jump), so a trigger *set* costs the same single gather as one token; column `V` is all
zeros and catches every token id outside the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from chatapp.ttfa.program import Program

NO_CLASS, STEP_CLASS, JUMP_CLASS = 0, 1, 2

# Columns of `Tables.rows`: everything `step` needs about the current zone comes from one gather of one row.
END, BUDGET, TIMEOUT, NEXT, JUMP, CLASS_BASE = range(6)


class Tables(NamedTuple):
    """Device tables indexed by the global row `pc`. A NamedTuple so `torch.compile` sees plain tensor leaves.

    HALT rows need no special case in `step`: a HALT row has no feed, no triggers, budget 0, `pad` as its timeout
    token and itself as its successor, so every step "times out" into the same state and emits pad, forced.
    """

    rows: torch.Tensor  # [R, 6] int64: END, BUDGET, TIMEOUT, NEXT, JUMP, CLASS_BASE (= row * width)
    start: torch.Tensor  # [R] int64, global offset of the zone's feed in data
    halt: torch.Tensor  # [R] bool
    pad: torch.Tensor  # [R] int64, the pad of the row's program
    tags: torch.Tensor  # [R, N] bool
    classes: torch.Tensor  # [R * width] int8, flattened [R, width]: 0 none, 1 step, 2 jump
    data: torch.Tensor  # [D + 1] int64; the trailing pad keeps `data[ptr]` in bounds when ptr == D
    width: int  # vocabulary size + 1 (the last column catches out-of-vocabulary ids)


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

    rows: list[list[int]] = []
    start: list[int] = []
    halt: list[bool] = []
    pad: list[int] = []
    labels: list[str] = []
    zone_base: list[int] = []
    data_base: list[int] = []
    entry: list[int] = []
    data: list[int] = []
    tag_rows: list[list[bool]] = []
    step_slots: list[int] = []  # flat indices row * width + token of the class table
    jump_slots: list[int] = []

    for program in programs:
        row0, d0 = len(labels), len(data)
        entry.append(row0)
        data.extend(program.data)
        for z in range(program.halt + 1):
            row = row0 + z
            zone = program.zones[z] if z < program.halt else None
            if zone is None:  # HALT: times out into itself every step, emitting pad
                rows.append([d0 + program.end(z), 0, program.pad, row, row, row * width])
                tags: set[str] = set()
            else:
                timeout = zone.timeout_token if zone.timeout_token is not None else program.pad
                jump = row0 + zone.jump_to if zone.jump_to is not None else row
                rows.append([d0 + program.end(z), program.budget(z), timeout, row + 1, jump, row * width])
                tags = set(zone.tags)
                step_slots += [row * width + token for token in zone.until]
                if zone.jump_to is not None:
                    jump_slots += [row * width + token for token in zone.jump_on]
            start.append(d0 + program.start(z))
            halt.append(zone is None)
            pad.append(program.pad)
            labels.append("halt" if zone is None else zone.label)
            zone_base.append(row0)
            data_base.append(d0)
            tag_rows.append([name in tags for name in tag_names])

    classes = torch.zeros(len(rows) * width, dtype=torch.int8)
    # `until` first, then `jump_on` overwrites: a token in both sets takes the jump.
    classes[torch.tensor(step_slots, dtype=torch.int64)] = STEP_CLASS
    classes[torch.tensor(jump_slots, dtype=torch.int64)] = JUMP_CLASS
    data.append(programs[0].pad)

    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    tables = Tables(
        rows=longs(rows).reshape(len(rows), 6),
        start=longs(start),
        halt=torch.tensor(halt, dtype=torch.bool, device=device),
        pad=longs(pad),
        tags=torch.tensor(tag_rows, dtype=torch.bool, device=device).reshape(len(rows), len(tag_names)),
        classes=classes.to(device),
        data=longs(data),
        width=width,
    )
    return Linked(
        tables=tables,
        entry=tuple(entry),
        labels=tuple(labels),
        tag_names=tag_names,
        zone_base=longs(zone_base),
        data_base=longs(data_base),
    )
