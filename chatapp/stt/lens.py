"""The logit lens: each decoder layer's residual stream read through the model's final norm and LM head.

A layer's output h_l (the residual stream after layer l) is what the next layer reads; the model reads only the last
one, through `norm` and `lm_head`. Reading every h_l the same way (nostalgebraist's logit lens) shows when the model's
prediction took shape: at which layer the emitted token became, and stayed, the most likely one.

`capture_states` is one full-sequence forward over a prefix with the routing a reply actually had, so a layer that
skipped a token really skips it here: in "strict" mode the token passes through unchanged and is no key of that
layer; in "kv" mode it passes through unchanged and its K/V (from its unchanged input) are keys. The routed pass is
`DecoderBlock.routed`, the same maths every full-sequence path uses (`stt.teacher`), not the decode step: the lens
never runs on the decode hot path. `replay_states` gets the same states for tokens still in a KV cache by replaying
only them against it, each attending to the entries it saw when it was fed.

A tuned lens (Belrose et al. 2023) adds a per-layer affine translator before the norm, fitted so that layer l's
reading matches the final distribution (`chatapp.training.lens_fit`); `Translators` holds them, and a model directory
keeps them in `lens.safetensors` (`chatapp.models.lens_files`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chatapp.stt.layers import STTLayer, router_probs, select, self_attention_sink, skipped_output
from chatapp.stt.teacher import previous_tokens

# Rows of hidden states read through the head at once: bounds the (rows, vocabulary) float32 logits in memory
# (256 x 49,152 x 4 B = 50 MB for the default model).
READ_ROWS = 256


@dataclass(frozen=True)
class LayerStates:
    """One forward's residual streams at the positions asked for, and the routing it ran with."""

    states: torch.Tensor  # (L, P, D) float32: decoder layer l's output at each asked position
    selected: torch.Tensor  # (L_stt, T) bool: whether each STT layer ran its block for each token of the prefix


@dataclass(frozen=True)
class Translators:
    """Per-layer affine maps of a tuned lens, low rank so that a model ships them small: layer l's state, scaled to
    unit RMS (x; the reading cannot tell scales apart, and the fit is better conditioned), reads as
    x + (x @ down[l]) @ up[l] + bias[l]. The last layer's is zero (the model's own reading)."""

    down: torch.Tensor  # (L, D, r)
    up: torch.Tensor  # (L, r, D)
    bias: torch.Tensor  # (L, D)

    def apply(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        down, up, bias = (t[layer].to(h.device, h.dtype) for t in (self.down, self.up, self.bias))
        return h + (h @ down) @ up + bias

    def tensors(self) -> dict[str, torch.Tensor]:
        """The translators as float16 tensors, for a model's `lens.safetensors` (`chatapp.models.lens_files`)."""
        return {name: getattr(self, name).to(torch.float16).contiguous() for name in ("down", "up", "bias")}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], num_layers: int, hidden_size: int) -> Translators:
        """Raises ValueError naming what does not fit a model of `num_layers` x `hidden_size`."""
        if set(tensors) != {"down", "up", "bias"}:
            raise ValueError(f"holds {sorted(tensors)}, not a lens's down, up and bias")
        down, up, bias = (tensors[name].float() for name in ("down", "up", "bias"))
        rank = down.shape[-1] if down.ndim == 3 else -1
        want = {
            "down": (num_layers, hidden_size, rank),
            "up": (num_layers, rank, hidden_size),
            "bias": (num_layers, hidden_size),
        }
        for name, tensor in (("down", down), ("up", up), ("bias", bias)):
            if tuple(tensor.shape) != want[name]:
                raise ValueError(f"{name} is {tuple(tensor.shape)}, the model needs {want[name]}")
        return cls(down, up, bias)


