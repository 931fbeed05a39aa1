"""`chatapp generate "PROMPT"`: quick mode end to end through the CLI."""

from __future__ import annotations

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


def test_generate_rejects_bad_settings(model_dir) -> None:
    result = CliRunner().invoke(app, ["generate", "Hi", "--model", str(model_dir), "--top-p", "0"])
    assert result.exit_code == 1 and "top_p" in result.output


def test_generate_runs_a_program_and_marks_its_zones(model_dir) -> None:
    args = ["generate", "3*4?", "--model", str(model_dir), "--max-tokens", "4", "--program", "calc"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("[expression] <|python_start|>")


def test_generate_names_a_bad_program_or_a_batch_only_option(model_dir) -> None:
    result = CliRunner().invoke(app, ["generate", "Hi", "--model", str(model_dir), "--program", "nope"])
    assert result.exit_code == 1 and "nope" in result.output
    result = CliRunner().invoke(app, ["generate", "Hi", "--model", str(model_dir), "--ordered"])
    assert result.exit_code == 1 and "--ordered" in result.output
