"""A row's numbers never depend on its batch: greedy rows answer in a batch exactly as alone, whatever else is in
it (prompt lengths on both sides of the products' 48-row switch, rows that finish early, routing on or off, tool
calls fed forced output, constraints), and on a CPU every decode step of an int8 batch is the native step, never
`extend`.

The int8 model decodes through the native step (`stt.cpu_step`), whose rows are summed in the same order whatever
rows are beside them, and each prompt is prefilled in its own row (`engine.loop.prefill_row`): there the log-probs
are compared bit for bit. The float32 model decodes through the torch step, where a batch's products are one matrix
product and a lone row's another: its tokens are compared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatapp.models import load_engine
from chatapp.settings import GenerationSettings

WORDS = ["What", "is", "12", "times", "7", "?", "Tell", "me", "about", "Paris", "and", "the", "sea", "please", "now"]


def prompt_of(words: list[int]) -> str:
    return " ".join(WORDS[w % len(WORDS)] for w in words)


@pytest.fixture(scope="module")
def int8_engine(routed_model_dir: Path):
    engine = load_engine(routed_model_dir, "cpu", dtype="int8")
    if engine.model.runtime.native is None:
        pytest.skip("the int8 native step could not be built here (no C compiler)")
    return engine


@pytest.fixture(scope="module")
def float32_engine(routed_model_dir: Path):
    return load_engine(routed_model_dir, "cpu", dtype="float32")


def rows_of(engine, prompts: list[str], settings: list[GenerationSettings]):
    """Each reply's (tokens, forced flags, log-probs of its tokens)."""
    replies = engine.generate_batch(prompts, settings)
    return [
        (
            tuple(e.token for e in reply.events),
            tuple(e.forced for e in reply.events),
            tuple(e.logprobs.logprob for e in reply.events),
        )
        for reply in replies
    ]


def assert_rows_answer_as_alone(engine, rows: list[tuple[list[int], int]], routing: str, exact: bool) -> None:
    """Each row's greedy reply in the batch is its reply alone: log-probs bit for bit (`exact`), else its tokens."""
    prompts = [prompt_of(words) for words, _ in rows]
    settings_ = [GenerationSettings(max_tokens=n, logprobs=1, routing=routing) for _, n in rows]
    batched = rows_of(engine, prompts, settings_)
    for prompt, setting, row in zip(prompts, settings_, batched, strict=True):
        alone = rows_of(engine, [prompt], [setting])[0]
        if exact:
            assert alone == row
        else:
            assert alone[:2] == row[:2]
            assert alone[2] == pytest.approx(row[2], abs=1e-3)


batch_compositions = st.lists(
    st.tuples(
        st.lists(st.integers(0, 200), min_size=1, max_size=70),  # prompt words: some prompts pass 48 tokens
        st.integers(1, 12),  # max_tokens: rows finish at different steps
    ),
    min_size=2,
    max_size=6,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=batch_compositions, routing=st.sampled_from(["student", "off"]))
def test_an_int8_row_is_the_same_in_any_batch_bit_for_bit(int8_engine, rows, routing: str) -> None:
    assert_rows_answer_as_alone(int8_engine, rows, routing, exact=True)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=batch_compositions, routing=st.sampled_from(["student", "off"]))
def test_a_float32_row_answers_the_same_in_any_batch(float32_engine, rows, routing: str) -> None:
    assert_rows_answer_as_alone(float32_engine, rows, routing, exact=False)


def test_no_int8_decode_step_of_a_batch_goes_through_extend(int8_engine, monkeypatch) -> None:
    """Rows that finish at different steps, a row fed a known run (its grammar forces a literal): every step after
    the prompts' prefill is the native step, finished rows masked in its call."""
    model = int8_engine.model
    calls: list[tuple[int, ...]] = []
    extend = model.extend

    def spy(ids, lengths, cache, **kwargs):
        calls.append(tuple(ids.shape))
        return extend(ids, lengths, cache, **kwargs)

    monkeypatch.setattr(model, "extend", spy)
    prompts = ["What is 12 times 7?", "Tell me about Paris and the sea please", "now"]
    settings_ = [GenerationSettings(max_tokens=n) for n in (3, 11, 6)]
    replies = int8_engine.generate_batch(prompts, settings_, constraints=[None, r"yes, because [a-z]{1,8}\.", None])
    assert len(replies[0].events) == 3 and any(e.forced for e in replies[1].events)
    assert len(calls) == len(prompts)  # the three prefills, one prompt each, and nothing after them
    for prompt, call in zip(prompts, calls, strict=True):
        assert call == (1, len(int8_engine.chat_format.render_for_completion([{"role": "user", "content": prompt}])))


def test_a_row_fed_a_run_in_one_step_matches_it_fed_a_token_a_step(int8_engine) -> None:
    """A known run fed in one step of the native step (successive calls, the other rows masked) is the same
    computation as its tokens fed one a step: a batch with a grammar-forced run and its rows alone agree bit for
    bit, with fast-forwarding on (a lone row fast-forwards) and off."""
    prompts = ["What is 12 times 7?", "Tell me about Paris"]
    constraints = [r"(yes|no), because [a-z ]{1,12}\.", None]
    for fast in (True, False):
        settings_ = [GenerationSettings(max_tokens=20, logprobs=1, fast_forward=fast)] * 2
        batched = int8_engine.generate_batch(prompts, settings_, constraints=constraints)
        for i, prompt in enumerate(prompts):
            alone = int8_engine.generate_batch([prompt], settings_[:1], constraints=constraints[i : i + 1])[0]
            assert [(e.token, e.forced, e.logprobs.logprob) for e in alone.events] == [
                (e.token, e.forced, e.logprobs.logprob) for e in batched[i].events
            ]


def test_the_native_step_leaves_an_idle_row_as_it_was(int8_engine) -> None:
    """The C call's active mask: a row not fed keeps its cache, its position and its router state untouched, and the
    fed rows get the numbers they get alone."""
    model = int8_engine.model
    with torch.inference_mode():
        both = model.new_cache(2, 32)
        alone = model.new_cache(1, 32)
        ids = torch.tensor([[5, 9, 13, 2], [7, 3, 11, 4]])
        for row in range(2):
            model.extend(ids[row : row + 1], torch.tensor([4]), both.row(row))
        model.extend(ids[1:], torch.tensor([4]), alone)
        before = (both.lengths[:, 0].clone(), both.seen[0].clone(), both.prev_hidden[:, 0].clone())
        out = model.decode(torch.tensor([8, 8]), both, active=torch.tensor([False, True]))
        own = model.decode(torch.tensor([8]), alone)
    assert torch.equal(both.lengths[:, 0], before[0]) and torch.equal(both.seen[0], before[1])
    assert torch.equal(both.prev_hidden[:, 0], before[2])
    assert torch.equal(out.logits[1], own.logits[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("routing", ["student", "off"])
def test_a_row_answers_the_same_in_any_batch_on_cuda(routed_model_dir: Path, routing: str) -> None:
    """On CUDA the torch step decodes (one call for every row, unselected rows computed and discarded) and each
    prompt is prefilled in its own row: a batch's greedy tokens are each prompt's alone."""
    engine = load_engine(routed_model_dir, "cuda", dtype="float32")
    rows = [([3, 1, 4, 1, 5], 9), (list(range(60)), 4), ([9, 2, 6], 12), (list(range(30, 90)), 7)]
    assert_rows_answer_as_alone(engine, rows, routing, exact=False)