@torch.no_grad()
def capture_states(
    model,
    ids: torch.Tensor,
    positions: torch.Tensor,
    *,
    decisions: torch.Tensor | None = None,
    known: torch.Tensor | None = None,
    dense: bool = False,
    threshold: float | None = None,
) -> LayerStates:
    """Run the model over the prefix `ids` (T,) and keep every decoder layer's output at `positions` (P,).

    Routing: `dense` runs every layer for every token (routing "off"). Otherwise an STT layer runs its block for the
    tokens `decisions` (L_stt, T) marks, at the positions `known` (T,) marks (all when None); at the other positions
    the causal router decides, as the model would have (`threshold`, else the model's own). A model without trained
    routers runs dense.
    """
    config = model.config
    ids = ids.to(model.device)[None]
    length = ids.shape[1]
    student = not dense and model.routing_active
    cutoff = config.router_threshold if threshold is None else threshold
    if decisions is not None:
        decisions = decisions.to(model.device, torch.bool)
        known = torch.ones(length, dtype=torch.bool, device=model.device) if known is None else known.to(model.device)
    hidden = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(length, device=model.device)[None])
    positions = positions.to(model.device)
    every = torch.ones(1, length, dtype=torch.bool, device=model.device)
    states, chosen = [], []
    for layer in model.model.layers:
        if isinstance(layer, STTLayer):
            selected = every
            if student:
                selected = select(router_probs(layer, hidden, previous_tokens(hidden)), cutoff)
                if decisions is not None:
                    selected = torch.where(known[None], decisions[len(chosen)][None], selected)
            hidden = layer.routed(hidden, cos, sin, selected, config.skip_mode)
            chosen.append(selected[0])
        else:
            hidden = layer.block(hidden, cos, sin, self_attention_sink())
        states.append(hidden[0, positions].float())
    empty = torch.zeros(0, length, dtype=torch.bool, device=model.device)
    return LayerStates(torch.stack(states), torch.stack(chosen) if chosen else empty)


