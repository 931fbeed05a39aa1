"""`chatapp lens "PROMPT"`: every reply token's decision depth, `--at N`'s per-layer table, `--json`, and the errors a
user can make (an empty prompt, --at past the reply, a lens the model does not have)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp.cli import app
from chatapp.models.lens_files import fitted_path

runner = CliRunner()


def lens(*args: str):
    return runner.invoke(app, ["lens", *args])


def test_lens_prints_every_tokens_decision_depth(routed_model_dir: Path) -> None:
    result = lens("What is 2+2?", "--model", str(routed_model_dir), "--max-tokens", "8")
    assert result.exit_code == 0, result.output
    assert "decision depth, raw lens" in result.output
    assert "routed layers 1 3 (strict skip mode)" in result.output
    rows = [line.split() for line in result.output.splitlines() if line.strip()[:1].isdigit()]
    assert [int(row[0]) for row in rows] == list(range(len(rows))) and len(rows) >= 8
    assert "layer 1: mean depth" in result.output and "layer 3: mean depth" in result.output


def test_json_has_every_token_and_the_table_at_n(routed_model_dir: Path) -> None:
    result = lens("What is 2+2?", "--model", str(routed_model_dir), "--max-tokens", "8", "--at", "2", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["lens"] == "raw" and document["num_layers"] == 4 and document["stt_layers"] == [1, 3]
    tokens = document["tokens"]
    assert [t["index"] for t in tokens] == list(range(len(tokens)))
    assert all(t["decision_depth"] is None or 0 <= t["decision_depth"] < 4 for t in tokens)
    assert all(len(t["computed"]) == 2 for t in tokens)
    assert [len(t["layers"]) for t in tokens] == [4 if t["index"] == 2 else 0 for t in tokens]
    layers = tokens[2]["layers"]
    assert [layer["layer"] for layer in layers] == [0, 1, 2, 3]
    assert [layer["routed"] for layer in layers] == [False, True, False, True]
    assert all(len(layer["top"]) == 3 and layer["rank"] >= 1 for layer in layers)
    # Greedy: the model's own top token is the one emitted, so its rank at the last layer is 1.
    assert layers[-1]["rank"] == 1 and layers[-1]["top"][0]["token"] == tokens[2]["token"]
    assert [split["layer"] for split in document["layer_depths"]] == [1, 3]


def test_at_n_prints_the_per_layer_table(routed_model_dir: Path) -> None:
    result = lens("What is 2+2?", "--model", str(routed_model_dir), "--max-tokens", "6", "--at", "0")
    assert result.exit_code == 0, result.output
    depths, table = result.stdout.split("layer by layer (raw lens)")
    depth = next(line.split()[2] for line in depths.splitlines() if line.split()[:1] == ["0"])
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"]
    decided = [row[0] for row in rows if "◀" in row]
    assert decided == ([] if depth == "-" else [depth])


def test_teacher_forced_reply(routed_model_dir: Path) -> None:
    result = lens("What is 2+2?", "--reply", "It is 4.", "--model", str(routed_model_dir), "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert "".join(t["text"] for t in document["tokens"]) == "It is 4."


@pytest.mark.parametrize(
    ("args", "message", "fix"),
    [
        (("   ",), "error: the prompt is empty", "fix: give the lens something"),
        (("hi", "--at", "-1"), "error: --at -1 is not a token index", "fix: use a # from the table"),
        (("hi", "--at", "500", "--max-tokens", "4"), "error: --at 500 is past the reply's last token", "fix: use --at"),
        (("hi", "--reply", "ok", "--at", "99"), "error: --at 99 is past the reply's last token", "fix: use --at"),
        (("hi", "--lens", "magic"), "error: --lens 'magic' is not a lens", "fix: use raw, tuned or auto"),
        (("hi", "--lens", "tuned"), "has no tuned lens", "fix: fit one with `chatapp lens fit"),
    ],
)
def test_bad_input_is_an_error_and_a_fix(routed_model_dir: Path, args, message: str, fix: str) -> None:
    result = lens(*args, "--model", str(routed_model_dir))
    assert result.exit_code == 1, result.output
    assert message in result.output and fix in result.output
    assert "Traceback" not in result.output


def test_lens_help_names_both_commands() -> None:
    result = lens("--help")
    assert result.exit_code == 0
    assert "show" in result.output and "fit" in result.output


@pytest.fixture
def own_model_dir(routed_model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the routed model that a test may give a lens file."""
    import shutil

    return Path(shutil.copytree(routed_model_dir, tmp_path / "model"))


def test_fit_writes_a_tuned_lens_that_show_then_reads(own_model_dir: Path) -> None:
    result = lens("fit", str(own_model_dir), "--conversations", "6", "--steps", "3", "--rank", "8")
    assert result.exit_code == 0, result.output
    assert "top-1 agreement with the model's output" in result.stdout
    # Kept in the data directory, not beside the weights: the model directory is not the fit's to change.
    assert fitted_path(own_model_dir).is_file() and not (own_model_dir / "lens.safetensors").exists()
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"]
    assert rows[-1][1:] == ["100.0%", "100.0%"]  # the last layer is the model's own reading, raw or tuned

    def document(kind: str) -> dict:
        shown = lens("What is 2+2?", "--model", str(own_model_dir), "--lens", kind, "--at", "1", "--json")
        assert shown.exit_code == 0, shown.output
        return json.loads(shown.stdout)

    tuned, raw, auto = document("tuned"), document("raw"), document("auto")
    assert (tuned["lens"], raw["lens"], auto["lens"]) == ("tuned", "raw", "tuned")
    last_tuned, last_raw = tuned["tokens"][1]["layers"][-1], raw["tokens"][1]["layers"][-1]
    assert last_tuned["prob"] == pytest.approx(last_raw["prob"], abs=1e-6)
    assert tuned["tokens"][1]["layers"][0]["prob"] != pytest.approx(raw["tokens"][1]["layers"][0]["prob"], abs=1e-9)


def test_a_damaged_lens_file_is_named(own_model_dir: Path) -> None:
    (own_model_dir / "lens.safetensors").write_bytes(b"not a lens")
    result = lens("hi", "--model", str(own_model_dir))
    assert result.exit_code == 1
    assert "is not a tuned lens for this model" in result.output and "fix: fit it again" in result.output
