"""The teacher's training forward, its losses and gradient routing, evaluation modes and a short training run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from chatapp.stt import STTForCausalLM
from chatapp.stt.config import betas_at, schedule_value
from chatapp.stt.layers import causal_moving_average
from chatapp.stt.teacher import gate_regulariser, select_targets

from .conftest import VOCAB, routed_model, tiny_config

GROUPS = ("base_model", "stt_transition_network", "stt_predictive_router", "stt_causal_router")


def grads_by_group(model: STTForCausalLM, loss: torch.Tensor) -> dict[str, bool]:
    """Which parameter groups receive a nonzero gradient from `loss` alone."""
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    reached = dict.fromkeys(GROUPS, False)
    for group in model.parameter_groups():
        reached[group["name"]] |= any(p.grad is not None and p.grad.abs().sum() > 0 for p in group["params"])
    return reached


@pytest.mark.parametrize("gated", [False, True])
def test_each_loss_is_finite_and_reaches_only_its_own_group(gated):
    torch.manual_seed(0)
    model = STTForCausalLM(tiny_config(gated_second_pass=gated, beta_warmup_steps=10))
    ids = torch.randint(0, VOCAB, (2, 16))
    out = model.forward_train(ids, step=3)
    assert all(torch.isfinite(v) for v in out.losses.values())
    expected = {
        "lm": {"base_model", "stt_predictive_router"} if gated else {"base_model"},
        "tpn": {"stt_transition_network"},
        "causal": {"stt_causal_router"},
        "g_reg": {"stt_predictive_router"},
    }
    for name, groups in expected.items():
        reached = grads_by_group(model, out.losses[name])
        assert {g for g, hit in reached.items() if hit} == groups, name
    weights = model.config
    total = (
        out.losses["lm"]
        + weights.tpn_loss_weight * out.losses["tpn"]
        + weights.causal_loss_weight * out.losses["causal"]
        + weights.g_reg_loss_weight * out.losses["g_reg"]
    )
    torch.testing.assert_close(out.loss, total)


def test_parameter_groups_cover_every_parameter_once_with_their_own_rates():
    model = STTForCausalLM(tiny_config(tie_word_embeddings=True))
    groups = model.parameter_groups(lr_scale=2.0, weight_decay=0.1)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    rates = {g["name"]: g["lr"] for g in groups}
    config = model.config
    assert rates == {
        "base_model": 2 * config.lr_base,
        "stt_transition_network": 2 * config.lr_transition_network,
        "stt_predictive_router": 2 * config.lr_predictive_router,
        "stt_causal_router": 2 * config.lr_causal_router,
    }
    assert all(g["weight_decay"] == 0.0 for g in groups if any(p.ndim < 2 for p in g["params"]))


def test_lm_loss_respects_the_loss_mask():
    model = routed_model()
    ids = torch.randint(0, VOCAB, (1, 10))
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 6:] = True
    out = model.forward_train(ids, mask)
    want = F.cross_entropy(out.logits[0, 5:9], ids[0, 6:])
    torch.testing.assert_close(out.losses["lm"], want)


def test_stats_describe_each_stt_layer():
    model = routed_model()
    out = model.forward_train(torch.randint(0, VOCAB, (2, 12)), step=0)
    for name, values in out.stats.items():
        assert values.shape == (len(model.stt_layer_indices),), name
        assert torch.isfinite(values).all(), name
    assert ((out.stats["f1"] >= 0) & (out.stats["f1"] <= 1)).all()


# -------------------------------------------------------------------------------------------- teacher maths
def test_gate_matches_the_spec_formula_in_raw_units():
    config = tiny_config(normalize_surprise=False, ma_window=3)
    model = STTForCausalLM(config)
    router = model.model.layers[1].predictive_router
    d_st = torch.rand(2, 7)
    d_ch = torch.rand(2, 7)
    ma = torch.stack([torch.stack([d_st[b, max(0, t - 2) : t + 1].mean() for t in range(7)]) for b in range(2)])
    ce = d_st - (d_ch - math.log(F.softplus(torch.tensor(config.o_ce_init))))
    cu = d_st - F.softplus(torch.tensor(config.m_cu_init)) * ma
    a, b = torch.sigmoid(2.0 * ce), torch.sigmoid(3.0 * cu)
    torch.testing.assert_close(router.gate(d_st, d_ch, 2.0, 3.0), a + b - a * b)


def test_normalised_gate_is_invariant_to_the_residual_scale():
    router = STTForCausalLM(tiny_config()).model.layers[1].predictive_router
    d_st, d_ch = torch.rand(2, 9), torch.rand(2, 9)
    torch.testing.assert_close(router.gate(d_st, d_ch, 5.0, 5.0), router.gate(1e4 * d_st, 1e4 * d_ch, 5.0, 5.0))


def test_causal_moving_average_matches_brute_force():
    values = torch.rand(3, 11)
    got = causal_moving_average(values, 4)
    for t in range(11):
        torch.testing.assert_close(got[:, t], values[:, max(0, t - 3) : t + 1].mean(-1))


def test_top_k_targets_pick_the_largest_gates_of_each_row():
    config = tiny_config(use_g_threshold_selection=False, capacity=0.25)
    g = torch.rand(3, 16)
    targets = select_targets(g, config)
    assert targets.sum(1).tolist() == [4, 4, 4]
    for row in range(3):
        assert g[row][targets[row]].min() >= g[row][~targets[row]].max()
    threshold = select_targets(g, tiny_config(g_threshold=0.6))
    assert torch.equal(threshold, g >= 0.6)


def test_gate_regulariser_is_the_spec_mean_or_a_band_around_the_target():
    g = torch.tensor([[0.9, 0.2, 0.95, 0.1]])
    assert gate_regulariser(g, tiny_config(g_reg_target=None)) == pytest.approx(g.mean().item())
    band = tiny_config(g_reg_target=0.5)
    assert gate_regulariser(g, band) < 1e-3  # half the gates clear g_threshold = 0.75
    assert gate_regulariser(torch.full((1, 4), 0.99), band) > 0.2


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_beta_schedule_anneals_monotonically_from_start_to_end(kind):
    values = [schedule_value(0.1, 100.0, s, 50, kind) for s in range(0, 60, 5)]
    assert values[0] == pytest.approx(0.1) and values[-1] == pytest.approx(100.0)
    assert values == sorted(values)
    config = tiny_config(beta_schedule="constant")
    assert betas_at(config, 0) == (config.beta_ce_end, config.beta_cu_end)


# ------------------------------------------------------------------------------------------------- evaluation
def test_eval_modes_agree_with_the_cached_inference_path():
    model = routed_model()
    ids = torch.randint(0, VOCAB, (2, 14))
    cache = model.new_cache(2, 32)
    student = model.extend(ids, torch.tensor([14, 14]), cache, all_logits=True)
    evaluated = model.forward_eval(ids, "student")
    assert torch.equal(evaluated.selected, student.selected)
    torch.testing.assert_close(evaluated.router_probs, student.router_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(evaluated.logits, student.logits, atol=1e-5, rtol=1e-5)
    off = model.forward_eval(ids, "off")
    cache = model.new_cache(2, 32)
    dense = model.extend(ids, torch.tensor([14, 14]), cache, routing="off", all_logits=True)
    torch.testing.assert_close(off.logits, dense.logits, atol=1e-5, rtol=1e-5)
    teacher = model.forward_eval(ids, "teacher")
    assert torch.equal(teacher.selected, teacher.teacher_targets)
    assert model.forward_eval(ids).selected.shape == teacher.selected.shape  # config default: student


def test_teacher_routed_eval_is_causal_given_its_selection():
    """With top-k targets fixed by the prefix, changing later tokens must not change earlier logits."""
    model = routed_model(use_g_threshold_selection=True)
    ids = torch.randint(0, VOCAB, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % VOCAB
    a, b = model.forward_eval(ids, "teacher"), model.forward_eval(changed, "teacher")
    assert torch.equal(a.selected[..., :8], b.selected[..., :8])
    torch.testing.assert_close(a.logits[:, :8], b.logits[:, :8])


# ------------------------------------------------------------------------------------------- a short training run
def markov_batch(successor: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Each token is followed by its fixed successor, except for random jumps (25%): the surprises."""
    vocab = successor.shape[0]
    ids = torch.empty(batch, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
    for t in range(1, length):
        jump = torch.rand(batch, generator=generator) < 0.25
        ids[:, t] = torch.where(jump, torch.randint(0, vocab, (batch,), generator=generator), successor[ids[:, t - 1]])
    return ids


def test_short_training_run_learns_the_task_and_the_router():
    torch.manual_seed(0)
    vocab = 64
    successor = torch.randperm(vocab)
    # From scratch the base model needs a larger rate than the fine-tuning default; the routers get rates that
    # converge in a few dozen steps, and β anneals within the run.
    config = tiny_config(
        vocab_size=vocab, lr_base=3e-3, lr_predictive_router=5e-2, lr_causal_router=1e-2, beta_warmup_steps=20
    )
    model = STTForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameter_groups(), betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(1)
    held_out = markov_batch(successor, 16, 32, torch.Generator().manual_seed(9))
    with torch.no_grad():
        before = model.forward_train(held_out).losses["lm"].item()
    for step in range(40):
        out = model.forward_train(markov_batch(successor, 8, 32, generator), step=step)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    with torch.no_grad():
        after = model.forward_train(held_out)
    assert after.losses["lm"].item() < before - 1.5  # ln 64 ≈ 4.16 at the start
    rate = after.stats["teacher_fraction"]
    assert ((rate > 0.1) & (rate < 0.9)).all(), rate  # the teacher neither collapsed nor selects everything
    majority = torch.maximum(rate, 1 - rate)
    always_select_f1 = 2 * rate / (1 + rate)
    first = 0  # the first STT layer sees token identities directly: its routing must be learnt by now
    assert after.stats["accuracy"][first] > majority[first] + 0.1, after.stats
    assert after.stats["f1"][first] > always_select_f1[first] + 0.05, after.stats
    assert after.losses["causal"].item() < math.log(2)
