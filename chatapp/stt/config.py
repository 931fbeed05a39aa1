"""STTConfig: a Qwen2 configuration plus the routing, loss and optimiser settings of `docs/stt.md` §4–§6.

The config stays `model_type = "qwen2"` on disk, with every Qwen2 field, so an STT directory still loads into stock
`transformers.Qwen2ForCausalLM` (the router weights are then ignored). An STT directory is recognised by the
`stt_layers` key in its config.json; a plain Qwen2 config loads with fresh routers and `routing_trained = False`.

It is a plain dataclass, not `transformers.Qwen2Config`: importing transformers' configuration machinery costs about
0.7 s of every command's start-up, and nothing at run time needs it. Like transformers' config it takes the keys it
does not know (`architectures`, `torch_dtype`, ...) and writes them back unchanged, reads the older top-level
`rope_theta`, and checks every known key's type when it is built (`TypeError` / `ValueError` naming the key).

Defaults follow the public STT code (docs/stt.md, last section), with deliberate changes that address its failure modes
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

import json
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from chatapp.routing_levels import level_thresholds, pick_level

BetaScheduleKind = Literal["cosine", "linear", "constant"]
# What an STT layer does with a token it skips (see `skip_mode` below and `chatapp.stt.layers`).
SKIP_MODES = ("strict", "kv", "predict")


MAX_PARAMETERS = 10**11
"""Rough upper bound on a model's parameters (layers x hidden x widest matrix) before anything is allocated."""

DEFAULT_ROPE_THETA = 10000.0


