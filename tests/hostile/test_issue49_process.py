"""Issue 49, the process around the commands: a broken stdout (a full disk, closed, a reader gone) is one `error:`
line on stderr and exit status 1 for every command, never a traceback (7); a `$GOMP_SPINCOUNT` libgomp cannot read
is refused with its fix, not left to libgomp's warning (13)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from chatapp.cli import app

runner = CliRunner()
COMMANDS = {
    "calc": ["calc", "1+1"],
    "models": ["models"],
    "program-show": ["program", "show", "think"],
    "generate": ["generate", "hi", "--model", "tiny", "--max-tokens", "4"],
}


def _chatapp(args: list[str], *, closed: bool = False, stdout=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "chatapp", *args]
    if closed:  # the shell's `>&-`: the process starts without a file descriptor 1
        command = ["bash", "-c", 'exec "$@" >&-', "bash", *command]
    return subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120, env=os.environ)


def _one_error(done: subprocess.CompletedProcess, says: str) -> None:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], done.stderr
    assert any(line.startswith("fix:") for line in done.stderr.splitlines()), done.stderr


# 7 ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(COMMANDS))
def test_7_stdout_on_a_full_disk_is_one_error(name: str) -> None:
    with open("/dev/full", "w") as full:
        _one_error(_chatapp(COMMANDS[name], stdout=full), "No space left on device")


@pytest.mark.parametrize("name", [*COMMANDS, "batch"])
def test_7_a_closed_stdout_is_one_error(name: str, tmp_path) -> None:
    args = COMMANDS.get(name) or ["batch", str(tmp_path / "in.jsonl"), "--model", "tiny", "--max-tokens", "2"]
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    _one_error(_chatapp(args, closed=True), "stdout is closed")


def test_7_a_reader_gone_before_the_output_is_one_error() -> None:
    read, write = os.pipe()
    os.close(read)  # nobody will read: the first write finds the pipe broken (EPIPE)
    try:
        done = _chatapp(COMMANDS["calc"], stdout=write)
    finally:
        os.close(write)
    _one_error(done, "reader went away")


def test_7_a_whole_stdout_is_untouched() -> None:
    done = _chatapp(COMMANDS["calc"], stdout=subprocess.PIPE)
    assert done.returncode == 0 and done.stdout == "2\n" and done.stderr == ""


# 13 -----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["abc", "", "-5", "12x", "1e5"])
def test_13_a_bad_spin_count_is_refused_naming_the_variable(monkeypatch, value: str) -> None:
    monkeypatch.setenv("GOMP_SPINCOUNT", value)
    for command in (["calc", "1+1"], ["generate", "hi", "--model", "tiny"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"GOMP_SPINCOUNT={value!r}" in errors[0], result.output
        assert "fix: unset GOMP_SPINCOUNT" in result.output


@pytest.mark.parametrize("value", ["0", "50000", " 10k ", "2M", "INFINITE", "infinity"])
def test_13_what_libgomp_reads_is_taken(monkeypatch, value: str) -> None:
    monkeypatch.setenv("GOMP_SPINCOUNT", value)
    result = runner.invoke(app, ["calc", "1+1"])
    assert result.exit_code == 0 and result.stdout == "2\n", result.output


def test_13_a_model_load_checks_it_too(monkeypatch) -> None:
    """The TUI's engine process and library callers load through `load_model`, not the CLI's command group."""
    from chatapp.errors import SettingsError
    from chatapp.models import load_model

    monkeypatch.setenv("GOMP_SPINCOUNT", "abc")
    with pytest.raises(SettingsError, match="GOMP_SPINCOUNT"):
        load_model("tiny")
