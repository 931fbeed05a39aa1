"""`chatapp eval`: perplexity / routing tables plus task accuracy, by default on the evaluated model's own held-out
set (the recipe that made it), and a clear error for a model no recipe made."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp.cli import app
from chatapp.models.smollm2 import PREPARED_STAMP
from chatapp.recipes.heldout import held_out_for, recipe_of
from tests.models.gguf_files import write_tiny_gguf

runner = CliRunner()


def test_eval_without_corpus_scores_the_tiny_models_own_held_out_split() -> None:
    result = runner.invoke(app, ["eval", "--model", "tiny", "--tasks", "6", "--max-batches", "2"])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())  # the table wraps its headers where the terminal's width puts it
    for text in ("routing off", "teacher gate g", "router vs teacher gate per STT layer, F1", "tool-use accuracy"):
        assert text in output
    assert "JSON shape valid" in output
    title = " ".join(result.output.split())  # the table's title wraps where the path's length puts it
    assert "the tiny recipe's synthetic held-out split" in title and "6 held-out questions" in result.output


def test_eval_without_corpus_on_a_prepared_default_model_scores_the_smollm2_held_out_set(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The SmolLM2 recipe's held-out set and task rows, chosen by the preparation stamp (on a small random model
    with the stamp: the default model itself is too slow for the suite; its numbers are the recipe's evaluate)."""
    model = tmp_path / "prepared"
    shutil.copytree(tiny_model_dir, model)
    (model / PREPARED_STAMP).write_text("{}\n")
    result = runner.invoke(app, ["eval", "--model", str(model), "--tasks", "4", "--max-batches", "1"])
    assert result.exit_code == 0, result.output
    assert "the SmolLM2 recipe's held-out tool conversations" in " ".join(result.output.split())
    for row in ("tool calls (all kinds)", "tool call after a tool exchange", "recall two turns back"):
        assert row in result.output
    assert "JSON shape valid" not in result.output  # not the tiny corpus


def test_eval_without_corpus_on_a_converted_gguf_says_to_pass_one(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", seed=1)
    converted = tmp_path / "converted"
    assert runner.invoke(app, ["convert", str(gguf.path), str(converted)]).exit_code == 0
    result = runner.invoke(app, ["eval", "--model", str(converted)])
    assert result.exit_code == 1
    assert "was not made by a chatapp recipe" in result.output and "chatapp eval CORPUS" in result.output
    assert ("Traceback" not in result.output and result.exception is None) or isinstance(result.exception, SystemExit)


def test_eval_with_a_corpus_needs_no_recipe_and_skips_tasks_unless_asked(tiny_model_dir: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "heldout.jsonl"
    conversation = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi! How can I help?"}]
    corpus.write_text("\n".join(json.dumps({"messages": conversation}) for _ in range(20)) + "\n")
    args = ["eval", str(corpus), "--seq-len", "16", "--max-batches", "1"]
    result = runner.invoke(app, [*args, "--model", str(tiny_model_dir)])  # a random model no recipe made
    assert result.exit_code == 0, result.output
    assert "teacher gate g" in result.output and "held-out questions" not in result.output
    result = runner.invoke(app, [*args, "--model", "tiny", "--tasks", "3"])
    assert result.exit_code == 0, result.output
    assert "3 held-out questions" in result.output and "tool-use accuracy" in result.output
    result = runner.invoke(app, [*args, "--model", str(tiny_model_dir), "--tasks", "3"])
    assert result.exit_code == 1 and "leave it out" in result.output


def test_eval_missing_model_dir_is_a_clean_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["eval", "--model", str(tmp_path / "missing"), "--tasks", "1"])
    assert result.exit_code == 1
    assert "does not exist" in result.output


def test_a_model_names_its_recipe_by_the_files_its_recipe_writes(tmp_path: Path) -> None:
    from chatapp.models.registry import tiny_model_dir

    assert recipe_of(tiny_model_dir()) == "tiny"
    model = tmp_path / "model"
    model.mkdir()
    assert recipe_of(model) is None
    (model / "MODEL_CARD.md").write_text("# some other model\n")
    assert recipe_of(model) is None
    shutil.copyfile(tiny_model_dir() / "MODEL_CARD.md", model / "MODEL_CARD.md")  # a rebuild of the tiny model
    assert recipe_of(model) == "tiny"
    (model / PREPARED_STAMP).write_text("{}\n")
    assert recipe_of(model) == "smollm2"


@pytest.mark.parametrize("recipe_file", ["tiny", "smollm2"])
def test_each_recipes_held_out_conversations_are_deterministic_and_answered(recipe_file: str, tmp_path: Path):
    from chatapp.models.registry import tiny_model_dir

    model = tmp_path / "model"
    model.mkdir()
    if recipe_file == "tiny":
        shutil.copyfile(tiny_model_dir() / "MODEL_CARD.md", model / "MODEL_CARD.md")
    else:
        (model / PREPARED_STAMP).write_text("{}\n")
    held_out = held_out_for(model)
    assert held_out.recipe == recipe_file
    conversations = held_out.conversations(12)
    assert conversations == held_out.conversations(12) and len(conversations) == 12
    assert all(messages[-1]["role"] == "assistant" for messages in conversations)  # answers to score perplexity on
