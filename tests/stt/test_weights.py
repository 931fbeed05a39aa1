"""Weight formats (chatapp.stt.weights): int8 weight-only projections, bfloat16, and choosing a format at load.

Tolerances on a tiny random model with spread-out logits (init std 0.05): bfloat16 and int8 logits stay within
0.15 x the float32 logits' standard deviation (largest difference over the vocabulary, the prefill and every decode
step; measured 0.03 for bfloat16, 0.08 for int8) and within 5% in norm per step (measured 0.8%, 2.3%), and greedy
decoding from a short prompt picks the same tokens as float32. (With student routing a router probability next to
the threshold can flip in reduced precision and change which tokens a layer runs; this seed has none.)
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from chatapp.errors import ChatappError
from chatapp.stt.weights import (
    DEQUANT_ROWS,
    INT4_DEQUANT_ROWS,
    INT4_GROUP,
    Int4Linear,
    Int8Linear,
    LowRankLinear,
    add_kv_projections,
    fuse_projections,
    parse_format,
    prepare_weights,
    quantize_int4,
    quantize_int8,
    weight_format,
)

from .conftest import routed_model

LOGIT_TOLERANCE = 0.15  # largest |logit - float32 logit|, x the float32 logits' standard deviation
NORM_TOLERANCE = 0.05  # |logits - float32 logits| / |float32 logits|, per step


def spread_model(seed: int = 3, **overrides):
    return routed_model(seed=seed, initializer_range=0.05, **overrides)


def test_parse_format_accepts_names_and_aliases() -> None:
    assert parse_format(None) is None and parse_format("auto") is None
    assert parse_format("fp32") == "float32" and parse_format("BF16") == "bfloat16" and parse_format("int8") == "int8"
    assert parse_format("q4") == "int4" and parse_format(" INT4 ") == "int4"
    with pytest.raises(ChatappError, match="unknown weight format 'fp8'"):
        parse_format("fp8")


def test_quantize_int8_rounds_to_nearest_per_channel() -> None:
    torch.manual_seed(0)
    weight = torch.randn(16, 32) * torch.logspace(-2, 1, 16)[:, None]  # channels of very different scales
    q, scales = quantize_int8(weight, torch.float32)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scales.shape == (16,)
    error = (weight - q.float() * scales[:, None]).abs()
    assert (error <= scales[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 5, DEQUANT_ROWS + 1])
def test_int8_linear_equals_its_dequantized_weight(rows: int) -> None:
    """Both paths (the weight-only kernel for decode, a dequantized product for prefill) compute x @ (q * s).T + b."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    int8 = Int8Linear.from_linear(linear)
    x = torch.randn(rows, 64).bfloat16()
    expected = F.linear(x.float(), int8.weight.float(), int8.bias.float())
    torch.testing.assert_close(int8(x).float(), expected, rtol=0.02, atol=0.02)
    assert int8(x[None]).shape == (1, rows, 48)


def test_quantize_int4_rounds_each_group_to_its_nearest_level() -> None:
    torch.manual_seed(0)
    weight = torch.randn(8, 4 * INT4_GROUP) * torch.logspace(-2, 1, 4 * INT4_GROUP)  # groups of different ranges
    q, scales_and_zeros = quantize_int4(weight, INT4_GROUP, torch.float32)
    assert q.min() >= 0 and q.max() <= 15 and scales_and_zeros.shape == (4, 8, 2)
    scales = scales_and_zeros[..., 0].t().repeat_interleave(INT4_GROUP, dim=1)
    zeros = scales_and_zeros[..., 1].t().repeat_interleave(INT4_GROUP, dim=1)
    error = (weight - ((q - 8) * scales + zeros)).abs()
    assert (error <= scales / 2 + 1e-5).all()


