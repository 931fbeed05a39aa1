"""`chatapp generate "PROMPT"`: quick mode end to end through the CLI."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from chatapp.cli import app
from chatapp.settings import GenerationSettings


@pytest.fixture
def model_dir(qwen_dir, chat_tokenizer, tmp_path):
    """A complete model directory: the tiny checkpoint plus its tokenizer.json."""
    path = tmp_path / "model"
    shutil.copytree(qwen_dir, path)
    chat_tokenizer.save(str(path / "tokenizer.json"))
    return path


def test_generate_streams_the_reply_and_prints_timing(model_dir, engine) -> None:
    result = CliRunner().invoke(app, ["generate", "Hello", "--model", str(model_dir), "--max-tokens", "6", "-v"])
    assert result.exit_code == 0, result.output
    expected = engine.generate_batch(["Hello"], GenerationSettings(max_tokens=6))[0]
    assert result.output.startswith(expected.text)
    for line in ("prompt eval count", "eval rate", "forced tokens", "compute saved", "finish reason"):
        assert line in result.output


def test_generate_reports_a_missing_model_dir(tmp_path) -> None:
    result = CliRunner().invoke(app, ["generate", "Hello", "--model", str(tmp_path / "nowhere")])
    assert result.exit_code == 1
    assert "does not exist" in result.output and "Traceback" not in result.output


def test_generate_refuses_a_prompt_longer_than_the_context_can_hold_before_tokenizing_it(model_dir) -> None:
    from tokenizers import Tokenizer

    from chatapp.models.loader import load_model
    from chatapp.validation import longest_token_chars

    loaded = load_model(model_dir, "cpu")
    context = int(loaded.model.config.max_position_embeddings)
    limit = context * longest_token_chars(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    result = CliRunner().invoke(app, ["generate", "x" * (limit + 1), "--model", str(model_dir)])
    assert result.exit_code == 1, result.output
    assert f"the prompt is {limit + 1:,} characters" in result.output and "Traceback" not in result.output
    # More characters than the context has tokens, within the bound: tokenized, then refused by its token count.
    result = CliRunner().invoke(app, ["generate", "x y " * context, "--model", str(model_dir)])
    assert result.exit_code == 1 and "tokens but the model's context" in result.output, result.output


def test_generate_rejects_bad_settings(model_dir) -> None:
    result = CliRunner().invoke(app, ["generate", "Hi", "--model", str(model_dir), "--top-p", "0"])
    assert result.exit_code == 1 and "top_p" in result.output


def test_generate_runs_a_program_into_a_pipe_as_exact_text(model_dir) -> None:
    args = ["generate", "3*4?", "--model", str(model_dir), "--max-tokens", "4", "--program", "calc"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("<|python_start|>")  # a pipe gets the text only: no zone labels


def test_generate_names_a_bad_program_or_a_batch_option(model_dir) -> None:
    result = CliRunner().invoke(app, ["generate", "Hi", "--model", str(model_dir), "--program", "nope"])
    assert result.exit_code == 1 and "nope" in result.output
    result = CliRunner().invoke(app, ["generate", "Hi", "--model", str(model_dir), "--ordered"])
    assert result.exit_code == 1 and "--ordered" in result.output  # a usage error: exit 1, one line (docs/usage.md, "Errors")


def test_a_piped_reply_is_exactly_the_tokens_text_tabs_included(model_dir) -> None:
    """`generate --regex RX | cat`: the grammar forces "a<TAB>b", and the pipe gets those bytes, not 8 spaces."""
    result = CliRunner().invoke(app, ["generate", "Hi", "--model", str(model_dir), "--regex", "a\tb"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "a\tb"


def test_generate_follows_a_json_schema_inline_or_from_a_file(model_dir, tmp_path) -> None:
    schema = '{"enum": ["yes", "no"]}'
    inline = CliRunner().invoke(app, ["generate", "Ok?", "--model", str(model_dir), "--json-schema", schema])
    assert inline.exit_code == 0, inline.output
    assert json.loads(inline.stdout) in ("yes", "no")
    path = tmp_path / "schema.json"
    path.write_text(schema)
    from_file = CliRunner().invoke(app, ["generate", "Ok?", "--model", str(model_dir), "--json-schema", str(path)])
    assert from_file.stdout == inline.stdout


def test_generate_names_a_bad_constraint(model_dir) -> None:
    bad_regex = CliRunner().invoke(app, ["generate", "Hi", "--model", str(model_dir), "--regex", "[a-"])
    assert bad_regex.exit_code == 1 and "Traceback" not in bad_regex.output
    bad_json = CliRunner().invoke(app, ["generate", "Hi", "--model", str(model_dir), "--json-schema", "{nope"])
    assert bad_json.exit_code == 1 and "not valid JSON" in bad_json.output
    both = CliRunner().invoke(app, ["generate", "Hi", "--model", str(model_dir), "--regex", "a", "--json-schema", "{}"])
    assert both.exit_code == 1 and "one of them" in both.output


def test_model_accepts_a_registered_name() -> None:
    result = CliRunner().invoke(app, ["generate", "What is 2+3?", "--model", "tiny", "--max-tokens", "4"])
    assert result.exit_code == 0, result.output


def test_generate_logprobs_prints_a_table(model_dir) -> None:
    args = ["generate", "Hello", "--model", str(model_dir), "--max-tokens", "4", "--logprobs", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "log-probabilities" in result.stderr and "entropy" in result.stderr
    bad = CliRunner().invoke(app, [*args[:-1], "99"])
    assert bad.exit_code == 1 and "logprobs must be between 0 and 20" in bad.output
    assert "Traceback" not in bad.output


def test_compile_on_a_cpu_is_a_notice_and_the_reply_comes(model_dir) -> None:
    """`--compile` compiles the CUDA decode step; on a CPU the step is native (int8) or eager, so the command says
    so in one notice and answers as without it."""
    args = ["generate", "Hello", "--model", str(model_dir), "--max-tokens", "4"]
    plain, compiled = CliRunner().invoke(app, args), CliRunner().invoke(app, [*args, "--compile"])
    assert plain.exit_code == 0 and compiled.exit_code == 0, compiled.output
    assert "on a CPU the step is not compiled" in compiled.stderr and compiled.stdout == plain.stdout

