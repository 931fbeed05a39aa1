"""The tokenizer a GGUF file describes, rebuilt from its metadata as a `tokenizers` tokenizer.

A GGUF file carries no `tokenizer.json`: the vocabulary, the merges, the special token ids and the chat template
are metadata keys (`tokenizer.ggml.*`). Byte-level BPE vocabularies (`tokenizer.ggml.model = gpt2`: SmolLM, Llama 3,
Qwen2, the default model among them) are built here with `tokenizers` alone, the way transformers'
`from_pretrained(gguf_file=...)` builds them, token for token (a test compares the two). Building them here rather
than through transformers' GGUF helpers keeps preparation independent of those helpers, which are private and were
renamed within 5.x (5.17 has no `convert_gguf_tokenizer`, which 5.24 has), and keeps transformers out of the
default model's preparation. Sentencepiece vocabularies (`llama`: Llama 2, TinyLlama) need merges recovered from
token scores; they go through transformers' public `AutoTokenizer.from_pretrained(gguf_file=...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatapp.byte_level import char_for_byte

# llama.cpp's token types (`tokenizer.ggml.token_type`).
CONTROL = 3  # special tokens such as <|im_start|>: matched whole, skipped when decoding with skip_special_tokens
USER_DEFINED = 4  # added tokens such as <think>: matched whole, not special

# How text is split before the merges apply, by `tokenizer.ggml.pre`: the splits of the vocabularies a Llama or
# Qwen2 file can carry. Any other value (`gpt2`, `smollm`, ...) gets GPT-2's own split (ByteLevel's regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (  # Mistral NeMo: a Llama-architecture file
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
# What tokenizer_config.json keeps of the metadata (the rest the runtime does not read).
CONFIG_KEYS = ("chat_template", "bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token", "add_eos_token")


@dataclass(frozen=True)
class GGUFTokenizer:
    """The files a model directory needs for its tokenizer: `tokenizer.json` and the fields of the config."""

    json: str
    config: dict[str, Any]
    size: int  # tokens, the added ones included: at most the model's vocabulary


class TokenizerError(ValueError):
    """The metadata describes a tokenizer that cannot be built (the caller names the file)."""


def build_tokenizer(field: Callable[[str], Any], path: Path) -> GGUFTokenizer:
    """The tokenizer of the GGUF file at `path`, whose metadata `field(key)` reads (None when absent)."""
    kind = field("tokenizer.ggml.model")
    tokens = list(field("tokenizer.ggml.tokens") or ())
    if not tokens:
        raise TokenizerError("the file lists no tokens (tokenizer.ggml.tokens)")
    config = _config(field, tokens, sentencepiece=kind == "llama")
    if kind == "gpt2":
        tokenizer = _byte_level(field, tokens, config)
    elif kind == "llama":
        tokenizer = _sentencepiece(path)
    else:
        raise TokenizerError(f"tokenizer.ggml.model is {kind!r}; chatapp reads 'gpt2' (byte-level BPE) and 'llama'")
    kept = {k: config[k] for k in CONFIG_KEYS if config.get(k) is not None}
    return GGUFTokenizer(tokenizer.to_str(), kept, tokenizer.get_vocab_size(with_added_tokens=True))


def _config(field: Callable[[str], Any], tokens: list[str], *, sentencepiece: bool) -> dict[str, Any]:
    def token(key: str) -> str | None:
        index = field(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise TokenizerError(f"tokenizer.ggml.{key} is {index}, outside the {len(tokens)} tokens")
        return tokens[int(index)]

    add_bos = field("tokenizer.ggml.add_bos_token")
    if add_bos is None and sentencepiece:  # older files say nothing, and llama.cpp adds BOS to such vocabularies
        add_bos = True
    return {
        "chat_template": field("tokenizer.chat_template"),
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": None if add_bos is None else bool(add_bos),
        "add_eos_token": None
        if field("tokenizer.ggml.add_eos_token") is None
        else bool(field("tokenizer.ggml.add_eos_token")),
    }


def _byte_level(field: Callable[[str], Any], tokens: list[str], config: dict[str, Any]) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = char_for_byte()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet is a llama.cpp mislabel of a raw string: spell its UTF-8 bytes.
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {t: index for index, t in enumerate(spelled)}
    merges = [tuple(merge.split(" ")) for merge in field("tokenizer.ggml.merges") or ()]
    try:
        tokenizer = Tokenizer(models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix=""))
    except Exception as err:  # tokenizers raises a bare Exception for a merge naming a token not in the vocabulary
        raise TokenizerError(f"the merges do not fit the vocabulary ({err})") from None
    split = PRE_TOKENIZER_SPLITS.get(field("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()

    types = list(field("tokenizer.ggml.token_type") or ())
    # Control tokens spelled outside the byte alphabet are mislabels too; adding them would grow the vocabulary.
    tokenizer.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, types, strict=False)
            if kind == CONTROL and set(t) <= alphabet
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == USER_DEFINED and t in vocab
        ]
    )
    tokenizer.post_processor = _template(config, vocab)
    return tokenizer


def _template(config: dict[str, Any], vocab: dict[str, int]) -> Any:
    """BOS/EOS around each sequence where the file asks for them, as transformers' tokenizers add them."""
    from tokenizers import processors

    bos = config["bos_token"] if config.get("add_bos_token") else None
    eos = config["eos_token"] if config.get("add_eos_token") else None

    def sequence(name: str, type_id: int) -> list[str]:
        return [*([f"{bos}:{type_id}"] if bos else []), f"${name}:{type_id}", *([f"{eos}:{type_id}"] if eos else [])]

    specials = [(t, vocab[t]) for t in dict.fromkeys(t for t in (bos, eos) if t) if t in vocab]
    return processors.TemplateProcessing(
        single=" ".join(sequence("A", 0)), pair=" ".join(sequence("A", 0) + sequence("B", 1)), special_tokens=specials
    )


def _sentencepiece(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).backend_tokenizer
    except Exception as err:  # transformers and tokenizers raise assorted types (a bare Exception among them)
        raise TokenizerError(f"{type(err).__name__}: {err}") from None
