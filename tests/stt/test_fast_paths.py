"""The decode fast path (`chatapp.stt.decode`) against the general `extend` with one token per row: same logits,
router outputs and cache contents, on ragged batches, under both routings, across the rotary table's growth."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from chatapp.stt import STTForCausalLM
from chatapp.stt.cache import KVCache
from chatapp.stt.decode import STACK_LAYERS, decode_plan
from chatapp.stt.layers import rms_norm

from .conftest import VOCAB, routed_model


def ragged_cache(model: STTForCausalLM, lengths: list[int], max_len: int, seed: int = 0) -> KVCache:
    """A cache prefilled with `lengths[b]` random tokens in row b (student routing, so STT layers differ)."""
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(seed))
    cache = model.new_cache(len(lengths), max_len)
    model.extend(ids, torch.tensor(lengths), cache)
    return cache


def live_entries(cache: KVCache) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer and row, the (keys, values, positions) of the live entries (dead slots hold anything)."""
    out = []
    for layer in range(cache.num_layers):
        for row, length in enumerate(cache.lengths[layer].tolist()):
            out.append(
                (
                    cache.keys[layer][row, :length],
                    cache.values[layer][row, :length],
                    cache.positions[layer, row, :length],
                )
            )
    return out


def assert_same_state(
    fast: KVCache, slow: KVCache, hidden_tolerance: float = 1e-6, entry_tolerance: float = 1e-5
) -> None:
    assert torch.equal(fast.lengths, slow.lengths)
    assert torch.equal(fast.seen, slow.seen)
    torch.testing.assert_close(fast.prev_hidden, slow.prev_hidden, atol=hidden_tolerance, rtol=hidden_tolerance)
    for (k1, v1, p1), (k2, v2, p2) in zip(live_entries(fast), live_entries(slow), strict=True):
        torch.testing.assert_close(k1, k2, atol=entry_tolerance, rtol=entry_tolerance)
        torch.testing.assert_close(v1, v2, atol=entry_tolerance, rtol=entry_tolerance)
        assert torch.equal(p1, p2)


def decode_both(model, fast: KVCache, slow: KVCache, steps: int, seed: int = 1, **kwargs) -> None:
    """Decode the same random tokens through `decode` (fast) and `extend` with T = 1 (slow); compare each step."""
    generator = torch.Generator().manual_seed(seed)
    ones = torch.ones(fast.batch_size, dtype=torch.long)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (fast.batch_size,), generator=generator)
        a = model.decode(ids, fast, **kwargs)
        b = model.extend(ids[:, None], ones, slow, **kwargs)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.router_probs, b.router_probs, atol=1e-6, rtol=1e-6)
        assert a.router_probs.dtype == b.router_probs.dtype
        assert torch.equal(a.selected, b.selected)
    assert_same_state(fast, slow)


@pytest.mark.parametrize("routing", ["student", "off"])
def test_decode_equals_extend_on_a_ragged_batch(model, routing):
    fast = ragged_cache(model, [3, 9, 1, 6], max_len=64)
    slow = ragged_cache(model, [3, 9, 1, 6], max_len=64)
    decode_both(model, fast, slow, steps=12, routing=routing)


@pytest.mark.parametrize("student", [False, True])
def test_decode_plan_stacks_dense_layers_and_starts_a_segment_at_each_routed_one(student):
    deep = routed_model(num_hidden_layers=15, stt_layers=[3, 4, 12])
    plan = decode_plan(deep, student)
    assert [i for segment in plan for i in range(segment.start, segment.stop)] == list(range(15))
    assert all(0 < segment.stop - segment.start <= STACK_LAYERS for segment in plan)
    routed = [segment for segment in plan if segment.routed]
    assert [s.start for s in routed] == ([3, 4, 12] if student else [])
    # A routed segment goes on with the dense layers after its STT layer, up to the next one or a stack's length.
    assert [(s.start, s.stop) for s in plan] == (
        [(0, 3), (3, 4), (4, 7), (7, 10), (10, 12), (12, 15)] if student else [(i, i + 3) for i in range(0, 15, 3)]
    )


@pytest.mark.parametrize("routing", ["student", "off"])
def test_decode_equals_extend_across_several_stacks(routing):
    """Stacks of several layers with STT layers inside them (routing off) or between them (student)."""
    deep = routed_model(num_hidden_layers=15, stt_layers=[3, 4, 12])
    fast = ragged_cache(deep, [5, 2, 8], max_len=48)
    slow = ragged_cache(deep, [5, 2, 8], max_len=48)
    decode_both(deep, fast, slow, steps=6, routing=routing)


@pytest.mark.parametrize("mode", ["strict", "kv", "predict"])
def test_batch_one_decode_equals_extend_with_routed_segments(mode):
    """At batch 1 every routed layer's decision is the same for all rows: a selected layer runs as a dense one at
    the head of its segment's stack, a skipped one stores only its K/V there ("kv") or is left out ("strict"),
    before the dense layers after it. Both decisions come up at each STT layer."""
    deep = routed_model(seed=1, num_hidden_layers=8, stt_layers=[1, 2, 5], skip_mode=mode)
    assert any(s.routed and s.stop - s.start > 1 for s in decode_plan(deep, True))
    fast, slow = (ragged_cache(deep, [7], max_len=48, seed=5) for _ in range(2))
    generator = torch.Generator().manual_seed(6)
    decisions = []
    for _ in range(24):
        ids = torch.randint(0, VOCAB, (1,), generator=generator)
        a = deep.decode(ids, fast)
        b = deep.extend(ids[:, None], torch.ones(1, dtype=torch.long), slow)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(a.selected, b.selected)
        decisions.append(a.selected[:, 0, 0])
    assert_same_state(fast, slow)
    decisions = torch.stack(decisions)
    assert decisions.any(0).all() and (~decisions).any(0).all()


