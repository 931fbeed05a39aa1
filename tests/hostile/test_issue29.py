"""Issue 29: every case gives one message with the right fix, exit 1, no traceback, and no work done first; killed
writes leave no staging behind the next command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
from typer.testing import CliRunner

from chatapp import store
from chatapp.cli import app
from chatapp.models import smollm2
from chatapp.models.registry import repair_hint, tiny_model_dir
from tests.models.gguf_files import write_tiny_gguf

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
ROOT_USER = os.geteuid() == 0


def _refused(args: list[str], *messages: str, env: dict | None = None) -> str:
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output and "Usage:" not in result.output and "╭" not in result.output
    assert result.output.count("error:") == 1, result.output
    for message in messages:
        assert message in result.output, result.output
    return result.output


@pytest.fixture
def no_work(monkeypatch):
    """Reading a GGUF, preparing the default model or loading weights is a test failure: it must be refused first."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr("chatapp.models.gguf.read_gguf", refuse)
    monkeypatch.setattr("chatapp.models.smollm2.prepare", refuse)
    monkeypatch.setattr("chatapp.stt.STTForCausalLM.from_pretrained", refuse)


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf", "llama", tiny_vocab=True).path


# 1 ------------------------------------------------------------------------------------------------------------------
def test_1_gguf_context_length_0_is_a_gguf_error_naming_the_key(tmp_path: Path) -> None:
    path = write_tiny_gguf(
        tmp_path / "ctx0.gguf", "llama", tiny_vocab=True, override={"{arch}.context_length": (0, gguf.GGUFValueType.UINT32)}
    ).path
    out = _refused(["convert", str(path), str(tmp_path / "out")], "llama.context_length",
                   "max_position_embeddings must be a positive integer")
    assert "fix:" in out and not (tmp_path / "out").exists()
    assert store.clean_stale(tmp_path) == [] and [p for p in tmp_path.iterdir() if p.name.startswith(".out.")] in (
        [], [tmp_path / ".out.lock"]
    )


# 2 ------------------------------------------------------------------------------------------------------------------
def test_2_convert_into_a_path_under_a_file_is_refused_before_reading(tmp_path: Path, small_gguf: Path, no_work) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep")
    _refused(["convert", str(small_gguf), str(afile / "sub")], f"{afile} is not a directory")
    assert afile.read_text() == "keep"


@pytest.mark.skipif(ROOT_USER, reason="root writes through mode bits (the path-under-a-file case covers it)")
def test_2_convert_into_an_unwritable_directory_is_refused_before_reading(tmp_path: Path, small_gguf, no_work) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        _refused(["convert", str(small_gguf), str(ro / "out")], "not writable")
    finally:
        ro.chmod(0o700)


# 3 ------------------------------------------------------------------------------------------------------------------
def test_3_chatapp_home_a_file_is_refused_before_preparing(tmp_path: Path, monkeypatch, no_work) -> None:
    home = tmp_path / "home"
    home.write_text("x")
    monkeypatch.setenv("CHATAPP_HOME", str(home))
    _refused(["generate", "hi", "--model", "default"], f"{home} is a file, not a directory", "CHATAPP_HOME")
    monkeypatch.setenv("CHATAPP_DEFAULT_MODEL", "default")
    _refused(["generate", "hi"], "is a file, not a directory")
    for command, report in ((["info"], "not usable"), (["models"], "cannot be prepared")):
        result = runner.invoke(app, command)
        assert result.exit_code == 0 and report in result.output, result.output


@pytest.mark.skipif(ROOT_USER, reason="root writes through mode bits")
def test_3_an_unwritable_empty_data_dir_is_refused_before_preparing(tmp_path: Path, monkeypatch, no_work) -> None:
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "data").chmod(0o500)
    monkeypatch.setenv("CHATAPP_HOME", str(home))
    try:
        _refused(["generate", "hi", "--model", "default"], "not writable")
    finally:
        (home / "data").chmod(0o700)


# 5 ------------------------------------------------------------------------------------------------------------------
def test_5_staging_of_a_killed_preparation_is_removed_by_the_next_command(tmp_path: Path) -> None:
    models = smollm2.prepared_dir().parent
    models.mkdir(parents=True)
    legacy = models / ".smollm2-135m-stt.k2j_9x0a"  # what the earlier versions' mkdtemp left
    current = models / ".smollm2-135m-stt.staging-ab12cd34"
    for path in (legacy, current):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"0" * 1000)
    compiled = models.parent / "compiled" / ".0123456789abcdef01234567.staging-zz99yy88"
    compiled.mkdir(parents=True)
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0
    assert not legacy.exists() and not current.exists() and not compiled.exists()


def test_5_a_killed_convert_leaves_nothing_the_rerun_trips_on(tmp_path: Path, small_gguf: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "chatapp.cli", "convert", str(small_gguf), str(out)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(".staging-" in p.name for p in tmp_path.iterdir()):
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists() or store.is_complete(out)  # killed while staging: nothing at OUT_DIR
    shutil.rmtree(out, ignore_errors=True)
    result = runner.invoke(app, ["convert", str(small_gguf), str(out)])
    assert result.exit_code == 0, result.output
    assert store.is_complete(out)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) in ([], [".out.lock"])


