"""Continuous batching (`Engine.continuous_batch`): rows that join a running batch between steps, and rows that leave
it, change nothing for the others. Each row's greedy reply, log-probs bit for bit, is its reply from `generate`
alone, whenever it joined and whatever joined or left around it (the int8 native step; the tiny routed model)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatapp.engine.reply import Reply
from chatapp.models import load_engine
from chatapp.settings import GenerationSettings

from .test_batch_invariance import prompt_of


@pytest.fixture(scope="module")
def int8_engine(routed_model_dir: Path):
    engine = load_engine(routed_model_dir, "cpu", dtype="int8")
    if engine.model.runtime.native is None:
        pytest.skip("the int8 native step could not be built here (no C compiler)")
    return engine


def signature(reply: Reply) -> tuple:
    return (
        tuple(e.token for e in reply.events),
        tuple(e.forced for e in reply.events),
        tuple(e.logprobs.logprob for e in reply.events),
        reply.finish_reason,
    )


def run_continuous(engine, arrivals: list[tuple[int, str, GenerationSettings]], leave: dict[int, int] | None = None):
    """Run requests that arrive at given steps (`arrivals`: step, prompt, settings) and rows that leave at given
    steps (`leave`: row -> step); each row's folded reply."""
    batch = engine.continuous_batch()
    replies = {row: engine.new_reply(row) for row in range(len(arrivals))}
    leave = leave or {}
    step_no = 0
    while True:
        joining = [
            engine.admission(prompt, setting, first_row=row)
            for row, (at, prompt, setting) in enumerate(arrivals)
            if at == step_no
        ]
        leaving = {row for row, at in leave.items() if at == step_no}
        step = batch.step(joining, leaving)
        if step is None and step_no > max(at for at, _, _ in arrivals):
            break
        for event in step.tokens if step is not None else ():
            replies[event.row].add(event)
        step_no += 1
    return replies


arrival_plans = st.lists(
    st.tuples(
        st.integers(0, 8),  # the step it arrives at
        st.lists(st.integers(0, 200), min_size=1, max_size=60),  # prompt words
        st.integers(1, 10),  # max_tokens
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=arrival_plans)
def test_rows_joining_between_steps_answer_as_alone(int8_engine, plan) -> None:
    arrivals = [(at, prompt_of(words), GenerationSettings(max_tokens=n, logprobs=1)) for at, words, n in plan]
    replies = run_continuous(int8_engine, arrivals)
    for row, (_, prompt, setting) in enumerate(arrivals):
        alone = int8_engine.generate_batch([prompt], setting)[0]
        assert signature(replies[row]) == signature(alone)


def test_a_row_that_leaves_stops_at_once_and_costs_the_others_nothing(int8_engine) -> None:
    setting = GenerationSettings(max_tokens=12, logprobs=1)
    arrivals = [(0, prompt_of([1, 2, 3]), setting), (0, prompt_of([9, 8]), setting), (2, prompt_of([4, 5]), setting)]
    replies = run_continuous(int8_engine, arrivals, leave={1: 3})
    assert len(replies[1].events) == 3  # steps 0, 1 and 2 ran it; from step 3 on it is gone
    for row in (0, 2):
        alone = int8_engine.generate_batch([arrivals[row][1]], setting)[0]
        assert signature(replies[row]) == signature(alone)


def test_samples_and_sampling_rows_join_as_generate_runs_them(int8_engine) -> None:
    """A request of n samples joins as n rows numbered from its first row; sampled rows draw what `generate`
    draws (per-row random streams keyed by seed and sample index)."""
    setting = GenerationSettings(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, logprobs=1)
    greedy = GenerationSettings(max_tokens=8, logprobs=1)
    batch = int8_engine.continuous_batch()
    replies = {row: int8_engine.new_reply(row) for row in range(4)}
    joining = [
        int8_engine.admission(prompt_of([3, 4]), greedy, first_row=0),
        int8_engine.admission(prompt_of([5, 6, 7]), setting, first_row=1, num_samples=3),
    ]
    while (step := batch.step(joining)) is not None:
        joining = []
        for event in step.tokens:
            replies[event.row].add(event)
    alone = int8_engine.generate_batch([prompt_of([5, 6, 7])], setting, num_samples=3)
    assert [signature(replies[row]) for row in (1, 2, 3)] == [signature(r) for r in alone]
    assert signature(replies[0]) == signature(int8_engine.generate_batch([prompt_of([3, 4])], greedy)[0])
    assert batch.active == 0 and batch.size == 0


PENALTY_SETTINGS = [
    {},  # none: the row's batch may hold no penalty state at all
    {"repetition_penalty": 1.3, "repeat_last_n": 8},
    {"presence_penalty": 0.7, "frequency_penalty": 0.4, "repeat_last_n": -1},
    {"dry_multiplier": 0.8, "dry_allowed_length": 1},
    {"repetition_penalty": 1.1, "dry_multiplier": 0.8, "temperature": 0.8, "seed": 3},
]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    plan=st.lists(
        st.tuples(
            st.integers(0, 6),
            st.lists(st.integers(0, 200), min_size=1, max_size=30),
            st.integers(1, 12),
            st.sampled_from(range(len(PENALTY_SETTINGS))),
        ),
        min_size=2,
        max_size=5,
    )
)
def test_rows_with_penalties_join_a_batch_with_or_without_them_and_answer_as_alone(int8_engine, plan) -> None:
    """Penalties keep per-row state (the tokens seen, their counts, DRY's repeats): rows joining a running batch
    bring theirs, rows without penalties join one that has them and the other way round, and every row answers as
    it does alone."""
    arrivals = [
        (at, prompt_of(words), GenerationSettings(max_tokens=n, logprobs=1, **PENALTY_SETTINGS[kind]))
        for at, words, n, kind in plan
    ]
    replies = run_continuous(int8_engine, arrivals)
    for row, (_, prompt, setting) in enumerate(arrivals):
        alone = int8_engine.generate_batch([prompt], setting)[0]
        assert signature(replies[row]) == signature(alone)
