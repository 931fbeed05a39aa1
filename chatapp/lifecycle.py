"""How a chatapp process starts and ends: start-up without the garbage collector, the end without Python's
finalization.

**Start-up** (`starting_up`). Importing torch and loading a model allocates about a million objects that live as
long as the process. The cyclic garbage collector runs a full collection each time the older generations have
grown by a quarter, walking all of them again: ~0.35 s of a one-token `chatapp generate` on the 2-core box (3.38 ->
3.0 s, median of 8 interleaved runs). So the collector is off while a command starts up; what start-up made is
then moved to the permanent generation (`gc.freeze`), which later collections skip, and the collector runs again.
The cost: a reference cycle that start-up left behind is never freed (objects freed by their reference counts
still are).

**The end** (`exit_process`). Python's finalization garbage-collects and tears down every module before the
process ends. With torch and a model loaded that is ~0.6 s of one core (measured with perf: mostly
`gc_collect_main` walking the objects torch's import made, then torch's operator registry unregistering itself),
after the reply is already out: a sixth of a one-token `chatapp generate`, and the time `chatapp run` waits for
its engine process at quit. Nothing chatapp holds needs it: output is written and flushed as it goes (`batch`
writes each record with one `os.write`), history commits per message, temporary files are removed by `atexit`
handlers (`weakref.finalize`, `tempfile`), and every thread chatapp starts is a daemon. So the exit does what must
happen, in Python's order, and skips the rest, as Instagram's servers do (atexit first, then `os._exit`):
  1. the `atexit` handlers (multiprocessing's children, logging's flush, finalizers registered for exit);
  2. a flush of stdout and stderr: a reader that went away (`chatapp generate ... | head -c 5`) makes the exit
     status 1, the same as a write that found the pipe closed;
  3. `os._exit(code)`.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

# How long an OpenMP thread spins at a join before it sleeps, for the one libgomp in the process (torch's: the int8
# step's library binds to the same `libgomp.so.1`), which reads it once, when `import torch` loads it. A decode step
# makes ~150 joins; libgomp's default spin (300,000 iterations) suits an idle machine and ruins a busy one: a thread
# spinning for a partner the scheduler has descheduled burns the slice its partner needs. `generate` of 64 tokens on
# the 2-core EPYC with two other processes busy on both cores: 8-25 tok/s by default, 66-75 with 50,000 (no spin at
# all, OMP_WAIT_POLICY=passive: 40-99, but half the speed on an idle box); idle, 122-185 either way (no difference
# beyond the noise). A user's own `$GOMP_SPINCOUNT` wins.
SPIN_ENV, SPIN_COUNT = "GOMP_SPINCOUNT", "50000"
@contextmanager
def starting_up() -> Iterator[None]:
    """Imports and model loading without the garbage collector, then what they made frozen out of later
    collections (module docstring), and OpenMP's spin count set before torch loads it (`SPIN_COUNT`; a user's own is
    checked by `settings.check_spin_count` before any command). Nested or with the collector already off: the
    collector is left as it is."""
    os.environ.setdefault(SPIN_ENV, SPIN_COUNT)
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def exit_code(code: object) -> int:
    """The exit status Python gives `sys.exit(code)`: None is 0, an int is itself, anything else is printed to
    stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_process(code: object = 0) -> NoReturn:
    """End this process now with `sys.exit(code)`'s status, after the exit-time work (module docstring). Under a
    profiler or a tracer (`python -m cProfile -o ...`, coverage), which write their results after the program
    returns, it raises `SystemExit` instead, so that they can."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        raise SystemExit(code)
    status = exit_code(code)
    atexit._run_exitfuncs()  # what `sys.exit` would run; each handler's error is printed, not raised
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BrokenPipeError:
            status = status or 1
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
            pass
    os._exit(status)
