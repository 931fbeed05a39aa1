"""The int8 decode step on a CPU as one call of native code (`decode_step.c`, built here with the C compiler).

`decode.decode_step` runs a step as ~25 torch calls of blocks with torch ops between them (routers, step state,
bookkeeping): at batch 1 on a 2-core CPU that bookkeeping and torch's int8 kernel were most of a step. For a model
whose projections and LM head are int8 (`stt.weights.Int8Linear`) on a CPU, the loader attaches a `NativeStep`
instead (`attach`, into the model's `decode.DecodeRuntime`): the whole step of every batch size, routing and cache
bookkeeping included, is one call of `chatapp_decode` over the model's own weight arrays, and every command decodes
through it from its first token (docs/cpu-kernel.md; the rates: docs/benchmarks.md).

The C file is compiled once per machine (`-O3 -march=native -fopenmp`, ~3 s; `make run` and `make test` do it
first) into `_build/` beside it, or the data directory where the package is read-only, under a name that hashes
the source, the flags and the CPU's features, so an edited file or another CPU gets its own build. Loading it is
a `dlopen` and a check that the library's `DecodeArgs` has this module's layout (`layout_mismatch`): no JIT,
nothing held in memory beyond the code. Without a C compiler, or with a layout that differs, the kernel is not
attached and the torch step decodes (`library_problem` says why, `chatapp info` shows it).

The model's arrays are gathered once (`model_arrays`, kept by its `NativeStep`) and a cache's once
(`cache_arrays`, kept on the cache): numpy views of the same memory, int8 levels shared with the modules, the
small float vectors (scales, biases, norm weights, routers) as float32 copies.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from chatapp.settings import KERNEL_THREADS_ENV, threads_from_env
from chatapp.stt.layers import stores_skipped
from chatapp.stt.thread_governor import ThreadGovernor
from chatapp.stt.weights import Int8Linear

SOURCE = Path(__file__).with_name("decode_step.c")
# Reordered float sums (what vectorizes the attention's dot products), but not -ffast-math: a shared library
# linked with it sets the CPU's flush-to-zero mode for the whole process when it is loaded, which changed the
# calculator's results (subnormal numbers became 0).
FLAGS = (
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
    "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
)  # fmt: skip
# Threads of the kernel's OpenMP pool: `$CHATAPP_KERNEL_THREADS` (checked and capped by `settings.threads_from_env`)
# for every step, else a count up to torch's that follows the machine's load (`thread_governor`).
THREADS_ENV = KERNEL_THREADS_ENV

# The cache's keys and values as the step stores and reads them: half the bytes of float32, which a step at a long
# context reads more of than it reads weights (decode_step.c). A cache made before the step was attached is float32
# and is decoded by the torch step.
KV_DTYPE = torch.float16

_EMPTY = np.zeros(0, dtype=np.float32)
# A build being written: `build` compiles to `.<name>.<pid>` and renames it into place.
_PARTIAL = re.compile(r"^\.decode_step-[0-9a-f]+\.so\.(?P<pid>[0-9]+)$")
# A build takes seconds (~3 s on 2 cores); a partial file older than this is no live build's, whatever its pid says.
PARTIAL_MAX_AGE_S = 30 * 60


def _f32(t: torch.Tensor | None) -> np.ndarray:
    return _EMPTY if t is None else t.detach().float().contiguous().numpy()


class ModelArrays(NamedTuple):
    """What `chatapp_decode` reads of a model: its arrays, every per-layer one stacked on a first axis of layers
    (kept alive here), and the `DecodeArgs` fields that describe and point at them."""

    arrays: dict[str, np.ndarray]  # by `DecodeArgs` field name
    fields: dict[str, int | float]  # the model's `DecodeArgs` fields: sizes, then the arrays' addresses


def _projections(layer) -> tuple | None:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    return projections if all(isinstance(p, Int8Linear) for p in projections) else None


def _stack_int8(modules: list[Int8Linear], mapped: list[tuple[int, int]]) -> np.ndarray:
    """The modules' int8 levels in one (L, N, K) array, each module's buffer then a view of it. The pages of the
    stored format's file mapping that the copy read are handed back (`_release`), so the resident set holds the
    levels once."""
    stacked = torch.stack([m.weight_int8 for m in modules])
    for module, view in zip(modules, stacked.unbind(0), strict=True):
        _release(module.weight_int8, mapped)
        module.weight_int8 = view
    return stacked.numpy()


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process mapped from files (/proc/self/maps; none where it cannot be read)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith("/"):
                    start, end = (int(value, 16) for value in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        pass
    return ranges


def _release(tensor: torch.Tensor, mapped: list[tuple[int, int]]) -> None:
    """Drop the resident pages of a tensor read from a file mapping that nothing reads any more (madvise
    DONTNEED: the file keeps them, and a read would map them again). Anonymous memory is left alone: there the
    call would discard the data."""
    import mmap

    start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    if not any(low <= start and start + size <= high for low, high in mapped):
        return
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + size) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4)  # MADV_DONTNEED


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    return np.ascontiguousarray(np.stack(arrays))


def model_arrays(model) -> ModelArrays | None:
    """`model`'s arrays for `chatapp_decode` (its int8 levels become views of the stacks); None when the kernel cannot
    run it: not on a CPU, a projection or the LM head not int8, an STT layer without a causal router, layers of
    different shapes."""
    layers = model.model.layers
    if model.device.type != "cpu" or not isinstance(model.lm_head, Int8Linear):
        return None
    projections = [_projections(layer) for layer in layers]
    stt = list(model.stt_layer_indices)
    routers = [layers[i].causal_router for i in stt]
    if any(p is None for p in projections) or any(r is None for r in routers):
        return None
    if len({(*(m.weight_int8.shape for m in p), p[0].bias is None) for p in projections}) != 1:
        return None
    qkv, o, up, down = (list(group) for group in zip(*projections, strict=True))
    mapped = _file_mappings()
    norm1 = [layer.input_layernorm for layer in layers]
    norm2 = [layer.post_attention_layernorm for layer in layers]
    arrays = {
        "norm1": _stack([_f32(n.weight) for n in norm1]),
        "eps1": np.array([n.variance_epsilon for n in norm1], np.float32),
        "qkv_w": _stack_int8(qkv, mapped), "qkv_s": _stack([_f32(m.scales) for m in qkv]),
        "qkv_b": _stack([_f32(m.bias) for m in qkv]),
        "o_w": _stack_int8(o, mapped), "o_s": _stack([_f32(m.scales) for m in o]),
        "norm2": _stack([_f32(n.weight) for n in norm2]),
        "eps2": np.array([n.variance_epsilon for n in norm2], np.float32),
        "up_w": _stack_int8(up, mapped), "up_s": _stack([_f32(m.scales) for m in up]),
        "down_w": _stack_int8(down, mapped), "down_s": _stack([_f32(m.scales) for m in down]),
        "stt_slot": np.full(len(layers), -1, dtype=np.int64),
        "final_norm": _f32(model.model.norm.weight),
        "head_w": model.lm_head.weight_int8.numpy(), "head_s": _f32(model.lm_head.scales),
    }  # fmt: skip
    arrays["stt_slot"][stt] = np.arange(len(stt))
    if routers:
        arrays |= {
            "r_norm_c": _stack([_f32(r.norm_current.weight) for r in routers]),
            "r_eps_c": np.array([r.norm_current.variance_epsilon for r in routers], np.float32),
            "r_norm_p": _stack([_f32(r.norm_previous.weight) for r in routers]),
            "r_eps_p": np.array([r.norm_previous.variance_epsilon for r in routers], np.float32),
            "r_up_w": _stack([_f32(r.up.weight) for r in routers]),
            "r_up_b": _stack([_f32(r.up.bias) for r in routers]),
            "r_out_w": _stack([_f32(r.out.weight.reshape(-1)) for r in routers]),
            "r_out_b": np.array([r.out.bias.item() for r in routers], np.float32),
        }
    predictors = [layers[i].skip_predictor for i in stt if getattr(layers[i], "skip_predictor", None) is not None]
    if predictors and len(predictors) == len(stt):
        arrays |= {
            "p_down": _stack([_f32(p.down.weight) for p in predictors]),
            "p_up": _stack([_f32(p.up.weight) for p in predictors]),
            "p_bias": _stack([_f32(p.up.bias) for p in predictors]),
        }
    attn = layers[0].self_attn
    fields = {
        "hidden": int(model.config.hidden_size), "layers": len(layers), "heads": attn.num_heads,
        "kv_heads": attn.num_kv_heads, "head_dim": attn.head_dim, "qkv_rows": arrays["qkv_w"].shape[1],
        "up_rows": arrays["up_w"].shape[1], "vocab": arrays["head_w"].shape[0], "stt_count": len(stt),
        "router_width": arrays["r_up_w"].shape[1] if routers else 0, "has_bias": int(arrays["qkv_b"].shape[1] > 0),
        "final_eps": float(model.model.norm.variance_epsilon),
        "predictor_rank": arrays["p_down"].shape[1] if "p_down" in arrays else 0,
        **{name: _ptr(array) for name, array in arrays.items()},
    }  # fmt: skip
    return ModelArrays(arrays, fields)


def cache_arrays(cache) -> tuple[np.ndarray, np.ndarray]:
    """The cache's keys and values as (L, B, S + 1, H_kv, Dh) arrays: its own blocks when its layers are views of
    one (`KVCache` allocates them so), else stacked once and the layers made views of the stack."""
    cached = cache.native_views
    if cached is not None and cached[0] == (id(cache.keys), id(cache.values)):
        return cached[1]
    arrays = (_layer_block(cache.keys), _layer_block(cache.values))
    cache.native_views = ((id(cache.keys), id(cache.values)), arrays)
    return arrays


def _layer_block(layers: list[torch.Tensor]) -> np.ndarray:
    first = layers[0]
    step = first.numel()
    if all(t.is_contiguous() and t.data_ptr() == first.data_ptr() + i * step * t.element_size()
           for i, t in enumerate(layers)):  # fmt: skip
        return torch.as_strided(first, (len(layers), *first.shape), (step, *first.stride())).numpy()
    stacked = torch.stack(layers)
    layers[:] = list(stacked.unbind(0))
    return stacked.numpy()


# ------------------------------------------------------------------------------------------ the native library
class ArgField(NamedTuple):
    """One field of `DecodeArgs`: its C type, its name, and what it holds (the header's comment)."""

    ctype: str
    name: str
    doc: str = ""


# `DecodeArgs` of decode_step.c, defined here once: `decode_args_header` writes the C struct from it for the build,
# and the ctypes mirror (`DecodeArgs`) is made from it. Every array is C-contiguous float32 unless its type says
# otherwise; per-layer arrays are stacked on a first axis of layers (L), the routers' on one of STT layers (L_stt).
_SIZES = "batch hidden layers heads kv_heads head_dim qkv_rows up_rows vocab slots stt_count router_width has_bias"
DECODE_ARGS: tuple[ArgField, ...] = (
    *(ArgField("int64_t", name) for name in _SIZES.split()),
    ArgField("int64_t", "student", "route STT layers by their causal routers at `cutoff`"),
    ArgField("int64_t", "store_skipped", "a skipped token stores its K/V (\"kv\", \"predict\")"),
    ArgField("int64_t", "threads", "OpenMP threads (0: as set)"),
    ArgField("int64_t", "predictor_rank", "\"predict\" skip mode: the predictor's rank P (0: none)"),
    ArgField("float *", "x", "(B, D) the token embeddings; the final hidden state after"),
    ArgField("const float *", "norm1", "(L, D)"),
    ArgField("const float *", "eps1", "(L)"),
    ArgField("const int8_t *", "qkv_w", "(L, QKV, D)"),
    ArgField("const float *", "qkv_s", "(L, QKV)"),
    ArgField("const float *", "qkv_b", "(L, QKV), only when has_bias"),
    ArgField("const int8_t *", "o_w", "(L, D, H * Dh)"),
    ArgField("const float *", "o_s", "(L, D)"),
    ArgField("const float *", "norm2", "(L, D)"),
    ArgField("const float *", "eps2", "(L)"),
    ArgField("const int8_t *", "up_w", "(L, 2I, D): gate rows, then up rows"),
    ArgField("const float *", "up_s", "(L, 2I)"),
    ArgField("const int8_t *", "down_w", "(L, D, I)"),
    ArgField("const float *", "down_s", "(L, D)"),
    ArgField("const float *", "r_norm_c", "(L_stt, D) the causal router's norm of the current input"),
    ArgField("const float *", "r_eps_c", "(L_stt)"),
    ArgField("const float *", "r_norm_p", "(L_stt, D) its norm of the previous token's input"),
    ArgField("const float *", "r_eps_p", "(L_stt)"),
    ArgField("const float *", "r_up_w", "(L_stt, R, 2D)"),
    ArgField("const float *", "r_up_b", "(L_stt, R)"),
    ArgField("const float *", "r_out_w", "(L_stt, R)"),
    ArgField("const float *", "r_out_b", "(L_stt)"),
    ArgField("const float *", "p_down", "(L_stt, P, D): a skipped token's update up . (down . norm1(x)) + bias"),
    ArgField("const float *", "p_up", "(L_stt, D, P)"),
    ArgField("const float *", "p_bias", "(L_stt, D)"),
    ArgField("const int64_t *", "stt_slot", "(L): the layer's STT index, -1 for a dense layer"),
    ArgField("uint16_t *", "keys", "(L, B, S + 1, H_kv, Dh), float16: slot S is the trash slot"),
    ArgField("uint16_t *", "values", "(L, B, S + 1, H_kv, Dh), float16"),
    ArgField("int64_t *", "lengths", "(L, B)"),
    ArgField("int32_t *", "positions", "(L, B, S + 1), as the cache keeps them"),
    ArgField("int64_t *", "seen", "(B)"),
    ArgField("const float *", "previous", "(L_stt, B, D): each STT layer's input one token before"),
    ArgField("float *", "inputs", "(L_stt, B, D): this token's, for the next step"),
    ArgField("const float *", "cos", "(B, Dh) at each row's position"),
    ArgField("const float *", "sin", "(B, Dh), signed as decode.rope_tables"),
    ArgField("const float *", "cutoff", "(B)"),
    ArgField("const float *", "final_norm", "(D)"),
    ArgField("float", "final_eps"),
    ArgField("const int8_t *", "head_w", "(V, D)"),
    ArgField("const float *", "head_s", "(V)"),
    ArgField("float *", "logits", "(B, V); an idle row's are left as they were"),
    ArgField("float *", "probs", "(L_stt, B)"),
    ArgField("uint8_t *", "selected", "(L_stt, B)"),
    ArgField("const uint8_t *", "active", "(B) rows fed this step, the others left as they are; NULL: every row"),
    ArgField("float *", "states", "(L, B, D) every layer's output, for the lens; NULL: not kept"),
)

_CTYPES = {"int64_t": ctypes.c_int64, "float": ctypes.c_float}


def decode_args_header() -> str:
    """decode_args.h, generated from `DECODE_ARGS`: the struct and `DECODE_ARGS_FIELDS(F)`, F applied to every field's
    name in order (the C side's layout table)."""
    lines = ["/* Generated by chatapp/stt/cpu_step.py from its DECODE_ARGS table at build time: edit the table. */"]
    lines += ["#include <stdint.h>", "typedef struct {"]
    for field in DECODE_ARGS:
        space = "" if field.ctype.endswith("*") else " "
        comment = f" /* {field.doc} */" if field.doc else ""
        lines.append(f"    {field.ctype}{space}{field.name};{comment}")
    lines.append("} DecodeArgs;")
    lines.append("#define DECODE_ARGS_FIELDS(F) " + " ".join(f"F({field.name})" for field in DECODE_ARGS))
    return "\n".join(lines) + "\n"


class DecodeArgs(ctypes.Structure):
    """`DecodeArgs` of decode_step.c, made from `DECODE_ARGS` (pointers as `c_void_p`)."""

    _fields_ = [(f.name, ctypes.c_void_p if f.ctype.endswith("*") else _CTYPES[f.ctype]) for f in DECODE_ARGS]


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def compiler() -> str | None:
    """The C compiler: `$CC`, else `cc` or `gcc` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compiler_problem() -> str | None:
    """Why this machine cannot build the kernel, found without building it (no compiler, or a `$CC` that names no
    program); None when a compiler is there (it may still fail, e.g. `CC=/bin/false`: `build` says so)."""
    cc = compiler()
    if cc is None:
        return "no C compiler found (set CC, or install gcc)"
    if shutil.which(cc) is None:
        return f"the C compiler CC={cc!r} was not found (set CC to an installed compiler such as gcc, or unset it)"
    return None


def library_path() -> Path:
    """Where the build for this source, these flags and this CPU lives (built or not)."""
    material = SOURCE.read_bytes() + decode_args_header().encode() + " ".join(FLAGS).encode()
    key = hashlib.sha256(material + _cpu_features().encode()).hexdigest()
    folder = SOURCE.parent / "_build"
    if not os.access(SOURCE.parent, os.W_OK) and not os.access(folder, os.W_OK):
        from chatapp.settings import data_dir

        folder = data_dir() / "kernels"
    return folder / f"decode_step-{key[:16]}.so"


def build(path: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Compile decode_step.c to `path` (atomically: a killed build leaves no half file under that name), with its
    header generated from `DECODE_ARGS`; `extra_flags` after `FLAGS` (a test builds the AVX2 products on a VNNI CPU)."""
    if (problem := compiler_problem()) is not None:
        raise OSError(problem)
    cc = compiler() or "cc"  # there is one: compiler_problem found it
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix="chatapp-kernel-") as include:
        (Path(include) / "decode_args.h").write_text(decode_args_header())
        command = [cc, *FLAGS, *extra_flags, "-I", include, "-o", str(partial), str(SOURCE), "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except FileNotFoundError:
            raise OSError(f"the C compiler {cc!r} was not found (set CC, or install gcc)") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise OSError(f"{cc} failed: {(done.stderr.strip().splitlines() or ['no message'])[-1]}")
    partial.replace(path)
    for stale in path.parent.glob("decode_step-*.so"):  # builds of earlier sources (or other CPUs) in this folder
        if stale != path:
            stale.unlink(missing_ok=True)


def remove_dead_partials(folder: Path) -> list[Path]:
    """Remove the half-written builds (`.decode_step-*.so.<pid>`) in `folder` that no build will finish: their
    process is gone (kill -9 during a build), or they are older than `PARTIAL_MAX_AGE_S` (the pid may be another
    process's by now). Run before every load; never raises. Returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = _PARTIAL.match(entry.name)
        if match is None:
            continue
        try:
            age = time.time() - entry.stat(follow_symlinks=False).st_mtime
            if _alive(int(match["pid"])) and age < PARTIAL_MAX_AGE_S:
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or a number no process can have
        return False
    except PermissionError:  # another user's process
        return True
    return True


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    try:
        path = library_path()
        remove_dead_partials(path.parent)
        if not path.is_file():
            build(path)
        library = ctypes.CDLL(str(path))
    except OSError as err:
        return None, f"the int8 decode kernel could not be built ({err}); decoding with torch's int8 step"
    if (mismatch := layout_mismatch(library)) is not None:
        return None, (
            f"the int8 decode kernel was not loaded: its DecodeArgs differs from cpu_step.DecodeArgs ({mismatch}); "
            "decoding with torch's int8 step"
        )
    library.chatapp_decode.argtypes = [ctypes.POINTER(DecodeArgs)]
    library.chatapp_decode.restype = ctypes.c_int
    return library, None


def layout_mismatch(library: ctypes.CDLL) -> str | None:
    """Where the library's `DecodeArgs` (as its compiler laid it out: `chatapp_decode_layout`) and this module's
    ctypes mirror differ, in a phrase; None when every field has the same name, offset and size, in order, and the
    structs the same size."""
    describe = library.chatapp_decode_layout
    describe.restype = ctypes.c_int64
    describe.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_char_p)] + [ctypes.POINTER(ctypes.c_int64)] * 2
    name, offset, size = ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64()

    def field(at: int) -> tuple[str, int, int]:
        describe(at, ctypes.byref(name), ctypes.byref(offset), ctypes.byref(size))
        return (name.value or b"").decode(), offset.value, size.value

    ours = [(n, getattr(DecodeArgs, n).offset, getattr(DecodeArgs, n).size) for n, _ in DecodeArgs._fields_]
    count = describe(-1, ctypes.byref(name), ctypes.byref(offset), ctypes.byref(size))
    if size.value != ctypes.sizeof(DecodeArgs):
        return f"{size.value} bytes in C, {ctypes.sizeof(DecodeArgs)} here"
    theirs = [field(at) for at in range(count)]
    for (c_name, c_offset, c_size), (py_name, py_offset, py_size) in zip(theirs, ours, strict=False):
        if (c_name, c_offset, c_size) != (py_name, py_offset, py_size):
            return f"C has {c_name} at byte {c_offset} ({c_size} bytes), Python {py_name} at {py_offset} ({py_size})"
    if count != len(ours):
        return f"{count} fields in C, {len(ours)} here"
    return None


def library() -> ctypes.CDLL | None:
    """The built kernel, loaded (building it first when this machine has no build of this source): None where it
    cannot be built."""
    return _load()[0]


def library_problem() -> str | None:
    """Why `library()` is None, in a sentence; None when it loaded."""
    return _load()[1]


def _ptr(array: np.ndarray) -> int:
    return array.ctypes.data


# ------------------------------------------------------------------------------------------------ the step
class NativeStep:
    """`decode.decode_step` (same arguments, same results, the logits in float32) as one `chatapp_decode` call over
    one model's arrays: what `attach` puts in the model's `DecodeRuntime`."""

    def __init__(self, arrays: ModelArrays, native: ctypes.CDLL) -> None:
        self.arrays, self.native = arrays, native
        self.governor: ThreadGovernor | None = None

    def team(self) -> tuple[int, ThreadGovernor | None]:
        """The next step's thread count, and the governor that chose it: `$CHATAPP_KERNEL_THREADS` when set (no
        governor), else the governor's choice up to torch's count (a new governor when that count changed)."""
        fixed = threads_from_env(THREADS_ENV)
        if fixed is not None:
            return fixed, None
        ceiling = torch.get_num_threads()
        if self.governor is None or self.governor.ceiling != ceiling:
            self.governor = ThreadGovernor(ceiling)
        return self.governor.threads(), self.governor

    @torch.no_grad()
    def __call__(
        self,
        model,
        ids: torch.Tensor,
        cache,
        student: bool,
        cutoff: float | torch.Tensor,
        active: torch.Tensor | None = None,
        states: torch.Tensor | None = None,
    ):
        """`active` (B,) bool: the rows fed this step (None: all); the others are left exactly as they were and their
        logits are zeros. `states`: a float32 (L, B, D) tensor that receives every layer's output of the fed rows."""
        from chatapp.stt.decode import rope_tables

        batch = ids.shape[0]
        if batch == 0 or not _kernel_layout(cache):
            return None
        fed = None if active is None else active.to(torch.uint8).contiguous()
        cache.reserve(1 if fed is None else fed.long(), 1)  # raises on overflow, as the torch step does
        cos_table, sin_table = rope_tables(model, int(cache.seen.max()) + 1, model.dtype)
        cos, sin = _f32(cos_table[cache.seen].reshape(batch, -1)), _f32(sin_table[cache.seen].reshape(batch, -1))
        keys, values = cache_arrays(cache)
        x = model.model.embed_tokens(ids).float().contiguous()
        cutoffs = torch.as_tensor(cutoff, dtype=torch.float32).expand(batch).contiguous()
        stt_count = cache.prev_hidden.shape[0]
        previous = _f32(cache.prev_hidden)
        inputs = torch.empty((stt_count, batch, x.shape[1]), dtype=torch.float32)
        probs = torch.ones((stt_count, batch), dtype=torch.float32)
        selected = torch.ones((stt_count, batch), dtype=torch.bool)
        logits = (torch.empty if fed is None else torch.zeros)((batch, self.arrays.fields["vocab"]), dtype=torch.float32)
        if states is not None and (states.dtype != torch.float32 or not states.is_contiguous()):
            raise ValueError("states must be a contiguous float32 (L, B, D) tensor")
        lengths, positions, seen = cache.lengths.numpy(), cache.positions.numpy(), cache.seen.numpy()
        threads, governor = self.team()
        args = DecodeArgs(
            batch=batch, slots=keys.shape[2], student=bool(student),
            store_skipped=stores_skipped(model.config.skip_mode), threads=threads, x=x.data_ptr(),
            keys=_ptr(keys), values=_ptr(values), lengths=_ptr(lengths), positions=_ptr(positions), seen=_ptr(seen),
            previous=_ptr(previous), inputs=inputs.data_ptr(), cos=_ptr(cos), sin=_ptr(sin),
            cutoff=cutoffs.data_ptr(), logits=logits.data_ptr(), probs=probs.data_ptr(),
            selected=selected.data_ptr(), active=None if fed is None else fed.data_ptr(),
            states=None if states is None else states.data_ptr(), **self.arrays.fields,
        )  # fmt: skip
        start = time.perf_counter()
        if self.native.chatapp_decode(ctypes.byref(args)) != 0:
            raise MemoryError("the int8 decode kernel could not allocate its scratch memory")
        if governor is not None:  # the work a step does: its rows, and how many of them it feeds
            governor.record((batch, batch if fed is None else int(fed.sum())), threads, time.perf_counter() - start)
        cache.prev_hidden.copy_(inputs)
        # float32 as computed: rounding 49k logits to the model's bfloat16 cost 0.4 ms a step, and sampling takes
        # them back to float32.
        return logits, probs[..., None], selected[..., None]


