"""Loop rate: how often a model's replies to open-ended prompts go round in circles, at given sampling settings.

A reply loops when some run of `LOOP_WORDS` words occurs `LOOP_REPEATS` or more times in its first `LOOP_TOKENS`
tokens (words: the text split on white space, lower-cased, with the punctuation around each word dropped, so "the
studio." and "The studio" are one word pair). The prompts (`open_prompts.jsonl`: stories, explanations, poems,
letters, plans, advice, speeches, reviews...) are held out: none is a recipe's training prompt nor shaped like one's
templates, and a test keeps it so.
"""

from __future__ import annotations

import json
import string
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from chatapp.settings import GenerationSettings

if TYPE_CHECKING:
    from chatapp.engine.engine import Engine

OPEN_PROMPTS = Path(__file__).with_name("open_prompts.jsonl")
LOOP_WORDS = 6
LOOP_REPEATS = 3
LOOP_TOKENS = 320
ROWS_PER_BATCH = 32


@dataclass(frozen=True)
class OpenPrompt:
    id: int
    kind: str
    prompt: str


@dataclass(frozen=True)
class LoopReport:
    """Of `total` replies, `looped` loop; `examples`: each looping reply's prompt and its repeated run."""

    looped: int
    total: int
    examples: tuple[str, ...]

    @property
    def rate(self) -> float:
        return self.looped / self.total if self.total else float("nan")

    def __str__(self) -> str:
        return f"{self.rate:.1%} ({self.looped}/{self.total})"


def open_prompts() -> list[OpenPrompt]:
    """The held-out open-ended prompts, in file order."""
    lines = OPEN_PROMPTS.read_text(encoding="utf-8").splitlines()
    return [OpenPrompt(**json.loads(line)) for line in lines if line.strip()]


def repeated_run(text: str, words: int = LOOP_WORDS, repeats: int = LOOP_REPEATS) -> str | None:
    """The most repeated run of `words` words if it occurs `repeats` or more times in `text`, else None."""
    tokens = [w.strip(string.punctuation).lower() for w in text.split()]
    tokens = [w for w in tokens if w]
    runs = Counter(" ".join(tokens[i : i + words]) for i in range(len(tokens) - words + 1))
    if not runs:
        return None
    run, count = runs.most_common(1)[0]
    return run if count >= repeats else None


def loop_rate(engine: Engine, settings: GenerationSettings, prompts: list[OpenPrompt] | None = None) -> LoopReport:
    """How many of the replies to the open prompts (one each, at `settings` with `max_tokens` set to `LOOP_TOKENS`)
    loop."""
    prompts = open_prompts() if prompts is None else prompts
    settings = replace(settings, max_tokens=LOOP_TOKENS)
    rendered = [engine.chat_format.render_for_completion([{"role": "user", "content": p.prompt}]) for p in prompts]
    examples = []
    for start in range(0, len(rendered), ROWS_PER_BATCH):
        replies = engine.generate_batch(rendered[start : start + ROWS_PER_BATCH], settings)
        for item, reply in zip(prompts[start : start + ROWS_PER_BATCH], replies, strict=True):
            if (run := repeated_run(reply.text)) is not None:
                examples.append(f"{item.prompt} -> {run!r}")
    return LoopReport(len(examples), len(prompts), tuple(examples))


# The settings a loop rate is reported beside: greedy (chatapp's default before a model had its own) and the
# defaults of two common runtimes.
LOOP_REFERENCES = {
    "greedy": GenerationSettings(),
    "llama.cpp's defaults": GenerationSettings(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "ollama's defaults": GenerationSettings(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1),
}


def loop_table(
    engine: Engine, settings: GenerationSettings, label: str, *, references: bool = True
) -> dict[str, LoopReport]:
    """The loop rate at `settings` (named `label`) and, with `references`, at each of `LOOP_REFERENCES` too."""
    wanted = {label: settings, **(LOOP_REFERENCES if references else {})}
    return {name: loop_rate(engine, each) for name, each in wanted.items()}
