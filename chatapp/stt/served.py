"""The served format: a model's weights stored as it runs them (int4 levels and scales, int8 head, fused projections,
adapters apart), so a process loads them by memory-mapping one file instead of reading float32 and quantizing.

`prepare_weights` turns float32 weights into a weight format; that costs seconds and a float32 copy of the model
(1.5 GB peak for the default model) at every start. The first load in a format writes the result here, once per
source, format and machine; every later load builds the model on the meta device (no allocation, no random
initialisation), puts the quantized modules back where `layout.json` says they were, and assigns the stored tensors,
which stay memory-mapped: only the pages a step reads are ever resident.

A stored format is found by `served_key`, a digest of everything its bytes depend on:
- the source files' contents (`content_digest`: config.json, the weights and the merged adapters, by name and bytes;
  not their directory nor their dates, so a copied or moved data directory finds its entries);
- the weight format;
- torch's version and the CPU's flags (torch's int4 kernel packs its weights in a layout of its own per CPU);
- the source of the code that builds it (this module, `weights.py`, `layers.py`, `qwen2.py`, `model.py`).
Any change gives another key, so a stale store is never read. Hashing the sources reads them whole (sha256 of the
default model's 560 MB: 0.33 s on a quiet 2-core box, 0.9 s at load 7), so each entry remembers the files' stamp
(where they were, their sizes and modification times) in `source.json`: a load whose stamp is remembered hashes
nothing. When an entry is written, the entries
that nothing will read again are removed (`remove_unused`): the same model's older builds, and those whose model
directory is gone.

The weights file carries a CRC-32 of its header and of each tensor (in `layout.json`), checked by every `read`
before a tensor is used: a damaged file is refused (and rebuilt by the loader), never run. Measured on the default
model's 197 MB int8 file (2-core box, page cache warm): the per-tensor check costs 52-64 ms a load; one CRC over the
whole file 52-56 ms, sha256 111 ms, blake2b 238 ms. Per tensor costs the same as whole-file and names the tensor.
The check runs in a thread of its own while the model is built around the mapped tensors (`zlib.crc32` lets go of
the interpreter lock), so on two cores it costs a load next to nothing; the model is handed out only once it passed.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import platform
import re
import shutil
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from chatapp.errors import ChatappError
from chatapp.stt.weights import Int4Linear, Int8Linear, LowRankLinear

# Raised when what is stored here changes meaning (a new module kind, another layout).
FORMAT_VERSION = 2  # 2: the weights file's checksums in layout.json
WEIGHTS_FILE = "weights.safetensors"
_FUSED = (".qkv_proj", ".gate_up_proj", ".kv_proj")  # the last: an STT layer's k/v-only copy (`add_kv_projections`)
# Every stored tensor starts on a boundary of this many bytes (a cache line; AVX-512's widest load).
ALIGNMENT = 64
_PAD = "__padding__."
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}
LAYOUT_FILE = "layout.json"
# What an entry was built from: its sources' stamp and content digest (`ServedEntry`), rewritten when a load finds
# the entry through the content digest with another stamp (a copied data directory).
SOURCE_FILE = "source.json"
# Where a model directory inside the data directory is recorded as, so that the record holds when the data
# directory is copied or moved.
_IN_DATA = "<data>/"
# After this many checked bytes, the check hands back the pages it mapped (it would hold the whole file otherwise).
_RELEASE_BYTES = 4 << 20
_LAYOUT_CRC = "chatapp.layout_crc32"  # the weights header's metadata key for `_layout_crc`
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

    model_dir: Path
    files: tuple[Path, ...]
    weight_format: str


class ServedEntry(NamedTuple):
    """A stored format's directory (written or not) and what finding it established about its source."""

    path: Path
    stamp: dict[str, Any]  # `source_stamp`: where the source is, its files' sizes and modification times
    digest: str  # `content_digest` of the source


