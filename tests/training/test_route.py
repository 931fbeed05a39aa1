"""`chatapp route`: the frozen-backbone routing fit, on a converted GGUF and through its pieces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from chatapp.cli import app
from chatapp.stt import STTConfig
from chatapp.stt.layers import CausalRouter, router_probs, select
from chatapp.training.route import fold_cutoff, teacher_selected, with_routed_layers
from tests.training.conftest import tiny_stt

runner = CliRunner()


def test_route_a_converted_gguf_then_it_skips(converted: Path, tmp_path: Path) -> None:
    """convert -> route -> the model loads with trained routers in kv mode, and a reply skips tokens."""
    out = tmp_path / "routed"
    args = ["route", str(converted), "--out", str(out), "--prompts", "8", "--answer-tokens", "12", "--budget", "1e9"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output
    config = json.loads((out / "config.json").read_text())
    report = json.loads((out / "routing.json").read_text())
    assert config["routing_trained"] is True and config["skip_mode"] == "kv" and config["router_threshold"] == 0.5
    assert config["stt_layers"] == report["chosen"]["layers"] and config["stt_layers"]
    assert report["single_layer"] and report["fit_tokens"] > 0 and report["held_out_tokens"] > 0
    # The source is untouched; tokenizer files came along.
    assert json.loads((converted / "config.json").read_text())["routing_trained"] is False
    assert (out / "tokenizer.json").is_file()

    from chatapp.models import load_engine
    from chatapp.settings import GenerationSettings

    engine = load_engine(out, dtype="float32")
    reply = engine.generate_batch(["Hello there, how are you?"], GenerationSettings(max_tokens=24))[0]
    decisions = [c for e in reply.events if e.computed is not None for c in e.computed]
    assert decisions and not all(decisions), "a budget of 1e9 routes at the highest rate: some tokens must skip"


def test_route_a_converted_gguf_in_predict_mode(converted: Path, tmp_path: Path) -> None:
    """convert -> route --skip-mode predict -> skipped tokens carry fitted predictors' updates, and the model
    serves them in every path (the served int8 model decodes through the C step)."""
    out = tmp_path / "predict"
    args = ["route", str(converted), "--out", str(out), "--prompts", "8", "--answer-tokens", "12", "--budget", "1e9"]
    result = runner.invoke(app, [*args, "--skip-mode", "predict"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    report = json.loads((out / "routing.json").read_text())
    assert config["skip_mode"] == "predict" and config["stt_layers"]
    assert set(map(int, report["predictor_explained"])) >= set(config["stt_layers"])
    # Its levels: "quality" at the calibrated threshold, each level measured on the held-out replies.
    assert config["routing_levels"]["quality"] == 0.5 and set(report["level_measures"]) == set(config["routing_levels"])
    for level in config["routing_levels"]:
        assert f"level {level} (threshold" in result.output

    from chatapp.models import load_engine
    from chatapp.settings import GenerationSettings

    for dtype in ("float32", "int8"):
        engine = load_engine(out, dtype=dtype)
        for index in config["stt_layers"]:
            predictor = engine.model.model.layers[index].skip_predictor
            assert predictor is not None and predictor.up.weight.abs().sum() > 0
        reply = engine.generate_batch(["Hello there, how are you?"], GenerationSettings(max_tokens=24))[0]
        decisions = [c for e in reply.events if e.computed is not None for c in e.computed]
        assert decisions and not all(decisions), "a budget of 1e9 routes at the highest rate: some tokens must skip"


def test_route_rejects_bad_options(converted: Path, tmp_path: Path) -> None:
    for args, message in [
        (["--layers", "a,b"], "comma-separated list"),
        (["--layers", "7"], "do not exist"),
        (["--skip-mode", "sometimes"], "use one of"),
    ]:
        result = runner.invoke(app, ["route", str(converted), "--out", str(tmp_path / "x"), *args])
        assert result.exit_code == 1, result.output
        assert message in result.output
    result = runner.invoke(app, ["route", str(tmp_path / "missing")])
    assert result.exit_code == 1 and "does not exist" in result.output


@given(st.floats(1e-4, 1 - 1e-4), st.lists(st.floats(-30, 30), min_size=1, max_size=64))
def test_folded_cutoff_decides_as_the_cutoff(cutoff: float, logits: list[float]) -> None:
    """After folding, probability >= 0.5 exactly where the raw probability was >= the cutoff (away from ties)."""
    z = torch.tensor(logits, dtype=torch.float64)
    raw = torch.sigmoid(z) >= cutoff
    folded = torch.sigmoid(z - math.log(cutoff / (1 - cutoff))) >= 0.5
    near = (torch.sigmoid(z) - cutoff).abs() < 1e-9
    assert torch.equal(raw[~near], folded[~near])


def test_fold_cutoff_shifts_the_router_bias() -> None:
    config = STTConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        causal_router_hidden_size=8,
    )
    router = CausalRouter(config)
    x, prev = torch.randn(50, 16), torch.randn(50, 16)
    with torch.no_grad():
        before = torch.sigmoid(router(x, prev))
        cutoff = float(before.median())
        fold_cutoff(router, cutoff)
        after = torch.sigmoid(router(x, prev))
    assert torch.equal(select(before, cutoff), select(after, 0.5))


@given(st.integers(1, 40), st.floats(0.0, 0.95), st.integers(0, 2**31))
def test_teacher_skips_the_lowest_scores_never_the_first(n: int, rate: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    score = torch.rand(1, n + 3, generator=generator)
    valid = torch.zeros(1, n + 3, dtype=torch.bool)
    valid[0, :n] = True
    selected = teacher_selected(score, valid, rate)
    skipped = (~selected)[0, :n]
    assert int(skipped.sum()) == min(math.floor(rate * n), n - 1)
    assert selected[0, 0] and selected[0, n:].all()
    if skipped.any() and (~skipped[1:]).any():
        kept_scores = score[0, 1:n][~skipped[1:]]
        assert score[0, :n][skipped].max() <= kept_scores.min()


def test_relayered_model_keeps_the_backbone() -> None:
    """Moving the STT layers changes no dense output: routing off gives the same logits."""
    model = tiny_stt(50, [1])
    moved = with_routed_layers(model, [2, 3], "kv")
    assert moved.stt_layer_indices == [2, 3] and moved.config.skip_mode == "kv"
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert torch.equal(model.forward_eval(ids, "off").logits, moved.forward_eval(ids, "off").logits)
        probs = router_probs(moved.model.layers[2], torch.randn(3, 32), torch.randn(3, 32))
    assert probs.shape == (3,)
