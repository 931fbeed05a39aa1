"""Weight formats for inference: float32, bfloat16, int8 weight-only with per-output-channel scales, and int4
weight-only in groups.

On a CPU a decode step of a model that does not fit in the cache is a stream of weight reads: every projection
is a matrix-vector product whose time is the bytes of its weight over the memory bandwidth. Halving the bytes
(bfloat16) or quartering them (int8) is the one large speed-up there. The format is applied once, when the model
is loaded (`prepare_weights`); nothing is converted per step.

- "float32": the checkpoint as trained; exact (matches transformers' Qwen2 on the same weights).
- "bfloat16": weights and activations in bfloat16; norms and softmax accumulate in float32.
- "int8": the decoder's projections and the LM head hold int8 weights with one float scale per output channel
  (symmetric, round to nearest; `w ~= q * scale`), run by torch's own weight-only kernel
  (`torch._weight_int8pack_mm`, activations in bfloat16). Embeddings and norms are bfloat16. Prefill-sized inputs (more than `DEQUANT_ROWS` rows) dequantize the weight to bfloat16 and
  run a plain matrix product instead: there the product is compute-bound and the weight-only kernel is slower.
- "int4": the projections hold 4-bit weights in groups of `INT4_GROUP` input channels, each group with its own
  scale and offset (asymmetric, the layout of llama.cpp's Q4_1, which is what the default model's GGUF ships), run
  by torch's CPU int4 kernel (`torch._weight_int4pack_mm_for_cpu`) at decode sizes. That kernel packs the nibbles
  in a layout of its own that differs per CPU, so each projection also keeps the same 4-bit levels two to a byte in
  plain row order (half a byte per weight more): prefill-sized inputs (more than `INT4_DEQUANT_ROWS` rows)
  dequantize those to bfloat16 and run a plain matrix product, where the kernel would take twice as long. Both
  paths compute with the same levels, scales and offsets. The LM head stays int8 (see `prepare_weights`).
  Adapters merged into the weights are taken back out and run beside the 4-bit base (`LowRankLinear`): that is what
  keeps the default model within the quality guard (greedy agreement with float32 97.9%; quantizing the merged
  weights gave 85.7% and perplexity -14%). A projection of a shape the kernel does not take (see
  `Int4Linear.fits`) stays in bfloat16.

The quantized formats fuse q/k/v and gate/up into one projection each (`fuse_projections`); an STT layer keeps a
k/v-only copy beside its fused q/k/v, for the tokens it skips in "kv" mode (`add_kv_projections`).
Under every format the causal routers stay float32 (see `prepare_weights`), and on a CPU the KV cache is float32
(`STTForCausalLM.kv_dtype`).

`auto` picks per device (see `default_format`): measured by benchmarks/cpu_decode.py, whose latest tables are in
docs/benchmarks.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from chatapp.validation import WeightFormatError, parse_format

# Above this many rows (tokens x batch) an int8 projection dequantizes and runs a dense bfloat16 product.
DEQUANT_ROWS = 48

# Input channels per int4 scale/offset pair: Q4_1's block size.
INT4_GROUP = 32

# Above this many rows an int4 projection dequantizes and runs a dense bfloat16 product. Measured on the default
# model (2-core EPYC): the kernel is ahead up to ~128 rows (a dequantization costs about as much as 100 rows of
# the kernel) and takes 1.9x the dense product's time at 1,000.
INT4_DEQUANT_ROWS = 128

# A model whose float32 weights exceed this is bound by weight reads at decode on a CPU; below it the weights
# stay in the CPU's caches and float32 is as fast as a quantized format (and exact).
CPU_QUANTIZE_MIN_BYTES = 64 * 2**20


def fits_in_cache(num_parameters: int) -> bool:
    """Whether a model of `num_parameters` keeps its float32 weights in a CPU's caches: then decode is bound by
    dispatch, not by weight reads, which decides its format (`default_format`) and thread count
    (`chatapp.models.loader.configure_threads`)."""
    return num_parameters * 4 <= CPU_QUANTIZE_MIN_BYTES


def default_format(device: torch.device, num_parameters: int) -> str:
    """On a CPU int8 for a model too large for its caches, float32 for a small one; float32 elsewhere (CUDA has not
    been measured yet). int8 because its decode step runs as one native call (`stt.cpu_step`) on any CPU, with nothing
    to compile, and on the CPU measured decodes faster than every other format's step, compiled or not, within the
    quality guard (the rates and the guard: docs/benchmarks.md, "cpu_decode.py"; the kernel: docs/cpu-kernel.md).
    int4 stays a choice (`--dtype int4`): eager, it is the torch step's fastest format at batch 1."""
    if device.type != "cpu" or fits_in_cache(num_parameters):
        return "float32"
    return "int8"


