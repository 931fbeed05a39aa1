"""The batched automaton against the per-row reference interpreter, step by step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.ttfa.automaton import Automaton
from chatapp.ttfa.program import Program, Zone
from chatapp.ttfa.reference import ReferenceRow

from .strategies import VOCAB, model_tokens, programs

STEPS = 24


def tag_tuple(automaton: Automaton, row_tags: list[bool]) -> tuple[str, ...]:
    return tuple(name for name, on in zip(automaton.tag_names, row_tags, strict=True) if on)


def assert_same_state(automaton: Automaton, rows: list[ReferenceRow]) -> None:
    pc, ptr, gen = automaton.local_state()
    assert pc == [r.pc for r in rows]
    assert ptr == [r.ptr for r in rows]
    assert gen == [r.gen for r in rows]
    assert automaton.pending_feed().tolist() == [r.pending_feed() for r in rows]
    assert automaton.halted().tolist() == [r.halted for r in rows]


def step_both(automaton: Automaton, rows: list[ReferenceRow], tokens: list[int]) -> None:
    out, forced, tags = automaton.step(torch.tensor(tokens, dtype=torch.int64))
    expected = [row.step(token) for row, token in zip(rows, tokens, strict=True)]
    assert out.tolist() == [e[0] for e in expected]
    assert forced.tolist() == [e[1] for e in expected]
    got_tags = [tag_tuple(automaton, t) for t in tags.tolist()]
    assert [set(t) for t in got_tags] == [set(e[2]) for e in expected]
    assert_same_state(automaton, rows)


@settings(max_examples=120)
@given(
    progs=st.lists(programs(), min_size=1, max_size=3),
    data=st.data(),
)
def test_batched_step_matches_reference(progs: list[Program], data: st.DataObject) -> None:
    batch = data.draw(st.integers(1, 6), label="batch")
    row_program = data.draw(st.lists(st.integers(0, len(progs) - 1), min_size=batch, max_size=batch))
    automaton = Automaton(progs, row_program)
    rows = [ReferenceRow(progs[p]) for p in row_program]
    assert_same_state(automaton, rows)
    for _ in range(STEPS):
        step_both(automaton, rows, data.draw(model_tokens(batch)))
    assert automaton.done() == all(r.halted for r in rows)


@settings(max_examples=80)
@given(progs=st.lists(programs(), min_size=1, max_size=3), data=st.data())
def test_advance_equals_steps_on_the_feed(progs: list[Program], data: st.DataObject) -> None:
    """`advance(n)` leaves exactly the state of `n` steps; `peek_feed` and `peek_feed_tags` show what they emit,
    across forced-only zones too."""
    batch = data.draw(st.integers(1, 5), label="batch")
    row_program = data.draw(st.lists(st.integers(0, len(progs) - 1), min_size=batch, max_size=batch))
    automaton = Automaton(progs, row_program)
    rows = [ReferenceRow(progs[p]) for p in row_program]
    for _ in range(6):
        pending = automaton.pending_feed().tolist()
        n = [data.draw(st.just(p) | st.integers(0, p)) for p in pending]  # often the whole run
        k = max(pending, default=0) + 1
        peeked = automaton.peek_feed(k).tolist()
        peeked_tags = automaton.peek_feed_tags(k).tolist()
        automaton.advance(torch.tensor(n))
        for b, row in enumerate(rows):
            emitted = [row.step(0) for _ in range(n[b])]
            assert all(forced for _, forced, _ in emitted)
            assert [token for token, _, _ in emitted] == peeked[b][: n[b]]
            assert [set(t) for _, _, t in emitted] == [set(tag_tuple(automaton, t)) for t in peeked_tags[b][: n[b]]]
            assert peeked[b][pending[b]] == row.program.pad  # past the feed: pad, no tags
            assert not any(peeked_tags[b][pending[b]])
        assert_same_state(automaton, rows)
        step_both(automaton, rows, data.draw(model_tokens(batch)))


def test_pending_feed_runs_through_forced_only_zones() -> None:
    program = Program(
        "p",
        (
            Zone("a", feed=(1, 2), budget=0, tags=("x",)),
            Zone("b", feed=(3,), budget=0),
            Zone("c", feed=(4, 5), until=frozenset({6}), tags=("y",)),
        ),
        ("x", "y"),
        pad=0,
        vocab_size=VOCAB,
    )
    automaton = Automaton([program], [0])
    assert automaton.pending_feed().tolist() == [5]
    assert automaton.peek_feed(6).tolist() == [[1, 2, 3, 4, 5, 0]]
    assert automaton.peek_feed_tags(6).tolist() == [
        [[True, False]] * 2 + [[False, False]] + [[False, True]] * 2 + [[False, False]]
    ]
    automaton.advance(torch.tensor([4]))
    assert automaton.zone_labels() == ["c"] and automaton.local_state() == ([2], [4], [1])


def test_advance_rejects_more_than_the_pending_feed() -> None:
    program = Program("p", (Zone("a", feed=(1, 2), until=frozenset({3})),), (), pad=0, vocab_size=VOCAB)
    automaton = Automaton([program], [0])
    with pytest.raises(RuntimeError):
        automaton.advance(torch.tensor([3]))


def test_halted_rows_emit_pad_with_no_tags_and_done() -> None:
    program = Program("p", (Zone("a", until=frozenset({3}), tags=("t",)),), ("t",), pad=7, vocab_size=VOCAB)
    automaton = Automaton([program], [0, 0])
    out, forced, tags = automaton.step(torch.tensor([3, 4]))
    assert out.tolist() == [3, 4] and forced.tolist() == [False, False] and tags.tolist() == [[True], [True]]
    assert automaton.zone_labels() == ["halt", "a"]
    assert not automaton.done()
    out, forced, tags = automaton.step(torch.tensor([5, 3]))
    assert out.tolist() == [7, 3] and forced.tolist() == [True, False] and tags.tolist() == [[False], [True]]
    assert automaton.done()


def test_out_of_vocabulary_tokens_pass_through_without_firing() -> None:
    program = Program("p", (Zone("a", until=frozenset({VOCAB - 1})),), (), pad=0, vocab_size=VOCAB)
    automaton = Automaton([program], [0])
    out, forced, _ = automaton.step(torch.tensor([VOCAB + 100]))
    assert out.tolist() == [VOCAB + 100] and not forced.item()
    assert automaton.zone_labels() == ["a"]
