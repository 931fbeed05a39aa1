"""The native step's thread count under load (`chatapp.stt.thread_governor`): a simulated machine whose step time
depends on the count and on what else runs, against the governor's choices; and the numbers of a step, which must
not depend on the count."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.stt import cpu_step
from chatapp.stt.thread_governor import LONGEST_WAIT, OtherLoad, ThreadGovernor

from .conftest import VOCAB
from .test_gemv import int8_model, prefilled


class Machine:
    """`cores` cores, `busy` of them held by other processes; a step at `threads` threads takes 1/threads of the
    single-thread time while the threads fit on the free cores, and five times the two-thread time once one shares a
    core with a busy process (every join waits a scheduler slice: what the 2-core box measured)."""

    def __init__(self, cores: int, busy: float = 0.0) -> None:
        self.cores, self.busy = cores, busy

    def load(self) -> float:
        return self.busy

    def step(self, threads: int) -> float:
        single = 10e-3
        if threads <= self.cores - self.busy + 1e-9:
            return single / threads ** 0.8
        return 5 * single / threads ** 0.8


def run(governor: ThreadGovernor, machine: Machine, steps: int, shape: object = (1, 1)) -> list[int]:
    counts = []
    for _ in range(steps):
        threads = governor.threads()
        counts.append(threads)
        governor.record(shape, threads, machine.step(threads))
    return counts


def test_an_idle_machine_keeps_every_thread_and_never_probes_fewer() -> None:
    machine = Machine(cores=2)
    counts = run(ThreadGovernor(2, load=machine.load), machine, 1000)
    assert set(counts) == {2}


def test_a_busy_core_moves_the_step_to_one_thread_within_a_few_steps() -> None:
    machine = Machine(cores=2, busy=1.0)
    governor = ThreadGovernor(2, load=machine.load)
    counts = run(governor, machine, 200)
    assert governor.current == 1
    assert counts.index(1) <= 3
    # Once moved, the free cores cannot hold two threads: no step goes back to two while the load lasts.
    assert counts[counts.index(1) + 3 :].count(2) == 0


def test_the_count_returns_when_the_load_goes_and_drops_when_it_comes_back() -> None:
    machine = Machine(cores=2, busy=1.0)
    governor = ThreadGovernor(2, load=machine.load)
    run(governor, machine, 100)
    assert governor.current == 1
    machine.busy = 0.0
    counts = run(governor, machine, LONGEST_WAIT + 10)
    assert governor.current == 2 and counts[-1] == 2
    machine.busy = 1.0
    counts = run(governor, machine, 40)
    assert governor.current == 1
    assert counts.count(2) < 15  # the slowdown is seen within a few steps, not after the long wait


def test_without_a_load_reading_the_probes_decide_and_cost_little_on_an_idle_machine() -> None:
    machine = Machine(cores=2)
    governor = ThreadGovernor(2, load=lambda: None)
    counts = run(governor, machine, 4000)
    assert governor.current == 2
    assert counts.count(1) / len(counts) < 0.02
    assert counts[1000:].count(1) / len(counts[1000:]) < 0.01  # once the looks are spaced out
    busy = Machine(cores=2, busy=1.0)
    governor = ThreadGovernor(2, load=lambda: None)
    run(governor, busy, 50)
    assert governor.current == 1


def test_sixteen_cores_with_half_of_them_busy_settle_on_eight() -> None:
    machine = Machine(cores=16, busy=8.0)
    governor = ThreadGovernor(16, load=machine.load)
    run(governor, machine, 300)
    assert governor.current == 8


def test_probe_steps_are_only_compared_with_steps_of_the_same_work() -> None:
    """A probe whose steps have other shapes than the current count's recent ones decides nothing."""
    governor = ThreadGovernor(2, load=lambda: 1.0)
    for _ in range(2):
        governor.record("eight rows", 2, 8e-3)
    assert governor.threads() == 1  # probing one thread
    for _ in range(3):
        governor.record("one row", 1, 1e-3)  # much faster, but other work
    assert governor.current == 2


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(1e-4, 1.0), st.floats(0, 3)), min_size=1, max_size=300))
@settings(max_examples=60, deadline=None)
def test_any_history_keeps_the_count_on_the_ladder(history) -> None:
    loads = iter([load for *_, load in history] + [0.0] * 1000)
    governor = ThreadGovernor(4, load=lambda: next(loads))
    for shape, seconds, _ in history:
        threads = governor.threads()
        assert threads in governor.ladder == [1, 2, 4]
        governor.record(shape, threads, seconds)


def test_other_load_reads_this_machine() -> None:
    load = OtherLoad()
    reading = load()
    assert reading is None or reading >= 0  # too soon to tell, or a share of cores


def test_the_count_changes_no_number_of_a_step(monkeypatch) -> None:
    """Logits, router probabilities and caches bit for bit at one thread and at two, on a ragged batch."""
    model = int8_model()
    results = []
    for threads in ("1", "2"):
        monkeypatch.setenv(cpu_step.THREADS_ENV, threads)
        cache = prefilled(model, [3, 9, 1, 6, 5])
        generator = torch.Generator().manual_seed(7)
        steps = []
        for _ in range(4):
            ids = torch.randint(0, VOCAB, (5,), generator=generator)
            steps.append(cpu_step.kernel_step(model, ids, cache, True, model.config.router_threshold))
        results.append((steps, [k.clone() for k in cache.keys]))
    (one, keys_one), (two, keys_two) = results
    for a, b in zip(one, two, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(keys_one, keys_two, strict=True))


@pytest.mark.parametrize("env", [None, "1"])
def test_the_step_is_governed_unless_the_user_sets_the_count(monkeypatch, env) -> None:
    model = int8_model()
    if env is None:
        monkeypatch.delenv(cpu_step.THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_step.THREADS_ENV, env)
    assert cpu_step.attach(model)
    cache = prefilled(model, [4, 2])
    cpu_step.kernel_step(model, torch.tensor([1, 2]), cache, True, model.config.router_threshold)
    step = model.runtime.native
    threads, governor = step.team()
    if env is None:
        assert governor is step.governor and governor.ceiling == torch.get_num_threads()
    else:
        assert (threads, governor) == (1, None)


def test_a_step_at_fewer_threads_leaves_torchs_count_and_the_governors_ceiling(monkeypatch) -> None:
    """torch's CPU ops and the step share one OpenMP setting: a step run at one thread must not leave torch (and
    so the governor's ceiling, torch's count) at one."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread here: nothing to lower")
    model = int8_model()
    assert cpu_step.attach(model)
    before = torch.get_num_threads()
    monkeypatch.setenv(cpu_step.THREADS_ENV, "1")
    cache = prefilled(model, [4, 2])
    cpu_step.kernel_step(model, torch.tensor([1, 2]), cache, True, model.config.router_threshold)
    assert torch.get_num_threads() == before
    monkeypatch.delenv(cpu_step.THREADS_ENV)
    step = model.runtime.native
    step.governor = ThreadGovernor(before, load=lambda: float(before))  # every core busy: it drops a count
    for _ in range(12):
        cpu_step.kernel_step(model, torch.tensor([1, 2]), cache, True, model.config.router_threshold)
    assert torch.get_num_threads() == before and step.governor.ceiling == before
