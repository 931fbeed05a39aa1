"""Token display, and the reply fold's segments and content as the transcript, store and export read them."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatapp.engine.reply import Reply
from chatapp.tools.parts import content_text
from chatapp.ui.streaming import StepChannel
from chatapp.ui.tokens import display_text, marker
from tests.ui.scripted import calculator_answer, greeting, steps, think_answer, tok


def test_markers_are_readable_never_raw():
    assert marker("<|python_start|>") == "⟨python⟩"
    assert marker("<|output_end|>") == "⟨/output⟩"
    assert marker("<|assistant_end|>") == "⟨end⟩"
    assert marker("<think>") == "⟨think⟩"
    assert marker("<|im_end|>") == "⟨end⟩"  # ChatML turn markers read like nanochat's
    assert marker("<jupyter_code>") == "⟨python⟩"  # SmolLM2's tool markers
    for event in calculator_answer() + think_answer():
        assert "<|" not in display_text(event)


def test_typed_special_text_stays_text():
    """A user-visible token whose text merely looks special is not a special token and is shown verbatim."""
    assert display_text(tok("<|python_start|>")) == "<|python_start|>"


def test_tool_call_is_one_segment_between_text():
    events = calculator_answer()
    segments = Reply.of(events).segments
    assert [s.kind for s in segments] == ["text", "tool", "text"]
    tool = segments[1]
    assert events[tool.start].text == "<|python_start|>"
    assert events[tool.end - 1].text == "<|output_end|>"
    assert tool.call is not None and tool.call.expression == "37*45"
    assert tool.outcome is not None and tool.outcome.output == "1665"
    assert segments[0].start == 0 and segments[-1].end == len(events)


@given(st.data())
def test_incremental_segmentation_matches_whole(data):
    """Feeding the stream in arbitrary batches gives the same segments as feeding it at once."""
    events = calculator_answer() + calculator_answer("2+2", "4")
    cuts = sorted(data.draw(st.sets(st.integers(1, len(events) - 1), max_size=8)))
    reply = Reply()
    touched = []
    for start, end in zip([0, *cuts], [*cuts, len(events)], strict=True):
        for event in events[start:end]:
            reply.add(event)
        touched.append([s.start for s in reply.segments_since(start)])
        assert touched[-1] and all(s.end > start for s in reply.segments_since(start))
    assert reply.segments == Reply.of(events).segments


def test_message_content_rebuilds_chat_parts():
    assert Reply.of(greeting()).content == "Hello! How can I help you today?"
    assert Reply.of(think_answer()).content == "<think>Paris is the capital.</think>The capital of France is Paris."
    assert Reply.of(calculator_answer()).content == [
        {"type": "text", "text": "Let me compute that."},
        {"type": "python", "text": "37*45"},
        {"type": "python_output", "text": "1665"},
        {"type": "text", "text": " 37*45 is 1665."},
    ]
    assert (
        content_text(Reply.of(calculator_answer()).content)
        == "Let me compute that.⟨python⟩37*45⟨/python⟩ = 1665 37*45 is 1665."
    )


def test_stats_from_steps():
    events = think_answer()
    stats = Reply(num_layers=8, stt_layers=(1, 3, 5, 7))
    for step in steps(events, prompt_tokens=12, seconds=0.02):
        stats.add_step(step)
    forced = sum(e.forced for e in events)
    assert stats.emitted == len(events)
    assert stats.forced_fraction == forced / len(events)
    assert abs(stats.tokens_per_second - 50.0) < 1e-9
    fed = [e for e in events if e.computed is not None]
    skipped = sum(not c for e in fed for c in e.computed)
    assert stats.stt_skipped_fraction == pytest.approx(skipped / (4 * len(fed)))
    assert stats.compute_saved == pytest.approx(skipped / (8 * len(fed)))
    # The final stop token is never fed to the model, so it does not occupy the context.
    assert stats.context_used == 12 + len(fed)
    assert stats.context_size == 2048


def test_channel_delivers_every_step_once_in_order_across_threads():
    """A producer thread and a consumer taking at its own pace see the stream exactly, in bigger or smaller
    batches but never a step twice or out of order."""
    channel = StepChannel()
    all_steps = steps(greeting() * 50)
    producer = threading.Thread(target=lambda: [channel.put(step) for step in all_steps])
    producer.start()
    received = []
    while producer.is_alive() or len(received) < len(all_steps):
        received += channel.take()
    producer.join()
    assert received == all_steps
    assert channel.take() == []
