"""The int8 decode step in one native call (`chatapp.stt.cpu_step`, `chatapp/stt/decode_step.c`) against the torch decode
step on the same int8 weights: same logits, router probabilities, decisions and cache state, step by step, on
ragged batches, under both routings and both skip modes.

The oracle runs in float32 (the int8 model's scales, norms and embeddings cast to float32, its int8 levels as
they are), and its int8 products take their input quantized as the C products do (`quantized_products`: blocks of
32, int8 levels of one scale each). The two then differ in the order of their sums, and where that moves an
input across a rounding boundary, by one level of it: the tolerances below are those of a level here and there."""

from __future__ import annotations

import contextlib

import pytest
import torch

from chatapp.stt import cpu_step
from chatapp.stt.decode import EAGER_STEPS, decode_step
from chatapp.stt.weights import Int8Linear, prepare_weights

from .conftest import VOCAB, routed_model
from .test_fast_paths import assert_same_state

QBLOCK = 32  # decode_step.c's activation block


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the C products see it: each row in blocks of 32, rounded (ties to even) to int8 levels of the block's
    largest magnitude / 127, and those levels times that scale."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // QBLOCK, QBLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    levels = torch.round(blocks * inverse).clamp(-127, 127)
    return (levels * scale).reshape(x.shape)


