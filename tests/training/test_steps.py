"""The one step loop (`training.steps`): its order, learning rates per group, clipping, checkpoint cadence and resume."""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch

from chatapp.training.steps import Clipping, Steps


class Out(NamedTuple):
    loss: torch.Tensor


def problem(seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2), torch.randn(8, 16, 4), torch.randn(8, 16, 2)


def steps_for(model: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor, **hooks) -> Steps[Out]:
    optimizer = torch.optim.AdamW(
        [{"params": [model.weight], "base_lr": 0.1}, {"params": [model.bias], "base_lr": 0.01}], lr=0.0
    )
    return Steps(
        optimizer,
        compute=lambda step: Out(((model(x[step % len(x)]) - y[step % len(y)]) ** 2).mean()),
        lr=lambda step, group: group["base_lr"] / (1 + step),
        clip=Clipping([[model.weight], [model.bias]], 0.5),
        **hooks,
    )


def test_a_resumed_run_is_the_run_that_was_not_interrupted():
    model, x, y = problem()
    assert steps_for(model, x, y).run(0, 6) == 6

    killed_model, _, _ = problem()
    saved: dict[int, tuple[dict, dict]] = {}

    class Killed(Exception):
        pass

    def kill_at_5(done: int, out: Out) -> None:
        if done == 5:
            raise Killed

    def keep(done: int) -> None:
        saved[done] = copy.deepcopy((killed_model.state_dict(), killed.optimizer.state_dict()))

    killed = steps_for(killed_model, x, y, after=kill_at_5, checkpoint=keep, checkpoint_every=4)
    with pytest.raises(Killed):
        killed.run(0, 6)
    assert sorted(saved) == [4]  # every 4 steps; the kill came before the end

    resumed_model, _, _ = problem()
    resumed = steps_for(resumed_model, x, y)
    resumed_model.load_state_dict(saved[4][0])
    resumed.optimizer.load_state_dict(saved[4][1])
    assert resumed.run(4, 6) == 6
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_each_group_gets_its_own_rate_and_the_last_step_is_checkpointed():
    model, x, y = problem()
    rates: list[list[float]] = []
    checkpoints: list[int] = []
    steps = steps_for(
        model,
        x,
        y,
        after=lambda done, out: rates.append([g["lr"] for g in steps.optimizer.param_groups]),
        checkpoint=checkpoints.append,
        checkpoint_every=2,
    )
    steps.run(0, 5)
    assert rates == [[pytest.approx(0.1 / (1 + s)), pytest.approx(0.01 / (1 + s))] for s in range(5)]
    assert checkpoints == [2, 4, 5]
    assert steps.run(5, 5) == 5  # nothing left to do: no step, no checkpoint
    assert checkpoints == [2, 4, 5]


def test_clipping_bounds_each_group_on_its_own():
    weight = torch.nn.Parameter(torch.zeros(3))
    bias = torch.nn.Parameter(torch.zeros(1))
    weight.grad, bias.grad = torch.full((3,), 100.0), torch.full((1,), 0.1)
    Clipping([[weight], [bias]], 1.0)()
    assert float(weight.grad.norm()) == pytest.approx(1.0)
    assert float(bias.grad.norm()) == pytest.approx(0.1)  # a small group is not shrunk by a large one
    weight.grad = torch.full((3,), 100.0)
    Clipping([[weight]], 0.0)()  # 0: off
    assert float(weight.grad[0]) == 100.0