def test_5_an_earlier_versions_interrupted_convert_says_remove_and_rerun(tmp_path: Path, small_gguf, no_work) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / ".model.safetensors.abc123.tmp").write_bytes(b"0" * 100)
    _refused(["convert", str(small_gguf), str(out)], "interrupted conversion", f"remove {out}")


# 6 ------------------------------------------------------------------------------------------------------------------
def test_6_convert_of_a_non_gguf_dot_gguf_file_says_it_is_not_gguf(tmp_path: Path, no_work) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text("<html>not found</html>")
    out = _refused(["convert", str(fake), str(tmp_path / "out")], "is not a GGUF file")
    assert "config.json" not in out


def _fake_prepare(model_dir: Path, progress=None, *, tokenizer: str | None = None) -> Path:
    """What `prepare` writes (its files' checksums too), made from the tiny model in milliseconds; `tokenizer`: the
    text of its tokenizer.json instead of the tiny model's."""
    with store.staged_dir(model_dir, what="prepared default model", checksums=True) as staging:
        for path in tiny_model_dir().iterdir():
            if path.is_file():
                shutil.copyfile(path, staging / path.name)
        if tokenizer is not None:
            (staging / "tokenizer.json").write_text(tokenizer)
        stamp = {"parts": smollm2.parts_fingerprint(), "layout": smollm2.PREPARED_LAYOUT}
        (staging / smollm2.PREPARED_STAMP).write_text(json.dumps(stamp))
    return model_dir


@pytest.mark.parametrize("damage", ["config", "truncated", "fifo"])
def test_6_a_damaged_prepared_model_is_prepared_again_with_a_notice(monkeypatch, capsys, damage: str) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "prepare", lambda d, p=None: calls.append(d) or _fake_prepare(d))
    target = _fake_prepare(smollm2.prepared_dir())
    if damage == "config":
        (target / "config.json").write_text("{ not json")
    elif damage == "truncated":
        weights = target / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    else:
        (target / "tokenizer.json").unlink()
        os.mkfifo(target / "tokenizer.json")
    assert smollm2.prepared_damage(target)
    assert smollm2.ensure_prepared() == target and calls == [target]
    err = capsys.readouterr().err
    assert "notice:" in err and "preparing it again" in err and err.count("notice:") == 1
    assert smollm2.prepared_damage(target) is None


def test_6_each_origin_gets_its_own_fix(tmp_path: Path, small_gguf: Path) -> None:
    assert "reinstall chatapp" in repair_hint("tiny", tiny_model_dir())
    prepared = smollm2.prepared_dir()
    assert "prepares the default model again" in repair_hint("default", prepared)
    assert "make train-tiny" not in repair_hint("default", prepared)
    assert runner.invoke(app, ["convert", str(small_gguf), str(tmp_path / "conv")]).exit_code == 0
    assert "chatapp convert" in repair_hint(str(tmp_path / "conv"), tmp_path / "conv")
    assert repair_hint(str(tmp_path), tmp_path) is None


def test_6_a_prepared_model_that_fails_to_load_names_the_prepared_fix(monkeypatch) -> None:
    """Files that match their checksums and still do not load (a preparation that went wrong, not damage since)."""
    bad = json.dumps({"not": "a tokenizer"})  # valid JSON, not a tokenizer
    target = _fake_prepare(smollm2.prepared_dir(), tokenizer=bad)
    monkeypatch.setattr(smollm2, "prepare", lambda d, p=None: _fake_prepare(d, tokenizer=bad))
    _refused(["generate", "hi", "--model", "default"], f"remove {target} and run again")


def test_6_a_refused_resume_names_chatapp_batch(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    output.write_text("not a record\n")
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    out = _refused(["batch", str(tmp_path / "in.jsonl"), "-o", str(output), "--resume", "--model", "tiny"])
    assert "chatapp batch" in out and "chatapp generate" not in out


# 7 ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--max-tokens", "abc"], "--max-tokens"),
        (["calc", "-5+3"], "goes after --"),
        (["batch", "in.jsonl", "--samples", "0"], "--samples"),
        (["no-such-command"], "No such command"),
    ],
)
def test_7_usage_errors_exit_1_with_one_line(args: list[str], message: str, no_work) -> None:
    _refused(args, message)


# 8 ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "variable, value",
    [("CHATAPP_COMPILE", "maybe"), ("CHATAPP_DTYPE", "int3"), ("CHATAPP_THREADS", "zero"),
     ("CHATAPP_DEFAULT_MODEL", "huge")],
)
def test_8_bad_environment_settings_are_refused_before_loading(variable: str, value: str, monkeypatch, no_work) -> None:
    monkeypatch.setattr("chatapp.models.loader.resolve_model", lambda *a: pytest.fail("the model was looked up"))
    monkeypatch.setenv(variable, value)
    _refused(["generate", "hi", "--model", "tiny"], variable)