@dataclass(init=False)
class STTConfig:
    """Qwen2 plus Subjective Timescale Transformer settings. Every field is saved in config.json."""

    # ---- Qwen2 (the names and defaults of transformers' Qwen2Config)
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list[str] | None = None
    attention_dropout: float = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # ---- STT
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
    # What a skipped token leaves in an STT layer. "strict" (the spec): nothing, it passes through unchanged and
    # stores no K/V there. "kv": its K and V, projected from its unchanged input, are stored (no query, attention
    # output or MLP), so later tokens still attend to it. The same in every path: prefill, decode, training, eval.
    skip_mode: str = "strict"
    # "predict" is "kv" plus an update for the skipped token: its residual stream gets f(norm(x)), a rank-r linear
    # map of the layer's normed input fitted to the block's residual Δx (`layers.SkipPredictor`), so a skipped token
    # moves roughly where the block would have moved it.
    predictor_rank: int = 64
    # Whether a prompt's tokens (the engine's prefill) are routed. False runs them through every layer and routes
    # only the tokens the model generates: what the user wrote (names, numbers a later answer copies) stays intact,
    # and a reply's compute saved, which counts generated tokens, is the same. On the default model's predict-mode
    # routing it won back the tool calls, follow-up calls and most letter counts that routed prompts lost, not all
    # of recall (model card, "Predict-mode routing").
    route_prompt: bool = True
    # Named operating points (level -> `router_threshold`): what `--routing LEVEL` picks. "off" is always a level
    # (routing off); a model without levels has one more, "default", its own `router_threshold`.
    routing_levels: dict | None = None
    # False until the routers were trained: then "student" routing runs every token (routing effectively off).
    routing_trained: bool = False

    # Keys of config.json this class does not know, kept to be written back as they were.
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __init__(self, **values: Any) -> None:
        """Build from keyword values (the keys of config.json). Unknown keys go to `extra`; a known key of the wrong
        type raises TypeError naming it. `rope_theta` (older configs) becomes `rope_parameters`."""
        values.pop("model_type", None)
        rope_theta = values.pop("rope_theta", None)
        rope_scaling = values.pop("rope_scaling", None)
        known = {f.name: f for f in fields(self) if f.name != "extra"}
        self.extra = {k: values.pop(k) for k in list(values) if k not in known}
        if "extra" in values:
            self.extra.update(values.pop("extra") or {})
        hints = _field_types()
        for name, spec in known.items():
            value = values[name] if name in values else _default(spec)
            setattr(self, name, _checked(name, value, hints[name]))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.rope_parameters is None:
            theta = DEFAULT_ROPE_THETA if rope_theta is None else _checked("rope_theta", rope_theta, float)
            self.rope_parameters = {"rope_type": "default", "rope_theta": theta}
        if rope_scaling:  # transformers' name for a non-default rope; kept so the check below can name it
            self.rope_parameters = {**self.rope_parameters, **dict(rope_scaling)}
        self.rope_parameters.setdefault("rope_type", self.rope_parameters.pop("type", "default"))
        self.rope_parameters.setdefault("rope_theta", DEFAULT_ROPE_THETA if rope_theta is None else rope_theta)
        if not self.use_sliding_window:
            self.sliding_window = None
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.stt_layers is None:
            self.stt_layers = list(range(1, self.num_hidden_layers, 2))
        self.stt_layers = sorted(set(self.stt_layers))
        self.validate_stt()  # a config that cannot describe a model is refused where it is made, as transformers' is

    # ------------------------------------------------------------------------------------------ reading, writing
    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def head_width(self) -> int:
        """Each attention head's width: `head_dim` when the config names one, else hidden_size / heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        """Every field, the unknown keys read with it, and `model_type`: what config.json holds."""
        out = dict(self.extra)
        out.update({f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "extra"})
        if out.get("head_dim") is None:
            out.pop("head_dim", None)
        out["model_type"] = "qwen2"
        return out

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> STTConfig:
        return cls(**values)

    @classmethod
    def from_json_file(cls, path: str | Path) -> STTConfig:
        """Read a config.json (OSError, json.JSONDecodeError, TypeError or ValueError on a bad file)."""
        values = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(values, dict):
            raise TypeError(f"{path} does not hold a JSON object")
        return cls(**values)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> STTConfig:
        return cls.from_json_file(Path(model_dir) / "config.json")

    def save_pretrained(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(self.to_json_string(), encoding="utf-8")

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
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
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
        if self.skip_mode not in SKIP_MODES:
            raise ValueError(f"skip_mode must be one of {', '.join(SKIP_MODES)}, got {self.skip_mode!r}")
        rank = self.predictor_rank
        if self.skip_mode == "predict" and (isinstance(rank, bool) or not 1 <= rank <= self.hidden_size):
            raise ValueError(f"predictor_rank must be in 1..hidden_size ({self.hidden_size}), got {self.predictor_rank}")
        for level, threshold in (self.routing_levels or {}).items():
            if level == "off" or not isinstance(threshold, int | float) or not 0 <= threshold <= 1:
                raise ValueError(f"routing_levels: {level!r}: a threshold in [0, 1] per level other than 'off'")
        if self.ma_window < 1:
            raise ValueError(f"ma_window must be >= 1, got {self.ma_window}")
        if self.use_sliding_window:
            raise ValueError("sliding-window attention is not supported by the STT model")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (Qwen2 models use 'silu')")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported (only the default rotary embedding)")
        theta = self.rope_parameters.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
            raise ValueError(f"rope_theta must be a positive number, got {theta!r}")


def routing_levels(config: STTConfig) -> dict[str, float | None]:
    """The model's routing levels (`chatapp.routing_levels`): level -> threshold, None for "off"."""
    return level_thresholds(config.routing_levels, config.router_threshold)


def routing_level(config: STTConfig, requested: str | None) -> str:
    """The level a request runs at (`chatapp.routing_levels.pick_level`)."""
    return pick_level(routing_levels(config), requested)


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


def _default(spec: Any) -> Any:
    from dataclasses import MISSING

    return spec.default_factory() if spec.default_factory is not MISSING else spec.default


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(STTConfig)


def _checked(name: str, value: Any, kind: Any) -> Any:
    """`value` if it is of the annotated `kind` (an int also passes as a float and becomes one), else TypeError."""
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    for option in options:
        if option is type(None) and value is None:
            return None
        base = typing.get_origin(option) or option
        if base is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base in (bool, str, dict) and isinstance(value, base):
            return value
        if base is list and isinstance(value, list | tuple):
            (item,) = typing.get_args(option) or (Any,)
            if item is Any or all(_is(v, item) for v in value):
                return list(value)
        if base is Literal and value in typing.get_args(option):
            return value
    raise TypeError(f"{name} must be of type {_type_name(kind)}, got {value!r}")


def _is(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _type_name(kind: Any) -> str:
    return str(kind).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _plain(value: Any) -> Any:
    """A JSON-ready copy (lists and dicts copied, so `to_dict` never aliases the config's own)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