@pytest.mark.parametrize("mode", ["strict", "kv", "predict"])
def test_student_decode_of_every_none_and_some_rows_in_each_mode(mode):
    """A batch whose rows an STT layer runs all, none or some of (the three branches of `routed_segment`), in each
    skip mode, on a model whose routed segments go on with dense layers."""
    deep = routed_model(num_hidden_layers=8, stt_layers=[1, 2, 5], skip_mode=mode)
    fast, slow = (ragged_cache(deep, [5, 2, 7], max_len=64, seed=2) for _ in range(2))
    generator = torch.Generator().manual_seed(3)
    counts = set()
    for _ in range(20):
        ids = torch.randint(0, VOCAB, (3,), generator=generator)
        a = deep.decode(ids, fast)
        b = deep.extend(ids[:, None], torch.ones(3, dtype=torch.long), slow)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(a.selected, b.selected)
        counts.update(a.selected[..., 0].sum(1).tolist())
    assert {0, 3} <= counts and {1, 2} & counts
    assert_same_state(fast, slow)


def test_student_decode_runs_only_selected_rows(model):
    """Some steps select every row, some none, most a subset: all three CPU branches agree with extend."""
    fast, slow = (ragged_cache(model, [5, 2, 7], max_len=64, seed=2) for _ in range(2))
    before = fast.lengths.clone()
    generator = torch.Generator().manual_seed(3)
    ones = torch.ones(3, dtype=torch.long)
    counts = set()
    for _ in range(20):
        ids = torch.randint(0, VOCAB, (3,), generator=generator)
        a = model.decode(ids, fast)
        b = model.extend(ids[:, None], ones, slow)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(a.selected, b.selected)
        counts.update(a.selected[..., 0].sum(1).tolist())
    assert {0, 3} & counts and ({1, 2} & counts)
    assert_same_state(fast, slow)
    stt = model.stt_layer_indices
    assert (fast.lengths[stt] - before[stt] < 20).any()  # the STT layers really skipped tokens


@pytest.mark.parametrize("threshold", [0.0, 1.1])
def test_decode_thresholds_select_everything_or_nothing(model, threshold):
    fast, slow = (ragged_cache(model, [4, 8], max_len=32) for _ in range(2))
    decode_both(model, fast, slow, steps=4, threshold=threshold)
    out = model.decode(torch.tensor([1, 2]), fast, threshold=threshold)
    assert bool(out.selected.all()) is (threshold == 0.0)
    assert bool(out.selected.any()) is (threshold == 0.0)


def test_decode_after_restore_and_select_rows(model):
    """Dead entries past a restored length and rows gathered from another cache never leak into attention."""
    fast, slow = (ragged_cache(model, [6, 3, 8], max_len=64) for _ in range(2))
    marks = fast.mark(), slow.mark()
    decode_both(model, fast, slow, steps=5)
    fast.restore(marks[0])
    slow.restore(marks[1])
    decode_both(model, fast, slow, steps=3, seed=7)
    index = torch.tensor([2, 0, 2])
    decode_both(model, fast.select_rows(index), slow.select_rows(index), steps=3, seed=8, routing="off")


def test_decode_past_the_first_rotary_table_and_after_grow():
    """Positions beyond the initial 256-entry rotary table (it grows) and a grown cache decode like extend."""
    model = routed_model(seed=4, max_position_embeddings=1024)
    fast, slow = (ragged_cache(model, [250, 240], max_len=256) for _ in range(2))
    decode_both(model, fast, slow, steps=4, routing="off")
    fast.grow(300)
    slow.grow(300)
    decode_both(model, fast, slow, steps=8)
    assert int(fast.seen.max()) > 256


def test_untrained_routers_report_probabilities_but_run_every_token(model):
    model.config.routing_trained = False
    fast, slow = (ragged_cache(model, [2, 5], max_len=32) for _ in range(2))
    decode_both(model, fast, slow, steps=3)
    out = model.decode(torch.tensor([3, 4]), fast)
    assert out.selected.all()
    assert out.router_probs.shape == (len(model.stt_layer_indices), 2, 1)


def test_decode_rejects_unknown_routing(model):
    with pytest.raises(ValueError, match="routing"):
        model.decode(torch.tensor([1]), model.new_cache(1, 8), routing="teacher")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_transformers(dtype):
    torch.manual_seed(0)
    norm = Qwen2RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(3, 5, 64) * 4).to(dtype)
    if dtype == torch.float32:
        assert torch.equal(rms_norm(norm, x), norm(x))
    else:  # the fused op rounds once where transformers rounds twice: within one bfloat16 rounding (2^-8)
        torch.testing.assert_close(rms_norm(norm, x).float(), norm(x).float(), rtol=2**-7, atol=1e-3)
