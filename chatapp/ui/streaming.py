"""Moving Steps from the generation thread to the UI in batches.

`call_from_thread` per token would block the generator until the UI repainted, tying tokens/s to the frame rate.
Instead the worker puts every Step into the answer's `StepChannel` and never waits; the UI takes whatever has
accumulated on a timer, ~30 times a second, and draws it as one batch. The worker posts one message, at the end,
saying how the generation ended.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from textual.message import Message
from textual.timer import Timer

from chatapp.engine.events import Step
from chatapp.engine.reply import Reply

Outcome = Literal["complete", "interrupted", "error"]

BATCH_INTERVAL = 1 / 30


class StepChannel:
    """Steps from the generation thread to the UI thread.

    The UI pulls (on its own clock) rather than the worker pushing messages: a UI that falls behind simply takes
    bigger batches, one repaint each, instead of a queue of messages; and tokens produced before the generator
    stalls (a slow tool call, a long prefill) are shown at the next tick rather than when the next token arrives.
    Both sides hold the lock only to append or swap a list.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer: list[Step] = []

    def put(self, step: Step) -> None:
        """Add a step (called by the worker)."""
        with self._lock:
            self._buffer.append(step)

    def take(self) -> list[Step]:
        """Everything put since the last take, in order (called by the UI)."""
        with self._lock:
            batch, self._buffer = self._buffer, []
            return batch


@dataclass
class Generation:
    """One answer being generated: where its tokens go on screen and in the history database."""

    answer: object  # the AssistantMessage widget (typed loosely to keep this module free of widget imports)
    message_id: int
    reply: Reply  # the answer folded as it streams: its content and stats
    channel: StepChannel = field(default_factory=StepChannel)
    ticker: Timer | None = None  # the UI timer taking batches from the channel
    written: int = 0  # tokens already saved to the database
    pieces_written: int = 0  # the reply's content pieces already saved (`Reply.pieces_since`)
    steps: int = 0
    started: float = field(default_factory=time.monotonic)


class FirstTokens(Message):
    """The worker put an answer's first tokens in the channel: draw them now rather than at the next tick (up to
    a tick, 33 ms, sooner). Posted once per answer, so the worker still never waits for the UI."""

    def __init__(self, generation: Generation) -> None:
        super().__init__()
        self.generation = generation


class GenerationEnded(Message):
    """The worker is done (its last steps are in the channel): how the generation ended (`error` has the message)."""

    def __init__(self, generation: Generation, outcome: Outcome, error: str | None) -> None:
        super().__init__()
        self.generation = generation
        self.outcome = outcome
        self.error = error
