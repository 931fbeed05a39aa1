"""Where a model keeps the prompts its routing is fitted on (`chatapp route MODEL` without `--prompts`).

The recipe that made a model registers them as data beside its weights: `route_prompts.jsonl`, one conversation's
user turns per line (`chatapp.training.corpus.read_dialogues` reads it), which the routing fit has the model answer.
The tiny model's directory holds its own (`recipes/tiny/build.py` writes it). The default model is prepared into the
data directory from the parts it ships (`smollm2_parts/`, written by `recipes/smollm2/build.py`), so its set is read
from the parts, for the prepared model and for any copy of it (`prepared.json` marks one, and `chatapp route --out`
keeps it): preparing the model again never loses it. A model no recipe made (a converted GGUF) has none, and
`chatapp route` asks for `--prompts FILE.jsonl`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TypeVar

from chatapp.models.smollm2 import PARTS_DIR, PREPARED_STAMP

ROUTE_PROMPTS_FILE = "route_prompts.jsonl"

T = TypeVar("T")


def route_prompts_file(model_dir: Path) -> Path | None:
    """The prompt set registered for `model_dir`: its own file, else the default model's shipped one for a prepared
    default model (or a copy of it), else None."""
    own = model_dir / ROUTE_PROMPTS_FILE
    if own.is_file():
        return own
    shipped = PARTS_DIR / ROUTE_PROMPTS_FILE
    if shipped.is_file() and (model_dir / PREPARED_STAMP).is_file():
        return shipped
    return None


def drawn(dialogues: list[T], count: int, seed: int) -> list[T]:
    """The `count` conversations a fit uses, drawn by `seed` (all of them when the set holds no more): what
    `chatapp route --conversations N --seed S` answers, and what the recipe's routing stage answers."""
    if count >= len(dialogues):
        return dialogues
    return random.Random(seed).sample(dialogues, count)
