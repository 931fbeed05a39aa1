"""Run a `chatapp` command in this process and report, on stderr, where each phase of it ended.

`startup.py --phases` runs this script (`python benchmarks/_phases.py generate "Hi" --max-tokens 1`) in a fresh
process per round. It imports nothing of chatapp's itself: an import hook wraps three functions as their modules
load, so the command imports exactly what it would alone. Phases, each ending where the next begins:

- start: the interpreter, up to this script's first line (measured from `$CHATAPP_PHASES_T0`, the launcher's clock
  just before it started this process);
- import: up to `chatapp.models.load_engine` being called (the CLI, torch, the engine's modules);
- model load: `load_engine` (the prepared model checked, the stored served format mapped, the tokenizer, the
  native step attached);
- prefill: up to the end of the prompt's forward (`DecodeLoop._prefill`);
- decode: up to the last step of the reply (the first step samples the first token and feeds it);
- exit: from `lifecycle.exit_process` to the launcher seeing the process end (measured by the launcher).

At each phase's end it records the wall clock (`time.time()`, comparable with the launcher's), the process's CPU
seconds (every thread), its resident set and its peak resident set so far (/proc/self/status: VmRSS, VmHWM), and
prints them as one JSON line `PHASES [...]` on stderr when the command exits.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from types import ModuleType

T0 = time.time()
MARKS: list[dict[str, float | str]] = []


def _status() -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            fields[name] = value
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def mark(phase: str) -> None:
    rss, peak = _status()
    MARKS.append({"phase": phase, "time": time.time(), "cpu": time.process_time(), "rss": rss, "peak": peak})


def _patch_models(module: ModuleType) -> None:
    load_engine = module.load_engine

    def timed_load_engine(*args, **kwargs):
        mark("import")
        engine = load_engine(*args, **kwargs)
        mark("model load")
        return engine

    module.load_engine = timed_load_engine


def _patch_loop(module: ModuleType) -> None:
    prefill = module.DecodeLoop._prefill

    def timed_prefill(self, *args, **kwargs):
        out = prefill(self, *args, **kwargs)
        if not any(m["phase"] == "prefill" for m in MARKS):
            mark("prefill")
        return out

    module.DecodeLoop._prefill = timed_prefill


def _patch_engine(module: ModuleType) -> None:
    generate = module.Engine.generate

    def timed_generate(self, *args, **kwargs):
        yield from generate(self, *args, **kwargs)
        mark("decode")

    module.Engine.generate = timed_generate


def _patch_lifecycle(module: ModuleType) -> None:
    exit_process = module.exit_process

    def timed_exit(code: object = 0):
        mark("exit")
        print("PHASES " + json.dumps({"t0": T0, "marks": MARKS}), file=sys.stderr, flush=True)
        exit_process(code)

    module.exit_process = timed_exit


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "chatapp.models": _patch_models,
    "chatapp.engine.loop": _patch_loop,
    "chatapp.engine.engine": _patch_engine,
    "chatapp.lifecycle": _patch_lifecycle,
}


class _Hook(importlib.abc.MetaPathFinder):
    """Wraps a patched module's loader so that the patch runs right after the module's own code."""

    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def main() -> None:
    mark("start")
    sys.meta_path.insert(0, _Hook())
    sys.argv = ["chatapp", *sys.argv[1:]]
    from chatapp.__main__ import main as chatapp_main

    chatapp_main()


if __name__ == "__main__":
    main()
