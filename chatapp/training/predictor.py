"""Fit the skip predictors of "predict" mode: per layer, f(norm(x)) ≈ Δx by reduced-rank ridge regression.

A token an STT layer skips in "predict" mode carries on with x + f(norm(x)) (`stt.layers.SkipPredictor`), so f
should be the best rank-r linear guess of the block's residual Δx from the layer's normed input. That is a least
squares problem with a closed form, fitted from sufficient statistics (means and second moments of norm(x) and Δx,
D x D each) gathered over cached dense passes: forward only, a few MB per layer whatever the number of tokens, so
hundreds of thousands of tokens cost one pass over them.

Reduced-rank ridge: the full ridge map W = (C_yy + λI)⁻¹ C_yr, then the rank-r map whose fitted values are closest
to W's (the top r eigenvectors V of Wᵀ C_yy W, the covariance of the fitted values): W_r = W V Vᵀ, i.e.
down = (W V)ᵀ and up = V. λ is chosen per layer on held-out statistics from a few multiples of the mean input
variance. The first token of a sequence is left out: it is never skipped (the attention sink) and its residuals are
orders of magnitude larger than the others', so it would dominate the fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from chatapp.stt.layers import SkipPredictor, rms_norm

# Ridge strengths tried, as multiples of the mean variance of the normed inputs; the held-out error chooses.
RIDGE_GRID = (1e-4, 1e-3, 1e-2, 1e-1)


@dataclass
class Moments:
    """Running sums over tokens of one layer: count, Σy, Σr, Σyyᵀ, Σyrᵀ, Σ‖r‖² (float64; y = norm(x), r = Δx)."""

    width: int
    count: int = 0
    sum_y: torch.Tensor = field(init=False)
    sum_r: torch.Tensor = field(init=False)
    yy: torch.Tensor = field(init=False)
    yr: torch.Tensor = field(init=False)
    rr: float = 0.0

    def __post_init__(self) -> None:
        d = self.width
        self.sum_y, self.sum_r = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
        self.yy, self.yr = torch.zeros(d, d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)

    def add(self, y: torch.Tensor, r: torch.Tensor) -> None:
        """Tokens y (N, D) with residuals r (N, D)."""
        y, r = y.double(), r.double()
        self.count += y.shape[0]
        self.sum_y += y.sum(0)
        self.sum_r += r.sum(0)
        self.yy += y.T @ y
        self.yr += y.T @ r
        self.rr += float(r.pow(2).sum())

    def centered(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean y, mean r, C_yy, C_yr) per token."""
        n = max(self.count, 1)
        mean_y, mean_r = self.sum_y / n, self.sum_r / n
        return mean_y, mean_r, self.yy / n - torch.outer(mean_y, mean_y), self.yr / n - torch.outer(mean_y, mean_r)

    def error(self, weight: torch.Tensor, bias: torch.Tensor) -> float:
        """Mean over these tokens of ‖r − (y W + b)‖² for the map (W (D, D), b (D))."""
        n = max(self.count, 1)
        fitted_cross = torch.sum(self.yr * weight) + self.sum_r @ bias  # Σ r·(yW + b)
        fitted_square = torch.sum(weight * (self.yy @ weight)) + 2 * (self.sum_y @ weight) @ bias + n * bias @ bias
        return float((self.rr - 2 * fitted_cross + fitted_square) / n)


@dataclass
class PredictorFit:
    """One layer's fitted map and how well it explains Δx (mean squared norms per token)."""

    down: torch.Tensor  # (r, D)
    up: torch.Tensor  # (D, r)
    bias: torch.Tensor  # (D,)
    ridge: float
    residual_energy: float  # held out: E‖Δx‖²
    error: float  # held out: E‖Δx − f(x)‖²

    @property
    def explained(self) -> float:
        """Share of the held-out residual energy the map explains."""
        return 1 - self.error / self.residual_energy if self.residual_energy > 0 else 0.0

    def load_into(self, predictor: SkipPredictor) -> None:
        with torch.no_grad():
            predictor.down.weight.copy_(self.down)
            predictor.up.weight.copy_(self.up)
            predictor.up.bias.copy_(self.bias)


def layer_moments(block, x: torch.Tensor, out: torch.Tensor, valid: torch.Tensor, moments: Moments) -> None:
    """Add the tokens of one layer's dense pass (inputs `x`, outputs `out` (B, T, D)) to `moments`; padding and
    each row's first token left out."""
    keep = valid.clone()
    keep[:, 0] = False
    y = rms_norm(block.input_layernorm, x)[keep]
    moments.add(y.float(), (out - x)[keep].float())


def solve(fit: Moments, held: Moments, rank: int) -> PredictorFit:
    """The reduced-rank ridge map of rank `rank` from `fit`, its ridge strength chosen on `held` (on `fit` itself
    when nothing is held out)."""
    if held.count == 0:
        held = fit
    mean_y, mean_r, c_yy, c_yr = fit.centered()
    d = c_yy.shape[0]
    scale = float(torch.diagonal(c_yy).mean().clamp_min(1e-12))
    eye = torch.eye(d, dtype=torch.float64)
    best: PredictorFit | None = None
    for ridge in RIDGE_GRID:
        full = torch.linalg.solve(c_yy + ridge * scale * eye, c_yr)
        # The fitted values' covariance Wᵀ C_yy W: its top eigenvectors span the best rank-r outputs.
        _, vectors = torch.linalg.eigh(full.T @ c_yy @ full)
        basis = vectors[:, -rank:]
        down = full @ basis  # (D, r): y -> coordinates
        weight = down @ basis.T
        bias = mean_r - mean_y @ weight
        candidate = PredictorFit(
            down=down.T.float().contiguous(),
            up=basis.float().contiguous(),
            bias=bias.float(),
            ridge=ridge,
            residual_energy=held.rr / max(held.count, 1),
            error=held.error(weight, bias),
        )
        if best is None or candidate.error < best.error:
            best = candidate
    assert best is not None
    return best


Passes = Iterable[tuple[list[torch.Tensor], torch.Tensor, bool]]


def layer_statistics(
    model, passes: Passes, layers: Iterable[int]
) -> tuple[dict[int, Moments], dict[int, Moments]]:
    """Per layer, the moments of the fit passes and of the held-out ones. Each pass is (the inputs of every layer and
    the final hidden state, as `route.Cached.inputs`; valid (B, T); whether it is held out); an iterable, so passes
    may be made one at a time."""
    layers = list(layers)
    width = model.config.hidden_size
    fit = {layer: Moments(width) for layer in layers}
    held = {layer: Moments(width) for layer in layers}
    with torch.no_grad():
        for inputs, valid, held_out in passes:
            target = held if held_out else fit
            for layer in layers:
                layer_moments(model.model.layers[layer], inputs[layer], inputs[layer + 1], valid, target[layer])
    return fit, held


def fit_predictors(model, passes: Passes, layers: Iterable[int], rank: int) -> dict[int, PredictorFit]:
    """A rank-`rank` predictor for each of `layers`, fitted on the passes (`layer_statistics`)."""
    fit, held = layer_statistics(model, passes, layers)
    return {layer: solve(fit[layer], held[layer], rank) for layer in fit}
