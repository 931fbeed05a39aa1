"""Issue 41, the outputs: `route`, `convert` and `eval` never destroy a user's files or rewrite a built-in model;
every bad route option and unwritable output is one `error:` and one `fix:` before any work; locks live in the data
directory; what a killed run left is removed by the next; `eval` reads its corpus a bounded line at a time.

Permission cases run the CLI in a subprocess without root's override (`setpriv` drops CAP_DAC_OVERRIDE), so mode
bits hold for root as they do for a user.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from chatapp import store
from chatapp.cli import app
from chatapp.models.registry import tiny_model_dir
from tests.hostile.refusals import refused as _refused

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
FAST = ["--layers", "3", "--conversations", "8", "--answer-tokens", "8"]  # a route of the tiny model in ~2 s
_NO_OVERRIDE = ["--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]


def _routed(args: list[str]) -> str:
    result = runner.invoke(app, ["route", *args, *FAST])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture
def no_work(monkeypatch):
    """Loading a model's weights is a test failure: the input must be refused first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr("chatapp.models.load_model", refuse)
    monkeypatch.setattr("chatapp.models.load_engine", refuse)
    monkeypatch.setattr("chatapp.stt.STTForCausalLM.from_pretrained", refuse)


def _tree_digest(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _litter(parent: Path) -> list[str]:
    """Hidden entries chatapp may have left in a user's directory: locks, staging, set-aside directories."""
    return sorted(path.name for path in parent.iterdir() if path.name.startswith("."))


def _locks() -> list[Path]:
    from chatapp.settings import data_dir

    return sorted((data_dir() / "locks").glob("*")) if (data_dir() / "locks").is_dir() else []


# 1 ------------------------------------------------------------------------------------------------------------------
def test_1_route_refuses_a_directory_of_the_users_files(tmp_path: Path, no_work) -> None:
    mine = tmp_path / "d"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("precious")
    (mine / "sub" / "more.txt").write_text("also precious")
    before = _tree_digest(mine)
    _refused(["route", "tiny", "--out", str(mine), "--layers", "3"], f"{mine} already exists", "new (or empty)")
    assert _tree_digest(mine) == before and _litter(tmp_path) == []


def test_1_convert_refuses_a_directory_of_the_users_files(tmp_path: Path) -> None:
    mine = tmp_path / "d"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    _refused(["convert", str(tiny_model_dir()), str(mine)], f"{mine} already exists", "new (or empty)")
    assert (mine / "notes.txt").read_text() == "precious" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_1_an_output_chatapp_wrote_is_replaced_and_an_empty_directory_is_used(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()  # empty: used
    _routed(["tiny", "--out", str(out)])
    assert store.is_complete(out) and (out / "routing.json").is_file()
    (out / "extra.txt").write_text("inside chatapp's output")
    _routed(["tiny", "--out", str(out), "--seed", "1"])  # its own stamp: replaced whole
    assert store.is_complete(out) and (out / "routing.json").is_file() and not (out / "extra.txt").exists()
    assert _litter(tmp_path) == [] and _locks() == []


def test_1_train_refuses_the_users_directory_and_a_built_in_model_and_takes_its_own(tmp_path: Path, no_work):
    corpus = tmp_path / "missing.txt"  # checked after the output: its error shows the output was accepted
    mine = tmp_path / "d"
    mine.mkdir()
    (mine / "config.json").write_text("my own model's config")
    train = ["train", str(corpus), "--model", "tiny", "--out"]
    _refused([*train, str(mine)], f"{mine} already exists", "new (or empty)")
    assert (mine / "config.json").read_text() == "my own model's config"
    _refused([*train, str(tiny_model_dir())], "part of chatapp itself")
    store.write_stamp(mine)  # what a finished `chatapp train` leaves: its own output, written again
    _refused([*train, str(mine)], "does not exist")


def test_1_odd_outputs_are_refused_without_harmful_advice(tmp_path: Path, monkeypatch, no_work) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("precious")
    _refused(["route", "tiny", "--out", "", "--layers", "3"], "already exists")  # "" is the current directory
    out = _refused(["route", "tiny", "--out", os.devnull, "--layers", "3"], "is not a directory")
    assert "remove" not in out
    assert (tmp_path / "notes.txt").read_text() == "precious"


# 2 ------------------------------------------------------------------------------------------------------------------
def test_2_routing_a_built_in_model_writes_a_named_copy_and_leaves_the_package_alone(tmp_path: Path) -> None:
    from chatapp.settings import routed_models_dir

    shipped = _tree_digest(tiny_model_dir())
    output = _routed(["tiny"])
    first = routed_models_dir() / "tiny-routed"
    assert f"wrote {first}" in output and "--model tiny-routed" in output
    assert store.is_complete(first) and json.loads((first / "config.json").read_text())["stt_layers"] == [3]
    second = routed_models_dir() / "tiny-routed-2"
    assert f"wrote {second}" in _routed(["tiny"])  # a second copy, numbered: the first is kept
    assert store.is_complete(first) and store.is_complete(second)
    assert _tree_digest(tiny_model_dir()) == shipped
    listing = runner.invoke(app, ["models"])
    assert listing.exit_code == 0 and "tiny-routed " in listing.output and "tiny-routed-2" in listing.output
    reply = runner.invoke(app, ["generate", "Hello", "--model", "tiny-routed", "--max-tokens", "3"])
    assert reply.exit_code == 0, reply.output


def test_2_a_built_in_model_is_never_an_output(tmp_path: Path, no_work) -> None:
    from chatapp.models.smollm2 import prepared_dir

    _refused(["route", "tiny", "--out", str(tiny_model_dir())], "part of chatapp itself", "fix: give a new directory")
    _refused(["convert", str(tiny_model_dir()), str(tiny_model_dir() / "inside")], "part of chatapp itself")
    # The prepared default model carries chatapp's stamp, and is still not replaceable by an output.
    prepared = prepared_dir()
    with store.staged_dir(prepared) as staging:
        (staging / "config.json").write_text("{}")
    _refused(["route", "tiny", "--out", str(prepared), "--layers", "3"], "part of chatapp itself")
    assert (prepared / "config.json").read_text() == "{}"


# 6 / 8 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--layers=-1"], "layers [-1] do not exist"),
        (["--layers", "6"], "layers [6] do not exist: the model has layers 0-5"),
        (["--layers", "3,-2,99"], "do not exist"),
        (["--layers", ","], "names no layer"),
        (["--layers", "three"], "comma-separated list"),
        (["--budget", "nan"], "finite perplexity ratio"),
        (["--budget", "inf"], "finite perplexity ratio"),
        (["--budget", "-inf"], "--budget"),
        (["--budget", "0.5"], "--budget"),
        (["--skip-mode", "sometimes"], "not a skip mode"),
        (["--max-layers", "0"], "--max-layers"),
        (["--conversations", "7"], "--conversations"),
        (["--conversations", "100000"], "--conversations"),
        (["--answer-tokens", "7"], "--answer-tokens"),
        (["--answer-tokens", "100000000"], "--answer-tokens must be between 8 and 256"),
        (["--tune-steps", "-1"], "--tune-steps"),
        (["--seed", "-1"], "--seed must be between 0"),
        (["--seed", str(2**70)], "--seed must be between 0"),
    ],
)
def test_6_8_every_bad_route_option_is_one_error_and_fix_before_loading(
    tmp_path: Path, no_work, option: list[str], message: str
) -> None:
    _refused(["route", "tiny", "--out", str(tmp_path / "x"), *option], message)
    assert not (tmp_path / "x").exists()


