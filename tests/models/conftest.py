"""Fixtures for the models tests: a tiny random STT checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chatapp.stt import STTConfig, STTForCausalLM


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer) -> Path:
    """A tiny random STT checkpoint (2 layers, layer 1 an STT layer) with the shared chat tokenizer."""
    torch.manual_seed(0)
    config = STTConfig(
        vocab_size=chat_tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    directory = tmp_path_factory.mktemp("model")
    STTForCausalLM(config).save_pretrained(directory)
    chat_tokenizer.save(str(directory / "tokenizer.json"))
    return directory