def kernel_step(model, ids: torch.Tensor, cache, student: bool, cutoff: float | torch.Tensor):
    """One decode step of `model` through its native step (attached first when it has none: `attach`); None when
    the kernel cannot serve the model or the call."""
    if not isinstance(model.runtime.native, NativeStep) and not attach(model):
        return None
    return model.runtime.native(model, ids, cache, student, cutoff)


def _kernel_layout(cache) -> bool:
    """Whether the cache's K/V and bookkeeping have the element types the C code reads (it reads raw memory)."""
    bookkeeping = (cache.lengths.dtype, cache.positions.dtype, cache.seen.dtype)
    return cache.kv_dtype == KV_DTYPE and bookkeeping == (torch.int64, torch.int32, torch.int64)


def serves(model) -> bool:
    """Whether the native step can decode `model` (see `model_arrays`): the library built, the model's layout
    taken. Gathers the arrays only when it is not attached yet."""
    if isinstance(model.runtime.native, NativeStep):
        return True
    return library() is not None and model_arrays(model) is not None


def attach(model) -> bool:
    """Decode `model` in one native call a step (its `DecodeRuntime.native`) when the kernel serves it; whether it
    is attached."""
    if isinstance(model.runtime.native, NativeStep):
        return True
    native = library()
    arrays = model_arrays(model) if native is not None else None
    if arrays is None:
        return False
    model.runtime.native = NativeStep(arrays, native)
    model.runtime.kv_dtype = KV_DTYPE  # caches made from now on are the step's
    model.runtime.note = "the decode step runs as one native call (int8 kernel)"
    return True


def build_kernel() -> None:
    """Build the kernel for this machine when it has no current build (`make run` and `make test` run this first:
    `python -m chatapp.stt.cpu_step`); say why where it cannot be built."""
    import sys

    if library() is None:
        print(library_problem(), file=sys.stderr)


if __name__ == "__main__":
    build_kernel()
