"""The served format: a model's weights stored as it runs them (int4 levels and scales, int8 head, fused projections,
adapters apart), so a process loads them by memory-mapping one file instead of reading float32 and quantizing.

`prepare_weights` turns float32 weights into a weight format; that costs seconds and a float32 copy of the model
(1.5 GB peak for the default model) at every start. The first load in a format writes the result here, once per
source, format and machine; every later load builds the model on the meta device (no allocation, no random
initialisation), puts the quantized modules back where `layout.json` says they were, and assigns the stored tensors,
which stay memory-mapped: only the pages a step reads are ever resident.

A stored format is found by `served_key`, a digest of everything its bytes depend on:
- the source files (path, size, modification time of config.json, the weights and the merged adapters);
- the weight format;
- torch's version and the CPU's flags (torch's int4 kernel packs its weights in a layout of its own per CPU);
- the source of the code that builds it (this module, `weights.py`, `layers.py`, `qwen2.py`, `model.py`).
Any change gives another key, so a stale store is never read: it is rebuilt, and the old one is left to be removed
with the data directory's other stale entries.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from chatapp.errors import ChatappError
from chatapp.stt.weights import Int4Linear, Int8Linear, LowRankLinear

# Raised when what is stored here changes meaning (a new module kind, another layout).
FORMAT_VERSION = 1
WEIGHTS_FILE = "weights.safetensors"
_FUSED = (".qkv_proj", ".gate_up_proj", ".kv_proj")  # the last: an STT layer's k/v-only copy (`add_kv_projections`)
# Every stored tensor starts on a boundary of this many bytes (a cache line; AVX-512's widest load).
ALIGNMENT = 64
_PAD = "__padding__."
_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.uint8: "U8",
    torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL",
}
LAYOUT_FILE = "layout.json"
# The code whose output the stored bytes are: a change to any of it gives a new key.
_BUILDING_SOURCES = ("served.py", "weights.py", "layers.py", "qwen2.py", "model.py")
# The module kinds `prepare_weights` puts in place of a float `nn.Linear`, by the name stored in layout.json, and
# `nn.Linear` itself where it is a fused projection (`fuse_projections`) kept in float (a shape int4 cannot take).
_KINDS: dict[str, type[nn.Module]] = {
    "Linear": nn.Linear,
    "Int4Linear": Int4Linear,
    "Int8Linear": Int8Linear,
    "LowRankLinear": LowRankLinear,
}


class ServedFormatError(ChatappError):
    """A stored served format that cannot be read (torn, corrupt, or written by other code)."""


@dataclass(frozen=True)
class ServedSource:
    """What a stored format is built from: a model directory's files and the weight format."""

    files: tuple[Path, ...]
    weight_format: str


def cpu_flags() -> str:
    """The CPU's instruction-set flags: packed int4 weights and compiled kernels are built for this machine's ISA."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def served_key(source: ServedSource) -> str:
    """A digest of everything a stored format of `source` depends on (see the module docstring)."""
    here = Path(__file__).parent
    code = hashlib.sha256(b"".join((here / name).read_bytes() for name in _BUILDING_SOURCES)).hexdigest()
    files = []
    for path in source.files:
        stat = path.stat()
        files.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    facts = {
        "format_version": FORMAT_VERSION,
        "files": files,
        "weight_format": source.weight_format,
        "torch": torch.__version__,
        "cpu": cpu_flags(),
        "code": code,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def write(model: nn.Module, directory: Path) -> None:
    """Write `model` (after `prepare_weights`) into `directory` (which must exist and be empty): its tensors and
    the layout of the modules that replaced its float projections."""
    state, aliases = _unaliased_state(model)
    modules = {
        name: {"kind": type(module).__name__, "attributes": _plain_attributes(module)}
        for name, module in model.named_modules()
        if isinstance(module, Int4Linear | Int8Linear | LowRankLinear) or name.endswith(_FUSED)
    }
    layout = {
        "format_version": FORMAT_VERSION,
        "weight_format": model.weight_format,
        "fused": model.model.layers[0].self_attn.qkv_proj is not None,
        "modules": modules,
        "aliases": aliases,
        "config": model.config.to_dict(),
    }
    write_aligned_safetensors(state, directory / WEIGHTS_FILE)
    (directory / LAYOUT_FILE).write_text(json.dumps(layout, indent=1) + "\n", encoding="utf-8")


def read(directory: Path, device: torch.device | None = None) -> nn.Module:
    """The model stored in `directory`, its tensors memory-mapped. Raises `ServedFormatError` when the files are
    missing, torn or do not describe a model."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from chatapp.store import open_regular, read_regular_bytes
    from chatapp.stt.config import STTConfig
    from chatapp.stt.model import STTForCausalLM, on_meta
    from chatapp.stt.weights import fuse_structure

    try:
        # Regular files only, checked without blocking (a FIFO put in their place would hang a plain read).
        layout = json.loads(read_regular_bytes(directory / LAYOUT_FILE, 64 << 20))
        with open_regular(directory / WEIGHTS_FILE):
            pass
        state = load_file(str(directory / WEIGHTS_FILE))
    except (OSError, ValueError, SafetensorError, ChatappError) as err:
        raise ServedFormatError(
            f"cannot read the stored weights in {directory}: {err}",
            hint="it is rebuilt from the model: run the command again",
        ) from None
    try:
        if layout["format_version"] != FORMAT_VERSION:
            raise ServedFormatError(
                f"{directory} holds format {layout['format_version']}, not {FORMAT_VERSION}",
                hint="it is rebuilt from the model: run the command again",
            )
        model = STTForCausalLM.empty(STTConfig.from_dict(layout["config"]))
        with on_meta():
            if layout["fused"]:
                fuse_structure(model)
            for name, spec in layout["modules"].items():
                parent, _, leaf = name.rpartition(".")
                if getattr(model.get_submodule(parent), leaf, False) is None:  # an optional projection, e.g. kv_proj
                    delattr(model.get_submodule(parent), leaf)
                model.set_submodule(name, _empty_module(name, spec, state))
        for name in [name for name in state if name.startswith(_PAD)]:
            del state[name]
        for name, target in layout["aliases"].items():
            state[name] = state[target]
        model.load_state_dict(state, strict=True, assign=True)
        model.finish_load()
    except ServedFormatError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as err:
        raise ServedFormatError(
            f"the stored weights in {directory} do not describe a model: {err}",
            hint="it is rebuilt from the model: run the command again",
        ) from None
    model.weight_format = layout["weight_format"]
    if device is not None and device.type != "cpu":
        model.to(device)
    return model.eval()


