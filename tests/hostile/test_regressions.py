"""Issue 17, case by case: each input that gave a traceback, lost data or hung now gives a clear `ChatappError`."""

from __future__ import annotations

import json
import math
import sqlite3
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp.batch.output import FileSink, scan_output
from chatapp.batch.requests import BatchDefaults, LineError, parse_line
from chatapp.cli import app
from chatapp.errors import (
    BatchFileError,
    ChatappError,
    ConstraintError,
    DataDirError,
    HistoryError,
    ProgramError,
    SettingsError,
)
from chatapp.settings import GenerationSettings
from chatapp.store import check_output
from chatapp.trie.json_schema import schema_to_regex
from chatapp.trie.regex import compile_regex
from chatapp.ttfa.source import load_program_source, parse_program_toml
from chatapp.validation import check_prompt_chars

runner = CliRunner()


def _error(text: str | bytes) -> str:
    parsed = parse_line(1, text, BatchDefaults())
    assert isinstance(parsed, LineError), parsed
    return parsed.error


# --- one batch line must not kill the batch ---------------------------------------------------------------------

def test_a_line_of_100000_brackets_is_an_error_record() -> None:
    assert "nested too deeply" in _error("[" * 100_000)


def test_a_lone_surrogate_prompt_is_an_error_record() -> None:
    assert "lone surrogate" in _error('{"id": 1, "prompt": "\\ud800"}')


@pytest.mark.parametrize("field", ["top_k", "max_tokens", "seed", "samples"])
def test_huge_integers_are_range_errors(field: str) -> None:
    assert "between" in _error(json.dumps({"id": 1, "prompt": "hi", field: 10**20}))


def test_a_billion_samples_is_refused_before_any_row_exists() -> None:
    assert "between 1 and 1024" in _error('{"id": 1, "prompt": "hi", "samples": 1000000000}')


def test_a_schema_400_deep_is_refused_by_its_depth() -> None:
    schema: dict = {"type": "string"}
    for _ in range(400):
        schema = {"type": "array", "items": schema}
    assert "nested 401 levels deep" in _error(json.dumps({"id": 1, "prompt": "hi", "json_schema": schema}))


def test_an_error_record_with_a_surrogate_still_encodes() -> None:
    from chatapp.batch.output import encode_record

    assert json.loads(encode_record({"id": "\ud800", "line": 1, "error": "x"}))["id"] == "\ud800"


# --- settings: one validation for quick and batch ----------------------------------------------------------------

@pytest.mark.parametrize(
    "changes",
    [{"temperature": math.nan}, {"temperature": math.inf}, {"top_p": math.nan}, {"top_k": 10**20}, {"seed": -1},
     {"seed": 2**64}, {"max_tokens": 10**12}],
)
def test_settings_out_of_range_are_refused(changes: dict) -> None:
    with pytest.raises(SettingsError):
        GenerationSettings(**changes)


def test_a_long_prompt_is_refused_before_tokenizing() -> None:
    with pytest.raises(SettingsError, match="1,000,000 characters"):
        check_prompt_chars(1_000_000, 256, 19)


# --- constraints compile within budget ---------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", ["a{99999}", "(a|b)*a(a|b){16}"])
def test_explosive_regexes_fail_fast(pattern: str) -> None:
    started = time.monotonic()
    with pytest.raises(ConstraintError, match="limit"):
        compile_regex(pattern)
    assert time.monotonic() - started < 30  # well under a second on a quiet machine; the budget caps it at 10 s


def test_a_thousand_fold_repeat_compiles_quickly() -> None:
    started = time.monotonic()
    assert compile_regex("a{1000}").accepts(b"a" * 1000)
    assert time.monotonic() - started < 30  # was 18 s on a quiet machine, now about 0.5 s


def test_min_items_100000_is_refused_at_once() -> None:
    with pytest.raises(ConstraintError, match="minItems"):
        schema_to_regex({"type": "array", "items": {"type": "integer"}, "minItems": 100000})


def test_a_deeply_nested_regex_is_a_constraint_error() -> None:
    with pytest.raises(ConstraintError):
        compile_regex("(" * 3000 + "a" + ")" * 3000)


# --- --resume never truncates what is not a torn record ----------------------------------------------------------

