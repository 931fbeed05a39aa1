"""The backbone fine-tune of `chatapp route --tune-steps`: it learns, it resumes exactly, and its merge is exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from chatapp.cli import app
from chatapp.stt import STTForCausalLM
from chatapp.stt.io import load_merged_adapters
from chatapp.training.route import Batch, combine_adapters, dense_pass
from chatapp.training.tune import TuneBatch, TuneOptions, dense_targets, distillation_loss, routed_logits, tune
from tests.training.conftest import tiny_stt

runner = CliRunner()
LAYERS = [1, 2]


def _model() -> STTForCausalLM:
    return tiny_stt(60, LAYERS, skip_mode="kv")


def _batches(model: STTForCausalLM, k: int = 8) -> list[TuneBatch]:
    """Two random batches (one row padded) with the dense model's top `k` predictions as targets."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        ids = torch.randint(1, 60, (2, 12), generator=generator)
        valid = torch.ones(2, 12, dtype=torch.bool)
        valid[1, 9:] = False
        scored = valid[:, 1:].clone()
        cached = dense_pass(model, Batch(ids, valid, scored, torch.zeros_like(scored), valid))
        out.append(dense_targets(model, ids, valid, scored, cached.inputs[-1], k=k))
    return out


def _skip_every_other(layer: int, x: torch.Tensor, rate: float) -> torch.Tensor:
    """A fixed routing: odd positions skip (the first token always runs)."""
    selected = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    selected[:, 1::2] = False
    return selected


def _divergence(model: STTForCausalLM, batches: list[TuneBatch]) -> float:
    """The distillation loss less the dense prediction's own entropy: what the tune can remove."""
    total = 0.0
    with torch.no_grad():
        for b in batches:
            loss = distillation_loss(routed_logits(model, b, LAYERS, _skip_every_other, 0.5, "kv"), b)
            total += float(loss) + float((b.top_logp.exp() * b.top_logp).sum(-1).mean())
    return total


def test_tune_lowers_the_routed_loss_and_merges_exactly() -> None:
    model = _model()
    batches = _batches(model)
    before = _divergence(model, batches)
    options = TuneOptions(steps=30, rank=4, alpha=8, lr=1e-2, warmup=2)
    adapters = tune(model, batches, LAYERS, _skip_every_other, [0.5], "kv", options, lambda _: None)
    after = _divergence(model, batches)  # the merged model: plain linear layers again
    assert after < before * 0.5, (before, after)
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert len(adapters) == 4 * 7 and all(a.shape[0] == 4 and b.shape[1] == 4 for a, b in adapters.values())
    # The adapters are the weight change: the untuned weight plus B A is the tuned weight.
    untuned = _model()
    name = "model.layers.2.mlp.down_proj"
    a, b = adapters[name]
    torch.testing.assert_close(
        untuned.get_submodule(name).weight + b @ a, model.get_submodule(name).weight, rtol=0, atol=1e-6
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_tune_on_the_gpu_comes_back_merged_to_the_cpu() -> None:
    """`TuneOptions.device`: the steps run on the GPU; the model and its adapters come back to the CPU, the routed
    loss lowered as on the CPU."""
    model = _model()
    batches = _batches(model)
    before = _divergence(model, batches)
    options = TuneOptions(steps=30, rank=4, alpha=8, lr=1e-2, warmup=2, device="cuda")
    adapters = tune(model, batches, LAYERS, _skip_every_other, [0.5], "kv", options, lambda _: None)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(a.device.type == "cpu" and b.device.type == "cpu" for a, b in adapters.values())
    assert _divergence(model, batches) < before * 0.5


def test_dense_steps_route_nothing_and_hold_the_dense_path() -> None:
    """A dense step (`dense_share`) consults no router, and its target is the model's own prediction: the dense
    path moves far less than under routed steps, which teach the adapters to make up for skipped work."""

    def no_router(layer: int, x: torch.Tensor, rate: float) -> torch.Tensor:
        raise AssertionError("a dense step consulted a router")

    def dense(model: STTForCausalLM, batches: list[TuneBatch]) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([routed_logits(model, b, [], no_router, 0.0, "kv") for b in batches])

    drift = {}
    for share, decide in ((1.0, no_router), (0.0, _skip_every_other)):
        model = _model()
        batches = _batches(model, k=60)  # the whole vocabulary: the dense target is the dense prediction exactly
        before = dense(model, batches)
        options = TuneOptions(steps=20, rank=4, alpha=8, lr=3e-3, warmup=2, dense_share=share)
        tune(model, batches, LAYERS, decide, [0.5], "kv", options, lambda _: None)
        after = dense(model, batches)
        drift[share] = float((before.exp() * (before - after)).sum(-1).mean())  # KL(before || after)
    assert drift[1.0] < drift[0.0] * 0.2, drift


def test_tune_resumes_as_if_never_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = TuneOptions(steps=6, rank=2, alpha=4, lr=5e-3, warmup=1, checkpoint_every=2)
    rates = [0.3, 0.5]
    straight = _model()
    whole = tune(straight, _batches(straight), LAYERS, _skip_every_other, rates, "kv", options, lambda _: None)

    checkpoint = tmp_path / "tune.pt"
    real_step, calls = torch.optim.AdamW.step, []

    def dies_at_the_fifth_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # killed after the checkpoint of step 4
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", dies_at_the_fifth_step)
    killed = _model()
    with pytest.raises(KeyboardInterrupt):
        tune(killed, _batches(killed), LAYERS, _skip_every_other, rates, "kv", options, print, checkpoint=checkpoint)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    resumed, lines = _model(), []
    parts = tune(
        resumed, _batches(resumed), LAYERS, _skip_every_other, rates, "kv", options, lines.append, checkpoint=checkpoint
    )
    assert any("resumed" in line and "step 4" in line for line in lines)
    for module, (a, b) in whole.items():
        torch.testing.assert_close(parts[module][0], a)
        torch.testing.assert_close(parts[module][1], b)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**31))
