"""Issue 49, what chatapp reads back from its data directory and the process around it: the prepared default model
is checked against the checksums recorded when it was prepared, and prepared again with one notice when its bytes
changed (1); a prepared model's damaged configs are prepared again, never "restored from the checkpoint" (10);
`$CHATAPP_DEFAULT_MODEL` takes a model directory, as the docs say (12)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp import store
from chatapp.cli import app
from chatapp.models import smollm2
from chatapp.models.registry import resolve_model, tiny_model_dir

runner = CliRunner()
PROMPT = "What is the capital of France?"


def _write_keeping_dates(path: Path, offset: int, data: bytes) -> None:
    """Write `data` at `offset` into `path` and set its dates back, as a careless tool (or a disk) would leave it:
    size and modification time alike."""
    before = path.stat()
    with path.open("r+b") as fh:
        fh.seek(offset)
        fh.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    with path.open("rb") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
    _write_keeping_dates(path, offset, bytes([byte ^ (1 << bit)]))


@pytest.fixture
def prepared_home(default_model_home: Path, tmp_path: Path, monkeypatch) -> Path:
    """A CHATAPP_HOME of its own holding a copy of the prepared default model (the shared one stays whole)."""
    home = tmp_path / "home"
    source = default_model_home / "data" / "models" / smollm2.prepared_dir().name
    shutil.copytree(source, home / "data" / "models" / source.name)
    monkeypatch.setenv("CHATAPP_HOME", str(home))
    return home


@pytest.fixture
def preparations(monkeypatch) -> list[Path]:
    """Records each (re-)preparation instead of running it (15 s each); the directory is left as it was."""
    done: list[Path] = []

    def prepare(target: Path, progress) -> Path:
        done.append(target)
        return target

    monkeypatch.setattr(smollm2, "_prepare_with_bar", prepare)
    return done


# 1 ------------------------------------------------------------------------------------------------------------------
def test_1_garbage_in_the_prepared_weights_is_noticed_and_prepared_again(prepared_home: Path) -> None:
    """The issue's case: 8 MB of 0x3f in the middle of model.safetensors, its dates set back. One notice, a new
    preparation, and the reply of the whole model."""
    def generate():
        result = runner.invoke(app, ["generate", PROMPT, "--model", "default", "--max-tokens", "12"])
        assert result.exit_code == 0 and "Traceback" not in result.output, result.output
        return result

    before = generate().stdout
    weights = smollm2.prepared_dir() / "model.safetensors"
    _write_keeping_dates(weights, weights.stat().st_size // 2, b"\x3f" * (8 << 20))

    result = generate()
    notices = [line for line in result.stderr.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1, result.stderr
    assert "damaged" in notices[0] and "model.safetensors" in notices[0] and "preparing it again" in notices[0]
    assert result.stdout == before
    assert smollm2.prepared_damage(smollm2.prepared_dir()) is None

    again = generate()  # prepared whole: read back without a word
    assert again.stdout == before and "notice:" not in again.stderr


@pytest.mark.parametrize("name", ["model.safetensors", "merged_adapters.safetensors", "tokenizer.json"])
def test_1_a_single_bit_flip_anywhere_in_a_prepared_file_is_found(prepared_home: Path, name: str) -> None:
    """int4 builds its weights from merged_adapters.safetensors: damage there is found before any conversion."""
    path = smollm2.prepared_dir() / name
    size = path.stat().st_size
    for offset in (0, 9, size // 3, size // 2 + 7, size - 1):
        _flip_bit(path, offset, bit=offset % 8)
        problem = smollm2.prepared_damage(smollm2.prepared_dir())
        assert problem is not None and name in problem, (offset, problem)
        _flip_bit(path, offset, bit=offset % 8)
        assert smollm2.prepared_damage(smollm2.prepared_dir()) is None


def test_1_damage_gets_one_notice_and_a_preparation(prepared_home: Path, preparations: list[Path], capsys) -> None:
    _flip_bit(smollm2.prepared_dir() / "merged_adapters.safetensors", 12345)
    assert smollm2.ensure_prepared() == smollm2.prepared_dir()
    assert preparations == [smollm2.prepared_dir()]
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1 and "merged_adapters.safetensors" in notices[0], notices


def test_1_the_prepared_model_named_by_its_path_is_checked_too(prepared_home: Path, preparations: list[Path]) -> None:
    _flip_bit(smollm2.prepared_dir() / "model.safetensors", 4096)
    assert resolve_model(str(smollm2.prepared_dir())) == smollm2.prepared_dir()
    assert preparations == [smollm2.prepared_dir()]


def test_1_an_untouched_model_is_not_read_at_start(prepared_home: Path, monkeypatch) -> None:
    """The check costs a few stat calls: nothing is hashed while no file was written to since it was checked. A copied
    directory (new inodes, as this one) is hashed once, and its new identity recorded."""
    target = smollm2.prepared_dir()
    assert store.files_damage(target) is None  # the copy: hashed once
    monkeypatch.setattr(store, "_sha256", lambda path: pytest.fail(f"{path} was hashed again"))
    for _ in range(3):
        assert store.files_damage(target) is None


def test_1_a_model_without_checksums_is_prepared_again(prepared_home: Path, preparations: list[Path]) -> None:
    """An earlier layout's directory, or a stamp that lost its checksums: nothing vouches for the files."""
    target = smollm2.prepared_dir()
    (target / store.STAMP).write_text(json.dumps({"format": store.STAMP_FORMAT}) + "\n")
    assert "no checksums" in (smollm2.prepared_damage(target) or "")
    smollm2.ensure_prepared()
    assert preparations == [target]


