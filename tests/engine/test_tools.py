"""The tool state machine driven by a scripted model, fast-forward against the one-token-per-step path, and tool
calls held to the tool's grammar."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatapp.engine.events import ToolEvent
from chatapp.settings import GenerationSettings
from chatapp.tools.calculator import CALCULATOR_GRAMMAR

GREEDY = GenerationSettings(max_tokens=40, routing="off")


def script_at(position: int, *runs: list[int] | None) -> dict[int, int]:
    """Tokens the model writes from `position` on; a `None` run is a gap the engine fills (forced output) of the
    given length, written as `[None] * n`."""
    script, at = {}, position
    for run in runs:
        for token in run:
            if token is not None:
                script[at] = token
            at += 1
    return script


def block(ids, text: str) -> list[None]:
    """Positions taken by a forced output block holding `text`."""
    return [None] * (len(ids.text(text)) + 2)


@pytest.mark.parametrize("fast_forward", [True, False])
def test_a_call_forces_its_result_and_flags_it(scripted, ids, fast_forward: bool) -> None:
    prompt = ids.prompt()
    call = [ids.start, *ids.text("3*4"), ids.end]
    after = ids.text("12")
    engine, model = scripted(script_at(len(prompt), call, block(ids, "12"), after, [ids.stop]))
    result = engine.generate_batch([prompt], GREEDY.with_(fast_forward=fast_forward))[0]

    output = [ids.out_start, *ids.text("12"), ids.out_end]
    assert result.tokens == [*call, *output, *after]
    assert result.forced == [False] * len(call) + [True] * len(output) + [False] * len(after)
    assert result.finish_reason == "stop"
    assert result.tool_events == [
        ToolEvent("call", "calculator", "3*4"),
        ToolEvent("result", "calculator", "3*4", "12"),
    ]
    assert result.text == "<|python_start|>3*4<|python_end|><|output_start|>12<|output_end|>12"
    widths = [width for _, width in model.step_calls]
    assert max(widths) == (len(output) if fast_forward else 1)


def test_events_arrive_with_their_tokens(scripted, ids) -> None:
    prompt = ids.prompt()
    engine, _ = scripted(script_at(len(prompt), [ids.start, *ids.text("1+1"), ids.end], block(ids, "2"), [ids.stop]))
    events = [e for step in engine.generate([prompt], GREEDY) for e in step.tokens]
    with_tool = [(e.token, e.tool.kind) for e in events if e.tool is not None]
    assert with_tool == [(ids.end, "call"), (ids.out_start, "result")]


def test_a_refused_expression_is_shown_as_an_error_block(scripted, ids) -> None:
    prompt = ids.prompt()
    expr = ids.text("2**10")
    engine, _ = scripted(script_at(len(prompt), [ids.start, *expr, ids.end], [None] * 30))
    result = engine.generate_batch([prompt], GREEDY.with_(max_tokens=len(expr) + 3))[0]
    refusal = result.tool_events[1]
    assert refusal.kind == "refusal" and "not allowed" in refusal.output
    shown = ids.text(f"error: {refusal.output}")
    start = len(expr) + 2
    assert result.tokens[start : start + len(shown) + 2] == [ids.out_start, *shown, ids.out_end]
    assert all(result.forced[start : start + len(shown) + 2])


def test_a_call_that_never_closes_is_cut_and_refused(scripted, ids) -> None:
    prompt = ids.prompt()
    engine, _ = scripted(script_at(len(prompt), [ids.start, *ids.text("1") * 30]), max_expression_tokens=5)
    result = engine.generate_batch([prompt], GREEDY.with_(max_tokens=12))[0]
    ones = ids.text("1") * 5
    assert result.tokens[:8] == [ids.start, *ones, ids.end, ids.out_start]
    assert result.forced[:8] == [False] * 6 + [True, True]  # the closing marker is forced too
    assert [e.kind for e in result.tool_events] == ["call", "refusal"]
    assert result.tool_events[1].output == "expression longer than 5 tokens"


def test_an_open_call_at_max_tokens_ends_the_row_with_a_refusal(scripted, ids) -> None:
    prompt = ids.prompt()
    engine, _ = scripted(script_at(len(prompt), [ids.start, *ids.text("1") * 30]))
    result = engine.generate_batch([prompt], GREEDY.with_(max_tokens=4))[0]
    assert result.finish_reason == "length" and len(result.tokens) == 4
    assert result.tool_events == [
        ToolEvent("refusal", "calculator", "111", "unfinished call: the reply hit max_tokens")
    ]


def test_forced_tokens_do_not_count_toward_max_tokens(scripted, ids) -> None:
    prompt = ids.prompt()
    call = [ids.start, *ids.text("3*4"), ids.end]
    engine, _ = scripted(script_at(len(prompt), call))
    result = engine.generate_batch([prompt], GREEDY.with_(max_tokens=len(call) + 3))[0]
    assert result.sampled_tokens == len(call) + 3
    assert result.forced.count(True) == len(ids.text("12")) + 2
    assert result.finish_reason == "length"


def test_a_call_closed_by_the_last_sampled_token_still_shows_its_result(scripted, ids) -> None:
    prompt = ids.prompt()
    call = [ids.start, *ids.text("3*4"), ids.end]
    engine, _ = scripted(script_at(len(prompt), call))
    result = engine.generate_batch([prompt], GREEDY.with_(max_tokens=len(call)))[0]
    assert result.tokens[-1] == ids.out_end and result.finish_reason == "length"


def test_many_calls_grow_the_cache_past_its_first_allocation(scripted, ids) -> None:
    """The cache is sized for prompt + max_tokens + slack; forced output beyond the slack makes it grow."""
    prompt = ids.prompt()
    call = [ids.start, *ids.text("1+1"), ids.end]
    runs = [run for _ in range(25) for run in (call, block(ids, "2"))]
    engine, _ = scripted(script_at(len(prompt), *runs))
    result = engine.generate_batch([prompt], GREEDY.with_(max_tokens=25 * len(call)))[0]
    assert result.forced.count(True) == 25 * (len(ids.text("2")) + 2) > 64
    assert [e.kind for e in result.tool_events] == ["call", "result"] * 25


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fast_forward_emits_exactly_the_step_by_step_tokens(scripted, ids, temperature: float) -> None:
    """Ragged batches: one row fast-forwards its tool output while the others advance one token per call."""
    prompts = [ids.prompt(), ids.prompt("Hello! How are you today? Tell me about Paris."), ids.prompt("Hi")]
    short = len(prompts[0])
    engine, model = scripted(script_at(short, [ids.start, *ids.text("37*45"), ids.end]), fast_forward="always")
    settings = GenerationSettings(max_tokens=30, temperature=temperature, seed=5, routing="off")
    runs = {}
    for fast_forward in (False, True):
        model.calls.clear()
        model.step_calls.clear()
        steps = list(engine.generate(prompts, settings.with_(fast_forward=fast_forward), num_samples=2))
        runs[fast_forward] = sorted(((e.row, e.token, e.forced) for s in steps for e in s.tokens), key=lambda t: t[0])
        calls = len(model.calls)
        assert max(width for _, width in model.step_calls) == (len(ids.text("1665")) + 2 if fast_forward else 1)
        assert any(e.forced for s in steps for e in s.tokens)
        runs[f"{fast_forward}-calls"] = calls
    assert runs[True] == runs[False]
    assert runs["True-calls"] < runs["False-calls"]


def test_auto_policy_fast_forwards_a_lone_row_only_on_cpu(scripted, ids) -> None:
    """Padding the other rows of a ragged call is wasted compute on a CPU, so "auto" feeds forced tokens one per
    step while several rows are active, and fast-forwards a row that is alone."""
    prompt = ids.prompt()
    call = [ids.start, *ids.text("3*4"), ids.end]
    engine, model = scripted(script_at(len(prompt), call))
    settings = GREEDY.with_(max_tokens=len(call) + 2)
    engine.generate_batch([prompt], settings)
    assert max(width for _, width in model.step_calls) == len(ids.text("12")) + 2
    model.step_calls.clear()
    engine.generate_batch([prompt, prompt], settings)
    assert max(width for _, width in model.step_calls) == 1


def test_a_call_is_held_to_the_tools_grammar(scripted, ids) -> None:
    """The calculator's grammar (`CALCULATOR_GRAMMAR`) constrains what the model writes inside a call: after a
    quoted word only `.count("` can follow, so the engine forces it (flagged forced) rather than let the model
    write `"ab"count(...)` or an answer; the rest of the call is the model's own choice within the grammar."""
    prompt = ids.prompt()
    opening = [ids.start, *ids.text('"ab"')]
    engine, _ = scripted(script_at(len(prompt), opening), max_expression_tokens=24)
    result = engine.generate_batch([prompt], GREEDY.with_(max_tokens=40))[0]
    assert result.tokens[: len(opening)] == opening
    run = result.forced[len(opening) :].index(False)
    forced_text = ids.decode(result.tokens[len(opening) : len(opening) + run])
    assert forced_text.startswith(".count(") and '.count("'.startswith(forced_text), forced_text
    call, outcome = result.tool_events[:2]
    assert call.kind == "call" and call.expression.startswith('"ab".count(')
    assert outcome.kind == "refusal" or re.fullmatch(CALCULATOR_GRAMMAR, call.expression)


