"""`chatapp.lifecycle`: start-up runs without the garbage collector and freezes what it made; `exit_process` ends a
process with `sys.exit`'s status, its atexit handlers run and its output flushed, but without Python's
finalization."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from chatapp.lifecycle import exit_code, starting_up

# Buffered output, as a command's is unless PYTHONUNBUFFERED is set (it is on some machines).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


def run(body: str) -> subprocess.CompletedProcess[str]:
    script = "import atexit, sys\nfrom chatapp.lifecycle import exit_process\n" + body
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=ENV)


def test_start_up_runs_without_the_collector_and_freezes_what_it_made() -> None:
    assert gc.isenabled()
    try:
        with starting_up():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]  # tracked objects
            with starting_up():  # nested: the outer one decides
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        assert gc.get_freeze_count() >= len(made)
        assert not any(obj is made[0] for obj in gc.get_objects(generation=2))  # out of the collected generations
    finally:
        gc.unfreeze()


def test_start_up_gives_the_collector_back_when_it_fails() -> None:
    try:
        with pytest.raises(RuntimeError), starting_up():
            raise RuntimeError("the model did not load")
        assert gc.isenabled()
    finally:
        gc.unfreeze()


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
        "import sys\nfrom chatapp.lifecycle import exit_process\n"
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


def test_under_a_profiler_the_exit_is_pythons_own(tmp_path) -> None:
    """`python -m cProfile -o FILE` writes FILE after the program returns."""
    script = tmp_path / "ends.py"
    script.write_text("from chatapp.lifecycle import exit_process\nexit_process(0)\n")
    profile = tmp_path / "out.prof"
    done = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(profile), str(script)], capture_output=True, timeout=60
    )
    assert done.returncode == 0 and profile.stat().st_size > 0


def test_starting_up_sets_openmps_spin_count_before_torch_loads_it() -> None:
    """`starting_up` sets `$GOMP_SPINCOUNT` (read once, when `import torch` loads libgomp) unless the user set it."""
    import os
    import subprocess
    import sys

    probe = (
        "import os\nfrom chatapp.lifecycle import starting_up\nassert 'torch' not in __import__('sys').modules\n"
        "with starting_up():\n    import torch\nprint(os.environ['GOMP_SPINCOUNT'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    for extra, expected in (({}, "50000"), ({"GOMP_SPINCOUNT": "7"}, "7")):
        done = subprocess.run([sys.executable, "-c", probe], env={**env, **extra}, capture_output=True, text=True,
                              timeout=120, check=True)  # fmt: skip
        assert done.stdout.strip() == expected
