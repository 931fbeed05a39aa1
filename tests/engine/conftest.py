"""Fixtures for the engine tests: a tiny random Qwen2 checkpoint (saved locally, loaded both by transformers and by
chatapp's STT model), engines over it, and a wrapper that scripts the model's choices at given positions."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from chatapp.chat import ChatFormat
from chatapp.engine.engine import Engine
from chatapp.stt import STTForCausalLM

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture(scope="session")
def qwen_dir(chat_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 checkpoint whose vocabulary is the chat tokenizer's."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=chat_tokenizer.get_vocab_size(), **TINY)).eval()
    path = tmp_path_factory.mktemp("tiny_qwen")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def reference(qwen_dir: Path) -> Qwen2ForCausalLM:
    """The same weights in transformers: the oracle for greedy parity."""
    return Qwen2ForCausalLM.from_pretrained(qwen_dir).eval()


@pytest.fixture(scope="session")
def stt_model(qwen_dir: Path) -> STTForCausalLM:
    return STTForCausalLM.from_pretrained(qwen_dir).eval()


@pytest.fixture(scope="session")
def chat_format(chat_tokenizer) -> ChatFormat:
    return ChatFormat(chat_tokenizer)


@pytest.fixture
def engine(stt_model, chat_tokenizer, chat_format) -> Engine:
    return Engine(stt_model, chat_tokenizer, chat_format)


class ScriptedModel:
    """A real model whose next token is overridden at given absolute positions: `script[p] = t` makes the token at
    position p be t (all other logits -inf), so any sampling setting picks it. Everything else is the real model,
    including the KV cache, so fast-forward and step-by-step runs still exercise real forwards."""

    def __init__(self, model: Any, script: Mapping[int, int]) -> None:
        self._model = model
        self.script = dict(script)
        self.calls: list[tuple[int, int]] = []  # (batch, width) of every extend/decode/feed call
        self.step_calls: list[tuple[int, int]] = []  # the same of the decode steps alone (decode, feed): no prefill

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def extend(self, ids: torch.Tensor, lengths: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
        return self._forward(ids, lengths, cache, **kwargs)

    def _forward(self, ids: torch.Tensor, lengths: torch.Tensor, cache: Any, step: bool = False, **kwargs: Any) -> Any:
        self.calls.append(tuple(ids.shape))
        if step:
            self.step_calls.append(tuple(ids.shape))
        out = self._model.extend(ids, lengths, cache, **kwargs)
        every_position = kwargs.get("all_logits", False)
        for row, position in enumerate(cache.seen.tolist()):
            token = self.script.get(position)
            if token is not None:
                # The logits after the row's last new token (every position's with all_logits: the last one's).
                target = out.logits[row, max(int(lengths[row]) - 1, 0)] if every_position else out.logits[row]
                target.fill_(float("-inf"))
                target[token] = 0.0
        return out

    def decode(self, ids: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
        return self._forward(ids[:, None], torch.ones_like(ids), cache, step=True, **kwargs)

    def feed(self, ids: torch.Tensor, lengths: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
        return self._forward(ids, lengths, cache, step=True, **kwargs)


@pytest.fixture
def scripted(stt_model, chat_tokenizer, chat_format):
    """Build an Engine over the tiny model with a position script."""

    def build(script: Mapping[int, int], **engine_kwargs: Any) -> tuple[Engine, ScriptedModel]:
        model = ScriptedModel(stt_model, script)
        return Engine(model, chat_tokenizer, chat_format, **engine_kwargs), model

    return build


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread, and the test machine's cores are shared with other tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def routed_model(chat_tokenizer) -> STTForCausalLM:
    """An STT model whose causal routers act trained: spread-out weights, so roughly half the tokens run each
    STT layer and the decisions depend on the token and its predecessor."""
    from chatapp.stt import STTConfig
    from chatapp.stt.random_init import random_routed_model

    config = STTConfig(vocab_size=chat_tokenizer.get_vocab_size(), routing_trained=True, **TINY)
    return random_routed_model(config, seed=3)


@pytest.fixture
def ids(chat_format):
    """Token ids by name, and helpers to write scripts."""

    class Ids:
        start, end = chat_format.python_start_id, chat_format.python_end_id
        out_start, out_end = chat_format.output_start_id, chat_format.output_end_id
        stop = chat_format.assistant_end_id

        @staticmethod
        def text(s: str) -> list[int]:
            return chat_format.encode_text(s)

        @staticmethod
        def decode(tokens: list[int]) -> str:
            return chat_format.decode(tokens)

        @staticmethod
        def prompt(s: str = "What is 3*4?") -> list[int]:
            return chat_format.render_for_completion([{"role": "user", "content": s}])

    return Ids
