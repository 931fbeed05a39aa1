"""The int8 decode step on a CPU as one call of numba code (`chatapp.stt.gemv.decode`).

`decode.decode_step` runs a step as ~25 torch calls of compiled or eager blocks with torch ops between them
(routers, step state, bookkeeping): at batch 1 on a 2-core CPU that bookkeeping and torch's int8 kernel were
most of a step. For a model whose projections and LM head are int8 (`stt.weights.Int8Linear`) on a CPU, the
loader attaches `kernel_step` instead (`attach`): the whole step, routing and cache bookkeeping included, is one
numba call over the model's own weight arrays, and every command decodes through it from its first token with
nothing to compile (README, "int8 decode in one numba call", has the rates).

The model's arrays are gathered once (`model_arrays`, cached on the model) and a cache's once
(`cache_arrays`, cached on the cache): numpy views of the same memory, int8 levels shared with the modules, the
small float vectors (scales, biases, norm weights, routers) as float32 copies. Calls the kernel does not take
(more rows than `gemv.MAX_ROWS`) go through the torch step.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np
import torch
from numba import typed

from chatapp.stt import gemv
from chatapp.stt.weights import Int8Linear

_EMPTY = np.zeros(0, dtype=np.float32)


def _f32(t: torch.Tensor | None) -> np.ndarray:
    return _EMPTY if t is None else t.detach().float().contiguous().numpy()


class ModelArrays(NamedTuple):
    """What `gemv.decode` reads of a model."""

    blocks: typed.List  # per layer, `block_arrays`
    routers: typed.List  # per STT layer, `router_arrays`
    stt_slot: np.ndarray  # (L,) int64: the layer's STT index, -1 for a dense layer
    heads: int
    kv_heads: int
    final_norm: np.ndarray
    final_eps: np.float32
    head_w: np.ndarray  # (V, D) int8
    head_s: np.ndarray  # (V,)


def block_arrays(layer) -> tuple | None:
    """A decoder layer's weights as `gemv.block` takes them; None when a projection is not int8."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    if not all(isinstance(p, Int8Linear) for p in projections):
        return None
    qkv, o, up, down = projections
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    return (
        _f32(norm1.weight), np.float32(norm1.variance_epsilon),
        qkv.weight_int8.numpy(), _f32(qkv.scales), _f32(qkv.bias),
        o.weight_int8.numpy(), _f32(o.scales),
        _f32(norm2.weight), np.float32(norm2.variance_epsilon),
        up.weight_int8.numpy(), _f32(up.scales),
        down.weight_int8.numpy(), _f32(down.scales),
    )  # fmt: skip


def router_arrays(layer) -> tuple | None:
    """An STT layer's causal router as `gemv.router` takes it (float32); None when it has none."""
    router = layer.causal_router
    if router is None:
        return None
    return (
        _f32(router.norm_current.weight), np.float32(router.norm_current.variance_epsilon),
        _f32(router.norm_previous.weight), np.float32(router.norm_previous.variance_epsilon),
        _f32(router.up.weight), _f32(router.up.bias), _f32(router.out.weight.reshape(-1)),
        np.float32(router.out.bias.item()),
    )  # fmt: skip


def model_arrays(model) -> ModelArrays | None:
    """`model`'s arrays for `gemv.decode`, gathered once and cached on it; None when the kernel cannot run it: not on
    a CPU, a cache that is not float32, a projection or the LM head not int8, an STT layer without a causal router,
    a fused q/k/v or gate/up missing."""
    cached = getattr(model, "_gemv_arrays", None)
    if cached is not None and cached[0] == id(model.lm_head):
        return cached[1]
    layers = model.model.layers
    if model.device.type != "cpu" or model.kv_dtype != torch.float32 or not isinstance(model.lm_head, Int8Linear):
        return None
    blocks = [block_arrays(layer) for layer in layers]
    stt = list(model.stt_layer_indices)
    routers = [router_arrays(layers[i]) for i in stt]
    if any(b is None for b in blocks) or any(r is None for r in routers):
        return None
    stt_slot = np.full(len(layers), -1, dtype=np.int64)
    stt_slot[stt] = np.arange(len(stt))
    if not routers:  # numba needs the list's type: a router that no layer reads
        routers = [router_arrays_placeholder(int(model.config.hidden_size))]
    attn, norm = layers[0].self_attn, model.model.norm
    arrays = ModelArrays(
        blocks=typed.List(blocks),
        routers=typed.List(routers),
        stt_slot=stt_slot,
        heads=attn.num_heads,
        kv_heads=attn.num_kv_heads,
        final_norm=_f32(norm.weight),
        final_eps=np.float32(norm.variance_epsilon),
        head_w=model.lm_head.weight_int8.numpy(),
        head_s=_f32(model.lm_head.scales),
    )
    model._gemv_arrays = (id(model.lm_head), arrays)
    return arrays


