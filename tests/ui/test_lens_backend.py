"""The layer lens through the real backends: `EngineBackend.lens` in process and `ProcessBackend.lens` over the
pipe, for a live answer (its run in the session's tokens), a resumed one (rendered from the messages) and a request
for an answer the conversation does not have."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from chatapp.engine.lens import LensRequest
from chatapp.engine.reply import Reply
from chatapp.errors import ConversationError
from chatapp.ui.backend import EngineBackend
from chatapp.ui.process import ProcessBackend


def answer_of(backend, text: str) -> Reply:
    reply = Reply()
    for step in backend.send(text):
        reply.add_step(step)
    return reply


def request_for(reply: Reply, detail: int | None, answer: int = 0) -> LensRequest:
    return LensRequest(
        answer=answer,
        tokens=tuple(event.token for event in reply.events),
        computed=tuple(event.computed for event in reply.events),
        detail=detail,
    )


def test_engine_backend_reads_a_live_answer(routed_model_dir: Path) -> None:
    backend = EngineBackend.load(routed_model_dir, device="cpu")
    reply = answer_of(backend, "What is 2+2?")
    result = backend.lens(request_for(reply, 1))
    assert [t.token for t in result.tokens] == [e.token for e in reply.events]
    assert result.lens == "raw" and result.stt_layers == (1, 3)
    token = result.tokens[1]
    assert len(token.layers) == 4 and all(not t.layers for i, t in enumerate(result.tokens) if i != 1)
    # The TUI asks for log-probs: the lens's last layer is the model's own distribution.
    assert math.log(token.layers[-1].prob) == pytest.approx(reply.events[1].logprobs.logprob, abs=1e-4)
    # The routing replayed at the predicting position is the one token 0 had when it was fed.
    assert token.computed == tuple(reply.events[0].computed)
    again = backend.lens(request_for(reply, 2))
    assert [t.decision_depth for t in again.tokens] == [t.decision_depth for t in result.tokens]
    assert len(again.tokens[2].layers) == 4


def test_a_resumed_answer_is_read_from_its_messages(routed_model_dir: Path) -> None:
    backend = EngineBackend.load(routed_model_dir, device="cpu")
    reply = answer_of(backend, "What is 2+2?")
    live = backend.lens(request_for(reply, 0))
    backend.new_session([{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": reply.content}])
    resumed = backend.lens(request_for(reply, 0))
    assert [t.token for t in resumed.tokens] == [t.token for t in live.tokens]
    assert resumed.tokens[0].layers[-1].prob == pytest.approx(live.tokens[0].layers[-1].prob, abs=1e-4)
    with pytest.raises(ConversationError, match="answer 3 is not in this conversation"):
        backend.lens(request_for(reply, 0, answer=3))


def test_process_backend_reads_the_lens_over_the_pipe(routed_model_dir: Path) -> None:
    local = EngineBackend.load(routed_model_dir, device="cpu")
    expected = local.lens(request_for(answer_of(local, "How many r are in strawberry?"), 3))
    with ProcessBackend(routed_model_dir, device="cpu") as remote:
        remote.wait_ready(120)
        reply = answer_of(remote, "How many r are in strawberry?")
        result = remote.lens(request_for(reply, 3))
    assert [t.decision_depth for t in result.tokens] == [t.decision_depth for t in expected.tokens]
    assert [layer.prob for layer in result.tokens[3].layers] == pytest.approx(
        [layer.prob for layer in expected.tokens[3].layers], abs=1e-5
    )
