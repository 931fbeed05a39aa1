"""No host sync inside the step: it traces as one graph, runs under CUDA sync-error mode, and captures in a graph."""

from __future__ import annotations

import pytest
import torch

from chatapp.ttfa.automaton import Automaton, TTFAState, ttfa_advance, ttfa_step
from chatapp.ttfa.program import Program, Zone

ROWS = 8


def sample_automaton(device: str = "cpu") -> Automaton:
    """Two programs covering feeds, a forced-only zone, a jump, a self-loop and a budget."""
    first = Program(
        "first",
        (
            Zone("intro", feed=(1, 2), budget=0, tags=("x",)),
            Zone("body", feed=(3,), until=frozenset({4, 5}), timeout_token=4, budget=4, tags=("y",)),
            Zone("loop", until=frozenset({6}), jump_on=frozenset({7}), jump_to=2, timeout_token=6),
        ),
        ("x", "y"),
        pad=0,
        vocab_size=10,
        max_genned_per_zone=5,
    )
    second = Program("second", (Zone("only", until=frozenset({8}), jump_on=frozenset({9}), jump_to=1),), ("y",), 0, 10)
    return Automaton([first, second], [b % 2 for b in range(ROWS)], device=device)


def token_stream(steps: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 12, (steps, ROWS), generator=torch.Generator().manual_seed(0)).to(device)


def run_eager(automaton: Automaton, stream: torch.Tensor) -> list[tuple[list[int], list[bool], list[list[bool]]]]:
    trace = []
    for tokens in stream:
        out, forced, tags = automaton.step(tokens)
        trace.append((out.tolist(), forced.tolist(), tags.tolist()))
    return trace


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here")
def test_step_and_advance_trace_as_one_graph() -> None:
    """`fullgraph=True` fails on any data-dependent Python branch or host read (`.item()`, `bool(tensor)`)."""
    compiled_step = torch.compile(ttfa_step, fullgraph=True, backend="aot_eager")
    compiled_advance = torch.compile(ttfa_advance, fullgraph=True, backend="aot_eager")
    stream = token_stream(20)
    expected = run_eager(sample_automaton(), stream)
    automaton = sample_automaton()
    state, tables = automaton.state, automaton.tables
    for tokens, (out, forced, tags) in zip(stream, expected, strict=True):
        result = compiled_step(state, tables, tokens)
        state = result.state
        assert (result.tokens.tolist(), result.forced.tolist(), result.tags.tolist()) == (out, forced, tags)
    advanced = compiled_advance(automaton.state, tables, automaton.pending_feed())
    eager = ttfa_advance(automaton.state, tables, automaton.pending_feed())
    assert all(torch.equal(a, b) for a, b in zip(advanced, eager, strict=True))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_cuda_step_never_synchronizes() -> None:
    automaton = sample_automaton("cuda")
    stream = token_stream(20, "cuda")
    expected = run_eager(sample_automaton(), stream.cpu())
    outputs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for tokens in stream:
            automaton.peek_feed(4)
            automaton.select_rows(torch.arange(ROWS, device="cuda"))
            outputs.append(automaton.step(tokens))
        automaton.advance(automaton.pending_feed())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = [(out.tolist(), forced.tolist(), tags.tolist()) for out, forced, tags in outputs]
    assert got == expected


@pytest.mark.gpu
@cuda
def test_cuda_graph_capture_replays_the_step() -> None:
    automaton = sample_automaton("cuda")
    stream = token_stream(20, "cuda")
    expected = run_eager(sample_automaton(), stream.cpu())
    state = TTFAState(*(t.clone() for t in automaton.state))
    tokens = torch.zeros(ROWS, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as CUDA graphs require
        ttfa_step(state, automaton.tables, tokens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = ttfa_step(state, automaton.tables, tokens)
        for old, new in zip(state, result.state, strict=True):
            old.copy_(new)
    for step_tokens, (out, forced, tags) in zip(stream, expected, strict=True):
        tokens.copy_(step_tokens)
        graph.replay()
        assert (result.tokens.tolist(), result.forced.tolist(), result.tags.tolist()) == (out, forced, tags)
