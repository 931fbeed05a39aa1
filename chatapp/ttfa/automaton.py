"""The batched TTFA: per-row state stepped by gathers from linked tables.

`ttfa_step` and `ttfa_advance` are pure functions of (state, tables, input): no Python branch depends on tensor
values and nothing reads a tensor back to the host, so they run unchanged on CUDA without synchronising, compile
with `torch.compile(fullgraph=True)` and capture in a CUDA graph. `Automaton` wraps them with the state and the
host-side metadata (labels, tag names) the engine and the UI need.

The seed's three state values are `pc`, `ptr` and `gen`. Within a zone `ptr` always equals
`start + min(gen, feed_len)` (both advance together while feeding, and `ptr` stops at the end of the feed), so
only `pc` and `gen` are stored and `ptr` is derived: two fewer ops per step. Replacing the sampled token costs
O(B) per step; masking logits would cost O(B·V).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from chatapp.ttfa.program import Program
from chatapp.ttfa.tables import BLOCK_BASE, BUDGET, FEED_LEN, NEXT, START, Tables, link


class TTFAState(NamedTuple):
    """Per-row automaton state, int64 `[B]` on the tables' device. `pc` is the global (linked) row."""

    pc: torch.Tensor
    gen: torch.Tensor


class StepOutput(NamedTuple):
    state: TTFAState
    tokens: torch.Tensor  # [B] int64, the emitted tokens
    forced: torch.Tensor  # [B] bool, emitted by the automaton rather than the model
    tags: torch.Tensor  # [B, N] bool, tags of the zone each token was emitted in


def ttfa_step(state: TTFAState, tables: Tables, tokens: torch.Tensor) -> StepOutput:
    """One automaton step for every row: replace `tokens` where the program forces, then take transitions."""
    pc, gen = state
    start, feed_len, budget, timeout_token, class_base, block_base = tables.rows.index_select(0, pc).unbind(1)
    feeding = gen < feed_len
    feed_token = tables.data.take(start + torch.minimum(gen, feed_len))
    # The class of the model's token is also the transition it asks for: 0 stay, 1 step, 2 jump.
    cls = tables.flat.take(class_base + tokens.clamp(0, tables.width - 1))
    gen = gen + 1
    # Timeout, or for a forced-only zone its last feed token (budgets are normalised so one test covers both).
    over = gen >= budget
    model_choice = torch.maximum(cls, over)  # a trigger wins over the timeout; the timeout takes the step
    choice = torch.where(feeding, over, model_choice)  # a feed token never fires a trigger
    forced = feeding | (model_choice > cls)  # feeding, or the timeout replaced the model's token
    out = torch.where(forced, torch.where(feeding, feed_token, timeout_token), tokens)
    new_pc = tables.flat.take(block_base + choice)
    new_gen = gen.masked_fill(choice > 0, 0)  # entering a zone (even the same one) restarts its count
    return StepOutput(TTFAState(new_pc, new_gen), out, forced, tables.tags.index_select(0, pc))


def ttfa_ptr(state: TTFAState, tables: Tables) -> torch.Tensor:
    """The seed's feed pointer into `tables.data`, derived from `pc` and `gen`."""
    row = tables.rows.index_select(0, state.pc)
    return row[:, START] + torch.minimum(state.gen, row[:, FEED_LEN])


def ttfa_pending_feed(state: TTFAState, tables: Tables) -> torch.Tensor:
    """Feed tokens each row will emit before the model's next token: the rest of the current zone's feed, plus the
    feeds of the zones a forced-only zone hands over to (0 for HALT rows)."""
    row = tables.rows.index_select(0, state.pc)
    return (row[:, FEED_LEN] - state.gen).clamp(min=0) + tables.run_after.index_select(0, state.pc)


def ttfa_advance(state: TTFAState, tables: Tables, n: torch.Tensor) -> TTFAState:
    """The state after each row emits its next `n[b]` feed tokens (requires `n <= pending feed`).

    Equal to `n[b]` calls of `ttfa_step` on the feed tokens: feeding only counts `gen` up, and the one transition
    a feed token can cause, leaving a forced-only zone with its last token, is taken at each zone boundary the run
    crosses. The loop bound is a property of the programs (`tables.hops`), not of the data, so nothing syncs.
    """
    pc, gen = state
    for _ in range(tables.hops + 1):
        row = tables.rows.index_select(0, pc)
        taken = torch.minimum(n, (row[:, FEED_LEN] - gen).clamp(min=0))
        gen = gen + taken
        n = n - taken
        leave = (taken > 0) & (gen >= row[:, BUDGET])
        pc = torch.where(leave, tables.flat.take(row[:, BLOCK_BASE] + NEXT), pc)
        gen = gen.masked_fill(leave, 0)
    return TTFAState(pc, gen)


