"""Importing a llama.cpp GGUF file (Llama or Qwen2 architecture) as an STT model directory.

The file is read and dequantized with the `gguf` package (llama.cpp's own reader), so every tensor type that
package can dequantize in numpy loads; the common ones are checked by tests. Two things differ from a Hugging Face
checkpoint and are undone here:

- llama.cpp's Llama converter permutes the rows of `q_proj` and `k_proj` so its rotary kernel can rotate adjacent
  pairs; transformers rotates halves. The inverse permutation restores the Hugging Face order. Qwen2 files are
  written without the permutation.
- A Llama block is a Qwen2 block without q/k/v biases, so Llama files get zero biases and load into the Qwen2
  layout unchanged in what they compute.

The tokenizer is rebuilt from the file's metadata (`chatapp.models.gguf_tokenizer`) and written as
`tokenizer.json`; the chat template and the special tokens go to `tokenizer_config.json`, the end-of-turn id to
`generation_config.json`.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chatapp.errors import ModelDirError
from chatapp.models.gguf_tokenizer import GGUFTokenizer, TokenizerError, build_tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# Tensor types that appear in the GGUF files people actually have; all dequantize in numpy via `gguf`.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp tensor names (per block, after `blk.N.`) -> Hugging Face Qwen2 names (after `model.layers.N.`).
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFError(ModelDirError):
    """A GGUF file cannot be imported: unreadable, truncated, or of an architecture / tensor type not supported."""


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file describes, read and converted: Qwen2 config values, HF-named tensors, tokenizer files."""

    architecture: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]


Progress = Callable[[int, int], None]


@functools.cache
def _bounded_reader() -> type:
    from gguf import GGUFReader, GGUFValueType

    class BoundedReader(GGUFReader):
        """`GGUFReader` whose every read must lie inside the file. The stock reader slices past the end without a
        word, so a corrupt array length made it loop, and grow lists, once per claimed element (up to 2**64)."""

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise ValueError(f"the file ends at byte {len(self.data)}, before the data it declares (to byte {end})")
            return super()._get(offset, dtype, count, override_order)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            # An array is read element by element: refuse one longer than the rest of the file could hold.
            if raw_type == GGUFValueType.ARRAY:
                item_type, count = int(self._get(orig_offs, np.uint32)[0]), int(self._get(orig_offs + 4, np.uint64)[0])
                scalar = self.gguf_scalar_to_np.get(item_type)  # a string takes 8 bytes at least, an array 12
                smallest = (
                    np.dtype(scalar).itemsize if scalar is not None else 12 if item_type == GGUFValueType.ARRAY else 8
                )
                if count * smallest > len(self.data) - orig_offs - 12:
                    raise ValueError(f"an array at byte {orig_offs} claims {count} items, more than the file holds")
            return super()._get_field_parts(orig_offs, raw_type)

    return BoundedReader


def _open(path: Path) -> Any:
    if not path.is_file():
        raise GGUFError(f"{path} is not a file", hint="pass the path of a .gguf model file")
    try:
        return _bounded_reader()(path)
    except (ValueError, IndexError, KeyError, OSError, struct.error, TypeError) as err:
        raise GGUFError(
            f"{path} is not a readable GGUF file ({type(err).__name__}: {str(err)[:200]})",
            hint="the file is truncated or not GGUF; download or copy it again",
        ) from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as err:
        raise GGUFError(f"the GGUF metadata field {key!r} is corrupt: {err}", hint="copy the file again") from None


