"""Generation against transformers (greedy parity), per-row independence, events, compaction, context limits."""

from __future__ import annotations

import pytest
import torch

from chatapp.engine.engine import Engine
from chatapp.errors import ConstraintError, ContextOverflowError, SettingsError
from chatapp.settings import GenerationSettings

GREEDY = GenerationSettings(max_tokens=24, routing="off")
PROMPTS = [
    "Hello! How are you today?",
    "What is 37*45? Use the calculator.",
    "Paris",
    "The quick brown fox jumps over the lazy dog.",
]


def hf_greedy(reference, prompts: list[list[int]], new_tokens: int, stops: tuple[int, ...]) -> list[list[int]]:
    """transformers' greedy generate on a left-padded batch, each row cut after its first stop token."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = reference.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=list(stops),
        pad_token_id=0,
    )[:, width:].tolist()
    cut = []
    for row in out:
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        cut.append(row[:end])
    return cut


def engine_tokens(engine: Engine, prompts, settings=GREEDY, num_samples: int = 1) -> list[list[int]]:
    results = engine.generate_batch(prompts, settings, num_samples=num_samples)
    return [r.tokens + ([r.stop_token] if r.stop_token is not None else []) for r in results]


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_tokens_equal_transformers_generate(engine, reference, chat_format, batch: int) -> None:
    prompts = [chat_format.render_for_completion([{"role": "user", "content": p}]) for p in PROMPTS[:batch]]
    assert len({len(p) for p in prompts}) == batch  # ragged prefill against transformers' left padding
    expected = hf_greedy(reference, prompts, GREEDY.max_tokens, chat_format.stop_token_ids)
    assert engine_tokens(engine, prompts) == expected


def test_rows_are_independent_of_the_batch_around_them(engine) -> None:
    sampled = GenerationSettings(max_tokens=16, temperature=0.9, top_p=0.95, seed=42, routing="off")
    alone = engine_tokens(engine, [PROMPTS[1]], sampled)[0]
    for others in ([PROMPTS[0]], [PROMPTS[0], PROMPTS[2], PROMPTS[3]], PROMPTS[2:] * 3):
        settings = [GREEDY.with_(max_tokens=5)] + [sampled] + [GREEDY] * (len(others) - 1)
        batch = engine_tokens(engine, [others[0], PROMPTS[1], *others[1:]], settings)
        assert batch[1] == alone


def test_seed_reproducibility_and_samples_differ(engine) -> None:
    sampled = GenerationSettings(max_tokens=12, temperature=1.0, seed=7, routing="off")
    first = engine_tokens(engine, [PROMPTS[0]], sampled, num_samples=3)
    assert first == engine_tokens(engine, [PROMPTS[0]], sampled, num_samples=3)
    assert len({tuple(t) for t in first}) == 3  # num_samples rows draw different streams
    # Sample i of a num_samples run equals a lone run only for sample 0 (its stream key includes the index).
    assert first[0] == engine_tokens(engine, [PROMPTS[0]], sampled)[0]
    assert engine_tokens(engine, [PROMPTS[0]], sampled.with_(seed=8)) != first[:1]


def test_num_samples_prefills_once_and_replicates(scripted, chat_format) -> None:
    engine, model = scripted({})
    prompt = chat_format.render_for_completion([{"role": "user", "content": PROMPTS[3]}])
    engine.generate_batch([prompt], GREEDY.with_(max_tokens=3), num_samples=4)
    assert model.calls[0] == (1, len(prompt))  # one prefill row
    assert model.calls[1][0] == 4  # then four decode rows


def test_first_step_carries_the_prompt_info_and_routing(engine, chat_format) -> None:
    steps = list(engine.generate(PROMPTS[:2], GenerationSettings(max_tokens=4)))
    info = steps[0].prompt
    assert info is not None and all(s.prompt is None for s in steps[1:])
    lengths = [len(chat_format.render_for_completion([{"role": "user", "content": p}])) for p in PROMPTS[:2]]
    assert info.prompt_tokens == tuple(lengths)
    assert info.context_size == engine.context_size
    assert [len(r) for r in info.router_probs] == lengths
    layers = len(engine.stt_layers)
    assert layers > 0 and all(len(t) == layers for t in info.computed[0])
    event = steps[0].tokens[0]
    assert len(event.router_probs) == layers and len(event.computed) == layers
    assert {e.row for s in steps for e in s.tokens} == {0, 1}
    assert steps[-1].active_rows == 0


def test_routing_off_reports_no_routing(engine) -> None:
    steps = list(engine.generate(PROMPTS[:1], GREEDY.with_(max_tokens=3)))
    assert steps[0].prompt.router_probs is None
    assert all(e.router_probs is None and e.computed is None for s in steps for e in s.tokens)


def test_max_tokens_and_finished_rows_leave_the_batch(scripted, chat_format) -> None:
    engine, model = scripted({})
    settings = [GREEDY.with_(max_tokens=n) for n in (2, 9, 3, 9)]
    results = engine.generate_batch(PROMPTS, settings)
    assert [len(r.tokens) for r in results] == [2, 9, 3, 9]
    assert all(r.finish_reason == "length" for r in results)
    batch_sizes = [batch for batch, _ in model.step_calls]
    assert batch_sizes[0] == 4 and batch_sizes[-1] == 2  # compacted once rows 0 and 2 finished


def test_stop_tokens_end_a_row(scripted, chat_format, chat_tokenizer) -> None:
    prompt = chat_format.render_for_completion([{"role": "user", "content": "Hi"}])
    dot = chat_tokenizer.token_to_id(".")
    engine, _ = scripted({len(prompt) + 2: dot})
    result = engine.generate_batch([prompt], GREEDY.with_(stop_tokens=(dot,)))[0]
    assert result.finish_reason == "stop" and result.stop_token == dot
    assert len(result.tokens) == 2


def test_full_context_ends_the_row_with_a_message(stt_model, chat_tokenizer, chat_format) -> None:
    engine = Engine(stt_model, chat_tokenizer, chat_format, context_size=40)
    prompt = chat_format.render_for_completion([{"role": "user", "content": "Hello there"}])
    steps = list(engine.generate([prompt], GREEDY.with_(max_tokens=200)))
    last = steps[-1].tokens[-1]
    assert last.finish_reason == "context" and "context is full" in last.error
    assert sum(len(s.tokens) for s in steps) == 40 - len(prompt)
    with pytest.raises(ContextOverflowError, match="prompt 0 needs"):
        engine.generate([list(range(40))], GREEDY)


def test_bad_requests_fail_before_generating(engine) -> None:
    with pytest.raises(SettingsError, match="share routing"):
        engine.generate(PROMPTS[:2], [GREEDY, GREEDY.with_(routing="student")])
    with pytest.raises(SettingsError, match="2 settings for 1"):
        engine.generate(PROMPTS[:1], [GREEDY, GREEDY])
    with pytest.raises(SettingsError, match="compiled TTFA program"):
        engine.generate(PROMPTS[:1], GREEDY, programs=["chat"])
    with pytest.raises(SettingsError, match="2 programs for 1"):
        engine.generate(PROMPTS[:1], GREEDY, programs=[None, None])
    with pytest.raises(SettingsError, match="2 constraints for 1"):
        engine.generate(PROMPTS[:1], GREEDY, constraints=["[0-9]+", None])
    with pytest.raises(ConstraintError):
        engine.generate(PROMPTS[:1], GREEDY, constraints=["(unclosed"])
