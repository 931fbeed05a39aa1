"""`chatapp eval`: perplexity / routing tables plus task accuracy on the synthetic held-out split."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from chatapp.cli import app

runner = CliRunner()


def test_eval_without_corpus_reports_routing_and_tasks(tiny_model_dir: Path) -> None:
    result = runner.invoke(app, ["eval", "--model", str(tiny_model_dir), "--tasks", "6", "--max-batches", "2"])
    assert result.exit_code == 0, result.output
    for text in ("off", "teacher", "student", "student vs teacher F1", "tool-use accuracy", "JSON shape valid"):
        assert text in result.output
    assert "6 held-out questions" in result.output


def test_eval_with_a_corpus_skips_tasks_unless_asked(tiny_model_dir: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "heldout.jsonl"
    conversation = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi! How can I help?"}]
    corpus.write_text("\n".join(json.dumps({"messages": conversation}) for _ in range(20)) + "\n")
    args = ["eval", str(corpus), "--model", str(tiny_model_dir), "--seq-len", "16", "--max-batches", "1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "student" in result.output and "tool-use accuracy" not in result.output
    result = runner.invoke(app, [*args, "--tasks", "3"])
    assert result.exit_code == 0, result.output
    assert "3 held-out questions" in result.output


def test_eval_missing_model_dir_is_a_clean_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["eval", "--model", str(tmp_path / "missing"), "--tasks", "1"])
    assert result.exit_code == 1
    assert "does not exist" in result.output
