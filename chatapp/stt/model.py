"""STTForCausalLM: a Qwen2-compatible decoder whose STT layers run their block only for routed tokens.

Inference (`extend` / `decode`) follows `docs/stt.md` §3.2: per STT layer the causal router gives each new token
a probability, tokens at or above the threshold are selected (`layers.router_probs`, `layers.select`), the block
runs for selected tokens only; unselected tokens pass through unchanged ("strict", "kv") or with the layer's
predicted update ("predict"). In "strict" skip mode only selected tokens append K/V to that layer's cache; in "kv"
and "predict" modes every token does, a skipped one from its unchanged input (`STTConfig.skip_mode`). Rows of a
batch are never
packed together: selected tokens are gathered *within* each row, so attention can only see the row's own cache.

Host syncs: decode needs none on CUDA (unselected rows are computed and discarded, masked by `torch.where`).
Prefill (more than one new token) and any CPU call compact instead: rows without a selected token are dropped
and each remaining row's selected tokens are gathered into a (B', S) batch. That shape depends on the routing,
so it is read on the host once per STT layer; on the CPU the read is free and a skipped token costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from chatapp.stt.cache import KVCache
from chatapp.stt.config import STTConfig
from chatapp.stt.decode import DecodeRuntime, decode_step
from chatapp.stt.forward import embed, head, run_layers
from chatapp.stt.io import load_model, save_model
from chatapp.stt.layers import (
    DecoderBlock,
    STTLayer,
    rms_norm,
    router_probs,
    select,
    skipped_output,
    stores_skipped,
)
from chatapp.stt.qwen2 import RMSNorm, RotaryEmbedding
from chatapp.stt.teacher import EvalMode, EvalOutput, TrainOutput, forward_eval, forward_train

Routing = Literal["student", "off"]
# What a forward keeps of every layer's output: nothing, each row's last new token, or every position.
Capture = Literal["last", "all"] | None


@dataclass
class ExtendOutput:
    """What one `extend`/`decode` call returns; all tensors stay on the model's device."""

    logits: torch.Tensor  # (B, V) at each row's last new token, or (B, T, V) with all_logits
    router_probs: torch.Tensor  # (L_stt, B, T) float32 causal-router probabilities
    selected: torch.Tensor  # (L_stt, B, T) bool: the STT layer ran its block for this token (False at padding)
    # Every layer's output, float32, when asked (`Capture`): (L, B, D) at each row's last new token, or (L, B, T, D).
    states: torch.Tensor | None = None


@contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside are on the meta device, and their initialisers do not run (see `STTForCausalLM.empty`)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "constant_", "trunc_normal_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def run_cached_block(
    layer: DecoderBlock,
    index: int,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    selected: torch.Tensor,
    cache: KVCache,
    span: int,
    compact: bool,
    causal: bool = False,
    store: bool = True,
) -> torch.Tensor:
    """Run `layer`'s block for the `selected` (B, T) tokens only; the others pass through unchanged.

    With `compact`, rows without a selected token are dropped and each remaining row's selected tokens are
    gathered (in order) into a (B', S) batch, S = the largest selected count. Otherwise all B x T tokens are
    computed and the outputs of unselected ones are discarded. `causal`: the layer's cache was empty and every
    row is a whole chunk. Once each row's selected tokens are gathered into a prefix of the row (always, under
    `causal`), the k-th of them lands in cache slot k and sees exactly slots 0..k: plain causal attention, with
    no mask to build. Without `store` the selected tokens' K/V are already in the cache (the "kv" skip mode
    stored every token's first): the block attends to those entries and writes none.
    """
    rows = gather = None
    x = hidden
    if compact:
        counts = selected.sum(1)
        active = counts > 0
        # The one host sync of a compacted call: the compacted batch's shape depends on the routing.
        num_rows, width, total = torch.stack((active.sum(), counts.max(), counts.sum())).tolist()
        if num_rows == 0:
            return hidden
        if num_rows < hidden.shape[0]:
            rows = active.nonzero().squeeze(1)
            x, cos, sin, positions, selected, counts = (
                t.index_select(0, rows) for t in (hidden, cos, sin, positions, selected, counts)
            )
        if width < hidden.shape[1] or (causal and total < num_rows * width):
            gather = torch.argsort((~selected).to(torch.uint8), dim=1, stable=True)[:, :width]
            selected = torch.arange(width, device=hidden.device)[None, :] < counts[:, None]
            dim = hidden.shape[-1]
            x_full = x
            x = x_full.gather(1, gather[..., None].expand(-1, -1, dim))
            cos = cos.gather(1, gather[..., None].expand(-1, -1, cos.shape[-1]))
            sin = sin.gather(1, gather[..., None].expand(-1, -1, sin.shape[-1]))
            positions = positions.gather(1, gather)
    write = selected

    def sink(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not store:
            return cache.visible(index, positions, write, span, rows)
        keys, values, mask = cache.append(index, k, v, positions, write, span, rows)
        return keys, values, None if causal else mask

    out = torch.where(write[..., None], layer.block(x, cos, sin, sink), x)
    if gather is not None:
        out = x_full.scatter(1, gather[..., None].expand_as(out), out)
    if rows is not None:
        out = hidden.index_copy(0, rows, out)
    return out

@dataclass
class CacheLayers:
    """The KV cache's back-end of the model's forward (`stt.forward.run_layers`): a layer appends its new tokens'
    K/V to the cache and attends over the row's entries; a routed layer runs its block for its selected tokens only
    (`run_cached_block`). `compact`: gather each row's selected tokens (prefill, and any call on a CPU) rather than
    compute every token and discard the unselected ones (a decode-sized call on CUDA, which then needs no host sync).
    `causal`: the cache was empty and every row is a whole chunk. `store_skipped`: a skipped token stores its K/V
    ("kv", "predict")."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    cache: KVCache
    span: int
    compact: bool
    causal: bool
    store_skipped: bool

    def dense(self, index: int, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return self._block(index, layer, hidden, self.valid, compact=False)

    def routed(self, index: int, layer: nn.Module, hidden: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        if not self.store_skipped:
            return self._block(index, layer, hidden, selected, self.compact)
        # "kv"/"predict": every valid token stores the K/V of its unchanged input, as in a dense layer; then the
        # block runs for the selected tokens, attending to those entries (the block's own K/V writes are skipped),
        # and the skipped ones carry on with `skipped_output` (their input, plus f in "predict").
        normed = rms_norm(layer.input_layernorm, hidden)
        k, v = layer.self_attn.project_kv(normed, self.cos, self.sin)
        self.cache.append(index, k, v, self.positions, self.valid, self.span)
        carried = skipped_output(layer, hidden, normed)
        out = self._block(index, layer, hidden, selected, self.compact, store=False)
        return out if carried is hidden else torch.where((self.valid & ~selected)[..., None], carried, out)

    def _block(
        self, index: int, layer: nn.Module, hidden: torch.Tensor, selected: torch.Tensor, compact: bool, store=True
    ) -> torch.Tensor:
        causal = self.causal and store
        return run_cached_block(
            layer, index, hidden, self.cos, self.sin, self.positions, selected, self.cache, self.span, compact,
            causal=causal, store=store,
        )  # fmt: skip


class STTModel(nn.Module):
    """The decoder stack (`model.` in the state dict): embeddings, layers, final norm, rotary embedding."""

    def __init__(self, config: STTConfig) -> None:
        super().__init__()
        stt = set(config.stt_layers)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [STTLayer(config) if i in stt else DecoderBlock(config) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class STTForCausalLM(nn.Module):
    """Qwen2-compatible causal LM with Subjective Timescale Transformer layers (see module docstring)."""

    def __init__(self, config: STTConfig) -> None:
        super().__init__()
        config.validate_stt()
        self.config = config
        self.model = STTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_base_weights()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # How the model is served, set where it is loaded (`chatapp.models.loader`) and nowhere else: the weight
        # format its projections are in (`stt.weights.prepare_weights`, `stt.served`; None: as built, float32 or
        # whatever `.to()` made it) and what its decode step runs (`stt.decode.DecodeRuntime`; as built: eager).
        self.weight_format: str | None = None
        self.runtime = DecodeRuntime()

    @classmethod
    def empty(cls, config: STTConfig) -> STTForCausalLM:
        """The model's structure on the meta device, for a state dict to be assigned into (`load_state_dict(...,
        assign=True)`, then `finish_load`): no memory, and none of the initialisers run. (On the meta device they
        would do nothing, yet `normal_` there goes through torch's Python reference ops, whose first use imports
        torch._dynamo: 1.3 s of a command's start.)"""
        with on_meta():
            return cls(config)

    def finish_load(self) -> None:
        """After a state dict was assigned into a model built on the meta device: tie the head to the embedding again
        (assigning replaced the tied parameter), rebuild the rotary frequencies (not part of any checkpoint), and
        check that nothing was left unloaded."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):  # not a quantized copy
            self.lm_head.weight = self.model.embed_tokens.weight
        if self.model.rotary_emb.inv_freq.is_meta:
            self.model.rotary_emb.reset_inv_freq(self.model.embed_tokens.weight.device)
        missing = [name for name, t in (*self.named_parameters(), *self.named_buffers()) if t.is_meta]
        if missing:
            raise RuntimeError(f"tensors never loaded: {missing[:4]}")

    def _init_base_weights(self) -> None:
        """Qwen2's initialisation for the base model; the STT modules keep the inits they chose themselves."""
        router_parts = ("transition_network", "predictive_router", "causal_router")
        for name, module in self.named_modules():
            if any(part in name for part in router_parts) or not isinstance(module, nn.Linear | nn.Embedding):
                continue
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def stt_layer_indices(self) -> list[int]:
        """Indices of the STT layers, in order: the order of `router_probs`/`selected` everywhere."""
        return list(self.config.stt_layers)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activation (and KV cache) dtype; an int8 LM head (see `chatapp.stt.weights`) has no float weight."""
        return self.model.embed_tokens.weight.dtype

    @property
    def routing_active(self) -> bool:
        """Whether "student" routing actually skips tokens (routers trained and present)."""
        return bool(self.config.routing_trained and self.config.train_causal_router)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the attached decode step's (`DecodeRuntime.kv_dtype`: float16 for the native CPU
        step, `stt.cpu_step`), else float32 on a CPU whatever the weights, the activation dtype elsewhere.

        torch's CPU kernels run one reduced-precision query against its keys 3-6x slower than float32 attention
        (scaled_dot_product_attention at 128-512 keys; benchmarks/cpu_decode.py), and at decode attention is a
        large share of a small model's step: the torch step's cache is float32. The native step converts as it reads
        (`decode_step.c`), so its cache takes half the bytes; the torch passes over that cache widen it to float32
        (`cache.attention_inputs`).
        """
        if self.runtime.kv_dtype is not None:
            return self.runtime.kv_dtype
        return torch.float32 if self.device.type == "cpu" else self.dtype

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty KV cache on the model's device: activations' state in the model's dtype, K/V in `kv_dtype`."""
        attn = self.model.layers[0].self_attn
        return KVCache(
            num_layers=self.config.num_hidden_layers,
            num_stt_layers=len(self.config.stt_layers),
            batch_size=batch_size,
            max_len=max_len,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            hidden_size=self.config.hidden_size,
            device=self.device,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
        )

    # ------------------------------------------------------------------------------------------------- inference
    @torch.no_grad()
    def extend(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        cache: KVCache,
        *,
        routing: Routing = "student",
        threshold: float | None = None,
        all_logits: bool = False,
        capture: Capture = None,
    ) -> ExtendOutput:
        """Process `lengths[b]` new tokens of each right-padded row of `ids` (B, T), appending to `cache`.

        Token i of row b sits at absolute position `cache.seen[b] + i`. A row with length 0 is untouched (its
        logits are meaningless). Raises ContextOverflowError if a row would exceed `cache.max_len`. `capture`: also
        return every layer's output (`ExtendOutput.states`, what the lens reads) at each row's last new token
        ("last", (L, B, D)) or at every position ("all", (L, B, T, D)).
        """
        if routing not in ("student", "off"):
            raise ValueError(f"routing must be 'student' or 'off', got {routing!r}")
        batch, width = ids.shape
        lengths = lengths.to(device=self.device, dtype=torch.long)
        # A first chunk that fills every row (a prompt into an empty cache) attends with plain causal attention,
        # which skips the masked half of the scores: about twice as fast as the same attention given a mask.
        # STT layers qualify too: `run_cached_block` lays each row's selected tokens out as a prefix first.
        causal = cache.host_bound == 0 and bool((lengths == width).all())
        span = max(cache.reserve(lengths, width), 1)
        steps = torch.arange(width, device=self.device)
        valid = steps[None, :] < lengths[:, None]
        positions = cache.seen[:, None] + steps[None, :]

        hidden, cos, sin = embed(self, ids, positions)
        student = routing == "student" and self.routing_active
        cutoff = self.config.router_threshold if threshold is None else threshold
        runner = CacheLayers(
            cos=cos,
            sin=sin,
            positions=positions,
            valid=valid,
            cache=cache,
            span=span,
            compact=width > 1 or hidden.device.type != "cuda",
            causal=causal,
            store_skipped=student and stores_skipped(self.config.skip_mode),
        )
        probs, chosen, states = [], [], []
        last = (lengths - 1).clamp(min=0)
        rows = torch.arange(batch, device=self.device)

        def policy(index: int, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
            """An STT layer's causal router reads its input (reported in every mode); under the student's routing
            its decision says which tokens run the block."""
            if not isinstance(layer, STTLayer):
                return None
            probs.append(self._router_probs(layer, x, lengths, cache, len(probs)))
            chosen.append(valid & select(probs[-1], cutoff) if student else valid)
            return chosen[-1]

        def keep(index: int, layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            states.append(out[rows, last].float() if capture == "last" else out.float())
            return out

        hidden = run_layers(self, hidden, runner, policy, after=keep if capture else None)
        cache.seen += lengths
        logits = head(self, hidden if all_logits else hidden[rows, last])
        empty = torch.zeros(0, batch, width, device=self.device)
        return ExtendOutput(
            logits=logits,
            router_probs=torch.stack(probs) if probs else empty,
            selected=torch.stack(chosen) if chosen else empty.bool(),
            states=torch.stack(states) if capture else None,
        )

    @torch.no_grad()
    def decode(
        self,
        ids: torch.Tensor,
        cache: KVCache,
        *,
        routing: Routing = "student",
        threshold: float | None = None,
        active: torch.Tensor | None = None,
        capture: bool = False,
    ) -> ExtendOutput:
        """One new token per row (`ids` is (B,)): `extend` with T = 1, outputs with T = 1, by the model's decode step
        (`decode.decode_step`: the native int8 step on a CPU when attached, else the torch step).

        `active` (B,) bool: only these rows are fed; the others are left exactly as they were (their logits are
        meaningless). `capture`: every layer's output too (`ExtendOutput.states`). The native step does both in its
        one call; the torch step, which does neither, hands such a call to `extend`."""
        if routing not in ("student", "off"):
            raise ValueError(f"routing must be 'student' or 'off', got {routing!r}")
        student = routing == "student" and self.routing_active
        cutoff = self.config.router_threshold if threshold is None else threshold
        if self.runtime.native is not None:
            states = torch.empty(len(self.model.layers), ids.shape[0], self.config.hidden_size) if capture else None
            result = self.runtime.native(self, ids, cache, student, cutoff, active, states)
            if result is not None:
                logits, probs, selected = result
                return ExtendOutput(logits=logits, router_probs=probs, selected=selected, states=states)
        if active is None and not capture:
            logits, probs, selected = decode_step(self, ids, cache, student, cutoff)
            return ExtendOutput(logits=logits, router_probs=probs, selected=selected)
        lengths = torch.ones_like(ids) if active is None else active.to(torch.long)
        kept = "last" if capture else None
        return self.extend(ids[:, None], lengths, cache, routing=routing, threshold=threshold, capture=kept)

    @torch.no_grad()
    def feed(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        cache: KVCache,
        *,
        routing: Routing = "student",
        threshold: float | None = None,
        all_logits: bool = False,
    ) -> ExtendOutput:
        """A decode step in which row b feeds `lengths[b]` tokens of `ids` (B, W): 0 for a finished row, more than
        one for a known run (tool output, tokens a grammar forces, a program's feed). Outputs as `extend`'s.

        With the native step every position is one native step of the rows that feed it, so a row's numbers are
        those of feeding its tokens one at a time, in any batch, and a batch never leaves the kernel. The torch
        step takes one token per row, so the torch path feeds such a step in one `extend` call (on a GPU a wide
        call costs about what a narrow one does)."""
        width = ids.shape[1]
        if self.runtime.native is None:
            return self.extend(ids, lengths, cache, routing=routing, threshold=threshold, all_logits=all_logits)
        lengths = lengths.to(torch.long)
        outs = [
            self.decode(ids[:, i], cache, routing=routing, threshold=threshold, active=lengths > i)
            for i in range(width)
        ]
        rows = torch.arange(ids.shape[0])
        every = torch.stack([out.logits for out in outs], dim=1)  # (B, W, V)
        return ExtendOutput(
            logits=every if all_logits else every[rows, (lengths - 1).clamp(min=0)],
            router_probs=torch.cat([out.router_probs for out in outs], dim=2),
            selected=torch.cat([out.selected for out in outs], dim=2) & (torch.arange(width) < lengths[:, None]),
        )

    def _router_probs(
        self, layer: STTLayer, hidden: torch.Tensor, lengths: torch.Tensor, cache: KVCache, stt_slot: int
    ) -> torch.Tensor:
        """Causal-router probabilities (B, T) for the new tokens; updates the cache's x_{t-1} for this layer."""
        stored = cache.prev_hidden[stt_slot]
        previous = torch.cat((stored[:, None].to(hidden.dtype), hidden[:, :-1]), dim=1)
        probs = router_probs(layer, hidden, previous)
        # Only now overwrite x_{t-1}: `stored` is a view of the same memory.
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), (lengths - 1).clamp(min=0)]
        stored.copy_(torch.where((lengths > 0)[:, None], last.to(stored.dtype), stored))
        return probs

    # ------------------------------------------------------------------------------------------ training, eval
    def forward(
        self, ids: torch.Tensor, loss_mask: torch.Tensor | None = None, *, step: int | None = None
    ) -> TrainOutput:
        """The training forward, so that DistributedDataParallel (which hooks `forward`) can wrap the model."""
        return forward_train(self, ids, loss_mask, step=step)

    def forward_train(
        self,
        ids: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        *,
        step: int | None = None,
        all_logits: bool = True,
    ) -> TrainOutput:
        """Teacher-mode training forward (§3.1, §5) at optimiser step `step` (for the β schedules)."""
        return forward_train(self, ids, loss_mask, step=step, all_logits=all_logits)

    def forward_eval(
        self, ids: torch.Tensor, mode: EvalMode | None = None, *, threshold: float | None = None
    ) -> EvalOutput:
        """Full-sequence logits with routing "off", by the "teacher" or by the "student" (causal router).

        `mode=None` follows the config: student when `use_causal_router_in_validation`, teacher otherwise.
        """
        if mode is None:
            student = self.config.use_causal_router_in_validation and self.config.train_causal_router
            mode = "student" if student else "teacher"
        return forward_eval(self, ids, mode, threshold=threshold)

    def parameter_groups(self, lr_scale: float = 1.0, weight_decay: float = 0.0) -> list[dict]:
        """The four optimiser groups of §6, each with its own learning rate from the config (times `lr_scale`).

        Norm weights, biases and the router's scalar biases get no weight decay.
        """
        config = self.config
        lrs = {
            "base_model": config.lr_base,
            "stt_transition_network": config.lr_transition_network,
            "stt_predictive_router": config.lr_predictive_router,
            "stt_causal_router": config.lr_causal_router,
        }
        buckets: dict[tuple[str, bool], list[nn.Parameter]] = {}
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            group = next((g for g in lrs if g != "base_model" and f".{g.removeprefix('stt_')}." in name), "base_model")
            buckets.setdefault((group, param.ndim >= 2), []).append(param)
        return [
            {
                "name": group,
                "params": params,
                "lr": lrs[group] * lr_scale,
                "weight_decay": weight_decay if decays else 0.0,
            }
            for (group, decays), params in sorted(buckets.items())
        ]

    # ---------------------------------------------------------------------------------------------- persistence
    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> STTForCausalLM:
        """Load an STT or plain Qwen2 directory (config.json + safetensors); see `chatapp.stt.io`."""
        return load_model(cls, model_dir, device=device, dtype=dtype)

    def save_pretrained(self, model_dir: str | Path) -> None:
        """Write config.json and model.safetensors (atomically) into `model_dir`."""
        save_model(self, model_dir)