def test_combined_adapters_apply_both(r1: int, r2: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    a1, b1 = torch.randn(r1, 6, generator=generator), torch.randn(5, r1, generator=generator)
    a2, b2 = torch.randn(r2, 6, generator=generator), torch.randn(5, r2, generator=generator)
    combined = combine_adapters({"m": (a1, b1), "only_first": (a1, b1)}, {"m": (a2, b2), "only_second": (a2, b2)})
    a, b = combined["m"]
    torch.testing.assert_close(b @ a, b1 @ a1 + b2 @ a2)
    assert set(combined) == {"m", "only_first", "only_second"}


def test_route_with_tune_steps_writes_a_tuned_model_int4_can_serve(
    converted: Path, route_prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tuned"
    args = ["route", str(converted), "--out", str(out), "--prompts", str(route_prompts), "--answer-tokens", "12"]
    result = runner.invoke(app, [*args, "--budget", "1e9", "--layers", "1", "--tune-steps", "3"])
    assert result.exit_code == 0, result.output
    assert "backbone tuned 3 steps" in result.output
    report = json.loads((out / "routing.json").read_text())
    assert report["tune_steps"] == 3 and report["tuned_dense_ppl"] > 0
    adapters = load_merged_adapters(out)
    assert adapters and all(a.shape[0] == TuneOptions().rank for a, _ in adapters.values())

    from chatapp.models import load_engine
    from chatapp.settings import GenerationSettings

    engine = load_engine(out, dtype="int4")
    reply = engine.generate_batch(["Hello there"], GenerationSettings(max_tokens=8))[0]
    assert reply.events


def test_a_chosen_routing_routes_every_layer_on_each_routed_step() -> None:
    """`layer_prefixes=False`: the routing is already chosen (as served), so no step routes only some of it."""
    for prefixes in (False, True):
        seen: list[int] = []

        def record(layer: int, x: torch.Tensor, rate: float, seen: list[int] = seen) -> torch.Tensor:
            seen.append(layer)
            return _skip_every_other(layer, x, rate)

        model = _model()
        options = TuneOptions(steps=8, rank=2, alpha=4, lr=1e-3, warmup=1, dense_share=0.0, layer_prefixes=prefixes)
        tune(model, _batches(model), LAYERS, record, [0.5], "kv", options, lambda _: None)
        if prefixes:
            assert seen.count(LAYERS[0]) > seen.count(LAYERS[-1])  # a prefix of one layer sometimes
        else:
            assert seen.count(LAYERS[0]) == seen.count(LAYERS[-1]) == 8
