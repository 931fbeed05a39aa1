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
def test_compiled_decode_gives_the_eager_tokens(tiny_model_dir: Path, monkeypatch) -> None:
    """`compile=True` runs the decode step's blocks through torch.compile: same tokens as eager, student routing on
    (stacks of dense layers between routed ones; a routed subset of rows is a shape of its own), in batch and
    alone."""
    from chatapp.models import load_engine

    monkeypatch.delenv(COMPILE_ENV, raising=False)
    eager = load_engine(tiny_model_dir, "cpu")
    compiled = load_engine(tiny_model_dir, "cpu", compile=True)
    assert eager.model.compiled_steps is None
    assert compiled.model.compiled_steps is not None
    for prompt in ("What is 12 times 7?", "How many r's are in strawberry?"):
        assert greedy_replies(compiled, prompt) == greedy_replies(eager, prompt)


def test_compile_env_and_failures_are_clear(tiny_model_dir: Path, monkeypatch) -> None:
    import chatapp.stt.precompile as precompile

    monkeypatch.setenv(COMPILE_ENV, "perhaps")
    with pytest.raises(ChatappError, match="CHATAPP_COMPILE='perhaps' is not a yes/no value"):
        load_model(tiny_model_dir, device="cpu")
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert getattr(load_model(tiny_model_dir, device="cpu").model, "compiled_steps", None) is None

    def no_compiler(model) -> None:
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    monkeypatch.setattr(precompile, "precompile", no_compiler)
    with pytest.raises(ChatappError, match="No working C\\+\\+ compiler found") as info:
        load_model(tiny_model_dir, device="cpu", compile=True)
    assert "without --compile" in info.value.hint


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="torch.compile needs g++")
def test_background_compile_switches_the_model_over_when_warm(tiny_model_dir: Path, monkeypatch) -> None:
    """The TUI's engine compiles the decode step in the background (`EngineBackend.compile_in_background`: a thread
    that waits for a child process), for a quantized model on a CPU unless $CHATAPP_COMPILE says otherwise; the
    model decodes eagerly meanwhile and gives the same tokens once it is switched over."""
    from chatapp.models.loader import wants_compiled_step
    from chatapp.ui.backend import EngineBackend

    monkeypatch.delenv(COMPILE_ENV, raising=False)
    # int8 decodes in one native call from the start (`stt.cpu_step`): nothing to compile in the background.
    monkeypatch.setenv(DTYPE_ENV, "int8")
    int8 = EngineBackend.load(tiny_model_dir, device="cpu")
    lines: list[str] = []
    assert int8._engine.model.kernel_step is not None and int8.compile_in_background(lines.append) is None, lines
    monkeypatch.setenv(DTYPE_ENV, "int4")
    backend = EngineBackend.load(tiny_model_dir, device="cpu")
    engine = backend._engine
    eager = greedy_replies(engine, "What is 12 times 7?")
    lines.clear()
    thread = backend.compile_in_background(lines.append)
    assert thread is not None
    thread.join(timeout=600)
    assert engine.model.compiled_steps is not None, lines
    assert lines and lines[0].startswith("the decode step is compiled") and "saved in" in lines[0], lines
    # In a child process: a compile in the engine's own process holds the GIL the replies need.
    assert "in a process of its own" in lines[0], lines
    assert greedy_replies(engine, "What is 12 times 7?") == eager

    # A later command decodes eagerly unless asked (loading the step costs more than one reply gains); asked, it
    # loads the saved step instead of compiling it.
    assert getattr(load_model(tiny_model_dir, device="cpu").model, "compiled_steps", None) is None
    later = load_model(tiny_model_dir, device="cpu", compile=True).model
    assert later.compiled_steps is not None
    tui = EngineBackend.load(tiny_model_dir, device="cpu")
    lines.clear()
    tui.compile_in_background(lines.append).join(timeout=120)
    assert lines and lines[0].startswith("the saved compiled decode step is loaded"), lines
    assert greedy_replies(tui._engine, "What is 12 times 7?") == eager

    monkeypatch.setenv(COMPILE_ENV, "0")  # never
    assert not wants_compiled_step(engine.model)
    monkeypatch.setenv(COMPILE_ENV, "1")  # compiled at load instead
    assert not wants_compiled_step(engine.model)
    monkeypatch.delenv(COMPILE_ENV)
    assert not wants_compiled_step(load_model(tiny_model_dir, device="cpu", dtype="float32").model)


def test_a_failed_background_compile_leaves_the_model_eager(tiny_model_dir: Path, monkeypatch) -> None:
    import chatapp.stt.precompile as precompile
    from chatapp.models.loader import compile_in_background

    def no_compiler(model) -> None:
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    monkeypatch.setattr(precompile, "precompile", no_compiler)
    model = load_model(tiny_model_dir, device="cpu", dtype="int8").model
    lines: list[str] = []
    compile_in_background(model, lines.append).join(timeout=60)
    assert model.compiled_steps is None
    assert lines == ["the decode step stays eager: compiling it failed: InvalidCxxCompiler: No working C++ compiler found"]


def test_a_corrupt_saved_step_costs_a_note_and_is_compiled_anew(tiny_model_dir: Path, monkeypatch):
    """A saved step that cannot be read (a torn file) costs a note, never a reply: the TUI's engine decodes eagerly
    meanwhile and compiles and saves it again."""
    import chatapp.stt.precompile as precompile
    from chatapp.models.loader import compile_in_background, compiled_steps_dir, saved_or_new_compiled_steps

    monkeypatch.delenv(COMPILE_ENV, raising=False)
    model = load_model(tiny_model_dir, device="cpu", dtype="int8").model
    assert model.compiled_steps is None  # a command decodes eagerly
    directory = compiled_steps_dir(model)
    directory.mkdir(parents=True)
    (directory / precompile.MANIFEST).write_text('{"steps": [{"kind": "stack", "shape": [1, true], "file": "x"}]}')
    steps, note = saved_or_new_compiled_steps(model, compile_if_missing=False)
    assert steps is None
    assert note.startswith("the decode step stays eager: cannot load the compiled decode step in")
    calls = []
    monkeypatch.setattr(precompile, "precompile", lambda m: calls.append(m) or {})
    lines: list[str] = []
    compile_in_background(model, lines.append).join(timeout=60)
    assert calls == [model] and lines[0].startswith("the decode step is compiled"), lines