def _config(reader: Any, path: Path, arch: str, has_output: bool) -> dict[str, Any]:
    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{path} lacks the metadata field {arch}.{key}", hint="the file is incomplete")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    if heads <= 0 or kv_heads <= 0 or hidden % heads or heads % kv_heads:
        raise GGUFError(
            f"{path}: inconsistent attention shape (hidden {hidden}, heads {heads}, kv heads {kv_heads})",
            hint="the file is damaged or not a supported model: download it again",
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


# The Hugging Face config field each GGUF metadata key becomes (after `ARCH.`), to name the key at fault.
_GGUF_KEYS = {
    "vocab_size": "vocab_size (or the length of tokenizer.ggml.tokens)",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "max_position_embeddings": "context_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
}


def _validate_config(path: Path, arch: str, config: dict[str, Any]) -> None:
    """The same validation a config.json gets (`STTConfig` and `validate_stt`), before any tensor is read; a
    failure names the GGUF metadata key the bad value came from."""
    from huggingface_hub.errors import StrictDataclassError

    from chatapp.stt.config import STTConfig, config_problem

    try:
        STTConfig(**config).validate_stt()
    except (TypeError, ValueError, StrictDataclassError) as err:
        problem = config_problem(err)
        fields = [name for name in _GGUF_KEYS if problem.startswith(name) or f" {name} " in f" {problem} "]
        keys = ", ".join(f"{arch}.{_GGUF_KEYS[name]}" for name in fields)
        where = (
            f"its metadata {keys} gives an impossible model config"
            if keys
            else "its metadata gives an impossible model config"
        )
        raise GGUFError(
            f"{path}: {where}: {problem}",
            hint="the file is corrupt or was written wrongly; use another copy or a file from another converter",
        ) from None


def _check_shapes(reader: Any, path: Path, config: dict[str, Any]) -> None:
    """The tensors are those the config implies, with the shapes it implies: checked before anything is dequantized
    or sized from the metadata's counts, so a corrupt count fails here instead of looping or allocating."""
    shapes = {}
    for tensor in reader.tensors:
        hf = _hf_name(tensor.name)
        if hf is not None:
            shapes[hf] = (tensor.name, tuple(int(d) for d in reversed(tensor.shape)))
    layers = {int(name.split(".")[2]) for name in shapes if name.startswith("model.layers.")}
    if len(layers) != config["num_hidden_layers"] or layers != set(range(len(layers))):
        raise GGUFError(
            f"{path}: the metadata says {config['num_hidden_layers']} layers but the file has tensors for {len(layers)}",
            hint="the file is corrupt or incomplete; copy it again",
        )
    hidden, ff, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    want = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        want["lm_head.weight"] = (vocab, hidden)
    for layer in layers:
        block = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
        for proj, rows in (("q", hidden), ("k", kv), ("v", kv)):
            block[f"self_attn.{proj}_proj.weight"] = (rows, hidden)
            if f"model.layers.{layer}.self_attn.{proj}_proj.bias" in shapes:
                block[f"self_attn.{proj}_proj.bias"] = (rows,)
        block |= {"self_attn.o_proj.weight": (hidden, hidden), "mlp.gate_proj.weight": (ff, hidden)}
        block |= {"mlp.up_proj.weight": (ff, hidden), "mlp.down_proj.weight": (hidden, ff)}
        want |= {f"model.layers.{layer}.{name}": shape for name, shape in block.items()}
    for hf, shape in want.items():
        name, got = shapes.get(hf, (None, None))
        if got != shape:
            found = "missing" if name is None else f"{name} has shape {got}"
            raise GGUFError(
                f"{path}: the metadata implies a tensor {hf} of shape {shape}, but it is {found}",
                hint="the file is corrupt or not a plain Llama / Qwen2 model",
            )


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Invert llama.cpp's rotary row permutation of a q/k projection (pairs interleaved -> halves)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    return None


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    from gguf import dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise GGUFError(
            f"{path}: tensor {tensor.name} has type {kind}, which chatapp does not import",
            hint=f"use a file quantized as one of {', '.join(SUPPORTED_TENSOR_TYPES)} (e.g. Q8_0 or Q4_K_M)",
        )
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except (ValueError, IndexError, NotImplementedError) as err:
        raise GGUFError(
            f"{path}: tensor {tensor.name} cannot be dequantized: {err}", hint="copy the file again"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions fastest-first
    if values.size != int(np.prod(shape)):
        raise GGUFError(f"{path}: tensor {tensor.name} is truncated", hint="the file is incomplete; copy it again")
    return values.reshape(shape).astype(np.float32)  # a copy: F32 tensors are views of the read-only map


def read_gguf(path: str | Path, progress: Progress | None = None) -> GGUFModel:
    """Read, dequantize and rename every tensor of a Llama / Qwen2 GGUF file; build its tokenizer files."""
    path = Path(path).expanduser()
    reader = _open(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path} holds a {arch!r} model; chatapp imports {' and '.join(SUPPORTED_ARCHITECTURES)} GGUF files",
            hint="use a Llama- or Qwen2-family model (SmolLM, Llama 3, Qwen2/2.5, ...)",
        )
    names = {t.name for t in reader.tensors}
    try:
        config = _config(reader, path, arch, has_output="output.weight" in names)
    except (TypeError, ValueError, OverflowError) as err:
        raise GGUFError(
            f"{path}: a model metadata field has a value of the wrong type ({err})", hint="copy the file again"
        ) from None
    _check_shapes(reader, path, config)  # first: it bounds the layer count, which the config builds lists of
    _validate_config(path, arch, config)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    for done, tensor in enumerate(reader.tensors, start=1):
        hf = _hf_name(tensor.name)
        if hf is None:
            if tensor.name == "rope_freqs.weight":  # llama 3.1 long-context scaling: not supported
                raise GGUFError(
                    f"{path} uses rope frequency scaling (rope_freqs), which chatapp does not support",
                    hint="convert a model without rope scaling (Llama 3.0, Qwen2, SmolLM2)",
                )
            continue
        values = _dequantize(tensor, path)
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            values = _unpermute(values, heads if "q_proj" in hf else kv_heads)
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(values))
        if progress is not None:
            progress(done, total)
    for layer in range(config["num_hidden_layers"]):
        for proj in ("q_proj", "k_proj", "v_proj"):
            weight = tensors.get(f"model.layers.{layer}.self_attn.{proj}.weight")
            bias = f"model.layers.{layer}.self_attn.{proj}.bias"
            if weight is not None and bias not in tensors:
                tensors[bias] = torch.zeros(weight.shape[0])
    tokenizer = _tokenizer(reader, path, config)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    return GGUFModel(arch, config, tensors, tokenizer.json, tokenizer.config, generation)


