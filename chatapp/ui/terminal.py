"""Keys typed while `chatapp run` starts belong to the app.

Between the command being typed and the app taking the terminal (Python, Textual and the history database: about a
second), the terminal is still in its line mode: it echoes what is typed onto the shell's screen and turns Enter
into a newline, which the app would read as ctrl+j (a newline in the message) instead of "send". Holding the
terminal the way the app will (no echo, keys as they come, Enter as itself) from the first moment keeps those keys,
Enter included, for the app's message box. The app reads them once it starts, in order.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO

try:
    import termios
except ImportError:  # not a POSIX terminal: nothing to hold
    termios = None  # type: ignore[assignment]


@contextlib.contextmanager
def keys_held_for_the_app(stream: TextIO | None = None) -> Iterator[None]:
    """Hold the terminal on `stream` (stdin) as the app will use it until the block ends, then restore it as it was.
    Not a terminal (a pipe, a test runner): nothing to do."""
    fd = _terminal_fd(stream if stream is not None else sys.stdin)
    if fd is None:
        yield
        return
    before = termios.tcgetattr(fd)
    held = termios.tcgetattr(fd)
    held[0] &= ~termios.ICRNL  # iflag: Enter stays "\r", as the app reads it
    held[3] &= ~(termios.ICANON | termios.ECHO)  # lflag: no waiting for a line, no echo on the shell's screen
    with contextlib.suppress(termios.error):
        termios.tcsetattr(fd, termios.TCSANOW, held)
    try:
        yield
    finally:
        with contextlib.suppress(termios.error):
            termios.tcsetattr(fd, termios.TCSANOW, before)


def _terminal_fd(stream: TextIO | None) -> int | None:
    if termios is None or stream is None:
        return None
    try:
        fd = stream.fileno()
        if not os.isatty(fd):
            return None
        termios.tcgetattr(fd)
    except (OSError, ValueError, AttributeError, termios.error):
        return None
    return fd


def end_on_hangup(stream: TextIO | None = None, *, interval: float = 1.0) -> None:
    """End this process's group when its terminal goes away, as the terminal's own hang-up would have.

    Closing the terminal sends SIGHUP to the session's controlling process, and the kernel sends it on to the
    foreground group only when that process does not hold it off. `make run` does (make blocks SIGHUP while its
    recipe runs), so a closed tmux pane or terminal window left `chatapp run` behind: its input thread spinning on
    the dead terminal (~70% of a core) and its drawing blocked for good, the engine process beside it. A daemon
    thread looks at the terminal every `interval` seconds and, once it is gone (`isatty` turns false on a hung-up
    terminal), delivers the SIGHUP itself to its process group: the app and its engine end as if run directly.
    Not a terminal (a pipe, a test runner): nothing to watch."""
    import signal
    import threading
    import time

    fd = _terminal_fd(stream if stream is not None else sys.stdin)
    if fd is None or not hasattr(signal, "SIGHUP"):
        return

    def watch() -> None:
        while os.isatty(fd):
            time.sleep(interval)
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGHUP)  # a process group that could not be signalled: this process at least

    threading.Thread(target=watch, name="chatapp-hangup", daemon=True).start()
