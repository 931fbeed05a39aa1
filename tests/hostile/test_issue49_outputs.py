"""The hostile pass on the lens, its fit, constraints with programs and the new outputs: no output over a path chatapp
did not write (a FIFO, a user's file, a link, a directory, a device), a fitted lens kept where preparing a model
again cannot reach it, no overflow run silently, no traceback, no developer's message, every refusal before the work.

Permission cases run the CLI in a subprocess without root's override (`setpriv` drops CAP_DAC_OVERRIDE), so mode
bits hold for root as they do for a user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from chatapp import store
from chatapp.cli import app
from chatapp.errors import DataDirError
from chatapp.models.lens_files import LENS_FILE, fitted_path, is_lens_file, lens_file
from chatapp.models.registry import tiny_model_dir
from tests.hostile.refusals import refused as _refused

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
FIT = ["--conversations", "4", "--steps", "0"]  # a lens fit of the tiny model in ~2 s
_NO_OVERRIDE = ["--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]


def _ok(args: list[str]):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return result


@pytest.fixture
def no_work(monkeypatch):
    """Loading a model's weights is a test failure: the input must be refused first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr("chatapp.models.load_model", refuse)
    monkeypatch.setattr("chatapp.models.load_engine", refuse)
    monkeypatch.setattr("chatapp.stt.STTForCausalLM.from_pretrained", refuse)


