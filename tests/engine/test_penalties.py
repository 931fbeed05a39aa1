"""Penalties on repeats and min-p against references: transformers' logits processors (repetition penalty, min-p),
OpenAI's formula (presence, frequency), a brute-force DRY written as its author's reference implementation reads;
then through the engine: a row's penalties depend on its own tokens only, and greedy with a penalty repeats less."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper

from chatapp.engine.penalties import PenaltyState
from chatapp.engine.sampling import SamplingParams, sample_with_log_probs
from chatapp.settings import GenerationSettings

CPU = torch.device("cpu")
VOCAB = 12


def state_for(
    settings_: list[GenerationSettings], histories: list[list[int]], breakers: frozenset[int] = frozenset()
) -> PenaltyState | None:
    """The penalty state (None: no penalty is on) after each row emitted its history, appended in ragged steps of up to 3 tokens (as a
    fast-forward step would) and single tokens, to cover both paths."""
    mask = torch.tensor([t in breakers for t in range(VOCAB)])
    state = PenaltyState.build(settings_, VOCAB, CPU, lambda _: mask)
    if state is None:
        return None
    at = [0] * len(histories)
    step = 0
    while any(a < len(h) for a, h in zip(at, histories, strict=True)):
        width = 1 + step % 3
        tokens = torch.zeros(len(histories), width, dtype=torch.long)
        counts = torch.zeros(len(histories), dtype=torch.long)
        for b, history in enumerate(histories):
            chunk = history[at[b] : at[b] + width]
            tokens[b, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
            counts[b] = len(chunk)
            at[b] += len(chunk)
        state.append(tokens, counts)
        step += 1
    return state


def penalised(state: PenaltyState | None, logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    if state is not None:
        state.apply(out)
    return out


histories = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(
    history=histories,
    penalty=st.floats(0.5, 3.0),
    window=st.sampled_from([-1, 1, 3, 8, 64]),
    seed=st.integers(0, 2**16),
)
def test_repetition_penalty_is_transformers_over_the_window(history, penalty, window, seed) -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    s = GenerationSettings(repetition_penalty=penalty, repeat_last_n=window)
    seen = history if window < 0 else history[-window:]
    expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seen]), logits.clone())
    torch.testing.assert_close(penalised(state_for([s], [history]), logits), expected)


@settings(max_examples=60, deadline=None)
@given(
    history=histories,
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    window=st.sampled_from([-1, 2, 5]),
)
def test_presence_and_frequency_are_openais_formula(history, presence, frequency, window) -> None:
    logits = torch.linspace(-4, 4, VOCAB)[None]
    s = GenerationSettings(presence_penalty=presence, frequency_penalty=frequency, repeat_last_n=window)
    seen = history if window < 0 else history[-window:]
    expected = [
        x - presence * (seen.count(t) > 0) - frequency * seen.count(t) for t, x in enumerate(logits[0].tolist())
    ]
    torch.testing.assert_close(penalised(state_for([s], [history]), logits)[0], torch.tensor(expected))


def dry_reference(
    history: list[int], multiplier: float, base: float, allowed: int, last_n: int, breakers: frozenset[int]
) -> list[float]:
    """DRY's penalty per token, as the reference implementation (text-generation-webui's `DRYLogitsProcessor`, by
    DRY's author, which llama.cpp ports) computes it over the last `last_n` tokens, written for clarity."""
    tokens = history if last_n < 0 else history[-last_n:]
    penalty = [0.0] * VOCAB
    last = tokens[-1]
    if last in breakers:
        return penalty
    longest: dict[int, int] = {}
    for i in range(len(tokens) - 1):
        if tokens[i] != last or tokens[i + 1] in breakers:
            continue
        length = 1
        while i - length >= 0:
            previous = tokens[-(length + 1)]
            if tokens[i - length] != previous or previous in breakers:
                break
            length += 1
        longest[tokens[i + 1]] = max(length, longest.get(tokens[i + 1], 0))
    for token, length in longest.items():
        if length >= allowed:
            penalty[token] = multiplier * base ** (length - allowed)
    return penalty


