"""The decode step compiled ahead of time (`chatapp.stt.precompile`): saved, loaded back with Dynamo's guard check
off, and run against the eager step over every call shape, batch sizes it was not compiled at, routing on and off,
other cache sizes and spans. Whatever the loaded artifacts were not made for must go to the fallback."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

from chatapp.stt import precompile
from chatapp.stt.decode import EAGER_STEPS, DecodeSteps, decode_step
from chatapp.stt.weights import prepare_weights

from .conftest import VOCAB, routed_model

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="torch.compile needs g++"
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    """A routed model, its call shapes compiled ahead of time, saved, and loaded back from disk."""
    model = routed_model(seed=3).eval()
    directory = tmp_path_factory.mktemp("compiled") / precompile.artifact_key(model)
    precompile.save(precompile.precompile(model), directory)
    return model, directory, precompile.load(directory)


def refuse(*args):
    raise AssertionError("a call the saved artifacts should have taken went to the fallback")


def decode_tokens(model, steps: DecodeSteps, lengths: list[int], max_len: int, student: bool, tokens: int = 10):
    """Prefill random prompts of `lengths`, then decode `tokens` random tokens with `steps`: each step's outputs."""
    generator = torch.Generator().manual_seed(sum(lengths) + max_len)
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=generator)
    outputs = []
    with torch.inference_mode():
        cache = model.new_cache(len(lengths), max_len)
        model.extend(ids, torch.tensor(lengths), cache, routing="off")
        for _ in range(tokens):
            token = torch.randint(0, VOCAB, (len(lengths),), generator=generator)
            outputs.append(decode_step(model, token, cache, student, model.config.router_threshold, steps))
    return outputs, cache


@pytest.mark.parametrize("student", [True, False], ids=["student", "off"])
@pytest.mark.parametrize(("lengths", "max_len"), [([5], 64), ([9, 3], 40), ([17, 2, 11, 6, 30], 300)])
def test_loaded_steps_decode_like_eager(saved, lengths, max_len, student):
    model, _, compiled = saved
    loaded = precompile.steps_from(compiled, fallback=DecodeSteps(refuse, refuse))
    fast, fast_cache = decode_tokens(model, loaded, lengths, max_len, student)
    slow, slow_cache = decode_tokens(model, EAGER_STEPS, lengths, max_len, student)
    for (logits, probs, selected), (logits_ref, probs_ref, selected_ref) in zip(fast, slow, strict=True):
        torch.testing.assert_close(logits, logits_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(probs, probs_ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(selected, selected_ref)
    assert torch.equal(fast_cache.lengths, slow_cache.lengths)
    for layer in range(fast_cache.num_layers):  # the live entries (the trash slot takes any of its writes)
        for row, length in enumerate(fast_cache.lengths[layer].tolist()):
            for store in ("keys", "values"):
                live = getattr(fast_cache, store)[layer][row, :length]
                torch.testing.assert_close(live, getattr(slow_cache, store)[layer][row, :length], atol=1e-5, rtol=1e-5)


def test_every_call_shape_is_captured_and_spans_under_two_fall_back(saved):
    model, _, compiled = saved
    shapes = set(compiled)
    # Stacks at batch 1 and more, and routed subsets of one row and of several.
    assert {("block", (True, True)), ("block", (False, True))} <= shapes
    stacks = {shape for kind, shape in shapes if kind == "stack"}
    assert {(1, True), (1, False)} <= {shape[:2] for shape in stacks}
    assert any(any(shape[4]) for shape in stacks)  # routers run inside the stacks
    calls = []
    steps = precompile.steps_from(compiled, fallback=DecodeSteps(refuse, lambda *a: calls.append(a) or refuse()))
    with torch.inference_mode(), pytest.raises(AssertionError, match="fallback"):
        cache = model.new_cache(1, 16)  # an empty cache: the first token's span is 1, a size the graphs never saw
        decode_step(model, torch.tensor([3]), cache, False, 0.5, steps)
    assert calls and calls[0][9] == 1


def test_artifact_key_tracks_what_the_graphs_assume(saved):
    model, _, _ = saved
    key = precompile.artifact_key(model)
    assert precompile.artifact_key(copy.deepcopy(model)) == key
    assert precompile.artifact_key(routed_model(seed=3, num_hidden_layers=3)) != key
    assert precompile.artifact_key(prepare_weights(copy.deepcopy(model), "int8")) != key


def test_missing_and_corrupt_artifacts(saved, tmp_path: Path):
    _, directory, _ = saved
    assert precompile.load(tmp_path / "nothing-here") is None
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    next(broken.glob("stack-*.bin")).write_bytes(b"not a compiled function")
    with pytest.raises(precompile.PrecompileError, match=r"cannot load the compiled decode step in .*broken"):
        precompile.load(broken)


def test_kv_skip_mode_decodes_compiled_like_eager_without_falling_back(saved):
    """In "kv" skip mode an STT layer that skips every row (at batch 1, whenever it skips) stores their K/V at the
    head of the stack after it (`kv_lead`): call shapes of kv's own, captured and compiled like the others, so that a
    routed step never falls back to eager. Batches of one row and of several (rows split: the skipped ones' K/V go
    through the K/V-only stack on their own). (A kv model gets artifacts of its own: the config is in the key.)"""
    model, _, _ = saved
    kv = copy.deepcopy(model)
    kv.config.skip_mode = "kv"
    assert precompile.artifact_key(kv) != precompile.artifact_key(model)
    compiled = precompile.precompile(kv)
    kv_leads = {shape[:4] for kind, shape in compiled if kind == "stack" and shape[2]}
    # Skipped at batch 1: STT layer 3 alone, 1 with layer 2; and one skipped row of a batch of 3.
    assert {(1, True, True, False), (2, True, True, False), (1, True, True, True)} <= kv_leads
    loaded = precompile.steps_from(compiled, fallback=DecodeSteps(refuse, refuse))
    for lengths in ([9], [9, 3, 14]):
        fast, fast_cache = decode_tokens(kv, loaded, lengths, 64, student=True)
        slow, slow_cache = decode_tokens(kv, EAGER_STEPS, lengths, 64, student=True)
        for (logits, _, selected), (logits_ref, _, selected_ref) in zip(fast, slow, strict=True):
            torch.testing.assert_close(logits, logits_ref, atol=1e-4, rtol=1e-4)
            assert torch.equal(selected, selected_ref)
        assert not torch.stack([s for _, _, s in slow]).all()  # some rows were skipped
        assert torch.equal(fast_cache.lengths, slow_cache.lengths)
        for index in kv.stt_layer_indices:  # every token stored, like a dense layer
            assert torch.equal(fast_cache.lengths[index], fast_cache.seen)
