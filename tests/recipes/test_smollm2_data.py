"""The default model's recipe data (chatapp.recipes.smollm2.data): held-out material stays out of training."""

from __future__ import annotations

import random

from chatapp.recipes.smollm2 import data


def test_no_training_prompt_is_an_evaluation_question() -> None:
    evaluation = {q.question for q in data.FACT_QUESTIONS}
    training = set(data.COUNTING_PROMPTS) | set(data.general_prompts(random.Random(0), 480))
    assert not evaluation & training


def test_counting_answers_train_only_when_right() -> None:
    assert data.answer_is_right("How many legs does a dog have?", "Dogs have four legs.")
    assert not data.answer_is_right("How many wheels does a bicycle have?", "A bicycle has 5 wheels.")
    assert data.answer_is_right("Write a haiku about rain.", "anything")  # not a counting prompt


def test_held_out_tool_phrasings_are_never_trained() -> None:
    train = {q.question for q, _ in data.tool_questions(random.Random(0), 500, held_out=False)}
    held = {q.question for q, _ in data.tool_questions(random.Random(0), 500, held_out=True)}
    assert not train & held


def test_chained_conversations_ask_each_tool_question_in_its_own_turn() -> None:
    rng = random.Random(0)
    tools = [data.tool_conversation(q, a) for q, a in data.tool_questions(rng, 20, held_out=False)]
    general = [[{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello!"}]]
    chains = data.chained_conversations(rng, 50, tools, general)
    for chain in chains:
        assert len(chain) in (4, 6) and [m["role"] for m in chain] == ["user", "assistant"] * (len(chain) // 2)
        assert any(isinstance(m["content"], list) for m in chain)  # at least one calculator call
    # Tool questions follow tool questions: the case a model trained on single exchanges gets wrong.
    assert any(isinstance(c[1]["content"], list) and isinstance(c[3]["content"], list) for c in chains)


def test_chains_switch_from_a_numeric_call_to_a_letter_count() -> None:
    rng = random.Random(0)
    tools = [data.tool_conversation(q, a) for q, a in data.tool_questions(rng, 30, held_out=False)]
    general = [[{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello!"}]]
    chains = data.chained_conversations(rng, 400, tools, general)
    calls = [[m["content"][0]["text"] for m in c if isinstance(m["content"], list)] for c in chains]
    switches = [c for c in calls if len(c) >= 2 and ".count(" not in c[0] and ".count(" in c[1]]
    # The weak direction is drawn for 0.4 x 0.75 of the chains; plain chains add a few more by chance.
    assert 0.25 * len(chains) < len(switches) < 0.45 * len(chains)


def test_training_mix_keeps_the_held_out_kinds() -> None:
    held = data.tool_questions(random.Random(5), 50, held_out=True)
    assert [q.kind for q, _ in held[:5]] == list(data.EVAL_KINDS)
    train = data.tool_questions(random.Random(5), 60, held_out=False, kinds=data.TRAIN_KINDS)
    assert sum(q.kind == "word problem" for q, _ in train) == 20