@settings(max_examples=40)
@given(
    layers=st.lists(st.integers(-(2**40), 2**40).filter(lambda n: not 0 <= n < 6), min_size=1, max_size=4),
    budget=st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda b: not 1.0 <= b < math.inf)),
)
def test_6_8_out_of_range_layers_and_budgets_never_reach_the_model(layers: list[int], budget: float) -> None:
    out = Path("/nonexistent-issue41/x")  # never written: every case is refused on its option (asserted below)
    for option in ([f"--layers={','.join(map(str, layers))}"], [f"--budget={budget!r}"]):
        result = runner.invoke(app, ["route", "tiny", "--out", str(out), *option])
        assert result.exit_code == 1, (option, result.output)
        assert result.output.count("error:") == 1 and result.output.count("fix:") == 1, result.output
        assert option[0].split("=")[0] in result.output and "Traceback" not in result.output


# 7 / 9 --------------------------------------------------------------------------------------------------------------
def _without_override() -> list[str]:
    """The prefix that runs a command without root's override of mode bits (nothing when not root)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is not installed: cannot drop root's override")
    probe = subprocess.run(["setpriv", *_NO_OVERRIDE, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"setpriv cannot drop capabilities here: {probe.stderr.decode(errors='replace').strip()}")
    return ["setpriv", *_NO_OVERRIDE]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [*_without_override(), sys.executable, "-m", "chatapp.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def _cli_refused(result: subprocess.CompletedProcess, *messages: str) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("error:") == 1, result.stderr
    assert result.stderr.count("fix:") == 1, result.stderr
    # Refused before the fit: none of its progress lines came first.
    assert "candidates" not in result.stderr and "self-distill" not in result.stderr, result.stderr
    for message in messages:
        assert message in result.stderr, result.stderr


@pytest.fixture
def read_only(tmp_path: Path):
    made: list[Path] = []

    def make(path: Path) -> Path:
        path.chmod(0o555)
        made.append(path)
        return path

    yield make
    for path in made:
        path.chmod(0o755)


def test_7_a_read_only_output_chatapp_wrote_is_refused_before_the_fit_and_left_whole(tmp_path: Path, read_only):
    out = tmp_path / "rodir"
    _routed(["tiny", "--out", str(out)])
    before = _tree_digest(out)
    read_only(out)
    result = _cli("route", "tiny", "--out", str(out), *FAST)
    _cli_refused(result, f"{out} is not writable", f"make {out} writable")
    assert _tree_digest(out) == before and _litter(tmp_path) == [] and _locks() == []


def test_9_an_output_under_a_read_only_directory_is_refused_before_the_fit(tmp_path: Path, read_only) -> None:
    (tmp_path / "parent").mkdir()
    parent = read_only(tmp_path / "parent")
    for out in (parent / "new", parent / "new" / "deeper"):
        _cli_refused(_cli("route", "tiny", "--out", str(out), *FAST), str(parent), "not writable")
        _cli_refused(_cli("convert", str(tiny_model_dir()), str(out)), str(parent), "not writable")
    assert list(parent.iterdir()) == [] and _litter(tmp_path) == []


def test_9_a_read_only_data_directory_refuses_the_routed_copy_before_the_fit(tmp_path: Path, read_only) -> None:
    from chatapp.settings import data_dir

    data_dir().mkdir(parents=True, exist_ok=True)
    read_only(data_dir())
    _cli_refused(_cli("route", "tiny", *FAST), str(data_dir()), "not writable")
    assert list(data_dir().iterdir()) == []


def test_7_a_failed_replace_puts_the_old_output_back_and_leaves_no_aside(tmp_path: Path, monkeypatch) -> None:
    """The rename of the new output into place fails after the old one went aside: the old one comes back."""
    out = tmp_path / "out"
    with store.staged_dir(out) as staging:
        (staging / "old.txt").write_text("old")
    real_rename = os.rename

    def rename(src, dst):
        if Path(dst) == out and ".staging-" in Path(src).name:
            raise PermissionError(13, "Permission denied")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(store.DataDirError, match="cannot replace"), store.staged_dir(out) as staging:
        (staging / "new.txt").write_text("new")
    assert (out / "old.txt").read_text() == "old" and _litter(tmp_path) == []


# 12 -----------------------------------------------------------------------------------------------------------------
def test_12_no_lock_file_beside_the_output_nor_left_in_the_data_directory(tmp_path: Path) -> None:
    out = tmp_path / "routed"
    _routed(["tiny", "--out", str(out)])
    converted = tmp_path / "converted"
    result = runner.invoke(app, ["convert", str(tiny_model_dir()), str(converted)])
    assert result.exit_code == 0, result.output
    assert _litter(tmp_path) == [] and _locks() == []


def test_12_staging_and_aside_directories_of_a_dead_run_are_removed_by_the_next(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for leftover in (".out.staging-abcd1234", ".out.old-k2j9x0a7"):
        (tmp_path / leftover / "sub").mkdir(parents=True)
        (tmp_path / leftover / "sub" / "model.safetensors").write_bytes(b"0" * 64)
    (tmp_path / ".other.staging-abcd1234").mkdir()  # another target's: not this run's to remove
    _routed(["tiny", "--out", str(out)])
    assert store.is_complete(out) and _litter(tmp_path) == [".other.staging-abcd1234"]


_HANG_IN_STAGING = """
import sys, time
import chatapp.training.route as route
real = route.save_model
def save_then_hang(model, directory):
    real(model, directory)
    print("staged", flush=True)
    time.sleep(600)
