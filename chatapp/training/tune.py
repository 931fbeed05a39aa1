"""Fine-tune a backbone to tolerate its own routing: LoRA trained with the routers' skips in the loop.

The frozen-backbone fit (`chatapp.training.route`) found that most of what skipping costs is the backbone's, not the
router's: even the update score's own choice of tokens costs ~14% perplexity at 30% skipped in seven layers of the default
model. So the backbone learns to do without the skipped work:

- The student is the model with its routers deciding, in the skip mode it will run (in "kv" mode a skipped token's
  keys and values are the dense ones, so a full-sequence pass computes every block and keeps the computed tokens'
  outputs: exactly what the cached decode does). Each step draws what the calibration may choose: a skip rate from
  its rates and a prefix of the candidate layers (cheapest first), so the adapters tolerate all of them rather than
  only the heaviest. A share of the steps run dense (`dense_share`): the adapters serve routing off too, and without
  these steps they drift the dense path (measured: x1.10 perplexity with routing off after 80-100 steps).
- The target is the model's own dense prediction (its top `top_k` probabilities at each scored position, computed
  once from the dense pass): self-distillation keeps what the model answers, including tool calls and recall, and
  needs no data beyond the replies the fit already has. Training on hard labels would sharpen the model on its own
  greedy text and flatter the perplexity the calibration reads.
- LoRA (peft) on every projection of every block; the routers stay frozen (they are refitted on the tuned backbone).
  When done the adapters are merged into the weights and returned, so the int4 format can keep them apart.

Resumable: the adapters and the optimizer are saved atomically every `checkpoint_every` steps, and a step's batch and
rate depend only on the seed and the step, so a resumed run is the run that was not interrupted.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple

import torch

from chatapp.stt import STTForCausalLM
from chatapp.stt.forward import head, run_layers, sequences
from chatapp.stt.layers import router_probs, select
from chatapp.stt.teacher import previous_tokens
from chatapp.training.checkpoint import save_state
from chatapp.training.schedule import warmup_cosine
from chatapp.training.steps import Clipping, Steps

Log = Callable[[str], None]
Decide = Callable[[int, torch.Tensor, float], torch.Tensor]  # (layer, its input (B, T, D), rate) -> selected (B, T)
Adapters = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A (r, in), B (out, r), scale folded into B)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class TuneOptions:
    steps: int = 0  # 0: no fine-tune
    rank: int = 16
    alpha: int = 32
    lr: float = 2e-4
    warmup: int = 10
    dense_share: float = 0.25  # the share of steps with nothing routed
    top_k: int = 32  # the dense prediction kept per position: ~all of its probability mass on a chat model
    # A routed step routes a prefix of the layers (the calibration may choose any), or every one (a routing that
    # is already chosen, as it is served)
    layer_prefixes: bool = True
    checkpoint_every: int = 20
    # Where the steps run ("cuda": a GPU, where a step takes a fraction of the ~10 s it takes on 2 CPU cores); the
    # model goes back to its own device merged, and a run resumes on either.
    device: str = "cpu"


@dataclass
class TuneBatch:
    """Right-padded token rows and what the dense model predicted at their scored positions."""

    ids: torch.Tensor  # (B, T)
    valid: torch.Tensor  # (B, T): the tokens the routers decide on (the others, padding included, run every block)
    scored: torch.Tensor  # (B, T - 1): the prediction at t of ids[t + 1] counts
    top_ids: torch.Tensor  # (N, k) for the N scored positions, in row-major order
    top_logp: torch.Tensor  # (N, k) the dense log-probabilities of `top_ids`

    def to(self, device: torch.device) -> TuneBatch:
        return TuneBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


@torch.no_grad()
def dense_targets(
    model: STTForCausalLM, ids: torch.Tensor, valid: torch.Tensor, scored: torch.Tensor, final: torch.Tensor, k: int
) -> TuneBatch:
    """A `TuneBatch` from a dense pass's final hidden state `final` (B, T, D) (before the final norm)."""
    logits = head(model, final[:, :-1][scored]).float()
    top = logits.log_softmax(-1).topk(k, dim=-1)
    return TuneBatch(ids, valid, scored, top.indices, top.values)


