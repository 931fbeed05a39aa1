"""Moving Steps from the generation thread to the UI in batches.

`call_from_thread` per token would block the generator until the UI repainted, tying tokens/s to the frame rate.
Instead the worker buffers Steps and posts one message per ~1/30 s (`post_message` is thread-safe and does not
wait), then a final message with whatever is left and how the generation ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from textual.message import Message

from chatapp.engine.events import Step
from chatapp.ui.stats import AnswerStats

Outcome = Literal["complete", "interrupted", "error"]

BATCH_INTERVAL = 1 / 30


class StepBatcher:
    """Collects Steps and releases them at most once per `interval` seconds of `clock`."""

    def __init__(self, interval: float = BATCH_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._buffer: list[Step] = []
        self._last = clock()

    def add(self, step: Step) -> list[Step] | None:
        """Buffer a step; return the batch when it is time to hand one over."""
        self._buffer.append(step)
        now = self._clock()
        if now - self._last < self.interval:
            return None
        self._last = now
        return self.flush()

    def flush(self) -> list[Step]:
        batch, self._buffer = self._buffer, []
        return batch


@dataclass
class Generation:
    """One answer being generated: where its tokens go on screen and in the history database."""

    answer: object  # the AssistantMessage widget (typed loosely to keep this module free of widget imports)
    message_id: int
    stats: AnswerStats
    written: int = 0  # tokens already saved to the database
    steps: int = 0
    started: float = field(default_factory=time.monotonic)


class StepsArrived(Message):
    """A batch of Steps from the generation worker."""

    def __init__(self, generation: Generation, steps: list[Step]) -> None:
        super().__init__()
        self.generation = generation
        self.steps = steps


class GenerationEnded(Message):
    """The worker's final flush and how the generation ended (`error` carries the message)."""

    def __init__(self, generation: Generation, steps: list[Step], outcome: Outcome, error: str | None) -> None:
        super().__init__()
        self.generation = generation
        self.steps = steps
        self.outcome = outcome
        self.error = error
