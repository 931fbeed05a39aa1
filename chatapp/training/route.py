"""Fit a model's STT routing with its backbone frozen: `chatapp route MODEL_DIR`.

Minutes on 2 CPU cores, on any chatapp model directory (a converted GGUF, a Qwen2 directory, the default model):

1. Data: the model's own greedy answers (routing off, float32) to the prompts it is given (`chatapp route` gives
   the set the model's recipe ships with it, `chatapp.models.route_prompts`, or the user's `--prompts` file), as
   whole token sequences with the results the engine forced. Self-distilled text is what the model sees at run time and needs no download. A quarter is held out.
2. One dense pass caches every layer's input. The update score of a token at a layer is ‖Δx‖², the size of the
   block's update to it (its residual, the spec's D_st): the oracle (`benchmarks/stt_oracle.py`, the default model's card) found it ranks
   tokens as well as the TPN error and better than the gate g, and it needs no trained part.
3. Which layers, unless given: each layer alone skips the half of the held-out tokens with the lowest score, in the
   chosen skip mode (the oracle), and the layers whose perplexity suffers least are the candidates.
4. Routers: each candidate's causal router is fitted from scratch on the cached dense inputs (x_t, x_{t-1}) to the
   update score's decision "‖Δx‖² in the upper half of its sequence" (BCE). The backbone is frozen, so an epoch is a pass
   over a few MB of cached features and many epochs are cheap.
5. Calibration, one cutoff per layer: at a share `rate`, each layer's cutoff is the `rate` quantile of its router's
   probabilities on the fit data. Student-routed held-out perplexity (relative to routing off) and a copy probe
   (does every digit the model copied into a tool call survive?) choose the rate and how many candidates route:
   the most block work skipped within the perplexity `budget` with the copy probe intact.
   With the prompts dense (`RouteOptions.dense_prompts`, a model whose config says `route_prompt` false), the
   routers decide on the replies' tokens alone, so every step from the layer sweep on (router targets, quantiles,
   held-out runs, compute saved, the tune) reads those tokens and runs the prompts through every layer: a prompt's
   tokens are easier to skip than a reply's, and a fit that counts them sets cutoffs that skip less of the replies.
6. Each layer's cutoff is folded into its router's output bias, so the probability 0.5 means "at this layer's
   cutoff": the model keeps one `router_threshold` (0.5), which the app's routing-threshold setting moves for all
   layers at once.

Not done here: fine-tuning the backbone to tolerate the skips (the recipe's gated phase, `chatapp train`).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from chatapp import store
from chatapp.compute_saved import compute_saved, skip_cost
from chatapp.errors import TrainingError
from chatapp.stt import STTConfig, STTForCausalLM
from chatapp.stt.config import SKIP_MODES
from chatapp.stt.forward import SequenceLayers, head, run_layers, sequences
from chatapp.stt.io import (
    CONFIG_NAME,
    MERGED_ADAPTERS_NAME,
    ROUTER_PARTS,
    WEIGHTS_NAME,
    load_merged_adapters,
    save_merged_adapters,
    save_model,
)
from chatapp.stt.layers import CausalRouter, SkipPredictor, rms_norm, router_probs, select
from chatapp.stt.teacher import previous_tokens
from chatapp.training.predictor import PredictorFit, fit_predictors
from chatapp.training.tune import Adapters, TuneOptions, dense_targets, tune

Log = Callable[[str], None]
REPORT_NAME = "routing.json"  # the fit's record, written beside the routed model
GENERATE_BATCH = 16  # rows per self-distillation batch: bounds the cache's memory
PADDED_POSITIONS = 2048  # positions per padded batch of the passes (sequences of similar length together)
SWEEP_RATE = 0.5  # the share each layer skips alone when candidates are measured
COPY_SLACK = 0.05  # the copy probe may lose this share (one probe in twenty) to count as intact
MAX_SEED = 2**32 - 1  # a layer's fit seeds with seed * 1000 + layer, which torch takes up to 2**63


@dataclass
class RouteOptions:
    """What `route` fits. `layers` None: chosen by measurement, at most `max_layers`."""

    layers: list[int] | None = None
    max_layers: int = 12
    skip_mode: str = "kv"
    predictor_rank: int = 64  # "predict" mode: the rank of each layer's skip predictor (`training.predictor`)
    budget: float = 1.10  # held-out perplexity, student routing / routing off
    rates: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6)
    # What the model answers, each conversation's user turns (`training.corpus.read_dialogues`): the data.
    dialogues: list[list[str]] = field(default_factory=list)
    answer_tokens: int = 128
    epochs: int = 40
    seed: int = 0
    tune: TuneOptions = field(default_factory=TuneOptions)  # the backbone's fine-tune (`tune.steps` 0: none)
    # Prompts through every layer, only the replies routed (`STTConfig.route_prompt` false): the fit then routes,
    # fits, calibrates, counts and tunes on the replies' tokens alone, as the model will be served. None: as the
    # model's config says.
    dense_prompts: bool | None = None

    def check(self, layer_count: int, context: int) -> None:
        """`TrainingError` naming the first option a model of `layer_count` layers and a context of `context`
        tokens cannot be routed with: checked before the model loads (`chatapp route`) and again by `route`."""
        options = "see `chatapp route --help`"
        if self.layers is not None:
            if not self.layers:
                raise TrainingError("--layers names no layer", hint="give layer numbers, e.g. --layers 3,4,5")
            if bad := [layer for layer in self.layers if not 0 <= layer < layer_count]:
                raise TrainingError(
                    f"--layers: layers {bad} do not exist: the model has layers 0-{layer_count - 1}",
                    hint=f"give layer numbers from 0 to {layer_count - 1}, e.g. --layers {min(3, layer_count - 1)}",
                )
        if self.skip_mode not in SKIP_MODES:
            raise TrainingError(
                f"--skip-mode {self.skip_mode!r} is not a skip mode", hint=f"use one of {', '.join(SKIP_MODES)}"
            )
        if not (math.isfinite(self.budget) and self.budget >= 1.0):
            raise TrainingError(
                f"--budget must be a finite perplexity ratio of at least 1.0, got {self.budget}",
                hint="e.g. --budget 1.10 (routed perplexity at most 10% above routing off)",
            )
        for name, value, low, high in (
            ("--max-layers", self.max_layers, 1, None),
            ("--answer-tokens", self.answer_tokens, 8, context),
            ("epochs", self.epochs, 1, None),  # not a command-line option: the API's
            ("--seed", self.seed, 0, MAX_SEED),
            ("--tune-steps", self.tune.steps, 0, None),
        ):
            if value < low or (high is not None and value > high):
                limit = f"at least {low}" if high is None else f"between {low} and {high}"
                raise TrainingError(f"{name} must be {limit}, got {value}", hint=options)
        if not self.rates or not all(0.0 < rate < 1.0 for rate in self.rates):
            raise TrainingError(f"the rates {list(self.rates)} must lie between 0 and 1", hint=options)
        check_tune_device(self.tune.device)


def check_tune_device(name: str) -> None:
    """`TrainingError` unless `name` is a device this machine has: "cpu", or "cuda[:N]" with a GPU there."""
    hint = "use --tune-device cpu, or cuda on a machine with an NVIDIA GPU and a CUDA build of torch"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TrainingError(f"--tune-device {name!r} is not a device", hint=hint) from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise TrainingError(f"--tune-device {name}: this machine has no such CUDA device", hint=hint)
    if device.type not in ("cpu", "cuda"):
        raise TrainingError(f"--tune-device {name!r}: only cpu and cuda are supported", hint=hint)


@dataclass
class Measure:
    """Student routing at one setting, on the held-out conversations."""

    layers: list[int]
    rate: float  # the calibration's share of tokens each layer skips; for a level (`measure_levels`) its threshold
    ppl_ratio: float
    copy: float
    compute_saved: float  # share of all block computations skipped (`chatapp.compute_saved`)
    processed: dict[int, float]  # per routed layer: share of tokens it computed


@dataclass
class RouteReport:
    """What the fit did and measured; written as `routing.json` beside the model."""

    skip_mode: str
    data: str
    dense_prompts: bool  # only the replies' tokens routed (and counted in compute saved)
    fit_tokens: int
    held_out_tokens: int
    dense_ppl: float  # routing off, the model as given
    dense_copy: float
    copy_probes: int
    single_layer: dict[int, float] = field(default_factory=dict)  # layer -> ppl ratio skipping SWEEP_RATE alone
    tried: list[Measure] = field(default_factory=list)
    chosen: Measure | None = None
    cutoffs: dict[int, float] = field(default_factory=dict)
    f1: dict[int, float] = field(default_factory=dict)  # router vs update-score decisions, held out, dense stream
    seconds: dict[str, float] = field(default_factory=dict)
    tune_steps: int = 0
    tuned_dense_ppl: float | None = None  # routing off, after the fine-tune (same held-out replies)
    # "predict" mode, per fitted layer: the share of held-out E‖Δx‖² its predictor explains
    predictor_explained: dict[int, float] = field(default_factory=dict)
    # Operating points over the chosen routing: level -> threshold, and what each measured (`measure_levels`)
    levels: dict[str, float] = field(default_factory=dict)
    level_measures: dict[str, Measure] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def summary(self) -> str:
        chosen = self.chosen
        if chosen is None or not chosen.layers:
            return f"no layer can route within the perplexity budget (dense perplexity {self.dense_ppl:.3f})"
        processed = ", ".join(f"L{layer} {share:.0%}" for layer, share in chosen.processed.items())
        tuned = f" (backbone tuned {self.tune_steps} steps)" if self.tune_steps else ""
        return (
            f"routed {len(chosen.layers)} layers{tuned} ({self.skip_mode} mode) at rate {chosen.rate:.2f}: "
            f"compute saved {chosen.compute_saved:.1%} of all block work, perplexity x{chosen.ppl_ratio:.3f}, "
            f"copy probe {chosen.copy:.0%} (dense {self.dense_copy:.0%}); processed {processed}"
            + "".join(
                f"\nlevel {name} (threshold {m.rate}): compute saved {m.compute_saved:.1%}, perplexity "
                f"x{m.ppl_ratio:.3f}, copy probe {m.copy:.0%}"
                for name, m in self.level_measures.items()
            )
        )


# ------------------------------------------------------------------------------------------------------- data
@dataclass
class Conversation:
    """A prompt and the model's reply as one sequence. `scored[t]`: the prediction made at t of `ids[t + 1]` counts
    (a token the model sampled, not one the system forced); `copy[t]`: `ids[t + 1]` is a digit inside a tool call."""

    ids: list[int]
    scored: list[bool]
    copy: list[bool]


def self_distilled(loaded: Any, options: RouteOptions, log: Log) -> list[Conversation]:
    """The model's own greedy replies, routing off, to `options.dialogues` (tool calls run, results forced), turn by
    turn: each later user turn follows the model's own earlier replies. A conversation scores its last reply.
    `loaded` writes them: the model as it is served (the CLI passes its default format, which on a CPU decodes in
    one native call a step of any batch size) or the float32 model itself."""
    from chatapp.engine.engine import Engine
    from chatapp.settings import GenerationSettings

    chat_format = loaded.chat_format
    # The calls unconstrained: the grammar would make a call differ from the raw argmax the copy probe reads.
    engine = Engine(loaded.model, loaded.tokenizer, chat_format, tool_grammar=False)
    settings = GenerationSettings(max_tokens=options.answer_tokens, routing="off")
    start_id, end_id = getattr(chat_format, "python_start_id", None), getattr(chat_format, "python_end_id", None)
    dialogues = options.dialogues
    step = GENERATE_BATCH
    messages: list[list[dict[str, Any]]] = [[] for _ in dialogues]
    out: list[Conversation | None] = [None] * len(dialogues)
    for turn in range(max((len(d) for d in dialogues), default=0)):
        rows = [i for i, dialogue in enumerate(dialogues) if len(dialogue) > turn]
        for first in range(0, len(rows), step):
            chunk = rows[first : first + step]
            rendered = []
            for i in chunk:
                messages[i].append({"role": "user", "content": dialogues[i][turn]})
                rendered.append(chat_format.render_for_completion(messages[i]))
            for i, prompt, reply in zip(chunk, rendered, engine.generate_batch(rendered, settings), strict=True):
                messages[i].append({"role": "assistant", "content": reply.content})
                if turn == len(dialogues[i]) - 1:
                    out[i] = conversation(prompt, reply.events, start_id, end_id, chat_format.decode)
            # A turn of a few hundred replies takes minutes on a CPU: say how far it is.
            log(f"self-distilling turn {turn + 1}: {first + len(chunk)}/{len(rows)} replies")
    return [c for c in out if c is not None]


def conversation(
    prompt: list[int], events: Sequence[Any], start_id: int | None, end_id: int | None, decode
) -> Conversation:
    """A `Conversation` from a prompt and its reply's token events."""
    ids = list(prompt) + [e.token for e in events]
    scored = [False] * (len(prompt) - 1) + [not e.forced for e in events]
    copy = [False] * (len(ids) - 1)
    inside = False
    for j, event in enumerate(events):
        if event.token == start_id:
            inside = True
        elif event.token == end_id:
            inside = False
        elif inside and not event.forced and any(c.isdigit() for c in decode([event.token])):
            copy[len(prompt) + j - 1] = True
    return Conversation(ids, scored, copy)


