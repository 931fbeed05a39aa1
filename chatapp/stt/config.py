"""STTConfig: a Qwen2 configuration plus the routing, loss and optimiser settings of `seeds/stt.md` §4–§6.

The config stays `model_type = "qwen2"` on disk so an STT directory still loads into stock
`transformers.Qwen2ForCausalLM` (the router weights are then ignored). An STT directory is recognised by the
`stt_layers` key in its config.json; a plain Qwen2 config loads with fresh routers and `routing_trained = False`.

Defaults follow the public STT code (REFERENCES.md), with deliberate changes that address its failure modes
(`normalize_surprise` is the third, explained in `layers.PredictiveRouter`):
- `g_reg_target`: the gating regulariser pulls each layer's (soft) fraction of gates above `g_threshold`
  towards a target rate instead of pushing g towards zero. With the plain `mean(g)` penalty the only gradient
  reaching `o_ce`/`m_cu` points down forever, which is how the public runs collapsed to selecting nothing.
  Measuring the fraction above the threshold (rather than mean g) keeps the target meaningful while β is still
  small and every g sits near 0.75. `g_reg_target = None` restores the spec's `mean(g)`.
- `router_threshold`: the student is a BCE-calibrated estimate of P(teacher selects), so its decision threshold
  is 0.5 (the Bayes decision), separate from `g_threshold`, which thresholds the teacher's gate score.
"""

from __future__ import annotations

import math
from typing import Literal

from huggingface_hub.dataclasses import strict
from transformers import Qwen2Config

BetaScheduleKind = Literal["cosine", "linear", "constant"]


MAX_PARAMETERS = 10**11
"""Rough upper bound on a model's parameters (layers x hidden x widest matrix) before anything is allocated."""


@strict
class STTConfig(Qwen2Config):
    """Qwen2 plus Subjective Timescale Transformer settings. Every field is saved in config.json."""

    # Which decoder layers are STT layers (ordered). None: every other layer, starting at layer 1.
    stt_layers: list[int] | None = None
    # Fixed-capacity (top-k) fraction γ of tokens an STT layer processes.
    capacity: float = 0.5
    # Teacher targets: threshold on g (variable capacity) when True, top-k at `capacity` when False.
    use_g_threshold_selection: bool = True
    g_threshold: float = 0.75
    # Student decision threshold on the causal router's probability at inference (see module docstring).
    router_threshold: float = 0.5
    train_causal_router: bool = True
    use_causal_router_in_validation: bool = True
    learn_o_ce: bool = True
    learn_m_cu: bool = True
    o_ce_init: float = 1.025
    m_cu_init: float = 1.1
    # Inverse temperatures of the gate, annealed from start to end over `beta_warmup_steps` optimiser steps.
    beta_ce_start: float = 0.1
    beta_ce_end: float = 100.0
    beta_cu_start: float = 0.1
    beta_cu_end: float = 100.0
    beta_warmup_steps: int = 1000
    beta_schedule: str = "cosine"
    # Window (in tokens) of the causal moving average of D_st used by the CU criterion.
    ma_window: int = 100
    # Measure CE and CU in units of that moving average (see PredictiveRouter); False: the spec's raw units.
    normalize_surprise: bool = True
    tpn_loss_weight: float = 0.05
    causal_loss_weight: float = 0.01
    g_reg_loss_weight: float = 0.001
    # Target for each layer's soft selected fraction mean(σ((g - g_threshold) / g_reg_temperature)) in the
    # regulariser (squared distance); None means the spec's plain mean(g) penalty.
    g_reg_target: float | None = 0.5
    g_reg_temperature: float = 0.05
    lr_base: float = 1e-5
    lr_transition_network: float = 1e-3
    lr_predictive_router: float = 1e-2
    lr_causal_router: float = 1e-3
    # Width of the TPN's hidden layer (None: hidden_size) and of the causal router's hidden layer.
    transition_hidden_size: int | None = None
    causal_router_hidden_size: int = 128
    # Optional second, routed block pass in training (§3.1 step 6): selected tokens are recomputed attending only
    # to selected keys, exactly as at inference, and gated by a straight-through copy of g so the LM loss also
    # trains the teacher's biases. Off: the layer's training output is the dense block output (the primary spec).
    gated_second_pass: bool = False
    # False until the routers were trained: then "student" routing runs every token (routing effectively off).
    routing_trained: bool = False

    def __post_init__(self, **kwargs) -> None:
        if self.stt_layers is None:
            self.stt_layers = list(range(1, self.num_hidden_layers, 2))
        self.stt_layers = sorted(set(self.stt_layers))
        super().__post_init__(**kwargs)

    def validate_stt(self) -> None:
        """Reject settings that cannot describe a model, as ValueError (callers reading a user's file turn it into a
        `ModelDirError` / `TrainingError` naming the file): sizes must be positive and fit together, and the model
        must fit in memory at all (a 10**9-wide layer would be tried, and fail only after minutes of allocating)."""
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings")
        for name in sizes:
            value = getattr(self, name, None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        head_dim = getattr(self, "head_dim", None)
        if head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        width = max(self.hidden_size, self.intermediate_size, self.vocab_size)
        if self.num_hidden_layers * self.hidden_size * width > MAX_PARAMETERS:
            raise ValueError("the sizes describe a model of more than 10**11 parameters, which cannot be loaded here")
        bad = [i for i in self.stt_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"stt_layers {bad} out of range for {self.num_hidden_layers} layers")
        if not 0 < self.capacity <= 1:
            raise ValueError(f"capacity must be in (0, 1], got {self.capacity}")
        if self.beta_schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"beta_schedule must be cosine, linear or constant, got {self.beta_schedule!r}")
        if self.ma_window < 1:
            raise ValueError(f"ma_window must be >= 1, got {self.ma_window}")
        if self.use_sliding_window:
            raise ValueError("sliding-window attention is not supported by the STT model")


def schedule_value(start: float, end: float, step: int, steps: int, kind: str) -> float:
    """Anneal from `start` to `end` over `steps` steps; `constant` holds `end` (the trained, hard gate)."""
    if kind == "constant" or steps <= 0:
        return end
    frac = min(max(step, 0), steps) / steps
    if kind == "linear":
        return start + (end - start) * frac
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * frac))


def betas_at(config: STTConfig, step: int | None) -> tuple[float, float]:
    """(β_ce, β_cu) at an optimiser step; None means after training (the end values)."""
    if step is None:
        return config.beta_ce_end, config.beta_cu_end
    steps, kind = config.beta_warmup_steps, config.beta_schedule
    return (
        schedule_value(config.beta_ce_start, config.beta_ce_end, step, steps, kind),
        schedule_value(config.beta_cu_start, config.beta_cu_end, step, steps, kind),
    )


def config_problem(err: Exception) -> str:
    """The message of a config error without the validation framework's wrapping ("Class validation error ...")."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    last = lines[-1] if lines else type(err).__name__
    for prefix in ("ValueError: ", "TypeError: "):
        last = last.removeprefix(prefix)
    return last if len(last) <= 500 else last[:500] + "..."