@torch.inference_mode()
def replay_states(model, cache, ids: torch.Tensor, positions: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Every decoder layer's output (L, P, D) for the tokens `ids` (P,) at absolute `positions` (P,) of row 0 of a
    KV cache (`stt.cache.KVCache`) that already holds them and everything before them, as generation left it.

    Each token attends to exactly the cache entries it attended to when it was fed (its own included: entries at
    positions up to its own), so nothing before it is computed again: a token costs one pass through the layers
    whatever the context. `selected` (L_stt, P): which STT layers ran for each token (a skipped token carries on as
    its skip path made it, `layers.skipped_output`; in "kv" and "predict" modes its K/V are in the cache already). The same states as
    `capture_states` over the whole prefix, to the rounding of the decode step that wrote the cache.
    """
    device = model.device
    ids, positions = ids.to(device)[None], positions.to(device)[None]
    selected = selected.to(device, torch.bool)
    hidden = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary_emb(hidden, positions)
    queries = torch.ones_like(positions, dtype=torch.bool)
    span = cache.host_bound
    states, slot = [], 0
    for index, layer in enumerate(model.model.layers):

        def sink(k: torch.Tensor, v: torch.Tensor, index: int = index):
            return cache.visible(index, positions, queries, span)

        out = layer.block(hidden, cos, sin, sink)
        if isinstance(layer, STTLayer):
            out = torch.where(selected[slot][None, :, None], out, skipped_output(layer, hidden))
            slot += 1
        hidden = out
        states.append(hidden[0].float())
    return torch.stack(states)


def unit_rms(x: torch.Tensor) -> torch.Tensor:
    """`x` scaled to unit root-mean-square along its last axis: what a tuned lens's translators take."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LensHead:
    """The model's final norm and LM head as one float32 product, for reading many hidden states.

    A quantized head (`stt.weights.Int8Linear`) dequantizes per call above a few rows; the lens reads thousands of
    rows in a few calls, so it dequantizes once here. At the last layer the reading is the model's own output
    distribution (to the rounding of its weight format's kernels).
    """

    def __init__(self, model, translators: Translators | None = None) -> None:
        head = model.lm_head
        self.weight = head.weight.detach().float()
        bias = getattr(head, "bias", None)
        self.bias = None if bias is None else bias.detach().float()
        norm = model.model.norm
        self.norm_weight = norm.weight.detach().float()
        self.eps = norm.variance_epsilon
        self.translators = translators

    @property
    def kind(self) -> str:
        """Which lens this head reads: "tuned" with translators, "raw" without."""
        return "raw" if self.translators is None else "tuned"

    def prepare(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s states `h` (N, D) as the head reads them: translated (tuned lens), then normed."""
        h = h.float()
        if self.translators is not None:
            h = self.translators.apply(layer, unit_rms(h))
        return F.rms_norm(h, (h.shape[-1],), self.norm_weight, self.eps)

    def read(self, normed: torch.Tensor) -> torch.Tensor:
        """(N, V) float32 logits of prepared rows (`prepare`), of any layers."""
        return F.linear(normed, self.weight, self.bias)

    def logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """(N, V) float32 logits of layer `layer`'s states `h` (N, D)."""
        return self.read(self.prepare(layer, h))


@dataclass(frozen=True)
class LensTable:
    """Every layer's reading at some positions: (P, L) for the emitted token, (P, L, k) for the top k."""

    prob: torch.Tensor  # probability of the emitted token
    rank: torch.Tensor  # its rank (1 = the reading's top token)
    top_ids: torch.Tensor
    top_probs: torch.Tensor


@torch.no_grad()
def read_layers(head: LensHead, states: torch.Tensor, emitted: torch.Tensor, k: int = 3) -> LensTable:
    """Every layer's reading of `states` (L, P, D) at the P positions, whose emitted tokens are `emitted` (P,).

    The rows of all layers go through the head together: for a few positions (the TUI's one token) the product is
    bound by reading the head's weight, so one pass over it serves every layer."""
    layers, count, _ = states.shape
    emitted = emitted.to(states.device).repeat(layers)  # row r = layer r // P, position r % P
    rows = torch.cat([head.prepare(layer, states[layer]) for layer in range(layers)])
    prob, rank, top_ids, top_probs = [], [], [], []
    for start in range(0, rows.shape[0], READ_ROWS):
        chunk = slice(start, start + READ_ROWS)
        logits = head.read(rows[chunk])
        own = logits.gather(1, emitted[chunk, None])
        log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
        prob.append((own - log_z).exp()[:, 0])
        rank.append((logits > own).sum(-1) + 1)
        values, ids = logits.topk(k, dim=-1)
        top_ids.append(ids)
        top_probs.append((values - log_z).exp())

    def by_position(parts: list[torch.Tensor]) -> torch.Tensor:
        joined = torch.cat(parts).cpu()
        return joined.view(layers, count, *joined.shape[1:]).transpose(0, 1)

    return LensTable(by_position(prob), by_position(rank), by_position(top_ids), by_position(top_probs))


@torch.no_grad()
def decision_depths(head: LensHead, states: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
    """Per position (P,): the first layer from which every reading's top token is the emitted one; -1 where even the
    last layer's is not (a sampled or forced token the model did not rank first).

    Read from the last layer down, and only the positions still settled are read: a token decided at layer 20 of 30
    costs 11 readings, not 30. Layers go through the head a block at a time (as many as keep a product near
    `READ_ROWS` rows), because a product of a few rows costs a whole read of the head's weight.
    """
    layers, count, _ = states.shape
    emitted = emitted.to(states.device)
    depth = torch.full((count,), -1, dtype=torch.long)
    alive = torch.arange(count, device=states.device)
    layer = layers - 1
    while layer >= 0 and alive.numel():
        block = list(range(layer, max(layer - max(READ_ROWS // alive.numel(), 1), -1), -1))
        rows = torch.cat([head.prepare(at, states[at, alive]) for at in block])
        top = torch.cat([head.read(rows[s : s + READ_ROWS]).argmax(-1) for s in range(0, rows.shape[0], READ_ROWS)])
        top = top.view(len(block), alive.numel())
        for row, at in enumerate(block):
            settled = top[row] == emitted[alive]
            alive, top = alive[settled], top[:, settled]
            depth[alive.cpu()] = at
        layer = block[-1] - 1
    return depth


def agreement(head: LensHead, states: torch.Tensor) -> torch.Tensor:
    """Per layer (L,): the share of positions where the layer's top token is the last layer's (the model's)."""
    layers, count, _ = states.shape
    final = torch.cat(
        [head.logits(layers - 1, states[-1, s : s + READ_ROWS]).argmax(-1) for s in range(0, count, READ_ROWS)]
    )
    shares = []
    for layer in range(layers):
        top = torch.cat(
            [head.logits(layer, states[layer, s : s + READ_ROWS]).argmax(-1) for s in range(0, count, READ_ROWS)]
        )
        shares.append((top == final).float().mean())
    return torch.stack(shares).cpu()