def conversations_cached(
    loaded: Any, options: RouteOptions, log: Log, cache_dir: Path | None, speaker: Any | None = None
) -> list[Conversation]:
    """`self_distilled` by `speaker` (default: `loaded`), kept in `cache_dir` for the next fit of the same weights,
    options and speaker's format (a second run, in another skip mode or with other layers, then starts at the dense
    pass). A damaged entry is made again."""
    speaker = speaker or loaded
    if cache_dir is None:
        return self_distilled(speaker, options, log)
    fmt = getattr(speaker.model, "weight_format", None) or "float32"
    path = cache_dir / f"{backbone_digest(loaded.model, options)}{'' if fmt == 'float32' else '-' + fmt}.json"
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        found = [Conversation(r["ids"], r["scored"], r["copy"]) for r in rows]
        log(f"self-distilled replies from {path}")
        return found
    except (OSError, ValueError, KeyError, TypeError):
        pass
    made = self_distilled(speaker, options, log)
    cache_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps([asdict(c) for c in made])
    store.atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return made


def backbone_digest(model: STTForCausalLM, options: RouteOptions) -> str:
    """What the replies depend on: every weight but the routing parts (~1 s for 135M parameters), and the options
    that make the data. A model routed in place keeps its digest, so a second fit reuses the first one's replies."""
    digest = hashlib.sha256(json.dumps([options.dialogues, options.answer_tokens]).encode())
    for name, tensor in sorted(model.state_dict().items()):
        if not any(part in name for part in ROUTER_PARTS):
            digest.update(name.encode())
            digest.update(tensor.detach().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()[:20]


@dataclass
class Batch:
    """Right-padded conversations: ids and valid (B, T); scored and copy (B, T - 1) as in `Conversation`; routable
    (B, T), the tokens the routers decide on: every valid one, or with the prompts dense the reply's alone (from its
    first token, which the model always samples, on; the results the engine forced in it included, as served)."""

    ids: torch.Tensor
    valid: torch.Tensor
    scored: torch.Tensor
    copy: torch.Tensor
    routable: torch.Tensor


def batches(
    conversations: Sequence[Conversation], pad: int, dense_prompts: bool = False, positions: int = PADDED_POSITIONS
) -> list[Batch]:
    """Conversations sorted by length in batches of at most `positions` padded positions."""
    order = sorted(conversations, key=lambda c: len(c.ids))
    groups: list[list[Conversation]] = [[]]
    for conv in order:
        if groups[-1] and len(conv.ids) * (len(groups[-1]) + 1) > positions:
            groups.append([])
        groups[-1].append(conv)
    out = []
    for group in groups:
        width = max(len(c.ids) for c in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        valid = torch.zeros(len(group), width, dtype=torch.bool)
        scored = torch.zeros(len(group), width - 1, dtype=torch.bool)
        copy = torch.zeros(len(group), width - 1, dtype=torch.bool)
        routable = torch.zeros(len(group), width, dtype=torch.bool)
        for b, conv in enumerate(group):
            n = len(conv.ids)
            ids[b, :n] = torch.tensor(conv.ids)
            valid[b, :n] = True
            scored[b, : n - 1] = torch.tensor(conv.scored, dtype=torch.bool)
            copy[b, : n - 1] = torch.tensor(conv.copy, dtype=torch.bool)
            reply = next((t + 1 for t, s in enumerate(conv.scored) if s), n) if dense_prompts else 0
            routable[b, reply:n] = True
        out.append(Batch(ids, valid, scored, copy, routable))
    return out


# ------------------------------------------------------------------------------------------------- the passes
@dataclass
class Cached:
    """A batch's dense pass: the input of every layer (index N: the final hidden state) and the rotary tables."""

    batch: Batch
    inputs: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor

    def update_score(self, layer: int, skips: Skips | None = None) -> torch.Tensor:
        """The update score (B, T) of `layer`'s dense block (higher = process): how much the block changes each
        token, ‖Δx‖² per dimension, the spec's D_st; where `skips` has a predictor for the layer ("predict" mode), what it fails to predict,
        ‖Δx − f(norm(x))‖² (the spec's change surprise D_ch, with f as the transition model)."""
        x = self.inputs[layer]
        residual = self.inputs[layer + 1] - x
        if skips is not None and layer in skips.predictors:
            residual = residual - skips.update(layer, x)
        return residual.float().pow(2).mean(-1)


@dataclass
class Skips:
    """What a token a routed layer skips carries on, during a fit: `mode` ("strict", "kv", "predict") and, in
    "predict" mode, each layer's fitted predictor (they join the routed model's layers when it is built)."""

    model: STTForCausalLM
    mode: str
    predictors: dict[int, SkipPredictor] = field(default_factory=dict)
    fits: dict[int, PredictorFit] = field(default_factory=dict)

    def update(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """f(norm(x)) of `layer`'s predictor."""
        return self.predictors[layer](rms_norm(self.model.model.layers[layer].input_layernorm, x))


@torch.no_grad()
def dense_pass(model: STTForCausalLM, batch: Batch) -> Cached:
    hidden, runner = sequences(model, batch.ids)
    inputs: list[torch.Tensor] = []
    run_layers(model, hidden, runner, inputs=inputs)
    return Cached(batch, inputs, runner.cos, runner.sin)


def selected_by_score(score: torch.Tensor, valid: torch.Tensor, rate: float) -> torch.Tensor:
    """The decisions a score makes (B, T): in each row of n `valid` tokens (the ones that may skip: every real token,
    or a batch's `routable` ones) all but the ⌊rate·n⌋ of lowest score, never the first position (the attention
    sink). The others count as selected (padding follows every valid token; a dense prompt runs every block)."""
    n = valid.sum(1)
    k = torch.minimum((rate * n).floor().long(), n - 1)
    s = score.float().masked_fill(~valid, math.inf)
    s[:, 0] = math.inf
    rank = torch.empty(s.shape, dtype=torch.long)
    rank.scatter_(1, s.argsort(dim=1, stable=True), torch.arange(s.shape[1]).expand_as(s).contiguous())
    return ~(rank < k[:, None])


@torch.no_grad()
def routed_pass(
    model: STTForCausalLM, cached: Cached, decide: dict[int, Callable[[torch.Tensor], torch.Tensor]], skips: Skips
) -> tuple[torch.Tensor, dict[int, int]]:
    """The final hidden state with the layers of `decide` routed (`decide[layer](layer_input)` gives the selected
    tokens (B, T)) and the others dense, from the cached input of the lowest routed layer; and per routed layer the
    number of tokens it skipped (of the routable ones: the others run every block)."""
    start, routable = min(decide), cached.batch.routable
    runner = SequenceLayers(cached.cos, cached.sin, skips.mode, dict(skips.predictors))
    skipped: dict[int, int] = {}

    def policy(index: int, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        if index not in decide:
            return None
        selected = decide[index](x) | ~routable
        skipped[index] = int((~selected).sum())
        return selected

    hidden = run_layers(model, cached.inputs[start], runner, policy, start=start)
    return hidden, skipped


def _read(model: STTForCausalLM, hidden: torch.Tensor, cached: Cached, which: torch.Tensor):
    """Logits at the positions `which` (B, T - 1) (the LM head runs on those only) and their targets."""
    picked = hidden[:, :-1][which]
    return head(model, picked).float(), cached.batch.ids[:, 1:][which]


@dataclass
class Scores:
    nll: float = 0.0  # summed over scored tokens
    copies_right: int = 0
    skipped: dict[int, int] = field(default_factory=dict)

    def add(self, model: STTForCausalLM, hidden: torch.Tensor, cached: Cached) -> None:
        logits, targets = _read(model, hidden, cached, cached.batch.scored)
        self.nll += F.cross_entropy(logits, targets, reduction="sum").item()
        copy = cached.batch.copy
        if copy.any():
            logits, targets = _read(model, hidden, cached, copy)
            wrong_rows = copy.nonzero()[:, 0][logits.argmax(-1) != targets].unique()
            self.copies_right += int(copy.any(1).sum()) - len(wrong_rows)


class HeldOut:
    """The held-out conversations with their dense passes cached: `measure` routes a plan over all of them."""

    def __init__(self, model: STTForCausalLM, cached: list[Cached], reference_nll: float | None = None) -> None:
        """`reference_nll`: the per-token loss routed runs are compared with (default: this model's dense one; a
        tuned backbone is compared with the model before tuning, so that what tuning cost counts too)."""
        self.model, self.cached = model, cached
        self.tokens = sum(int(c.batch.routable.sum()) for c in cached)  # what compute saved counts over
        self.scored = sum(int(c.batch.scored.sum()) for c in cached)
        self.probes = sum(int(c.batch.copy.any(1).sum()) for c in cached)
        dense = Scores()
        for c in cached:
            dense.add(model, c.inputs[-1], c)
        self.dense_nll = dense.nll / max(self.scored, 1)
        self.reference_nll = self.dense_nll if reference_nll is None else reference_nll
        self.dense_copy = dense.copies_right / self.probes if self.probes else 1.0

    def run(
        self, decide_for: Callable[[Cached], dict[int, Callable]], skips: Skips
    ) -> tuple[float, float, dict[int, int]]:
        """(perplexity ratio to the reference, copy-probe share, skipped tokens per layer) of a routing plan."""
        scores = Scores()
        for c in self.cached:
            hidden, skipped = routed_pass(self.model, c, decide_for(c), skips)
            scores.add(self.model, hidden, c)
            for layer, n in skipped.items():
                scores.skipped[layer] = scores.skipped.get(layer, 0) + n
        ratio = math.exp(scores.nll / max(self.scored, 1) - self.reference_nll)
        copy = scores.copies_right / self.probes if self.probes else 1.0
        return ratio, copy, scores.skipped


# ------------------------------------------------------------------------------------------- layers and routers
def fitted_skips(
    model: STTForCausalLM, options: RouteOptions, fit: Sequence[Cached], held: HeldOut, layers: Iterable[int]
) -> Skips:
    """The skip path of `options.skip_mode`; in "predict" mode with a predictor fitted for each of `layers` on the
    fit passes (its ridge strength chosen on the held-out ones, `training.predictor`)."""
    skips = Skips(model, options.skip_mode)
    if options.skip_mode != "predict":
        return skips
    passes = [(c.inputs, c.batch.valid, False) for c in fit] + [(c.inputs, c.batch.valid, True) for c in held.cached]
    rank = min(options.predictor_rank, model.config.hidden_size)
    skips.fits = fit_predictors(model, passes, layers, rank)
    config = STTConfig.from_dict({**model.config.to_dict(), "predictor_rank": rank})
    for layer, found in skips.fits.items():
        predictor = SkipPredictor(config)
        found.load_into(predictor)
        skips.predictors[layer] = predictor.eval()
    return skips


def single_layer_costs(held: HeldOut, layers: Sequence[int], skips: Skips, log: Log) -> dict[int, float]:
    """Per layer: perplexity ratio with that layer alone skipping `SWEEP_RATE` of tokens by the update score."""
    costs = {}
    for layer in layers:

        def decide_for(c: Cached, layer: int = layer) -> dict[int, Callable]:
            chosen = selected_by_score(c.update_score(layer, skips), c.batch.routable, SWEEP_RATE)
            return {layer: lambda _x: chosen}

        costs[layer], _, _ = held.run(decide_for, skips)
        log(f"layer {layer} alone at {SWEEP_RATE:.0%} skipped: perplexity x{costs[layer]:.3f}")
    return costs


def with_routed_layers(
    model: STTForCausalLM, layers: Sequence[int], skip_mode: str, skips: Skips | None = None
) -> STTForCausalLM:
    """A copy of `model` (same weights, shared) whose STT layers are `layers`, with fresh causal routers; the
    transition networks and teacher biases of layers that already were STT layers are kept. In "predict" mode the
    layers' skip predictors are those of `skips`."""
    values = model.config.to_dict()
    values.update(stt_layers=sorted(layers), skip_mode=skip_mode, routing_trained=True, router_threshold=0.5)
    if skips is not None and skips.predictors:
        values.update(predictor_rank=next(iter(skips.predictors.values())).down.out_features)
    config = STTConfig.from_dict(values)
    config.validate_stt()
    routed = STTForCausalLM(config)
    kept = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if not any(part in name for part in ROUTER_PARTS) or _layer_of(name) in layers
    }
    kept = {
        name: tensor
        for name, tensor in kept.items()
        if ".causal_router." not in name and ".skip_predictor." not in name
    }
    result = routed.load_state_dict(kept, strict=False)
    missing = [k for k in result.missing_keys if not any(part in k for part in ROUTER_PARTS)]
    if config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"re-layering lost weights: missing {missing[:4]}, unexpected {result.unexpected_keys[:4]}")
    if config.tie_word_embeddings:
        routed.lm_head.weight = routed.model.embed_tokens.weight
    for layer in layers if skip_mode == "predict" and skips is not None else ():
        routed.model.layers[layer].skip_predictor.load_state_dict(skips.predictors[layer].state_dict())
    return routed.eval()


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] else None


def fit_router(
    router: CausalRouter, fit: Sequence[Cached], layer: int, options: RouteOptions, skips: Skips
) -> float:
    """Fit `router` to the update score's decisions at `layer` on the cached dense inputs; returns the final loss."""
    currents, previouses, targets = [], [], []
    for c in fit:
        x, routable = c.inputs[layer], c.batch.routable
        target = selected_by_score(c.update_score(layer, skips), routable, 0.5)
        currents.append(x[routable])
        previouses.append(previous_tokens(x)[routable])
        targets.append(target[routable].float())
    current, previous, target = torch.cat(currents), torch.cat(previouses), torch.cat(targets)
    generator = torch.Generator().manual_seed(options.seed * 1000 + layer)
    optimizer = torch.optim.AdamW(router.parameters(), lr=2e-3, weight_decay=0.01)
    steps_per_epoch = max(1, len(target) // 512)
    total = options.epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / total)))
    router.train()
    loss = torch.tensor(0.0)
    with torch.enable_grad():
        for _ in range(options.epochs):
            order = torch.randperm(len(target), generator=generator)
            for rows in order.split(512):
                loss = F.binary_cross_entropy_with_logits(router(current[rows], previous[rows]), target[rows])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
    router.eval()
    return float(loss.detach())