def _without_override() -> list[str]:
    probe = subprocess.run(["setpriv", *_NO_OVERRIDE, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"setpriv cannot drop capabilities here: {probe.stderr.decode(errors='replace').strip()}")
    return ["setpriv", *_NO_OVERRIDE]


# 2: never over a path chatapp did not write ------------------------------------------------------------------------
def test_2_lens_fit_never_replaces_a_fifo_a_users_file_or_a_link(tmp_path: Path, no_work) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    mine = tmp_path / "mine.txt"
    mine.write_text("precious")
    link = tmp_path / "link"
    link.symlink_to(mine)
    _refused(["lens", "fit", "tiny", "-o", str(fifo), *FIT], f"{fifo} is a FIFO", "fix: give the path of a new file")
    _refused(["lens", "fit", "tiny", "-o", str(mine), *FIT], f"{mine} already exists and is not a file chatapp wrote")
    _refused(["lens", "fit", "tiny", "-o", str(link), *FIT], f"{link} is a symbolic link")
    assert fifo.is_fifo() and link.is_symlink() and mine.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link", "mine.txt"]  # nothing left beside them


def test_2_a_device_is_never_an_output_file(tmp_path: Path) -> None:
    # Checked on the rule itself: a command run against /dev/null that got it wrong would replace the machine's.
    with pytest.raises(DataDirError, match="is a character device"):
        store.check_output_file(os.devnull, "-o file", ours=lambda path: True)
    assert Path(os.devnull).is_char_device()


def test_2_a_lens_file_chatapp_wrote_is_replaced_whole(tmp_path: Path) -> None:
    out = tmp_path / "lens.safetensors"
    _ok(["lens", "fit", "tiny", "-o", str(out), *FIT])
    assert is_lens_file(out)
    first = out.read_bytes()
    _ok(["lens", "fit", "tiny", "-o", str(out), "--conversations", "6", "--steps", "0"])  # its own file: replaced
    assert is_lens_file(out) and out.read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lens.safetensors"]


def test_2_export_never_writes_over_what_is_at_its_name(tmp_path: Path) -> None:
    from chatapp.ui.export import export_conversation
    from chatapp.ui.history import Conversation, ConversationSummary

    conversation = Conversation(ConversationSummary(1, "Hi", "tiny", None, 0.0, 0.0, 0), [])
    first = export_conversation(conversation, tmp_path, now=0.0)
    os.mkfifo(tmp_path / f"{first[0].stem}-2.json")  # a FIFO at the next name: a plain write would hang on it
    second = export_conversation(conversation, tmp_path, now=0.0)  # the same second: never over the first
    assert [p.name for p in second] == [f"{first[0].stem}-3.md", f"{first[0].stem}-3.json"]
    assert all(path.is_file() for path in (*first, *second)) and (tmp_path / f"{first[0].stem}-2.json").is_fifo()


# 3: a fitted lens lives where preparing a model again cannot reach it -----------------------------------------------
def test_3_a_fitted_lens_goes_to_the_data_directory_and_the_lens_finds_it(tmp_path: Path) -> None:
    from chatapp.settings import data_dir

    package = sorted(p.name for p in tiny_model_dir().iterdir())
    result = _ok(["lens", "fit", "tiny", *FIT])
    fitted = data_dir() / "lenses" / "tiny" / LENS_FILE
    assert fitted.is_file() and str(fitted) in "".join(result.stdout.split())
    assert sorted(p.name for p in tiny_model_dir().iterdir()) == package  # nothing written into the package
    shown = _ok(["lens", "What is 2+2?", "--model", "tiny", "--lens", "tuned", "--max-tokens", "4", "--json"])
    assert json.loads(shown.stdout)["lens"] == "tuned"


def test_3_the_default_models_fitted_lens_is_outside_its_prepared_directory(tmp_path: Path) -> None:
    from chatapp.models.smollm2 import prepared_dir

    fitted = fitted_path(prepared_dir())
    assert prepared_dir().resolve() not in fitted.resolve().parents  # a re-preparation replaces that directory whole
    fitted.parent.mkdir(parents=True)
    fitted.write_bytes(b"")
    assert lens_file(prepared_dir()) == fitted  # the user's fit comes before the shipped one


def test_3_a_model_directory_is_left_as_it_was(tmp_path: Path) -> None:
    import shutil

    model = Path(shutil.copytree(tiny_model_dir(), tmp_path / "model"))
    before = sorted(p.name for p in model.iterdir())
    _ok(["lens", "fit", str(model), *FIT])
    assert sorted(p.name for p in model.iterdir()) == before and lens_file(model) == fitted_path(model)


# 5: no overflow run silently ----------------------------------------------------------------------------------------
def test_5_a_reply_longer_than_the_context_is_refused() -> None:
    reply = "word " * 400  # ~400 tokens on the tiny model's 256
    _refused(
        ["lens", "hi", "--model", "tiny", "--reply", reply],
        "more than the model's context of 256 tokens",
        "fix: shorten --reply to at most",
    )
    _refused(["lens", reply, "--model", "tiny"], "the model's context holds 256", "fix: shorten the prompt")


# 6: no traceback ----------------------------------------------------------------------------------------------------
def test_6_an_existing_directory_is_refused_before_the_fit(tmp_path: Path, no_work) -> None:
    _refused(["lens", "fit", "tiny", "-o", str(tmp_path), *FIT], f"{tmp_path} is a directory", "new file")


def test_6_an_output_under_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    prefix = _without_override()
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        out = locked / "lens.safetensors"
        command = [*prefix, sys.executable, "-m", "chatapp.cli", "lens", "fit", "tiny", "-o", str(out), *FIT]
        result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        locked.chmod(0o755)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("error:") == 1, result.stderr
    assert f"{locked} is not writable" in result.stderr and "caching states" not in result.stderr
    assert list(locked.iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [["--conversations", "2"], ["--conversations", "4", "--rank", "100"]],
    ids=["fewest conversations", "rank above the positions"],
)
def test_6_small_fits_work_with_the_rank_the_data_supports(tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "lens.safetensors"
    result = _ok(["lens", "fit", "tiny", "-o", str(out), "--steps", "1", *args])
    assert "can support: fitting rank" in result.output  # said, not silent
    from chatapp.models.safetensors_header import read_header

    down = read_header(out).tensors["down"]["shape"]
    assert down[:2] == [6, 192] and 1 <= down[2] < 100


def test_6_a_rank_above_the_models_width_is_refused_before_loading(tmp_path: Path, no_work) -> None:
    _refused(["lens", "fit", "tiny", "-o", str(tmp_path / "x"), "--rank", "1000"], "width (192)", "--rank 192")


# 8: a program and a constraint that cannot both hold ----------------------------------------------------------------
def test_8_a_program_forcing_text_the_regex_forbids_is_refused() -> None:
    result = runner.invoke(
        app, ["generate", "What is 2*3?", "--model", "tiny", "--program", "think", "--regex", "[0-9]+"]
    )
    assert result.exit_code == 1, result.output
    assert "<think>" not in result.stdout and "allowed_mask" not in result.output
    assert "--program think starts the reply with the forced text '<think>'" in result.output
    assert "fix: drop --program or --regex" in result.output


def test_8_a_batch_line_with_such_a_program_and_schema_is_an_error_record(tmp_path: Path) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text(
        json.dumps({"id": "a", "prompt": "What is 2*3?", "program": "think", "json_schema": {"type": "integer"}})
        + "\n"
    )
    result = runner.invoke(app, ["batch", str(lines), "--model", "tiny", "--max-tokens", "4"])
    assert result.exit_code == 1
    record = json.loads(result.stdout.splitlines()[0])
    assert "text" not in record and "allowed_mask" not in record["error"]
    assert "starts the reply with the forced text '<think>'" in record["error"]
    assert 'fix: drop "program" or "json_schema"' in record["error"]


def test_8_a_later_conflict_ends_the_row_in_the_users_words(engine_free_constraint) -> None:
    from chatapp.errors import ConstraintError

    constraint, token = engine_free_constraint
    with pytest.raises(ConstraintError) as caught:
        constraint.consume(token)
    assert "allowed_mask" not in caught.value.hint and "drop the program or the constraint" in caught.value.hint


@pytest.fixture
def engine_free_constraint():
    from chatapp.models.loader import _load_tokenizer
    from chatapp.trie.constraint import Constraint
    from chatapp.trie.vocab import ConstraintVocab

    tokenizer = _load_tokenizer(tiny_model_dir(), None)
    vocab = ConstraintVocab.from_tokenizer(tokenizer, tokenizer.get_vocab_size())
    letter = tokenizer.token_to_id("a")
    return Constraint.regex("[0-9]+", vocab, None), letter


# 9: an output that is a link is refused before the work ------------------------------------------------------------
def test_9_route_out_a_link_to_an_empty_directory_is_refused_up_front(tmp_path: Path, no_work) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    link = tmp_path / "link"
    link.symlink_to(empty)
    _refused(["route", "tiny", "--out", str(link), "--layers", "3"], f"{link} is a symbolic link", str(empty))
    assert link.is_symlink() and list(empty.iterdir()) == []


# 11: a model without tool markers -----------------------------------------------------------------------------------
def test_11_lens_fit_fits_a_converted_gguf(tmp_path: Path) -> None:
    from tests.models.gguf_files import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", seed=3)
    _ok(["convert", str(gguf.path), str(tmp_path / "model")])
    result = _ok(["lens", "fit", str(tmp_path / "model"), *FIT])
    assert "no tool markers: fitting on its answers to general prompts only" in result.output
    assert "saved the tuned lens" in result.stdout and fitted_path(tmp_path / "model").is_file()


# 14: a missing schema file is named as missing ----------------------------------------------------------------------
def test_14_a_missing_json_schema_file_is_named_as_missing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = _refused(["generate", "hi", "--model", "tiny", "--json-schema", "missing.json"], "missing.json does not exist")
    assert "not valid JSON" not in out
    _refused(["generate", "hi", "--model", "tiny", "--json-schema", str(tmp_path)], "is a directory")
    _refused(["generate", "hi", "--model", "tiny", "--json-schema", "a" * 5000], "neither a file nor valid JSON")


# 15: run's options are checked before the TUI -----------------------------------------------------------------------
def test_15_run_refuses_an_unknown_routing_level_before_starting_anything(monkeypatch) -> None:
    def started(*args, **kwargs):
        raise AssertionError("the engine process or the TUI started before --routing was checked")

    monkeypatch.setattr("chatapp.ui.process.start_engine", started)
    monkeypatch.setattr("chatapp.ui.app.make_app", started)
    _refused(["run", "--model", "tiny", "--routing", "bogus"], "no routing level 'bogus'", "default, off")


# 17: the file and line; numbers that stay readable ------------------------------------------------------------------
def test_17_a_prompt_over_the_context_is_named_by_file_and_line(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"Hello number {i}, how are you?"}]} for i in range(9)]
    lines[3] = {"messages": [{"role": "user", "content": "word " * 400}]}
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["route", "tiny", "--prompts", str(prompts), "--out", str(tmp_path / "x"), "--layers", "3"]
    _refused([*args, "--conversations", "9", "--answer-tokens", "8"], f"{prompts}:4", "the model's context holds 256")
    assert not (tmp_path / "x").exists()


def test_17_the_per_layer_table_keeps_its_numbers_at_80_columns() -> None:
    from chatapp.cli.lens import render_layers
    from chatapp.engine.lens import LayerLens, LensAlternative, ReplyLens, TokenLens

    wide = tuple(LensAlternative(i, " a rather long alternative token", 0.123) for i in range(3))
    layers = tuple(LayerLens(n, n % 2 == 1, n != 3, 0.25 + n / 100, n + 1, wide) for n in range(6))
    token = TokenLens(0, 5, 7, " x", 2, (True, False, True), layers)
    result = ReplyLens("raw", 6, (1, 3, 5), "kv", (token,))
    console = Console(width=80, record=True, highlight=False)
    console.print(render_layers(result, token))
    text = console.export_text()
    assert "…" not in text
    for layer in layers:
        assert f"{layer.prob:.3f}" in text and "○ skipped" in text and "◀ decided" in text
    assert max(len(line) for line in text.splitlines()) <= 80
