"""The reply fold: what a reply is (the final stop token kept apart) and its statistics, from events alone."""

from __future__ import annotations

import pytest

from chatapp.engine.events import PromptInfo, Step, TokenEvent, ToolEvent
from chatapp.engine.reply import Reply, fold_replies
from chatapp.tools.base import JUPYTER_TOOL_MARKERS


def _event(token: int, text: str, *, row: int = 0, forced: bool = False, special: bool = False, **more) -> TokenEvent:
    return TokenEvent(row=row, token=token, forced=forced, text=text, special=special, **more)


def test_the_final_stop_token_ends_the_reply_but_counts_as_emitted() -> None:
    reply = Reply(num_layers=4, stt_layers=(1, 3))
    gained = [
        reply.add(_event(5, "Hi", computed=(True, False))),
        reply.add(_event(6, "!", forced=True, computed=(True, True))),
        reply.add(_event(2, "<|assistant_end|>", special=True, computed=(False, False), finish_reason="stop")),
    ]
    assert gained == ["Hi", "!", ""]
    assert (reply.text, reply.tokens, reply.forced, reply.stop_token) == ("Hi!", [5, 6], [False, True], 2)
    assert reply.emitted == 3 and reply.forced_count == 1 and reply.sampled_tokens == 1
    assert reply.layer_computed() == {1: pytest.approx(2 / 3), 3: pytest.approx(1 / 3)}
    assert reply.stt_skipped_fraction == pytest.approx(3 / 6)
    assert reply.compute_saved == pytest.approx(3 / 12)  # skipped blocks over all 4 layers of the 3 tokens


def test_a_stop_token_that_is_not_last_stays_in_the_reply() -> None:
    reply = Reply()
    reply.add(_event(2, ".", finish_reason="stop"))
    reply.add(_event(7, "x"))
    assert reply.text == ".x" and reply.stop_token is None


def test_content_splits_tool_calls_for_either_marker_protocol() -> None:
    nanochat = Reply()
    for event in [
        _event(1, "Sure"),
        _event(10, "<|python_start|>", special=True),
        _event(11, "2*3"),
        _event(12, "<|python_end|>", special=True, tool=ToolEvent("call", "calculator", "2*3")),
        _event(13, "<|output_start|>", special=True, forced=True, tool=ToolEvent("result", "calculator", "2*3", "6")),
        _event(14, "6", forced=True),
        _event(15, "<|output_end|>", special=True, forced=True),
        _event(16, " done"),
    ]:
        nanochat.add(event)
    parts = [
        {"type": "text", "text": "Sure"},
        {"type": "python", "text": "2*3"},
        {"type": "python_output", "text": "6"},
        {"type": "text", "text": " done"},
    ]
    assert nanochat.content == parts
    assert nanochat.tool_calls == [{"tool": "calculator", "expression": "2*3", "result": "6"}]

    jupyter = Reply(markers=JUPYTER_TOOL_MARKERS)  # the call's end marker also opens the output
    for event in [
        _event(1, "Sure"),
        _event(10, "<jupyter_code>", special=True),
        _event(11, "2*3"),
        _event(12, "<jupyter_output>", special=True),
        _event(14, "6", forced=True),
        _event(15, "<jupyter_text>", special=True, forced=True),
        _event(16, " done"),
    ]:
        jupyter.add(event)
    assert jupyter.content == parts


def test_fold_replies_times_each_row_until_it_finished() -> None:
    prompt = PromptInfo(rows=2, prompt_tokens=(3, 4), prefill_seconds=0.5, context_used=(3, 4), context_size=64)
    steps = [
        Step(0, (_event(1, "a"), _event(1, "b", row=1, finish_reason="length")), 0.1, 1, prompt),
        Step(1, (_event(2, "c", finish_reason="length"),), 0.2, 0),
    ]
    first, second = fold_replies(steps)
    assert (first.text, first.decode_seconds, first.prompt_tokens) == ("ac", pytest.approx(0.3), 3)
    assert (second.text, second.decode_seconds, second.prompt_tokens) == ("b", pytest.approx(0.1), 4)
    assert (first.context_used, second.context_used) == (3 + 1, 4)  # a last token without routing: not counted


def test_the_fold_imports_no_torch() -> None:
    """The UI folds replies too, and the UI never touches tensors."""
    import subprocess
    import sys
    from pathlib import Path

    import chatapp

    root = str(Path(chatapp.__file__).resolve().parent.parent)
    code = "import sys, chatapp.engine.reply; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_surprise_is_folded_per_stt_layer_and_logprobs_take_openai_shape() -> None:
    """Mean -log p over the tokens with log-probs; per STT layer, over the tokens it computed vs skipped; and the
    reply's tokens (not the final stop token) as OpenAI `logprobs.content` entries."""
    import math

    from chatapp.engine.events import Alternative, TokenEvent, TokenLogprobs
    from chatapp.engine.reply import Reply

    def event(token: int, text: str, p: float, computed: tuple[bool, ...], **kwargs) -> TokenEvent:
        alternative = Alternative(token, text.encode(), math.log(p))
        logprobs = TokenLogprobs(math.log(p), text.encode(), 0.5, (alternative,))
        return TokenEvent(0, token, False, text, router_probs=(0.5, 0.5), computed=computed, logprobs=logprobs, **kwargs)

    reply = Reply(0, 4, (1, 3))
    for item in (
        event(10, "a", 0.5, (True, False)),
        event(11, "b", 0.25, (True, True)),
        event(12, "<|assistant_end|>", 1.0, (False, True), special=True, finish_reason="stop"),
    ):
        reply.add(item)
    assert reply.mean_surprise == (math.log(2) + math.log(4) + 0) / 3
    layers = reply.layer_surprise()
    assert layers[1].computed == (math.log(2) + math.log(4)) / 2 and layers[1].skipped == 0
    assert layers[3].computed == math.log(4) / 2 and layers[3].skipped == math.log(2)
    assert (layers[3].computed_tokens, layers[3].skipped_tokens) == (2, 1)
    content = reply.logprobs_content()
    assert content is not None and [entry["token"] for entry in content] == ["a", "b"]
    assert content[0] == {
        "token": "a",
        "logprob": math.log(0.5),
        "bytes": [97],
        "top_logprobs": [{"token": "a", "logprob": math.log(0.5), "bytes": [97]}],
    }
    plain = Reply()
    plain.add(TokenEvent(0, 10, False, "a"))
    assert plain.logprobs_content() is None and plain.mean_surprise is None and plain.layer_surprise() == {}