@contextlib.contextmanager
def quantized_products():
    """The torch step's int8 products with their inputs quantized as the C step's are (K a multiple of 32)."""
    plain = Int8Linear.forward

    def forward(self: Int8Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % QBLOCK:
            return plain(self, x)
        weight = self.weight_int8.float() * self.scales.float()[:, None]
        out = quantize_activations(x) @ weight.T
        return out if self.bias is None else out + self.bias.float()

    Int8Linear.forward = forward
    try:
        yield
    finally:
        Int8Linear.forward = plain


def int8_model(skip_mode: str = "strict", **overrides):
    """A routed int8 model with the native step attached where it can be, as the loader leaves one: its caches are
    then the step's (float16 K/V), which the torch step, the oracle here, reads as well."""
    model = prepare_weights(routed_model(seed=3, initializer_range=0.05, skip_mode=skip_mode, **overrides), "int8")
    model = model.float().eval()
    cpu_step.attach(model)
    return model


def prefilled(model, lengths: list[int], max_len: int = 64):
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(len(lengths), max_len)
    model.extend(ids, torch.tensor(lengths), cache)
    return cache


def resync(slow, fast) -> None:
    """The oracle's cache made the C step's again, so that a rounding difference of one step (see the module
    docstring) is not carried into the next."""
    for mine, theirs in zip(slow.keys + slow.values, fast.keys + fast.values, strict=True):
        mine.copy_(theirs)
    for name in ("positions", "lengths", "seen", "prev_hidden", "host_bound"):
        value = getattr(fast, name)
        setattr(slow, name, value.clone() if isinstance(value, torch.Tensor) else value)


class StepComparison:
    """Each step of the C kernel against the oracle, from the same cache: within a level of a quantized input
    (a rounding boundary crossed differently moves logits by ~1e-2 on these tiny models), and most steps within
    the float noise of summing in another order (a systematic error would show in every step)."""

    def __init__(self) -> None:
        self.steps = self.close = 0

    def check(self, got, want) -> None:
        torch.testing.assert_close(got[0], want[0], atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(got[1], want[1], atol=2e-3, rtol=2e-3)
        assert torch.equal(got[2], want[2])
        self.steps += 1
        self.close += bool(torch.allclose(got[0], want[0], atol=1e-4, rtol=1e-4))

    def done(self) -> None:
        assert self.close >= self.steps / 2, f"only {self.close} of {self.steps} steps agree to 1e-4"


@torch.no_grad()
def decode_both(model, lengths: list[int], steps: int, student: bool, cutoff, max_len: int = 64) -> None:
    fast, slow = prefilled(model, lengths, max_len), prefilled(model, lengths, max_len)
    generator = torch.Generator().manual_seed(1)
    comparison = StepComparison()
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (len(lengths),), generator=generator)
        got = cpu_step.kernel_step(model, ids, fast, student, cutoff)
        assert got is not None
        with quantized_products():
            want = decode_step(model, ids, slow, student, cutoff, EAGER_STEPS)
        comparison.check(got, want)
        assert_same_state(fast, slow, hidden_tolerance=2e-2, entry_tolerance=2e-2)
        resync(slow, fast)
    comparison.done()


@pytest.mark.parametrize("skip_mode", ["strict", "kv", "predict"])
@pytest.mark.parametrize("student", [True, False])
def test_kernel_step_equals_the_torch_step_on_a_ragged_batch(skip_mode: str, student: bool) -> None:
    model = int8_model(skip_mode)
    assert cpu_step.serves(model)
    decode_both(model, [3, 9, 1, 6], steps=10, student=student, cutoff=model.config.router_threshold)


@pytest.mark.parametrize("skip_mode", ["strict", "kv", "predict"])
def test_kernel_step_splits_rows_that_a_layer_takes_from_rows_it_skips(skip_mode: str) -> None:
    # Per-row cutoffs: row 0 runs every STT layer, row 1 none, row 2 as its router says.
    model = int8_model(skip_mode)
    decode_both(model, [4, 7, 2], steps=6, student=True, cutoff=torch.tensor([0.0, 1.1, 0.5]))


def test_kernel_step_reads_and_writes_a_single_row() -> None:
    model = int8_model(num_hidden_layers=3, stt_layers=[1])
    decode_both(model, [5], steps=8, student=True, cutoff=0.5)


@pytest.mark.parametrize("hidden", [96, 48])
def test_kernel_step_on_rows_of_an_odd_number_of_blocks_or_none(hidden: int) -> None:
    """96 = three blocks of 32 (the last one alone in the products' loop); 48 is no whole number of blocks, so its
    products take float32 inputs (the oracle's too)."""
    model = int8_model(hidden_size=hidden, intermediate_size=2 * hidden)
    decode_both(model, [4, 1, 7], steps=6, student=True, cutoff=model.config.router_threshold)


@pytest.mark.parametrize("skip_mode", ["strict", "kv", "predict"])
def test_kernel_step_with_heads_of_64_dimensions(skip_mode: str) -> None:
    """Heads of 64 (the default model's) take the vectorized sum of values, in chunks of 32 positions: rows that
    end inside a chunk, on its edge and past several."""
    model = int8_model(skip_mode, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    decode_both(model, [3, 31, 32, 100], steps=6, student=True, cutoff=model.config.router_threshold, max_len=128)


@pytest.mark.parametrize("skip_mode", ["strict", "kv", "predict"])
@pytest.mark.parametrize("lengths", [[1, 64, 65, 150], [600, 3, 257]])
@torch.no_grad()
def test_kernel_step_over_rows_of_very_different_cache_lengths(skip_mode: str, lengths: list[int]) -> None:
    # Each row attends over its own entries only, a short row beside long ones too (the attention loops prefetch
    # entries ahead of the one they read, up to the row's end).
    model = int8_model(skip_mode)
    max_len = max(lengths) + 42
    fast, slow = prefilled(model, lengths, max_len=max_len), prefilled(model, lengths, max_len=max_len)
    generator = torch.Generator().manual_seed(2)
    comparison = StepComparison()
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (len(lengths),), generator=generator)
        got = cpu_step.kernel_step(model, ids, fast, True, model.config.router_threshold)
        with quantized_products():
            want = decode_step(model, ids, slow, True, model.config.router_threshold, EAGER_STEPS)
        comparison.check(got, want)
        assert_same_state(fast, slow, hidden_tolerance=2e-2, entry_tolerance=2e-2)
        resync(slow, fast)
    comparison.done()


@torch.no_grad()
def test_a_rows_numbers_do_not_depend_on_the_rows_beside_it() -> None:
    """The products take rows a tile at a time (two, or four with VNNI) and the rows left over alone
    (`int8_matmul`): identical rows in one batch, some summed in a tile and one alone, give bit-identical logits,
    router probabilities and caches."""
    model = int8_model()
    rows = 5
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(rows, 32)
    model.extend(prompt.repeat(rows, 1), torch.tensor([6] * rows), cache)
    generator = torch.Generator().manual_seed(5)
    for _ in range(5):
        ids = torch.randint(0, VOCAB, (1,), generator=generator).repeat(rows)
        logits, probs, selected = cpu_step.kernel_step(model, ids, cache, True, model.config.router_threshold)
        for row in range(1, rows):
            assert torch.equal(logits[row], logits[0])
            assert torch.equal(probs[:, row], probs[:, 0]) and torch.equal(selected[:, row], selected[:, 0])
    for layer in range(model.config.num_hidden_layers):
        keys = cache.keys[layer]
        assert all(torch.equal(keys[row], keys[0]) for row in range(1, rows))
    # And a row alone (one channel at a time, no tile) gets the numbers it got in the batch.
    alone = model.new_cache(1, 32)
    model.extend(prompt, torch.tensor([6]), alone)
    generator = torch.Generator().manual_seed(5)
    batch_cache = model.new_cache(rows, 32)
    model.extend(prompt.repeat(rows, 1), torch.tensor([6] * rows), batch_cache)
    for _ in range(5):
        ids = torch.randint(0, VOCAB, (1,), generator=generator)
        one = cpu_step.kernel_step(model, ids, alone, True, model.config.router_threshold)
        many = cpu_step.kernel_step(model, ids.repeat(rows), batch_cache, True, model.config.router_threshold)
        assert torch.equal(one[0][0], many[0][rows - 1]) and torch.equal(one[1][:, 0], many[1][:, rows - 1])


def test_decode_goes_through_the_kernel_step_at_every_batch_size() -> None:
    """A batch of any size decodes in the native step, the rows in tiles and the rows left over alone: 11 rows of
    mixed lengths, routed, against the torch step."""
    model = int8_model()
    assert cpu_step.attach(model) and isinstance(model.runtime.native, cpu_step.NativeStep)
    decode_both(model, [3, 9, 1, 6, 2, 5, 8, 4, 7, 3, 2], steps=4, student=True, cutoff=model.config.router_threshold)


def test_the_avx2_products_where_the_cpu_has_vnni_too(tmp_path, monkeypatch) -> None:
    """A CPU without AVX-512 VNNI takes the AVX2 products: built here with VNNI switched off, the step still equals
    the torch step, batch 1 and a batch of tiles."""
    import ctypes

    if "avx512_vnni" not in cpu_step._cpu_features():
        pytest.skip("this CPU builds the AVX2 products anyway (the other tests cover them)")
    path = tmp_path / "decode_step_avx2.so"
    cpu_step.build(path, ("-mno-avx512vnni",))
    library = ctypes.CDLL(str(path))
    library.chatapp_decode.argtypes = [ctypes.POINTER(cpu_step.DecodeArgs)]
    library.chatapp_decode.restype = ctypes.c_int
    monkeypatch.setattr(cpu_step, "_load", lambda: (library, None))
    model = int8_model("predict")
    decode_both(model, [5], steps=4, student=True, cutoff=model.config.router_threshold)
    decode_both(model, [3, 9, 1, 6, 2, 5, 8, 4, 7, 3, 2], steps=4, student=True, cutoff=model.config.router_threshold)


def test_a_struct_that_drifted_apart_refuses_to_load(monkeypatch) -> None:
    """The library reports its `DecodeArgs` layout and the loader compares it with the ctypes mirror: a field left
    out, or retyped, on one side is refused by name, and the torch step decodes (the notice says why)."""
    import ctypes

    native = cpu_step.library()
    assert native is not None and cpu_step.layout_mismatch(native) is None
    fields = cpu_step.DecodeArgs._fields_

    class Missing(ctypes.Structure):
        _fields_ = [f for f in fields if f[0] != "predictor_rank"]

    class Retyped(ctypes.Structure):
        _fields_ = [(n, ctypes.c_int32 if n == "threads" else t) for n, t in fields]

    for mirror, named in ((Missing, "predictor_rank"), (Retyped, "threads")):
        monkeypatch.setattr(cpu_step, "DecodeArgs", mirror)
        problem = cpu_step.layout_mismatch(native)
        assert problem is not None and (named in problem or "bytes in C" in problem), problem
        library, notice = cpu_step._load.__wrapped__()
        assert library is None and "DecodeArgs differs" in notice


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int4"])
def test_only_int8_models_are_served(fmt: str) -> None:
    assert not cpu_step.serves(prepare_weights(routed_model(seed=3), fmt))
    assert not cpu_step.attach(prepare_weights(routed_model(seed=3), fmt))


# -- building the kernel -------------------------------------------------------------------------------------------


def test_the_build_is_named_by_source_flags_and_cpu_and_loads() -> None:
    path = cpu_step.library_path()
    assert path.name.startswith("decode_step-") and path.suffix == ".so"
    assert cpu_step.library() is not None and cpu_step.library_problem() is None
    assert path.is_file()  # built by the first load (or by `make`)


def test_a_failing_or_missing_compiler_is_an_error_naming_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with pytest.raises(OSError, match="false failed"):
        cpu_step.build(tmp_path / "k.so")
    assert not list(tmp_path.iterdir())  # no half-written library left behind
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(OSError, match="no-such-cc' was not found"):
        cpu_step.build(tmp_path / "k.so")
    monkeypatch.delenv("CC")
    monkeypatch.setattr(cpu_step.shutil, "which", lambda name: None)
    with pytest.raises(OSError, match="no C compiler"):
        cpu_step.build(tmp_path / "k.so")


def test_without_the_library_the_torch_step_decodes_and_the_loader_says_why(monkeypatch, capsys) -> None:
    from chatapp.models.loader import load_model

    monkeypatch.setattr(cpu_step, "_load", lambda: (None, "the int8 decode kernel could not be built (no C compiler)"))
    model = int8_model()
    assert not cpu_step.serves(model) and not cpu_step.attach(model)
    cache = prefilled(model, [3, 5])
    assert cpu_step.kernel_step(model, torch.zeros(2, dtype=torch.long), cache, True, 0.5) is None
    assert torch.isfinite(model.decode(torch.zeros(2, dtype=torch.long), cache).logits).all()

    loaded = load_model("tiny", "cpu", "int8")
    assert loaded.model.runtime.native is None
    assert "notice: the int8 decode kernel could not be built (no C compiler)" in capsys.readouterr().err


def test_loading_the_kernel_leaves_the_process_float_mode_alone() -> None:
    """A library built with -ffast-math turns on flush-to-zero for the whole process when it loads: subnormal
    numbers then become 0 in every later computation (the calculator's among them)."""
    import sys

    assert cpu_step.library() is not None
    tiny = sys.float_info.min
    assert tiny / 2 > 0
    assert torch.tensor(1e-40, dtype=torch.float32).item() > 0


def half_cases() -> torch.Tensor:
    """Floats across float16's range and its edges: ties between two halves, subnormals, the largest half and the
    values past it that round to infinity, infinities, NaN, signed zeros."""
    generator = torch.Generator().manual_seed(11)
    spread = torch.randn(4096, generator=generator) * torch.pow(2.0, torch.randint(-30, 18, (4096,), generator=generator))
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 2**-24 * 1.5, 2**-24 * 2.5, 2**-25, 2**-26, 65504.0, 65519.0,
                         65520.0, 65536.0, 1e6, 6.1e-5, 6.0e-5, 2**-14, 2**-14 * (1 - 2**-11)])
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    return torch.cat([spread, ties, -ties, special])


