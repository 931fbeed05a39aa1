"""The server's one engine loop: a thread that owns the model and its `ContinuousBatch`.

Requests queue here (`submit`), join the batch between decode steps as rows free up, and leave it when they finish
or their client goes (`cancel`). Each step's token events go to their request's handler, on the server's event
loop, in one call per request per step. The queue is bounded: past it a request is refused with 429 at once (503
while the server drains), never left waiting without end.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from chatapp.engine.continuous import Admission
from chatapp.engine.engine import Engine
from chatapp.engine.events import TokenEvent
from chatapp.serve.errors import ApiError

log = logging.getLogger("chatapp.serve")

# Prompt tokens prefilled between two decode steps at most (one request's, however long, always joins). Measured on
# the default model, 2-core box: 16 requests arriving at once had their first token after 6.8 s (p50) when all of
# them were prefilled before the first step.
PREFILL_TOKENS_PER_STEP = 128

Delivery = list[TokenEvent] | BaseException
"""What the loop hands a request: the step's events of its rows, or the error that ended them."""


@dataclass(eq=False)
class Ticket:
    """One request in the loop: its rows (checked, built, not yet prefilled) and where its events go. `deliver` is
    called on the loop's thread and must only hand the item over (e.g. `call_soon_threadsafe`)."""

    admission: Admission
    deliver: Callable[[Delivery], None]
    running: set[int] = field(default_factory=set)  # its rows still in the batch

    @property
    def rows(self) -> list[int]:
        return self.admission.indices


class EngineLoop:
    """The thread that steps the batch. `max_rows`: rows decoded together at most; `max_queue`: requests waiting."""

    def __init__(self, engine: Engine, *, max_rows: int = 32, max_queue: int = 64) -> None:
        self.engine = engine
        self.max_rows = max_rows
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._leaving: set[int] = set()
        self._tickets: dict[int, Ticket] = {}  # row -> its request, for rows in the batch
        self._row_numbers = itertools.count()
        self._draining = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="chatapp-engine-loop", daemon=True)

    # ------------------------------------------------------------------------------------------- request side
    def start(self) -> None:
        self._thread.start()

    def first_row(self, count: int) -> int:
        """Reserve `count` row numbers for one request (numbers are never reused)."""
        with self._cond:
            first = next(self._row_numbers)
            for _ in range(count - 1):
                next(self._row_numbers)
            return first

    def submit(self, ticket: Ticket) -> None:
        """Queue a request to join the batch; 429 past the queue's bound, 503 while draining."""
        with self._cond:
            if self._draining or self._stopped:
                raise ApiError(503, "the server is shutting down; retry against another server", code="shutting_down")
            free_rows = self.max_rows - len(self._tickets)  # a request that fits them waits only for the next step
            if len(self._waiting) >= self.max_queue + max(free_rows, 0):
                raise ApiError(
                    429,
                    f"the server is busy: {len(self._waiting)} requests wait for a row already; retry shortly",
                    code="queue_full",
                )
            self._waiting.append(ticket)
            self._cond.notify()

    def cancel(self, ticket: Ticket) -> None:
        """The request's client left or timed out: it leaves the queue, or its rows leave the batch at the next
        step (they are fed nothing from then on)."""
        self.cancel_rows(ticket, ticket.rows)

    def cancel_rows(self, ticket: Ticket, rows: list[int]) -> None:
        """Some of a request's rows are done with (a stop string ended them): they leave the batch at the next step.
        Rows that already finished are skipped; a request still queued leaves the queue."""
        with self._cond:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                return
            self._leaving.update(rows)
            self._cond.notify()

    def drain(self) -> None:
        """Refuse new requests (503); those queued or running go on."""
        with self._cond:
            self._draining = True

    def stop(self, timeout: float = 5.0) -> None:
        """End the loop: requests still running get an error."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def load(self) -> tuple[int, int]:
        """(rows in the batch, requests waiting)."""
        with self._cond:
            return len(self._tickets), len(self._waiting)

    # ------------------------------------------------------------------------------------------- loop thread
    def _run(self) -> None:
        batch = self.engine.continuous_batch()
        while True:
            with self._cond:
                while not self._stopped and not self._waiting and not self._leaving and not batch.active:
                    self._cond.wait()
                if self._stopped:
                    break
                joining = self._take_joining(batch.active)
                leaving, self._leaving = self._leaving, set()
            for row in leaving:
                self._tickets.pop(row, None)
            for ticket in joining:
                ticket.running.update(ticket.rows)
                self._tickets.update(dict.fromkeys(ticket.rows, ticket))
            try:
                step = batch.step([t.admission for t in joining], leaving)
            except Exception as err:  # a bug, not a request's fault: end what runs, keep serving
                log.exception("the engine loop failed a step")
                self._fail_all(err)
                batch.close()
                continue
            if step is not None:
                self._dispatch(step.tokens)
        batch.close()
        self._fail_all(ApiError(503, "the server shut down before the reply finished", code="shutting_down"))

    def _take_joining(self, active: int) -> list[Ticket]:
        """Queued requests that fit in the rows left, first come first served, up to `PREFILL_TOKENS_PER_STEP`
        prompt tokens (always one request): the rows already decoding wait for every newcomer's prefill, so a
        burst of requests joins over a few steps and the first of them stream while the rest are prefilled."""
        joining: list[Ticket] = []
        room = self.max_rows - active
        budget = PREFILL_TOKENS_PER_STEP
        while self._waiting and len(self._waiting[0].rows) <= room:
            prompt = len(self._waiting[0].admission.prompt_ids)
            if joining and prompt > budget:
                break
            ticket = self._waiting.popleft()
            room -= len(ticket.rows)
            budget -= prompt
            joining.append(ticket)
        return joining

    def _dispatch(self, events: tuple[TokenEvent, ...]) -> None:
        by_ticket: dict[Ticket, list[TokenEvent]] = {}
        for event in events:
            ticket = self._tickets.get(event.row)
            if ticket is None:  # its request left this step
                continue
            by_ticket.setdefault(ticket, []).append(event)
            if event.finish_reason is not None:
                ticket.running.discard(event.row)
                del self._tickets[event.row]
        for ticket, ticket_events in by_ticket.items():
            ticket.deliver(ticket_events)

    def _fail_all(self, err: BaseException) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        tickets = {*self._tickets.values(), *waiting}
        self._tickets.clear()
        for ticket in tickets:
            ticket.running.clear()
            ticket.deliver(err)
