"""The one learning-rate schedule: warm-up to the peak, then a monotone cosine decay to the floor."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatapp.training.loop import TrainConfig
from chatapp.training.schedule import warmup_cosine

totals = st.integers(min_value=1, max_value=5000)
floors = st.floats(min_value=0.0, max_value=1.0)


@given(totals, st.data(), floors)
def test_decays_monotonically_from_the_peak_to_the_floor_after_warmup(total, data, floor):
    warmup = data.draw(st.integers(min_value=0, max_value=total))
    step = data.draw(st.integers(min_value=warmup, max_value=total + 10))
    factor = warmup_cosine(step, total, warmup, floor)
    assert floor - 1e-12 <= factor <= 1.0 + 1e-12
    assert warmup_cosine(step + 1, total, warmup, floor) <= factor + 1e-12
    if step == warmup:
        assert factor == pytest.approx(1.0)
    if step >= total and step > warmup:  # (with no decay span, warmup == total, step `total` is still the peak)
        assert factor == pytest.approx(floor)


@given(st.integers(min_value=1, max_value=1000), st.data())
def test_warmup_rises_linearly_and_trains_from_step_zero(warmup, data):
    step = data.draw(st.integers(min_value=0, max_value=warmup - 1))
    factor = warmup_cosine(step, warmup + 100, warmup)
    assert factor == pytest.approx((step + 1) / warmup)
    assert 0 < factor <= 1.0
    assert warmup_cosine(warmup - 1, warmup + 100, warmup) == 1.0  # the peak is reached at the last warm-up step


def test_halfway_is_the_mean_of_peak_and_floor():
    assert warmup_cosine(60, 110, 10, floor=0.2) == pytest.approx(0.6)
    assert warmup_cosine(50, 100, 0) == pytest.approx(0.55)


@given(st.integers(min_value=1, max_value=500), st.integers(min_value=0, max_value=50), st.data())
def test_the_generic_loop_reads_the_same_schedule(steps, warmup, data):
    step = data.draw(st.integers(min_value=0, max_value=steps))
    config = TrainConfig(steps=steps, warmup_steps=warmup, min_lr_ratio=0.3)
    assert config.lr_factor(step) == warmup_cosine(step, steps, warmup, 0.3)
    assert not math.isnan(config.lr_factor(step))