@pytest.mark.parametrize("data", [b"notes, no trailing newline", b"\x00\x01\x02binary", b'{"a": 1}', b"[1, 2]"])
def test_resume_refuses_a_file_without_records_and_leaves_it(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(data)
    with pytest.raises(BatchFileError, match="left untouched"):
        scan_output(path)
    assert path.read_bytes() == data


def test_resume_refuses_a_record_whose_sample_is_a_list(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    data = b'{"id":"a","sample":[0],"text":"","finish_reason":"stop"}\n{"id":"b"'
    path.write_bytes(data)
    with pytest.raises(BatchFileError):
        scan_output(path)
    assert path.read_bytes() == data


def test_resume_cuts_only_a_torn_record_after_a_valid_one(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    good = b'{"id":"a","sample":0,"text":"","finish_reason":"stop"}\n'
    path.write_bytes(good + b'{"id":"b","sam')
    assert scan_output(path).truncated_bytes == 14
    assert path.read_bytes() == good
    path.write_bytes(good + b"trailing note")
    with pytest.raises(BatchFileError):
        scan_output(path)


def test_resume_on_a_file_that_cannot_be_cut_is_refused(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "out.jsonl"
    data = b'{"id":"a","sample":0,"text":"","finish_reason":"stop"}\n{"id":"b'
    path.write_bytes(data)

    real_open = Path.open

    def immutable(self, mode="r", *args, **kwargs):
        if mode == "r+b":
            raise PermissionError(1, "Operation not permitted")
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", immutable)
    with pytest.raises(BatchFileError, match="cannot cut"):
        scan_output(path)
    monkeypatch.undo()
    assert path.read_bytes() == data


def test_writing_to_a_full_disk_is_a_batch_file_error() -> None:
    sink = FileSink(Path("/dev/full"))
    with pytest.raises(BatchFileError, match="No space left"):
        sink.write({"id": 1, "line": 1, "error": "x"})
    sink.close()


# --- programs ------------------------------------------------------------------------------------------------------

def test_a_program_file_with_invalid_utf8_is_a_program_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b'name = "x\xff"\n[[zones]]\nlabel = "a"\n')
    with pytest.raises(ProgramError, match="UTF-8"):
        load_program_source(path)


def test_max_genned_per_zone_beyond_int64_is_refused() -> None:
    with pytest.raises(ProgramError, match="max_genned_per_zone"):
        parse_program_toml('max_genned_per_zone = 18446744073709551616\n[[zones]]\nlabel = "a"\n')


# --- model configs and output paths --------------------------------------------------------------------------------

@pytest.mark.parametrize("changes", [{"num_attention_heads": 0}, {"hidden_size": 0}, {"num_key_value_heads": 2}])
def test_impossible_model_configs_are_refused(changes: dict) -> None:
    from chatapp.stt.config import STTConfig

    base = {"hidden_size": 12, "num_attention_heads": 3, "num_key_value_heads": 3, "num_hidden_layers": 2,
            "intermediate_size": 8, "vocab_size": 16, "max_position_embeddings": 32}
    with pytest.raises(Exception, match=r"must be|multiple"):
        STTConfig(**{**base, **changes})


def test_an_existing_file_as_output_directory_is_refused_before_work(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(DataDirError, match="not a directory"):
        check_output(target, "--out directory")
    assert check_output(tmp_path / "new" / "dir", "--out directory") == tmp_path / "new" / "dir"


# --- history database ------------------------------------------------------------------------------------------------

def test_a_directory_as_history_db_is_refused(tmp_path: Path) -> None:
    from chatapp.ui.history import open_history

    with pytest.raises(HistoryError, match="directory"):
        open_history(tmp_path)


def test_a_foreign_database_is_refused_and_untouched(tmp_path: Path) -> None:
    from chatapp.ui.history import open_history

    path = tmp_path / "other.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE stuff (a)")
    db.commit()
    db.close()
    data = path.read_bytes()
    with pytest.raises(HistoryError, match="left untouched"):
        open_history(path)
    assert path.read_bytes() == data


def test_a_damaged_default_db_is_moved_aside_with_a_notice(tmp_path: Path) -> None:
    from chatapp.ui.history import open_history

    path = tmp_path / "history.sqlite3"
    path.write_bytes(b"garbage")
    with pytest.raises(HistoryError):
        open_history(path, move_aside=False)  # a --db the user named: refused
    store = open_history(path)
    assert store.notice and "moved to" in store.notice
    store.close()
    aside = [p for p in tmp_path.iterdir() if ".damaged-" in p.name]
    assert [p.read_bytes() for p in aside] == [b"garbage"]


# --- the CLI: no traceback, non-zero exit, before any model loads -------------------------------------------------

@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hello \udcff"], "not UTF-8"),
        (["generate", "hi", "--top-k", "99999999999999999999"], "top_k must be between"),
        (["generate", "hi", "--temperature", "nan"], "finite"),
        (["generate", "hi", "--seed", "-1"], "seed must be between"),
    ],
)
def test_cli_refuses_bad_quick_input_cleanly(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert message in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_cli_convert_and_train_check_the_output_path_first(tmp_path: Path) -> None:
    from chatapp.models.registry import tiny_model_dir as default_model_dir

    existing = tmp_path / "existing"
    existing.write_text("keep me")
    result = runner.invoke(app, ["convert", str(default_model_dir()), str(existing)])
    assert result.exit_code == 1 and "already exists" in result.output
    result = runner.invoke(app, ["train", "corpus.jsonl", "--out", str(existing), "--model", str(default_model_dir())])
    assert result.exit_code == 1 and "not a directory" in result.output
    assert existing.read_text() == "keep me"


def test_cli_convert_of_a_plain_file_says_it_is_a_file(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("x")
    result = runner.invoke(app, ["convert", str(plain), str(tmp_path / "out")])
    assert result.exit_code == 1 and "is a file, not a model directory" in result.output


def test_no_chatapp_error_is_swallowed() -> None:
    assert issubclass(HistoryError, ChatappError)


# --- `chatapp run`: every value is checked before the TUI starts ---------------------------------------------------

@pytest.fixture
def no_tui(monkeypatch):
    """`run` must refuse before the app starts: starting it is a test failure, not a hang."""
    from chatapp.ui.app import ChatApp

    def refuse(self, *args, **kwargs):
        raise AssertionError("the TUI started")

    monkeypatch.setattr(ChatApp, "run", refuse)


def _run_refuses(args: list[str], *messages: str, code: int = 1) -> str:
    result = runner.invoke(app, ["run", *args])
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for message in messages:
        assert message in result.output, result.output
    return result.output


def test_run_with_a_bad_program_file_names_it_before_loading_the_model(tmp_path: Path, no_tui, monkeypatch) -> None:
    import chatapp.ui.app
    import chatapp.ui.process

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded first")

    monkeypatch.setattr(chatapp.ui.app, "make_app", no_model)
    monkeypatch.setattr(chatapp.ui.process, "ProcessBackend", no_model)
    bad = tmp_path / "BAD.toml"
    bad.write_bytes(b'name = "x\xff"\n[[zones]]\nlabel = "a"\n')
    _run_refuses(["--program", str(bad)], str(bad), "not valid UTF-8", "fix: save the program as UTF-8")
    _run_refuses(["--program", str(tmp_path / "missing.toml")], "missing.toml does not exist", "fix:")
    _run_refuses(["--program", "nosuchbuiltin"], "no built-in program named 'nosuchbuiltin'", "fix:")
    (tmp_path / "syntax.toml").write_text("zones = [[[")
    _run_refuses(["--program", str(tmp_path / "syntax.toml")], "syntax.toml", "fix:")


def test_run_with_a_program_that_does_not_compile_says_why(tmp_path: Path, no_tui) -> None:
    """Compiling needs the model's tokenizer: the engine's error comes back whole (not "engine process stopped")."""
    bad = tmp_path / "BAD.toml"
    bad.write_text('name = "x"\n[[zones]]\nlabel = "a"\nuntil = "no such token here"\n')
    output = _run_refuses(
        ["--program", str(bad), "--in-process", "--db", str(tmp_path / "h.sqlite3")],
        f"{bad}:4: zone 'a': until 'no such token here' is not a single token", "fix: trigger on",
    )
    assert "engine process stopped" not in output


def test_run_refuses_bad_model_device_and_db_values(tmp_path: Path, no_tui) -> None:
    plain = tmp_path / "plain"
    plain.write_text("x")
    _run_refuses(["--model", str(tmp_path / "nowhere")], "nowhere does not exist", "fix:")
    _run_refuses(["--model", str(plain)], "is a file, not a model directory", "fix:")
    (tmp_path / "empty").mkdir()
    _run_refuses(["--model", str(tmp_path / "empty")], "has no config.json", "fix:")
    _run_refuses(["--device", "toaster"], "unknown device 'toaster'", "fix:")
    _run_refuses(["--db", str(tmp_path)], "directory", "fix:")


def test_run_has_no_constraint_options_and_says_so(no_tui) -> None:
    """Constraints are set in the TUI (F2); `run --regex` is a usage error, not a traceback."""
    _run_refuses(["--regex", "a{99999}"], "No such option", code=1)  # a usage error exits 1 like every user error (issue 29)


def test_the_context_overflow_hint_names_what_the_chat_offers() -> None:
    """The TUI shows this hint when a turn does not fit: every key it names is a binding of the chat app, and it
    names no setting the settings screen (F2) lacks (it once said to change `context_policy`)."""
    import re

    from chatapp.errors import ContextOverflowError
    from chatapp.models import load_engine
    from chatapp.ui.app import ChatApp
    from chatapp.ui.screens.settings import _FIELDS

    engine = load_engine("tiny", "cpu")
    session = engine.session()
    with pytest.raises(ContextOverflowError) as caught:
        session.send("word " * (engine.context_size + 10), GenerationSettings(max_tokens=4))
    hint = caught.value.hint or ""
    keys = re.findall(r"\b(?:ctrl|shift|alt)\+\w+|\bf\d+\b", hint)
    bindings = {binding.key for binding in ChatApp.BINDINGS}
    assert keys and set(keys) <= bindings, (hint, bindings)
    settings_named = set(re.findall(r"\b[a-z]+_[a-z_]+\b", hint))  # snake_case words name settings
    assert settings_named <= {spec.name for spec in _FIELDS}, hint


# --- the rest of the list, end to end -----------------------------------------------------------------------

@pytest.fixture
def tiny_copy(tmp_path: Path) -> Path:
    """A copy of the shipped tiny model directory, to damage."""
    import shutil

    from chatapp.models.registry import tiny_model_dir

    return Path(shutil.copytree(tiny_model_dir(), tmp_path / "tiny"))


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
        ({"max_position_embeddings": -5}, "max_position_embeddings must be a positive integer"),
    ],
    ids=["heads-0", "context-0", "context-negative"],
)
def test_a_model_dir_with_an_impossible_config_is_a_clean_cli_error(tiny_copy: Path, changes, message) -> None:
    _edit_config(tiny_copy, **changes)
    result = runner.invoke(app, ["generate", "hi", "--model", str(tiny_copy)])
    assert result.exit_code == 1 and message in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_shape_mismatch_message_stays_short(tiny_copy: Path) -> None:
    """Every MLP of the model mismatches: the message shows three and counts the rest (it was 17.9 KB)."""
    from chatapp.errors import ModelDirError
    from chatapp.models.loader import load_model

    _edit_config(tiny_copy, intermediate_size=584)
    with pytest.raises(ModelDirError, match=r"wrong shapes .*\(and \d+ more\)") as caught:
        load_model(tiny_copy, "cpu")
    assert len(str(caught.value)) < 1000


def test_nan_weights_are_refused_not_answered_with_silence(tiny_copy: Path) -> None:
    from safetensors.torch import load_file, save_file

    from chatapp.errors import ModelDirError
    from chatapp.models.loader import load_model

    weights = tiny_copy / "model.safetensors"
    state = load_file(str(weights))
    name = next(n for n in sorted(state) if n.endswith("mlp.down_proj.weight"))
    state[name][0, 0] = float("nan")
    save_file(state, str(weights))
    with pytest.raises(ModelDirError, match=r"NaN or infinite values"):
        load_model(tiny_copy, "cpu")


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tiny_copy: Path) -> None:
    """Prompting with the extra token would index past the embedding: the directory is refused when loaded."""
    from tokenizers import Tokenizer

    from chatapp.errors import ModelDirError
    from chatapp.models.loader import load_model

    tokenizer = Tokenizer.from_file(str(tiny_copy / "tokenizer.json"))
    tokenizer.add_tokens(["<extra-token>"])
    tokenizer.save(str(tiny_copy / "tokenizer.json"))
    with pytest.raises(ModelDirError, match=r"token ids up to \d+, but the model's vocabulary"):
        load_model(tiny_copy, "cpu")


