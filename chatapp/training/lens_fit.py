"""Fitting a tuned lens (Belrose et al. 2023, arXiv 2303.08112) on cached states: `chatapp lens fit MODEL`.

The raw logit lens reads an early layer's state through a head trained for the last layer's, and early states live
in another basis: their readings can be noise. A tuned lens gives each layer an affine translator, fitted so that
the translated state reads like the last layer's (`chatapp.stt.lens.Translators`).

Cheap by design (minutes on 2 CPU cores): one forward per conversation caches every layer's state at the positions
that predict an assistant token (`stt.lens.capture_states`, with the model's own routing), then per layer
  1. least squares: the translated unit-RMS state should be the last layer's unit-RMS state, each output channel
     weighted by the final norm's weight (the head reads that product); the map is cut to rank `rank` along the
     directions that carry most of the fitted change (reduced-rank regression), so a model ships it small;
  2. optionally a few hundred Adam steps on the tuned lens's own objective, the KL divergence from the last layer's
     distribution to the translated reading, over the vocabulary rows those distributions put mass on.
Agreement (the share of held-out positions where a layer's top token is the model's) is measured on conversations
the fit never saw, raw and tuned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from chatapp.stt.lens import LensHead, Translators, agreement, capture_states, unit_rms

DEFAULT_RANK = 32
MAX_POSITIONS = 2048  # cached positions per split: L x N x D float32 (30 x 2048 x 576 x 4 B = 142 MB at most)
RIDGE = 1e-2  # relative to the mean diagonal of X^T X: keeps outlier channels from blowing the solve up


@dataclass(frozen=True)
class LensFit:
    """Fitted translators and each layer's top-1 agreement with the model on held-out positions, raw and tuned."""

    translators: Translators
    rank: int  # the translators' rank: the one asked for, or fewer where the fit had less to go on (`fitted_rank`)
    raw: list[float]
    tuned: list[float]
    fit_positions: int
    eval_positions: int


def cached_states(engine: Any, conversations: Sequence[Sequence[dict]], limit: int) -> torch.Tensor:
    """Every layer's state (L, N, D) at the positions that predict an assistant token, N <= `limit`."""
    model = engine.model
    context = int(model.config.max_position_embeddings)
    parts, total = [], 0
    for messages in conversations:
        ids, mask = engine.chat_format.render_conversation(messages, max_tokens=min(context, 1024))
        reads = [p - 1 for p in range(1, len(ids)) if mask[p]]
        if not reads:
            continue
        captured = capture_states(model, torch.tensor(ids), torch.tensor(reads))
        parts.append(captured.states)
        total += len(reads)
        if total >= limit:
            break
    if not parts:
        raise ValueError("no conversation has an assistant token to read")
    return torch.cat(parts, dim=1)[:, :limit]


def fitted_rank(rank: int, positions: int, dim: int) -> int:
    """The rank a fit on `positions` cached positions of width `dim` can give: the fitted change spans at most
    `positions` directions (and `dim`), and a rank above that would be directions the data never showed."""
    return max(1, min(rank, positions, dim))


def least_squares(states: torch.Tensor, norm_weight: torch.Tensor, rank: int) -> Translators:
    """Per layer, the rank-`rank` affine map of unit-RMS states that best predicts the last layer's (module
    docstring, step 1), `rank` cut to what the data supports (`fitted_rank`). The last layer's map is zero."""
    layers, positions, dim = states.shape
    rank = fitted_rank(rank, positions, dim)
    target = unit_rms(states[-1].double())
    scale = norm_weight.double().abs().clamp_min(1e-6)
    down = torch.zeros(layers, dim, rank)
    up = torch.zeros(layers, rank, dim)
    bias = torch.zeros(layers, dim)
    for layer in range(layers - 1):
        x = unit_rms(states[layer].double())
        y = (target - x) * scale  # the change the translator must add, as the head weighs it
        x_mean, y_mean = x.mean(0), y.mean(0)
        xc, yc = x - x_mean, y - y_mean
        gram = xc.T @ xc
        gram += torch.eye(dim, dtype=gram.dtype) * RIDGE * gram.diagonal().mean()
        full = torch.linalg.solve(gram, xc.T @ yc)  # (D, D)
        # Reduced rank: keep the `rank` directions of output space that carry most of the fitted change.
        _, _, vh = torch.linalg.svd(xc @ full, full_matrices=False)
        basis = vh[:rank].T  # (D, r)
        down[layer] = (full @ basis).float()
        up[layer] = (basis.T / scale).float()  # back from the head's weighting
        bias[layer] = ((y_mean - x_mean @ full @ basis @ basis.T) / scale).float()
    return Translators(down, up, bias)


