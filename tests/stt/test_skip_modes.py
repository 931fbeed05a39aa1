"""Skip modes (`STTConfig.skip_mode`) against a dense reference written in plain torch over the full sequence.

"strict": a skipped token passes through unchanged and is no key for that layer. "kv": it passes through unchanged
but its K and V, projected from its unchanged input, are keys for later tokens. "predict": as "kv", and the skipped
token carries on with the layer's predicted update f(norm(x)). Each path (extend, decode, the
full-sequence evaluation pass, the teacher's gated second pass) must mean the same thing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chatapp.stt import STTConfig, STTForCausalLM
from chatapp.stt.layers import STTLayer

from .conftest import VOCAB, routed_model, tiny_config

MODES = ["strict", "kv", "predict"]


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def model_in(mode: str, seed: int = 0, **overrides) -> STTForCausalLM:
    """A routed random model in skip `mode` ("predict": with random, non-zero predictors, see `random_init`)."""
    return routed_model(seed=seed, skip_mode=mode, **overrides)


class FixedRouter(nn.Module):
    """A causal router that selects by a fixed (B, T) mask, walking along it as calls come: a (B, S, D) call takes
    the next S columns, a (B, D) decode call the next one (rows must advance together)."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask, self.t = mask, 0

    def forward(self, current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        width = 1 if current.dim() == 2 else current.shape[1]
        picked = self.mask[:, self.t : self.t + width].float()
        self.t += width
        logits = picked * 40 - 20
        return logits[:, 0] if current.dim() == 2 else logits


def fix_routing(model: STTForCausalLM, masks: dict[int, torch.Tensor]) -> None:
    for index, mask in masks.items():
        model.model.layers[index].causal_router = FixedRouter(mask)


def random_masks(model: STTForCausalLM, batch: int, length: int, seed: int = 0) -> dict[int, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {i: torch.rand(batch, length, generator=generator) < 0.5 for i in model.stt_layer_indices}


# ------------------------------------------------------------------------------------------- the dense reference
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x (B, T, H, D) rotated at `positions` (T,), the half-split convention of Qwen2."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv[None, :]
    cos = torch.cat((angles.cos(), angles.cos()), -1)[None, :, None]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[None, :, None]
    rotated = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1)
    return x * cos + rotated * sin


def reference_logits(model: STTForCausalLM, ids: torch.Tensor, masks: dict[int, torch.Tensor], mode: str):
    """Plain torch over the whole sequence: layer i runs for the tokens of masks[i] (every token in a dense layer);
    in "strict" mode only those tokens are its keys, in "kv" mode every token is."""
    config: STTConfig = model.config
    b, t = ids.shape
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_width
    eps = config.rms_norm_eps
    positions = torch.arange(t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    with torch.no_grad():
        x = model.model.embed_tokens.weight[ids]
        for index, layer in enumerate(model.model.layers):
            run = masks.get(index, torch.ones(b, t, dtype=torch.bool))
            attn = layer.self_attn
            h = rms(x, layer.input_layernorm.weight, eps)
            q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(b, t, heads, dim)
            k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(b, t, kv_heads, dim)
            v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(b, t, kv_heads, dim)
            q, k = rope(q, positions, config.rope_theta), rope(k, positions, config.rope_theta)
            k = k.repeat_interleave(heads // kv_heads, dim=2)
            v = v.repeat_interleave(heads // kv_heads, dim=2)
            keys = run if mode == "strict" else torch.ones_like(run)
            # A query sees causal keys of the layer; a query that does not run sees every earlier token (discarded).
            allowed = (causal[None] & keys[:, None, :]) | (causal[None] & ~run[:, :, None])
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / dim**0.5
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, t, heads * dim)
            h2 = x + F.linear(out, attn.o_proj.weight)
            mlp = layer.mlp
            m = rms(h2, layer.post_attention_layernorm.weight, eps)
            y = h2 + F.linear(F.silu(F.linear(m, mlp.gate_proj.weight)) * F.linear(m, mlp.up_proj.weight), mlp.down_proj.weight)
            skipped = x
            if mode == "predict" and index in masks:  # a skipped token's predicted update f(norm(x)) = up(down(h)) + b
                predictor = layer.skip_predictor
                skipped = x + F.linear(F.linear(h, predictor.down.weight), predictor.up.weight, predictor.up.bias)
            x = torch.where(run[..., None], y, skipped)
        return F.linear(rms(x, model.model.norm.weight, eps), model.lm_head.weight)


def prefill(model: STTForCausalLM, ids: torch.Tensor, lengths: list[int] | None = None, **kwargs):
    lengths_t = torch.tensor(lengths) if lengths is not None else torch.full((ids.shape[0],), ids.shape[1])
    cache = model.new_cache(ids.shape[0], 64)
    return model.extend(ids, lengths_t, cache, all_logits=True, **kwargs), cache


# ------------------------------------------------------------------------------------------------------- tests
def test_skip_mode_is_validated_and_strict_by_default():
    assert tiny_config().skip_mode == "strict"
    assert STTConfig.from_dict({k: v for k, v in tiny_config().to_dict().items() if k != "skip_mode"}).skip_mode == "strict"
    with pytest.raises(ValueError, match="skip_mode"):
        tiny_config(skip_mode="loose").validate_stt()
    with pytest.raises(TypeError, match="skip_mode"):
        tiny_config(skip_mode=1)


@pytest.mark.parametrize("mode", MODES)
def test_nothing_skipped_equals_routing_off(mode):
    model = model_in(mode)
    ids = random_ids(2, 12)
    off, off_cache = prefill(model, ids, routing="off")
    everything, cache = prefill(model, ids, threshold=0.0)
    assert everything.selected.all()
    torch.testing.assert_close(everything.logits, off.logits)
    assert torch.equal(cache.lengths, off_cache.lengths)
    for m in ("student", "teacher"):
        model.config.g_threshold = 0.0  # the teacher selects every token too
        torch.testing.assert_close(model.forward_eval(ids, m, threshold=0.0).logits, model.forward_eval(ids, "off").logits)
    # decode: routing off and a threshold of 0 take the same steps
    a, b = model.new_cache(2, 64), model.new_cache(2, 64)
    for t in range(ids.shape[1]):
        x = model.decode(ids[:, t], a, routing="off")
        y = model.decode(ids[:, t], b, threshold=0.0)
        torch.testing.assert_close(x.logits, y.logits)
    assert torch.equal(a.lengths, b.lengths)


@pytest.mark.parametrize("mode", MODES)
def test_fixed_selection_equals_the_masked_reference(mode):
    model = model_in(mode)
    ids = random_ids(3, 14, seed=2)
    masks = random_masks(model, 3, 14, seed=1)
    expected = reference_logits(model, ids, masks, mode)
    fix_routing(model, masks)
    out, cache = prefill(model, ids)
    for slot, index in enumerate(model.stt_layer_indices):
        assert torch.equal(out.selected[slot], masks[index])
        stored = cache.layer_lengths(index).tolist()
        assert stored == ([14] * 3 if mode != "strict" else masks[index].sum(1).tolist())
    torch.testing.assert_close(out.logits, expected, atol=1e-4, rtol=1e-4)
    fix_routing(model, masks)  # rewind the routers
    torch.testing.assert_close(model.forward_eval(ids, "student").logits, expected, atol=1e-4, rtol=1e-4)
    # the modes really differ ("predict" needs the predictors only its model has)
    for other_mode in ("strict", "kv"):
        if other_mode != mode:
            assert not torch.allclose(reference_logits(model, ids, masks, other_mode), expected, atol=1e-3)


@pytest.mark.parametrize("mode", MODES)
def test_fixed_selection_decoded_token_by_token_equals_the_reference(mode):
    model = model_in(mode)
    ids = random_ids(2, 12, seed=3)
    masks = random_masks(model, 2, 12, seed=4)
    expected = reference_logits(model, ids, masks, mode)
    fix_routing(model, masks)
    cache = model.new_cache(2, 64)
    first = model.extend(ids[:, :4], torch.full((2,), 4), cache, all_logits=True)
    logits = [first.logits] + [model.decode(ids[:, t], cache).logits[:, None] for t in range(4, 12)]
    torch.testing.assert_close(torch.cat(logits, 1), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_gated_second_pass_forward_equals_the_masked_reference(mode):
    """The teacher's routed second pass (hard gate in the forward pass) is the masked forward of its targets."""
    # Top-k targets: a random model's gate clears g_threshold everywhere, top-k always splits the tokens.
    model = model_in(mode, gated_second_pass=True, use_g_threshold_selection=False, capacity=0.5)
    ids = random_ids(2, 10, seed=5)
    out = model.forward_eval(ids, "teacher")
    masks = dict(zip(model.stt_layer_indices, out.teacher_targets, strict=True))
    assert 0 < out.teacher_targets.float().mean() < 1
    expected = reference_logits(model, ids, masks, mode)
    torch.testing.assert_close(out.logits, expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        trained = model.forward_train(ids)
    torch.testing.assert_close(trained.logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_decode_equals_prefill_on_a_ragged_batch(mode):
    """Prompts of different lengths, then decoded tokens one by one == one extend of each row's whole sequence."""
    model = model_in(mode, seed=1)
    prompts, steps = [3, 9, 1, 6], 10
    ids = random_ids(4, max(prompts) + steps, seed=6)
    rows = [torch.cat((ids[b, :n], ids[b, max(prompts) : max(prompts) + steps])) for b, n in enumerate(prompts)]
    full_ids = torch.zeros(4, max(prompts) + steps, dtype=torch.long)
    for b, row in enumerate(rows):
        full_ids[b, : len(row)] = row
    full, full_cache = prefill(model, full_ids, [n + steps for n in prompts])

    cache = model.new_cache(4, 64)
    model.extend(ids[:, : max(prompts)], torch.tensor(prompts), cache)
    for t in range(steps):
        step = model.decode(ids[:, max(prompts) + t], cache)
        for b, n in enumerate(prompts):
            torch.testing.assert_close(step.logits[b], full.logits[b, n + t], atol=1e-4, rtol=1e-4)
            assert torch.equal(step.selected[:, b, 0], full.selected[:, b, n + t])
    assert 0 < full.selected.float().mean() < 1
    assert torch.equal(cache.lengths, full_cache.lengths)
    for index in model.stt_layer_indices:
        if mode != "strict":  # an STT layer's cache advances with every token, like a dense layer's
            assert torch.equal(cache.layer_lengths(index), cache.seen)


@pytest.mark.parametrize("mode", MODES)
def test_kv_mode_stores_dense_keys_for_every_token(mode):
    """In "kv" mode an STT layer's cache holds exactly what a dense layer would store: each token's K/V from its
    input. With routing off the inputs are the same, so compare the first STT layer's cache with routing off's."""
    model = model_in(mode)
    ids = random_ids(2, 11, seed=7)
    _, routed = prefill(model, ids)
    _, dense = prefill(model, ids, routing="off")
    first = model.stt_layer_indices[0]
    if mode != "strict":
        torch.testing.assert_close(routed.keys[first][:, :11], dense.keys[first][:, :11])
        torch.testing.assert_close(routed.values[first][:, :11], dense.values[first][:, :11])
        assert torch.equal(routed.positions[first, :, :11], dense.positions[first, :, :11])
    else:
        assert (routed.layer_lengths(first) < 11).any()


def test_training_step_runs_in_kv_mode():
    model = model_in("kv", gated_second_pass=True).train()
    out = model.forward_train(random_ids(2, 10, seed=8))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    layer = model.model.layers[model.stt_layer_indices[0]]
    assert isinstance(layer, STTLayer)
    assert layer.predictive_router.o_ce.grad is not None