def test_program_check_on_invalid_utf8_names_the_file(tmp_path: Path) -> None:
    from chatapp.models.registry import tiny_model_dir

    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'name = "x\xff"\n[[zones]]\nlabel = "a"\n')
    result = runner.invoke(app, ["program", "check", str(bad), "--tokenizer", str(tiny_model_dir())])
    assert result.exit_code == 1 and f"{bad}:1: not valid UTF-8" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_train_init_with_hidden_size_0_is_a_clean_error(tmp_path: Path) -> None:
    from chatapp.models.registry import tiny_model_dir

    config = json.loads((tiny_model_dir() / "config.json").read_text())
    init = tmp_path / "init.json"
    init.write_text(json.dumps({**config, "hidden_size": 0}))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world " * 200)
    result = runner.invoke(
        app,
        ["train", str(corpus), "--out", str(tmp_path / "out"), "--init", str(init), "--tokenizer", str(tiny_model_dir())],
    )
    assert result.exit_code == 1 and "hidden_size must be a positive integer" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_cli_temperature_must_be_finite(value: str) -> None:
    result = runner.invoke(app, ["generate", "hi", "--temperature", value])
    assert result.exit_code == 1 and "finite" in result.output, result.output


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_quick_and_batch_refuse_a_seed_with_the_same_rule(seed: int) -> None:
    """One validation (GenerationSettings) for `generate --seed` and a batch line's "seed"."""
    quick = runner.invoke(app, ["generate", "hi", "--seed", str(seed)])
    batch = _error(json.dumps({"id": 1, "prompt": "hi", "seed": seed}))
    assert quick.exit_code == 1
    assert "seed must be between" in quick.output and "seed must be between" in batch