def test_without_the_tool_grammar_a_call_is_whatever_the_model_writes(scripted, ids) -> None:
    prompt = ids.prompt()
    call = [ids.start, *ids.text('"ab"count("a")'), ids.end]
    engine, _ = scripted(script_at(len(prompt), call), tool_grammar=False)
    result = engine.generate_batch([prompt], GREEDY.with_(max_tokens=len(call)))[0]
    assert result.tokens[: len(call)] == call and not any(result.forced[: len(call)])
    assert result.tool_events[0].expression == '"ab"count("a")'
    assert result.tool_events[1].kind == "refusal"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.7, 1.0, 1.5]))
def test_every_sampled_call_matches_the_grammar(scripted, ids, seed: int, temperature: float) -> None:
    """Whatever the model samples after a call opens, the expression the calculator gets is in its grammar (or,
    cut at `max_expression_tokens`, as far as it got: every token of it passed the grammar's mask)."""
    prompt = ids.prompt()
    engine, _ = scripted(script_at(len(prompt), [ids.start]), max_expression_tokens=12)
    sampling = GREEDY.with_(max_tokens=24, temperature=temperature, seed=seed)
    events = engine.generate_batch([prompt], sampling)[0].tool_events
    assert events and events[0].kind == "call"  # the scripted call closed by the model or cut at the limit
    for call, outcome in zip(events[0::2], events[1::2], strict=False):
        if call.kind == "call" and not outcome.output.startswith("expression longer than"):
            assert re.fullmatch(CALCULATOR_GRAMMAR, call.expression), call.expression


