"""Building blocks of the STT model: a Qwen2 decoder block with its own attention, the transition network (TPN),
the teacher's predictive router, the student's causal router and the STT layer that holds them.

This module is the one home of the STT maths every path uses (`extend`, the decode step, the teacher's training
pass, evaluation): the block (`run_block`, with its attention in two forms: over a sequence through a `KVSink`,
and over one token per row of the cache in `block_step`), the K/V a skipped token stores in "kv" skip mode
(`Attention.project_kv`, `kv_step`), the causal router's probability (`router_probs`), the selection rule
(`select`) and the keys a routed layer's queries may see (`routed_attention_mask`).

Module and parameter names mirror `transformers`' Qwen2 (`self_attn.q_proj`, `mlp.gate_proj`,
`input_layernorm`, ...) so a Qwen2 state dict loads unchanged. The norm, MLP and rotary maths are transformers'
(`stt.qwen2`); attention is written here because it runs over chatapp's per-layer sparse KV cache, where which keys a query
may see depends on stored absolute positions rather than on slot order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from chatapp.stt.cache import attention_inputs
from chatapp.stt.config import STTConfig
from chatapp.stt.qwen2 import MLP, RMSNorm, apply_rotary_pos_emb, rotate_half

# Stores a block's new keys/values and returns what its queries attend to: (keys, values, mask). Keys and values
# are (B, Tk, H_kv, D); mask is a bool (B, S, Tk) "query may see key", or None for plain causal self-attention.
KVSink = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def self_attention_sink(mask: torch.Tensor | None = None) -> KVSink:
    """A sink for full-sequence passes without a cache: queries attend to the sequence's own keys."""

    def sink(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return k, v, mask

    return sink


def select(probs: torch.Tensor, cutoff: float) -> torch.Tensor:
    """The student's routing rule (§3.2 step 2, variable capacity): a token runs the block when its causal-router
    probability is at or above the layer's cutoff."""
    return probs >= cutoff


def router_probs(layer: STTLayer, current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """The causal router's probability of "process x_t" (float32, `current`'s shape less the last axis) from the
    layer's inputs x_t (`current`) and x_{t-1} (`previous`); 1 everywhere for a layer without a causal router."""
    if layer.causal_router is None:
        return torch.ones(current.shape[:-1], device=current.device)
    return torch.sigmoid(layer.causal_router(current, previous).float())


def routed_attention_mask(selected: torch.Tensor, skip_mode: str) -> torch.Tensor | None:
    """Which keys a routed STT layer's queries see over a full (B, T) sequence: in "strict" mode only the selected
    tokens are keys (`routed_causal_mask`); in "kv" and "predict" modes every token is (its K/V come from its
    unchanged input), which is plain causal attention (None)."""
    return routed_causal_mask(selected) if skip_mode == "strict" else None


def stores_skipped(skip_mode: str) -> bool:
    """Whether a token an STT layer skips stores its K/V there ("kv" and "predict"; not "strict")."""
    return skip_mode != "strict"


def skipped_output(
    layer: nn.Module, x: torch.Tensor, normed: torch.Tensor | None = None, predictor: nn.Module | None = None
) -> torch.Tensor:
    """What a token an STT layer skips carries on: its input `x`, plus the layer's predicted update f(norm(x)) when
    the layer has a `SkipPredictor` ("predict" mode). `normed`: `norm(x)` when the caller has it already (the
    skipped token's K/V were projected from it). `predictor`: one to use instead of the layer's own (a routing fit
    measures predictors before they belong to a layer)."""
    if predictor is None:
        predictor = getattr(layer, "skip_predictor", None)
    if predictor is None:
        return x
    if normed is None:
        normed = rms_norm(layer.input_layernorm, x)
    return x + predictor(normed).to(x.dtype)


def routed_causal_mask(key_selected: torch.Tensor) -> torch.Tensor:
    """Causal mask (B, T, T) over a full sequence in which only selected tokens are keys.

    This is what an STT layer's cache holds at inference: a selected query at t sees the selected tokens <= t
    (itself included). Unselected queries are computed and thrown away; they see every earlier token so their
    softmax never runs over an empty set (no NaN to leak into gradients).
    """
    t = key_selected.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=key_selected.device).tril()
    mask = causal & key_selected[:, None, :]
    return mask | (causal & ~key_selected[:, :, None])


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` in one fused op. In float32 it is bit-identical to transformers' module (which upcasts to float32
    anyway and multiplies the same factors); in bfloat16 the fused op also accumulates in float32 but rounds once,
    after the weight, where the module rounds before it too (a difference of one bfloat16 rounding)."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


class Attention(nn.Module):
    """Qwen2 grouped-query attention (biased q/k/v, unbiased o) that stores K/V through a `KVSink`."""

    def __init__(self, config: STTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_width
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        # Set by `stt.weights.fuse_projections` at load for quantized inference: q, k and v as one projection.
        self.qkv_proj: nn.Module | None = None
        # Set beside it for an STT layer (`stt.weights.add_kv_projections`): k and v alone, the same weights.
        self.kv_proj: nn.Module | None = None

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """q, k and v of `x` side by side on the last axis ((H + 2 H_kv) * D wide)."""
        if self.qkv_proj is not None:
            return self.qkv_proj(x)
        return torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)

    def project_kv_only(self, x: torch.Tensor) -> torch.Tensor:
        """k and v of `x` side by side on the last axis (2 H_kv * D wide), and no query: what a token skipped in "kv"
        mode computes. Under fused projections that is the layer's own k/v product (`kv_proj`) when it has one,
        else the fused product with its query part dropped (a shape the int4 kernel cannot take alone)."""
        if self.kv_proj is not None:
            return self.kv_proj(x)
        if self.qkv_proj is not None:
            return self.qkv_proj(x)[..., self.num_heads * self.head_dim :]
        return torch.cat((self.k_proj(x), self.v_proj(x)), dim=-1)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (rotary at their positions) and values (B, S, H_kv, D) of the normed inputs `x` (B, S, D), and no
        query (`project_kv_only`): what a token skipped in "kv" mode stores."""
        b, s, _ = x.shape
        width = self.num_kv_heads * self.head_dim
        k, v = self.project_kv_only(x).split((width, width), dim=-1)
        k, v = k.view(b, s, self.num_kv_heads, self.head_dim), v.view(b, s, self.num_kv_heads, self.head_dim)
        c, n = cos.unsqueeze(2), sin.unsqueeze(2)
        return k * c + rotate_half(k) * n, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sink: KVSink) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.project_qkv(x).view(b, s, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=2)
        # Rotary on (B, S, H, D) with cos/sin (B, S, D): unsqueeze at the head axis.
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        keys, values, mask = sink(k, v)
        # The cache may hold K/V in another dtype than the activations (float32, or float16 for the native step, on
        # a CPU: see `STTForCausalLM.kv_dtype`): attention runs in the dtype the cache is read in.
        keys, values = attention_inputs(keys, values)
        out = F.scaled_dot_product_attention(
            q.to(keys.dtype).transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=None if mask is None else mask[:, None],
            is_causal=mask is None,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim).to(x.dtype))


class FusedMLP(nn.Module):
    """Qwen2's SwiGLU MLP with the gate and up projections as one (`stt.weights.fuse_projections`)."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.intermediate_size = gate_up_proj, down_proj, intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderBlock(nn.Module):
    """A Qwen2 decoder layer: pre-norm attention and SwiGLU MLP, each with a residual connection."""

    def __init__(self, config: STTConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sink: KVSink) -> torch.Tensor:
        """The block's output for every token of `x` (B, S, D) (the TF-Block of the spec)."""
        return run_block(self, x, lambda y: self.self_attn(y, cos, sin, sink))

    def routed(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        selected: torch.Tensor,
        skip_mode: str,
        predictor: nn.Module | None = None,
    ) -> torch.Tensor:
        """A routed layer over a full (B, T) sequence without a cache: the block's output for the `selected`
        tokens, attending to the keys `skip_mode` leaves (`routed_attention_mask`); for the others what a skipped
        token carries on (`skipped_output`, with `predictor` instead of the layer's own when given)."""
        y = self.block(x, cos, sin, self_attention_sink(routed_attention_mask(selected, skip_mode)))
        return torch.where(selected[..., None], y, skipped_output(self, x, predictor=predictor))


def run_block(block, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The TF-Block's maths, the one copy every path runs: pre-norm attention then pre-norm SwiGLU MLP, each with a
    residual. `block` has the norms and the MLP (a `DecoderBlock` or the decode step's `BlockParts`); `attend` maps
    the normed input to the attention output, over a sequence's sink or over the cache's rows."""
    h = x + attend(rms_norm(block.input_layernorm, x))
    return h + block.mlp(rms_norm(block.post_attention_layernorm, h))


class TransitionNetwork(nn.Module):
    """TPN: predicts a token's block residual Δx_t from the previous token's block output x_{t-1} (pre-norm MLP).

    The output layer starts at zero, so the first prediction is "no change" and D_ch starts equal to D_st.
    """

    def __init__(self, config: STTConfig) -> None:
        super().__init__()
        width = config.transition_hidden_size or config.hidden_size
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.up = nn.Linear(config.hidden_size, width)
        self.down = nn.Linear(width, config.hidden_size)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, prev_output: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(self.norm(prev_output))))


def causal_moving_average(values: torch.Tensor, window: int) -> torch.Tensor:
    """Mean of `values[..., max(0, t-window+1) : t+1]` for every t, along the last axis (sequence)."""
    csum = values.cumsum(-1)
    shifted = F.pad(csum, (window, 0))[..., : values.shape[-1]]
    counts = torch.arange(1, values.shape[-1] + 1, device=values.device).clamp(max=window)
    return (csum - shifted) / counts


class PredictiveRouter(nn.Module):
    """The teacher (§3.1 steps 3–4): surprise metrics and the continuous gate g from a dense block pass.

    `o_ce` and `m_cu` are parameters when learnable, buffers otherwise; both enter through softplus so the
    criteria stay well defined whatever the optimiser does to them.

    With `normalize_surprise` (the default) both criteria are divided by the moving average of D_st, i.e.
    measured in units of the layer's typical residual. CU keeps its sign exactly (the spec's CU is MA times the
    normalised one); CE's bias log(softplus(o_ce)) then means the same thing in a 64-wide toy model, whose
    residuals are ~1e-3, and in a Qwen2.5 layer, whose residuals are ~1e2. Without it, β and the biases
    would have to be retuned for every model and layer, and a bias that dwarfs the surprises routes every token
    the same way with saturated (zero) gradients.
    """

    def __init__(self, config: STTConfig) -> None:
        super().__init__()
        self.ma_window = config.ma_window
        self.normalize = config.normalize_surprise
        for name, init, learn in (
            ("o_ce", config.o_ce_init, config.learn_o_ce),
            ("m_cu", config.m_cu_init, config.learn_m_cu),
        ):
            value = torch.tensor(float(init))
            if learn:
                self.register_parameter(name, nn.Parameter(value))
            else:
                self.register_buffer(name, value)

    def surprises(self, residual: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(D_st, D_ch), each (B, T): squared norms per dimension of the residual and of its prediction error."""
        d_st = residual.float().pow(2).mean(-1)
        d_ch = (residual.float() - predicted.float()).pow(2).mean(-1)
        return d_st, d_ch

    def gate(self, d_st: torch.Tensor, d_ch: torch.Tensor, beta_ce: float, beta_cu: float) -> torch.Tensor:
        """g in [0, 1] (B, T): the probabilistic OR of the expected-event (CE) and unexpected-event (CU) criteria."""
        ma = causal_moving_average(d_st, self.ma_window)
        scale = ma.clamp_min(torch.finfo(ma.dtype).tiny) if self.normalize else torch.ones_like(ma)
        ce = (d_st - d_ch) / scale + torch.log(F.softplus(self.o_ce))
        cu = (d_st - F.softplus(self.m_cu) * ma) / scale
        p_ce = torch.sigmoid(beta_ce * ce)
        p_cu = torch.sigmoid(beta_cu * cu)
        return p_ce + p_cu - p_ce * p_cu


class CausalRouter(nn.Module):
    """The student: a small MLP on [x_t || x_{t-1}] (the layer's inputs), giving the logit of "process x_t".

    Each input is RMS-normalised first: Qwen residual streams carry a few huge outlier dimensions, and an MLP on
    raw states is badly conditioned (one reason the public router sat at chance). The output bias starts at the
    logit of the target capacity, so an untrained router already predicts the right rate.
    """

    def __init__(self, config: STTConfig) -> None:
        super().__init__()
        d, width = config.hidden_size, config.causal_router_hidden_size
        self.norm_current = RMSNorm(d, eps=config.rms_norm_eps)
        self.norm_previous = RMSNorm(d, eps=config.rms_norm_eps)
        self.up = nn.Linear(2 * d, width)
        self.out = nn.Linear(width, 1)
        rate = min(max(config.capacity, 1e-3), 1 - 1e-3)
        nn.init.constant_(self.out.bias, math.log(rate / (1 - rate)))  # logit(rate)

    def forward(self, current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Logits (...) from current (..., D) and previous (..., D) layer inputs ((B, T, D) over a sequence, (B, D)
        in a decode step), in the router's own dtype (float32 under every weight format: see
        `chatapp.stt.weights.prepare_weights`)."""
        dtype = self.up.weight.dtype
        features = torch.cat(
            (rms_norm(self.norm_current, current.to(dtype)), rms_norm(self.norm_previous, previous.to(dtype))), dim=-1
        )
        return self.out(F.silu(self.up(features))).squeeze(-1)


class SkipPredictor(nn.Module):
    """f(norm(x)) ≈ Δx: the update a token an STT layer skips gets in "predict" mode, a rank-r linear map of the
    layer's normed input (`input_layernorm(x)`, which the skipped token's K/V projection computes anyway).

    Linear because it is fitted in closed form (reduced-rank ridge regression on cached dense passes,
    `chatapp.training.predictor`), low rank because a skipped token must stay cheap: at rank 64 on a 576-wide
    model it costs 2·64·576 multiply-adds, ~2% of the block it stands in for. It starts at zero, which is "kv"
    mode exactly."""

    def __init__(self, config: STTConfig) -> None:
        super().__init__()
        # Built with the global RNG's state put back after (what nn.Linear draws is zeroed below), so a model's other
        # weights are the same whether or not it has predictors; zero, the update starts as none. Not `skip_init`:
        # on the meta device (`STTForCausalLM.empty`, every load) its `to_empty` imported torch's symbolic-shapes
        # machinery, 0.35 s of each command's start.
        with torch.random.fork_rng(devices=[]):
            self.down = nn.Linear(config.hidden_size, config.predictor_rank, bias=False)
            self.up = nn.Linear(config.predictor_rank, config.hidden_size, bias=True)
        for tensor in (self.down.weight, self.up.weight, self.up.bias):
            nn.init.zeros_(tensor)

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        dtype = self.down.weight.dtype
        return self.up(self.down(normed.to(dtype)))


class STTLayer(DecoderBlock):
    """A decoder block whose execution is routed per token; owns the TPN, both routers (§2) and, in "predict" skip
    mode, the predictor of a skipped token's update."""

    def __init__(self, config: STTConfig) -> None:
        super().__init__(config)
        self.transition_network = TransitionNetwork(config)
        self.predictive_router = PredictiveRouter(config)
        self.causal_router = CausalRouter(config) if config.train_causal_router else None
        self.skip_predictor = SkipPredictor(config) if config.skip_mode == "predict" else None


# ------------------------------------------------------------------------------------------------------------------
# The decode step's form: one token per row of the cache, activations 2-D (B, D), in as few torch ops as possible
# (see `chatapp.stt.decode`, which schedules these over the layers and may compile them).


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` with the half swap done by one roll (same products)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def cache_attention(
    attn: Attention,
    x: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    span: int,
    subset: bool,
) -> torch.Tensor:
    """Self-attention of the (B', D) queries `x` of cache rows `rows`, storing their K/V at `slots` of the layer's
    cache `keys`/`values` (B, S, H_kv, Dh). `subset`: `rows` is not every cache row, so gather them."""
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    batch = x.shape[0]
    qkv = attn.project_qkv(x).view(batch, heads + 2 * kv_heads, head_dim)
    # Rotary runs once over Q and K side by side (B', H + H_kv, Dh), in the activations' dtype as `extend` does.
    qk = rotate(qkv[:, : heads + kv_heads], cos, sin)
    keys.index_put_((rows, slots), qk[:, heads:].to(keys.dtype))
    values.index_put_((rows, slots), qkv[:, heads + kv_heads :].to(values.dtype))
    if subset:
        keys, values = keys[rows], values[rows]
    keys, values = attention_inputs(keys[:, :span], values[:, :span])
    qk = qk.to(keys.dtype)
    if keys.dtype == torch.float32:
        out = F.scaled_dot_product_attention(
            qk[:, :heads, None],
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            enable_gqa=heads != kv_heads,
        )
    else:
        out = single_query_attention(qk[:, :heads], keys, values, mask, kv_heads)
    return attn.o_proj(out.reshape(batch, heads * head_dim).to(x.dtype))


def single_query_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, kv_heads: int
) -> torch.Tensor:
    """Grouped-query attention of one query per row in two matrix products, softmax in float32.

    For a reduced-precision cache (a CPU cache is float32, see `STTForCausalLM.kv_dtype`): torch's CPU flash
    attention runs a single bfloat16 query 4-20x slower than these three ops (measured at 128-1024 keys, batch
    1-32). `q` (B, H, D); `keys`/`values` (B, S, H_kv, D);
    `mask` (B, 1, 1, S), bool "may see" or additive. Returns (B, H, D).
    """
    batch, heads, head_dim = q.shape
    groups = heads // kv_heads
    q = (q * head_dim**-0.5).view(batch, kv_heads, groups, head_dim)
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1))  # (B, H_kv, G, S)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values.transpose(1, 2)).view(batch, heads, head_dim)


