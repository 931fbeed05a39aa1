"""Per-token log-probabilities: equal to transformers' on the same weights, alternatives sorted and consistent with
greedy, the sampling distribution's alternatives respect the grammar, fast-forwarded tokens report what the
one-per-step path reports, and rows that did not ask pay nothing and get nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from chatapp.engine.events import TokenLogprobs
from chatapp.settings import GenerationSettings
from chatapp.trie.constraint import Constraint
from chatapp.trie.vocab import ConstraintVocab
from tests.engine.test_tools import block, script_at

GREEDY = GenerationSettings(max_tokens=16, routing="off", logprobs=5)
PROMPTS = ["Hello! How are you today?", "Paris"]
TOLERANCE = 1e-4


def _logprobs(events) -> list[TokenLogprobs]:
    return [event.logprobs for event in events]


def test_logprobs_equal_transformers_on_the_same_weights(engine, reference, chat_format) -> None:
    """Every emitted token's log p, entropy and top-5 equal a full transformers forward over prompt + answer."""
    sampled = GREEDY.with_(temperature=1.0, seed=7)
    for settings in (GREEDY, sampled):
        prompts = [chat_format.render_for_completion([{"role": "user", "content": p}]) for p in PROMPTS]
        for prompt, reply in zip(prompts, engine.generate_batch(prompts, settings), strict=True):
            answer = [event.token for event in reply.events]
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, dim=-1)
            for position, (token, measured) in enumerate(zip(answer, _logprobs(reply.events), strict=True)):
                row = expected[position]
                assert measured.logprob == pytest.approx(row[token].item(), abs=TOLERANCE)
                entropy = -(row.exp() * row).sum().item()
                assert measured.entropy == pytest.approx(entropy, abs=TOLERANCE)
                values, indices = row.topk(5)
                assert [a.logprob for a in measured.top] == pytest.approx(values.tolist(), abs=TOLERANCE)
                assert [a.token for a in measured.top] == indices.tolist()


def test_alternatives_are_sorted_and_greedy_takes_the_first(engine, chat_format) -> None:
    vocab_size = engine.model.config.vocab_size
    for reply in engine.generate_batch(PROMPTS, GREEDY):
        for event in reply.events:
            lp = event.logprobs
            assert lp is not None and len(lp.top) == 5
            values = [a.logprob for a in lp.top]
            assert values == sorted(values, reverse=True)
            assert 0 <= lp.entropy <= math.log(vocab_size) + 1e-6
            assert lp.logprob <= 0
            if not event.forced:
                assert lp.top[0].token == event.token  # greedy: the model's favourite is what was emitted
                assert lp.sampling_logprob == 0.0  # the greedy distribution is the argmax alone
                assert [a.token for a in lp.sampling_top] == [event.token]
            assert lp.top[0].piece == engine.token_bytes(lp.top[0].token)


def test_sampling_alternatives_respect_the_grammar(engine, chat_format, chat_tokenizer, stt_model) -> None:
    """Under a regex, the sampling distribution lists only tokens the grammar allowed at that point (the model's
    own alternatives may name forbidden ones: that is what it would have said)."""
    vocab = ConstraintVocab.from_tokenizer(chat_tokenizer, stt_model.config.vocab_size)
    pattern = r"(yes|no), because [a-z ]{1,12}\."
    settings = GenerationSettings(max_tokens=40, temperature=1.0, seed=4, routing="off", logprobs=20)
    model_named_a_forbidden_token = False
    for reply in engine.generate_batch(["Hello", "What is 37*45?"], settings, constraints=[pattern] * 2):
        state = Constraint.regex(pattern, vocab, chat_format.assistant_end_id)
        for event in reply.events:
            mask = np.unpackbits(state.allowed_mask().view(np.uint8), bitorder="little")
            lp = event.logprobs
            if not event.forced:
                assert lp.sampling_logprob is not None and math.isfinite(lp.sampling_logprob)
                assert lp.sampling_top, "a sampled token has a sampling distribution"
                assert all(mask[a.token] for a in lp.sampling_top)
                model_named_a_forbidden_token |= any(not mask[a.token] for a in lp.top)
            else:
                assert lp.sampling_logprob is None and lp.sampling_top == ()
            state.consume(event.token)
    assert model_named_a_forbidden_token  # the property means something: the model's own list is not filtered


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fast_forwarded_tokens_report_the_step_by_step_numbers(scripted, ids, temperature: float) -> None:
    """A tool's output pushed through one forward reports, for each of its forced tokens, the model's log p at
    that position: the same numbers as feeding it one token per step."""
    prompt = ids.prompt()
    script = script_at(len(prompt), [ids.start, *ids.text("37*45"), ids.end], block(ids, "1665"), [ids.stop])
    engine, model = scripted(script, fast_forward="always")
    settings = GenerationSettings(max_tokens=30, temperature=temperature, seed=5, routing="off", logprobs=3)
    runs = {}
    for fast_forward in (False, True):
        model.calls.clear()
        model.step_calls.clear()
        (reply,) = engine.generate_batch([prompt], settings.with_(fast_forward=fast_forward))
        runs[fast_forward] = reply
        assert (max(width for _, width in model.step_calls) > 1) == fast_forward
    slow, fast = runs[False], runs[True]
    assert [e.token for e in slow.events] == [e.token for e in fast.events]
    forced = [i for i, e in enumerate(fast.events) if e.forced]
    assert len(forced) == len(ids.text("1665")) + 2
    for a, b in zip(_logprobs(slow.events), _logprobs(fast.events), strict=True):
        assert b.logprob == pytest.approx(a.logprob, abs=TOLERANCE)
        assert b.entropy == pytest.approx(a.entropy, abs=TOLERANCE)
        assert [x.token for x in b.top] == [x.token for x in a.top]
    # Forced tool output was not scripted: the model's real distribution, informative about its surprise.
    assert any(fast.events[i].logprobs.logprob < -1e-3 for i in forced)


def test_logprobs_off_reports_nothing_and_rows_choose_for_themselves(engine) -> None:
    off, on = GREEDY.with_(logprobs=0), GREEDY.with_(logprobs=2)
    replies = engine.generate_batch(PROMPTS, [off, on])
    assert all(event.logprobs is None for event in replies[0].events)
    assert all(len(event.logprobs.top) == 2 for event in replies[1].events)
    alone = engine.generate_batch(PROMPTS[1:], on)[0]
    assert [e.logprobs.logprob for e in alone.events] == pytest.approx(
        [e.logprobs.logprob for e in replies[1].events], abs=TOLERANCE
    )
    assert [e.token for e in engine.generate_batch(PROMPTS, off)[1].events] == [e.token for e in alone.events]