def cpu_flags() -> str:
    """The CPU's instruction-set flags: packed int4 weights and compiled kernels are built for this machine's ISA."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def served_key(source: ServedSource, digest: str) -> str:
    """A digest of everything a stored format of `source` (whose files' `content_digest` is `digest`) depends on
    (see the module docstring)."""
    here = Path(__file__).parent
    code = hashlib.sha256(b"".join((here / name).read_bytes() for name in _BUILDING_SOURCES)).hexdigest()
    facts = {
        "format_version": FORMAT_VERSION,
        "content": digest,
        "weight_format": source.weight_format,
        "torch": torch.__version__,
        "cpu": cpu_flags(),
        "code": code,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def content_digest(source: ServedSource) -> str:
    """sha256 of the source files' names, sizes and bytes: their identity wherever they live and whatever their
    dates. Read in chunks (`hashlib.file_digest`), so the files never join this process's resident set."""
    from chatapp.store import open_regular

    total = hashlib.sha256()
    for path in source.files:
        with open_regular(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            part = hashlib.file_digest(fh, "sha256").hexdigest()
        total.update(f"{path.name}\0{size}\0{part}\n".encode())
    return total.hexdigest()


def source_stamp(source: ServedSource, store: Path) -> dict[str, Any]:
    """What identifies `source` without reading it: its model directory (relative to the data directory, the
    parent of `store`, when inside it), the weight format, and each file's name, size and modification time."""
    stats = [(path.name, path.stat()) for path in source.files]
    return {
        "model_dir": _recorded_dir(source.model_dir, store.parent),
        "weight_format": source.weight_format,
        "files": [[name, stat.st_size, stat.st_mtime_ns] for name, stat in stats],
    }


def find_entry(source: ServedSource, store: Path) -> ServedEntry:
    """The entry of `source` in the store directory `store` (written or not): its content digest is taken from
    an entry that remembers the same stamp, else computed from the files."""
    stamp = source_stamp(source, store)
    digest = next((record["digest"] for _, record in _records(store) if record.get("stamp") == stamp), None)
    if not isinstance(digest, str):
        digest = content_digest(source)
    label = re.sub(r"[^A-Za-z0-9._]+", "_", source.model_dir.name)[:40] or "model"
    return ServedEntry(store / f"{label}-{source.weight_format}-{served_key(source, digest)}", stamp, digest)


def record_source(entry: ServedEntry, directory: Path | None = None) -> None:
    """Write what `entry` was built from into `directory` (default: the entry itself), replacing any earlier
    record whole (`store.atomic_write`)."""
    from chatapp.store import atomic_write

    text = json.dumps({"stamp": entry.stamp, "digest": entry.digest}, indent=1) + "\n"

    def write_record(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(0o644)  # as the entry's other files (a temporary file is created private)

    atomic_write((directory or entry.path) / SOURCE_FILE, write_record)


def remember(entry: ServedEntry) -> None:
    """After `entry` was read: when it was found through its content digest under another stamp (the data
    directory or the model was copied), record the current one, so the next load hashes nothing and
    `remove_unused` sees the entry in use. Best effort: a read-only store is only slower to look up."""
    from chatapp.store import target_lock

    record = _record(entry.path)
    if record is not None and record.get("stamp") == entry.stamp:
        return
    try:
        with target_lock(entry.path, blocking=False) as locked:
            if locked and entry.path.is_dir():
                record_source(entry)
    except OSError:
        pass


def remove_unused(entry: ServedEntry) -> list[Path]:
    """Remove the entries beside `entry` that nothing will read again: the same model directory's in the same
    format (older weights, code, torch or CPU: another key), those whose model directory is gone, and those
    without a readable record (written by earlier versions). An entry another process is writing (its lock held)
    is left. Returns what was removed."""
    from chatapp.store import target_lock

    store = entry.path.parent
    mine = (entry.stamp["model_dir"], entry.stamp["weight_format"])
    removed = []
    for path in _entries(store):
        if path == entry.path:
            continue
        record = _record(path)
        stamp = record.get("stamp") if record is not None else None
        if isinstance(stamp, dict):
            recorded = stamp.get("model_dir")
            same = (recorded, stamp.get("weight_format")) == mine
            if not same and isinstance(recorded, str) and _recorded_exists(recorded, store.parent):
                continue
        try:
            with target_lock(path, blocking=False) as locked:
                if locked:
                    shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue
        if not path.exists():
            removed.append(path)
    return removed


def _recorded_dir(model_dir: Path, data: Path) -> str:
    resolved = model_dir.resolve()
    try:
        return _IN_DATA + resolved.relative_to(data.resolve()).as_posix()
    except ValueError:
        return str(resolved)


def _recorded_exists(recorded: str, data: Path) -> bool:
    path = data / recorded.removeprefix(_IN_DATA) if recorded.startswith(_IN_DATA) else Path(recorded)
    return path.is_dir()


def _entries(store: Path) -> list[Path]:
    """The entries in `store` (not the hidden staging, lock and set-aside names of `chatapp.store`)."""
    try:
        return [Path(item.path) for item in os.scandir(store) if not item.name.startswith(".") and item.is_dir()]
    except OSError:
        return []


def _record(directory: Path) -> dict[str, Any] | None:
    from chatapp.store import read_regular_bytes

    try:
        record = json.loads(read_regular_bytes(directory / SOURCE_FILE, 1 << 20))
    except (OSError, ValueError, ChatappError):
        return None
    return record if isinstance(record, dict) else None


def _records(store: Path) -> list[tuple[Path, dict[str, Any]]]:
    return [(path, record) for path in _entries(store) if (record := _record(path)) is not None]


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
    # The layout's own checksum goes in the weights file's header, which the layout's checksums cover in turn.
    metadata = {_LAYOUT_CRC: str(_layout_crc(layout))}
    layout["checksums"] = write_aligned_safetensors(state, directory / WEIGHTS_FILE, metadata)
    (directory / LAYOUT_FILE).write_text(json.dumps(layout, indent=1) + "\n", encoding="utf-8")


def _layout_crc(layout: dict[str, Any]) -> int:
    """CRC-32 of a layout without its checksums, as canonical JSON (what a JSON round trip gives back exactly)."""
    described = {key: value for key, value in layout.items() if key != "checksums"}
    return zlib.crc32(json.dumps(described, sort_keys=True, separators=(",", ":")).encode())


def read(directory: Path, device: torch.device | None = None) -> nn.Module:
    """The model stored in `directory`, its tensors memory-mapped. Raises `ServedFormatError` when the files are
    missing, torn or do not describe a model."""
    from chatapp.store import open_regular, read_regular_bytes

    weights = directory / WEIGHTS_FILE
    try:
        # Regular files only, checked without blocking (a FIFO put in their place would hang a plain read).
        layout = json.loads(read_regular_bytes(directory / LAYOUT_FILE, 64 << 20))
        if not isinstance(layout, dict) or layout.get("format_version") != FORMAT_VERSION:
            found = layout.get("format_version") if isinstance(layout, dict) else None
            raise ServedFormatError(
                f"{directory} holds format {found}, not {FORMAT_VERSION}",
                hint=REBUILT,
            )
        fh = open_regular(weights)
    except ServedFormatError:
        raise
    except (OSError, ValueError, ChatappError) as err:
        raise ServedFormatError(
            f"cannot read the stored weights in {directory}: {err}",
            hint="it is rebuilt from the model: run the command again",
        ) from None
    with fh:
        check = _Check(fh, layout, weights)
        try:
            model = _build(directory, weights, layout)
        finally:
            check.join()  # its verdict before the build's: a damaged file is reported as damaged
    model.weight_format = layout["weight_format"]
    if device is not None and device.type != "cpu":
        model.to(device)
    return model.eval()


class _Check(threading.Thread):
    """`check_sums` of the weights file open as `fh`, and the layout against the checksum its header keeps, in a
    thread started at once; `join` raises what it found wrong (`ServedFormatError`)."""

    def __init__(self, fh: Any, layout: dict[str, Any], path: Path) -> None:
        super().__init__(name="chatapp-served-check", daemon=True)
        self._fh, self._layout, self._path = fh, layout, path
        self._error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            header = check_sums(self._fh, self._layout.get("checksums"), self._path)
            if header.get("__metadata__", {}).get(_LAYOUT_CRC) != str(_layout_crc(self._layout)):
                raise ServedFormatError(
                    f"{self._path.with_name(LAYOUT_FILE)} is damaged: it does not match its checksum", hint=REBUILT
                )
        except ServedFormatError as err:
            self._error = err
        except (OSError, ValueError) as err:
            self._error = ServedFormatError(
                f"cannot read the stored weights in {self._path.parent}: {err}",
                hint="it is rebuilt from the model: run the command again",
            )
        except BaseException as err:  # a bug: raised in the reading thread, as it was raised here
            self._error = err

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self._error is not None:
            raise self._error


def _build(directory: Path, weights: Path, layout: dict[str, Any]) -> nn.Module:
    """The model `layout` describes, on the tensors of `weights` (memory-mapped)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from chatapp.stt.config import STTConfig
    from chatapp.stt.model import STTForCausalLM, on_meta
    from chatapp.stt.weights import fuse_structure

    try:
        state = load_file(str(weights))
    except (OSError, ValueError, SafetensorError) as err:
        raise ServedFormatError(
            f"cannot read the stored weights in {directory}: {err}",
            hint="it is rebuilt from the model: run the command again",
        ) from None
    try:
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
    return model


def write_aligned_safetensors(
    state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> dict[str, Any]:
    """Write `state` as a safetensors file in which every tensor starts on an `ALIGNMENT`-byte boundary; return
    its checksums for `check_sums` (CRC-32 of the header, and of each tensor by name).

    torch's weight-only kernels load their weights with aligned vector loads: a memory-mapped tensor at an
    unaligned offset (the safetensors library packs tensors back to back) crashes them. The format allows no gaps
    between tensors, so the gaps are filled by uint8 padding entries (`_PAD` names, dropped by `read`), and the
    header is padded with spaces (as the format allows) so the data starts aligned too."""
    names = sorted(state, key=lambda name: (-state[name].element_size(), name))
    entries: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    chunks: list[tuple[str, bytes | torch.Tensor]] = []
    offset = 0
    for name in names:
        gap = -offset % ALIGNMENT
        if gap:
            entries[f"{_PAD}{len(entries)}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            chunks.append((_PAD, bytes(gap)))
            offset += gap
        tensor = state[name].detach().contiguous().cpu()
        size = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        chunks.append((name, tensor))
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % ALIGNMENT)
    header = len(header).to_bytes(8, "little") + header
    sums: dict[str, int] = {}
    with path.open("wb") as out:
        out.write(header)
        for name, chunk in chunks:
            data = chunk if isinstance(chunk, bytes) else chunk.reshape(-1).view(torch.uint8).numpy().tobytes()
            if not name.startswith(_PAD):
                sums[name] = zlib.crc32(data)
            out.write(data)
    return {"algorithm": "crc32", "header": zlib.crc32(header), "tensors": sums}


# What a damaged stored model's error says to do: loading rebuilds it from its source model (`served_model`).
REBUILT = "it is rebuilt from the model: run the command again"


def check_sums(fh: Any, checksums: Any, path: Path) -> dict[str, Any]:
    """Check the safetensors file open as `fh` (at `path`, for the message) against the `checksums` that
    `write_aligned_safetensors` returned, and return its header; `ServedFormatError` naming the file and the
    damaged part otherwise.

    The file is memory-mapped for the check, and the pages already checked are handed back as it goes, so it
    adds no resident memory; what it costs is one CRC-32 pass (measured in the module docstring)."""
    if not isinstance(checksums, dict) or checksums.get("algorithm") != "crc32":
        raise ServedFormatError(f"{path} has no checksums to check it against", hint=REBUILT)
    size = os.fstat(fh.fileno()).st_size
    if size < 8:
        raise ServedFormatError(f"{path} is damaged: it is {size} bytes long", hint=REBUILT)
    with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            length = int.from_bytes(view[:8], "little")
            if 8 + length > size or zlib.crc32(view[: 8 + length]) != checksums.get("header"):
                raise ServedFormatError(f"{path} is damaged: its header does not match its checksum", hint=REBUILT)
            header = json.loads(bytes(view[8 : 8 + length]))
            stored = {name for name in header if name != "__metadata__" and not name.startswith(_PAD)}
            if set(checksums["tensors"]) != stored:
                raise ServedFormatError(f"{path} is damaged: its checksums do not cover its tensors", hint=REBUILT)
            base, released = 8 + length, 0
            for name, expected in checksums["tensors"].items():
                start, end = (base + offset for offset in header[name]["data_offsets"])
                if end > size:
                    raise ServedFormatError(
                        f"{path} is damaged: tensor {name} ends past the end of the file", hint=REBUILT
                    )
                crc = 0
                for low in range(start, end, _RELEASE_BYTES):
                    high = min(end, low + _RELEASE_BYTES)
                    crc = zlib.crc32(view[low:high], crc)
                    if high - released >= _RELEASE_BYTES:
                        upto = high // mmap.PAGESIZE * mmap.PAGESIZE
                        mapped.madvise(mmap.MADV_DONTNEED, released, upto - released)
                        released = upto
                if crc != expected:
                    raise ServedFormatError(
                        f"{path} is damaged: tensor {name} does not match its checksum", hint=REBUILT
                    )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ServedFormatError(
                f"{path} is damaged: its checksums do not describe it ({err})", hint=REBUILT
            ) from None
        finally:
            view.release()
    return header


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
        local = key[len(prefix) :]
        if "." in local:  # a child module's tensor (LowRankLinear's `base`): built with the child's own entry
            children.setdefault(local.split(".", 1)[0], {})
            continue
        module.register_buffer(local, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
    if kind is not LowRankLinear and "bias" not in module._buffers:  # a projection without bias has `bias = None`
        module.register_buffer("bias", None)
    return module
