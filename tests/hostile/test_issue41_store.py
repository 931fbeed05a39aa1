"""Issue 41, the stored served model, the environment and the kernel build: a damaged stored model is noticed and
rebuilt (3); every `CHATAPP_*` setting is checked at start and thread counts are capped at the usable cores (5); a
build killed with -9 leaves nothing the next load does not remove (12); the store's key does not depend on where
the data directory lives, and entries nothing uses are removed (13); `info` says why the kernel cannot be built."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp.cli import app
from chatapp.models import loader
from chatapp.models.registry import tiny_model_dir
from chatapp.settings import data_dir, usable_cores
from chatapp.store import STAMP
from chatapp.stt import cpu_step, served

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "What is the capital of France?"


def _generate(*args: str, env: dict | None = None):
    result = runner.invoke(app, ["generate", *args, "--max-tokens", "12"], env=env)
    assert "Traceback" not in result.output, result.output
    return result


def _reply(model: str | Path = "tiny", env: dict | None = None) -> str:
    result = _generate(PROMPT, "--model", str(model), "--dtype", "int8", env=env)
    assert result.exit_code == 0, result.output
    return result.stdout


def _entries(data: Path | None = None) -> list[Path]:
    store = (data or data_dir()) / "served"
    return sorted(path for path in store.iterdir() if not path.name.startswith(".")) if store.is_dir() else []


@pytest.fixture
def no_conversion(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the weights were converted again instead of read from the store")

    monkeypatch.setattr(loader, "_converted_model", refuse)


# 3 ------------------------------------------------------------------------------------------------------------------
def test_3_random_bytes_in_the_middle_of_the_stored_model_are_noticed_and_rebuilt() -> None:
    before = _reply()
    [entry] = _entries()
    weights = entry / served.WEIGHTS_FILE
    with weights.open("r+b") as fh:  # the case: random bytes written into the middle of the file
        fh.seek(weights.stat().st_size // 2)
        fh.write(os.urandom(256))

    result = _generate(PROMPT, "--model", "tiny", "--dtype", "int8")
    assert result.exit_code == 0, result.output
    notices = [line for line in result.stderr.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1 and f"{weights} is damaged" in notices[0], result.stderr
    assert "converting the weights again" in notices[0]
    assert result.stdout == before  # the model it ran was whole, not the damaged one

    again = _generate(PROMPT, "--model", "tiny", "--dtype", "int8")  # rebuilt whole: read back without a word
    assert again.exit_code == 0 and again.stdout == before and "notice:" not in again.stderr
    assert _entries() == [entry]


def test_3_a_stored_model_without_checksums_is_rebuilt_not_run_unchecked() -> None:
    """A layout that lost its checksums (or one written as an earlier format's) is refused and rebuilt."""
    import json

    before = _reply()
    [entry] = _entries()
    layout = json.loads((entry / served.LAYOUT_FILE).read_text())
    del layout["checksums"]
    (entry / served.LAYOUT_FILE).write_text(json.dumps(layout))

    result = _generate(PROMPT, "--model", "tiny", "--dtype", "int8")
    assert result.exit_code == 0 and result.stdout == before, result.output
    assert "has no checksums to check it against; converting the weights again" in result.stderr
    assert "checksums" in json.loads((entry / served.LAYOUT_FILE).read_text())


# 5 ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5", "2 threads", "-" + "9" * 400])
def test_5_a_kernel_thread_count_that_is_not_a_positive_integer_is_refused(value: str, monkeypatch) -> None:
    monkeypatch.setattr("chatapp.models.loader.resolve_model", lambda *a: pytest.fail("the model was looked up"))
    result = _generate("Say hi", "--model", "tiny", env={"CHATAPP_KERNEL_THREADS": value})
    assert result.exit_code == 1, result.output
    assert result.output.count("error: CHATAPP_KERNEL_THREADS=") == 1, result.output
    assert result.output.count("fix: set CHATAPP_KERNEL_THREADS to a number of threads from 1 to") == 1
    assert len(result.output) < 400  # a 400-digit value is not echoed whole


def test_5_a_kernel_thread_count_above_the_cores_runs_on_the_cores(monkeypatch) -> None:
    """The issue's 10000 threads took a reply from 14 s to 174 s: the kernel now gets the usable cores."""
    counted = cpu_step.NativeStep.team
    seen: list[int] = []

    def team(self):
        threads, governor = counted(self)
        seen.append(threads)
        return threads, governor

    monkeypatch.setattr(cpu_step.NativeStep, "team", team)
    if cpu_step.library() is None:
        pytest.skip(f"the kernel cannot be built here: {cpu_step.library_problem()}")
    plain = _reply()
    first = len(seen)
    assert _reply(env={"CHATAPP_KERNEL_THREADS": "10000"}) == plain
    assert first and set(seen[first:]) == {usable_cores()}, seen


def _environment_names() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "chatapp").rglob("*.py"):
        names |= set(re.findall(r"\bCHATAPP_[A-Z_]+\b", path.read_text(encoding="utf-8")))
    return names