class BlockParts(NamedTuple):
    """A decoder block as the step functions take it. An STT layer's parts have the types of a dense layer's, so
    one compiled graph serves both kinds (a graph guards on the types of the modules it is given); `skip_predictor`
    is read only where the layer skipped its rows."""

    input_layernorm: nn.Module
    self_attn: Attention
    post_attention_layernorm: nn.Module
    mlp: nn.Module
    skip_predictor: nn.Module | None = None


def block_step(
    block: BlockParts,
    x: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    span: int,
    subset: bool,
) -> torch.Tensor:
    """A decoder block (attention and SwiGLU MLP, pre-norm, residuals) on (B', D) rows (see `cache_attention`).

    Tensors, modules and plain values only, no cache object or layer index: a compiled copy (`compile_decode`)
    then serves every layer with one graph."""
    return run_block(
        block, x, lambda y: cache_attention(block.self_attn, y, keys, values, rows, slots, mask, cos, sin, span, subset)
    )


def kv_step(
    block: BlockParts,
    x: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Store the K/V of tokens an STT layer skips in "kv" or "predict" mode: the (B', D) layer inputs `x` of cache
    rows `rows`, normed and projected (no query, no attention, no MLP), rotary at their positions, written at
    `slots`. Returns what the skipped tokens carry on (`skipped_output`)."""
    attn = block.self_attn
    normed = rms_norm(block.input_layernorm, x)
    kv = attn.project_kv_only(normed).view(x.shape[0], 2 * attn.num_kv_heads, attn.head_dim)
    k = rotate(kv[:, : attn.num_kv_heads], cos, sin)
    keys.index_put_((rows, slots), k.to(keys.dtype))
    values.index_put_((rows, slots), kv[:, attn.num_kv_heads :].to(values.dtype))
    return skipped_output(block, x, normed)
