"""The default model's refining tune (`recipes.smollm2.refine`) and the evaluation's agreement with a base model, on
a tiny random routed model: batches as served, targets as promised, a refined model that loads with its adapters."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chatapp.models.loader import load_model
from chatapp.recipes.smollm2 import data
from chatapp.recipes.smollm2.evaluate import agreement_score
from chatapp.recipes.smollm2.refine import PADDED_POSITIONS, RefineRecipe, padded, refine, sources, targets
from chatapp.stt.io import load_merged_adapters
from chatapp.training.tune import distillation_loss, routed_logits, served_routing

GENERAL = [
    ("What is a good name for a cat?", "Whiskers is a classic name for a cat."),
    ("Explain rain in one sentence.", "Rain is water that falls from clouds when droplets grow heavy."),
    ("Give me a tip for sleeping well.", "Keep a regular bedtime, even at weekends."),
    ("Describe the sea.", "The sea is vast, salty and always moving."),
]


@pytest.fixture(scope="module")
def loaded(routed_model_dir: Path):
    return load_model(routed_model_dir, dtype="float32")


def _encoded(loaded, count: int = 6) -> list[tuple[list[int], list[int]]]:
    questions = data.multistep_questions(random.Random(0), count, held_out=False)
    conversations = [data.tool_conversation(q, a) for q, a in questions]
    conversations += [[{"role": "user", "content": p}, {"role": "assistant", "content": a}] for p, a in GENERAL]
    return [loaded.chat_format.render_conversation(c) for c in conversations]


def test_padded_rows_keep_every_conversation_and_route_only_the_reply(loaded) -> None:
    encoded = _encoded(loaded)
    rows = padded(encoded, pad=0)
    found = []
    for batch in rows:
        assert batch.ids.numel() <= max(PADDED_POSITIONS, batch.ids.shape[1])
        for b in range(batch.ids.shape[0]):
            n = int(batch.valid[b].sum())
            ids = batch.ids[b, :n].tolist()
            mask = next(m for i, m in encoded if i == ids)
            assert batch.scored[b, : n - 1].tolist() == [bool(m) for m in mask[1:]]
            assert not batch.scored[b, n - 1 :].any()
            first = mask.index(1)
            assert not batch.routable[b, :first].any() and batch.routable[b, first:n].all()
            found.append(ids)
    assert sorted(found) == sorted(ids for ids, _ in encoded)


def test_hard_label_targets_are_plain_cross_entropy(loaded) -> None:
    (batch,) = padded(_encoded(loaded, 2)[:1], pad=0)
    hard = targets(None, batch, k=8)
    logp = routed_logits(loaded.model, hard, [], served_routing(loaded.model), 0.0, "strict")
    labels = batch.ids[:, 1:][batch.scored]
    expected = F.cross_entropy(logp, labels)
    torch.testing.assert_close(distillation_loss(logp, hard), expected)


def test_teacher_targets_are_the_teachers_top_predictions(loaded) -> None:
    (batch,) = padded(_encoded(loaded, 2)[:1], pad=0)
    made = targets(loaded.model, batch, k=5)
    with torch.no_grad():
        logits = loaded.model.forward_eval(batch.ids, "off").logits[:, :-1][batch.scored].float()
    top = logits.log_softmax(-1).topk(5, dim=-1)
    assert torch.equal(made.top_ids, top.indices)
    torch.testing.assert_close(made.top_logp, top.values, rtol=1e-4, atol=1e-4)


def test_sources_draw_the_three_kinds_apart() -> None:
    recipe = RefineRecipe(general=3, multistep=5, kept=7)
    by_name = {s.name: s for s in sources(GENERAL, recipe)}
    assert {s.target for s in by_name.values()} == {"base", "text", "self"}
    assert len(by_name["general"].conversations) == 3
    assert len(by_name["multi-step"].conversations) == 5 and len(by_name["kept"].conversations) == 7
    plain = [[{"role": "user", "content": p}, {"role": "assistant", "content": a}] for p, a in GENERAL]
    assert not any(c in plain for c in by_name["kept"].conversations)
    assert sources(GENERAL, recipe) == sources(GENERAL, recipe)  # seeded


def test_agreement_of_a_model_with_itself_is_whole(loaded) -> None:
    conversations = [[{"role": "user", "content": p}, {"role": "assistant", "content": a}] for p, a in GENERAL]
    both = agreement_score(
        loaded.model, loaded.model, loaded.chat_format, conversations, {"dense": None, "routed": 0.5}
    )
    same, routed = both["dense"], both["routed"]
    assert same["top1"] == 1.0 and same["top1_se"] == 0.0
    assert abs(same["kl"]) < 1e-5 and same["conversations"] == 4 and same["tokens"] > 0
    assert routed["kl"] >= -1e-6 and 0.0 <= routed["top1"] <= 1.0


def test_refine_writes_a_model_whose_adapters_join_the_tune(routed_model_dir: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    recipe = RefineRecipe(general=2, multistep=4, kept=3, steps=2, rank=4, alpha=8)
    out = refine(routed_model_dir, routed_model_dir, tmp_path, GENERAL, recipe, lines.append)
    assert any("tune step 2/2" in line for line in lines)
    refined = load_model(out, dtype="float32").model
    before = load_model(routed_model_dir, dtype="float32").model
    adapters = load_merged_adapters(out)
    assert adapters and all(a.shape[0] == 4 for a, _ in adapters.values())
    name = "model.layers.0.mlp.down_proj"
    a, b = adapters[name]
    torch.testing.assert_close(
        before.get_submodule(name).weight + b @ a, refined.get_submodule(name).weight, rtol=0, atol=1e-5
    )
    for key, value in before.state_dict().items():  # the routers are the served ones, untouched
        if "router" in key:
            assert torch.equal(value, refined.state_dict()[key]), key