@functools.cache
def _fast_bfloat16_products() -> bool:
    return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())


def product_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a dequantized (prefill-sized) product runs in: the activations' own, except bfloat16 on a CPU
    whose oneDNN has no fast bfloat16 products (no AVX-512): there float32's. On a 2-core AVX2 EPYC a (128 x 576) x
    (576 x 3072) product took 36.9 ms in bfloat16 and 4.3 ms in float32, which took the default model's prefill of a
    128-token prompt from ~1.6 s to ~0.3 s; float32 is also the closer to the weights."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or _fast_bfloat16_products():
        return x.dtype
    return torch.float32


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

    def rows(self, index: torch.Tensor) -> Int8Linear:
        """A projection computing only outputs `index` (1-D), with the same int8 weights and scales."""
        part = Int8Linear.__new__(Int8Linear)
        nn.Module.__init__(part)
        part.out_features, part.in_features = len(index), self.in_features
        part.register_buffer("weight_int8", self.weight_int8[index].contiguous())
        part.register_buffer("scales", self.scales[index].contiguous())
        part.register_buffer("bias", None if self.bias is None else self.bias[index].contiguous())
        return part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] > DEQUANT_ROWS or x2.device.type != "cpu":
            dtype = product_dtype(x)
            weight = self.weight_int8.to(dtype) * self.scales.to(dtype)[:, None]
            return F.linear(x.to(dtype), weight, None if self.bias is None else self.bias.to(dtype)).to(x.dtype)
        out = torch._weight_int8pack_mm(x2.to(self.scales.dtype), self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_int4(weight: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 (N, K) in [0, 15], scales_and_zeros (K / group, N, 2)): asymmetric round-to-nearest per group of
    `group` input channels, in the layout of torch's int4 kernels: w ~= (q - 8) * scale + zero.

    Each group's range [min, max] maps onto the 16 levels; the scale and offset are rounded to `dtype` first, so
    their rounding is part of the quantization. (Clipping each group's range by the factor of least squared
    error, llama.cpp's k-quant idea on one axis, moved the default model's greedy agreement by 0.2 points: not
    worth its code.)
    """
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low) / 15).clamp_min(1e-12).to(dtype).float()
    zeros = (low + 8 * scales).to(dtype).float()  # the value of level 8, the kernel's midpoint
    q = torch.round((w - zeros[..., None]) / scales[..., None] + 8).clamp_(0, 15).to(torch.int32).reshape(n, k)
    scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).to(dtype).contiguous()
    return q, scales_and_zeros


class Int4Linear(nn.Module):
    """A weight-only int4 `nn.Linear` in groups (see the module docstring). CPU only: the packed layout is the CPU
    kernel's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = INT4_GROUP) -> None:
        super().__init__()
        q, scales_and_zeros = quantize_int4(weight, group, torch.bfloat16)
        self._hold(q, scales_and_zeros, None if bias is None else bias.detach().to(torch.bfloat16).clone(), group)

    def _hold(self, q: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None, group: int) -> None:
        """Keep levels `q` (N, K int32 in [0, 15]) with their scales and offsets in the kernel's layouts."""
        self.out_features, self.in_features = q.shape
        self.group = group
        self.register_buffer("weight_int4", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        # The same levels two to a byte, in row order (even input channel in the low nibble): for `dequantized`.
        pairs = q.to(torch.uint8).view(self.out_features, -1, 2)
        self.register_buffer("weight_nibbles", (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous())
        self.register_buffer("bias", bias)

    def rows(self, index: torch.Tensor) -> Int4Linear | None:
        """A projection computing only outputs `index` (1-D), from the same levels, scales and offsets (no second
        rounding), or None when the kernel does not take that many outputs (a multiple of 16)."""
        if len(index) % 16:
            return None
        nibbles = self.weight_nibbles[index]
        q = torch.stack((nibbles & 15, nibbles >> 4), dim=-1).view(len(index), -1).to(torch.int32)
        part = Int4Linear.__new__(Int4Linear)
        nn.Module.__init__(part)
        bias = None if self.bias is None else self.bias[index].contiguous()
        part._hold(q, self.scales_and_zeros[:, index].contiguous(), bias, self.group)
        return part

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int = INT4_GROUP) -> Int4Linear:
        return cls(linear.weight, linear.bias, group)

    @staticmethod
    def fits(linear: nn.Linear, group: int = INT4_GROUP, extra_rows: int = 0) -> bool:
        """Whether the kernel takes this projection's shape, with `extra_rows` more outputs (input width a multiple
        of the group, output width a multiple of 16)."""
        return linear.in_features % group == 0 and (linear.out_features + extra_rows) % 16 == 0

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight (N, K) the kernel computes with, q * scale + (offset - 8 * scale), worked out in float32 and
        returned in `dtype` (equal to the kernel's own, tests/stt/test_weights.py)."""
        nibbles = self.weight_nibbles
        # Levels spread into a bfloat16 buffer (exact for 0..15): two strided stores cost less than building a
        # uint8 pair tensor and converting it, and float32 arithmetic from there is faster than bfloat16's.
        levels = torch.empty(*nibbles.shape, 2, dtype=torch.bfloat16, device=nibbles.device)
        levels[..., 0] = nibbles & 15
        levels[..., 1] = nibbles >> 4
        scales, zeros = self.scales_and_zeros.float().permute(1, 0, 2).unsqueeze(-2).unbind(-1)  # (N, K/g, 1) each
        weight = levels.view(self.out_features, -1, self.group).float().mul_(scales).add_(zeros - 8 * scales)
        return weight.view(self.out_features, self.in_features).to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (N, K) in float32: for code that reads `.weight` of a projection."""
        return self.dequantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.scales_and_zeros.dtype)
        if x2.shape[0] > INT4_DEQUANT_ROWS:
            dtype = product_dtype(x2)
            bias = None if self.bias is None else self.bias.to(dtype)
            out = F.linear(x2.to(dtype), self.dequantized(dtype), bias).to(x2.dtype)
        else:
            out = torch._weight_int4pack_mm_for_cpu(x2, self.weight_int4, self.group, self.scales_and_zeros)
            if self.bias is not None:
                out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


Adapter = tuple[torch.Tensor, torch.Tensor]  # (A (r, in), B (out, r)): W = W_base + B @ A


class LowRankLinear(nn.Module):
    """An int4 projection with a low-rank adapter beside it: `W_base x + B (A x)` (QLoRA's split).

    An adapter trained on a 4-bit base and merged into it moves the weights off the base's 4-bit grid, and
    quantizing the merged weights again adds a second rounding on top of the first. Kept apart, the base
    re-quantizes onto its own grid (for a Q4_1 GGUF source, the same levels: see `prepare_weights`) and only the
    adapter's small update is rounded. A's rows ride in the base's kernel call, below W_base's (r more output rows:
    one call gives W_base x and A x), so the adapter costs one small float32 product, B (A x): at batch 1 a
    separate call per factor cost more than the 4-bit weights saved.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.rank = lora_a.shape[0]
        if bias is not None:
            bias = torch.cat((bias.detach(), bias.new_zeros(self.rank)))
        self.base = Int4Linear(torch.cat((weight.detach().float(), lora_a.detach().float())), bias)
        self.register_buffer("lora_B_t", lora_b.detach().float().t().contiguous())  # (r, out)

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight (N, K): base plus adapter, dequantized, in float32."""
        both = self.base.weight.float()
        return both[: self.out_features] + self.lora_B_t.t() @ both[self.out_features :]

    def rows(self, index: torch.Tensor) -> LowRankLinear | None:
        """A projection computing only outputs `index` (1-D): the base's rows with all of A's (a fused projection's
        adapter is block-diagonal, so the rows of another output's adapter meet zeros in B), or None when the int4
        kernel does not take that many outputs."""
        rank_rows = torch.arange(self.out_features, self.out_features + self.rank, device=index.device)
        base = self.base.rows(torch.cat((index, rank_rows)))
        if base is None:
            return None
        part = LowRankLinear.__new__(LowRankLinear)
        nn.Module.__init__(part)
        part.out_features, part.in_features, part.rank = len(index), self.in_features, self.rank
        part.base = base
        part.register_buffer("lora_B_t", self.lora_B_t[:, index].contiguous())
        return part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.numel() // shape[-1] > INT4_DEQUANT_ROWS:
            # Prefill sizes: the adapter merged into the dequantized weight (one more small product per call)
            # rather than carried through every row (a split, a float32 product and a sum the size of the output).
            both = self.base.dequantized()
            weight = both[: self.out_features].addmm_(self.lora_B_t.t(), both[self.out_features :])
            bias = None if self.base.bias is None else self.base.bias[: self.out_features]
            dtype = self.base.scales_and_zeros.dtype  # the activations' dtype, as on the kernel's path
            product = product_dtype(x.to(dtype))
            bias = None if bias is None else bias.to(product)
            return F.linear(x.to(product), weight.to(product), bias).to(dtype)
        out, low = self.base(x).split((self.out_features, self.rank), dim=-1)
        delta = torch.mm(low.reshape(-1, self.rank).float(), self.lora_B_t)
        return out + delta.view(out.shape).to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


def quantized(linear: nn.Linear, fmt: str, adapter: Adapter | None = None) -> nn.Module:
    """`linear` in weight-only format `fmt` ("int8" or "int4"; an int4-incompatible shape stays as it is).

    `adapter` (A, B): a low-rank update already merged into `linear`'s weight. Under int4 it is taken back out, the
    base is quantized alone, and the adapter runs beside it (`LowRankLinear`); int8's finer grid takes the merged
    weight as it is."""
    if fmt == "int8":
        return Int8Linear.from_linear(linear, torch.bfloat16)
    if not Int4Linear.fits(linear):
        return linear
    if adapter is None or not Int4Linear.fits(linear, extra_rows=adapter[0].shape[0]):
        return Int4Linear.from_linear(linear)
    a, b = (t.to(linear.weight.device, torch.float32) for t in adapter)
    return LowRankLinear(linear.weight.detach().float() - b @ a, linear.bias, a, b)


def _fused(linears: list[nn.Linear], adapters: list[Adapter | None]) -> tuple[nn.Linear, Adapter | None]:
    """One projection computing `linears` side by side (their rows stacked), and its adapter: the adapters' A
    stacked and their B block-diagonal, so each output still sees only its own adapter."""
    weight = torch.cat([m.weight.detach() for m in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None, device=weight.device)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([m.bias.detach() for m in linears]))
    if all(a is None for a in adapters):
        return fused, None
    pairs = [
        a if a is not None else (weight.new_zeros(0, m.in_features), weight.new_zeros(m.out_features, 0))
        for m, a in zip(linears, adapters, strict=True)
    ]
    return fused, (torch.cat([a for a, _ in pairs]), torch.block_diag(*[b for _, b in pairs]))


def fuse_projections(model: nn.Module, adapters: dict[str, Adapter] | None = None) -> dict[str, Adapter]:
    """Merge each layer's q/k/v projections into one `qkv_proj` and the MLP's gate/up into one `gate_up_proj`
    (`layers.FusedMLP`), in place; returns `adapters` re-keyed for the fused modules.

    At batch 1 a weight-only kernel call costs more than its bytes (dispatch, threads, the input's conversion):
    seven calls a layer become four, and three adapters' side products become one (`LowRankLinear`)."""
    from chatapp.stt.layers import FusedMLP

    adapters = dict(adapters or {})
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}"
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None:
            names = ("q_proj", "k_proj", "v_proj")
            parts = [adapters.pop(f"{prefix}.self_attn.{n}", None) for n in names]
            attn.qkv_proj, adapter = _fused([getattr(attn, n) for n in names], parts)
            for name in names:
                delattr(attn, name)
            if adapter is not None:
                adapters[f"{prefix}.self_attn.qkv_proj"] = adapter
        if not isinstance(mlp, FusedMLP):
            parts = [adapters.pop(f"{prefix}.mlp.{n}", None) for n in ("gate_proj", "up_proj")]
            gate_up, adapter = _fused([mlp.gate_proj, mlp.up_proj], parts)
            layer.mlp = FusedMLP(gate_up, mlp.down_proj, mlp.gate_proj.out_features)
            if adapter is not None:
                adapters[f"{prefix}.mlp.gate_up_proj"] = adapter
    return adapters


def fuse_structure(model: nn.Module) -> None:
    """The module structure of `fuse_projections` without its weights: each layer's `qkv_proj` and the MLP's
    `gate_up_proj` are placeholders, for a stored model to put its fused projections in (`stt.served`)."""
    from chatapp.stt.layers import FusedMLP

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = nn.Identity()
        for name in ("q_proj", "k_proj", "v_proj"):
            delattr(attn, name)
        layer.mlp = FusedMLP(nn.Identity(), mlp.down_proj, mlp.gate_proj.out_features)


def output_rows(module: nn.Module, index: torch.Tensor) -> nn.Module | None:
    """A projection computing only outputs `index` of `module` (any kind `prepare_weights` makes), with the same
    weights, or None when its format cannot take that shape."""
    if isinstance(module, Int4Linear | Int8Linear | LowRankLinear):
        return module.rows(index)
    if isinstance(module, nn.Linear):
        part = nn.Linear(module.in_features, len(index), bias=module.bias is not None, device=module.weight.device)
        part.to(module.weight.dtype)
        with torch.no_grad():
            part.weight.copy_(module.weight[index])
            if module.bias is not None:
                part.bias.copy_(module.bias[index])
        return part.requires_grad_(module.weight.requires_grad)
    return None


def add_kv_projections(model: nn.Module) -> None:
    """Give each STT layer's fused q/k/v projection a k/v-only copy (`Attention.kv_proj`), in place.

    A token an STT layer skips in "kv" mode stores its K and V and nothing else (`layers.kv_step`): with q/k/v fused,
    that took the whole fused product and dropped its query, 2.6x the k/v product's weights (SmolLM2-135M: q is
    576 of the 960 outputs) and, at batch 1 in int4, as much time as a third of the rest of the block. The copy
    holds the same levels, scales and adapter (no second rounding; 0.2 MB per layer of the default model in int4)."""
    for index in getattr(model.config, "stt_layers", None) or []:
        attn = model.model.layers[index].self_attn
        if attn.qkv_proj is None or attn.kv_proj is not None:
            continue
        query = attn.num_heads * attn.head_dim
        kv = torch.arange(query, query + 2 * attn.num_kv_heads * attn.head_dim, device=model.device)
        attn.kv_proj = output_rows(attn.qkv_proj, kv)


def prepare_weights(model: nn.Module, fmt: str, adapters: dict[str, Adapter] | None = None) -> nn.Module:
    """Put an STTForCausalLM's weights in format `fmt` in place (once, at load) and return it.

    Int8 and int4 replace the q/k/v/o and MLP projections of every layer and the LM head (a tied head gets its own
    quantized copy; the embedding table stays in the activations' dtype, since a lookup only reads one row).
    Quantization reads the float32 weights, before anything is rounded to bfloat16, and the quantized formats fuse
    q/k/v and gate/up first (`fuse_projections`). Under int4 the LM head is int8:
    on the default model a 4-bit head alone cost 9 points of greedy agreement with float32 (its GGUF ships the
    embeddings in Q8_0, so int8 keeps them nearly as they are). `adapters` (`stt.io.load_merged_adapters`) are the
    low-rank updates merged into the projections, which int4 runs apart (`quantized`).

    The causal routers stay float32 under every format: their threshold decides which tokens run, so they should
    decide as trained, and at their size (2D -> 64 -> 1) a float32 product on a CPU is several times faster than a
    bfloat16 one. So do the skip predictors ("predict" mode), for the same size reason and because the C step
    reads them in float32. So do the rotary embedding's frequencies (cos and sin are then rounded once, to the activations'
    dtype, as transformers does).
    """
    fmt = parse_format(fmt) or "float32"
    if fmt == "int4" and model.device.type != "cpu":
        raise WeightFormatError(
            f"the int4 format runs on the CPU only, not on {model.device.type}", hint="use --dtype int8 or bfloat16"
        )
    adapters = adapters or {}
    if fmt in ("int8", "int4"):
        adapters = fuse_projections(model, adapters)
        for index, layer in enumerate(model.model.layers):
            for part, parent in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        adapter = adapters.get(f"model.layers.{index}.{part}.{name}")
                        setattr(parent, name, quantized(child, fmt, adapter))
        model.lm_head = quantized(model.lm_head, "int8")
    # The routers and the adapters' B stay float32 under every format (see LowRankLinear): kept aside while the rest
    # is cast, so that they never pass through the activations' dtype.
    routers = [
        part
        for layer in model.model.layers
        for part in (getattr(layer, "causal_router", None), getattr(layer, "skip_predictor", None))
        if part is not None
    ]
    kept = [(router, {k: v.clone() for k, v in router.state_dict().items()}) for router in routers]
    low_rank = [(module, module.lora_B_t) for module in model.modules() if isinstance(module, LowRankLinear)]
    model.to(dtype=activation_dtype(fmt))
    # The rotary frequencies too: rounded to bfloat16 they are off by up to 2**-9 of themselves, a phase error that
    # grows with the position (radians by a few thousand tokens).
    model.model.rotary_emb.reset_inv_freq(model.device)
    for router, state in kept:
        router.float().load_state_dict(state)
    for module, lora_b in low_rank:
        module.lora_B_t = lora_b
    add_kv_projections(model)
    model.weight_format = fmt
    return model


def weight_format(model: nn.Module) -> str:
    """The format a model's weights are in (float32 or bfloat16 for a model never passed to `prepare_weights`)."""
    if model.weight_format is not None:
        return model.weight_format
    return "bfloat16" if model.model.embed_tokens.weight.dtype == torch.bfloat16 else "float32"
