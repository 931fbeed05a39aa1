"""The skip predictors' fit (`chatapp.training.predictor`) against brute-force least squares on the same tokens."""

from __future__ import annotations

import torch

from chatapp.stt import STTConfig
from chatapp.stt.layers import SkipPredictor
from chatapp.training.predictor import Moments, solve


def _data(n: int, d: int, rank: int, noise: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens y and residuals r = y W + 0.7 + noise, W of rank `rank` (the same W for every seed)."""
    maps = torch.Generator().manual_seed(1234)
    w = torch.randn(d, rank, generator=maps) @ torch.randn(rank, d, generator=maps) / d
    generator = torch.Generator().manual_seed(seed)
    y = torch.randn(n, d, generator=generator) * torch.linspace(0.5, 2.0, d) + 0.3
    r = y @ w + 0.7 + noise * torch.randn(n, d, generator=generator)
    return y, r


def _moments(y: torch.Tensor, r: torch.Tensor, chunks: int = 3) -> Moments:
    moments = Moments(y.shape[1])
    for a, b in zip(y.chunk(chunks), r.chunk(chunks), strict=True):  # sums over chunks = sums over all
        moments.add(a, b)
    return moments


def _predict(fit, y: torch.Tensor) -> torch.Tensor:
    config = STTConfig(hidden_size=y.shape[1], intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                       num_key_value_heads=1, vocab_size=8, skip_mode="predict", predictor_rank=fit.down.shape[0])  # fmt: skip
    predictor = SkipPredictor(config)
    fit.load_into(predictor)
    with torch.no_grad():
        return predictor(y)


def test_an_exactly_low_rank_update_is_recovered() -> None:
    y, r = _data(4000, 24, rank=4, noise=0.0, seed=0)
    held_y, held_r = _data(1000, 24, rank=4, noise=0.0, seed=5)
    fit = solve(_moments(y, r), _moments(held_y, held_r), rank=4)
    torch.testing.assert_close(_predict(fit, held_y), held_r, atol=2e-3, rtol=1e-3)
    assert fit.explained > 0.999


def test_full_rank_fit_equals_least_squares_and_the_error_formula_is_exact() -> None:
    """At full rank and the smallest ridge the map is ordinary least squares with an intercept (torch's lstsq on
    the same tokens), and the held-out error computed from the moments equals the error of its predictions."""
    d = 16
    y, r = _data(3000, d, rank=d, noise=0.3, seed=1)
    held_y, held_r = _data(800, d, rank=d, noise=0.3, seed=2)
    fit = solve(_moments(y, r), _moments(held_y, held_r), rank=d)
    design = torch.cat((y.double(), torch.ones(len(y), 1, dtype=torch.float64)), dim=1)
    solution = torch.linalg.lstsq(design, r.double()).solution
    expected = (torch.cat((held_y.double(), torch.ones(len(held_y), 1, dtype=torch.float64)), 1) @ solution).float()
    torch.testing.assert_close(_predict(fit, held_y), expected, atol=5e-3, rtol=5e-3)
    direct = float((held_r - _predict(fit, held_y)).pow(2).sum(1).mean())
    assert abs(fit.error - direct) <= 1e-3 * direct


def test_a_lower_rank_explains_less() -> None:
    y, r = _data(3000, 20, rank=8, noise=0.1, seed=3)
    held = _moments(*_data(800, 20, rank=8, noise=0.1, seed=4))
    fits = [solve(_moments(y, r), held, rank=k) for k in (2, 4, 8)]
    assert fits[0].explained < fits[1].explained < fits[2].explained
    assert fits[2].explained > 0.9
