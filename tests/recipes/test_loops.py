"""The loop rate's measure and its held-out open prompts."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from chatapp.recipes.loops import LOOP_WORDS, open_prompts, repeated_run
from chatapp.recipes.smollm2 import data


def test_a_run_said_three_times_is_a_loop_whatever_its_case_and_punctuation() -> None:
    line = "She began to explore the studio's various art projects."
    run = repeated_run(f"{line} {line.upper()} {line.rstrip('.')}")
    assert run is not None and run in "she began to explore the studio's various art projects"
    assert repeated_run(f"{line} {line} and then she went home to rest.") is None


@given(words=st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f", "g"]), max_size=60))
def test_a_loop_is_a_six_word_run_found_three_times_by_brute_force(words) -> None:
    runs = [tuple(words[i : i + LOOP_WORDS]) for i in range(len(words) - LOOP_WORDS + 1)]
    looping = any(runs.count(run) >= 3 for run in runs)
    assert (repeated_run(" ".join(words)) is not None) == looping


def test_the_open_prompts_are_many_distinct_and_none_is_a_recipe_prompt() -> None:
    prompts = [p.prompt for p in open_prompts()]
    assert len(prompts) >= 60 and len(set(prompts)) == len(prompts)
    trained = {*data._SMALL_TALK, *data.COUNTING_PROMPTS, *(q.question for q in data.FACT_QUESTIONS)}
    shapes = [re.compile(re.sub(r"\\\{\w+\\\}", ".+", re.escape(t)), re.IGNORECASE) for t in data._GENERAL_TEMPLATES]
    for prompt in prompts:
        assert prompt not in trained
        assert not any(shape.fullmatch(prompt) for shape in shapes), prompt
