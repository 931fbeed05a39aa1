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

from chatapp.stt import gemv
from chatapp.stt.weights import Int8Linear

_EMPTY = np.zeros(0, dtype=np.float32)


def _f32(t: torch.Tensor | None) -> np.ndarray:
    return _EMPTY if t is None else t.detach().float().contiguous().numpy()


class ModelArrays(NamedTuple):
    """What `gemv.decode` reads of a model: every per-layer array stacked on a first axis of layers."""

    blocks: tuple  # `gemv.block`'s weight arguments, each (L, ...)
    routers: tuple  # `gemv.router`'s weight arguments, each (L_stt, ...)
    stt_slot: np.ndarray  # (L,) int64: the layer's STT index, -1 for a dense layer
    heads: int
    kv_heads: int
    final_norm: np.ndarray
    final_eps: np.float32
    head_w: np.ndarray  # (V, D) int8
    head_s: np.ndarray  # (V,)


def _projections(layer) -> tuple | None:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    return projections if all(isinstance(p, Int8Linear) for p in projections) else None


def _stack_int8(modules: list[Int8Linear], mapped: list[tuple[int, int]]) -> np.ndarray:
    """The modules' int8 levels in one (L, N, K) array, each module's buffer then a view of it. The pages of the
    stored format's file mapping that the copy read are handed back (`_release`), so the resident set holds the
    levels once."""
    stacked = torch.stack([m.weight_int8 for m in modules])
    for module, view in zip(modules, stacked.unbind(0), strict=True):
        _release(module.weight_int8, mapped)
        module.weight_int8 = view
    return stacked.numpy()


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process mapped from files (/proc/self/maps; none where it cannot be read)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith("/"):
                    start, end = (int(value, 16) for value in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        pass
    return ranges


def _release(tensor: torch.Tensor, mapped: list[tuple[int, int]]) -> None:
    """Drop the resident pages of a tensor read from a file mapping that nothing reads any more (madvise
    DONTNEED: the file keeps them, and a read would map them again). Anonymous memory is left alone: there the
    call would discard the data."""
    import ctypes
    import mmap

    start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    if not any(low <= start and start + size <= high for low, high in mapped):
        return
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + size) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4)  # MADV_DONTNEED


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    return np.ascontiguousarray(np.stack(arrays))


def model_arrays(model) -> ModelArrays | None:
    """`model`'s arrays for `gemv.decode`, gathered once and cached on it; None when the kernel cannot run it: not on
    a CPU, a cache that is not float32, a projection or the LM head not int8, an STT layer without a causal router,
    layers of different shapes."""
    cached = getattr(model, "_gemv_arrays", None)
    if cached is not None and cached[0] == id(model.lm_head):
        return cached[1]
    layers = model.model.layers
    if model.device.type != "cpu" or model.kv_dtype != torch.float32 or not isinstance(model.lm_head, Int8Linear):
        return None
    projections = [_projections(layer) for layer in layers]
    stt = list(model.stt_layer_indices)
    routers = [layers[i].causal_router for i in stt]
    if any(p is None for p in projections) or any(r is None for r in routers):
        return None
    if len({(*(m.weight_int8.shape for m in p), p[0].bias is None) for p in projections}) != 1:
        return None
    qkv, o, up, down = (list(group) for group in zip(*projections, strict=True))
    mapped = _file_mappings()
    norm1 = [layer.input_layernorm for layer in layers]
    norm2 = [layer.post_attention_layernorm for layer in layers]
    blocks = (
        _stack([_f32(n.weight) for n in norm1]), np.array([n.variance_epsilon for n in norm1], np.float32),
        _stack_int8(qkv, mapped), _stack([_f32(m.scales) for m in qkv]), _stack([_f32(m.bias) for m in qkv]),
        _stack_int8(o, mapped), _stack([_f32(m.scales) for m in o]),
        _stack([_f32(n.weight) for n in norm2]), np.array([n.variance_epsilon for n in norm2], np.float32),
        _stack_int8(up, mapped), _stack([_f32(m.scales) for m in up]),
        _stack_int8(down, mapped), _stack([_f32(m.scales) for m in down]),
    )  # fmt: skip
    hidden = int(model.config.hidden_size)
    if not routers:  # numba types the arrays by their rank: a router that no layer reads
        ones = np.ones((1, hidden), np.float32)
        eps = np.ones(1, np.float32)
        router_arrays = (ones, eps, ones, eps, np.zeros((1, 1, 2 * hidden), np.float32), np.zeros((1, 1), np.float32),
                         np.zeros((1, 1), np.float32), eps)  # fmt: skip
    else:
        router_arrays = (
            _stack([_f32(r.norm_current.weight) for r in routers]),
            np.array([r.norm_current.variance_epsilon for r in routers], np.float32),
            _stack([_f32(r.norm_previous.weight) for r in routers]),
            np.array([r.norm_previous.variance_epsilon for r in routers], np.float32),
            _stack([_f32(r.up.weight) for r in routers]),
            _stack([_f32(r.up.bias) for r in routers]),
            _stack([_f32(r.out.weight.reshape(-1)) for r in routers]),
            np.array([r.out.bias.item() for r in routers], np.float32),
        )
    stt_slot = np.full(len(layers), -1, dtype=np.int64)
    stt_slot[stt] = np.arange(len(stt))
    attn, norm = layers[0].self_attn, model.model.norm
    arrays = ModelArrays(
        blocks=blocks,
        routers=router_arrays,
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


def cache_arrays(cache) -> tuple[np.ndarray, np.ndarray]:
    """The cache's keys and values as (L, B, S + 1, H_kv, Dh) arrays: its own blocks when its layers are views of
    one (`KVCache` allocates them so), else stacked once and the layers made views of the stack."""
    cached = getattr(cache, "_gemv_arrays", None)
    if cached is not None and cached[0] == (id(cache.keys), id(cache.values)):
        return cached[1]
    arrays = (_layer_block(cache.keys), _layer_block(cache.values))
    cache._gemv_arrays = ((id(cache.keys), id(cache.values)), arrays)
    return arrays


def _layer_block(layers: list[torch.Tensor]) -> np.ndarray:
    first = layers[0]
    step = first.numel()
    if all(t.is_contiguous() and t.data_ptr() == first.data_ptr() + i * step * t.element_size()
           for i, t in enumerate(layers)):  # fmt: skip
        return torch.as_strided(first, (len(layers), *first.shape), (step, *first.stride())).numpy()
    stacked = torch.stack(layers)
    layers[:] = list(stacked.unbind(0))
    return stacked.numpy()


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
