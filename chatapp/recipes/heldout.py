"""A model's own held-out set: what `chatapp eval` scores when it is given no CORPUS.

A model directory names the recipe that made it by a file that recipe (or the preparation of its parts) writes
into it, and nothing else is needed: no new field in config.json, which the runtime reads and the compiled-step
store keys on.

- `prepared.json` (`models.smollm2.PREPARED_STAMP`): the default SmolLM2 model, prepared from the shipped parts of
  `recipes/smollm2`. Only preparation writes it.
- `MODEL_CARD.md` whose first line is the tiny recipe's title (`recipes.tiny.build.CARD_TITLE`): the tiny model, or
  a rebuild of it (`make train-tiny --out DIR`).

Both files are copied along by `chatapp route --out` (it keeps the source's other files), so a re-routed model
keeps its recipe's held-out set; a fine-tune with `chatapp train` writes neither, nor does `chatapp convert`, and
those models belong to no recipe: `chatapp eval` then asks for a CORPUS instead of scoring data the model was never
meant for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatapp.errors import ModelDirError

if TYPE_CHECKING:
    from chatapp.engine.engine import Engine
    from chatapp.training.evaluation import Tally

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class HeldOut:
    """One recipe's held-out set: conversations with answers (perplexity, routing) and generated task metrics."""

    recipe: str
    description: str  # what the conversations are, for the report's title
    conversations: Callable[[int], list[Messages]]  # count -> whole conversations, the same ones for the same count
    tasks: Callable[[Engine, int], list[tuple[str, Tally]]]  # (engine, count) -> (label, tally) rows
    default_conversations: int
    default_tasks: int  # what a run of `chatapp eval` can afford on a CPU for this model's size


def recipe_of(model_dir: Path) -> str | None:
    """The recipe that made `model_dir` ("tiny", "smollm2"), or None (see the module docstring for the rule)."""
    from chatapp.models.smollm2 import PREPARED_STAMP
    from chatapp.recipes.tiny.build import CARD_TITLE

    if (model_dir / PREPARED_STAMP).is_file():
        return "smollm2"
    card = model_dir / "MODEL_CARD.md"
    try:
        with card.open(encoding="utf-8") as handle:
            first = handle.readline().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return "tiny" if first == CARD_TITLE else None


def held_out_for(model_dir: Path) -> HeldOut:
    """The held-out set of the recipe that made `model_dir`; a ModelDirError saying to pass a CORPUS if none."""
    recipe = recipe_of(model_dir)
    if recipe == "tiny":
        return _tiny()
    if recipe == "smollm2":
        return _smollm2()
    raise ModelDirError(
        f"{model_dir} was not made by a chatapp recipe (no prepared.json, no tiny model card), so it has no "
        "held-out set of its own to evaluate on",
        hint="pass held-out data: `chatapp eval CORPUS --model ...` with JSONL conversations or a text file "
        "(--tasks asks a recipe's held-out questions: leave it out)",
    )


def _tiny() -> HeldOut:
    from chatapp.recipes.tiny.corpus import generate_corpus
    from chatapp.recipes.tiny.evaluate import heldout_task_report

    return HeldOut(
        recipe="tiny",
        description="the tiny recipe's synthetic held-out split",
        conversations=lambda count: [c.messages for c in generate_corpus(count, "heldout")],
        tasks=lambda engine, count: heldout_task_report(engine, count).rows(),
        default_conversations=300,
        default_tasks=300,
    )


def _smollm2() -> HeldOut:
    from chatapp.recipes.smollm2.evaluate import held_out_chat, task_tallies

    return HeldOut(
        recipe="smollm2",
        # The self-distilled general answers held out at training time are in the recipe's working directory, not
        # in the model: the conversations here are the generated held-out tool exchanges.
        description="the SmolLM2 recipe's held-out tool conversations",
        conversations=lambda count: held_out_chat([], count),
        tasks=task_tallies,
        default_conversations=40,
        # 16 tool questions and 4 each of follow-up and recall: 24 generated replies of up to 96 tokens. 8 (12
        # replies) took 5 min 50 s with preparation on 2 busy CPU cores; the recipe's evaluate runs the full set.
        default_tasks=16,
    )
