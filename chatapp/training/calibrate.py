"""The student router's decision threshold: the one rule both recipes calibrate with.

The causal router (the student) estimates P(the teacher selects this token); its decisions at generation time are
`probability >= router_threshold`. The calibration reads the teacher's and the student's choices on the same
teacher-routed forward passes and picks the threshold by the rule in `calibrate_router_threshold`. The tiny recipe
writes the result into its model's config.json; the SmolLM2 recipe records it beside its own run (its shipped
threshold is a quality choice below the calibrated one, see `recipes.smollm2.train.SHIPPED_ROUTER_THRESHOLD`).

`chatapp route`'s per-layer cutoffs (`training.route`) are a different fit: quantiles of each layer's probabilities
at a chosen skip rate, measured on perplexity, not agreement with a teacher.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

# The student may process at most this fraction of tokens (the top of the 30-70% routing target), and the highest
# threshold within `F1_TOLERANCE` of the best F1 is taken.
MAX_PROCESSED = 0.7
F1_TOLERANCE = 0.005


@dataclass(frozen=True)
class Calibration:
    threshold: float
    f1: float  # student-teacher F1 at `threshold`, mean over STT layers
    processed: float  # fraction of tokens the student processes at `threshold`, mean over STT layers


def calibrate_router_threshold(model: Any, batches: Iterable[tuple[torch.Tensor, Any]]) -> Calibration:
    """The causal router's decision threshold, chosen on `(ids, mask)` batches of whole conversations.

    Why whole conversations: generation always starts at a conversation's first token, and the student's
    probabilities there differ from those in random training windows (the F1 optimum on windows is about twice the
    one on whole conversations, which is also where held-out F1 peaks; measured on the tiny model).
    Rule: on a 0.01 grid, the highest threshold whose student-teacher F1 (mean over STT layers, as `chatapp eval`
    reports it, teacher-routed stream) is within `F1_TOLERANCE` of the best, among thresholds at which the student
    processes at most `MAX_PROCESSED` of the tokens. The F1 curve is flat near its optimum, so the tolerance buys
    compute (a higher threshold, fewer tokens processed) for a negligible F1 loss.
    """
    grid = torch.arange(5, 96, dtype=torch.float32) / 100  # (G,)
    totals = None  # per threshold and layer: true positives, student selections; per layer: teacher selections
    positions = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for ids, _ in batches:
            out = model.forward_eval(ids.to(model.device), "teacher")
            targets = out.teacher_targets.flatten(1).cpu()  # (L_stt, N) bool
            picked = out.router_probs.flatten(1).float().cpu()[None] >= grid[:, None, None]  # (G, L_stt, N)
            counts = ((picked & targets[None]).sum(-1), picked.sum(-1), targets.sum(-1))
            totals = counts if totals is None else tuple(a + b for a, b in zip(totals, counts, strict=True))
            positions += targets.shape[1]
    model.train(was_training)
    if totals is None:
        raise ValueError("no calibration batches")
    true_positives, chosen, teacher = totals
    f1 = (2 * true_positives / (chosen + teacher[None]).clamp(min=1)).mean(-1)  # (G,)
    processed = chosen.float().mean(-1) / positions  # (G,)
    allowed = processed <= MAX_PROCESSED
    if not bool(allowed.any()):
        allowed[-1] = True  # even the highest threshold processes too much: take the sparsest
    best = f1[allowed].max()
    candidates = torch.nonzero(allowed & (f1 >= best - F1_TOLERANCE)).flatten()
    index = int(candidates[-1])
    return Calibration(round(grid[index].item(), 2), f1[index].item(), processed[index].item())
