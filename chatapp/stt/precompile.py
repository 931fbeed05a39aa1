"""The compiled decode step, compiled once per machine and kept on disk.

`decode.compiled_decode_steps` compiles the step's blocks with torch.compile in every process that wants them
(10-35 s on 2 cores), and each compiled call then checks Dynamo's guards (~0.1 ms a call, ~1.3 ms a step of the
default model). This module compiles the same functions ahead of time, with Dynamo's precompile API
(`torch.compile(...).aot_compile`), one artifact per call shape, and saves them; a later process loads them in about
a second and calls them with the guard check off: the default model's step ran 1.08x the guarded compile's rate
and 1.46x eager's (README). So every command, `generate` and `batch` too, can
decode compiled without paying for a compile.

Turning the guard check off is safe because the guards are replaced by what the loader knows:

- an artifact is stored under a key of everything its graph assumed (`artifact_key`): torch and Python versions,
  the CPU's instruction-set flags, the model's config and weight format, the module types of its blocks, and the
  source of the code it traced;
- a call goes to an artifact only for the call shape it was compiled from (`ShapeDispatch`: stack length, batch 1
  or more, all rows or a routed subset); within a shape, batch size and cache span are dynamic (sizes 0 and 1 are
  not, so a span under 2 or a shape never captured runs the eager fallback).

tests/stt/test_precompile.py runs the loaded artifacts against the eager step over batch sizes, routing, cache
sizes and spans.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from chatapp.stt import decode
from chatapp.stt.decode import EAGER_STEPS, DecodeSteps, block_step, stack_step
from chatapp.stt.served import cpu_flags

# Bump when what an artifact holds or assumes changes in a way the key below cannot see.
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20

# The files whose code the artifacts trace: a change to any of them makes every stored artifact stale.
_TRACED_SOURCES = ("decode.py", "layers.py", "weights.py", "precompile.py")

StepFn = Callable[..., Any]
CallShape = tuple[str, tuple]  # ("block" | "stack", the shape key of `decode._block_shape` / `_stack_shape`)

# The argument position of `span` in both step functions (see `decode.block_step`, `decode.stack_step`).
_SPAN_ARG = 9


def available() -> bool:
    """Whether this torch has the precompile API (2.9 and later); older ones compile in every process."""
    return hasattr(torch.compiler, "load_compiled_function")


class PrecompileError(RuntimeError):
    """Compiling, saving or loading the precompiled steps failed (the caller decodes without them)."""


def call_shape(kind: str, args: tuple) -> CallShape:
    shape_of = decode._block_shape if kind == "block" else decode._stack_shape
    return kind, shape_of(*args)


class ShapeDispatch:
    """Calls the compiled function stored for a call's shape, and `fallback` for any other call."""

    def __init__(self, kind: str, compiled: dict[tuple, StepFn], fallback: StepFn) -> None:
        self.kind, self.compiled, self.fallback = kind, compiled, fallback

    def __call__(self, *args):
        fn = self.compiled.get(call_shape(self.kind, args)[1])
        if fn is None or args[_SPAN_ARG] < 2:
            return self.fallback(*args)
        return fn(*args)


def steps_from(compiled: dict[CallShape, StepFn], fallback: DecodeSteps = EAGER_STEPS) -> DecodeSteps:
    """`DecodeSteps` that run `compiled` for the shapes it has and `fallback` for the others."""
    by_kind: dict[str, dict[tuple, StepFn]] = {"block": {}, "stack": {}}
    for (kind, shape), fn in compiled.items():
        by_kind[kind][shape] = fn
    return DecodeSteps(
        ShapeDispatch("block", by_kind["block"], fallback.block),
        ShapeDispatch("stack", by_kind["stack"], fallback.stack),
    )


# ------------------------------------------------------------------------------------------------------ the key
def artifact_key(model) -> str:
    """A digest of everything the artifacts of `model` depend on (see the module docstring)."""
    from chatapp.stt.weights import weight_format

    here = Path(__file__).parent
    sources = hashlib.sha256(b"".join((here / name).read_bytes() for name in _TRACED_SOURCES)).hexdigest()
    layers = [
        [type(part).__name__ for part in (b.input_layernorm, b.self_attn, b.post_attention_layernorm, b.mlp)]
        + [type(child).__name__ for child in (*b.self_attn.children(), *b.mlp.children())]
        for b in model.model.layers
    ]
    facts = {
        "format_version": FORMAT_VERSION,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_flags(),
        "device": model.device.type,
        "weight_format": weight_format(model),
        "dtype": str(model.dtype),
        "kv_dtype": str(model.kv_dtype),
        "config": model.config.to_dict(),
        "layers": layers,
        "sources": sources,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]


