"""The one threshold calibration (both recipes use it): the rule, checked against a plain loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chatapp.models.loader import load_model
from chatapp.training.calibrate import F1_TOLERANCE, MAX_PROCESSED, calibrate_router_threshold


def test_calibrated_threshold_is_the_cheapest_within_tolerance_of_the_best_f1(routed_model_dir: Path) -> None:
    """Differential: the vectorised calibration against a per-threshold loop over the same teacher/student
    decisions."""
    model = load_model(routed_model_dir, device="cpu").model
    model.config.use_g_threshold_selection = False  # the teacher picks the top 60% of each sequence
    model.config.capacity = 0.6
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(10, model.config.vocab_size, (4, 48), generator=generator), None) for _ in range(3)]
    calibration = calibrate_router_threshold(model, batches)
    assert calibrate_router_threshold(model, batches) == calibration  # deterministic

    with torch.no_grad():
        outs = [model.forward_eval(ids, "teacher") for ids, _ in batches]
    teacher = torch.cat([o.teacher_targets.flatten(1) for o in outs], dim=1)
    probs = torch.cat([o.router_probs.flatten(1).float() for o in outs], dim=1)

    def score(threshold: float) -> tuple[float, float]:
        picked = probs >= threshold
        f1 = [
            2 * (p & t).sum().item() / max(p.sum().item() + t.sum().item(), 1)
            for p, t in zip(picked, teacher, strict=True)
        ]
        return sum(f1) / len(f1), picked.float().mean().item()

    scores = {t / 100: score(t / 100) for t in range(5, 96)}
    allowed = {t: f1 for t, (f1, processed) in scores.items() if processed <= MAX_PROCESSED}
    best = max(allowed.values())
    expected = max(t for t, f1 in allowed.items() if f1 >= best - F1_TOLERANCE - 1e-6)
    assert calibration.threshold == pytest.approx(expected)
    assert calibration.f1 == pytest.approx(scores[expected][0], abs=1e-5)
    assert calibration.processed == pytest.approx(scores[expected][1], abs=1e-5) and calibration.processed <= 0.7