def write_aligned_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write `state` as a safetensors file in which every tensor starts on an `ALIGNMENT`-byte boundary.

    torch's weight-only kernels load their weights with aligned vector loads: a memory-mapped tensor at an
    unaligned offset (the safetensors library packs tensors back to back) crashes them. The format allows no gaps
    between tensors, so the gaps are filled by uint8 padding entries (`_PAD` names, dropped by `read`), and the
    header is padded with spaces (as the format allows) so the data starts aligned too."""
    names = sorted(state, key=lambda name: (-state[name].element_size(), name))
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    chunks: list[bytes | torch.Tensor] = []
    offset = 0
    for name in names:
        gap = -offset % ALIGNMENT
        if gap:
            entries[f"{_PAD}{len(entries)}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            chunks.append(bytes(gap))
            offset += gap
        tensor = state[name].detach().contiguous().cpu()
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + size]}
        chunks.append(tensor)
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % ALIGNMENT)
    with path.open("wb") as out:
        out.write(len(header).to_bytes(8, "little"))
        out.write(header)
        for chunk in chunks:
            out.write(chunk if isinstance(chunk, bytes) else chunk.reshape(-1).view(torch.uint8).numpy().tobytes())


def _unaliased_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict with each shared tensor stored once (safetensors refuses aliases), and {alias: stored name}."""
    state: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in model.state_dict().items():
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ident in seen and tensor.numel():
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        state[name] = tensor.detach().contiguous().cpu()
    return state, aliases


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    """A module's own plain attributes (sizes, group, rank): what its tensors do not say."""
    return {
        key: value
        for key, value in vars(module).items()
        if not key.startswith("_") and key != "training" and isinstance(value, int | float | str | bool)
    }


def _empty_module(name: str, spec: dict[str, Any], state: dict[str, torch.Tensor]) -> nn.Module:
    """An instance of the stored kind, with its attributes and with meta buffers of the stored tensors' shapes
    (filled by `load_state_dict(assign=True)`), built without running its quantizing constructor."""
    kind = _KINDS[spec["kind"]]
    if kind is nn.Linear:
        attributes = spec["attributes"]
        return nn.Linear(attributes["in_features"], attributes["out_features"], bias=f"{name}.bias" in state)
    module = kind.__new__(kind)
    nn.Module.__init__(module)
    for key, value in spec["attributes"].items():
        setattr(module, key, value)
    prefix = f"{name}."
    children: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if not key.startswith(prefix):
            continue
        local = key[len(prefix):]
        if "." in local:  # a child module's tensor (LowRankLinear's `base`): built with the child's own entry
            children.setdefault(local.split(".", 1)[0], {})
            continue
        module.register_buffer(local, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
    if kind is not LowRankLinear and "bias" not in module._buffers:  # a projection without bias has `bias = None`
        module.register_buffer("bias", None)
    return module
