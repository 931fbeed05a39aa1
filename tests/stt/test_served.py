"""The stored served format (`chatapp.stt.served`): a model written after `prepare_weights` and read back on the meta
device computes bit-identical logits and routing to the model converted in memory, in every quantized format."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.stt import served
from chatapp.stt.weights import prepare_weights

from .conftest import routed_model


def _adapters(model, rank: int = 8, seed: int = 3) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Low-rank updates for every q/k/v/o and MLP projection, merged into `model`'s weights (as preparation does)."""
    generator = torch.Generator().manual_seed(seed)
    adapters = {}
    for name, module in model.named_modules():
        if name.endswith(("_proj",)) and isinstance(module, torch.nn.Linear):
            a = torch.randn(rank, module.in_features, generator=generator) * 0.05
            b = torch.randn(module.out_features, rank, generator=generator) * 0.05
            with torch.no_grad():
                module.weight += b @ a
            adapters[name] = (a, b)
    return adapters


def _run(model, ids: torch.Tensor, steps: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, selected) of a prefill of `ids` (2 rows) and of `steps` greedy decode steps."""
    outputs = []
    with torch.inference_mode():
        cache = model.new_cache(ids.shape[0], 64)
        out = model.extend(ids, torch.tensor([ids.shape[1], ids.shape[1] - 3]), cache)
        outputs.append((out.logits, out.selected))
        for _ in range(steps):
            out = model.decode(out.logits.argmax(-1), cache)
            outputs.append((out.logits, out.selected))
    return outputs


@pytest.mark.parametrize(
    ("fmt", "with_adapters", "skip_mode"),
    [
        ("int4", True, "strict"),
        ("int4", True, "kv"),
        ("int4", False, "strict"),
        ("int8", False, "kv"),
        ("int8", False, "predict"),
        ("int4", False, "predict"),
        ("bfloat16", False, "strict"),
    ],
)
def test_stored_format_computes_what_the_in_memory_conversion_does(
    tmp_path: Path, fmt: str, with_adapters: bool, skip_mode: str
):
    """Including the STT layers' k/v-only projections, which "kv" mode runs for the tokens it skips."""
    base = routed_model(seed=2, skip_mode=skip_mode)
    adapters = _adapters(base) if with_adapters else None
    converted = prepare_weights(copy.deepcopy(base), fmt, copy.deepcopy(adapters)).eval()
    served.write(converted, tmp_path)
    stored = served.read(tmp_path)

    assert stored.weight_format == fmt
    assert [type(m).__name__ for m in stored.modules()] == [type(m).__name__ for m in converted.modules()]
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    for (logits, selected), (logits_stored, selected_stored) in zip(
        _run(converted, ids), _run(stored, ids), strict=True
    ):
        assert torch.equal(selected, selected_stored)
        assert torch.equal(logits, logits_stored)


def test_the_stored_tensors_stay_memory_mapped(tmp_path: Path):
    converted = prepare_weights(routed_model(), "int8").eval()
    served.write(converted, tmp_path)
    stored = served.read(tmp_path)
    size = (tmp_path / served.WEIGHTS_FILE).stat().st_size
    start = tmp_path.joinpath(served.WEIGHTS_FILE)
    assert start.is_file()
    # A memory-mapped tensor's storage is the file's mapping: every stored buffer lies within one `size`-byte span.
    pointers = [t.untyped_storage().data_ptr() for t in stored.state_dict().values()]
    assert max(pointers) - min(pointers) < size


def test_a_torn_store_is_refused_with_its_directory_named(tmp_path: Path):
    converted = prepare_weights(routed_model(), "int4").eval()
    served.write(converted, tmp_path)
    weights = tmp_path / served.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(served.ServedFormatError, match=str(tmp_path)):
        served.read(tmp_path)


def test_a_layout_from_other_code_is_refused(tmp_path: Path):
    converted = prepare_weights(routed_model(), "int4").eval()
    served.write(converted, tmp_path)
    layout = tmp_path / served.LAYOUT_FILE
    layout.write_text(layout.read_text().replace('"Int4Linear"', '"Int5Linear"'))
    with pytest.raises(served.ServedFormatError):
        served.read(tmp_path)


@pytest.fixture(scope="module")
def stored_int8(tmp_path_factory) -> tuple[Path, bytes, dict[str, torch.Tensor]]:
    """A stored int8 model: its directory, its weights file's bytes, and its state as read back whole."""
    directory = tmp_path_factory.mktemp("stored")
    served.write(prepare_weights(routed_model(), "int8").eval(), directory)
    state = {name: tensor.clone() for name, tensor in served.read(directory).state_dict().items()}
    return directory, (directory / served.WEIGHTS_FILE).read_bytes(), state


@given(position=st.floats(0, 1, exclude_max=True), mask=st.binary(min_size=1, max_size=64))
@settings(max_examples=60)
def test_any_damage_to_the_weights_file_is_refused_or_harmless(stored_int8, position: float, mask: bytes) -> None:
    """Bytes changed anywhere in the file (header, tensors, the padding between them): `read` either refuses the
    file, naming it, or (padding only: never read) gives the model exactly as it was stored. Never other numbers."""
    directory, original, state = stored_int8
    start = int(position * len(original))
    damaged = bytearray(original)
    for offset, byte in enumerate(mask[: len(original) - start]):
        damaged[start + offset] ^= byte or 0xFF
    weights = directory / served.WEIGHTS_FILE
    weights.write_bytes(bytes(damaged))
    try:
        model = served.read(directory)
    except served.ServedFormatError as err:
        assert str(weights) in str(err) or str(directory) in str(err)
    else:
        read = model.state_dict()
        assert read.keys() == state.keys()
        assert all(torch.equal(read[name], tensor) for name, tensor in state.items())
    finally:
        weights.write_bytes(original)


def test_the_checksums_name_the_damaged_tensor(stored_int8) -> None:
    import json

    directory, original, _ = stored_int8
    weights = directory / served.WEIGHTS_FILE
    header_end = 8 + int.from_bytes(original[:8], "little")
    header = json.loads(original[8:header_end])
    name = next(name for name in header if name.endswith("qkv_proj.weight_int8"))
    start, end = header[name]["data_offsets"]
    damaged = bytearray(original)
    damaged[header_end + (start + end) // 2] ^= 0x01  # one bit
    weights.write_bytes(bytes(damaged))
    try:
        with pytest.raises(served.ServedFormatError, match=re.escape(f"{weights} is damaged: tensor {name}")):
            served.read(directory)
    finally:
        weights.write_bytes(original)


def test_a_changed_layout_is_refused(stored_int8) -> None:
    """A number changed in layout.json (still valid JSON) would build other modules around the right tensors: the
    layout's checksum, kept in the weights file's checked header, refuses it."""
    directory, _, _ = stored_int8
    layout = directory / served.LAYOUT_FILE
    original = layout.read_text()
    changed = re.sub(r'"in_features": (\d+)', lambda m: f'"in_features": {int(m[1]) + 1}', original, count=1)
    assert changed != original
    layout.write_text(changed)
    try:
        with pytest.raises(served.ServedFormatError, match=re.escape(f"{layout} is damaged")):
            served.read(directory)
    finally:
        layout.write_text(original)
