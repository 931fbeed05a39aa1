"""load_model's weight format (the `dtype` argument, $CHATAPP_DTYPE, the per-device default) and thread count."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from chatapp.errors import ChatappError
from chatapp.models.loader import COMPILE_ENV, DTYPE_ENV, THREADS_ENV, load_model
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
        assert torch.get_num_threads() == min(2, len(os.sched_getaffinity(0)))  # capped at the usable cores
        monkeypatch.setenv(THREADS_ENV, "many")
        with pytest.raises(ChatappError, match="CHATAPP_THREADS"):
            load_model(tiny_model_dir, device="cpu")
    finally:
        torch.set_num_threads(before)


def greedy_replies(engine, prompt: str) -> list[int]:
    from chatapp.settings import GenerationSettings

    settings = GenerationSettings(max_tokens=24, routing="student")
    return [e.token for step in engine.generate([prompt, prompt + "?"], settings) for e in step.tokens]


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="torch.compile needs g++")
def test_compiled_decode_gives_the_eager_tokens(tiny_model_dir: Path) -> None:
    """The CUDA step's blocks through torch.compile (`compile_decode`), its logic checked on a CPU: same tokens as
    eager, student routing on (stacks of dense layers between routed ones; a routed subset of rows is a shape of
    its own), in batch and alone."""
    from chatapp.models import load_engine
    from chatapp.stt.decode import compile_decode

    eager = load_engine(tiny_model_dir, "cpu")
    compiled = load_engine(tiny_model_dir, "cpu")
    compile_decode(compiled.model)
    assert eager.model.runtime.compiled is None and compiled.model.runtime.compiled is not None
    for prompt in ("What is 12 times 7?", "How many r's are in strawberry?"):
        assert greedy_replies(compiled, prompt) == greedy_replies(eager, prompt)


def test_one_decode_path_per_format_on_a_cpu(tiny_model_dir: Path, monkeypatch, capsys) -> None:
    """int8 decodes in one native call a step, other formats run the torch step eagerly; nothing is compiled on
    a CPU, asked or not (a notice says so), and a bad $CHATAPP_COMPILE is refused before any work."""
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    int8 = load_model(tiny_model_dir, device="cpu", dtype="int8").model
    assert int8.runtime.native is not None and "native call" in int8.runtime.note
    for fmt in ("float32", "bfloat16", "int4"):
        runtime = load_model(tiny_model_dir, device="cpu", dtype=fmt).model.runtime
        assert runtime.native is None and runtime.compiled is None and "eagerly" in runtime.note
    asked = load_model(tiny_model_dir, device="cpu", dtype="int4", compile=True).model
    assert asked.runtime.compiled is None
    assert "on a CPU the step is not compiled" in capsys.readouterr().err
    monkeypatch.setenv(COMPILE_ENV, "perhaps")
    with pytest.raises(ChatappError, match="CHATAPP_COMPILE='perhaps' is not a yes/no value"):
        load_model(tiny_model_dir, device="cpu")
