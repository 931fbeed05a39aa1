"""Routing levels (`--routing LEVEL`) and the net "compute saved": through the CLI, the batch records and the fold."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp.cli import app
from chatapp.compute_saved import compute_saved, skip_cost
from chatapp.errors import SettingsError
from chatapp.routing_levels import level_thresholds, pick_level
from chatapp.stt import STTConfig

runner = CliRunner()


@pytest.fixture
def leveled_dir(routed_model_dir: Path, tmp_path: Path) -> Path:
    """The routed random model with two levels: "quality" at its threshold 0.5 and "all" at 0 (every token runs).
    Its random routers' probabilities sit at 0 or 1, so thresholds in between all decide alike."""
    path = tmp_path / "leveled"
    shutil.copytree(routed_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["routing_levels"] = {"quality": 0.5, "all": 0.0}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _saved(output: str) -> float:
    line = next(line for line in output.splitlines() if line.startswith("compute saved:"))
    return float(line.split()[2].rstrip("%"))


def test_levels_are_the_models_own_then_off() -> None:
    assert list(level_thresholds(None, 0.4)) == ["default", "off"]
    table = level_thresholds({"fast": 0.8, "quality": 0.5}, 0.5)  # as config.json's sorted keys give them
    assert list(table.items()) == [("quality", 0.5), ("fast", 0.8), ("off", None)]
    assert pick_level(table, None) == "quality" and pick_level(table, "off") == "off"
    with pytest.raises(SettingsError, match="quality, fast, off"):
        pick_level(table, "turbo")
    with pytest.raises(ValueError, match="routing_levels"):
        STTConfig(hidden_size=8, num_attention_heads=1, num_key_value_heads=1, routing_levels={"fast": 1.5}).validate_stt()


def test_generate_runs_at_the_level_it_names(leveled_dir: Path) -> None:
    """Each level as --verbose reports it: "quality" skips, "all" (threshold 0) and "off" skip nothing."""
    saved = {}
    for level in ("quality", "all", "off"):
        args = ["generate", "Hello there", "--model", str(leveled_dir), "--max-tokens", "16", "-v", "--routing", level]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert f"routing level:        {level}" in result.output
        saved[level] = _saved(result.output)
    assert saved["quality"] > 0 and saved["all"] == 0 and saved["off"] == 0, saved
    # The default is the level with the lowest threshold: the one that computes most.
    default = runner.invoke(app, ["generate", "Hello there", "--model", str(leveled_dir), "--max-tokens", "4", "-v"])
    assert "routing level:        all" in default.output


def test_an_unknown_level_is_refused_with_the_models_levels(leveled_dir: Path) -> None:
    result = runner.invoke(app, ["generate", "Hi", "--model", str(leveled_dir), "--routing", "turbo"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "no routing level 'turbo'" in result.output and "all, quality, off" in result.output
    assert "fix:" in result.output


def test_batch_records_name_the_level(leveled_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": f"Say {i}", "max_tokens": 6}) + "\n" for i in range(3)))
    result = runner.invoke(app, ["batch", str(source), "--model", str(leveled_dir), "--routing", "off"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 3 and all(r["routing_level"] == "off" and r["compute_saved"] == 0 for r in records)
    refused = runner.invoke(app, ["batch", str(source), "--model", str(leveled_dir), "--routing", "turbo"])
    assert refused.exit_code == 1 and "no routing level 'turbo'" in refused.output


def test_compute_saved_is_net_of_what_a_skipped_token_still_computes() -> None:
    """SmolLM2-135M's shapes: a skipped token's K/V are 2*192*576 of the block's 3,538,944 weight multiply-adds
    (6.25%); "predict" adds its rank-64 predictor, 2*64*576 + 576."""
    shapes = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152)  # fmt: skip
    block = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    assert skip_cost(STTConfig(**shapes, skip_mode="strict")) == 0
    assert skip_cost(STTConfig(**shapes, skip_mode="kv")) == pytest.approx(2 * 192 * 576 / block)
    predict = STTConfig(**shapes, skip_mode="predict", predictor_rank=64)
    assert skip_cost(predict) == pytest.approx((2 * 192 * 576 + 129 * 576) / block)
    # 300 skipped blocks of 100 tokens x 30 layers: 10% gross, less the cost of the skips.
    assert compute_saved(300, 100, 30) == pytest.approx(0.1)
    assert compute_saved(300, 100, 30, skip_cost(predict)) == pytest.approx(0.1 * (1 - skip_cost(predict)))


def test_the_tui_settings_take_a_level_the_model_has() -> None:
    from chatapp.errors import SettingsError
    from chatapp.settings import GenerationSettings
    from chatapp.ui.screens.settings import parse_settings

    form = {"temperature": "0", "top_k": "0", "top_p": "1", "max_tokens": "64", "seed": "0"}
    levels = ("quality", "fast", "off")
    chosen = parse_settings(GenerationSettings(), {**form, "routing_level": "fast"}, levels)
    assert chosen.routing_level == "fast"
    assert parse_settings(GenerationSettings(), {**form, "routing_level": " "}, levels).routing_level is None
    with pytest.raises(SettingsError, match="no level 'turbo'"):
        parse_settings(GenerationSettings(), {**form, "routing_level": "turbo"}, levels)


def test_a_model_that_does_not_route_prompts_routes_only_what_it_generates(routed_model_dir: Path) -> None:
    """`route_prompt = False`: the prompt runs through every layer (no prompt routing is reported, and the cache is
    a dense model's for it), the generated tokens still skip; the prompt's logits are routing off's."""
    from chatapp.models import load_engine
    from chatapp.settings import GenerationSettings

    engine = load_engine(routed_model_dir, dtype="float32")
    settings = GenerationSettings(max_tokens=12)
    routed = list(engine.generate(["Hello there, how are you?"], settings))
    assert routed[0].prompt.computed is not None
    engine.model.config.route_prompt = False
    steps = list(engine.generate(["Hello there, how are you?"], settings))
    assert steps[0].prompt.computed is None
    flags = [flag for step in steps for event in step.tokens if event.computed for flag in event.computed]
    assert flags and not all(flags), "generated tokens still skip"
    dense = list(engine.generate(["Hello there, how are you?"], settings.with_(routing="off")))
    first = next(event.token for step in dense for event in step.tokens)
    assert next(event.token for step in steps for event in step.tokens) == first  # the prompt ran dense


def test_batch_records_count_compute_saved_as_the_reply_fold_does(leveled_dir: Path, tmp_path: Path) -> None:
    """A record's compute saved is its per-layer routing folded by the one definition (`chatapp.compute_saved`) over
    all of the model's layers, net of the skip cost: not zero while its STT layers skip."""
    config = STTConfig.from_pretrained(leveled_dir)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": f"Say {i}", "max_tokens": 8}) + "\n" for i in range(3)))
    result = runner.invoke(app, ["batch", str(source), "--model", str(leveled_dir), "--routing", "quality"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 3
    for record in records:
        skipped = sum(1 - share for share in record["routing"].values())
        expected = compute_saved(skipped, 1, config.num_hidden_layers, skip_cost(config))
        assert record["compute_saved"] == pytest.approx(expected, abs=1e-5)
    assert any(record["compute_saved"] > 0 for record in records)