@settings(max_examples=150, deadline=None)
@given(
    history=st.lists(st.integers(0, 3), min_size=1, max_size=40),  # a small alphabet: many repeats
    multiplier=st.floats(0.1, 2.0),
    base=st.floats(1.0, 3.0),
    allowed=st.integers(1, 4),
    last_n=st.sampled_from([-1, 2, 5, 16]),
    breakers=st.frozensets(st.integers(0, 4), max_size=2),
)
def test_dry_matches_the_reference_implementation(history, multiplier, base, allowed, last_n, breakers) -> None:
    s = GenerationSettings(
        dry_multiplier=multiplier, dry_base=base, dry_allowed_length=allowed, dry_penalty_last_n=last_n
    )
    logits = torch.zeros(1, VOCAB)
    got = -penalised(state_for([s], [history], breakers), logits)[0]
    expected = dry_reference(history, multiplier, base, allowed, last_n, breakers)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_dry_penalises_the_token_that_extends_a_loop_by_its_length() -> None:
    # "a b c d a b c" ends with "a b c", which was followed by "d": d would make it a repeat of length 4.
    a, b, c, d = 1, 2, 3, 4
    s = GenerationSettings(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    got = -penalised(state_for([s], [[a, b, c, d, a, b, c]]), torch.zeros(1, VOCAB))[0]
    assert got[d].item() == pytest.approx(0.8 * 1.75 ** (3 - 2))
    assert got.count_nonzero().item() == 1


def test_a_huge_dry_exponent_stays_finite() -> None:
    s = GenerationSettings(dry_multiplier=1.0, dry_base=16.0, dry_allowed_length=1)
    got = penalised(state_for([s], [[1, 2] * 40]), torch.zeros(1, VOCAB))
    assert torch.isfinite(got).all() and got[0, 1] < -1e30


def test_a_masked_token_stays_masked_and_an_unpenalised_row_is_untouched() -> None:
    rows = [GenerationSettings(repetition_penalty=1.5, presence_penalty=1.0, dry_multiplier=1.0), GenerationSettings()]
    state = state_for(rows, [[1, 2, 1, 2, 1], [1, 2, 1, 2, 1]])
    logits = torch.randn(2, VOCAB)
    logits[0, 2] = float("-inf")
    got = penalised(state, logits)
    assert got[0, 2] == float("-inf")
    torch.testing.assert_close(got[1], logits[1])


def test_no_state_is_built_when_no_row_has_a_penalty() -> None:
    settings_ = [GenerationSettings(temperature=0.7, top_k=40, min_p=0.05), GenerationSettings(repeat_last_n=0)]
    assert PenaltyState.build(settings_, VOCAB, CPU, lambda _: torch.zeros(VOCAB, dtype=torch.bool)) is None


def test_a_rows_penalties_depend_only_on_its_own_tokens() -> None:
    s = GenerationSettings(repetition_penalty=1.3, frequency_penalty=0.5, dry_multiplier=0.8, repeat_last_n=4)
    mine = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    alone = penalised(state_for([s], [mine]), torch.ones(1, VOCAB))
    beside = penalised(state_for([s, s], [[7, 7, 7, 7], mine]), torch.ones(2, VOCAB))
    torch.testing.assert_close(beside[1:], alone)
    both = state_for([s, s], [[7, 7], mine])
    assert both is not None
    compacted = both.select(torch.tensor([1]))
    torch.testing.assert_close(penalised(compacted, torch.ones(1, VOCAB)), alone)


@settings(max_examples=60, deadline=None)
@given(min_p=st.floats(0.0, 1.0), temperature=st.floats(0.2, 2.0), seed=st.integers(0, 2**16))
def test_min_p_keeps_the_tokens_transformers_keeps(min_p, temperature, seed) -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed)) * 4
    s = GenerationSettings(temperature=temperature, min_p=min_p)
    params = SamplingParams.build([s], [0], CPU)
    _, log_probs = sample_with_log_probs(logits.clone(), params, torch.zeros(1, dtype=torch.long))
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    warped = MinPLogitsWarper(min_p)(None, scores) if min_p > 0 else scores
    assert torch.equal(torch.isfinite(log_probs), torch.isfinite(warped))
    probs = torch.softmax(warped, dim=-1)
    torch.testing.assert_close(log_probs.exp(), probs, atol=1e-6, rtol=1e-5)


def test_greedy_with_a_repetition_penalty_repeats_less_through_the_engine(engine) -> None:
    """The tiny random model loops at once greedily; the penalties change its tokens, a batch gives each row
    what it gives alone, and the reply stays as long (forced tokens and the budget are untouched)."""
    prompt = "Hello there"
    plain = engine.generate_batch([prompt], GenerationSettings(max_tokens=40))[0]
    tuned = GenerationSettings(max_tokens=40, repetition_penalty=1.5, dry_multiplier=1.0, dry_allowed_length=2)
    alone = engine.generate_batch([prompt], tuned)[0]
    both = engine.generate_batch([prompt, "Other words entirely"], [tuned, GenerationSettings(max_tokens=7)])
    assert alone.tokens == both[0].tokens
    assert alone.tokens != plain.tokens
    distinct = len(set(alone.tokens)) / len(alone.tokens)
    assert distinct > len(set(plain.tokens)) / len(plain.tokens)
    assert math.isfinite(distinct)