# -------------------------------------------------------------------------------------------------- capturing
class _Recorder:
    """A step function that runs eagerly and keeps the arguments of the first call of each shape."""

    def __init__(self, kind: str, fn: StepFn, calls: dict[CallShape, tuple]) -> None:
        self.kind, self.fn, self.calls = kind, fn, calls

    def __call__(self, *args):
        shape = call_shape(self.kind, args)
        if shape not in self.calls and args[_SPAN_ARG] >= 2:
            self.calls[shape] = args
        return self.fn(*args)


def capture_calls(model) -> dict[CallShape, tuple]:
    """Example arguments of every call shape a decode step of `model` makes, from eager decodes (`decode.warm_up`)."""
    calls: dict[CallShape, tuple] = {}
    decode.warm_up(model, DecodeSteps(_Recorder("block", block_step, calls), _Recorder("stack", stack_step, calls)))
    return calls


# -------------------------------------------------------------------------------------------- compile and save
def precompile(model) -> dict[CallShape, StepFn]:
    """Compile every call shape of `model`'s decode step ahead of time (inductor; on a CPU it needs g++)."""
    import torch._dynamo

    decode.configure_compiler()
    compiled = {}
    # Python floats in the modules (norm epsilons) are constants of the graph, not inputs: the precompile path
    # cannot restart an analysis to specialise them, as a plain torch.compile would.
    with torch._dynamo.config.patch(specialize_float=True), torch.inference_mode():
        for (kind, shape), args in capture_calls(model).items():
            fn = block_step if kind == "block" else stack_step
            compiled[(kind, shape)] = torch.compile(fn, fullgraph=True, dynamic=True).aot_compile((args, {}))
            compiled[(kind, shape)].disable_guard_check()
    return compiled


def save(compiled: dict[CallShape, StepFn], directory: Path) -> None:
    """Write the artifacts and their manifest into `directory`, replacing it whole (through `chatapp.store`: staged
    beside it and renamed into place, so a reader never sees half, and a killed save leaves only staging that the
    next start removes)."""
    from chatapp import store

    with store.staged_dir(directory, what="compiled-step store") as staging:
        entries = []
        for index, ((kind, shape), fn) in enumerate(compiled.items()):
            name = f"{kind}-{index}.bin"
            fn.save_compiled_function(str(staging / name))
            entries.append({"kind": kind, "shape": list(shape), "file": name})
        (staging / MANIFEST).write_text(json.dumps({"format_version": FORMAT_VERSION, "steps": entries}, indent=1))


def load(directory: Path) -> dict[CallShape, StepFn] | None:
    """The artifacts saved in `directory` with their guard checks off, or None when there are none. Raises
    PrecompileError when they are there but cannot be read (a corrupt file, another torch's format)."""
    from chatapp import store

    manifest = directory / MANIFEST
    if not manifest.is_file():
        return None
    try:
        # Through the store's reads: a FIFO or a device in place of a file is refused at once instead of blocking.
        entries = json.loads(store.read_regular_bytes(manifest, MAX_MANIFEST_BYTES))["steps"]
        compiled = {}
        for entry in entries:
            with store.open_regular(directory / entry["file"]) as f:
                fn = torch.compiler.load_compiled_function(f)
            fn.disable_guard_check()
            compiled[(entry["kind"], _as_tuple(entry["shape"]))] = fn
    except Exception as err:  # unpickling and the inductor loader raise anything from OSError to AttributeError
        raise PrecompileError(f"cannot load the compiled decode step in {directory}: {err}") from err
    return compiled


def _as_tuple(value: Any) -> Any:
    """A call shape read back from JSON, its lists (a stack's router flags among them) tuples again."""
    return tuple(_as_tuple(item) for item in value) if isinstance(value, list) else value