route.save_model = save_then_hang
from chatapp.cli import main
sys.argv = ["chatapp", *sys.argv[1:]]
main()
"""


def test_12_a_route_killed_while_writing_leaves_nothing_the_next_run_keeps(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _routed(["tiny", "--out", str(out)])  # an earlier output, to be replaced
    before = _tree_digest(out)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", _HANG_IN_STAGING, "route", "tiny", "--out", str(out), *FAST]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and "staged" not in line and proc.poll() is None:
            line = proc.stdout.readline()
        assert "staged" in line, "the route never reached its staging directory"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert [name for name in _litter(tmp_path) if ".staging-" in name], "kill -9 mid-write left no staging"
    assert _tree_digest(out) == before  # killed before the rename: the earlier output is whole
    assert len(_locks()) == 1  # the dead writer's lock file, in the data directory, not beside the output
    assert runner.invoke(app, ["models"]).exit_code == 0 and _locks() == []  # any next command removes it
    _routed(["tiny", "--out", str(out), "--seed", "2"])  # the next write of the same output removes its staging
    assert store.is_complete(out) and _litter(tmp_path) == [] and _locks() == []


# 11 and the smaller points -----------------------------------------------------------------------------------------
def test_11_eval_of_a_directory_says_it_is_a_directory(tmp_path: Path, no_work) -> None:
    _refused(["eval", str(tmp_path), "--model", "tiny"], f"corpus {tmp_path} is a directory", "fix:")
    _refused(["eval", str(tmp_path / "missing.txt"), "--model", "tiny"], "does not exist")


def test_eval_refuses_an_over_long_line_by_its_number_with_bounded_memory(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello there\n\n" + "x" * 20_000_000 + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # The command runs under a small Python parent that reports its peak memory (RUSAGE_CHILDREN). Spawned straight
    # from here, the child's ru_maxrss would start at this test process's own peak: Linux carries a process's peak
    # across exec, and subprocess spawns with vfork, whose child runs in the parent's memory until it execs (a worker
    # that loaded the default model before this test read 1 GB).
    command = [sys.executable, "-m", "chatapp.cli", "eval", str(corpus), "--model", "tiny"]
    parent = (
        "import resource, subprocess, sys; "
        f"code = subprocess.run({command!r}).returncode; "
        "print('peak', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
        "sys.exit(code)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", parent], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _, stderr = proc.communicate(timeout=120)  # tokenizing a 20 MB line whole took minutes and gigabytes
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr
    assert f"{corpus}:3: the line is longer than 1 MiB" in stderr and "fix: split line 3" in stderr, stderr
    peak = int(stderr.rsplit("peak ", 1)[1].split()[0])
    assert peak < 1_000_000, f"peak {peak} KiB for a 20 MB line"  # ru_maxrss is in KiB


def test_eval_reads_no_more_of_the_corpus_than_it_evaluates(tmp_path: Path) -> None:
    """One batch of one window needs the first document only: a broken line far after it is never read."""
    corpus = tmp_path / "corpus.txt"
    words = " ".join(["the cat sat on the mat and the dog ran far away"] * 40)
    corpus.write_bytes((words + "\n\n").encode() * 4 + b"\xff\xfe not UTF-8\n")
    args = ["eval", str(corpus), "--model", "tiny", "--max-batches", "1", "--batch-size", "1", "--seq-len", "32"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    _refused(["eval", str(corpus), "--model", "tiny", "--max-batches", "1000"], f"{corpus}:9: not valid UTF-8")


def test_generate_with_a_gguf_file_points_at_convert(tmp_path: Path) -> None:
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 16)
    _refused(["generate", "hi", "--model", str(gguf)], "not a model directory", f"chatapp convert {gguf}")