@torch.no_grad()
def fit_probs(model: STTForCausalLM, fit: Sequence[Cached], layer: int) -> torch.Tensor:
    """The layer's router probabilities over every routable fit token (dense stream), flat."""
    block = model.model.layers[layer]
    return torch.cat(
        [router_probs(block, c.inputs[layer], previous_tokens(c.inputs[layer]))[c.batch.routable] for c in fit]
    )


def f1_score(model: STTForCausalLM, held: HeldOut, layer: int, cutoff: float, skips: Skips) -> float:
    """Router (probability >= cutoff) vs update-score (the upper half by ‖Δx‖²) decisions, dense held-out stream."""
    true_pos = predicted = actual = 0
    block = model.model.layers[layer]
    with torch.no_grad():
        for c in held.cached:
            routable = c.batch.routable
            student = select(router_probs(block, c.inputs[layer], previous_tokens(c.inputs[layer])), cutoff) & routable
            target = selected_by_score(c.update_score(layer, skips), routable, 0.5) & routable
            true_pos += int((student & target).sum())
            predicted += int(student.sum())
            actual += int(target.sum())
    return 2 * true_pos / max(predicted + actual, 1)


# ---------------------------------------------------------------------------------------------------- the fit
@dataclass
class Routed:
    """What `route` made: the routed model, what was measured, and the adapters a fine-tune merged into it."""

    model: STTForCausalLM
    report: RouteReport
    adapters: Adapters = field(default_factory=dict)
    # The fine-tune's resumable checkpoint, if one was kept: the caller removes it once the routed model is written.
    checkpoint: Path | None = None