def _feed_positions(state: TTFAState, tables: Tables, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in `data` of each row's next `k` feed tokens (clamped in bounds) and which of them are feed."""
    index = ttfa_ptr(state, tables)[:, None] + torch.arange(k, device=state.pc.device)
    valid = torch.arange(k, device=state.pc.device) < ttfa_pending_feed(state, tables)[:, None]
    return index.clamp(max=tables.data.numel() - 1), valid


def ttfa_peek_feed(state: TTFAState, tables: Tables, k: int) -> torch.Tensor:
    """The next `k` feed tokens per row, `[B, k]`; positions past the pending feed hold the row's pad token."""
    index, valid = _feed_positions(state, tables, k)
    return torch.where(valid, tables.data[index], tables.pad.index_select(0, state.pc)[:, None])


def ttfa_peek_feed_tags(state: TTFAState, tables: Tables, k: int) -> torch.Tensor:
    """Tags `[B, k, N]` of the zones the next `k` feed tokens will be emitted in (all False past the feed)."""
    index, valid = _feed_positions(state, tables, k)
    return tables.tags[tables.data_zone[index]] & valid[:, :, None]


class Automaton:
    """A batch of TTFA rows, each running one of `programs` (row `b` runs `programs[row_program[b]]`).

    All tensors live on `device`; `step`, `advance`, `pending_feed`, `peek_feed` and `select_rows` never read
    them back. `done()`, `zone_labels()` and `local_state()` are host queries and do.

    Decoding feeds each sampled token through `step`. Fast-forward pushes the known feed through the model at once
    and leaves the automaton where the same tokens stepped one by one would:

        n = automaton.pending_feed()                 # [B] feed tokens known ahead (0 where the model speaks next)
        k = int(n.max())                             # the caller's host read, folded into its per-step copy
        ids, tags = automaton.peek_feed(k), automaton.peek_feed_tags(k)
        model.extend(ids, n, cache)                  # right-padded; rows with n = 0 untouched
        automaton.advance(n)
    """

    def __init__(self, programs: Sequence[Program], row_program: Sequence[int], device: torch.device | str = "cpu"):
        self.programs = tuple(programs)
        self.device = torch.device(device)
        linked = link(self.programs, self.device)
        self.tables = linked.tables
        self._entry = linked.entry
        self._labels = linked.labels
        self._zone_base = linked.zone_base
        self._data_base = linked.data_base
        self.tag_names: list[str] = list(linked.tag_names)
        self.state = self._entry_state(row_program)

    # -- the hot path ----------------------------------------------------------------------------------------

    def step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Consume the model's tokens `[B]`; return the emitted tokens, forced flags and tags `[B, N]`."""
        out = ttfa_step(self.state, self.tables, tokens.to(torch.int64))
        self.state = out.state
        return out.tokens, out.forced, out.tags

    def pending_feed(self) -> torch.Tensor:
        """Forced feed tokens known ahead per row `[B]` (the rest of the current zone's feed)."""
        return ttfa_pending_feed(self.state, self.tables)

    def peek_feed(self, k: int) -> torch.Tensor:
        """The next `k` feed tokens per row `[B, k]`, padded with the row's pad past its pending feed."""
        return ttfa_peek_feed(self.state, self.tables, k)

    def peek_feed_tags(self, k: int) -> torch.Tensor:
        """`[B, k, N]`: the tags each of the next `k` feed tokens carries (a run may cross zones)."""
        return ttfa_peek_feed_tags(self.state, self.tables, k)

    def advance(self, n: torch.Tensor) -> None:
        """Emit `n[b]` feed tokens of each row without stepping (fast-forward; `peek_feed` shows them).

        Leaves exactly the state `n[b]` `step` calls would. `n` must lie in `0..pending_feed()`; this is checked
        on the device without a host sync (`torch._assert_async`).
        """
        n = n.to(device=self.device, dtype=torch.int64)
        torch._assert_async(((n >= 0) & (n <= self.pending_feed())).all())
        self.state = ttfa_advance(self.state, self.tables, n)

    def halted(self) -> torch.Tensor:
        """`[B]` bool: rows whose program has halted (they only emit pad from now on)."""
        return self.tables.halt[self.state.pc]

    def tags(self) -> torch.Tensor:
        """`[B, N]` tags of each row's current zone."""
        return self.tables.tags[self.state.pc]

    # -- batch management ------------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.state.pc.shape[0]

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` in that order (drop finished rows, permute, or replicate a row)."""
        index = index.to(device=self.device, dtype=torch.int64)
        self.state = TTFAState(*(t.index_select(0, index) for t in self.state))

    def _entry_state(self, row_program: Sequence[int]) -> TTFAState:
        if bad := [p for p in row_program if not 0 <= p < len(self.programs)]:
            raise IndexError(f"row_program refers to programs {bad}; only {len(self.programs)} are linked")
        pc = torch.tensor([self._entry[p] for p in row_program], dtype=torch.int64, device=self.device)
        return TTFAState(pc, torch.zeros_like(pc))

    # -- host queries ----------------------------------------------------------------------------------------

    @property
    def pc(self) -> torch.Tensor:
        return self.state.pc

    @property
    def ptr(self) -> torch.Tensor:
        """The feed pointer into the linked data (derived: `start + min(gen, feed_len)`)."""
        return ttfa_ptr(self.state, self.tables)

    @property
    def gen(self) -> torch.Tensor:
        return self.state.gen

    def done(self) -> bool:
        """True when every row has halted (a host sync; `halted()` is the sync-free mask)."""
        return bool(self.halted().all())

    def zone_labels(self, pc: torch.Tensor | None = None) -> list[str]:
        """The label of each row's zone (`"halt"` for halted rows); `pc` defaults to the current state."""
        rows = (self.state.pc if pc is None else pc).tolist()
        return [self._labels[r] for r in rows]

    def local_state(self) -> tuple[list[int], list[int], list[int]]:
        """`(pc, ptr, gen)` per row relative to each row's own program: zone index (HALT = number of zones)
        and offset into that program's `data`, as the reference interpreter and the disassembler count them."""
        pc, gen = self.state
        return (
            (pc - self._zone_base[pc]).tolist(),
            (self.ptr - self._data_base[pc]).tolist(),
            gen.tolist(),
        )