@pytest.mark.parametrize("name", sorted(_environment_names() - {"CHATAPP_HOME", "CHATAPP_API_KEY"}))
def test_5_every_chatapp_setting_is_checked_before_any_work(name: str, monkeypatch) -> None:
    """Every `CHATAPP_*` variable the package reads (found in its source) refuses a bad value at start, with one
    `error:` naming it and one `fix:`. `CHATAPP_HOME` is a path: any value names a directory (checked where it is
    first written); `CHATAPP_API_KEY` is a secret: "bogus-value" is a key (one that cannot travel in a header is
    refused: `test_5_an_api_key_that_cannot_be_sent_is_refused`)."""
    monkeypatch.setattr("chatapp.models.loader.resolve_model", lambda *a: pytest.fail("the model was looked up"))
    result = _generate("Say hi", "--model", "tiny", env={name: "bogus-value"})
    assert result.exit_code == 1, result.output
    assert result.output.count("error:") == 1 and name in result.output, result.output
    assert result.output.count("fix:") == 1, result.output


def test_5_an_api_key_that_cannot_be_sent_is_refused(monkeypatch) -> None:
    result = _generate("Say hi", "--server", "http://127.0.0.1:9", env={"CHATAPP_API_KEY": "two words"})
    assert result.exit_code == 1, result.output
    assert result.output.count("error:") == 1 and "CHATAPP_API_KEY" in result.output, result.output
    assert result.output.count("fix:") == 1, result.output


def test_5_the_torch_thread_count_is_capped_too(monkeypatch) -> None:
    import torch

    before = torch.get_num_threads()
    try:
        assert _reply(env={"CHATAPP_THREADS": "10000"})
        assert torch.get_num_threads() == usable_cores()
    finally:
        torch.set_num_threads(before)


# 12 -----------------------------------------------------------------------------------------------------------------
def _fake_compiler(folder: Path) -> Path:
    """A "compiler" that writes its output and then hangs, so a build can be killed with its partial file there."""
    script = folder / "slow-cc"
    script.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho partial > "$2"\nexec sleep 600\n')
    script.chmod(0o755)
    return script


def test_12_a_build_killed_with_minus_9_leaves_a_temporary_the_next_load_removes(tmp_path: Path, monkeypatch):
    if cpu_step.library() is None:
        pytest.skip(f"the kernel cannot be built here: {cpu_step.library_problem()}")
    folder = tmp_path / "_build"
    folder.mkdir()
    target = folder / cpu_step.library_path().name
    build = "import sys; from pathlib import Path; from chatapp.stt import cpu_step; cpu_step.build(Path(sys.argv[1]))"
    env = os.environ | {"CC": str(_fake_compiler(tmp_path)), "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", build, str(target)], env=env, start_new_session=True)
    partial = folder / f".{target.name}.{child.pid}"
    try:
        deadline = time.monotonic() + 60
        while not partial.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert partial.exists(), "the build never started writing"
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert partial.exists()  # what kill -9 leaves

    # The next load (here, of this folder, with the machine's build in it) removes it, and loads the build.
    shutil.copy(cpu_step.library_path(), target)
    monkeypatch.setattr(cpu_step, "library_path", lambda: target)
    cpu_step._load.cache_clear()
    try:
        assert cpu_step.library() is not None
    finally:
        cpu_step._load.cache_clear()
    assert sorted(path.name for path in folder.iterdir()) == [target.name]


