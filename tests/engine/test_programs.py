"""TTFA programs in the engine, against the per-row reference interpreter (`chatapp.ttfa.reference`).

The model's proposals are scripted at every generated position, so the reference can replay exactly what the
engine's automaton saw and say which token each step emits, whether it was forced, and its tags and zone."""

from __future__ import annotations

import pytest

from chatapp.engine.engine import Engine
from chatapp.settings import GenerationSettings
from chatapp.ttfa import compile_program, load_program, parse_program_toml
from chatapp.ttfa.reference import ReferenceRow

GREEDY = GenerationSettings(max_tokens=40, routing="off")

THINK = """
name = "brief"
tags = ["think", "answer"]
pad = "<|assistant_end|>"

[[zones]]
label = "think"
force = "Let me think"
until = "."
budget = 9
tags = ["think"]

[[zones]]
label = "answer"
until = "!"
tags = ["answer"]
"""


@pytest.fixture(scope="module")
def brief(chat_tokenizer):
    return compile_program(parse_program_toml(THINK), chat_tokenizer)


def proposals(chat_format, text: str, length: int) -> list[int]:
    ids = chat_format.encode_text(text)
    return (ids * (length // len(ids) + 1))[:length]


def expected(program, proposed: list[int], steps: int) -> list[tuple[int, bool, tuple[str, ...], str]]:
    row, out = ReferenceRow(program), []
    for token in proposed[:steps]:
        zone = program.zones[row.pc].label if not row.halted else "halt"
        emitted, forced, tags = row.step(token)
        out.append((emitted, forced, tuple(tags), zone))
        if row.halted:
            break
    return out


def events_by_row(engine: Engine, prompts, settings, programs):
    rows: dict[int, list] = {}
    for step in engine.generate(prompts, settings, programs=programs):
        for e in step.tokens:
            rows.setdefault(e.row, []).append(e)
    return [rows[i] for i in sorted(rows)]


@pytest.mark.parametrize("text", ["abc abc abc", "ab. cd ef gh!", "x. y."])
def test_tokens_flags_tags_and_zones_match_the_reference(scripted, chat_format, brief, text) -> None:
    prompt = chat_format.render_for_completion([{"role": "user", "content": "Hi"}])
    proposed = proposals(chat_format, text, 60)
    engine, _ = scripted({len(prompt) + i: t for i, t in enumerate(proposed)})
    settings = GREEDY.with_(max_tokens=30)
    ours = events_by_row(engine, [prompt, prompt], [settings, settings], programs=[brief, None])
    reference = expected(brief, proposed, len(ours[0]))
    assert [(e.token, e.forced, e.tags, e.zone) for e in ours[0]] == reference
    assert [e.token for e in ours[1]] == proposed[: len(ours[1])]  # the row without a program runs free
    assert all(not e.forced and e.tags == () and e.zone is None for e in ours[1])


def test_a_program_that_halts_ends_the_row(scripted, chat_format, brief) -> None:
    prompt = chat_format.render_for_completion([{"role": "user", "content": "Hi"}])
    proposed = proposals(chat_format, "ok. done! more", 20)
    engine, _ = scripted({len(prompt) + i: t for i, t in enumerate(proposed)})
    events = events_by_row(engine, [prompt], GREEDY, programs=[brief])[0]
    assert events[-1].finish_reason == "program"
    assert events[-1].token == chat_format.encode_text("!")[0]
    assert sum(not e.forced for e in events) < GREEDY.max_tokens


def test_program_tokens_do_not_count_toward_max_tokens(scripted, chat_format, brief) -> None:
    prompt = chat_format.render_for_completion([{"role": "user", "content": "Hi"}])
    proposed = proposals(chat_format, "abc", 20)
    engine, _ = scripted({len(prompt) + i: t for i, t in enumerate(proposed)})
    events = events_by_row(engine, [prompt], GREEDY.with_(max_tokens=3), programs=[brief])[0]
    assert sum(not e.forced for e in events) == 3
    assert sum(e.forced for e in events) == len(chat_format.encode_text("Let me think"))
    assert events[-1].finish_reason == "length"


def test_the_calc_program_drives_the_tool(scripted, chat_format, chat_tokenizer) -> None:
    calc = load_program("calc", chat_tokenizer)
    prompt = chat_format.render_for_completion([{"role": "user", "content": "3*4?"}])
    output = chat_format.encode_text("12")
    # Positions: forced <|python_start|>, the model's expression and <|python_end|>, the tool's block, the answer.
    script = [None, *chat_format.encode_text("3*4"), chat_format.python_end_id, *[None] * (len(output) + 2)]
    script += [*chat_format.encode_text("It is 12"), chat_format.assistant_end_id]
    engine, _ = scripted({len(prompt) + i: t for i, t in enumerate(script) if t is not None})
    result = engine.generate_batch([prompt], GREEDY, programs=[calc])[0]
    block = [chat_format.output_start_id, *output, chat_format.output_end_id]
    expression, answer = chat_format.encode_text("3*4"), chat_format.encode_text("It is 12")
    assert result.tokens == [chat_format.python_start_id, *expression, chat_format.python_end_id, *block, *answer]
    assert result.forced == [True] + [False] * (len(expression) + 1) + [True] * len(block) + [False] * len(answer)
    assert [e.kind for e in result.tool_events] == ["call", "result"]
    assert result.finish_reason == "stop"
    tags = [e.tags for s in engine.generate([prompt], GREEDY, programs=[calc]) for e in s.tokens]
    assert tags[0] == ("tool",) and tags[-1] == ("answer",)


def test_a_session_turn_runs_a_program(scripted, chat_format, brief) -> None:
    prompt = chat_format.render_for_completion([{"role": "user", "content": "Hi"}])
    proposed = proposals(chat_format, "a. b!", 20)
    engine, _ = scripted({len(prompt) + i: t for i, t in enumerate(proposed)})
    session = engine.session()
    events = [e for s in session.send("Hi", GREEDY, program=brief) for e in s.tokens]
    assert [(e.token, e.forced, e.tags, e.zone) for e in events] == expected(brief, proposed, len(events))
    assert session.messages[-1]["content"] == chat_format.decode([e.token for e in events])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fast_forwarded_feeds_equal_step_by_step(scripted, chat_format, chat_tokenizer, brief, temperature) -> None:
    """A feed is pushed through one ragged forward while the other rows step; nothing observable changes."""
    json_program = load_program("json", chat_tokenizer)
    prompts = [chat_format.render_for_completion([{"role": "user", "content": t}]) for t in ("Hi", "Hello there")]
    engine, model = scripted({}, fast_forward="always")
    settings = GenerationSettings(max_tokens=12, temperature=temperature, seed=3, routing="off")
    streams = {}
    for fast_forward in (False, True):
        model.calls.clear()
        model.step_calls.clear()
        rows = events_by_row(engine, prompts, settings.with_(fast_forward=fast_forward), [json_program, brief])
        streams[fast_forward] = [[(e.token, e.forced, e.tags, e.zone, e.finish_reason) for e in r] for r in rows]
        assert (max(width for _, width in model.step_calls) > 1) == fast_forward
        streams[f"calls-{fast_forward}"] = len(model.calls)
    assert streams[True] == streams[False]
    assert streams["calls-True"] < streams["calls-False"]
    assert any(forced for _, forced, *_ in streams[True][0])
