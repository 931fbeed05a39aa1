"""load_model's weight format (the `dtype` argument, $CHATAPP_DTYPE, the per-device default) and thread count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chatapp.errors import ChatappError
from chatapp.models.loader import DTYPE_ENV, THREADS_ENV, load_model
from chatapp.stt.weights import weight_format


def test_load_model_dtype_option_env_and_default(tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    assert weight_format(load_model(tiny_model_dir, device="cpu").model) == "float32"  # small model: float32
    assert weight_format(load_model(tiny_model_dir, device="cpu", dtype="int8").model) == "int8"
    monkeypatch.setenv(DTYPE_ENV, "bf16")
    assert weight_format(load_model(tiny_model_dir, device="cpu").model) == "bfloat16"
    assert weight_format(load_model(tiny_model_dir, device="cpu", dtype="float32").model) == "float32"
    with pytest.raises(ChatappError, match="unknown weight format"):
        load_model(tiny_model_dir, device="cpu", dtype="int3")


def test_load_model_sets_cpu_threads(tiny_model_dir: Path, monkeypatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv(THREADS_ENV, raising=False)
        load_model(tiny_model_dir, device="cpu")
        assert torch.get_num_threads() == 1  # a small model: one thread
        monkeypatch.setenv(THREADS_ENV, "2")
        load_model(tiny_model_dir, device="cpu")
        assert torch.get_num_threads() == 2
        monkeypatch.setenv(THREADS_ENV, "many")
        with pytest.raises(ChatappError, match="CHATAPP_THREADS"):
            load_model(tiny_model_dir, device="cpu")
    finally:
        torch.set_num_threads(before)