def router_arrays_placeholder(hidden: int) -> tuple:
    ones = np.ones(hidden, dtype=np.float32)
    one = np.float32(1e-6)
    return (ones, one, ones, one, np.zeros((1, 2 * hidden), np.float32), _EMPTY[:0] + 0, np.zeros(1, np.float32), one)


def cache_arrays(cache) -> tuple[typed.List, typed.List]:
    """The cache's per-layer keys and values as numpy views, gathered once per cache."""
    cached = getattr(cache, "_gemv_arrays", None)
    if cached is None:
        cached = cache._gemv_arrays = (
            typed.List([k.numpy() for k in cache.keys]),
            typed.List([v.numpy() for v in cache.values]),
        )
    return cached


@torch.no_grad()
def kernel_step(model, ids: torch.Tensor, cache, student: bool, cutoff: float | torch.Tensor):
    """`decode.decode_step` (same arguments, same results) as one `gemv.decode` call; None for a call it does not
    take (more than `gemv.MAX_ROWS` rows), which the caller runs through the torch step."""
    from chatapp.stt.decode import rope_tables

    batch = ids.shape[0]
    arrays = model_arrays(model)
    if arrays is None or batch > gemv.MAX_ROWS or batch == 0:
        return None
    cache.reserve(1, 1)  # raises on overflow, as the torch step does
    cos_table, sin_table = rope_tables(model, int(cache.seen.max()) + 1, model.dtype)
    cos, sin = cos_table[cache.seen].reshape(batch, -1), sin_table[cache.seen].reshape(batch, -1)
    keys, values = cache_arrays(cache)
    x = model.model.embed_tokens(ids).float()
    cutoffs = torch.as_tensor(cutoff, dtype=torch.float32).expand(batch).contiguous()
    stt_count = cache.prev_hidden.shape[0]
    inputs = torch.empty((stt_count, batch, x.shape[1]), dtype=torch.float32)
    probs = torch.ones((stt_count, batch), dtype=torch.float32)
    selected = torch.ones((stt_count, batch), dtype=torch.bool)
    logits = torch.empty((batch, arrays.head_w.shape[0]), dtype=torch.float32)
    gemv.decode(
        x.numpy(), arrays.blocks, arrays.routers, arrays.stt_slot, keys, values,
        cache.lengths.numpy(), cache.positions.numpy(), cache.seen.numpy(),
        _f32(cache.prev_hidden), inputs.numpy(), _f32(cos), _f32(sin), cutoffs.numpy(), bool(student),
        model.config.skip_mode == "kv", arrays.heads, arrays.kv_heads, arrays.final_norm, arrays.final_eps,
        arrays.head_w, arrays.head_s, logits.numpy(), probs.numpy(), selected.numpy(),
    )  # fmt: skip
    cache.prev_hidden.copy_(inputs)
    return logits.to(model.dtype), probs[..., None], selected[..., None]


def serves(model) -> bool:
    """Whether `kernel_step` can decode `model` (see `model_arrays`)."""
    return model_arrays(model) is not None


def attach(model) -> bool:
    """Decode `model` through `kernel_step` when the kernel `serves` it, with the kernels loaded meanwhile in the
    background (`warm`); whether it was attached."""
    if not serves(model):
        return False
    model.kernel_step = kernel_step
    model.compile_note = "the decode step runs as one numba call (int8 kernels)"
    threading.Thread(target=warm, args=(model,), name="chatapp-warm-kernels", daemon=True).start()
    return True


def warm(model) -> None:
    """Load the step's compiled code (numba's cache; without it numba compiles it, ~30 s on 2 cores) with a step
    on a one-row scratch cache, so that the first token does not wait for it."""
    with torch.inference_mode():
        cache = model.new_cache(1, 4)
        kernel_step(model, torch.zeros(1, dtype=torch.long), cache, True, 0.5)


def compile_kernels() -> None:
    """Compile the kernels into numba's cache (beside this package's code, or numba's user-wide cache when that
    is read-only) with a step of a tiny random int8 model: the same argument types as any model's, so a later
    process only loads them. `make run` and `make test` run this first (`python -m chatapp.stt.cpu_step`); it
    takes about a second when the cache is current."""
    from chatapp.stt.config import STTConfig
    from chatapp.stt.random_init import random_routed_model
    from chatapp.stt.weights import prepare_weights

    config = STTConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, stt_layers=[1], routing_trained=True,
    )  # fmt: skip
    warm(prepare_weights(random_routed_model(config), "int8"))


if __name__ == "__main__":
    compile_kernels()
