"""The default-model build pipeline end to end on its quick recipe (same code path as `make train-tiny`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatapp.models.loader import load_model
from chatapp.models.registry import tiny_model_dir
from chatapp.models.route_prompts import route_prompts_file
from chatapp.recipes.tiny.build import SPECIAL_TOKENS, Metrics, Recipe, main, route_prompt_set, targets
from chatapp.training.corpus import read_dialogues


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("build") / "default"
    assert main(["--quick", "--out", str(out)]) == 0
    return out


def test_build_writes_a_loadable_model_dir(built: Path) -> None:
    assert sorted(p.name for p in built.iterdir()) == [
        "MODEL_CARD.md",
        "config.json",
        "model.safetensors",
        "route_prompts.jsonl",
        "tokenizer.json",
    ]
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in built.iterdir())  # shipped files are world-readable
    config = json.loads((built / "config.json").read_text())
    assert config["routing_trained"] is True and config["stt_layers"] == [1]
    loaded = load_model(built, device="cpu")
    assert [loaded.tokenizer.id_to_token(i) for i in range(len(SPECIAL_TOKENS))] == list(SPECIAL_TOKENS)
    card = (built / "MODEL_CARD.md").read_text()
    for section in ("## Data", "## Training", "## Held-out results", "## Reproduce", "make train-tiny"):
        assert section in card


def test_build_is_reproducible(built: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert main(["--quick", "--out", str(again)]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "route_prompts.jsonl"):
        assert (again / name).read_bytes() == (built / name).read_bytes(), name


def test_the_shipped_prompt_set_is_the_one_the_recipe_writes(built: Path) -> None:
    """`chatapp route tiny` asks the model its own training split's questions: the build writes them beside the
    weights, and the shipped model's file is the full recipe's."""
    assert read_dialogues(route_prompts_file(built)) == route_prompt_set(Recipe().quick())
    assert read_dialogues(route_prompts_file(tiny_model_dir())) == route_prompt_set(Recipe())


def test_another_seed_builds_another_model(built: Path, tmp_path: Path) -> None:
    other = tmp_path / "seed1"
    assert main(["--quick", "--seed", "1", "--out", str(other)]) == 0
    assert (other / "model.safetensors").read_bytes() != (built / "model.safetensors").read_bytes()
    assert "| `seed` | `1` |" in (other / "MODEL_CARD.md").read_text()


def _metrics(calculator: float, student_ppl: float, fractions: list[float], f1: list[float]) -> Metrics:
    def tally(rate: float) -> dict[str, float | int]:
        return {"correct": round(rate * 100), "total": 100, "rate": rate}

    return Metrics(
        tasks={"calculator": tally(calculator), "letters": tally(1.0), "json_valid": tally(1.0)},
        perplexity={"off": 2.0, "teacher": 2.0, "student": student_ppl},
        selected_fraction={"teacher": fractions, "student": fractions},
        student_f1=f1,
        student_accuracy=f1,
        failures=[],
    )


def test_targets_pass_and_fail_on_their_bounds() -> None:
    good = _metrics(0.95, 2.2, [0.3, 0.7], [0.8, 0.8])
    assert all(t.met for t in targets(good))
    bad = _metrics(0.94, 2.21, [0.05, 0.95], [0.9, 0.6])
    missed = {t.name for t in targets(bad) if not t.met}
    assert missed == {
        "calculator accuracy",
        "student / off perplexity",
        "every STT layer processes",
        "student-teacher F1 (mean over layers)",
    }


def test_quick_recipe_keeps_the_code_path() -> None:
    quick = Recipe(gated_steps=10).quick()
    assert quick.gated_steps > 0 and quick.steps < Recipe().steps and quick.seed == Recipe().seed
    assert Recipe(gated_steps=0).quick().gated_steps == 0