def refine(
    head: LensHead,
    translators: Translators,
    states: torch.Tensor,
    steps: int,
    log: Callable[[str], None],
    batch: int = 64,
    vocab_rows: int = 4096,
) -> Translators:
    """`steps` Adam steps on the KL from the last layer's distribution to each translated reading (step 2), over the
    `vocab_rows` tokens the last layer's distributions put most mass on."""
    if steps == 0:
        return translators
    layers, count, _ = states.shape
    with torch.no_grad():
        chunks = [slice(s, s + 256) for s in range(0, count, 256)]  # full-vocabulary logits a chunk at a time
        mass = sum(head.logits(layers - 1, states[-1, c]).softmax(-1).sum(0) for c in chunks)
        rows = mass.topk(min(vocab_rows, mass.numel())).indices
        target = torch.cat([head.logits(layers - 1, states[-1, c])[:, rows].log_softmax(-1) for c in chunks])
    weight = head.weight[rows]
    down = translators.down.clone().requires_grad_(True)
    up = translators.up.clone().requires_grad_(True)
    bias = translators.bias.clone().requires_grad_(True)
    optimiser = torch.optim.Adam([down, up, bias], lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        pick = torch.randint(0, count, (batch,), generator=generator)
        x = unit_rms(states[:-1, pick])  # (L-1, b, D)
        h = x + torch.bmm(torch.bmm(x, down[:-1]), up[:-1]) + bias[:-1, None]  # `Translators.apply`, all layers
        logits = F.rms_norm(h, (h.shape[-1],), head.norm_weight, head.eps) @ weight.T
        log_q = logits.log_softmax(-1)
        p = target[pick].exp()
        loss = (p * (target[pick] - log_q)).sum(-1).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step + 1}/{steps}: KL {loss.item():.3f} nats (mean over layers)")
    with torch.no_grad():
        down[-1].zero_(), up[-1].zero_(), bias[-1].zero_()
    return Translators(down.detach(), up.detach(), bias.detach())


def fit_lens(
    engine: Any,
    conversations: Sequence[Sequence[dict]],
    *,
    steps: int = 200,
    rank: int = DEFAULT_RANK,
    log: Callable[[str], None] = lambda line: None,
) -> LensFit:
    """Fit the tuned lens on the first half of `conversations` and measure it on the second (module docstring)."""
    if len(conversations) < 2:
        raise ValueError("a lens fit needs at least two conversations (one to fit, one to measure)")
    half = len(conversations) // 2
    torch.manual_seed(0)
    log(f"caching states of {half} conversations to fit on")
    fit_states = cached_states(engine, conversations[:half], MAX_POSITIONS)
    log(f"caching states of {len(conversations) - half} held-out conversations")
    eval_states = cached_states(engine, conversations[half:], MAX_POSITIONS)
    raw_head = LensHead(engine.model)
    positions, dim = int(fit_states.shape[1]), int(fit_states.shape[2])
    if (fitted := fitted_rank(rank, positions, dim)) < rank:
        log(
            f"rank {rank} is more than {positions} fitted positions of width {dim} can support: fitting rank "
            f"{fitted} (more --conversations give more positions)"
        )
        rank = fitted
    log(f"least squares on {positions} positions, rank {rank}")
    translators = least_squares(fit_states, raw_head.norm_weight, rank)
    translators = refine(LensHead(engine.model, translators), translators, fit_states, steps, log)
    raw = agreement(raw_head, eval_states).tolist()
    tuned = agreement(LensHead(engine.model, translators), eval_states).tolist()
    return LensFit(translators, rank, raw, tuned, positions, int(eval_states.shape[1]))
