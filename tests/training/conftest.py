"""A tiny Qwen2 GGUF converted as a user would (`chatapp convert`), for the routing fit and its fine-tune, and the
user's prompts file such a model (no recipe made it) is routed on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from chatapp.cli import app
from chatapp.stt import STTConfig, STTForCausalLM
from tests.models.gguf_files import write_tiny_gguf


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("converted")
    tiny = write_tiny_gguf(folder / "tiny.gguf", "qwen2", seed=3)
    result = CliRunner().invoke(app, ["convert", str(tiny.path), str(folder / "model")])
    assert result.exit_code == 0, result.output
    return folder / "model"


ROUTE_PROMPTS = [
    ["Hello! How are you today?"],
    ["What is the capital of France?"],
    ["Give me three tips for sleeping well."],
    ["Why is the sky blue?"],
    ["Write a short poem about the sea."],
    ["How do I boil an egg?"],
    ["My cat is called Tom.", "What is a good name for a dog?", "What is my cat called?"],
    ["I was born in 1990.", "How many legs does a spider have?", "In which year was I born?"],
]


@pytest.fixture(scope="module")
def route_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight conversations as a user writes them for `chatapp route --prompts` (two that recall a fact)."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [{"messages": [{"role": "user", "content": turn} for turn in turns]} for turns in ROUTE_PROMPTS]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def tiny_stt(vocab_size: int, stt_layers: list[int], **overrides) -> STTForCausalLM:
    """A 4-layer random STT model (seed 0) small enough to train in a test."""
    torch.manual_seed(0)
    config = STTConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        stt_layers=stt_layers,
        tie_word_embeddings=True,
        **overrides,
    )
    return STTForCausalLM(config).eval()
