"""Moving Steps from the generation thread to the UI in batches.

`call_from_thread` per token would block the generator until the UI repainted, tying tokens/s to the frame rate.
Instead the worker puts every Step into a `StepChannel` and, at most once per ~1/30 s, posts a message telling the
UI to take what has accumulated (`post_message` is thread-safe and does not wait); a final message says how the
generation ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from textual.message import Message

from chatapp.engine.events import Step
from chatapp.ui.stats import AnswerStats

Outcome = Literal["complete", "interrupted", "error"]

BATCH_INTERVAL = 1 / 30


class StepChannel:
    """Steps from one producer thread to the UI, handed over at most once per `interval` seconds of `clock`.

    The producer `put`s every step; `put` answers True when a batch is due and the UI has taken the previous one,
    and only then does the producer post a message. The UI `take`s everything buffered when it handles that
    message. So a UI that falls behind gets fewer, bigger batches (one repaint each) rather than a queue of
    messages, and the producer never waits for the UI: both sides hold the lock only to swap a list.
    """

    def __init__(self, interval: float = BATCH_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._buffer: list[Step] = []
        self._posted = False  # a message is on its way to the UI and it has not taken the buffer yet
        self._last = clock()

    def put(self, step: Step) -> bool:
        """Buffer a step; True when the caller should tell the UI to take a batch."""
        with self._lock:
            self._buffer.append(step)
            if self._posted:
                return False
            now = self._clock()
            if now - self._last < self.interval:
                return False
            self._posted, self._last = True, now
            return True

    def take(self) -> list[Step]:
        """Everything buffered since the last take (called by the UI)."""
        with self._lock:
            batch, self._buffer = self._buffer, []
            self._posted = False
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
    """Steps are waiting in the generation's channel."""

    def __init__(self, generation: Generation, channel: StepChannel) -> None:
        super().__init__()
        self.generation = generation
        self.channel = channel


class GenerationEnded(Message):
    """The worker is done: the channel holds the last steps; how the generation ended (`error` has the message)."""

    def __init__(self, generation: Generation, channel: StepChannel, outcome: Outcome, error: str | None) -> None:
        super().__init__()
        self.generation = generation
        self.channel = channel
        self.outcome = outcome
        self.error = error