def test_1_store_checksums_catch_every_kind_of_change(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with store.staged_dir(target, checksums=True) as staging:
        (staging / "a.bin").write_bytes(bytes(range(256)) * 64)
        (staging / "sub").mkdir()
        (staging / "sub" / "b.json").write_text("{}")
    assert store.files_damage(target) is None
    for offset in range(0, 256 * 64, 997):
        _flip_bit(target / "a.bin", offset, bit=offset % 8)
        assert "a.bin does not match its checksum" in (store.files_damage(target) or "")
        _flip_bit(target / "a.bin", offset, bit=offset % 8)
    assert store.files_damage(target) is None
    with (target / "a.bin").open("ab") as fh:
        fh.write(b"x")
    assert "a.bin is 16385 bytes" in (store.files_damage(target) or "")
    (target / "a.bin").unlink()
    os.mkfifo(target / "a.bin")
    assert "a.bin is not a regular file" in (store.files_damage(target) or "")
    (target / "sub" / "b.json").unlink()
    (target / "a.bin").unlink()
    assert "is missing" in (store.files_damage(target) or "")


# 10 -----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, damage",
    [
        ("generation_config.json", lambda text: text[: len(text) // 2]),
        ("tokenizer_config.json", lambda text: "{not json"),
        ("tokenizer_config.json", lambda text: json.dumps({k: v for k, v in json.loads(text).items()
                                                            if k != "chat_template"})),
    ],
    ids=["generation_config-torn", "tokenizer_config-torn", "tokenizer_config-no-template"],
)
def test_10_a_prepared_models_damaged_config_is_prepared_again(
    prepared_home: Path, preparations: list[Path], capsys, name: str, damage
) -> None:
    path = smollm2.prepared_dir() / name
    path.write_text(damage(path.read_text(encoding="utf-8")), encoding="utf-8")
    smollm2.ensure_prepared()
    assert preparations == [smollm2.prepared_dir()]
    err = capsys.readouterr().err
    notices = [line for line in err.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1 and name in notices[0] and "preparing it again" in notices[0], err
    assert "checkpoint" not in err


def test_10_a_chatapp_written_model_without_its_template_is_not_sent_to_another_checkpoint(
    prepared_home: Path, tmp_path: Path
) -> None:
    """A directory chatapp wrote (`convert`, `route`) whose chat template went missing: the fix is to write it again,
    whether its stamp records checksums (damage found first) or not (an earlier version's)."""
    out = tmp_path / "converted"
    shutil.copytree(smollm2.prepared_dir(), out)
    (out / smollm2.PREPARED_STAMP).unlink()  # not the prepared model: a chatapp output like any other
    config = out / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    for stamp in (None, {"format": store.STAMP_FORMAT}):
        if stamp is not None:
            (out / store.STAMP).write_text(json.dumps(stamp))
        result = runner.invoke(app, ["generate", "hi", "--model", str(out), "--max-tokens", "2"])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        fix = next(line for line in result.output.splitlines() if line.startswith("fix:"))
        assert "checkpoint" not in fix and "run that command again" in fix, result.output


# 12 -----------------------------------------------------------------------------------------------------------------
def test_12_the_default_model_may_be_a_directory(tmp_path: Path, monkeypatch) -> None:
    copy = tmp_path / "my model"
    shutil.copytree(tiny_model_dir(), copy)
    expected = runner.invoke(app, ["generate", PROMPT, "--model", "tiny", "--max-tokens", "8"])
    monkeypatch.setenv("CHATAPP_DEFAULT_MODEL", str(copy))
    result = runner.invoke(app, ["generate", PROMPT, "--max-tokens", "8"])
    assert result.exit_code == 0 and result.stdout == expected.stdout, result.output
    listing = runner.invoke(app, ["models"])
    assert listing.exit_code == 0 and "$CHATAPP_DEFAULT_MODEL" in listing.stdout, listing.output
    assert listing.stdout.count("(default)") == 1, listing.output


@pytest.mark.parametrize(
    "value, says",
    [
        ("{tmp}/missing", "neither a model name nor an existing model directory"),
        ("{tmp}", "a directory without config.json"),
        ("{tmp}/file.txt", "is a file, not a model directory"),
    ],
)
def test_12_a_bad_default_model_directory_is_one_error_naming_the_variable(
    tmp_path: Path, monkeypatch, value: str, says: str
) -> None:
    (tmp_path / "file.txt").write_text("x")
    monkeypatch.setenv("CHATAPP_DEFAULT_MODEL", value.format(tmp=tmp_path))
    for command in (["generate", "hi"], ["models"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        lines = result.output.splitlines()
        assert sum(line.startswith("error:") for line in lines) == 1, result.output
        assert "CHATAPP_DEFAULT_MODEL" in result.output and says in result.output, result.output
        assert any(line.startswith("fix:") and "model directory" in line for line in lines), result.output


# 17 -----------------------------------------------------------------------------------------------------------------
def test_17_batch_output_under_a_file_says_the_file_is_not_a_directory(tmp_path: Path) -> None:
    source, blocker = tmp_path / "in.jsonl", tmp_path / "FILE"
    source.write_text('{"id": 1, "prompt": "hi"}\n')
    blocker.write_text("mine\n")
    for output in (blocker / "x.jsonl", blocker / "a" / "x.jsonl"):
        result = runner.invoke(app, ["batch", str(source), "-o", str(output), "--model", "tiny", "--max-tokens", "2"])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert f"{blocker} is a file, not a directory" in result.output, result.output
        assert "first" not in result.output  # "create FILE first" cannot help
    assert blocker.read_text() == "mine\n"


def test_17_a_finished_route_leaves_no_fine_tune_checkpoint(tmp_path: Path) -> None:
    from chatapp.settings import data_dir

    prompts = tmp_path / "prompts.jsonl"
    turns = ["Hello! How are you today?", "What is the capital of France?", "Why is the sky blue?", "Hi there"]
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in turns * 2))
    args = ["route", "tiny", "--out", str(tmp_path / "out"), "--prompts", str(prompts), "--answer-tokens", "8"]
    result = runner.invoke(app, [*args, "--budget", "1e9", "--layers", "1", "--tune-steps", "2"])
    assert result.exit_code == 0, result.output
    assert "backbone tuned 2 steps" in result.output
    cache = data_dir() / "routing-data"
    assert cache.is_dir() and not list(cache.glob("*.pt")), sorted(cache.iterdir())


# 16 -----------------------------------------------------------------------------------------------------------------
def _history(path: Path):
    from chatapp.ui.history import HistoryStore
    from tests.ui.conftest import FixedClock

    return HistoryStore(path, clock=FixedClock())


def _messages(path: Path) -> list[str]:
    """Every message's content in the history at `path`, read by a fresh store, oldest conversation first."""
    reader = _history(path)
    try:
        conversations = sorted(reader.list_conversations(), key=lambda c: c.id)
        return [m.content for c in conversations for m in reader.load(c.id).messages]
    finally:
        reader.close()


@pytest.mark.parametrize("with_journal", [False, True], ids=["db-only", "db-wal-shm"])
def test_16_a_history_deleted_under_the_store_is_written_again(tmp_path: Path, with_journal: bool) -> None:
    path = tmp_path / "history.sqlite3"
    store = _history(path)
    notices: list[str] = []
    store.on_notice = notices.append
    first = store.create_conversation("earlier")
    store.add_message(first, "user", "before the deletion")
    for suffix in ("", "-wal", "-shm") if with_journal else ("",):
        Path(f"{path}{suffix}").unlink(missing_ok=True)

    store.add_message(first, "assistant", "after the deletion")
    assert len(notices) == 1 and "was deleted" in notices[0] and str(path) in notices[0]
    second = store.create_conversation("later")
    store.add_message(second, "user", "and more")
    assert store.unsaved is None and len(notices) == 1
    store.close()
    assert _messages(path) == ["before the deletion", "after the deletion", "and more"]


def test_16_a_history_deleted_after_the_last_write_is_saved_at_close(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    store = _history(path)
    store.add_message(store.create_conversation("t"), "user", "the last words")
    path.unlink()
    store.close()
    assert _messages(path) == ["the last words"]


def test_16_a_history_replaced_by_another_file_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    store = _history(path)
    unsaved = []
    store.on_unsaved = unsaved.append
    conversation = store.create_conversation("t")
    path.unlink()
    path.write_bytes(b"someone else's file")
    store.add_message(conversation, "user", "kept in memory")
    assert len(unsaved) == 1 and "replaced by another file" in unsaved[0].message
    assert [m.content for m in store.load(conversation).messages] == ["kept in memory"]
    store.close()
    assert path.read_bytes() == b"someone else's file"


@pytest.mark.asyncio
async def test_16_the_tui_keeps_every_message_when_its_history_is_deleted(tmp_path: Path) -> None:
    from chatapp.ui import ChatApp
    from tests.ui.conftest import SIZE, send_and_wait
    from tests.ui.scripted import ScriptedBackend, greeting

    path = tmp_path / "history.sqlite3"
    app = ChatApp(ScriptedBackend([greeting(), greeting()]), _history(path), cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "first message")
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        await send_and_wait(pilot, "second message")
        notices = [n.message for n in app._notifications if n.title == "History"]
        assert len(notices) == 1 and "was deleted" in notices[0], [n.message for n in app._notifications]
        assert "history not saved" not in app.sub_title
    contents = _messages(path)
    assert contents[0] == "first message" and contents[2] == "second message" and len(contents) == 4, contents