def test_12_a_live_build_is_left_alone_and_an_old_one_is_not(tmp_path: Path) -> None:
    live = tmp_path / f".decode_step-0123456789abcdef.so.{os.getpid()}"
    old = tmp_path / f".decode_step-fedcba9876543210.so.{os.getpid()}"
    unrelated = tmp_path / ".decode_step-notes.txt"
    for path in (live, old, unrelated):
        path.write_text("x")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))  # its pid is alive, but no build takes an hour: pid reused
    assert cpu_step.remove_dead_partials(tmp_path) == [old]
    assert live.exists() and unrelated.exists()


# 13 -----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("copy", [shutil.copy2, shutil.copy], ids=["dates-kept", "dates-new"])
def test_13_a_copied_data_directory_reads_its_stored_models_without_rebuilding(
    tmp_path: Path, monkeypatch, copy
) -> None:
    """The model lives in the data directory (as the default model does): a copy of the whole directory elsewhere
    (`cp -a` keeps the dates, `cp -r` does not) finds its stored model by content, and reads it."""
    first = tmp_path / "first"
    model = first / "data" / "models" / "mine"
    shutil.copytree(tiny_model_dir(), model)
    monkeypatch.setenv("CHATAPP_HOME", str(first))
    before = _reply(model)
    [entry] = _entries()

    second = tmp_path / "second"
    shutil.copytree(first, second, copy_function=copy)
    monkeypatch.setenv("CHATAPP_HOME", str(second))
    monkeypatch.setattr(loader, "_converted_model", lambda *a, **k: pytest.fail("the copy rebuilt its store"))
    assert _reply(second / "data" / "models" / "mine") == before
    assert [path.name for path in _entries()] == [entry.name]

    hashed = []
    monkeypatch.setattr(served, "content_digest", lambda source: hashed.append(source) or "")
    assert _reply(second / "data" / "models" / "mine") == before
    assert not hashed  # its place is remembered: the next load reads no source file whole


def test_13_entries_nothing_uses_are_removed(tmp_path: Path) -> None:
    """When an entry is written, older builds of the same model and format, entries of deleted models, and
    entries of earlier versions (no record of their source) go; other models' and formats' entries stay."""
    from safetensors.torch import load_file, save_file

    legacy = data_dir() / "served" / "0123456789ab-0123456789abcdef01234567"
    legacy.mkdir(parents=True)
    (legacy / STAMP).write_text('{"format": 1}\n')
    (legacy / served.WEIGHTS_FILE).write_bytes(b"\0" * 1024)

    kept, gone, mine = (tmp_path / name for name in ("kept", "gone", "mine"))
    for model in (kept, gone, mine):
        shutil.copytree(tiny_model_dir(), model)
    _reply(kept)
    [kept_entry] = _entries()
    _reply(gone)
    shutil.rmtree(gone)
    _reply(mine)
    assert not legacy.exists()  # an earlier version's entry: removed by the first entry written
    mine_entries = set(_entries()) - {kept_entry}
    assert len(mine_entries) == 1  # `gone`'s entry went when `mine`'s was written
    assert runner.invoke(app, ["generate", PROMPT, "--model", str(mine), "--dtype", "int4"]).exit_code == 0
    assert len(_entries()) == 3  # another format of the same model is another entry, kept

    weights = mine / "model.safetensors"  # new weights for `mine`: its int8 entry is replaced, not kept beside
    state = load_file(weights)
    name = next(name for name in state if name.endswith("down_proj.weight"))
    state[name] = state[name] * 0.5
    save_file(state, weights, metadata={"format": "pt"})
    _reply(mine)
    after = set(_entries())
    assert kept_entry in after and not mine_entries & after and len(after) == 3


# info -----------------------------------------------------------------------------------------------------------------
def test_info_says_the_kernel_cannot_be_built_and_why(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_step, "library_path", lambda: tmp_path / "decode_step-0123456789abcdef.so")
    result = runner.invoke(app, ["info"], env={"CC": "/nonexistent"})
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("int8 kernel"))
    assert "cannot be built" in line and "CC='/nonexistent' was not found" in line and "not built yet" not in line
    assert "set CC" in line
