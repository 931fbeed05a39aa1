"""Keys typed while `chatapp run` starts: the terminal is held as the app will read it, and given back as it was."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from chatapp.ui.terminal import end_on_hangup, keys_held_for_the_app

termios = pytest.importorskip("termios")


def test_the_terminal_is_held_for_the_app_and_restored() -> None:
    parent, child = os.openpty()
    try:
        with os.fdopen(child, "r", closefd=False) as stream:
            before = termios.tcgetattr(child)
            assert before[3] & termios.ICANON and before[3] & termios.ECHO and before[0] & termios.ICRNL
            with keys_held_for_the_app(stream):
                held = termios.tcgetattr(child)
                assert not held[3] & (termios.ICANON | termios.ECHO)  # no line wait, no echo on the shell's screen
                assert not held[0] & termios.ICRNL  # Enter stays Enter ("\r"), not a newline (ctrl+j in the app)
                os.write(parent, b"hi\r")
                assert os.read(child, 16) == b"hi\r"  # what was typed waits, as typed, for the app to read
            assert termios.tcgetattr(child) == before
    finally:
        os.close(parent)
        os.close(child)


def test_not_a_terminal_is_left_alone() -> None:
    with keys_held_for_the_app(io.StringIO("piped")):
        pass


# The app's process as `chatapp run` starts it: watching its terminal, then busy for a long time.
WATCHER = """
import sys, time
from chatapp.ui.terminal import end_on_hangup
end_on_hangup(sys.stdin, interval=0.05)
print("watching", flush=True)
time.sleep(60)
"""


def test_the_app_process_ends_when_its_terminal_goes_away():
    """Under `make run` the terminal's hang-up signal never reaches the app (make holds it off), which then spun
    on the dead terminal for good; the app delivers the signal to its own group instead."""
    master, slave = os.openpty()
    child = subprocess.Popen(
        [sys.executable, "-c", WATCHER],
        stdin=slave,
        stdout=subprocess.PIPE,
        start_new_session=True,  # a process group of its own, as a shell's job has
        text=True,
    )
    os.close(slave)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "watching"
        time.sleep(0.3)
        assert child.poll() is None  # a live terminal: it keeps running
        os.close(master)  # the terminal goes away
        assert child.wait(timeout=10) == -signal.SIGHUP
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_nothing_is_watched_without_a_terminal(tmp_path):
    with open(tmp_path / "input", "w+") as stream:  # a file, as a pipe or a test runner gives
        end_on_hangup(stream)
    assert "chatapp-hangup" not in {t.name for t in threading.enumerate()}
