"""Full-sequence passes: the teacher's training forward (`docs/stt.md` §3.1 and §5) and evaluation forwards.

Training runs one dense pass per layer. In an STT layer the TPN predicts each token's residual from the previous
token's block output, the predictive router turns the two surprises into the gate g, and g becomes binary
targets (threshold or top-k) that the causal router learns with BCE from the layer's inputs only.

Gradient routing keeps each loss on its own parameter group: the surprises are computed from detached residuals
and predictions, so the gate regulariser reaches only `o_ce`/`m_cu` (never the base model or the TPN), the TPN
sees a detached input, and the causal router sees detached inputs.

Both run the model's one layer loop (`stt.forward.run_layers`) with its back-end for whole sequences: training
as a pass's `after` look at every layer's dense output, evaluation as a policy per layer. Routed passes over a whole
sequence (teacher evaluation, student evaluation and the optional gated second training pass) run
`STTLayer.routed`: in "strict" skip mode an attention mask in which only selected tokens are
keys, in "kv" and "predict" modes plain causal attention (every token's K/V, from its unchanged input; in "predict"
a skipped token carries on with its predicted update, `layers.skipped_output`): the same maths as the
sparse KV cache at inference, written independently of it, which makes each a check on the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from chatapp.stt.config import STTConfig, betas_at
from chatapp.stt.forward import head, run_layers, sequences
from chatapp.stt.layers import (
    STTLayer,
    routed_attention_mask,
    router_probs,
    select,
    self_attention_sink,
    skipped_output,
)

EvalMode = Literal["off", "teacher", "student"]
STAT_NAMES = (
    "teacher_fraction",
    "student_fraction",
    "mean_g",
    "accuracy",
    "f1",
    "tpn_loss",
    "causal_loss",
    "g_reg",
)


@dataclass
class TrainOutput:
    """A training forward: logits (B, T, V), the weighted total loss, its parts and per-STT-layer statistics."""

    logits: torch.Tensor | None  # None when the forward was asked for the loss only (`all_logits=False`)
    loss: torch.Tensor
    losses: dict[str, torch.Tensor]  # "lm", "tpn", "causal", "g_reg" (unweighted) and "total"
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (L_stt,) detached, see STAT_NAMES


@dataclass
class EvalOutput:
    """An evaluation forward: logits (B, T, V); per STT layer router probabilities and routing decisions."""

    logits: torch.Tensor
    router_probs: torch.Tensor  # (L_stt, B, T) causal-router probabilities (on the inputs this mode produced)
    selected: torch.Tensor  # (L_stt, B, T) bool: the layer's block ran for the token
    teacher_targets: torch.Tensor | None = None  # (L_stt, B, T) bool, in teacher mode


@dataclass
class _LayerSignals:
    """What the teacher computes in one STT layer."""

    g: torch.Tensor
    targets: torch.Tensor
    causal_logits: torch.Tensor | None
    tpn_loss: torch.Tensor


def previous_tokens(x: torch.Tensor) -> torch.Tensor:
    """x shifted one step along the sequence, with zeros at t = 0: the x_{t-1} of every token."""
    return F.pad(x[:, :-1], (0, 0, 1, 0))


def select_targets(g: torch.Tensor, config: STTConfig) -> torch.Tensor:
    """Binary routing targets (B, T) from the gate: threshold on g, or the top ⌊γT⌋ tokens of each row.

    The result is a mask, so the chosen tokens keep their sequence order wherever they are gathered later
    (the public code's unsorted top-k indices let tokens attend to the future).
    """
    if config.use_g_threshold_selection:
        return g >= config.g_threshold
    k = max(1, int(config.capacity * g.shape[-1]))
    chosen = g.topk(k, dim=-1).indices.sort(dim=-1).values
    return torch.zeros_like(g, dtype=torch.bool).scatter(-1, chosen, True)


def soft_fraction(g: torch.Tensor, config: STTConfig) -> torch.Tensor:
    """A differentiable estimate of the fraction of tokens whose gate clears `g_threshold`."""
    return torch.sigmoid((g - config.g_threshold) / config.g_reg_temperature).mean()


def gate_regulariser(g: torch.Tensor, config: STTConfig) -> torch.Tensor:
    """The spec's mean(g), or (with `g_reg_target`) the squared distance of the soft selected fraction to it."""
    if config.g_reg_target is None:
        return g.mean()
    return (soft_fraction(g, config) - config.g_reg_target).pow(2)


def _f1(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """F1 of boolean predictions (1.0 when both are empty: perfect agreement on 'select nothing')."""
    tp = (predicted & target).sum().float()
    denominator = (predicted.sum() + target.sum()).float()
    return torch.where(denominator > 0, 2 * tp / denominator.clamp(min=1), torch.ones_like(tp))


def _teacher_signals(
    layer: STTLayer, x: torch.Tensor, y: torch.Tensor, betas: tuple[float, float], config: STTConfig
) -> _LayerSignals:
    """§3.1 steps 2–6 from a layer's input x and dense output y."""
    residual = (y - x).detach()
    predicted = layer.transition_network(previous_tokens(y).detach())
    tpn_loss = F.mse_loss(predicted.float(), residual.float())
    d_st, d_ch = layer.predictive_router.surprises(residual, predicted.detach())
    g = layer.predictive_router.gate(d_st, d_ch, *betas)
    targets = select_targets(g.detach(), config)
    causal_logits = None
    if layer.causal_router is not None:
        causal_logits = layer.causal_router(x.detach(), previous_tokens(x).detach()).float()
    return _LayerSignals(g=g, targets=targets, causal_logits=causal_logits, tpn_loss=tpn_loss)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Next-token cross-entropy; `loss_mask[b, t]` (when given) says whether token t is a training target."""
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    if loss_mask is None:
        return per_token.mean()
    weights = loss_mask[:, 1:].flatten().to(per_token.dtype)
    return (per_token * weights).sum() / weights.sum().clamp(min=1)


def forward_train(
    model: nn.Module,
    ids: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    step: int | None = None,
    all_logits: bool = True,
) -> TrainOutput:
    """The teacher-mode training forward on full (B, T) sequences; see the module docstring.

    With `all_logits=False` and a `loss_mask`, the LM head runs only on the positions the loss reads: with a large
    vocabulary (SmolLM2: 49,152 rows) and chat data that supervises a third of the tokens, that is most of the
    head's cost, and the loss is the same.
    """
    config = model.config
    betas = betas_at(config, step)
    hidden, runner = sequences(model, ids)
    zero = hidden.new_zeros((), dtype=torch.float32)
    tpn_losses, causal_losses, g_regs, rows = [], [], [], []

    def teach(index: int, layer: nn.Module, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Every layer ran densely; an STT layer's output is the teacher's signals' to read (and, with the gated
        second pass, to replace)."""
        if not isinstance(layer, STTLayer):
            return hidden
        signals = _teacher_signals(layer, x, hidden, betas, config)
        targets = signals.targets
        if config.gated_second_pass:
            # Straight-through gate: 1 in the forward pass (hard routing, as at inference), g's gradient backward.
            # Selected tokens attend to the keys the skip mode leaves: in "kv" mode every token's, which is the dense
            # pass just computed (a token's K/V come from its input), so only "strict" runs the block again.
            gate = (targets.to(signals.g.dtype) + signals.g - signals.g.detach())[..., None]
            mask = routed_attention_mask(targets, config.skip_mode)
            routed = hidden if mask is None else layer.block(x, runner.cos, runner.sin, self_attention_sink(mask))
            hidden = torch.where(targets[..., None], x + gate.to(x.dtype) * (routed - x), skipped_output(layer, x))
        if signals.causal_logits is not None:
            causal_loss = F.binary_cross_entropy_with_logits(signals.causal_logits, targets.float())
            predicted = select(torch.sigmoid(signals.causal_logits.detach()), config.router_threshold)
        else:
            causal_loss, predicted = zero, torch.ones_like(targets)
        g_reg = gate_regulariser(signals.g, config)
        tpn_losses.append(signals.tpn_loss)
        causal_losses.append(causal_loss)
        g_regs.append(g_reg)
        rows.append(
            torch.stack(
                [
                    targets.float().mean(),
                    predicted.float().mean(),
                    signals.g.detach().mean(),
                    (predicted == targets).float().mean(),
                    _f1(predicted, targets),
                    signals.tpn_loss.detach(),
                    causal_loss.detach(),
                    g_reg.detach(),
                ]
            )
        )
        return hidden

    hidden = run_layers(model, hidden, runner, after=teach)
    if all_logits or loss_mask is None:
        logits = head(model, hidden)
        lm = lm_loss(logits, ids, loss_mask)
    else:
        logits = None
        read = loss_mask[:, 1:].bool()
        picked = head(model, hidden[:, :-1][read])
        lm = F.cross_entropy(picked.float(), ids[:, 1:][read]) if picked.shape[0] else zero
    losses = {
        "lm": lm,
        "tpn": torch.stack(tpn_losses).mean() if tpn_losses else zero,
        "causal": torch.stack(causal_losses).mean() if causal_losses else zero,
        "g_reg": torch.stack(g_regs).mean() if g_regs else zero,
    }
    total = (
        losses["lm"]
        + config.tpn_loss_weight * losses["tpn"]
        + config.causal_loss_weight * losses["causal"]
        + config.g_reg_loss_weight * losses["g_reg"]
    )
    losses["total"] = total
    table = torch.stack(rows) if rows else hidden.new_zeros(0, len(STAT_NAMES))
    stats = {name: table[:, i].detach() for i, name in enumerate(STAT_NAMES)}
    return TrainOutput(logits=logits, loss=total, losses=losses, stats=stats)


@torch.no_grad()
def forward_eval(
    model: nn.Module, ids: torch.Tensor, mode: EvalMode = "student", *, threshold: float | None = None
) -> EvalOutput:
    """Full-sequence logits with routing off, by the teacher (upper bound) or by the student (as at inference).

    Teacher mode runs each STT layer densely to get g, then recomputes the block for its targets only. The
    causal router's probabilities are reported on the inputs the mode produced, so comparing them with the
    teacher's targets measures the student where the teacher routes.
    """
    if mode not in ("off", "teacher", "student"):
        raise ValueError(f"mode must be 'off', 'teacher' or 'student', got {mode!r}")
    config = model.config
    if mode == "student" and not config.train_causal_router:
        raise ValueError("student evaluation needs a causal router (train_causal_router = false in this config)")
    cutoff = config.router_threshold if threshold is None else threshold
    betas = betas_at(config, None)
    hidden, runner = sequences(model, ids)
    probs, chosen, targets_out = [], [], []

    def policy(index: int, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """An STT layer's router reads its input in every mode; the mode says which tokens it runs."""
        if not isinstance(layer, STTLayer):
            return None
        probs.append(router_probs(layer, x, previous_tokens(x)))
        if mode == "off":
            chosen.append(torch.ones_like(ids, dtype=torch.bool))
            return None
        if mode == "teacher":
            selected = _teacher_signals(layer, x, runner.dense(index, layer, x), betas, config).targets
            targets_out.append(selected)
        else:
            selected = select(probs[-1], cutoff)
        chosen.append(selected)
        return selected

    logits = head(model, run_layers(model, hidden, runner, policy))
    empty = torch.zeros(0, *ids.shape, device=ids.device)
    return EvalOutput(
        logits=logits,
        router_probs=torch.stack(probs) if probs else empty,
        selected=torch.stack(chosen) if chosen else empty.bool(),
        teacher_targets=torch.stack(targets_out) if targets_out else None,
    )
