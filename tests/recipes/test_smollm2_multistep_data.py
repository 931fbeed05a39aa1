"""Multi-step tool questions and the held-out knowledge check (chatapp.recipes.smollm2.data)."""

from __future__ import annotations

import random
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.recipes.chats import calculate
from chatapp.recipes.smollm2 import data


def _shape(expression: str) -> str:
    return re.sub(r"\d+", "n", expression)


def _unit_factors(question: str, expression: str) -> set[str]:
    """Numbers the call uses that the question never states: the unit factors (7 days a week, ...)."""
    return {n for n in re.findall(r"\d+", expression) if not re.search(rf"\b{n}\b", question)}


def _structure(question: str, expression: str) -> str:
    """The call's shape with the unit factors kept: `n*24*n` for so much an hour over days, `n*n*n` for boxes."""
    units = _unit_factors(question, expression)
    return re.sub(r"\d+", lambda m: m.group() if m.group() in units else "n", expression)


# The held-out stories' distinctive nouns and settings, none of which a training story may use.
HELD_OUT_NOUNS = re.compile(
    r"\b(caf[eé]|table|chair|stool|shirt|sale|muffin|class|pump|lit(er|re)|music|sav(e|ing)|toy|trail|pencil|"
    r"librar|monday|tuesday|wednesday|cookie|boy|girl)",
    re.IGNORECASE,
)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), held_out=st.booleans())
def test_multistep_questions_are_reproducible_and_right(seed: int, held_out: bool) -> None:
    items = data.multistep_questions(random.Random(seed), 30, held_out)
    assert items == data.multistep_questions(random.Random(seed), 30, held_out)
    for question, answer in items:
        assert question.kind == "multi-step"
        assert " " not in question.expression
        assert calculate(question.expression).result == question.result
        assert question.result.isdigit() and int(question.result) > 0
        assert question.result in answer
        numbers = re.findall(r"\d+", question.expression)
        assert len(numbers) >= 2 and len(set(numbers)) == len(numbers)  # which operand goes where is checkable
        assert len(re.findall(r"[-+*/]", question.expression)) >= 1


def test_every_template_is_used_evenly() -> None:
    for held_out in (False, True):
        count = len(
            {re.sub(r"\d+", "n", q.question) for q, _ in data.multistep_questions(random.Random(2), 1000, held_out)}
        )
        assert count == len(data._MULTI_HELD_OUT if held_out else data._MULTI_TRAIN)  # no two templates read alike
        items = data.multistep_questions(random.Random(3), 2 * count, held_out)
        texts = [re.sub(r"\d+", "n", q.question) for q, _ in items]
        assert len(set(texts)) == count and all(texts.count(t) == 2 for t in texts)


def test_held_out_multistep_is_new_stories_of_trained_structures() -> None:
    """Held out by story and wording, every question; by structure, one shape (two bracketed sums multiplied), the
    evaluation's check that a call composes; the unit factors are all trained (knowledge a call cannot invent)."""
    train = data.multistep_questions(random.Random(0), 600, held_out=False)
    held = data.multistep_questions(random.Random(0), 300, held_out=True)
    train_texts = {re.sub(r"\d+", "n", q.question) for q, _ in train}
    held_texts = {re.sub(r"\d+", "n", q.question) for q, _ in held}
    assert not train_texts & held_texts
    train_shapes = {_shape(q.expression) for q, _ in train}
    held_shapes = {_shape(q.expression) for q, _ in held}
    assert held_shapes - train_shapes == {"(n-n)*(n+n)"}
    train_units = set().union(*(_unit_factors(q.question, q.expression) for q, _ in train))
    held_units = set().union(*(_unit_factors(q.question, q.expression) for q, _ in held))
    assert held_units <= train_units and {"7", "24", "60", "12", "52", "100", "1000"} <= train_units


def test_every_trained_structure_is_told_in_many_stories() -> None:
    """A structure (unit factors kept) is learned across stories, not from one or two: at least 8 stories each, and
    each structure the held-out set asks but the untrained one is a trained structure."""
    stories: dict[str, set[str]] = {}
    for q, _ in data.multistep_questions(random.Random(4), 3 * len(data._MULTI_TRAIN), held_out=False):
        stories.setdefault(_structure(q.question, q.expression), set()).add(re.sub(r"\d+", "n", q.question))
    assert {s: len(t) for s, t in stories.items() if len(t) < 8} == {}
    for shape in ("n*n-n", "n*(n+n)", "(n-n)*n", "n*n-n*n", "n+n+n-n", "n/(n+n)", "n*52*n", "n*24*n", "n*1000-n"):
        assert shape in stories
    held = data.multistep_questions(random.Random(4), 3 * len(data._MULTI_HELD_OUT), held_out=True)
    assert {_structure(q.question, q.expression) for q, _ in held} - set(stories) == {"(n-n)*(n+n)"}


def test_training_stories_avoid_the_held_out_settings() -> None:
    """The held-out set stays a test of new stories: its distinctive nouns are in no training question (and are in
    the held-out questions, so the list is not stale)."""
    assert [q for q, *_ in data._MULTI_TRAIN if HELD_OUT_NOUNS.search(q)] == []
    assert sum(bool(HELD_OUT_NOUNS.search(q)) for q, *_ in data._MULTI_HELD_OUT) >= 10
    for question, *_ in data._MULTI_TRAIN:  # operands in the question's order, no stray numbers
        names = re.findall(r"\{(\w)\}", question)
        assert names == sorted(set(names)) and not re.search(r"\d", question), question


def test_multistep_calls_are_the_whole_problem() -> None:
    questions = data.multistep_questions(random.Random(1), 200, held_out=False)
    for question, _ in questions + data.multistep_questions(random.Random(1), 100, held_out=True):
        stated = re.findall(r"\d+", question.question)
        # Every number the question gives is in the call, in the question's order.
        assert [n for n in re.findall(r"\d+", question.expression) if n in stated] == stated


def test_knowledge_questions_are_new_and_held_out() -> None:
    questions = [q.question for q in data.KNOWLEDGE_QUESTIONS]
    assert len(questions) == 80 and len(set(questions)) == 80
    assert all(q.keywords and all(k.strip() for k in q.keywords) for q in data.KNOWLEDGE_QUESTIONS)
    facts = {q.question for q in data.FACT_QUESTIONS}
    training = set(data.COUNTING_PROMPTS) | set(data.general_prompts(random.Random(0), 480))
    assert not set(questions) & (facts | training)
