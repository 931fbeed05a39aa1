"""Chat sessions: continuing from the cache equals a fresh prefill; regenerate, edit, cancel, context policies."""

from __future__ import annotations

import pytest

from chatapp.engine.engine import Engine
from chatapp.errors import ContextOverflowError, ConversationError
from chatapp.settings import GenerationSettings

GREEDY = GenerationSettings(max_tokens=12, routing="off")
SAMPLED = GREEDY.with_(temperature=1.0, seed=3)


def reply(steps) -> list[int]:
    return [e.token for s in steps for e in s.tokens]


def fresh(engine: Engine, prompt: list[int] | tuple[int, ...], settings: GenerationSettings) -> list[int]:
    result = engine.generate_batch([list(prompt)], settings)[0]
    return result.tokens + ([result.stop_token] if result.stop_token is not None else [])


def assert_last_turn_is_a_fresh_prefill(session, engine, answer: list[int], settings) -> None:
    prompt = session.token_ids[: len(session.token_ids) - len(answer)]
    assert fresh(engine, prompt, settings) == answer


@pytest.mark.parametrize("settings", [GREEDY, SAMPLED])
def test_turns_continue_the_cache_and_equal_a_fresh_prefill(scripted, settings) -> None:
    engine, model = scripted({})
    session = engine.session(system="You are terse.")
    first = reply(session.send("Hello! How are you today?", settings))
    assert_last_turn_is_a_fresh_prefill(session, engine, first, settings)
    used = session.context_used
    model.calls.clear()
    second = reply(session.send("What is 37*45?", settings))
    assert model.calls[0][1] == session.context_used - used - len(second)  # only the new segment was prefilled
    assert model.calls[0][1] < used
    assert_last_turn_is_a_fresh_prefill(session, engine, second, settings)
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert session.context_size == engine.context_size


def test_regenerate_and_edit_roll_the_cache_back(engine) -> None:
    session = engine.session()
    reply(session.send("Hello! How are you today?", GREEDY))
    first = reply(session.send("Paris", GREEDY))
    ids_after = session.token_ids
    assert reply(session.regenerate(GREEDY)) == first
    assert session.token_ids == ids_after
    other = reply(session.regenerate(SAMPLED))
    assert_last_turn_is_a_fresh_prefill(session, engine, other, SAMPLED)
    assert len(session.messages) == 4

    edited = reply(session.edit_last("What is 37*45?", GREEDY))
    assert session.messages[2] == {"role": "user", "content": "What is 37*45?"}
    assert_last_turn_is_a_fresh_prefill(session, engine, edited, GREEDY)
    twin = engine.session()
    reply(twin.send("Hello! How are you today?", GREEDY))
    assert reply(twin.send("What is 37*45?", GREEDY)) == edited


def test_cancel_keeps_the_partial_answer_and_a_consistent_cache(engine) -> None:
    session = engine.session()
    steps = session.send("Hello! How are you today?", GREEDY.with_(max_tokens=50))
    seen = [e for _, step in zip(range(3), steps, strict=False) for e in step.tokens]
    steps.close()
    assert session.messages[-1] == {"role": "assistant", "content": engine.chat_format.decode([e.token for e in seen])}
    answer = reply(session.send("Paris", GREEDY))
    assert_last_turn_is_a_fresh_prefill(session, engine, answer, GREEDY)


def test_a_new_turn_finishes_an_abandoned_one_first(engine) -> None:
    session = engine.session()
    steps = session.send("Hello! How are you today?", GREEDY.with_(max_tokens=50))
    partial = [e.token for e in next(steps).tokens]
    answer = reply(session.send("Paris", GREEDY))  # the first stream was left open, never closed
    assert session.messages[1] == {"role": "assistant", "content": engine.chat_format.decode(partial)}
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    assert_last_turn_is_a_fresh_prefill(session, engine, answer, GREEDY)


def test_a_restored_conversation_can_be_continued_and_regenerated(engine) -> None:
    original = engine.session()
    reply(original.send("Hello! How are you today?", GREEDY))
    restored = engine.session()
    restored.messages.extend(original.messages)  # e.g. loaded from the history database
    again = reply(restored.regenerate(GREEDY))
    assert restored.messages == original.messages
    assert_last_turn_is_a_fresh_prefill(restored, engine, again, GREEDY)
    answer = reply(restored.send("Paris", GREEDY))
    assert_last_turn_is_a_fresh_prefill(restored, engine, answer, GREEDY)


def test_a_turn_never_started_changes_nothing(engine) -> None:
    session = engine.session()
    reply(session.send("Hello", GREEDY))
    before = (list(session.messages), session.token_ids)
    session.send("unused", GREEDY)
    session.regenerate(GREEDY)
    assert (session.messages, session.token_ids) == before
    with pytest.raises(ConversationError, match="no turn"):
        engine.session().regenerate(GREEDY)


def test_tool_calls_are_stored_as_parts(scripted, chat_format) -> None:
    prompt = chat_format.render_for_completion([{"role": "user", "content": "3*4?"}])
    call = [chat_format.python_start_id, *chat_format.encode_text("3*4"), chat_format.python_end_id]
    output = [None] * (len(chat_format.encode_text("12")) + 2)
    after = [*chat_format.encode_text("12"), chat_format.assistant_end_id]
    tokens = [*call, *output, *after]
    engine, _ = scripted({len(prompt) + i: t for i, t in enumerate(tokens) if t is not None})
    session = engine.session()
    reply(session.send("3*4?", GREEDY.with_(max_tokens=30)))
    assert session.messages[-1]["content"] == [
        {"type": "python", "text": "3*4"},
        {"type": "python_output", "text": "12"},
        {"type": "text", "text": "12"},
    ]


def test_error_policy_refuses_a_turn_that_cannot_fit(stt_model, chat_tokenizer, chat_format) -> None:
    engine = Engine(stt_model, chat_tokenizer, chat_format, context_size=60)
    session = engine.session()
    steps = list(session.send("Hello! How are you today?", GREEDY.with_(max_tokens=100)))
    assert steps[-1].tokens[-1].finish_reason in ("context", "stop")
    with pytest.raises(ContextOverflowError, match="context"):
        session.send("The quick brown fox jumps over the lazy dog. " * 2, GREEDY)
    assert session.messages[-1]["role"] == "assistant"  # the refused turn left no trace


def test_drop_oldest_policy_forgets_old_turns_and_keeps_the_system(stt_model, chat_tokenizer, chat_format) -> None:
    engine = Engine(stt_model, chat_tokenizer, chat_format, context_size=70)
    settings = GREEDY.with_(context_policy="drop_oldest", max_tokens=8)
    session = engine.session(system="Be brief.")
    for text in ["Hello! How are you today?", "What is 37*45?", "Paris", "The quick brown fox."]:
        answer = reply(session.send(text, settings))
        assert session.context_used < engine.context_size
    assert session.messages[0] == {"role": "system", "content": "Be brief."}
    assert {"role": "user", "content": "Hello! How are you today?"} not in session.messages
    assert session.messages[-2] == {"role": "user", "content": "The quick brown fox."}
    assert_last_turn_is_a_fresh_prefill(session, engine, answer, settings)
