"""Byte-level DFAs: the recognizer the compiled trie walk runs against.

A `ByteDFA` is a dense `int32[n_states, 256]` transition table with state 0 the dead state (every byte leads back
to it). Tables are pruned to states that are reachable and can still reach acceptance, then minimised, so "not
dead" means exactly "this prefix can be completed to a match": the trie walk needs no other check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from chatapp.trie.budget import check_states, tick

DEAD = 0
"""The dead state: reached by any byte that no match can continue with; absorbing."""

MAX_FORCED_BYTES = 4096
"""Cap on one forced run (a forced cycle cannot occur in a pruned DFA; the cap only bounds pathological sizes)."""


@dataclass(frozen=True, eq=False)
class ByteDFA:
    """A pruned, minimised DFA over bytes. `source` names what it was compiled from (for messages)."""

    transitions: np.ndarray  # int32[n_states, 256]
    accepting: np.ndarray  # bool[n_states]
    start: int
    source: str = ""
    live_count: np.ndarray = field(init=False, repr=False)  # int32[n_states]: bytes not leading to DEAD
    single_byte: np.ndarray = field(init=False, repr=False)  # int32[n_states]: that byte when live_count == 1
    _forced_runs: dict[int, tuple[bytes, int]] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        live = self.transitions != DEAD
        object.__setattr__(self, "live_count", live.sum(axis=1).astype(np.int32))
        object.__setattr__(self, "single_byte", np.argmax(live, axis=1).astype(np.int32))

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    def step(self, state: int, data: bytes) -> int:
        """The state after `data` (DEAD if `data` cannot be continued to a match)."""
        table = self.transitions
        for byte in data:
            state = int(table[state, byte])
            if state == DEAD:
                return DEAD
        return state

    def accepts(self, data: bytes) -> bool:
        return bool(self.accepting[self.step(self.start, data)])

    def can_extend(self, state: int) -> bool:
        """Whether at least one more byte is possible from `state`."""
        return bool(self.live_count[state] > 0)

    def forced_bytes(self, state: int) -> bytes:
        """The bytes every match must continue with from `state`: one live byte at a time, stopping at acceptance.

        An accepting state is a choice point (stop here or go on), so forcing stops there.
        """
        return self.forced_run(state)[0]

    def forced_run(self, state: int) -> tuple[bytes, int]:
        """`forced_bytes(state)` and the state after them (cached: fast-forward asks at every forced step)."""
        run = self._forced_runs.get(state)
        if run is None:
            out = bytearray()
            end = state
            while not self.accepting[end] and self.live_count[end] == 1 and len(out) < MAX_FORCED_BYTES:
                byte = int(self.single_byte[end])
                out.append(byte)
                end = int(self.transitions[end, byte])
            run = (bytes(out), end)
            self._forced_runs[state] = run
        return run

    def recognizer(self, state: int | None = None) -> DfaRecognizer:
        return DfaRecognizer(self, self.start if state is None else state)


class DfaRecognizer:
    """`try_push_byte` / `pop_bytes` over a stack of DFA states (the Python walk's view of a `ByteDFA`)."""

    def __init__(self, dfa: ByteDFA, state: int) -> None:
        self._table = dfa.transitions
        self.stack = [state]

    @property
    def state(self) -> int:
        return self.stack[-1]

    def try_push_byte(self, byte: int) -> bool:
        nxt = int(self._table[self.stack[-1], byte])
        if nxt == DEAD:
            return False
        self.stack.append(nxt)
        return True

    def pop_bytes(self, n: int) -> None:
        if n:
            del self.stack[-n:]


def finish_dfa(transitions: np.ndarray, accepting: np.ndarray, start: int, source: str) -> ByteDFA:
    """Prune (unreachable states, states that cannot reach acceptance) and minimise a raw table into a `ByteDFA`.

    `transitions[DEAD]` must be all DEAD. If nothing is accepted at all the result has only the dead state and
    a dead start: every mask is empty, which the caller reports as an error.
    """
    transitions = np.asarray(transitions, dtype=np.int32)
    accepting = np.asarray(accepting, dtype=bool)
    keep = _reachable(transitions, start) & _coreachable(transitions, accepting)
    keep[DEAD] = True
    remap = np.where(keep, np.cumsum(keep) - 1, DEAD).astype(np.int32)
    transitions = remap[transitions[keep]]
    accepting = accepting[keep]
    start = int(remap[start])
    transitions, accepting, start = _minimise(transitions, accepting, start)
    return ByteDFA(transitions=transitions, accepting=accepting, start=start, source=source)


def stitch(pieces: list[ByteDFA], bridges: list[bytes], source: str) -> ByteDFA:
    """The DFA of `pieces[0] bridges[0] pieces[1] ... pieces[-1]` (concatenation with fixed byte strings between).

    Used to splice special tokens (bytes 0xFF + name) into a regex: from every accepting state of a piece the
    bridge's bytes lead, through fresh states, to the next piece's start. That stays deterministic because no
    piece has a transition on a bridge's first byte (0xFF never occurs in UTF-8); a clash raises ValueError.
    """
    if len(bridges) != len(pieces) - 1:
        raise ValueError("need one bridge between each two pieces")
    offsets, rows = [], [np.zeros((1, 256), dtype=np.int32)]
    total = 1
    for piece in pieces:  # each piece's rows except its DEAD row, renumbered; DEAD stays 0
        offsets.append(total - 1)
        shift = np.where(piece.transitions[1:] == DEAD, DEAD, piece.transitions[1:] + total - 1)
        rows.append(shift.astype(np.int32))
        total += piece.num_states - 1
    table = np.concatenate(rows)
    accepting = np.zeros(total, dtype=bool)
    accepting[offsets[-1] + 1 :] = pieces[-1].accepting[1:]
    for i, bridge in enumerate(bridges):
        chain = np.zeros((len(bridge) - 1, 256), dtype=np.int32)
        chain_ids = np.arange(len(table), len(table) + len(bridge) - 1)
        targets = [*chain_ids.tolist(), pieces[i + 1].start + offsets[i + 1]]
        for k in range(1, len(bridge)):
            chain[k - 1, bridge[k]] = targets[k]
        table = np.concatenate((table, chain))
        accepting = np.concatenate((accepting, np.zeros(len(chain), dtype=bool)))
        ends = np.flatnonzero(pieces[i].accepting) + offsets[i]
        if (table[ends, bridge[0]] != DEAD).any():
            raise ValueError(f"byte {bridge[0]:#x} already has a meaning in piece {i}")
        table[ends, bridge[0]] = targets[0]
    start = pieces[0].start + offsets[0]
    return finish_dfa(table, accepting, start, source)


def _reachable(transitions: np.ndarray, start: int) -> np.ndarray:
    seen = np.zeros(len(transitions), dtype=bool)
    seen[start] = True
    frontier = np.array([start])
    while len(frontier):
        tick()
        nxt = np.unique(transitions[frontier])
        nxt = nxt[~seen[nxt]]
        seen[nxt] = True
        frontier = nxt
    return seen


def _coreachable(transitions: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """States from which an accepting state is reachable: a breadth-first search backwards over the edges.

    Linear in the edges (a fixpoint over the whole table would take one table pass per state of a long chain).
    """
    n = len(transitions)
    sources = np.repeat(np.arange(n, dtype=np.int64), transitions.shape[1])
    targets = transitions.reshape(-1).astype(np.int64)
    edge_id = np.unique(targets * n + sources)  # distinct (target, source) pairs, sorted by target
    by_target, from_source = edge_id // n, edge_id % n
    starts = np.searchsorted(by_target, np.arange(n + 1))
    good = accepting.copy()
    good[DEAD] = False
    frontier = np.flatnonzero(good)
    while len(frontier):
        tick()
        spans = [from_source[starts[t] : starts[t + 1]] for t in frontier]
        preds = np.unique(np.concatenate(spans)) if spans else np.zeros(0, dtype=np.int64)
        preds = preds[~good[preds]]
        preds = preds[preds != DEAD]
        good[preds] = True
        frontier = preds
    return good


def _minimise(transitions: np.ndarray, accepting: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Moore's partition refinement with `np.unique` over (class, classes of the successors) rows.

    Bytes that every state treats alike (one column of the table repeated) are compared once: a signature has one
    column per byte class, not 256, which makes each round cheap for the usual tables (ASCII letters, digits).
    Renumbers classes so DEAD stays 0 (it is alone in its initial class: the only non-coreachable state left).
    """
    check_states(len(transitions), "byte")
    _, column_of_class = np.unique(transitions.T, axis=0, return_index=True)
    compact = transitions[:, np.sort(column_of_class)]
    classes = np.where(accepting, 2, 1)
    classes[DEAD] = 0
    count = len(np.unique(classes))
    while True:
        tick()
        signature = np.concatenate((classes[:, None], classes[compact]), axis=1)
        classes = _row_ids(signature)
        new_count = int(classes.max()) + 1
        if new_count == count:
            break
        count = new_count
    # Rows are numbered in sorted order, and DEAD's row (class 0, all-zero successors) is the smallest: it keeps 0.
    representative = np.zeros(count, dtype=np.int64)
    representative[classes] = np.arange(len(classes))
    new_transitions = classes[transitions[representative]].astype(np.int32)
    new_accepting = accepting[representative]
    return new_transitions, new_accepting, int(classes[start])


def _row_ids(rows: np.ndarray) -> np.ndarray:
    """Number the distinct rows of a 2-D int array in lexicographic order (`np.unique(axis=0)`'s inverse, faster)."""
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    starts = np.ones(len(rows), dtype=bool)
    starts[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    ids = np.empty(len(rows), dtype=np.int64)
    ids[order] = np.cumsum(starts) - 1
    return ids
