"""Refine the shipped default model: its general answers pulled back to the base model's, calls that encode the
whole problem, and its routing in the loop throughout.

The recipe's tune drifted from what SmolLM2 knew (held-out general questions of kinds it never trains: fewer right
than the base conversion), and a word problem of several steps got a call for one of them (`24-17` for three boxes of
24 pencils less 17). A LoRA tune over the served model (`chatapp.training.tune`, the loop `chatapp route
--tune-steps` runs) fixes both without a rebuild from scratch. Each batch is one kind of text with its own target:

- general: the base model's greedy answers to the recipe's general prompts (`build.stage_distill`), against the
  **base conversion's** own predictions (top k): distillation that pulls the tuned backbone back to the base;
- whole-problem calls: word problems of several steps with the call written whole (`data.multistep_questions`),
  against the text itself (hard labels): the one thing the model must learn rather than keep;
- kept: the recipe's tool, recall and chained conversations against the **served model's** own predictions before
  the tune: self-distillation that holds what the tune must not lose (calls, recall, switching between tools).

The served routers decide during the tune (a share of steps dense), at the served levels' thresholds, so the
backbone stays fitted to the skips decode will make. Resumable: the tune checkpoints itself; the targets are
recomputed (a few minutes) on a resume.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chatapp.recipes.smollm2 import data
from chatapp.stt.forward import run_layers, sequences
from chatapp.training.route import Batch, Conversation, batches, write_tuned
from chatapp.training.tune import TuneBatch, TuneOptions, dense_targets, served_routing, tune

Log = Callable[[str], None]
Messages = list[dict[str, Any]]
PADDED_POSITIONS = 1536  # positions per padded batch
CHECKPOINT = "refine.pt"


@dataclass(frozen=True)
class RefineRecipe:
    general: int = 360  # base answers to general prompts, distilled from the base conversion
    multistep: int = 1200  # whole-problem word problems (hard labels): ~a third of the batches
    kept: int = 720  # tool, recall and chained conversations, distilled from the served model itself
    steps: int = 300  # ~4 s a step on 2 CPU cores
    top_k: int = 32
    lr: float = 3e-4
    rank: int = 16
    alpha: int = 32
    dense_share: float = 0.25
    seed: int = 0


@dataclass(frozen=True)
class Source:
    """One kind of training text and where its targets come from: "base", "self" or "text" (hard labels)."""

    name: str
    conversations: list[Messages]
    target: str


def sources(general: list[tuple[str, str]], recipe: RefineRecipe) -> list[Source]:
    """The three kinds of text (module docstring), drawn from the recipe's own training data and seed."""
    from chatapp.recipes.smollm2.train import Recipe, conversations

    rng = random.Random(recipe.seed + 7)
    plain = [[{"role": "user", "content": p}, {"role": "assistant", "content": a}] for p, a in general]
    mix = conversations(general, recipe.seed, Recipe())
    kept = [c for c in mix if c not in plain]  # the tool, recall and chained conversations
    multistep = [
        data.tool_conversation(q, a) for q, a in data.multistep_questions(rng, recipe.multistep, held_out=False)
    ]
    return [
        Source("general", rng.sample(plain, min(recipe.general, len(plain))), "base"),
        Source("multi-step", multistep, "text"),
        Source("kept", rng.sample(kept, min(recipe.kept, len(kept))), "self"),
    ]


def padded(encoded: Sequence[tuple[list[int], list[int]]], pad: int) -> list[Batch]:
    """(ids, mask) conversations in batches of at most `PADDED_POSITIONS` padded positions, by length
    (`route.batches`). A row's routers decide from its first supervised token on (`routable`): the prompt before it
    is prefilled densely, as served."""
    conversations = [Conversation(ids, [bool(m) for m in mask[1:]], [False] * (len(ids) - 1)) for ids, mask in encoded]
    return batches(conversations, pad, dense_prompts=True, positions=PADDED_POSITIONS)


@torch.no_grad()
def targets(teacher: Any | None, rows: Batch, k: int) -> TuneBatch:
    """A `TuneBatch` of `rows`: the top `k` dense predictions of `teacher` at the scored positions, or (no teacher)
    the next token itself with log-probability 0: the same loss is then plain cross-entropy."""
    if teacher is None:
        labels = rows.ids[:, 1:][rows.scored]
        return TuneBatch(rows.ids, rows.routable, rows.scored, labels[:, None], torch.zeros(len(labels), 1))
    hidden, runner = sequences(teacher, rows.ids, "strict")
    final = run_layers(teacher, hidden, runner)
    return dense_targets(teacher, rows.ids, rows.routable, rows.scored, final, k)


def refine(
    model_dir: Path, base_dir: Path, work: Path, general: list[tuple[str, str]], recipe: RefineRecipe, log: Log
) -> Path:
    """Tune the served model in `model_dir` as the module docstring says; the tuned model is written to
    `work / "refined"` (the source's files copied along, the tune's adapters joined to those it had merged), and
    its path returned."""
    from chatapp.models.loader import load_model

    torch.manual_seed(recipe.seed)
    loaded = load_model(model_dir, dtype="float32")
    model, chat_format = loaded.model, loaded.chat_format
    pad = loaded.tokenizer.pad_id if getattr(loaded.tokenizer, "pad_id", None) is not None else 0
    batches: list[TuneBatch] = []
    teachers = {"self": model, "text": None}
    for source in sources(general, recipe):
        if source.target == "base" and "base" not in teachers:
            teachers["base"] = load_model(base_dir, dtype="float32").model
        rows = padded([chat_format.render_conversation(c) for c in source.conversations], pad)
        made = [targets(teachers[source.target], r, recipe.top_k) for r in rows]
        made = [b for b in made if len(b.top_ids)]
        log(
            f"{source.name}: {len(source.conversations)} conversations, {len(made)} batches, "
            f"{sum(len(b.top_ids) for b in made)} scored positions (targets: {source.target})"
        )
        batches += made
    teachers.pop("base", None)
    layers = list(model.stt_layer_indices)
    levels = sorted(set((model.config.routing_levels or {}).values()) or {model.config.router_threshold})

    options = TuneOptions(
        steps=recipe.steps,
        rank=recipe.rank,
        alpha=recipe.alpha,
        lr=recipe.lr,
        dense_share=recipe.dense_share,
        top_k=recipe.top_k,
        layer_prefixes=False,  # every routed layer decides on a routed step, as served
    )
    log(f"tune: {recipe.steps} steps over {len(batches)} batches, routed layers {layers} at thresholds {levels}")
    adapters = tune(
        model,
        batches,
        layers,
        served_routing(model),
        levels,
        model.config.skip_mode,
        options,
        log,
        checkpoint=work / CHECKPOINT,
        seed=recipe.seed,
    )
    target = work / "refined"
    write_tuned(model, adapters, model_dir, target)
    return target