@pytest.mark.parametrize("rows", [1, 5, 80, INT4_DEQUANT_ROWS + 1])
def test_int4_linear_equals_its_dequantized_weight(rows: int) -> None:
    """Both paths (the kernel for decode, a dequantized product for prefill) compute x @ W.T + b for the same W."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    int4 = Int4Linear.from_linear(linear)
    q, scales_and_zeros = quantize_int4(linear.weight, INT4_GROUP, torch.bfloat16)
    dequantized = (q.float() - 8).view(48, 2, INT4_GROUP) * scales_and_zeros[..., 0].t().float()[..., None]
    dequantized = (dequantized + scales_and_zeros[..., 1].t().float()[..., None]).view(48, 64)
    torch.testing.assert_close(int4.weight, dequantized, rtol=0, atol=0)
    # The kernel's own weight, read back through an identity input, is that W too.
    eye = torch.eye(64, dtype=torch.bfloat16)
    kernel_weight = torch._weight_int4pack_mm_for_cpu(eye, int4.weight_int4, INT4_GROUP, int4.scales_and_zeros).t()
    torch.testing.assert_close(kernel_weight.float(), dequantized.bfloat16().float(), rtol=0, atol=0)
    x = torch.randn(rows, 64).bfloat16()
    expected = F.linear(x.float(), dequantized, int4.bias.float())
    torch.testing.assert_close(int4(x).float(), expected, rtol=0.02, atol=0.03)
    assert int4(x[None]).shape == (1, rows, 48)


def test_int4_keeps_shapes_its_kernel_cannot_take_dense() -> None:
    assert Int4Linear.fits(torch.nn.Linear(64, 48)) and not Int4Linear.fits(torch.nn.Linear(40, 48))
    assert not Int4Linear.fits(torch.nn.Linear(64, 40))
    model = prepare_weights(routed_model(seed=1, hidden_size=48, intermediate_size=96), "int4")
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.gate_up_proj, torch.nn.Linear) and isinstance(mlp.down_proj, Int4Linear)  # 48 in; 96 in


@torch.no_grad()
def greedy(model, prompt: list[int], steps: int, routing: str):
    cache = model.new_cache(1, 64)
    out = model.extend(torch.tensor([prompt]), torch.tensor([len(prompt)]), cache, routing=routing)
    logits, tokens = [out.logits[0].float()], []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits.append(model.decode(torch.tensor([tokens[-1]]), cache, routing=routing).logits[0].float())
    return torch.stack(logits), tokens


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
@pytest.mark.parametrize("routing", ["off", "student"])
def test_lossy_formats_stay_close_to_float32(fmt: str, routing: str) -> None:
    reference = spread_model()
    converted = prepare_weights(spread_model(), fmt)
    assert weight_format(converted) == fmt and converted.dtype == torch.bfloat16
    assert converted.new_cache(1, 4).keys[0].dtype == torch.float32  # on a CPU attention runs in float32
    prompt = [5, 17, 42, 9, 111, 7, 250, 3]
    want, want_tokens = greedy(reference, prompt, 8, routing)
    got, got_tokens = greedy(converted, prompt, 8, routing)
    assert (got - want).abs().max().item() <= LOGIT_TOLERANCE * want.std().item()
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item() <= NORM_TOLERANCE
    assert got_tokens == want_tokens


@pytest.mark.parametrize("routing", ["off", "student"])
def test_int4_model_computes_its_dequantized_weights(routing: str) -> None:
    """int4's rounding is too coarse for a random model's logits to stay near float32's (16 levels a group, on
    weights with no structure; the real model's guard is in benchmarks/cpu_decode.py). What it must do is compute
    exactly the model of its dequantized weights, in bfloat16: that checks the kernel, the packing and the plumbing.
    """
    converted = prepare_weights(spread_model(vocab_size=320), "int4")
    reference = spread_model(vocab_size=320)
    fuse_projections(reference)  # the same module names as the converted model
    add_kv_projections(reference)
    with torch.no_grad():
        for name, module in converted.named_modules():
            if isinstance(module, Int4Linear | Int8Linear):  # the head is int8 under int4
                reference.get_submodule(name).weight.copy_(module.weight.float())
    prompt = [5, 17, 42, 9, 111, 7, 250, 3]
    want, want_tokens, want_probs = routed_greedy(reference, prompt, 8, routing)
    got, got_tokens, got_probs = routed_greedy(converted, prompt, 8, routing)
    # bfloat16 activations move a router's probability a little (by up to ~0.03 on this random model, whose spread
    # routers are far more sensitive than trained ones); a token whose router is close to the cutoff may then go
    # the other way, and from there on the two models compute different things. Up to such a flip (there may be
    # none) the logits must agree.
    cutoff = converted.config.router_threshold
    flips = [i for i, (a, b) in enumerate(zip(want_probs, got_probs, strict=True)) if not torch.equal(a >= cutoff, b >= cutoff)]
    agree = flips[0] if flips else len(want_tokens) + 1
    assert routing == "student" or agree == len(want_tokens) + 1
    # Likewise a greedy near-tie: the models may pick different tokens where float32's top two are that close.
    ties = [i for i, (a, b) in enumerate(zip(want_tokens, got_tokens, strict=True)) if a != b]
    if ties and ties[0] < agree:
        step = ties[0]
        assert want[step][want_tokens[step]] - want[step][got_tokens[step]] <= LOGIT_TOLERANCE * want.std()
        agree = step + 1
    assert agree >= 2, "the prefill and the first decode step already differ"
    assert (got[:agree] - want[:agree]).abs().max().item() <= LOGIT_TOLERANCE * want.std().item()
    assert got_tokens[: agree - 1] == want_tokens[: agree - 1]


@torch.no_grad()
def routed_greedy(model, prompt: list[int], steps: int, routing: str):
    """`greedy`, and each call's router probabilities (the prefill's, then one per decode step)."""
    cache = model.new_cache(1, 64)
    out = model.extend(torch.tensor([prompt]), torch.tensor([len(prompt)]), cache, routing=routing)
    logits, tokens, probs = [out.logits[0].float()], [], [out.router_probs]
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        out = model.decode(torch.tensor([tokens[-1]]), cache, routing=routing)
        logits.append(out.logits[0].float())
        probs.append(out.router_probs)
    return torch.stack(logits), tokens, probs


def test_int8_replaces_every_projection_and_the_tied_head() -> None:
    model = prepare_weights(spread_model(), "int8")
    projections = [m for m in model.modules() if isinstance(m, Int8Linear)]
    # qkv, o, gate_up, down; each STT layer's k/v alone (`add_kv_projections`); the head
    assert len(projections) == 4 * model.config.num_hidden_layers + len(model.stt_layer_indices) + 1
    assert isinstance(model.lm_head, Int8Linear)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    router = model.model.layers[model.stt_layer_indices[0]].causal_router
    assert isinstance(router.up, torch.nn.Linear) and router.up.weight.dtype == torch.float32  # routers stay float32


def test_int4_replaces_every_projection_and_keeps_the_head_int8() -> None:
    model = prepare_weights(spread_model(), "int4")
    expected = 4 * model.config.num_hidden_layers + len(model.stt_layer_indices)  # with the STT layers' k/v alone
    assert len([m for m in model.modules() if isinstance(m, Int4Linear)]) == expected
    assert isinstance(model.lm_head, Int8Linear)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4 with adapters"])
@pytest.mark.parametrize("rows", [1, 3, INT4_DEQUANT_ROWS + 1])
def test_kv_projection_computes_the_fused_projections_k_and_v(fmt: str, rows: int) -> None:
    """An STT layer's k/v-only copy holds the fused q/k/v's own levels, scales and adapter: its outputs are the fused
    product's k/v columns (to the last bit at decode sizes, where the kernel computes each output on its own)."""
    reference = spread_model()
    adapters = merge_random_adapters(reference) if fmt.endswith("adapters") else None
    model = prepare_weights(reference, fmt.split()[0], adapters)
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert (attn.kv_proj is not None) == (index in model.stt_layer_indices)
        if attn.kv_proj is None:
            continue
        assert isinstance(attn.kv_proj, type(attn.qkv_proj))
        x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(index)).bfloat16()
        want = attn.qkv_proj(x)[:, attn.num_heads * attn.head_dim :]
        if rows <= INT4_DEQUANT_ROWS:
            assert torch.equal(attn.kv_proj(x), want)
        else:
            torch.testing.assert_close(attn.kv_proj(x), want, rtol=0.01, atol=0.01)


