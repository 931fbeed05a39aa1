"""Packed bitmasks: packing round-trips, and `apply_token_bitmask` equals llguidance's numpy reference."""

from __future__ import annotations

import llguidance.numpy as llg_numpy
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.trie.bitmask import (
    allowed_ids,
    apply_token_bitmask,
    bitmask_from_bools,
    bitmask_to_bools,
    is_allowed,
    mask_words,
    set_bit,
)

bool_vectors = st.integers(1, 200).flatmap(lambda n: st.lists(st.booleans(), min_size=n, max_size=n))


@settings(max_examples=50)
@given(bool_vectors)
def test_pack_unpack_round_trip(bits):
    allowed = np.array(bits)
    packed = bitmask_from_bools(allowed)
    assert packed.dtype == np.uint32 and len(packed) == mask_words(len(bits))
    assert (bitmask_to_bools(packed, len(bits)) == allowed).all()
    assert allowed_ids(packed, len(bits)).tolist() == np.flatnonzero(allowed).tolist()
    assert all(is_allowed(packed, i) == b for i, b in enumerate(bits))


def test_set_bit_in_the_last_word():
    mask = np.zeros(mask_words(70), dtype=np.uint32)
    set_bit(mask, 69)
    set_bit(mask, 31)
    assert allowed_ids(mask, 70).tolist() == [31, 69]


def _random_case(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32))
    masks = np.stack([bitmask_from_bools(rng.random(vocab) < 0.3) for _ in range(rows)])
    return logits, masks


@pytest.mark.parametrize(("rows", "vocab"), [(1, 31), (3, 64), (4, 1000), (2, 32 * 5 + 1)])
def test_apply_equals_llguidance_reference(rows, vocab):
    logits, masks = _random_case(rows, vocab, seed=rows * vocab)
    expected = logits.numpy().copy()
    llg_numpy.apply_token_bitmask_inplace(expected, masks.view(np.int32))
    ours = apply_token_bitmask(logits.clone(), masks)
    assert torch.equal(ours, torch.from_numpy(expected))
    as_tensor = apply_token_bitmask(logits.clone(), torch.from_numpy(masks.view(np.int32)))
    assert torch.equal(as_tensor, ours)


def test_apply_to_one_row_and_to_a_padded_head():
    logits, masks = _random_case(1, 40, seed=1)
    padded = torch.cat([logits[0], torch.zeros(30)])  # model head larger than the tokenizer's words cover
    out = apply_token_bitmask(padded.clone(), masks[0])
    assert torch.isinf(out[64:]).all()
    allowed = bitmask_to_bools(masks[0], 40)
    assert torch.equal(torch.isfinite(out[:40]), torch.from_numpy(allowed))


def test_apply_accepts_read_only_cached_masks(recwarn):
    logits, masks = _random_case(1, 100, seed=3)
    frozen = masks[0].copy()
    frozen.setflags(write=False)
    out = apply_token_bitmask(logits.clone(), frozen)
    assert torch.equal(torch.isfinite(out[0]), torch.from_numpy(bitmask_to_bools(frozen, 100)))
    assert not [w for w in recwarn if "not writable" in str(w.message)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_apply_on_cuda_matches_cpu_without_host_sync():
    logits, masks = _random_case(8, 5000, seed=7)
    expected = apply_token_bitmask(logits.clone(), masks)
    device_logits = logits.cuda()
    device_masks = torch.from_numpy(masks.view(np.int32)).cuda()
    apply_token_bitmask(device_logits, device_masks)  # warm the cached shift table
    device_logits = logits.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_token_bitmask(device_logits, device_masks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(device_logits.cpu(), expected)