def _tokenizer(reader: Any, path: Path, config: dict[str, Any]) -> GGUFTokenizer:
    try:
        built = build_tokenizer(lambda key: _field(reader, key), path)
    except (TokenizerError, TypeError, ValueError, OSError) as err:
        raise GGUFError(
            f"{path}: the tokenizer in the file's metadata cannot be rebuilt ({err})",
            hint="use a GGUF file with a gpt2 (byte-level BPE) or llama (sentencepiece) tokenizer",
        ) from None
    if built.size > config["vocab_size"]:
        raise GGUFError(
            f"{path}: the tokenizer has {built.size} tokens, more than the model's vocabulary of {config['vocab_size']}",
            hint="the file is damaged or not a supported model: download it again",
        )
    return built


def convert_gguf(source: str | Path, target: str | Path, progress: Progress | None = None) -> Any:
    """Write `source` (a .gguf file) as an STT model directory at `target`; returns the loaded STT model."""
    from chatapp.stt import STTForCausalLM
    from chatapp.stt.config import STTConfig
    from chatapp.stt.io import ROUTER_PARTS, save_model

    read = read_gguf(source, progress)
    target = Path(target)
    config = STTConfig(**read.config)
    with torch.random.fork_rng(devices=[]):  # the fresh routers: the same on every conversion of a file
        torch.manual_seed(0)
        model = STTForCausalLM(config)
    state = dict(read.tensors)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not any(part in k for part in ROUTER_PARTS)]  # fresh routers are expected
    if missing or unexpected:
        raise GGUFError(
            f"{source}: tensors do not match the architecture (missing {missing[:3]}, unexpected {unexpected[:3]})",
            hint="the file is damaged or not a supported model: download it again",
        )
    target.mkdir(parents=True, exist_ok=True)
    save_model(model, target)
    write_tokenizer_files(target, read)
    return model.eval()


def write_tokenizer_files(target: Path, read: GGUFModel) -> None:
    (target / "tokenizer.json").write_text(read.tokenizer_json, encoding="utf-8")
    (target / "tokenizer_config.json").write_text(json.dumps(read.tokenizer_config, indent=2) + "\n", encoding="utf-8")
    (target / "generation_config.json").write_text(
        json.dumps(read.generation_config, indent=2) + "\n", encoding="utf-8"
    )


def is_gguf(path: str | Path) -> bool:
    """True for a file that starts with GGUF's magic bytes."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False
