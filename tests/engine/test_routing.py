"""Student routing (STT layers skip tokens): events report the decisions, and every engine path that must be
equivalent (session vs fresh prefill, fast-forward vs step-by-step, alone vs batched) still is."""

from __future__ import annotations

import torch

from chatapp.engine.engine import Engine
from chatapp.settings import GenerationSettings

STUDENT = GenerationSettings(max_tokens=16, routing="student")


def rows(engine: Engine, prompts, settings=STUDENT) -> list[list[tuple[int, bool, tuple[bool, ...] | None]]]:
    out: dict[int, list] = {}
    for step in engine.generate(prompts, settings):
        for e in step.tokens:
            out.setdefault(e.row, []).append((e.token, e.forced, e.computed))
    return [out[i] for i in sorted(out)]


def test_events_carry_the_decisions_of_the_forward_that_processed_the_token(routed_model, chat_tokenizer,
                                                                             chat_format) -> None:  # fmt: skip
    engine = Engine(routed_model, chat_tokenizer, chat_format)
    prompt = chat_format.render_for_completion([{"role": "user", "content": "Hello! How are you today?"}])
    steps = list(engine.generate([prompt], STUDENT))
    events = [e for s in steps for e in s.tokens]
    decisions = [d for e in events for d in e.computed]
    assert 0 < sum(decisions) < len(decisions)  # the layers really skip some tokens
    # Replay the same tokens through a fresh cache: every token's routing must match its event.
    ids = torch.tensor([prompt + [e.token for e in events]])
    cache = routed_model.new_cache(1, ids.shape[1])
    out = routed_model.extend(ids, torch.tensor([ids.shape[1]]), cache, routing="student")
    replay = out.selected[:, 0].T.tolist()
    assert [list(c) for c in steps[0].prompt.computed[0]] == replay[: len(prompt)]
    assert [list(e.computed) for e in events] == replay[len(prompt) :]
    probs = torch.tensor([e.router_probs for e in events])
    assert torch.allclose(probs, out.router_probs[:, 0, len(prompt) :].T, atol=1e-5)


def test_a_row_is_the_same_alone_and_batched(routed_model, chat_tokenizer, chat_format) -> None:
    engine = Engine(routed_model, chat_tokenizer, chat_format)
    prompts = ["Hello! How are you today?", "Paris", "What is 37*45? Use the calculator."]
    batched = rows(engine, prompts)
    assert [rows(engine, [p])[0] for p in prompts] == batched


def test_session_continuation_equals_a_fresh_prefill(routed_model, chat_tokenizer, chat_format) -> None:
    engine = Engine(routed_model, chat_tokenizer, chat_format)
    session = engine.session()
    list(session.send("Hello! How are you today?", STUDENT))
    answer = [(e.token, e.computed) for s in session.send("Paris", STUDENT) for e in s.tokens]
    prompt = list(session.token_ids[: len(session.token_ids) - len(answer)])
    assert [(t, c) for t, _, c in rows(engine, [prompt])[0]] == answer


def test_fast_forward_keeps_tokens_and_decisions(routed_model, chat_tokenizer, chat_format) -> None:
    from tests.engine.conftest import ScriptedModel

    prompt = chat_format.render_for_completion([{"role": "user", "content": "37*45?"}])
    call = [chat_format.python_start_id, *chat_format.encode_text("37*45"), chat_format.python_end_id]
    model = ScriptedModel(routed_model, {len(prompt) + i: t for i, t in enumerate(call)})
    engine = Engine(model, chat_tokenizer, chat_format, fast_forward="always")
    sampled = STUDENT.with_(temperature=1.0, seed=9, max_tokens=20)
    step_by_step = rows(engine, [prompt, "Hello"], sampled.with_(fast_forward=False))
    fast = rows(engine, [prompt, "Hello"], sampled)
    assert any(forced for _, forced, _ in fast[0])
    assert fast == step_by_step
