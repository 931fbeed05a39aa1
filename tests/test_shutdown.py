"""`chatapp.shutdown.exit_process`: a process ends with `sys.exit`'s status, its atexit handlers run and its output
flushed, but without Python's finalization."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chatapp.shutdown import exit_code

# Buffered output, as a command's is unless PYTHONUNBUFFERED is set (it is on some machines).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


def run(body: str) -> subprocess.CompletedProcess[str]:
    script = "import atexit, sys\nfrom chatapp.shutdown import exit_process\n" + body
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=ENV)


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (3, 3), (130, 130)])
def test_exit_code_is_the_status_sys_exit_gives(code: object, status: int) -> None:
    assert exit_code(code) == status


def test_a_message_for_exit_is_printed_and_is_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code("no model here") == 1
    assert capsys.readouterr().err == "no model here\n"


def test_atexit_handlers_run_and_buffered_output_is_flushed() -> None:
    done = run(
        "atexit.register(lambda: print('handler ran', file=sys.stderr))\n"
        "sys.stdout.write('no newline, still buffered')\n"
        "exit_process(7)\n"
        "print('never')\n"
    )
    assert done.returncode == 7
    assert done.stdout == "no newline, still buffered"
    assert done.stderr == "handler ran\n"


def test_finalizers_are_skipped() -> None:
    """The point of it: objects are not torn down (a `__del__` that would print does not)."""
    done = run("class Noisy:\n    def __del__(self):\n        print('finalized')\nkeep = Noisy()\nexit_process(0)\n")
    assert done.returncode == 0
    assert done.stdout == ""


def test_a_reader_that_went_away_makes_the_status_1() -> None:
    """`chatapp generate ... | head -c 5`: the flush at exit finds the pipe closed."""
    script = (
        "import sys\nfrom chatapp.shutdown import exit_process\n"
        "sys.stdout.write('x' * 100)\n"  # stays in the buffer until the exit's flush
        "sys.stdin.read()\n"  # wait until the test has closed our stdout's reader
        "exit_process(0)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV
    )
    assert process.stdout is not None and process.stdin is not None
    process.stdout.close()
    process.stdin.close()
    assert process.wait(timeout=60) == 1
    assert process.stderr is not None and b"Traceback" not in process.stderr.read()
