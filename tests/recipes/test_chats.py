"""The recipes' shared chat pieces (chatapp.recipes.chats): calculator calls and held-out splits."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatapp.recipes.chats import (
    SPLITS,
    arithmetic,
    calculate,
    held_out_number,
    is_letter_count,
    letter_count,
    split_list,
    tool_exchange,
)


def test_calls_carry_the_calculators_own_text() -> None:
    product = arithmetic(37, "*", 45)
    count = letter_count("strawberry", "r")
    assert (product.expression, product.result) == ("37*45", "1665")
    assert (count.expression, count.result) == ('"strawberry".count("r")', "3")
    assert is_letter_count(count.expression) and not is_letter_count(product.expression)


def test_an_expression_the_calculator_refuses_is_a_recipe_bug() -> None:
    with pytest.raises(ValueError, match="refused"):
        calculate("__import__('os')")


def test_a_tool_exchange_is_question_call_output_answer() -> None:
    call = arithmetic(6, "/", 3)
    plain = tool_exchange("What is 6/3?", call, "It is 2.")
    assert plain[0] == {"role": "user", "content": "What is 6/3?"}
    assert [(p["type"], p["text"]) for p in plain[1]["content"]] == [
        ("python", "6/3"),
        ("python_output", "2"),
        ("text", "It is 2."),
    ]
    opened = tool_exchange("What is 6/3?", call, "It is 2.", opening="Let me compute that. ")
    assert opened[1]["content"][0] == {"type": "text", "text": "Let me compute that. "}
    assert opened[1]["content"][1:] == plain[1]["content"]


def test_about_a_fifth_of_numbers_are_held_out_with_every_final_digit() -> None:
    held = [n for n in range(1000) if held_out_number(n)]
    assert 150 < len(held) < 250
    assert {n % 10 for n in held} == set(range(10))


@given(st.lists(st.text(min_size=1), unique=True, max_size=40), st.integers(2, 6))
def test_split_lists_partition_their_items(items: list[str], every: int) -> None:
    train, held = (split_list(items, split, every=every) for split in SPLITS)
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(items)
    assert split_list(items, "train", every=every, train_only=["extra"])[-1] == "extra"
