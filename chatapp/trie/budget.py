"""A compile budget for regex and JSON-schema constraints: states, time, and cancellation.

Determinising a regex can need exponentially many states (`(a|b)*a(a|b){16}`: 2**17) and a counted repetition is
unrolled (`a{99999}`), so a constraint a user types may cost minutes and gigabytes. Every compile therefore runs
under a `CompileBudget`: the unrolled size is checked before anything is built, and the loops that build states
(interegular's `crawl`, the byte-table builder, pruning and minimisation) `tick` the active meter, which raises
`ConstraintError` naming the limit as soon as one is passed, or as soon as a caller (the TUI's cancel) asks it to stop.

interegular's own `crawl` finds each new state with `list.index` (quadratic in the states); it is replaced, once, by
an equivalent one that numbers states in the same order through a dict and ticks the meter.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import interegular.fsm as _fsm

from chatapp.errors import ConstraintError


@dataclass(frozen=True)
class CompileBudget:
    """Limits of one constraint compile. `cancel`, when set by another thread, stops the compile at its next tick."""

    max_states: int = 20_000  # states of any intermediate automaton (character FSM or byte table)
    max_unrolled: int = 10_000  # positions of the regex with every counted repetition written out
    seconds: float = 10.0  # CPU seconds of the compiling thread
    cancel: threading.Event | None = None


DEFAULT_BUDGET = CompileBudget()


class CompileCancelled(ConstraintError):
    """The compile was cancelled by its caller (not the input's fault)."""


class _Meter:
    def __init__(self, budget: CompileBudget, source: str) -> None:
        self.budget = budget
        self.source = source
        # CPU time of the compiling thread, not wall time: a compile is limited by the work it does, so a busy
        # machine (or a UI thread taking turns with it) does not turn a valid regex into a refused one.
        self.deadline = time.thread_time() + budget.seconds
        self._ticks = 0

    def states(self, count: int, what: str) -> None:
        """Raise if an automaton has grown past the state limit (and check time now and then)."""
        if count > self.budget.max_states:
            raise ConstraintError(
                f"{self.source} needs more than {self.budget.max_states:,} {what} states to compile "
                "(the limit), e.g. from a large counted repetition or a pattern that must remember many characters",
                hint="simplify it: smaller {n} counts, fewer alternatives under repetition",
            )
        self.tick()

    def tick(self) -> None:
        self._ticks += 1
        if self._ticks & 63:
            return
        if self.budget.cancel is not None and self.budget.cancel.is_set():
            raise CompileCancelled(f"compiling {self.source} was cancelled", hint="set the constraint again")
        if time.thread_time() > self.deadline:
            raise ConstraintError(
                f"{self.source} took more than {self.budget.seconds:g} s of CPU time to compile (the limit)",
                hint="simplify it: smaller {n} counts, fewer alternatives under repetition",
            )


_local = threading.local()


def active_meter() -> _Meter | None:
    return getattr(_local, "meter", None)


@contextmanager
def metered(source: str, budget: CompileBudget | None = None) -> Iterator[_Meter]:
    """Run a compile under `budget` (the default when None); nested calls keep the outermost meter."""
    outer = active_meter()
    if outer is not None:
        yield outer
        return
    meter = _Meter(budget or DEFAULT_BUDGET, source)
    _local.meter = meter
    try:
        yield meter
    finally:
        _local.meter = None


def tick() -> None:
    meter = active_meter()
    if meter is not None:
        meter.tick()


def check_states(count: int, what: str) -> None:
    meter = active_meter()
    if meter is not None:
        meter.states(count, what)


def _state_key(state: object) -> object:
    """A hashable key equal for states interegular's `crawl` finds equal (its states may be sets or dicts)."""
    if isinstance(state, set | frozenset):
        return frozenset(state)
    if isinstance(state, dict):
        return ("dict", frozenset(state.items()))
    return state


def _budgeted_crawl(alphabet, initial, final, follow):
    """interegular's `crawl` (same states in the same order), linear instead of quadratic, under the meter."""
    meter = active_meter()
    states = [initial]
    index = {_state_key(initial): 0}
    finals = set()
    transitions = {}
    i = 0
    while i < len(states):
        state = states[i]
        if final(state):
            finals.add(i)
        transitions[i] = {}
        for transition in alphabet.by_transition:
            try:
                nxt = follow(state, transition)
            except _fsm.OblivionError:
                continue
            key = _state_key(nxt)
            j = index.get(key)
            if j is None:
                j = len(states)
                states.append(nxt)
                index[key] = j
                if meter is not None:
                    meter.states(len(states), "automaton")
            transitions[i][transition] = j
        i += 1
    return _fsm.FSM(
        alphabet=alphabet, states=range(len(states)), initial=0, finals=finals, map=transitions,
        __no_validation__=True,
    )


_fsm.crawl = _budgeted_crawl
