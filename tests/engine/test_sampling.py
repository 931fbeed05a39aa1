"""Sampling: greedy, top-k/top-p against a brute-force oracle, the sampled distribution, per-row independence."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from chatapp.engine.sampling import SamplingParams, _mix32_int, mix32, row_key, row_uniforms, sample
from chatapp.settings import GenerationSettings

CPU = torch.device("cpu")


def params_for(settings: list[GenerationSettings], samples: list[int] | None = None) -> SamplingParams:
    return SamplingParams.build(settings, samples or [0] * len(settings), CPU)


def allowed_oracle(logits: torch.Tensor, s: GenerationSettings) -> set[int]:
    """Temperature, then top-k, then top-p over the survivors, written the slow obvious way (ties kept)."""
    scaled = (logits.double() / s.temperature).tolist()
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = order if s.top_k == 0 else [i for i in order if scaled[i] >= scaled[order[s.top_k - 1]]]
    if s.top_p < 1:
        top = max(scaled[i] for i in keep)
        weights = [math.exp(scaled[i] - top) for i in keep]
        total = sum(weights)
        nucleus, mass = [], 0.0
        for i, w in zip(keep, weights, strict=True):
            if nucleus and mass >= s.top_p:
                break
            nucleus.append(i)
            mass += w / total
        cutoff = scaled[nucleus[-1]]
        keep = [i for i in keep if scaled[i] >= cutoff]
    return set(keep)


def test_hash_matches_host_reference() -> None:
    """The device hash is exact 32-bit arithmetic: equal to the pure-Python one on values near 2**32."""
    values = [0, 1, 12345, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF, 987654321]
    assert mix32(torch.tensor(values)).tolist() == [_mix32_int(v) for v in values]


def test_uniforms_are_in_the_open_unit_interval_and_spread() -> None:
    keys = torch.tensor([row_key(7, 0)] * 20000)
    u = row_uniforms(keys, torch.arange(20000))
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert len(set(u.tolist())) > 19900


def test_greedy_rows_take_the_argmax_next_to_sampling_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    settings = [
        GenerationSettings(),
        GenerationSettings(temperature=1.0, top_p=0.5),
        GenerationSettings(top_k=3),  # top_k without temperature is still greedy
        GenerationSettings(temperature=2.0, top_k=5),
    ]
    tokens = sample(logits, params_for(settings), torch.zeros(4, dtype=torch.long))
    assert tokens[0] == logits[0].argmax()
    assert tokens[2] == logits[2].argmax()


@given(
    seed=st.integers(0, 2**16),
    top_k=st.sampled_from([0, 1, 2, 5, 40]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]),
    temperature=st.sampled_from([0.5, 1.0, 3.0]),
    neighbour=st.sampled_from([GenerationSettings(), GenerationSettings(temperature=1.0, top_p=0.3)]),
)
def test_sampled_tokens_are_inside_top_k_and_top_p(seed, top_k, top_p, temperature, neighbour) -> None:
    torch.manual_seed(seed)
    logits = torch.randn(40) * 3
    s = GenerationSettings(temperature=temperature, top_k=top_k, top_p=top_p)
    allowed = allowed_oracle(logits, s)
    draws = 64
    batch = torch.stack([logits] * draws + [torch.randn(40)])
    params = params_for([s] * draws + [neighbour], [*range(draws), 0])
    tokens = sample(batch, params, torch.full((draws + 1,), seed)).tolist()[:draws]
    assert set(tokens) <= allowed


def test_sampled_frequencies_follow_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    s = GenerationSettings(temperature=1.0, seed=3)
    draws = 20000
    params = params_for([s])
    counters = torch.arange(draws)
    tokens = sample(logits.expand(draws, -1), params.select(torch.zeros(draws, dtype=torch.long)), counters)
    freq = torch.bincount(tokens, minlength=5).double() / draws
    expected = torch.softmax(logits.double(), dim=0)
    assert torch.allclose(freq, expected, atol=0.015)


def test_a_row_draws_the_same_tokens_in_any_batch() -> None:
    """Row independence: same seed/sample/counter -> same token, whatever the batch around it and the code path
    its neighbours force (pure argmax, top-k only, full-sort top-p)."""
    torch.manual_seed(1)
    mine = GenerationSettings(temperature=0.8, top_p=0.9, seed=11)
    row_logits = torch.randn(100)
    alone = [sample(row_logits[None], params_for([mine], [2]), torch.tensor([c])).item() for c in range(30)]
    neighbours = [
        [GenerationSettings()],
        [GenerationSettings(temperature=1.0, top_k=3)] * 5,
        [GenerationSettings(temperature=2.0, top_k=7, top_p=0.2, seed=5), GenerationSettings(seed=1)] * 3,
    ]
    for others in neighbours:
        settings = [*others[:1], mine, *others[1:]]
        batch = torch.randn(len(settings), 100)
        batch[1] = row_logits
        params = params_for(settings, [0, 2, *[0] * (len(settings) - 2)])
        together = [sample(batch, params, torch.full((len(settings),), c))[1].item() for c in range(30)]
        assert together == alone


@pytest.mark.parametrize("field", ["seed", "sample"])
def test_seed_and_sample_index_change_the_stream(field: str) -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, 200)
    s = GenerationSettings(temperature=1.0, seed=1)

    def draw(seed: int, index: int) -> list[int]:
        params = params_for([s.with_(seed=seed)], [index])
        return [sample(logits, params, torch.tensor([c])).item() for c in range(40)]

    assert draw(1, 0) == draw(1, 0)
    assert draw(1, 0) != (draw(2, 0) if field == "seed" else draw(1, 1))
