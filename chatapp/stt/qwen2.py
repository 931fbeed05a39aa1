"""Qwen2's norm, MLP and rotary embedding, the same maths as `transformers.models.qwen2.modeling_qwen2`.

They are written here, not imported, because importing transformers' modeling code costs about 2.4 s and 110 MB of
every command's start-up, for three small modules. Their names, parameters and arithmetic (the order of every
product and every cast) are transformers', so a Qwen2 state dict loads unchanged and the logits equal
`Qwen2ForCausalLM`'s on the same weights: `tests/stt/test_inference.py` compares them, and the tests are where
transformers is imported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chatapp.stt.config import STTConfig


class RMSNorm(nn.Module):
    """Qwen2RMSNorm: normalized in float32, scaled by the weight after the cast back to the input's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class MLP(nn.Module):
    """Qwen2MLP: SwiGLU, down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, config: STTConfig) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def inverse_frequencies(config: STTConfig) -> torch.Tensor:
    """The default rotary embedding's inverse frequencies (head_dim / 2 of them), in float32."""
    dim = config.head_width
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()  # real even inside a meta-device build
    return 1.0 / (config.rope_theta ** (steps / dim))


class RotaryEmbedding(nn.Module):
    """Qwen2RotaryEmbedding (default rope type): (cos, sin) for absolute positions, in the input's dtype.

    `inv_freq` is a buffer that is not saved (as in transformers): a model built on the meta device gets it back
    from `reset_inv_freq`, since nothing in a checkpoint holds it."""

    def __init__(self, config: STTConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)

    def reset_inv_freq(self, device: torch.device | str = "cpu") -> None:
        self.inv_freq = inverse_frequencies(self.config).to(device)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q` and `k` by (cos, sin); `unsqueeze_dim` is their head axis (2 for (B, S, H, D))."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
