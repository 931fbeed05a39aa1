"""Realistic tokenizers trained offline on local text, for tests and benchmarks of the trie.

No registry ships a real LLM tokenizer and nothing here may touch the network, so vocabularies of realistic size
are trained with `tokenizers` on Python sources that every installation has: the standard library (about 11 MB
without its test suites: 32k merges in seconds) and, for the ~128k vocabulary, site-packages sources as well.
Trained tokenizers are cached as `tokenizer.json` files keyed by their parameters.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from chatapp.recipes.tiny.tokenizer import CHAT_SPECIAL_TOKENS, train_bpe_tokenizer
from chatapp.trie.token_bytes import gpt2_unicode_to_byte

_SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


def python_source_files(include_site_packages: bool = False) -> list[Path]:
    """The standard library's `.py` files (test suites excluded), optionally followed by site-packages' ones."""
    paths = sysconfig.get_paths()
    stdlib = Path(paths["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if not _SKIPPED_DIRS & set(p.relative_to(stdlib).parts))
    if include_site_packages:
        for root in dict.fromkeys((paths["purelib"], paths["platlib"])):
            files += sorted(Path(root).rglob("*.py"))
    return files


def python_source_texts(max_chars: int, include_site_packages: bool = False) -> Iterator[str]:
    """File contents in a fixed order until `max_chars` characters have been produced."""
    total = 0
    for path in python_source_files(include_site_packages):
        if total >= max_chars:
            return
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        yield text


def cached_source_tokenizer(
    cache_dir: Path,
    vocab_size: int,
    max_chars: int = 12_000_000,
    include_site_packages: bool = False,
    special_tokens: Sequence[str] = CHAT_SPECIAL_TOKENS,
) -> Tokenizer:
    """A byte-level BPE trained on local Python sources, loaded from `cache_dir` when trained before."""
    key = hashlib.sha256(repr((vocab_size, max_chars, include_site_packages, tuple(special_tokens))).encode())
    path = Path(cache_dir) / f"bpe-{vocab_size}-{key.hexdigest()[:12]}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    texts = python_source_texts(max_chars, include_site_packages)
    tokenizer = train_bpe_tokenizer(texts, vocab_size=vocab_size, special_tokens=tuple(special_tokens))
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


def train_byte_fallback_tokenizer(
    texts: Sequence[str], vocab_size: int, special_tokens: Sequence[str] = ()
) -> Tokenizer:
    """A SentencePiece-style BPE: metaspace `▁` words, and `<0xNN>` tokens for bytes outside the vocabulary.

    The `<0xNN>` tokens sit in the model vocabulary (ids 0..255, as in Llama), not among the added tokens, so
    they are ordinary tokens whose bytes are one raw byte.
    """
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, show_progress=False, min_frequency=2)
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.Metaspace()
    plain.train_from_iterator(texts, trainer=trainer)
    learned = plain.get_vocab()
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece, _ in sorted(learned.items(), key=lambda item: item[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [
        tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
        for m in json.loads(plain.to_str())["model"]["merges"]
    ]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    # Llama's decoder chain (llguidance recognises SentencePiece tokenizers by its `Replace("▁", " ")`).
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    if special_tokens:
        tokenizer.add_special_tokens(list(special_tokens))
    return tokenizer


def handmade_bpe(tokens: Sequence[str], special_tokens: Sequence[str] = ()) -> Tokenizer:
    """A byte-level BPE whose multi-byte tokens are `tokens` plus whatever intermediate merges build them.

    Tokens are added shortest first; each one is merged from the longest split into two existing tokens
    (`orderId` = `order` + `Id`), else grown one byte at a time from its prefix. No regex pre-split, so tokens
    may span punctuation (`_of`, `":`), as in real vocabularies.
    """
    char_for_byte = {b: ch for ch, b in gpt2_unicode_to_byte().items()}
    vocab = {char_for_byte[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []

    def add(piece: str) -> None:
        if piece in vocab:
            return
        splits = [k for k in range(len(piece) - 1, 0, -1) if piece[:k] in vocab and piece[k:] in vocab]
        if splits:
            merges.append((piece[: splits[0]], piece[splits[0] :]))
        else:
            add(piece[:-1])
            merges.append((piece[:-1], piece[-1]))
        vocab[piece] = len(vocab)

    for token in sorted(set(tokens), key=lambda t: (len(t.encode()), t)):
        add("".join(char_for_byte[b] for b in token.encode()))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    if special_tokens:
        tokenizer.add_special_tokens(list(special_tokens))
    return tokenizer
