"""The int8 decode step in numba: the whole step in one call, for a few rows at a time on a CPU.

At batch 1 a decode step of the default model in int8 is 120 matrix-vector products over 106 MB of weights,
plus ~40 small torch ops per block around them. Both were slow on a CPU without AVX-512:

- torch's weight-only kernel (`torch._weight_int8pack_mm`) is written for AVX-512. On a 2-core AVX2 EPYC it
  streamed a 576x3072 weight at 14 GB/s and the 49152x576 LM head at 7.5 GB/s; this file's loop, which LLVM
  vectorizes (int8 widened to float32, fused multiply-adds; `fastmath` lets it reorder the sum), reads them at
  22-26 GB/s on the same two threads.
- each torch op costs a few microseconds of dispatch whatever its size; a block's norms, rotary, cache writes,
  attention and activations are ~40 of them.

So `block` runs a whole block (norm, q/k/v, rotary, the cache write, attention over the row's cache entries, o,
residual, norm, gate/up, SwiGLU, down, residual) in one call, its residual stream in float32, and `int8_matmul`
runs the LM head; `decode` runs a whole step through them (`stt.cpu_step`). Parallel loops run output channels
(a projection) or (row, K/V head) pairs (attention) on numba's OpenMP layer (the system's libgomp, a thread pool
beside torch's own); for each output channel every input row is computed while the channel's weight row is in
L1, so a few rows cost little more than one.

The arithmetic is the eager step's with int8 weights dequantized exactly (`q * scale`, one scale per output
channel, applied after the sum) and float32 throughout where the eager step rounds activations to bfloat16:
tests/stt/test_gemv.py compares it with the eager step run in float32 on the same dequantized weights.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

# Most rows one call takes; a larger batch goes through the torch step (there the weight-only kernel's cost is
# shared by the rows, and a dense product wins from 48 rows up: see `stt.weights.DEQUANT_ROWS`).
MAX_ROWS = 8

_NUMBA = {"parallel": True, "fastmath": True, "cache": True, "nogil": True}


@njit(**_NUMBA)
def int8_matmul(x, weight, scales, bias, out, first):  # pragma: no cover - compiled
    """out[m, r - first] = sum_j x[m, j] * weight[r, j] * scales[r] (+ bias[r] when `bias` has a value per
    channel), for output channels r from `first` on; x (M, K) float32, weight (N, K) int8."""
    n, k = weight.shape
    rows = x.shape[0]
    with_bias = bias.shape[0] == n
    for r in prange(first, n):
        scale = scales[r]
        for m in range(rows):
            acc = np.float32(0.0)
            for j in range(k):
                acc += np.float32(weight[r, j]) * x[m, j]
            value = acc * scale
            if with_bias:
                value += bias[r]
            out[m, r - first] = value


@njit(fastmath=True, cache=True, nogil=True)
def _rms_norm(x, weight, eps):  # pragma: no cover - compiled
    rows, d = x.shape
    out = np.empty((rows, d), dtype=np.float32)
    for m in range(rows):
        total = np.float32(0.0)
        for j in range(d):
            total += x[m, j] * x[m, j]
        factor = np.float32(1.0) / np.sqrt(total / d + eps)
        for j in range(d):
            out[m, j] = x[m, j] * factor * weight[j]
    return out


@njit(fastmath=True, cache=True, nogil=True)
def _rotate(src, dst, cos, sin, half):  # pragma: no cover - compiled
    """dst = src * cos + roll(src, half) * sin (the signed sin of `decode.rope_tables`)."""
    width = 2 * half
    for i in range(width):
        dst[i] = src[i] * cos[i] + src[(i + half) % width] * sin[i]


@njit(**_NUMBA)
def block(x, weights, cos, sin, keys, values, rows, slots, heads, kv_heads, kv_only):  # pragma: no cover - compiled
    """One decoder block on the rows `x` (B, D) float32, updated in place: the cache row of row b is rows[b], its
    token is stored at slot slots[b] and attends over the slots up to it. `kv_only`: store K/V and stop (an STT
    layer's skipped token in "kv" mode). cos, sin (B, Dh) at each row's position. `weights`: (input norm, its eps,
    q/k/v int8, scales, bias, o int8, scales, post-attention norm, its eps, gate/up int8, scales, down int8,
    scales)."""
    norm1, eps1, qkv_w, qkv_s, qkv_b, o_w, o_s, norm2, eps2, up_w, up_s, down_w, down_s = weights
    batch = x.shape[0]
    head_dim = cos.shape[1]
    half = head_dim // 2
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    first = q_width if kv_only else 0
    h = _rms_norm(x, norm1, eps1)
    qkv = np.empty((batch, qkv_w.shape[0] - first), dtype=np.float32)
    int8_matmul(h, qkv_w, qkv_s, qkv_b, qkv, first)
    k_at, v_at = q_width - first, q_width - first + kv_width
    for b in range(batch):
        for g in range(kv_heads):
            _rotate(
                qkv[b, k_at + g * head_dim : k_at + (g + 1) * head_dim],
                keys[rows[b], slots[b], g],
                cos[b],
                sin[b],
                half,
            )
            values[rows[b], slots[b], g, :] = qkv[b, v_at + g * head_dim : v_at + (g + 1) * head_dim]
    if kv_only:
        return
    # Attention over the row's entries 0..slot, softmax in float32: one task per (row, K/V head), whose query heads
    # read each key and value once between them (per query head, the reads of a long cache cost more than the dot
    # products).
    group = heads // kv_heads
    scale = np.float32(1.0 / math.sqrt(head_dim))
    attended = np.empty((batch, q_width), dtype=np.float32)
    for task in prange(batch * kv_heads):
        b, g = task // kv_heads, task % kv_heads
        row, count = rows[b], slots[b] + 1
        q = np.empty((group, head_dim), dtype=np.float32)
        for h in range(group):
            at = (g * group + h) * head_dim
            _rotate(qkv[b, at : at + head_dim], q[h], cos[b], sin[b], half)
        scores = np.empty((group, count), dtype=np.float32)
        for s in range(count):
            key = keys[row, s, g]
            for h in range(group):
                dot = np.float32(0.0)
                for i in range(head_dim):
                    dot += q[h, i] * key[i]
                scores[h, s] = dot * scale
        for h in range(group):
            peak = scores[h].max()
            total = np.float32(0.0)
            for s in range(count):
                scores[h, s] = np.exp(scores[h, s] - peak)
                total += scores[h, s]
            scores[h] /= total
        out = np.zeros((group, head_dim), dtype=np.float32)
        for s in range(count):
            value = values[row, s, g]
            for h in range(group):
                weight = scores[h, s]
                for i in range(head_dim):
                    out[h, i] += weight * value[i]
        attended[b, g * group * head_dim : (g + 1) * group * head_dim] = out.reshape(-1)
    projected = np.empty((batch, o_w.shape[0]), dtype=np.float32)
    int8_matmul(attended, o_w, o_s, qkv_b[:0], projected, 0)
    x += projected
    # SwiGLU MLP: gate and up are one product, gate first.
    h = _rms_norm(x, norm2, eps2)
    width = up_w.shape[0] // 2
    gate_up = np.empty((batch, up_w.shape[0]), dtype=np.float32)
    int8_matmul(h, up_w, up_s, qkv_b[:0], gate_up, 0)
    act = np.empty((batch, width), dtype=np.float32)
    for b in range(batch):
        for i in range(width):
            gate = gate_up[b, i]
            act[b, i] = gate / (np.float32(1.0) + np.exp(-gate)) * gate_up[b, width + i]
    int8_matmul(act, down_w, down_s, qkv_b[:0], projected, 0)
    x += projected


@njit(fastmath=True, cache=True, nogil=True)
def router(
    current, previous, norm_current, eps_current, norm_previous, eps_previous, up_w, up_b, out_w, out_b, probs
):  # pragma: no cover - compiled
    """The causal router's probability of "process x_t" per row (`layers.CausalRouter`, then a sigmoid): a small
    float32 MLP on the RMS-normed current and previous layer inputs (B, D), side by side."""
    batch, d = current.shape
    features = np.empty(2 * d, dtype=np.float32)
    for b in range(batch):
        features[:d] = _rms_norm(current[b : b + 1], norm_current, eps_current)[0]
        features[d:] = _rms_norm(previous[b : b + 1], norm_previous, eps_previous)[0]
        logit = out_b
        for r in range(up_w.shape[0]):
            acc = up_b[r]
            for j in range(2 * d):
                acc += up_w[r, j] * features[j]
            logit += out_w[r] * acc / (np.float32(1.0) + np.exp(-acc))
        probs[b] = np.float32(1.0) / (np.float32(1.0) + np.exp(-logit))


@njit(**_NUMBA)
def decode(
    x, blocks, routers, stt_slot, keys, values, lengths, positions, seen, previous, inputs,
    cos, sin, cutoff, student, store_skipped, heads, kv_heads, final_norm, final_eps, head_w, head_s,
    logits, probs, selected,
):  # pragma: no cover - compiled  # fmt: skip
    """One decode step of every row of `x` (B, D), the token embeddings (float32): the model's layers in order, each
    row stored at slot `lengths[layer, b]` of its cache row b, then the final norm and the int8 LM head into
    `logits` (B, V). Every per-layer array is stacked on a first axis of layers (L, ...): `blocks`, `block`'s
    weights in its order, the cache's `keys` and `values` (L, B, S + 1, H_kv, Dh); `routers`, `router`'s weights in
    its order, on one of STT layers. The rules are
    `decode.decode_step`'s, which tests/stt/test_gemv.py checks against it:

    - at an STT layer (`stt_slot[layer]` >= 0) its router reads the layer input beside `previous` (the row's input
      there one token before) into `probs`, and the input is kept in `inputs` for the next token;
    - with `student` a row runs an STT layer only when its probability is at or above its `cutoff`; a skipped row
      stores its K/V only (`store_skipped`, "kv" mode) or nothing ("strict": its trash slot takes the position);
    - a row's length at a layer grows by one wherever it stored its token; `positions` records the token's
      position `seen[b]` at its slot, and `seen` grows by one.
    """
    batch = x.shape[0]
    trash = keys.shape[2] - 1
    norm1, eps1, qkv_w, qkv_s, qkv_b, o_w, o_s, norm2, eps2, up_w, up_s, down_w, down_s = blocks
    r_norm_c, r_eps_c, r_norm_p, r_eps_p, r_up_w, r_up_b, r_out_w, r_out_b = routers
    for layer in range(qkv_w.shape[0]):
        slot = stt_slot[layer]
        run = np.ones(batch, dtype=np.bool_)
        if slot >= 0:
            inputs[slot, :, :] = x
            router(
                x, previous[slot], r_norm_c[slot], r_eps_c[slot], r_norm_p[slot], r_eps_p[slot], r_up_w[slot],
                r_up_b[slot], r_out_w[slot], r_out_b[slot], probs[slot],
            )  # fmt: skip
            for b in range(batch):
                if student:
                    run[b] = probs[slot, b] >= cutoff[b]
                selected[slot, b] = run[b]
        taken = np.flatnonzero(run)
        skipped = np.flatnonzero(~run)
        for b in taken:
            positions[layer, b, lengths[layer, b]] = seen[b]
        weights = (
            norm1[layer], eps1[layer], qkv_w[layer], qkv_s[layer], qkv_b[layer], o_w[layer], o_s[layer],
            norm2[layer], eps2[layer], up_w[layer], up_s[layer], down_w[layer], down_s[layer],
        )  # fmt: skip
        if taken.shape[0] == batch:
            rows = np.arange(batch)
            block(x, weights, cos, sin, keys[layer], values[layer], rows, lengths[layer].copy(), heads, kv_heads, False)
        elif taken.shape[0] > 0:
            part = x[taken].copy()
            block(
                part, weights, cos[taken], sin[taken], keys[layer], values[layer], taken, lengths[layer][taken],
                heads, kv_heads, False,
            )  # fmt: skip
            x[taken] = part
        if skipped.shape[0] > 0:
            if store_skipped:
                part = x[skipped].copy()
                block(
                    part, weights, cos[skipped], sin[skipped], keys[layer], values[layer], skipped,
                    lengths[layer][skipped], heads, kv_heads, True,
                )  # fmt: skip
                for b in skipped:
                    positions[layer, b, lengths[layer, b]] = seen[b]
                    lengths[layer, b] += 1
            else:
                for b in skipped:
                    positions[layer, b, trash] = seen[b]
        for b in taken:
            lengths[layer, b] += 1
    for b in range(batch):
        seen[b] += 1
    normed = _rms_norm(x, final_norm, final_eps)
    int8_matmul(normed, head_w, head_s, final_norm[:0], logits, 0)
