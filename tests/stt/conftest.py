"""Tiny random STT / Qwen2 models for the STT tests (hidden 64, 4 layers, 4 heads, 2 KV heads, vocab 300)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from chatapp.stt import STTConfig, STTForCausalLM
from chatapp.stt.random_init import random_routed_model

VOCAB = 300
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_config(**overrides) -> STTConfig:
    return STTConfig(**{**TINY, **overrides})


def routed_model(seed: int = 0, **overrides) -> STTForCausalLM:
    """A random STT model whose causal routers are 'trained': spread-out weights so about half the tokens pass."""
    return random_routed_model(tiny_config(routing_trained=True, **overrides), seed=seed)


@pytest.fixture
def model() -> STTForCausalLM:
    return routed_model()


@pytest.fixture
def qwen2_dir(tmp_path: Path) -> tuple[Qwen2ForCausalLM, Path]:
    """A random transformers Qwen2 checkpoint saved in a temporary directory."""
    torch.manual_seed(1)
    reference = Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()
    path = tmp_path / "qwen2"
    reference.save_pretrained(path)
    return reference, path
