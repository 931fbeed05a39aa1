"""Packed token bitmasks: bit `t % 32` of uint32 word `t // 32` says whether token `t` is allowed.

The layout is llguidance's and xgrammar's (little-endian 32-bit words), so a 150k vocabulary mask is 19 KB and
moves to the GPU in one small copy; `apply_token_bitmask` expands it there.
"""

from __future__ import annotations

import numpy as np
import torch


def mask_words(vocab_size: int) -> int:
    """Number of uint32 words that hold one bit per token."""
    return (vocab_size + 31) // 32


def empty_bitmask(vocab_size: int) -> np.ndarray:
    """A mask that allows nothing."""
    return np.zeros(mask_words(vocab_size), dtype=np.uint32)


def bitmask_from_bools(allowed: np.ndarray) -> np.ndarray:
    """Pack a boolean vector (one entry per token) into uint32 words."""
    padded = np.zeros(mask_words(len(allowed)) * 32, dtype=np.uint8)
    padded[: len(allowed)] = allowed
    return np.packbits(padded, bitorder="little").view("<u4").astype(np.uint32)


def bitmask_to_bools(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Unpack uint32 words into a boolean vector of length `vocab_size`."""
    as_bytes = np.ascontiguousarray(bitmask, dtype="<u4").view(np.uint8)
    return np.unpackbits(as_bytes, bitorder="little")[:vocab_size].astype(bool)


def allowed_ids(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set, ascending."""
    return np.flatnonzero(bitmask_to_bools(bitmask, vocab_size))


def set_bit(bitmask: np.ndarray, token: int) -> None:
    bitmask[token >> 5] |= np.uint32(1 << (token & 31))


def is_allowed(bitmask: np.ndarray, token: int) -> bool:
    return bool((int(bitmask[token >> 5]) >> (token & 31)) & 1)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    """`arange(32)` on `device`, cached so a decode step allocates nothing new for it."""
    if device not in _BIT_SHIFTS:
        _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return _BIT_SHIFTS[device]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Set `logits[b, t] = -inf` wherever bit `t` of row `b` is clear; in place, on the logits' device; returns logits.

    `logits` is `[B, V]` (or `[V]`); `bitmask` is `[B, W]` (or `[W]`) uint32/int32 words, a numpy array or a tensor
    on any device. Tokens past `32 * W` (a model head padded beyond the tokenizer) are disallowed. One broadcast
    shift-and-test over all rows: no Python loop over rows and no host synchronisation.
    """
    squeeze = logits.dim() == 1
    rows = logits.unsqueeze(0) if squeeze else logits
    if isinstance(bitmask, np.ndarray):
        words = np.ascontiguousarray(bitmask, dtype=np.uint32)
        if not words.flags.writeable:  # cached masks are read-only; torch.from_numpy wants writable memory
            words = words.copy()
        bitmask = torch.from_numpy(words.view(np.int32))
    words = bitmask.to(device=rows.device, dtype=torch.int32, non_blocking=True)
    if words.dim() == 1:
        words = words.unsqueeze(0)
    vocab = rows.shape[-1]
    bits = (words.unsqueeze(-1) >> _shifts(rows.device)) & 1
    allowed = bits.reshape(words.shape[0], -1).to(torch.bool)
    if allowed.shape[-1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    rows.masked_fill_(~allowed[:, :vocab], float("-inf"))
    return logits
