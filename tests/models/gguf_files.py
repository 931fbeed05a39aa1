"""Tiny GGUF files for the GGUF import tests, written the way llama.cpp's convert_hf_to_gguf.py writes them.

`write_tiny_gguf` makes a random 2-layer Llama or Qwen2 model (hidden 64, 4 heads / 2 KV heads, intermediate 256
so `ffn_down` rows are 256 wide and can hold K-quant blocks) with a small byte-level BPE vocabulary and the metadata
keys llama.cpp writes. Llama q/k rows are permuted as llama.cpp permutes them; Qwen2 files carry q/k/v biases and
no permutation. It returns, besides the path, the numpy oracle: every tensor under its Hugging Face name, in the
Hugging Face row order, holding exactly the values the file stores (dequantized), so a correct importer must
reproduce it bit for bit.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 256, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
CONTEXT, ROPE_THETA, RMS_EPS = 256, 10000.0, 1e-5
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2, as in SmolLM2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXT = (
    "Hello! How are you today? I am fine, thank you. What is 37*45? The quick brown fox jumps over the lazy dog. "
    "Paris is the capital of France. Numbers: 0 1 2 3 4 5 6 7 8 9 10 3.14159. Think first, then answer.\n"
)
# Types gguf.quants can quantize in numpy; K-quants it only dequantizes, so those blocks are made up (see below).
NUMPY_QUANTIZED = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
INTEGER_TYPES = {Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32}


@dataclass(frozen=True)
class TinyGGUF:
    path: Path
    arch: str
    tied: bool
    expected: dict[str, np.ndarray]  # Hugging Face name -> float32 values the file holds, in HF row order
    types: dict[str, Q]  # GGUF tensor name -> the type it was written in


def tiny_vocabulary() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """31 tokens and one merge: a file with few metadata entries, quick to read (for the corruption tests)."""
    return (*SPECIAL_TOKENS, *"abcdefghijklmnopqrstuvwxyz", "\u0120", "ab"), ("a b",)


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens in id order, merges as "a b") of a ~320-token byte-level BPE trained on TEXT, specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TEXT] * 4, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = tuple(sorted(vocab, key=vocab.__getitem__))
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = tuple(m if isinstance(m, str) else " ".join(m) for m in model["merges"])
    return tokens, merges


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): Hugging Face halves -> interleaved pairs."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `permute`, computed from where `permute` sends each row index (independent of the importer)."""
    source = permute(np.arange(weights.shape[0]), heads)  # permuted[i] == original[source[i]]
    original = np.empty_like(weights)
    original[source] = weights
    return original


