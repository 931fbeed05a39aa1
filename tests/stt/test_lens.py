"""`chatapp.stt.lens`'s readings against their definitions: the decision depth found from the last layer down, a
block of layers at a time, is the first layer from which every layer's top token is the emitted one (found here by
reading every layer); every layer's table agrees with reading that layer alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import chatapp.stt.lens as lens
from chatapp.stt import STTConfig
from chatapp.stt.random_init import random_routed_model

MODEL = random_routed_model(
    STTConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        routing_trained=True,
    )
)


def brute_depths(head: lens.LensHead, states: torch.Tensor, emitted: torch.Tensor) -> list[int]:
    tops = torch.stack([head.logits(layer, states[layer]).argmax(-1) for layer in range(states.shape[0])])  # (L, P)
    depths = []
    for position in range(states.shape[1]):
        depth = -1
        for layer in range(states.shape[0] - 1, -1, -1):
            if tops[layer, position] != emitted[position]:
                break
            depth = layer
        depths.append(depth)
    return depths


@settings(max_examples=30)
@given(
    length=st.integers(2, 40),
    seed=st.integers(0, 10_000),
    read_rows=st.sampled_from([1, 2, 3, 7, 256]),
    own=st.floats(0.0, 1.0),
)
def test_decision_depth_is_the_first_layer_the_top_token_stays(length: int, seed: int, read_rows: int, own: float):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (length,), generator=generator)
    states = lens.capture_states(MODEL, ids, torch.arange(length - 1)).states
    head = lens.LensHead(MODEL)
    final = head.logits(5, states[-1]).argmax(-1)
    # Emitted tokens: the model's own top token at a share `own` of the positions, random ones elsewhere.
    emitted = torch.where(torch.rand(length - 1, generator=generator) < own, final, ids[1:])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lens, "READ_ROWS", read_rows)
        depths = lens.decision_depths(head, states, emitted)
        table = lens.read_layers(head, states, emitted, k=3)
    assert depths.tolist() == brute_depths(head, states, emitted)
    for layer in range(states.shape[0]):
        logits = head.logits(layer, states[layer])
        assert torch.equal(table.top_ids[:, layer], logits.topk(3, dim=-1).indices)
        expected = logits.log_softmax(-1).gather(1, emitted[:, None])[:, 0].exp()
        assert torch.allclose(table.prob[:, layer], expected, atol=1e-6)
        assert torch.equal(table.rank[:, layer] == 1, logits.argmax(-1) == emitted)