def on_int4_grid(model) -> None:
    """Round every projection onto the int4 grid, as a model read from a Q4_1 GGUF is."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and Int4Linear.fits(module):
                module.weight.copy_(Int4Linear.from_linear(module).weight.float())


def merge_random_adapters(model, rank: int = 16, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Merge a random low-rank update into every projection of every layer (as preparing the default model merges
    its LoRA); returns the adapters as `stt.io.load_merged_adapters` gives them."""
    generator = torch.Generator().manual_seed(seed)
    adapters = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear) and "_router" not in name:
                # A small update next to the weights (std 0.05), as a trained LoRA's is: ~8% of their scale.
                a = torch.randn(rank, module.in_features, generator=generator) * 0.05
                b = torch.randn(module.out_features, rank, generator=generator) * 0.02
                module.weight += b @ a
                adapters[name] = (a, b)
    return adapters


def test_int4_runs_merged_adapters_apart_and_recovers_the_base_grid() -> None:
    """A base on the int4 grid with adapters merged in (the default model: a Q4_1 GGUF plus LoRA): int4 with the
    adapters apart computes the float32 merged model within bfloat16's tolerance (measured: 2% in norm, bfloat16
    itself 1%), while quantizing the merged weights again moves them 30 times further (measured 63%).
    Routing off: with these random adapters a router probability sits next to the threshold and flips under any
    reduced precision, bfloat16's included."""
    routing = "off"
    reference = spread_model()
    on_int4_grid(reference)
    adapters = merge_random_adapters(reference)
    split, merged = spread_model(), spread_model()
    split.load_state_dict(reference.state_dict())
    merged.load_state_dict(reference.state_dict())
    prepare_weights(split, "int4", adapters)
    prepare_weights(merged, "int4")
    wrapped = [m for m in split.modules() if isinstance(m, LowRankLinear)]
    assert len(wrapped) == 4 * split.config.num_hidden_layers + len(split.stt_layer_indices)  # with k/v alone
    assert all(m.lora_B_t.dtype == torch.float32 and isinstance(m.base, Int4Linear) for m in wrapped)
    prompt = [5, 17, 42, 9, 111, 7, 250, 3]
    want, want_tokens = greedy(reference, prompt, 8, routing)
    got, got_tokens = greedy(split, prompt, 8, routing)
    requantized, _ = greedy(merged, prompt, 8, routing)
    split_error = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    requantized_error = ((requantized - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert split_error <= NORM_TOLERANCE and got_tokens == want_tokens
    assert requantized_error > 3 * split_error


@pytest.mark.parametrize("rows", [1, 7, INT4_DEQUANT_ROWS + 1, 300])
def test_low_rank_linear_computes_base_plus_adapter_at_every_size(rows: int) -> None:
    """Decode sizes run the 4-bit kernel with the adapter's B product beside it; prefill sizes merge the adapter
    into the dequantized weight. Both compute x @ (W_base + B A).T + b within bfloat16's rounding."""
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 64) * 0.1, torch.randn(48) * 0.1
    a, b = torch.randn(16, 64) * 0.05, torch.randn(48, 16) * 0.02
    layer = LowRankLinear(weight, bias, a, b)
    x = torch.randn(rows, 64).bfloat16()
    both = layer.base.weight
    a_level = both[48:]  # A as the kernel holds it: on the 4-bit grid, like the base
    expected = F.linear(x.float(), both[:48] + b @ a_level, bias.bfloat16().float())
    torch.testing.assert_close(layer(x).float(), expected, rtol=0.02, atol=0.03)
    torch.testing.assert_close(layer.weight, both[:48] + b @ a_level)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="torch.compile needs g++")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_compiled_decode_of_quantized_formats_matches_eager(fmt: str) -> None:
    """Inductor fuses the compiled step's ops in its own order, in bfloat16 activations: the same greedy tokens as
    eager and logits within bfloat16's rounding, with adapters run apart under int4 (`LowRankLinear`)."""
    from chatapp.stt.decode import compile_decode

    reference = spread_model()
    adapters = merge_random_adapters(reference)
    eager, compiled = spread_model(), spread_model()
    for model in (eager, compiled):
        model.load_state_dict(reference.state_dict())
        prepare_weights(model, fmt, adapters)
    compile_decode(compiled)
    prompt = [5, 17, 42, 9, 111, 7, 250, 3]
    want, want_tokens = greedy(eager, prompt, 8, "off")
    got, got_tokens = greedy(compiled, prompt, 8, "off")
    assert got_tokens == want_tokens
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item() <= 0.02