def _made_up_kquant(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small, finite f16 scales (random bytes there would give inf/NaN weights)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)

    def scales(n: int) -> np.ndarray:
        return rng.uniform(0.001, 0.004, size=(rows, cols // block_elems, n)).astype(np.float16).view(np.uint8)

    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin first
        blocks[..., 0:4] = scales(2)
    else:  # Q6_K: d last
        blocks[..., -2:] = scales(1)
    return blocks.reshape(rows, -1)


def _encode(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what to hand GGUFWriter.add_tensor, the float32 values the file then holds; NaN where the importer is
    expected to refuse the type)."""
    if qtype in INTEGER_TYPES:
        data = (values * 100).astype(INTEGER_TYPES[qtype])
        return data, np.full(values.shape, np.nan, dtype=np.float32)
    if qtype not in (Q.F32, Q.F16, Q.BF16, *NUMPY_QUANTIZED, *K_QUANTS):  # other block types: random bytes
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(
            0, 256, size=(values.shape[0], values.shape[1] // block_elems * block_bytes), dtype=np.uint8
        )
        return data, np.full(values.shape, np.nan, dtype=np.float32)
    if qtype == Q.F32:
        data = values.astype(np.float32)
    elif qtype == Q.F16:
        data = values.astype(np.float16)
    elif qtype in K_QUANTS:
        data = _made_up_kquant(values.shape[0], values.shape[1], qtype, rng)
    else:  # BF16 and the numpy-quantizable block types
        data = gguf.quantize(values.astype(np.float32), qtype)
    stored = data.astype(np.float32) if qtype in (Q.F32, Q.F16) else gguf.dequantize(data, qtype)
    return data, stored.reshape(values.shape).astype(np.float32)


_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    weight_type: Q = Q.F32,
    types: Mapping[str, Q] | None = None,
    tied: bool = True,
    seed: int = 0,
    general_architecture: str | None = None,
    omit: frozenset[str] | set[str] = frozenset(),
    override: Mapping[str, tuple[Any, gguf.GGUFValueType]] | None = None,
    tiny_vocab: bool = False,
) -> TinyGGUF:
    """Write a tiny random model. `weight_type` is the type of every 2-D weight; `types` overrides it per tensor
    (keys: GGUF names, or a block-tensor suffix such as "ffn_down.weight" for every layer). Norms and biases are F32,
    as llama.cpp writes them. `general_architecture` replaces the architecture string (the key prefix stays `arch`);
    `omit` drops metadata keys (full names, `{arch}` expanded) and `override` writes keys with a raw value/type.
    `tiny_vocab` swaps the trained BPE for a 31-token one."""
    rng = np.random.default_rng(seed)
    tokens, merges = tiny_vocabulary() if tiny_vocab else vocabulary()
    vocab = len(tokens)
    types = dict(types or {})
    writer = gguf.GGUFWriter(path, general_architecture or arch)
    override = {key.replace("{arch}", arch): value for key, value in (override or {}).items()}
    omit = {key.replace("{arch}", arch) for key in omit}

    def kv(key: str, value: Any, vtype: gguf.GGUFValueType, sub: gguf.GGUFValueType | None = None) -> None:
        key = key.replace("{arch}", arch)
        if key in omit or key in override:
            return
        writer.add_key_value(key, value, vtype, sub_type=sub)

    V = gguf.GGUFValueType
    kv("general.name", "tiny", V.STRING)
    kv("{arch}.block_count", LAYERS, V.UINT32)
    kv("{arch}.context_length", CONTEXT, V.UINT32)
    kv("{arch}.embedding_length", HIDDEN, V.UINT32)
    kv("{arch}.feed_forward_length", INTERMEDIATE, V.UINT32)
    kv("{arch}.attention.head_count", HEADS, V.UINT32)
    kv("{arch}.attention.head_count_kv", KV_HEADS, V.UINT32)
    kv("{arch}.rope.freq_base", ROPE_THETA, V.FLOAT32)
    kv("{arch}.attention.layer_norm_rms_epsilon", RMS_EPS, V.FLOAT32)
    kv("general.file_type", 0, V.UINT32)
    kv("tokenizer.ggml.model", "gpt2", V.STRING)
    kv("tokenizer.ggml.pre", "qwen2" if arch == "qwen2" else "smollm", V.STRING)
    kv("tokenizer.ggml.tokens", list(tokens), V.ARRAY, V.STRING)
    kv("tokenizer.ggml.token_type", [3 if t in SPECIAL_TOKENS else 1 for t in tokens], V.ARRAY, V.INT32)
    kv("tokenizer.ggml.merges", list(merges), V.ARRAY, V.STRING)
    kv("tokenizer.ggml.bos_token_id", 1, V.UINT32)
    kv("tokenizer.ggml.eos_token_id", 2, V.UINT32)
    kv("tokenizer.ggml.padding_token_id", 2, V.UINT32)
    kv("tokenizer.chat_template", CHAT_TEMPLATE, V.STRING)
    for key, (value, vtype) in override.items():
        writer.add_key_value(key, value, vtype)

    expected: dict[str, np.ndarray] = {}
    written: dict[str, Q] = {}

    def tensor(name: str, values: np.ndarray, *, heads: int | None = None) -> None:
        block = name.split(".", 2)[-1]
        layer = name.split(".")[1] if name.startswith("blk.") else None
        hf = _TOP_NAMES[name] if layer is None else f"model.layers.{layer}.{_TENSOR_NAMES[block]}"
        qtype = types.get(name, types.get(block, weight_type if values.ndim == 2 else Q.F32))
        if heads is not None:  # a Llama q/k projection: stored permuted
            values = permute(values, heads)
        data, stored = _encode(values, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16, *INTEGER_TYPES) else qtype)
        expected[hf] = unpermute(stored, heads) if heads is not None else stored
        written[name] = qtype

    def weight(rows: int, cols: int, scale: float = 0.08) -> np.ndarray:
        return rng.normal(0.0, scale, size=(rows, cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return rng.uniform(0.8, 1.2, size=HIDDEN).astype(np.float32)

    llama, kv_rows = arch == "llama", KV_HEADS * HEAD_DIM
    tensor("token_embd.weight", weight(vocab, HIDDEN, 0.5))
    for layer in range(LAYERS):
        blk = f"blk.{layer}."
        tensor(blk + "attn_norm.weight", norm())
        tensor(blk + "attn_q.weight", weight(HIDDEN, HIDDEN), heads=HEADS if llama else None)
        tensor(blk + "attn_k.weight", weight(kv_rows, HIDDEN), heads=KV_HEADS if llama else None)
        tensor(blk + "attn_v.weight", weight(kv_rows, HIDDEN))
        if not llama:
            for part, rows in (("q", HIDDEN), ("k", kv_rows), ("v", kv_rows)):
                tensor(blk + f"attn_{part}.bias", rng.normal(0.0, 0.3, size=rows).astype(np.float32))
        tensor(blk + "attn_output.weight", weight(HIDDEN, HIDDEN))
        tensor(blk + "ffn_norm.weight", norm())
        tensor(blk + "ffn_gate.weight", weight(INTERMEDIATE, HIDDEN))
        tensor(blk + "ffn_up.weight", weight(INTERMEDIATE, HIDDEN))
        tensor(blk + "ffn_down.weight", weight(HIDDEN, INTERMEDIATE))
    tensor("output_norm.weight", norm())
    if not tied:
        tensor("output.weight", weight(vocab, HIDDEN))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(Path(path), arch, tied, expected, written)
