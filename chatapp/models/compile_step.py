"""Compile and save a model's decode step in a process of its own: `python -m chatapp.models.compile_step DIR FORMAT`.

The TUI's engine switches to the compiled step in the background (`loader.compile_in_background`). Compiling it in
a thread of the engine's own process starved the replies: Dynamo's tracing and inductor's code generation are
Python that holds the GIL, and a reply sent during the compile decoded at 0.3-0.5 tokens/s instead of ~20 (2-core
AVX2 box, int8, measured in the TUI). A child process takes the GIL out of it, runs at a lower priority on one
thread, and leaves the artifacts in the data directory, where the engine then loads them
(`loader.saved_or_new_compiled_steps`) as any later process would.

Exit status 0 when the step is saved (or already was), 1 with one line on stderr when it could not be compiled.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m chatapp.models.compile_step MODEL_DIR FORMAT", file=sys.stderr)
        return 2
    model_dir, fmt = args
    os.nice(10)  # the replies first: this only makes later ones faster
    import torch

    torch.set_num_threads(1)
    from chatapp.models.loader import _first_line, load_model, saved_or_new_compiled_steps

    try:
        model = load_model(model_dir, device="cpu", dtype=fmt, compile=False).model
        _, note = saved_or_new_compiled_steps(model, compile_if_missing=True)
    except Exception as err:  # torch.compile's failures have no common type (compiler missing, backend errors)
        print(_first_line(err), file=sys.stderr)
        return 1
    print(note or "", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
