"""Inference over the sparse KV cache: Qwen2 equivalence, causality, incremental == full, batching, cache ops."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from chatapp.errors import ContextOverflowError
from chatapp.stt import STTForCausalLM

from .conftest import TINY, VOCAB, routed_model


def prefill(model: STTForCausalLM, ids: torch.Tensor, max_len: int = 64, **kwargs):
    """One full-width extend over a fresh cache; returns (output, cache)."""
    cache = model.new_cache(ids.shape[0], max_len)
    lengths = torch.full((ids.shape[0],), ids.shape[1])
    return model.extend(ids, lengths, cache, all_logits=True, **kwargs), cache


def token_by_token(model: STTForCausalLM, ids: torch.Tensor, first: int, **kwargs):
    """Prefill `first` tokens, then decode the rest one by one; stack logits, router probs and selections."""
    cache = model.new_cache(ids.shape[0], 64)
    out = model.extend(ids[:, :first], torch.full((ids.shape[0],), first), cache, all_logits=True, **kwargs)
    logits, probs, selected = [out.logits], [out.router_probs], [out.selected]
    for t in range(first, ids.shape[1]):
        step = model.decode(ids[:, t], cache, **kwargs)
        logits.append(step.logits[:, None])
        probs.append(step.router_probs)
        selected.append(step.selected)
    return torch.cat(logits, 1), torch.cat(probs, 2), torch.cat(selected, 2), cache


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- Qwen2 equivalence
@pytest.mark.parametrize("tied", [False, True])
def test_routing_off_matches_transformers_prefill_and_decode(tmp_path, tied):
    torch.manual_seed(3)
    reference = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tied)).eval()
    reference.save_pretrained(tmp_path)
    model = STTForCausalLM.from_pretrained(tmp_path)
    ids = random_ids(2, 12)
    with torch.no_grad():
        want = reference(ids).logits
    out, _ = prefill(model, ids, routing="off")
    torch.testing.assert_close(out.logits, want, atol=1e-5, rtol=1e-5)
    logits, _, selected, _ = token_by_token(model, ids, 5, routing="off")
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    assert selected.all()


def test_untrained_routing_runs_every_token(qwen2_dir):
    """A plain Qwen2 checkpoint has fresh routers: 'student' routing is off until they are trained."""
    reference, path = qwen2_dir
    model = STTForCausalLM.from_pretrained(path)
    assert model.config.routing_trained is False
    ids = random_ids(1, 9)
    out, _ = prefill(model, ids, routing="student")
    assert out.selected.all()
    with torch.no_grad():
        torch.testing.assert_close(out.logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_skipping_every_token_equals_qwen2_without_the_stt_layers(model):
    """Threshold above 1 selects nothing: STT layers become identities, leaving a 2-layer Qwen2."""
    dense = [i for i in range(TINY["num_hidden_layers"]) if i not in model.stt_layer_indices]
    reference = Qwen2ForCausalLM(Qwen2Config(**{**TINY, "num_hidden_layers": len(dense)})).eval()
    state = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.layers."):
            index = int(key.split(".")[2])
            if index not in dense or any(p in key for p in ("transition_network", "router")):
                continue
            key = key.replace(f"model.layers.{index}.", f"model.layers.{dense.index(index)}.")
        state[key] = value
    reference.load_state_dict(state)
    ids = random_ids(2, 10)
    out, cache = prefill(model, ids, threshold=1.01)
    assert not out.selected.any()
    with torch.no_grad():
        torch.testing.assert_close(out.logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    for index in model.stt_layer_indices:
        assert cache.layer_lengths(index).tolist() == [0, 0]


def test_threshold_zero_selects_everything_like_routing_off(model):
    ids = random_ids(2, 10)
    everything, _ = prefill(model, ids, threshold=0.0)
    off, _ = prefill(model, ids, routing="off")
    assert everything.selected.all()
    torch.testing.assert_close(everything.logits, off.logits)
    torch.testing.assert_close(everything.router_probs, off.router_probs)


# ------------------------------------------------------------------------------------------- student routing
def test_student_routing_skips_some_tokens(model):
    out, _ = prefill(model, random_ids(2, 24))
    fraction = out.selected.float().mean().item()
    assert 0.1 < fraction < 0.9
    assert out.router_probs.shape == out.selected.shape == (len(model.stt_layer_indices), 2, 24)


def test_student_routing_is_causal(model):
    ids = random_ids(2, 16)
    changed = ids.clone()
    cut = 9
    changed[:, cut + 1 :] = (changed[:, cut + 1 :] + 7) % VOCAB
    a, _ = prefill(model, ids)
    b, _ = prefill(model, changed)
    torch.testing.assert_close(a.logits[:, : cut + 1], b.logits[:, : cut + 1])
    torch.testing.assert_close(a.router_probs[..., : cut + 1], b.router_probs[..., : cut + 1])
    assert torch.equal(a.selected[..., : cut + 1], b.selected[..., : cut + 1])
    assert not torch.allclose(a.logits[:, cut + 1 :], b.logits[:, cut + 1 :])


@pytest.mark.parametrize("first", [1, 7])
def test_incremental_decode_equals_full_prefill(model, first):
    ids = random_ids(2, 20, seed=4)
    full, full_cache = prefill(model, ids)
    logits, probs, selected, cache = token_by_token(model, ids, first)
    assert torch.equal(selected, full.selected)
    torch.testing.assert_close(probs, full.router_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, full.logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache.lengths, full_cache.lengths)


def test_chunked_extend_equals_full_prefill(model):
    """Fast-forward: several known tokens at once, in uneven chunks, per row of a ragged batch."""
    ids = random_ids(2, 18, seed=5)
    full, _ = prefill(model, ids)
    cache = model.new_cache(2, 64)
    done = torch.zeros(2, dtype=torch.long)
    chunks = [torch.tensor([3, 1]), torch.tensor([5, 6]), torch.tensor([0, 4]), torch.tensor([10, 7])]
    selected = [[], []]
    for sizes in chunks:
        width = int(sizes.max())
        batch = torch.zeros(2, width, dtype=torch.long)
        for row in range(2):
            batch[row, : sizes[row]] = ids[row, done[row] : done[row] + sizes[row]]
        out = model.extend(batch, sizes, cache, all_logits=True)
        for row in range(2):
            n = int(sizes[row])
            selected[row].append(out.selected[:, row, :n])
            assert not out.selected[:, row, n:].any()
            if n:
                torch.testing.assert_close(
                    out.logits[row, :n], full.logits[row, done[row] : done[row] + n], atol=1e-4, rtol=1e-4
                )
        done += sizes
    assert done.tolist() == [18, 18]
    for row in range(2):
        assert torch.equal(torch.cat(selected[row], 1), full.selected[:, row])


def test_stt_cache_holds_exactly_the_selected_tokens(model):
    ids = random_ids(3, 15, seed=6)
    lengths = torch.tensor([15, 9, 4])
    cache = model.new_cache(3, 32)
    out = model.extend(ids, lengths, cache)
    for step in range(3):
        more = model.decode(ids[:, step], cache)
        out.selected = torch.cat((out.selected, more.selected), 2)
    per_row = out.selected.sum(2)  # (L_stt, B)
    for slot, index in enumerate(model.stt_layer_indices):
        assert cache.layer_lengths(index).tolist() == per_row[slot].tolist()
    for index in range(model.config.num_hidden_layers):
        if index not in model.stt_layer_indices:
            assert cache.layer_lengths(index).tolist() == (lengths + 3).tolist()
    assert cache.seen.tolist() == (lengths + 3).tolist()


def test_row_alone_equals_row_in_ragged_batch(model):
    ids = random_ids(3, 14, seed=7)
    lengths = torch.tensor([14, 5, 10])
    batch_cache = model.new_cache(3, 40)
    batch_out = model.extend(ids, lengths, batch_cache, all_logits=True)
    next_tokens = random_ids(3, 4, seed=8)
    batch_steps = [model.decode(next_tokens[:, t], batch_cache) for t in range(4)]
    for row in range(3):
        n = int(lengths[row])
        alone_cache = model.new_cache(1, 40)
        alone = model.extend(ids[row : row + 1, :n], lengths[row : row + 1], alone_cache, all_logits=True)
        torch.testing.assert_close(batch_out.logits[row, :n], alone.logits[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(batch_out.selected[:, row, :n], alone.selected[:, 0])
        for t in range(4):
            step = model.decode(next_tokens[row : row + 1, t], alone_cache)
            torch.testing.assert_close(batch_steps[t].logits[row], step.logits[0], atol=1e-5, rtol=1e-5)
            assert torch.equal(batch_steps[t].selected[:, row], step.selected[:, 0])


# --------------------------------------------------------------------------------------------- cache operations
def test_select_rows_replicates_and_drops_rows(model):
    ids = random_ids(2, 8, seed=9)
    _, cache = prefill(model, ids)
    replicated = cache.select_rows(torch.tensor([1, 1, 0]))
    assert replicated.batch_size == 3
    token = torch.tensor([5, 5, 5])
    out = model.decode(token, replicated)
    torch.testing.assert_close(out.logits[0], out.logits[1])
    alone = model.decode(token[:2], cache)
    torch.testing.assert_close(out.logits[2], alone.logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[1], alone.logits[1], atol=1e-5, rtol=1e-5)


def test_mark_and_restore_roll_back(model):
    ids = random_ids(1, 10, seed=10)
    _, cache = prefill(model, ids)
    mark = cache.mark()
    model.extend(random_ids(1, 6, seed=11), torch.tensor([6]), cache)
    cache.restore(mark)
    follow_up = random_ids(1, 5, seed=12)
    rolled_back = model.extend(follow_up, torch.tensor([5]), cache, all_logits=True)
    fresh, _ = prefill(model, torch.cat((ids, follow_up), 1))
    torch.testing.assert_close(rolled_back.logits[0], fresh.logits[0, 10:], atol=1e-5, rtol=1e-5)
    assert torch.equal(rolled_back.selected[:, 0], fresh.selected[:, 0, 10:])


def test_grow_keeps_contents(model):
    ids = random_ids(1, 12, seed=13)
    cache = model.new_cache(1, 8)
    model.extend(ids[:, :8], torch.tensor([8]), cache)
    with pytest.raises(ContextOverflowError):
        model.decode(ids[:, 8], cache)
    cache.grow(16)
    rest = model.extend(ids[:, 8:], torch.tensor([4]), cache, all_logits=True)
    full, _ = prefill(model, ids)
    torch.testing.assert_close(rest.logits[0], full.logits[0, 8:], atol=1e-5, rtol=1e-5)


def test_overflow_is_reported_only_when_a_row_would_not_fit(model):
    cache = model.new_cache(2, 6)
    model.extend(random_ids(2, 6), torch.tensor([6, 2]), cache)
    model.extend(random_ids(2, 4), torch.tensor([0, 4]), cache)  # row 1 fills up exactly; row 0 untouched
    assert cache.seen.tolist() == [6, 6]
    with pytest.raises(ContextOverflowError, match="6"):
        model.extend(random_ids(2, 1), torch.tensor([0, 1]), cache)


def test_a_row_with_length_zero_is_untouched(model):
    ids = random_ids(2, 6)
    _, cache = prefill(model, ids)
    before = cache.mark()
    model.extend(random_ids(2, 3, seed=2), torch.tensor([3, 0]), cache)
    assert torch.equal(cache.lengths[:, 1], before.lengths[:, 1])
    assert torch.equal(cache.prev_hidden[:, 1], before.prev_hidden[:, 1])
    assert cache.seen.tolist() == [9, 6]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_decode_matches_cpu_without_host_syncs():
    cpu_model = routed_model(seed=0)
    gpu_model = routed_model(seed=0).cuda()
    ids = random_ids(2, 12)
    want, _, want_selected, _ = token_by_token(cpu_model, ids, 6)
    cache = gpu_model.new_cache(2, 64)
    gpu_model.extend(ids[:, :6].cuda(), torch.tensor([6, 6]).cuda(), cache)
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps = [gpu_model.decode(ids[:, t].cuda(), cache) for t in range(6, 12)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    logits = torch.stack([s.logits for s in steps], 1).cpu()
    torch.testing.assert_close(logits, want[:, 6:], atol=1e-3, rtol=1e-3)
    assert torch.equal(torch.cat([s.selected for s in steps], 2).cpu(), want_selected[..., 6:])
