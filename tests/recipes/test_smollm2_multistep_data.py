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
            {re.sub(r"\d+", "n", q.question) for q, _ in data.multistep_questions(random.Random(2), 500, held_out)}
        )
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
