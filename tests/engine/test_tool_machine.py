"""The tool state machine under random token streams (Hypothesis): whatever the model writes, every call is
answered by exactly one forced output block holding the calculator's result or refusal, and nothing else is forced."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatapp.engine.tools import ToolBox, ToolMachine
from chatapp.tools import CALCULATOR, evaluate

MAX_EXPRESSION = 6


@pytest.fixture(scope="module")
def box(chat_format) -> ToolBox:
    tokenizer = chat_format.tokenizer
    encode, decode = chat_format.encode_text, chat_format.decode
    return ToolBox([CALCULATOR], tokenizer.token_to_id, encode, decode, max_expression_tokens=MAX_EXPRESSION)


def run(box: ToolBox, sampled: list[int]) -> tuple[list[tuple[int, bool]], list]:
    """Drive one row as the engine does: queued forced tokens first, then the model's next token."""
    machine, stream, events = ToolMachine(box), [], []
    for token in sampled:
        while machine.queue:
            forced = machine.queue.popleft()
            stream.append((forced.token, True))
            events += [forced.event] if forced.event else []
        stream.append((token, False))
        event = machine.observe(token)
        events += [event] if event else []
    while machine.queue:
        forced = machine.queue.popleft()
        stream.append((forced.token, True))
        events += [forced.event] if forced.event else []
    return stream, events


@given(data=st.data())
def test_every_call_gets_exactly_its_output_block(box, chat_format, data) -> None:
    start, end = chat_format.python_start_id, chat_format.python_end_id
    out_start, out_end = chat_format.output_start_id, chat_format.output_end_id
    pieces = [start, end, *chat_format.encode_text("12+3*4 - 7 / 0 'a'")]
    sampled = data.draw(st.lists(st.sampled_from(pieces), max_size=40))
    stream, events = run(box, sampled)

    # Parse the stream back: text, then per call its expression, its closing marker and its output block.
    position, calls = 0, []
    while position < len(stream):
        token, forced = stream[position]
        assert not forced, "a forced token outside an output block"
        position += 1
        if token != start:
            continue
        expression = []
        while position < len(stream) and stream[position][0] != end and len(expression) < MAX_EXPRESSION:
            assert not stream[position][1]
            expression.append(stream[position][0])
            position += 1
        if position == len(stream):
            break  # the stream ended inside the call: nothing may be forced for it yet
        closer, closed_by_model = stream[position][0], not stream[position][1]
        assert closer == end
        assert closed_by_model or len(expression) == MAX_EXPRESSION
        text = chat_format.decode(expression)
        if closed_by_model:
            result = evaluate(text.strip())
            shown = result.text if result.ok else f"error: {result.reason}"
        else:
            shown = f"error: expression longer than {MAX_EXPRESSION} tokens"
        block = [out_start, *chat_format.encode_text(shown), out_end]
        assert stream[position + 1 : position + 1 + len(block)] == [(t, True) for t in block]
        position += 1 + len(block)
        calls.append((text, shown))
    # Events come in pairs, the call then its outcome, each naming the expression; the outcome's output is what
    # the block shows (a refusal's block adds the "error: " prefix).
    assert [e.kind for e in events[0::2]] == ["call"] * len(calls)
    assert [(e.expression, e.output if e.kind == "result" else f"error: {e.output}") for e in events[1::2]] == calls
