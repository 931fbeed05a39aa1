"""Rows come and go: adding, retiring, permuting and replicating rows keeps every row's automaton intact."""

from __future__ import annotations

import copy

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from chatapp.ttfa.automaton import Automaton, TTFAState
from chatapp.ttfa.program import Program
from chatapp.ttfa.reference import ReferenceRow

from .strategies import model_tokens, programs


class RowManagement(RuleBasedStateMachine):
    """The engine's row lifecycle, mirrored by a list of reference rows."""

    automaton: Automaton
    progs: list[Program]
    rows: list[ReferenceRow]

    @initialize(progs=st.lists(programs(), min_size=1, max_size=3), data=st.data())
    def start(self, progs: list[Program], data: st.DataObject) -> None:
        self.progs = progs
        row_program = data.draw(st.lists(st.integers(0, len(progs) - 1), min_size=1, max_size=4))
        self.automaton = Automaton(progs, row_program)
        self.rows = [ReferenceRow(progs[p]) for p in row_program]

    @rule(data=st.data())
    def add_rows(self, data: st.DataObject) -> None:
        row_program = data.draw(st.lists(st.integers(0, len(self.progs) - 1), min_size=1, max_size=3))
        # Fresh rows join at their programs' entries: the state of a new automaton over the same programs.
        fresh = Automaton(self.progs, row_program).state
        self.automaton.state = TTFAState(*(torch.cat([old, new]) for old, new in zip(self.automaton.state, fresh, strict=True)))
        self.rows += [ReferenceRow(self.progs[p]) for p in row_program]

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def retire_rows(self, data: st.DataObject) -> None:
        keep = sorted(data.draw(st.sets(st.integers(0, len(self.rows) - 1))))
        self.automaton.select_rows(torch.tensor(keep, dtype=torch.int64))
        self.rows = [self.rows[i] for i in keep]

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def permute_or_replicate(self, data: st.DataObject) -> None:
        index = data.draw(st.lists(st.integers(0, len(self.rows) - 1), min_size=1, max_size=6))
        self.automaton.select_rows(torch.tensor(index, dtype=torch.int64))
        self.rows = [copy.copy(self.rows[i]) for i in index]

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        tokens = data.draw(model_tokens(len(self.rows)))
        out, forced, _ = self.automaton.step(torch.tensor(tokens, dtype=torch.int64))
        expected = [row.step(token) for row, token in zip(self.rows, tokens, strict=True)]
        assert out.tolist() == [e[0] for e in expected]
        assert forced.tolist() == [e[1] for e in expected]

    @rule(data=st.data())
    def fast_forward(self, data: st.DataObject) -> None:
        n = [data.draw(st.integers(0, row.pending_feed())) for row in self.rows]
        self.automaton.advance(torch.tensor(n, dtype=torch.int64))
        for row, count in zip(self.rows, n, strict=True):
            for _ in range(count):
                row.step(0)

    @invariant()
    def same_state(self) -> None:
        pc, ptr, gen = self.automaton.local_state()
        assert (pc, ptr, gen) == ([r.pc for r in self.rows], [r.ptr for r in self.rows], [r.gen for r in self.rows])
        labels = [r.program.zones[r.pc].label if not r.halted else "halt" for r in self.rows]
        assert self.automaton.zone_labels() == labels
        assert self.automaton.done() == all(r.halted for r in self.rows)


RowManagement.TestCase.settings = settings(max_examples=40, stateful_step_count=25)
TestRowManagement = RowManagement.TestCase
