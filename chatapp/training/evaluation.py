"""Held-out metrics of an STT model: perplexity with routing off / by the teacher / by the student, per-layer
selected fractions, and how well the student (causal router) reproduces the teacher's decisions; and the tally the
recipes' task metrics (does the model call the calculator, recall a fact) count in.

Shared by `chatapp eval`, the training loop's periodic evaluation and both recipes' evaluations. F1 is reported
beside accuracy because at low capacity "never select" already scores a high accuracy (docs/architecture.md, Mixture-of-Depths).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chatapp.compute_saved import compute_saved, skip_cost
from chatapp.stt.layers import select

MODES = ("off", "teacher", "student")
# What each mode routes by, as reports print it: "teacher" is the spec's gate g (`chatapp.stt.teacher`), which only a
# full sequence can compute, and "student" the causal router that runs when the model is served.
MODE_LABELS = {"off": "routing off", "teacher": "teacher gate g", "student": "router"}
KEPT_MISSES = 8


@dataclass
class Tally:
    """Correct out of total for one task metric, and the first few misses (what was asked, what came back)."""

    correct: int = 0
    total: int = 0
    misses: list[str] = field(default_factory=list)

    def add(self, ok: bool, what: str = "") -> None:
        self.correct += int(ok)
        self.total += 1
        if not ok and what and len(self.misses) < KEPT_MISSES:
            self.misses.append(what)

    @property
    def rate(self) -> float:
        return self.correct / self.total if self.total else float("nan")

    def __str__(self) -> str:
        return f"{self.rate:.1%} ({self.correct}/{self.total})" if self.total else "n/a"


def conversation_batches(
    conversations: Iterable[list[dict[str, Any]]], chat_format: Any, max_batch: int = 32
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, loss_mask) batches of whole conversations (message lists) of equal length, for `evaluate`.

    Grouping by exact length means no padding, so selected fractions count only real tokens (padding would be
    routed too and skew them), and each row starts where generation starts. Order is deterministic: by length, then
    the given order.
    """
    by_length: dict[int, list[tuple[list[int], list[int]]]] = {}
    for messages in conversations:
        ids, mask = chat_format.render_conversation(messages)
        by_length.setdefault(len(ids), []).append((list(ids), list(mask)))
    for length in sorted(by_length):
        rows = by_length[length]
        for start in range(0, len(rows), max_batch):
            chunk = rows[start : start + max_batch]
            yield torch.tensor([r[0] for r in chunk]), torch.tensor([r[1] for r in chunk])


@dataclass
class EvalReport:
    """Aggregated metrics over the evaluated tokens; per-layer lists follow `model.stt_layer_indices`."""

    tokens: int = 0
    num_layers: int = 0  # all decoder layers of the model: the denominator of `compute_saved`
    skip_mode: str = "strict"
    skip_cost: float = 0.0  # share of a block a skipped token still computes (`chatapp.compute_saved.skip_cost`)
    loss: dict[str, float] = field(default_factory=dict)  # mode -> mean next-token cross-entropy
    selected_fraction: dict[str, list[float]] = field(default_factory=dict)  # mode -> per STT layer
    student_accuracy: list[float] = field(default_factory=list)  # causal router vs teacher targets
    student_f1: list[float] = field(default_factory=list)

    @property
    def perplexity(self) -> dict[str, float]:
        return {mode: math.exp(min(loss, 50.0)) for mode, loss in self.loss.items()}

    def compute_saved(self, mode: str = "student") -> float:
        """Share of all the model's block computations (tokens x decoder layers) skipped in `mode`; see
        `chatapp.compute_saved`. Without `num_layers` (a report built by hand) the STT layers are taken for all."""
        fractions = self.selected_fraction.get(mode) or []
        return compute_saved(sum(1.0 - f for f in fractions), 1, self.num_layers or len(fractions), self.skip_cost)

    def routed_skipped(self, mode: str = "student") -> float:
        """Share of the STT layers' block computations skipped in `mode` (0 when there are no STT layers)."""
        fractions = self.selected_fraction.get(mode) or []
        return compute_saved(sum(1.0 - f for f in fractions), 1, len(fractions), self.skip_cost)


@dataclass
class _Counts:
    """Running sums for one evaluation."""

    positions: int = 0
    loss: dict[str, float] = field(default_factory=dict)
    selected: dict[str, torch.Tensor] = field(default_factory=dict)
    tp: torch.Tensor | None = None
    fp: torch.Tensor | None = None
    fn: torch.Tensor | None = None
    tn: torch.Tensor | None = None


def _token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
    modes: tuple[str, ...] = MODES,
) -> EvalReport:
    """Evaluate `(ids, loss_mask)` batches (B, T); the loss counts tokens whose mask is set (all when None).

    Selected fractions count every token of the batch (routing runs on prompts too). Student accuracy and F1
    compare the causal router with the teacher's targets on the teacher-routed stream.
    """
    was_training = model.training
    model.eval()
    counts = _Counts()
    tokens = 0  # supervised tokens: the loss denominator
    threshold = model.config.router_threshold
    for ids, mask in batches:
        ids = ids.to(model.device)
        weights = (
            torch.ones_like(ids[:, 1:], dtype=torch.float32) if mask is None else mask[:, 1:].to(model.device).float()
        )
        tokens += int(weights.sum())
        for mode in modes:
            out = model.forward_eval(ids, mode)
            loss = (_token_losses(out.logits, ids) * weights.flatten()).sum().item()
            counts.loss[mode] = counts.loss.get(mode, 0.0) + loss
            picked = out.selected.float().sum(dim=(1, 2))
            counts.selected[mode] = counts.selected.get(mode, 0) + picked
            if mode == "teacher" and out.teacher_targets is not None:
                predicted = select(out.router_probs, threshold)
                target = out.teacher_targets
                for name, hits in (
                    ("tp", predicted & target),
                    ("fp", predicted & ~target),
                    ("fn", ~predicted & target),
                    ("tn", ~predicted & ~target),
                ):
                    total = hits.sum(dim=(1, 2)).double()
                    previous = getattr(counts, name)
                    setattr(counts, name, total if previous is None else previous + total)
        counts.positions += ids.numel()
    if was_training:
        model.train()
    report = EvalReport(
        tokens=tokens,
        num_layers=model.config.num_hidden_layers,
        skip_mode=model.config.skip_mode,
        skip_cost=skip_cost(model.config),
    )
    positions = counts.positions
    for mode in modes:
        if mode in counts.loss:
            report.loss[mode] = counts.loss[mode] / max(tokens, 1)
            report.selected_fraction[mode] = (counts.selected[mode] / max(positions, 1)).tolist()
    if counts.tp is not None:
        tp, fp, fn, tn = counts.tp, counts.fp, counts.fn, counts.tn
        report.student_accuracy = ((tp + tn) / (tp + fp + fn + tn).clamp(min=1)).tolist()
        denominator = 2 * tp + fp + fn
        report.student_f1 = torch.where(denominator > 0, 2 * tp / denominator.clamp(min=1), 1.0).tolist()
    return report