@pytest.mark.parametrize("flags", [(), ("-mno-f16c",)], ids=["f16c", "portable"])
def test_cache_entries_round_as_torch_rounds_to_float16(tmp_path, flags) -> None:
    """The step stores K/V as float16 rounded as torch's `.half()` rounds (the prefill writes the same cache), and
    reads them back exactly: bit for bit, with F16C's instructions and with the portable conversion of a CPU without
    them."""
    import ctypes

    if flags:
        path = tmp_path / "decode_step_portable.so"
        cpu_step.build(path, flags)
        library = ctypes.CDLL(str(path))
    else:
        library = cpu_step.library()
    values = half_cases()
    halves = torch.empty(values.shape, dtype=torch.float16)
    library.chatapp_to_halves(ctypes.c_void_p(values.data_ptr()), ctypes.c_void_p(halves.data_ptr()),
                              ctypes.c_int64(values.numel()))
    want = values.half()
    nan = want.isnan()
    assert torch.equal(halves.isnan(), nan)
    assert torch.equal(halves[~nan].view(torch.int16), want[~nan].view(torch.int16))
    back = torch.empty(values.shape, dtype=torch.float32)
    library.chatapp_from_halves(ctypes.c_void_p(halves.data_ptr()), ctypes.c_void_p(back.data_ptr()),
                                ctypes.c_int64(values.numel()))
    assert torch.equal(back[~nan], want[~nan].float()) and back[nan].isnan().all()


def test_a_joined_cache_is_read_by_the_step_in_place_and_decodes_as_its_parts() -> None:
    """`KVCache.join` (rows admitted into a running batch) lays every layer in one block, as a new cache does: the
    step reads it where it is (no stacked copy), and each row decodes as it did in its own cache."""
    model = int8_model()
    assert cpu_step.attach(model)
    left, right = prefilled(model, [3, 5]), prefilled(model, [4])
    alone = prefilled(model, [4])
    joined = left.join(right)
    where = joined.keys[0].data_ptr()
    keys, _ = cpu_step.cache_arrays(joined)
    assert keys.ctypes.data == where and joined.keys[0].data_ptr() == where  # not stacked again
    ids = torch.tensor([1, 2, 3])
    got = cpu_step.kernel_step(model, ids, joined, True, model.config.router_threshold)
    want = cpu_step.kernel_step(model, ids[2:], alone, True, model.config.router_threshold)
    assert torch.equal(got[0][2], want[0][0])