def routed_logits(
    model: STTForCausalLM, batch: TuneBatch, layers: Sequence[int], decide: Decide, rate: float, skip_mode: str
) -> torch.Tensor:
    """Log-probabilities (N, V) at the scored positions with `layers` routed by `decide` at `rate`, with grad."""
    hidden, runner = sequences(model, batch.ids, skip_mode)

    def policy(index: int, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        if index not in layers:
            return None
        with torch.no_grad():
            return decide(index, x, rate) | ~batch.valid

    hidden = run_layers(model, hidden, runner, policy)
    return head(model, hidden[:, :-1][batch.scored]).float().log_softmax(-1)


def served_routing(model: STTForCausalLM) -> Decide:
    """The model's own routers deciding, each token kept when its router's probability reaches the threshold: the
    routing decode runs (the routers' cutoffs are folded into their biases, so a threshold is a served level)."""

    def decide(layer: int, x: torch.Tensor, threshold: float) -> torch.Tensor:
        return select(router_probs(model.model.layers[layer], x, previous_tokens(x)), threshold)

    return decide


class Distilled(NamedTuple):
    loss: torch.Tensor  # the step's distillation loss (`distillation_loss`)


def distillation_loss(logp: torch.Tensor, batch: TuneBatch) -> torch.Tensor:
    """Cross-entropy of the student against the dense prediction's top k: -Σ p_dense log p_student, mean over
    positions (equal to the KL divergence up to the dense entropy, a constant)."""
    return -(batch.top_logp.exp() * logp.gather(-1, batch.top_ids)).sum(-1).mean()


def _inject_lora(model: STTForCausalLM, options: TuneOptions) -> list[torch.nn.Parameter]:
    from peft import LoraConfig, inject_adapter_in_model

    for param in model.parameters():
        param.requires_grad_(False)
    config = LoraConfig(r=options.rank, lora_alpha=options.alpha, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
    # Only the decoder blocks: the routers' own linear layers are not adapted (their names differ anyway).
    inject_adapter_in_model(config, model.model.layers)
    params = [p for name, p in model.named_parameters() if "lora_" in name]
    for param in params:
        param.requires_grad_(True)
    return params


def _lora_modules(model: STTForCausalLM) -> list[tuple[str, torch.nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def merge_lora(model: STTForCausalLM) -> Adapters:
    """Merge every LoRA module of `model` into its base weight and put the plain layer back; return the adapters."""
    adapters: Adapters = {}
    for name, module in _lora_modules(model):
        base = module.get_base_layer()
        a = module.lora_A["default"].weight.detach().float()
        b = module.lora_B["default"].weight.detach().float() * module.scaling["default"]
        with torch.no_grad():
            base.weight += (b @ a).to(base.weight.dtype)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, base)
        adapters[name] = (a.contiguous(), b.contiguous())
    return adapters


def _draw(
    batches: Sequence[TuneBatch],
    layers: Sequence[int],
    rates: Sequence[float],
    dense_share: float,
    seed: int,
    step: int,
    prefixes: bool = True,
) -> tuple[TuneBatch, Sequence[int], float]:
    """A step's batch, routed layers (a prefix of `layers`; none on a dense step) and rate: from the seed and the
    step alone, so that a resumed run draws what the uninterrupted one did."""
    pick = random.Random(seed * 1_000_003 + step)
    batch, rate = batches[pick.randrange(len(batches))], pick.choice(list(rates))
    if pick.random() < dense_share:
        return batch, (), rate
    return batch, (layers[: pick.randint(1, len(layers))] if prefixes else layers), rate


def tune(
    model: STTForCausalLM,
    batches: Sequence[TuneBatch],
    layers: Sequence[int],
    decide: Decide,
    rates: Sequence[float],
    skip_mode: str,
    options: TuneOptions,
    log: Log,
    *,
    checkpoint: Path | None = None,
    seed: int = 0,
) -> Adapters:
    """Train LoRA on `model` (in place) for `options.steps` steps with `layers` routed by `decide`, then merge it:
    the adapters merged (for `stt.io.save_merged_adapters`), on the model's device. `checkpoint`: where the run is
    saved and resumed. The steps run on `options.device`; the model is back on its own device when this returns."""
    device = torch.device(options.device)
    home = next(model.parameters()).device
    batches = [b.to(device) for b in batches]
    model.to(device)
    try:
        params = _inject_lora(model, options)
        optimizer = torch.optim.AdamW(params, lr=options.lr, betas=(0.9, 0.95), weight_decay=0.0)
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        step = 0
        if checkpoint is not None and checkpoint.is_file():
            saved = torch.load(checkpoint, weights_only=True, map_location="cpu")
            if _resume_key(TuneOptions(**saved["options"])) == _resume_key(options) and saved["names"] == names:
                for param, tensor in zip(params, saved["lora"], strict=True):
                    param.data.copy_(tensor)
                optimizer.load_state_dict(saved["optimizer"])
                step = int(saved["step"])
                log(f"tune: resumed from {checkpoint} at step {step}")

        def save(done: int) -> None:
            if checkpoint is not None:
                state = {
                    "step": done,
                    "options": asdict(options),
                    "names": names,
                    "lora": [p.detach().clone() for p in params],
                    "optimizer": optimizer.state_dict(),
                }
                save_state(state, checkpoint)

        began, recent = time.perf_counter(), []

        def compute(at: int) -> Distilled:
            batch, routed, rate = _draw(batches, layers, rates, options.dense_share, seed, at, options.layer_prefixes)
            return Distilled(distillation_loss(routed_logits(model, batch, routed, decide, rate, skip_mode), batch))

        def after(done: int, out: Distilled) -> None:
            recent.append(float(out.loss.detach()))
            if done % 10 == 0 or done == options.steps:
                per_step = (time.perf_counter() - began) / len(recent)
                last = recent[-10:]
                log(f"tune step {done}/{options.steps}: loss {sum(last) / len(last):.4f} ({per_step:.1f} s/step)")

        model.train()
        Steps(
            optimizer,
            compute,
            lr=lambda at, group: options.lr * warmup_cosine(at, options.steps, options.warmup),
            clip=Clipping([params], 1.0),
            after=after,
            checkpoint=save,
            checkpoint_every=options.checkpoint_every,
        ).run(step, options.steps)
        model.eval()
        adapters = merge_lora(model)
    finally:
        model.to(home)
    return {name: (a.to(home), b.to(home)) for name, (a, b) in adapters.items()}


def _resume_key(options: TuneOptions) -> dict:
    """What a saved run must share with this one to go on from it: all but the step count and the device."""
    return {k: v for k, v in asdict(options).items() if k not in ("steps", "device")}
