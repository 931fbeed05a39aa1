"""Weight formats for inference: float32, bfloat16, and int8 weight-only with per-output-channel scales.

On a CPU a decode step of a model that does not fit in the cache is a stream of weight reads: every projection
is a matrix-vector product whose time is the bytes of its weight over the memory bandwidth. Halving the bytes
(bfloat16) or quartering them (int8) is the one large speed-up there. The format is applied once, when the model
is loaded (`prepare_weights`); nothing is converted per step.

- "float32": the checkpoint as trained; exact (matches transformers' Qwen2 on the same weights).
- "bfloat16": weights, activations and the KV cache in bfloat16; norms and softmax accumulate in float32.
- "int8": the decoder's projections and the LM head hold int8 weights with one float scale per output channel
  (symmetric, round to nearest; `w ~= q * scale`), run by torch's own weight-only kernel
  (`torch._weight_int8pack_mm`, activations in bfloat16). Everything else (embeddings, norms, routers, the KV
  cache) is bfloat16. Prefill-sized inputs (more than `DEQUANT_ROWS` rows) dequantize the weight to bfloat16 and
  run a plain matrix product instead: there the product is compute-bound and the weight-only kernel is slower.

`auto` picks per device (see `default_format`): measured in benchmarks/cpu_decode.py and recorded in the README.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chatapp.errors import ChatappError

FORMATS = ("float32", "bfloat16", "int8")
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "q8": "int8", "int8": "int8"}

# Above this many rows (tokens x batch) an int8 projection dequantizes and runs a dense bfloat16 product.
DEQUANT_ROWS = 48

# A model whose float32 weights exceed this is bound by weight reads at decode on a CPU; below it the weights
# stay in the CPU's caches and float32 is as fast as int8 (and exact).
CPU_INT8_MIN_BYTES = 64 * 2**20


class WeightFormatError(ChatappError):
    """An unknown weight format was asked for."""


def parse_format(name: str | None) -> str | None:
    """The canonical format name for a user's `--dtype` value; None and "auto" mean "pick per device"."""
    if name is None or name == "auto":
        return None
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise WeightFormatError(
            f"unknown weight format {name!r}", hint=f"use one of: auto, {', '.join(FORMATS)} (or fp32, bf16)"
        )
    return key


def default_format(device: torch.device, num_parameters: int) -> str:
    """On a CPU int8 for a model too large for its caches, float32 for a small one; float32 elsewhere (CUDA has not
    been measured yet)."""
    if device.type != "cpu":
        return "float32"
    return "int8" if num_parameters * 4 > CPU_INT8_MIN_BYTES else "float32"


def activation_dtype(fmt: str) -> torch.dtype:
    """The dtype of activations and of the KV cache under a weight format."""
    return torch.float32 if fmt == "float32" else torch.bfloat16


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (N, K), scales (N,)): symmetric per-row quantization of a (N, K) weight, w ~= q * scales[:, None].

    The scale is rounded to `scale_dtype` before the weights are divided by it, so the rounding of the scale is
    part of the quantization, not an extra error on top of it.
    """
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(scale_dtype)
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


class Int8Linear(nn.Module):
    """A weight-only int8 `nn.Linear` (see the module docstring): int8 weight, per-output-channel scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        q, scales = quantize_int8(weight, dtype)
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16) -> Int8Linear:
        return cls(linear.weight, linear.bias, dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (N, K): for code that reads `.weight` of a projection; costs a conversion."""
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] > DEQUANT_ROWS or x2.device.type != "cpu":
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        out = torch._weight_int8pack_mm(x2.to(self.scales.dtype), self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepare_weights(model: nn.Module, fmt: str) -> nn.Module:
    """Put an STTForCausalLM's weights in format `fmt` in place (once, at load) and return it.

    Int8 replaces the q/k/v/o and MLP projections of every layer and the LM head (a tied head gets its own int8
    copy; the embedding table stays bfloat16, since a lookup only reads one row). Routers, the TPN and norms are
    left in bfloat16: they are small, and the causal router's threshold decides which tokens run.
    """
    fmt = parse_format(fmt) or "float32"
    model.to(dtype=activation_dtype(fmt))
    if fmt == "int8":
        dtype = torch.bfloat16
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(parent, name, Int8Linear.from_linear(child, dtype))
        model.lm_head = Int8Linear.from_linear(model.lm_head, dtype)
    model.weight_format = fmt
    return model


def weight_format(model: nn.Module) -> str:
    """The format a model's weights are in (float32 or bfloat16 for a model never passed to `prepare_weights`)."""
    fmt = getattr(model, "weight_format", None)
    if fmt is not None:
        return fmt
    return "bfloat16" if model.model.embed_tokens.weight.dtype == torch.bfloat16 else "float32"