def test_fused_projections_compute_the_same_model() -> None:
    """q/k/v and gate/up fused (as the quantized formats load them) give float32's logits to rounding."""
    reference, fused = spread_model(), spread_model()
    fuse_projections(fused)
    assert fused.model.layers[0].self_attn.qkv_proj is not None and not hasattr(fused.model.layers[0].mlp, "up_proj")
    prompt = [5, 17, 42, 9, 111, 7, 250, 3]
    for routing in ("off", "student"):
        want, want_tokens = greedy(reference, prompt, 8, routing)
        got, got_tokens = greedy(fused, prompt, 8, routing)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got_tokens == want_tokens


def test_default_format_by_size() -> None:
    from chatapp.stt.weights import default_format

    cpu = torch.device("cpu")
    assert default_format(cpu, 3_350_000) == "float32"
    # A large model on a CPU: int8, whose decode step is one native call (`stt.cpu_step`).
    assert default_format(cpu, 135_000_000) == "int8"
    assert default_format(torch.device("cuda"), 135_000_000) == "float32"


def test_routers_and_adapters_keep_their_float32_values() -> None:
    """Kept float32 means never rounded: the routers decide as trained, under every reduced format."""
    reference = spread_model()
    adapters = merge_random_adapters(reference)
    model = spread_model()
    model.load_state_dict(reference.state_dict())
    prepare_weights(model, "int4", adapters)
    index = model.stt_layer_indices[0]
    torch.testing.assert_close(
        model.model.layers[index].causal_router.up.weight, reference.model.layers[index].causal_router.up.weight,
        rtol=0, atol=0,
    )
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, LowRankLinear) and qkv.lora_B_t.dtype == torch.float32
    assert torch.equal(qkv.lora_B_t[:16, :64], adapters["model.layers.0.self_attn.q_proj"][1].t()[:, :64])