def route(
    loaded: Any, options: RouteOptions, log: Log, cache_dir: Path | None = None, speaker: Any | None = None
) -> Routed:
    """Fit and calibrate routing for `loaded` (a float32 `LoadedModel`), with its backbone frozen or, when
    `options.tune.steps`, fine-tuned to the routing first. `cache_dir`: where the self-distilled replies and the
    fine-tune's checkpoint are kept between runs; `speaker`: the same model in the format that writes them
    (`conversations_cached`)."""
    torch.manual_seed(options.seed)
    model, clock = loaded.model, time.perf_counter()
    count = model.config.num_hidden_layers
    options.check(count, model.config.max_position_embeddings)
    conversations = conversations_cached(loaded, options, log, cache_dir, speaker)
    held_rows = [c for i, c in enumerate(conversations) if i % 4 == 3]
    fit_rows = [c for i, c in enumerate(conversations) if i % 4 != 3]
    pad = conversations[0].ids[0]
    seconds = {"self-distill": time.perf_counter() - clock}
    prompts_dense = options.dense_prompts
    if prompts_dense is None:
        prompts_dense = not getattr(model.config, "route_prompt", True)

    clock = time.perf_counter()
    fit = [dense_pass(model, b) for b in batches(fit_rows, pad, prompts_dense)]
    held = HeldOut(model, [dense_pass(model, b) for b in batches(held_rows, pad, prompts_dense)])
    report = RouteReport(
        skip_mode=options.skip_mode,
        data=(
            f"{len(conversations)} self-distilled replies (greedy, routing off, <= {options.answer_tokens} tokens) "
            f"to general{' and tool' if held.probes else ''} prompts; every 4th held out"
        ),
        dense_prompts=prompts_dense,
        fit_tokens=sum(int(c.batch.valid.sum()) for c in fit),
        held_out_tokens=held.tokens,
        dense_ppl=math.exp(held.dense_nll),
        dense_copy=held.dense_copy,
        copy_probes=held.probes,
    )
    skips = fitted_skips(model, options, fit, held, range(count) if options.layers is None else options.layers)
    report.predictor_explained = {layer: fit.explained for layer, fit in skips.fits.items()}
    if options.layers is None:
        # One padded batch of the held-out set (of middling length) ranks the layers: the sweep runs ~N²/2 layer
        # passes, and a ranking needs fewer tokens than a calibration.
        sample = HeldOut(model, held.cached[len(held.cached) // 2 :][:1])
        report.single_layer = single_layer_costs(sample, range(count), skips, log)
        candidates = sorted(report.single_layer, key=report.single_layer.get)
        candidates = [layer for layer in candidates if report.single_layer[layer] <= options.budget]
        candidates = candidates[: options.max_layers]
    else:
        candidates = list(options.layers)
    seconds["choose layers"] = time.perf_counter() - clock
    log(f"candidates, cheapest first: {candidates}")

    clock = time.perf_counter()
    routed, probs = fit_routers(model, candidates, fit, options, skips, log)
    seconds["fit routers"] = time.perf_counter() - clock
    adapters: Adapters = {}
    checkpoint = None
    if options.tune.steps:
        # The backbone learns to tolerate these routers' skips; then everything downstream of the weights (the
        # dense passes, the update scores, the routers) is measured again on the tuned backbone, and routed runs are
        # compared with the untuned model's dense perplexity, so that what the tune cost counts.
        clock = time.perf_counter()
        if cache_dir is not None:
            cache_dir.mkdir(parents=True, exist_ok=True)
            key = json.dumps(
                [backbone_digest(model, options), candidates, options.skip_mode, list(options.rates)]
                + (["dense prompts"] if prompts_dense else [])
            )
            checkpoint = cache_dir / f"tune-{hashlib.sha256(key.encode()).hexdigest()[:20]}.pt"
        adapters = tune_backbone(routed, fit, candidates, probs, options, log, checkpoint)
        seconds["tune"] = time.perf_counter() - clock
        clock = time.perf_counter()
        model = routed
        fit = [dense_pass(model, c.batch) for c in fit]
        held = HeldOut(model, [dense_pass(model, c.batch) for c in held.cached], reference_nll=held.dense_nll)
        report.tune_steps, report.tuned_dense_ppl = options.tune.steps, math.exp(held.dense_nll)
        log(f"tuned: dense perplexity {report.tuned_dense_ppl:.3f} (before {report.dense_ppl:.3f})")
        skips = fitted_skips(model, options, fit, held, candidates)
        report.predictor_explained = {layer: fit.explained for layer, fit in skips.fits.items()}
        routed, probs = fit_routers(model, candidates, fit, options, skips, log)
        seconds["fit routers"] += time.perf_counter() - clock

    clock = time.perf_counter()

    def cutoffs_at(rate: float, layers: Sequence[int]) -> dict[int, float]:
        return {layer: float(torch.quantile(probs[layer], rate)) for layer in layers}

    def measure(rate: float, n: int) -> Measure:
        layers = sorted(candidates[:n])
        cutoffs = cutoffs_at(rate, layers)

        def decide_for(c: Cached) -> dict[int, Callable]:
            def decide(layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
                block = routed.model.layers[layer]
                return lambda x: select(router_probs(block, x, previous_tokens(x)), cutoffs[layer])

            return {layer: decide(layer) for layer in layers}

        ratio, copy, skipped = held.run(decide_for, skips)
        result = Measure(
            layers=layers,
            rate=rate,
            ppl_ratio=ratio,
            copy=copy,
            compute_saved=compute_saved(sum(skipped.values()), held.tokens, count, skip_cost(routed.config)),
            processed={layer: 1 - skipped[layer] / held.tokens for layer in layers},
        )
        report.tried.append(result)
        log(
            f"rate {rate:.2f}, {n} layers: perplexity x{ratio:.3f}, copy {copy:.0%}, "
            f"compute saved {result.compute_saved:.1%}"
        )
        return result

    def acceptable(m: Measure) -> bool:
        return m.ppl_ratio <= options.budget and m.copy >= held.dense_copy - COPY_SLACK

    best: Measure | None = None
    for rate in options.rates:
        # The largest prefix of the candidates (cheapest first) that stays acceptable: binary search, as adding
        # a layer only adds skipping.
        low, high, found = 1, len(candidates), None
        while low <= high:
            middle = (low + high) // 2
            m = measure(rate, middle)
            if acceptable(m):
                found, low = m, middle + 1
            else:
                high = middle - 1
        if found and (best is None or found.compute_saved > best.compute_saved):
            best = found
    seconds["calibrate"] = time.perf_counter() - clock
    report.seconds = seconds
    report.chosen = best
    if best is None:
        return Routed(with_routed_layers(model, [], options.skip_mode), report, adapters, checkpoint)
    final = with_routed_layers(model, best.layers, options.skip_mode, skips)
    final.config.route_prompt = not prompts_dense
    report.cutoffs = cutoffs_at(best.rate, best.layers)
    for layer in best.layers:
        source, target = routed.model.layers[layer].causal_router, final.model.layers[layer].causal_router
        target.load_state_dict(source.state_dict())
        report.f1[layer] = f1_score(final, held, layer, report.cutoffs[layer], skips)
        fold_cutoff(target, report.cutoffs[layer])
    report.levels, report.level_measures = measure_levels(final, held, skips, log)
    final.config.routing_levels = dict(report.levels)
    return Routed(final, report, adapters, checkpoint)


# Router thresholds tried for the "fast" level, above the calibrated 0.5 (higher skips more in every layer), and the
# net share of all block work it aims at: "fast" should skip at least a fifth, or it is not worth a level of its own.
FAST_THRESHOLDS = (0.6, 0.7, 0.8, 0.9, 0.95)
FAST_TARGET = 0.20


def measure_levels(model: STTForCausalLM, held: HeldOut, skips: Skips, log: Log) -> tuple[dict, dict]:
    """The routed `model`'s levels and what each costs on the held-out conversations: "quality" at the calibrated
    threshold 0.5, and "fast" at the lowest of `FAST_THRESHOLDS` that skips `FAST_TARGET` of all block work net
    (the highest when none does, if it skips more than "quality"). Returns (level -> threshold, level -> Measure)."""
    layers = list(model.stt_layer_indices)
    blocks = model.model.layers
    count, cost = model.config.num_hidden_layers, skip_cost(model.config)

    def at(threshold: float) -> Measure:
        def decide_for(_c: Cached) -> dict[int, Callable]:
            return {
                layer: (lambda x, block=blocks[layer]: select(router_probs(block, x, previous_tokens(x)), threshold))
                for layer in layers
            }

        ratio, copy, skipped = held.run(decide_for, skips)
        saved = compute_saved(sum(skipped.values()), held.tokens, count, cost)
        log(f"level at threshold {threshold}: perplexity x{ratio:.3f}, copy {copy:.0%}, compute saved {saved:.1%}")
        processed = {layer: 1 - skipped.get(layer, 0) / held.tokens for layer in layers}
        return Measure(layers, threshold, ratio, copy, saved, processed)

    levels, measures = {"quality": 0.5}, {"quality": at(0.5)}
    tried = []
    for threshold in FAST_THRESHOLDS:
        tried.append(at(threshold))
        if tried[-1].compute_saved >= FAST_TARGET:
            break
    fast = tried[-1]
    if fast.compute_saved > measures["quality"].compute_saved:
        levels["fast"], measures["fast"] = fast.rate, fast
    return levels, measures


def fit_routers(
    model: STTForCausalLM, layers: Sequence[int], fit: Sequence[Cached], options: RouteOptions, skips: Skips, log: Log
) -> tuple[STTForCausalLM, dict[int, torch.Tensor]]:
    """A copy of `model` routed at `layers`, each router fitted, and each router's probabilities on the fit data."""
    routed = with_routed_layers(model, layers, options.skip_mode, skips)
    for layer in layers:
        loss = fit_router(routed.model.layers[layer].causal_router, fit, layer, options, skips)
        log(f"layer {layer}: router fitted, final BCE {loss:.3f}")
    return routed, {layer: fit_probs(routed, fit, layer) for layer in layers}


def tune_backbone(
    routed: STTForCausalLM,
    fit: Sequence[Cached],
    layers: Sequence[int],
    probs: dict[int, torch.Tensor],
    options: RouteOptions,
    log: Log,
    checkpoint: Path | None,
) -> Adapters:
    """Fine-tune `routed`'s backbone (in place) with its routers deciding at each of `options.rates` (the cutoff of
    a rate: that quantile of the router's fit probabilities, as the calibration sets it), against the dense
    predictions of the fit data (`chatapp.training.tune`)."""
    cutoffs = {rate: {layer: float(torch.quantile(probs[layer], rate)) for layer in layers} for rate in options.rates}
    targets = [
        dense_targets(routed, c.batch.ids, c.batch.routable, c.batch.scored, c.inputs[-1], options.tune.top_k)
        for c in fit
    ]
    batches_ = [t for t in targets if len(t.top_ids)]
    log(f"tune: {options.tune.steps} steps on {sum(len(t.top_ids) for t in batches_)} scored positions")

    def decide(layer: int, x: torch.Tensor, rate: float) -> torch.Tensor:
        block = routed.model.layers[layer]
        return select(router_probs(block, x, previous_tokens(x)), cutoffs[rate][layer])

    return tune(
        routed,
        batches_,
        layers,
        decide,
        options.rates,
        options.skip_mode,
        options.tune,
        log,
        checkpoint=checkpoint,
        seed=options.seed,
    )


def fold_cutoff(router: CausalRouter, cutoff: float) -> None:
    """Shift the router's output bias so that probability 0.5 falls where `cutoff` did: σ(z + b) >= 0.5 exactly
    when σ(z) >= cutoff, with b = -logit(cutoff)."""
    c = min(max(cutoff, 1e-6), 1 - 1e-6)
    with torch.no_grad():
        router.out.bias -= math.log(c / (1 - c))


def write_routed(routed: Routed, source: Path, target: Path, locks: Path | None = None) -> None:
    """The routed model in `target` with its fit's report beside it (`write_tuned`)."""
    write_tuned(routed.model, routed.adapters, source, target, locks, {REPORT_NAME: routed.report.to_json()})


def write_tuned(
    model: STTForCausalLM,
    adapters: Adapters,
    source: Path,
    target: Path,
    locks: Path | None = None,
    extra: dict[str, str] | None = None,
) -> None:
    """`model` in `target` (the source's other files copied along, and the text files `extra` names), through the
    store: built beside it and renamed into place, so an interrupted write leaves the previous model as it was
    (`locks`: where the target's lock file goes, `store.lock_path`). A fine-tune's `adapters` join those the source
    had merged (`stt.io.MERGED_ADAPTERS_NAME`, which int4 keeps apart from the rounded weights): two low-rank updates
    of one module are one of the summed rank, [B1 B2] [A1; A2]."""
    adapters = combine_adapters(load_merged_adapters(source), adapters)
    with store.staged_dir(target, what="routed model directory", locks=locks, checksums=True) as staging:
        for path in source.iterdir():
            if (
                path.is_file()
                and path.name not in (CONFIG_NAME, WEIGHTS_NAME, MERGED_ADAPTERS_NAME, store.STAMP)
                and not path.name.startswith(".")
            ):
                shutil.copyfile(path, staging / path.name)
        save_model(model, staging)
        if adapters:
            save_merged_adapters(adapters, staging)
        for name, text in (extra or {}).items():
            (staging / name).write_text(text, encoding="utf-8")


def combine_adapters(first: Adapters, second: Adapters) -> Adapters:
    """Per module, the low-rank update equal to both applied: (A, B) with B A = B1 A1 + B2 A2."""
    out = dict(first)
    for module, (a, b) in second.items():
        if module in out:
            a0, b0 = out[module]
            out[module] = (torch.cat((a0, a)), torch.cat((b0, b), dim=1))
        else:
            out[module] = (a, b)
    return out
