"""Continuous batching: one decode batch that requests join and leave between steps (`chatapp serve`'s loop).

`Engine.generate` runs a fixed set of rows from prefill to their last token. A server cannot wait for a batch to end
before it starts the next request, so here the same decode loop (`loop.py`) runs one long-lived batch instead:

    step(joining, leaving):  rows whose consumer left are dropped (`DecodeLoop.cancel`, the cache compacted at once)
                             ─► each newcomer is prefilled on its own into a cache of its own (`DecodeLoop.open`)
                             ─► they join the batch in one copy of the cache (`DecodeLoop.admit`)
                             ─► one decode step over everything (`DecodeLoop.step`) ─► Step

Nothing about a row depends on the rows beside it (its prompt is prefilled alone; the decode step computes each row
the same whatever else is in the batch), so a request's greedy reply is the one `generate` gives it alone.
A newcomer's prefill runs between two steps, so the running rows wait for it: prompts are not chunked across steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chatapp.engine.events import Step
from chatapp.engine.loop import DecodeLoop, DeviceBatch, RowState
from chatapp.engine.protocols import ModelLike


@dataclass(frozen=True)
class Admission:
    """One request's rows, checked and built by `Engine.admission`, waiting to join a `ContinuousBatch`: its prompt,
    one row per sample (row indices the caller chose, unique in the batch), and the cache slots to start with."""

    prompt_ids: list[int]
    rows: list[RowState]
    cache_len: int

    @property
    def indices(self) -> list[int]:
        return [row.index for row in self.rows]


class ContinuousBatch:
    """A decode batch that rows join and leave between steps. One thread drives it (`step`); it is not shared."""

    def __init__(self, loop: DecodeLoop, model: ModelLike) -> None:
        self._loop = loop
        self._model = model
        self._batch: DeviceBatch | None = None
        self._steps = 0

    @property
    def active(self) -> int:
        """Rows still generating."""
        return 0 if self._batch is None else self._batch.active

    @property
    def size(self) -> int:
        """Rows the device batch holds, finished ones not yet compacted away included."""
        return 0 if self._batch is None else len(self._batch.rows)

    def step(self, joining: Sequence[Admission] = (), leaving: set[int] | frozenset[int] = frozenset()) -> Step | None:
        """Drop the rows in `leaving` (request row indices), admit `joining`, and run one decode step over every
        running row. None when no row is left to step (everything finished or left, nothing joined)."""
        if self._batch is not None and leaving:
            self._loop.cancel(self._batch, set(leaving))
        if joining:
            newcomers = [self._open(admission) for admission in joining]
            if self._batch is None or not self._batch.active:
                self._batch, newcomers = newcomers[0], newcomers[1:]
            if newcomers:
                self._loop.admit(self._batch, newcomers)
        if self._batch is None or not self._batch.active:
            self._batch = None  # its cache is freed now, not when the next request comes
            return None
        step = self._loop.step(self._batch, self._steps)
        self._steps += 1
        return step

    def close(self) -> None:
        """Drop every row and the batch's cache."""
        self._batch = None

    def _open(self, admission: Admission) -> DeviceBatch:
        """A newcomer's rows prefilled alone, into a cache of their own (one row, replicated per sample)."""
        with torch.inference_mode():
            cache = self._model.new_cache(1, admission.cache_len)
        batch, _ = self._loop.open([admission.prompt_ids], admission.rows, cache, num_samples=len(admission.rows))
        return batch
