"""The decode steps a benchmark side times a model with (not a benchmark itself: `make bench` skips files starting
with `_`).

A model decodes with what its `DecodeRuntime` holds (`chatapp.stt.decode`): the native int8 step
(`chatapp.stt.cpu_step`), the torch step's blocks compiled, or neither (the torch step, eager). To compare them on one
model object, a benchmark gathers each step once (`model_steps`) and switches the runtime to a side's step around
each timed call (`Step.used_by`), the one place where it is switched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from chatapp.stt import STTForCausalLM, cpu_step
from chatapp.stt.cpu_step import NativeStep
from chatapp.stt.decode import DecodeSteps, compiled_decode_steps


class Step(NamedTuple):
    """What a side's decode step runs: the two fields of the model's `DecodeRuntime` it sets for its calls; neither
    is the torch step, run eagerly."""

    native: NativeStep | None = None  # the whole step as one native call (int8: `chatapp.stt.cpu_step`)
    compiled: DecodeSteps | None = None  # the torch step's blocks compiled in this process

    @contextmanager
    def used_by(self, model: STTForCausalLM) -> Iterator[None]:
        """`model` decodes with this step inside the block, and as before after it."""
        runtime = model.runtime
        before = runtime.native, runtime.compiled
        runtime.native, runtime.compiled = self
        try:
            yield
        finally:
            runtime.native, runtime.compiled = before


EAGER = Step()
# Each step's name in the tables, in the order they are listed: the app's own CPU step for int8 first.
STEP_LABELS = {"kernel": "native step", "eager": "torch step", "compiled": "torch step compiled in-process"}


def model_steps(model: STTForCausalLM, fmt: str, compile_it: bool = False) -> dict[str, Step]:
    """The decode steps `model` (in weight format `fmt`) can be timed with, by `STEP_LABELS` name: "kernel" where
    the native step serves the model (attached once here, or taken from the loader, then left off: only the sides
    that name it turn it on), "eager", and with `compile_it` "compiled" (`compiled_decode_steps`: Dynamo's guards
    on, as `--compile` runs the CUDA step; compiled here, so that no timed call pays for it)."""
    steps = {}
    if cpu_step.attach(model):
        steps["kernel"] = Step(native=model.runtime.native)
        model.runtime.native = None
    steps["eager"] = EAGER
    if compile_it:
        start = time.perf_counter()
        steps["compiled"] = Step(compiled=compiled_decode_steps(model))
        print(f"{fmt}: decode step compiled in this process in {time.perf_counter() - start:.1f} s", flush=True)
    return steps


def app_step(steps: dict[str, Step]) -> Step:
    """The step the app decodes a model with on a CPU: the native one where it serves the model, else eager."""
    return steps.get("kernel", EAGER)
