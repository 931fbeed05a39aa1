"""The logit lens: each decoder layer's residual stream read through the model's final norm and LM head.

A layer's output h_l (the residual stream after layer l) is what the next layer reads; the model reads only the last
one, through `norm` and `lm_head`. Reading every h_l the same way (nostalgebraist's logit lens) shows when the model's
prediction took shape: at which layer the emitted token became, and stayed, the most likely one.

The states are the model's own forward's (`STTForCausalLM.extend` and `decode` keep every layer's output when asked):
`chatapp.engine.lens_pass.replay` replays a reply exactly as the engine generated it, so a layer that skipped a token
skips it there too, and the last layer's reading is the distribution the reply was sampled from (`read_layers` and
`decision_depths` take those logits as the last layer's reading). `capture_states` is one pass over a sequence as a
prompt, for a tuned lens's fit.

A tuned lens (Belrose et al. 2023) adds a per-layer affine translator before the norm, fitted so that layer l's
reading matches the final distribution (`chatapp.training.lens_fit`); `Translators` holds them, and a model directory
keeps them in `lens.safetensors` (`chatapp.models.lens_files`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


@torch.inference_mode()
def capture_states(
    model, ids: torch.Tensor, positions: torch.Tensor, *, dense: bool = False, threshold: float | None = None
) -> LayerStates:
    """Every decoder layer's output at `positions` (P,) of the sequence `ids` (T,), from one pass of the model's
    forward (`STTForCausalLM.extend`) over it as a prompt: the routers decide at `threshold` (else the model's own),
    or every layer runs every token (`dense`). For a tuned lens's fit (`chatapp.training.lens_fit`): reading a reply
    exactly as it was generated is the engine's replay (`chatapp.engine.lens_pass.replay`)."""
    length = ids.shape[0]
    cache = model.new_cache(1, length)
    ids = ids.to(model.device)[None]
    lengths = torch.full((1,), length, dtype=torch.long, device=model.device)
    routing = "off" if dense else "student"
    out = model.extend(ids, lengths, cache, routing=routing, threshold=threshold, capture="all")
    return LayerStates(out.states[:, 0, positions.to(model.device)], out.selected[:, 0])


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


# Alternatives kept of the model's own distribution at a position (`FinalReading`); a table shows a few of them.
FINAL_TOP = 16


@dataclass(frozen=True)
class FinalReading:
    """The model's own distribution at some positions (the last layer's reading), kept small: the emitted token's
    probability and rank, and the `FINAL_TOP` most likely tokens. A reply's logits in full would cost a vocabulary of
    floats a token (200 KB for the default model's)."""

    prob: torch.Tensor  # (P,)
    rank: torch.Tensor  # (P,) 1 = the model's top token
    top_ids: torch.Tensor  # (P, FINAL_TOP)
    top_probs: torch.Tensor  # (P, FINAL_TOP)

    @classmethod
    def of(cls, logits: torch.Tensor, emitted: torch.Tensor) -> FinalReading:
        """From logits (P, V) and the tokens emitted after them (P,)."""
        logits = logits.float()
        own = logits.gather(1, emitted.to(logits.device)[:, None])
        log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
        values, ids = logits.topk(min(FINAL_TOP, logits.shape[-1]), dim=-1)
        return cls((own - log_z).exp()[:, 0].cpu(), ((logits > own).sum(-1) + 1).cpu(), ids.cpu(), (values - log_z).exp().cpu())

    @classmethod
    def join(cls, parts: list[FinalReading]) -> FinalReading:
        return cls(*(torch.cat([getattr(p, name) for p in parts]) for name in ("prob", "rank", "top_ids", "top_probs")))

    def at(self, index: list[int]) -> FinalReading:
        return FinalReading(self.prob[index], self.rank[index], self.top_ids[index], self.top_probs[index])


@torch.no_grad()
def read_layers(
    head: LensHead, states: torch.Tensor, emitted: torch.Tensor, k: int = 3, final: FinalReading | None = None
) -> LensTable:
    """Every layer's reading of `states` (L, P, D) at the P positions, whose emitted tokens are `emitted` (P,).
    `final`: the model's own distribution there, which is the last layer's reading (the head's product of the last
    state would differ from it by the rounding of the model's own head kernel); `k` at most `FINAL_TOP` then.

    The rows of all layers go through the head together: for a few positions (the TUI's one token) the product is
    bound by reading the head's weight, so one pass over it serves every layer."""
    layers, count, _ = states.shape
    read = layers - 1 if final is not None else layers
    emitted = emitted.to(states.device)
    targets = emitted.repeat(read)  # row r = layer r // P, position r % P
    prob, rank, top_ids, top_probs = [], [], [], []
    if read:
        rows = torch.cat([head.prepare(layer, states[layer]) for layer in range(read)])
        for start in range(0, rows.shape[0], READ_ROWS):
            logits = head.read(rows[start : start + READ_ROWS])
            own = logits.gather(1, targets[start : start + READ_ROWS, None])
            log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
            prob.append((own - log_z).exp()[:, 0].cpu())
            rank.append(((logits > own).sum(-1) + 1).cpu())
            values, ids = logits.topk(k, dim=-1)
            top_ids.append(ids.cpu())
            top_probs.append((values - log_z).exp().cpu())
    if final is not None:
        prob.append(final.prob)
        rank.append(final.rank)
        top_ids.append(final.top_ids[:, :k])
        top_probs.append(final.top_probs[:, :k])

    def by_position(parts: list[torch.Tensor]) -> torch.Tensor:
        joined = torch.cat(parts)
        return joined.view(layers, count, *joined.shape[1:]).transpose(0, 1)

    return LensTable(by_position(prob), by_position(rank), by_position(top_ids), by_position(top_probs))


@torch.no_grad()
def decision_depths(
    head: LensHead, states: torch.Tensor, emitted: torch.Tensor, final: FinalReading | None = None
) -> torch.Tensor:
    """Per position (P,): the first layer from which every reading's top token is the emitted one; -1 where even the
    last layer's is not (a sampled or forced token the model did not rank first). `final`: the model's own
    distribution, the last layer's reading (`read_layers`).

    Read from the last layer down, and only the positions still settled are read: a token decided at layer 20 of 30
    costs 11 readings, not 30. Layers go through the head a block at a time (as many as keep a product near
    `READ_ROWS` rows), because a product of a few rows costs a whole read of the head's weight.
    """
    layers, count, _ = states.shape
    emitted = emitted.to(states.device)
    depth = torch.full((count,), -1, dtype=torch.long)
    alive = torch.arange(count, device=states.device)
    layer = layers - 1
    if final is not None:
        alive = alive[(final.rank == 1).to(states.device)]
        depth[alive.cpu()] = layer
        layer -= 1
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
