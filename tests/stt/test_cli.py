"""`chatapp convert`, `chatapp train` and `chatapp eval` through Typer's test runner."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from chatapp.cli import app
from chatapp.stt import STTForCausalLM

from .conftest import tiny_config

runner = CliRunner()


@pytest.fixture
def corpus(tmp_path):
    lines = [
        {
            "messages": [
                {"role": "user", "content": f"What is {a} plus {a}?"},
                {"role": "assistant", "content": f"{2 * a}"},
            ]
        }
        for a in range(40)
    ]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


@pytest.fixture
def init_files(tmp_path, chat_tokenizer):
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    chat_tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    config = tiny_config(vocab_size=chat_tokenizer.get_vocab_size())
    config_path = tmp_path / "init.json"
    config_path.write_text(config.to_json_string())
    return config_path, tokenizer_dir


def test_convert_writes_an_stt_directory_with_the_tokenizer(qwen2_dir, tmp_path):
    _, path = qwen2_dir
    (path / "tokenizer.json").write_text("{}")
    result = runner.invoke(app, ["convert", str(path), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "STT layers [1, 3]" in result.output
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["routing_trained"] is False


def test_convert_reports_a_missing_directory(tmp_path):
    result = runner.invoke(app, ["convert", str(tmp_path / "missing"), str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "missing" in result.output and "Traceback" not in result.output


def test_train_from_scratch_then_resume_then_eval(corpus, init_files, tmp_path):
    config_path, tokenizer_dir = init_files
    out = tmp_path / "run"
    common = ["train", str(corpus), "--out", str(out), "--init", str(config_path), "--tokenizer", str(tokenizer_dir)]
    args = [
        *common,
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--eval-interval",
        "1",
        "--lr-scale",
        "100",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (out / "tokenizer.json").is_file()
    model = STTForCausalLM.from_pretrained(out)
    assert model.config.routing_trained is True
    assert not torch.equal(model.lm_head.weight, STTForCausalLM(tiny_config(vocab_size=512)).lm_head.weight)

    resumed = runner.invoke(app, [*args[:-6], "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--resume"])
    assert resumed.exit_code == 0, resumed.output

    evaluated = runner.invoke(app, ["eval", str(corpus), "--model", str(out), "--seq-len", "32", "--max-batches", "2"])
    assert evaluated.exit_code == 0, evaluated.output
    output = " ".join(evaluated.output.split())  # the table wraps where the terminal's width puts it
    for mode in ("routing off", "teacher gate g", "router"):
        assert mode in output
    assert "router vs teacher gate per STT layer, F1" in output


def test_train_names_the_bad_corpus_line(init_files, tmp_path):
    config_path, tokenizer_dir = init_files
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{not json}\n')
    args = [
        "train",
        str(bad),
        "--out",
        str(tmp_path / "o"),
        "--init",
        str(config_path),
        "--tokenizer",
        str(tokenizer_dir),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "bad.jsonl:2" in result.output


def test_train_needs_exactly_one_model_source(corpus, tmp_path):
    result = runner.invoke(app, ["train", str(corpus), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert "--model" in result.output and "--init" in result.output