def test_tool_grammars_can_be_prepared_ahead(scripted) -> None:
    """The TUI's engine builds the grammar's vocabulary index before the first call (`prepare_tool_grammars`);
    an engine whose calls are not constrained builds nothing."""
    engine, _ = scripted({})
    assert engine.toolbox.has_grammars and engine._constraint_vocab is None
    engine.prepare_tool_grammars()
    assert engine._constraint_vocab is not None
    unconstrained, _ = scripted({}, tool_grammar=False)
    unconstrained.prepare_tool_grammars()
    assert not unconstrained.toolbox.has_grammars and unconstrained._constraint_vocab is None


@pytest.mark.parametrize("fast_forward", [True, False])
def test_penalties_see_the_reply_and_its_call_but_not_the_tools_output(scripted, ids, monkeypatch, fast_forward) -> None:
    from chatapp.engine.penalties import PenaltyState

    seen: list[int] = []
    append = PenaltyState.append

    def recording(self, tokens, counts) -> None:
        seen.extend(tokens[0, : int(counts[0])].tolist())
        append(self, tokens, counts)

    monkeypatch.setattr(PenaltyState, "append", recording)
    prompt = ids.prompt()
    call = [ids.start, *ids.text("3*3"), ids.end]
    after = ids.text("9")
    engine, _ = scripted(script_at(len(prompt), call, block(ids, "9"), after, [ids.stop]))
    settings_ = GREEDY.with_(fast_forward=fast_forward, repetition_penalty=2.0, dry_multiplier=5.0)
    result = engine.generate_batch([prompt], settings_)[0]
    output = [ids.out_start, *ids.text("9"), ids.out_end]
    assert result.tokens == [*call, *output, *after]  # the tool's output is forced whatever the penalties say
    assert seen == [*call, *after, ids.stop]
