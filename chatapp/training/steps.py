"""The one optimisation loop every trainer here runs: the generic STT loop (`training.loop`), the default model's
recipe (`recipes.smollm2.train`) and the routing fine-tune (`training.tune`).

What differs between them is what a step computes (token windows through the teacher's training forward, padded
conversations through two phases, a routed pass against the dense prediction), how each parameter group's learning
rate moves, which parameters share a clipping norm, and what a checkpoint holds. Those come in as functions and
data; the order of the step itself (learning rates set, gradients cleared, backward, clipped, stepped, then the
caller's report and the checkpoint cadence) lives here once, so a fix to it reaches every trainer.

A step's batch must be a function of its index alone (each caller draws it from a seed and the step), so a run
resumed from `start` replays what the uninterrupted run would have done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch


class HasLoss(Protocol):
    @property
    def loss(self) -> torch.Tensor: ...


Out = TypeVar("Out", bound=HasLoss)


@dataclass(frozen=True)
class Clipping:
    """Gradient clipping: each of `groups` clipped to `max_norm` on its own (one group: a global norm). A recipe
    whose parameter groups have gradients of very different scales clips each apart, or the largest would shrink the
    others' updates to nothing. `max_norm` <= 0: no clipping."""

    groups: Sequence[Sequence[torch.nn.Parameter]]
    max_norm: float = 1.0

    def __call__(self) -> None:
        if self.max_norm <= 0:
            return
        for params in self.groups:
            torch.nn.utils.clip_grad_norm_(params, self.max_norm)


@dataclass
class Steps(Generic[Out]):
    """One trainer's loop, steps `start` .. `total` - 1.

    - `compute(step)`: the forward of that step, returning at least the loss to minimise (`.loss`);
    - `lr(step, group)`: the learning rate of a parameter group of `optimizer` at that step;
    - `clip`: the gradient clipping;
    - `after(done, out)`: called once a step is done (`done` = steps done), e.g. a report; optional;
    - `checkpoint(done)`: saves the run, every `checkpoint_every` steps and after the last; optional.
    """

    optimizer: torch.optim.Optimizer
    compute: Callable[[int], Out]
    lr: Callable[[int, dict[str, Any]], float]
    clip: Clipping
    after: Callable[[int, Out], None] | None = None
    checkpoint: Callable[[int], None] | None = None
    checkpoint_every: int = 0

    def run(self, start: int, total: int) -> int:
        """Train from step `start` to `total`; returns the steps done (`total`, or `start` when past it)."""
        for step in range(start, total):
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr(step, group)
            out = self.compute(step)
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            self.clip()
            self.optimizer.step()
            done = step + 1
            if self.after is not None:
                self.after(done, out)
            if self.checkpoint is not None and (
                done == total or (self.checkpoint_every and done % self.checkpoint_every == 0)
            ):
                self.checkpoint(done)
        return max(start, total)
