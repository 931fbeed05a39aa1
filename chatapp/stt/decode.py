"""The decode fast path: one new token per row, over the sparse KV cache, in as few torch ops as possible.

This module only schedules: the maths it runs (the block on cache rows `block_step`, the K/V a skipped token
stores in "kv" mode `kv_step`, the router `router_probs` and the rule `select`) lives in `chatapp.stt.layers`.

At decode shapes (a handful of rows, one token each) a step is dispatch-bound: on a CPU every torch op costs a
few microseconds whatever its size, and the matrix products are the only ops that do real work. So this path
does the general `extend`'s maths with the bookkeeping hoisted out of the layers:

- Everything the layers share is built once per step (`StepState`): rotary cos/sin looked up in a table, the
  row index, and the attention masks of every layer at once. In decode a row's live cache entries all precede
  the new token, so "key slot < the layer's length after the write" is the whole mask, no positions needed.
- Per layer, K/V are written with one indexed store each, rotary runs over Q and K together, and activations
  stay 2-D (B, D), so every projection is a single matrix product (q/k/v and gate/up are one product each under
  the quantized formats, see `stt.weights.fuse_projections`).
- Layers that run every row go in stacks (`decode_plan`, `stack_step`): compiled, a stack is one call of the
  compiled code instead of one per layer.
- The cache's entry positions and per-layer lengths are written once per step for all layers.
- Routing off runs no host sync. Student routing on a CPU reads each STT layer's decisions (one small host read
  per STT layer) and runs the block only for the selected rows; on CUDA it computes every row and discards
  unselected outputs, like `extend`.
- Under student routing each STT layer heads a segment of the plan, the dense layers after it in the same stack
  (`decode_plan`, `routed_segment`). When the layer's decision is the same for every row (at batch 1 it always
  is), the segment is one stack call: the layer runs as a dense one, or, skipped, stores its K/V at the head of
  the stack (`kv_lead`) in "kv" mode and is left out in "strict" mode. A skipped token then costs the layer its
  K/V projection and nothing else, and the step makes about one more call per STT layer than routing off (where
  the STT layers cut its stacks), no eager layer and no gathers. Rows that split go through `routed_layer`: the
  selected ones gathered into the block's subset call, the skipped ones' K/V ("kv" mode) through a K/V-only stack.
- Skip mode "kv" (`STTConfig.skip_mode`): an STT layer stores every row's K/V, so its lengths grow like a dense
  layer's. On CUDA that is the dense call with unselected outputs discarded (a row's K/V depend only on its input).

The results equal `extend` with T = 1: tests/stt/test_fast_paths.py compares the two step by step (logits, router
outputs, cache contents), and tests/stt/test_inference.py compares routing-off decode with transformers' Qwen2.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from chatapp.stt.cache import KVCache
from chatapp.stt.layers import (
    BlockParts,
    STTLayer,
    block_step,
    kv_step,
    rms_norm,
    router_probs,
    select,
    skipped_output,
    stores_skipped,
)


@dataclass
class StepState:
    """Per-step tensors every layer shares (B rows, keys sliced to `span` slots)."""

    cos: torch.Tensor  # (B, 1, Dh) rotary cos at each row's position, broadcast over heads
    sin: torch.Tensor  # (B, 1, Dh) rotary sin with rotate_half's sign folded in (see `rotate`)
    rows: torch.Tensor  # (B,) arange: the cache row of every batch row
    visible: torch.Tensor  # (L, B, 1, 1, span) bool: key slot < that layer's length once this token is written
    bias: torch.Tensor  # `visible` as an additive mask (0 / -inf), converted once rather than by every attention
    grown: torch.Tensor  # (L, B) every layer's length with this token written
    trash: torch.Tensor  # (B,) the cache's trash slot, where a layer that skips a row in "strict" mode writes it
    span: int


@dataclass
class LayerWrite:
    """Where one layer stored the step's token: per row its slot (`max_len`, the trash slot, when the layer
    skipped the row) and the layer's length after the step."""

    slots: torch.Tensor  # (B,)
    lengths: torch.Tensor  # (B,)


def rope_tables(model, needed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary (cos, signed sin) tables of at least `needed` positions, shaped (P, 1, Dh), kept in the model's
    `DecodeRuntime`.

    Built by the model's own rotary module, so a lookup equals what it computes for that position. The table
    doubles when it runs short and is rebuilt when the rotary buffer moves (device) or the dtype changes.
    """
    rotary = model.model.rotary_emb
    runtime = model.runtime
    key = (rotary.inv_freq.device, dtype)
    if runtime.rope is not None and runtime.rope[0] == key and runtime.rope[1].shape[0] >= needed:
        return runtime.rope[1], runtime.rope[2]
    size = max(256, 1 << (max(needed, 1) - 1).bit_length())
    positions = torch.arange(size, device=rotary.inv_freq.device)[None]
    probe = torch.empty(0, device=rotary.inv_freq.device, dtype=dtype)
    cos, sin = rotary(probe, positions)
    half = cos.shape[-1] // 2
    # rotate_half(x) * sin == roll(x, half) * signed_sin with signed_sin = [-sin[:half], sin[half:]].
    signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
    runtime.rope = (key, cos[0, :, None], signed[:, None])
    return runtime.rope[1], runtime.rope[2]


def step_state(model, cache: KVCache, span: int) -> StepState:
    """The tensors every layer of this step shares (see `StepState`)."""
    device = cache.device
    cos_table, sin_table = rope_tables(model, span, model.dtype)
    cos, sin = cos_table[cache.seen], sin_table[cache.seen]
    grown = cache.lengths + 1
    slot_ids = torch.arange(span, device=device)
    visible = (slot_ids < grown[..., None])[:, :, None, None, :]
    bias = torch.zeros(visible.shape, device=device, dtype=cache.attention_dtype).masked_fill_(~visible, float("-inf"))
    rows = torch.arange(cache.batch_size, device=device)
    trash = torch.full((cache.batch_size,), cache.max_len, device=device)
    return StepState(cos=cos, sin=sin, rows=rows, visible=visible, bias=bias, grown=grown, trash=trash, span=span)


def block_parts(model) -> list[BlockParts]:
    """Every layer's `BlockParts` (built each step, ~15 us: a copy cached on the model could go stale when a
    weight format swaps a module)."""
    return [
        BlockParts(b.input_layernorm, b.self_attn, b.post_attention_layernorm, b.mlp, getattr(b, "skip_predictor", None))
        for b in model.model.layers
    ]


def stack_step(
    blocks: tuple[BlockParts, ...],
    x: torch.Tensor,
    keys: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    rows: torch.Tensor,
    slots: tuple[torch.Tensor, ...],
    masks: tuple[torch.Tensor, ...],
    cos: torch.Tensor,
    sin: torch.Tensor,
    span: int,
    kv_lead: bool = False,
    routers: tuple[STTLayer | None, ...] = (),
    previous: tuple[torch.Tensor | None, ...] = (),
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Consecutive blocks on every row, one after the other. Compiled, a stack is one call where its blocks one by
    one were as many, and each call of a compiled function costs ~0.05 ms of argument handling, a seventh of a
    block at batch 1.

    `kv_lead`: the first block is an STT layer that skipped every row in "kv" or "predict" mode, so it only stores
    their K/V (`kv_step`) and passes them on (with its predicted update in "predict" mode); the call goes on with the
    blocks after it (`routed_segment`).

    `routers`: per block, the STT layer whose causal router reads that block's input, and one more that reads the
    stack's output (the next layer's input), None where there is none; `previous`: each one's stored x_{t-1}.
    Inside the call a router costs a few fused kernels; run eagerly between calls, ~12 ops and ~0.1 ms. Returns
    (output, the routers' probabilities, their inputs), in order."""
    probs, inputs = [], []

    def route(position: int, layer_input: torch.Tensor) -> None:
        if position < len(routers) and routers[position] is not None:
            probs.append(router_probs(routers[position], layer_input, previous[position]))
            inputs.append(layer_input)

    for i, block in enumerate(blocks):
        route(i, x)
        if i == 0 and kv_lead:
            x = kv_step(block, x, keys[0], values[0], rows, slots[0], cos, sin)
            continue
        x = block_step(block, x, keys[i], values[i], rows, slots[i], masks[i], cos, sin, span, False)
    route(len(blocks), x)
    return x, probs, inputs


@dataclass(frozen=True)
class DecodeSteps:
    """The functions a decode step runs its blocks with: `block_step` and `stack_step` themselves, or their
    compiled copies (`compile_decode`, kept in the model's `DecodeRuntime`)."""

    block: Callable[..., torch.Tensor]
    stack: Callable[..., tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]


EAGER_STEPS = DecodeSteps(block_step, stack_step)

# A whole decode step in one call: (model, ids, cache, student, cutoff) -> `decode_step`'s results, or None for a
# call it does not take (`stt.cpu_step.NativeStep`).
OneCallStep = Callable[..., "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None"]


@dataclass
class DecodeRuntime:
    """How one model decodes, in one object (`STTForCausalLM.runtime`): the loader fills it in
    (`chatapp.models.loader.load_model`) and `STTForCausalLM.decode` reads it. A model built any other way decodes eagerly
    with the torch step. Nothing else about decoding is kept on the module."""

    # The whole step in one call, tried first by `STTForCausalLM.decode` (int8 on a CPU: `stt.cpu_step`).
    native: OneCallStep | None = None
    compiled: DecodeSteps | None = None  # the torch step's blocks compiled (CUDA: `compile_decode`)
    # The K/V dtype the attached step reads (`STTForCausalLM.kv_dtype`); None: the model's default.
    kv_dtype: torch.dtype | None = None
    note: str = "the decode step runs eagerly (torch)"  # how it runs, for `--verbose` and logs
    # Derived once and kept: the step's plans and their readers by (student, layers), and the rotary tables.
    plans: dict[tuple[bool, int], list[Segment]] = field(default_factory=dict)
    readers: dict[tuple[bool, int], list[tuple[int | None, ...]]] = field(default_factory=dict)
    rope: tuple | None = None


class CompiledByShape:
    """`fn` compiled by torch.compile, one compiled copy per call shape (`shape_of(*args)`).

    Dynamo keeps a function's graphs in one list per code object and checks a call's guards against each graph in
    turn, so with every shape in one list a call paid for the failed checks of the others (in a student-routed
    step of the default model a lookup averaged 150 us a call with one list, 115 us with a copy per shape). Each
    copy here has a code object of its own, hence a list of its own. Per instance too: two models in one process
    never share graphs."""

    def __init__(self, fn: Callable, shape_of: Callable[..., tuple]) -> None:
        self.fn, self.shape_of = fn, shape_of
        self.copies: dict[tuple, Callable] = {}

    def __call__(self, *args):
        shape = self.shape_of(*args)
        compiled = self.copies.get(shape)
        if compiled is None:
            name = f"{self.fn.__name__}_{len(self.copies)}"
            code = self.fn.__code__.replace(co_name=name)
            copy = types.FunctionType(code, self.fn.__globals__, name, self.fn.__defaults__, self.fn.__closure__)
            compiled = self.copies[shape] = torch.compile(copy, dynamic=True)
        return compiled(*args)


def _block_shape(block, x, keys, values, rows, slots, mask, cos, sin, span, subset) -> tuple:
    return (x.shape[0] == 1, subset)  # batch 1 is a shape of its own (dynamic shapes specialise sizes 0 and 1)


def _stack_shape(
    blocks, x, keys, values, rows, slots, masks, cos, sin, span, kv_lead=False, routers=(), previous=()
) -> tuple:
    # After kv_lead: the stack runs some of the cache's rows (a K/V-only stack of the rows a routed layer skipped),
    # so one row of a larger cache is not batch 1 (a graph of batch 1 assumes a cache of one row); last, where
    # routers run.
    subset = x.shape[0] < keys[0].shape[0] if keys else False
    return (len(blocks), x.shape[0] == 1, kv_lead, subset, tuple(router is not None for router in routers))


# Blocks per stack call. Compiled, a stack of 3 decoded the default model 8-10% faster than one block a call
# (int8 and int4, batch 1); stacks of 6 and 10 were no faster and took longer to compile (a compiled stack is
# that many blocks of code). Under student routing a routed segment is a stack too, of up to as many blocks.
STACK_LAYERS = 3


class Segment(NamedTuple):
    """Consecutive layers a decode step runs together, in one stack call when it can. A routed segment starts at an
    STT layer under student routing (which rows it runs is decided just before it) and goes on with dense layers."""

    start: int
    stop: int
    routed: bool


def decode_plan(model, student: bool) -> list[Segment]:
    """The step's segments: stacks of up to `STACK_LAYERS` layers. Without routing every layer runs every row and
    the layers go in stacks in order. Under student routing each STT layer starts a segment (its rows are decided
    just before it, from the router's reading of its input: one host read), followed by the dense layers after
    it, so that a layer whose decision is the same for every row (at batch 1, always) costs no call of its own:
    it heads the stack of the layers after it (`routed_segment`)."""
    key = (student, len(model.model.layers))
    cached = model.runtime.plans
    if key in cached:
        return cached[key]
    routed = set(model.stt_layer_indices) if student else set()
    plan: list[Segment] = []
    start, count = 0, len(model.model.layers)
    while start < count:
        stop = start + 1
        while stop < count and stop - start < STACK_LAYERS and stop not in routed:
            stop += 1
        plan.append(Segment(start, stop, start in routed))
        start = stop
    cached[key] = plan
    return plan


def plan_readers(model, student: bool) -> list[tuple[int | None, ...]]:
    """Per segment of `decode_plan`, whose router reads each of its layers' inputs and its output: the STT layer
    at each position (None for a dense layer and for a routed segment's own STT layer, whose router must have read
    its input before the segment, to decide it), then the next segment's STT layer when that one is routed (it reads
    this segment's output), else None. So every router runs inside a stack call, compiled with it."""
    key = (student, len(model.model.layers))
    cached = model.runtime.readers
    if key in cached:
        return cached[key]
    plan, stt = decode_plan(model, student), set(model.stt_layer_indices)
    readers = []
    for k, segment in enumerate(plan):
        own = [i if i in stt and not (segment.routed and i == segment.start) else None for i in range(*segment[:2])]
        after = plan[k + 1] if k + 1 < len(plan) and plan[k + 1].routed else None
        readers.append((*own, None if after is None else after.start))
    cached[key] = readers
    return readers


def dense_layers(
    steps: DecodeSteps,
    blocks: list[BlockParts],
    x: torch.Tensor,
    state: StepState,
    cache: KVCache,
    segment: Segment,
    kv_lead: bool = False,
    routers: tuple[STTLayer | None, ...] = (),
    previous: tuple[torch.Tensor | None, ...] = (),
):
    """Layers `segment` storing and computing every row's token (the first one only storing its K/V, with
    `kv_lead`), and the `routers` (see `stack_step`): (output, the routers' probabilities, their inputs, the layers'
    LayerWrites). An empty segment runs its routers only, eagerly (they read `x`)."""
    if segment.start == segment.stop:
        readers = [(router, stored) for router, stored in zip(routers, previous, strict=True) if router is not None]
        return x, [router_probs(router, x, stored) for router, stored in readers], [x] * len(readers), []
    if not any(router is not None for router in routers):
        routers, previous = (), ()  # one call shape for a stack without routers, however it was asked
    span = range(segment.start, segment.stop)
    out, probs, inputs = steps.stack(
        tuple(blocks[i] for i in span),
        x,
        tuple(cache.keys[i] for i in span),
        tuple(cache.values[i] for i in span),
        state.rows,
        tuple(cache.lengths[i] for i in span),
        tuple(state.bias[i] for i in span),
        state.cos,
        state.sin,
        state.span,
        kv_lead,
        routers,
        previous,
    )
    return out, probs, inputs, [LayerWrite(cache.lengths[i], state.grown[i]) for i in span]


def routed_segment(
    steps: DecodeSteps,
    blocks: list[BlockParts],
    x: torch.Tensor,
    selected: torch.Tensor | None,
    taken: int | None,
    state: StepState,
    cache: KVCache,
    segment: Segment,
    store_skipped: bool,
    routers: tuple[STTLayer | None, ...],
    previous: tuple[torch.Tensor | None, ...],
):
    """An STT layer under student routing (`segment.start`, its rows `selected` (B,), `taken` of them when the host
    knows already: `selected` may then be None if that is every row or none) and the dense layers after it, with
    their `routers` (`dense_layers`; the first, the STT layer's own, is None: it ran before, to decide it).

    On a CPU the decision is read on the host (one read; there it is free), and when it is the same for every row,
    which at batch 1 it always is, the segment is one stack call: a layer that runs every row is a dense layer for
    this step; one that skips every row stores their K/V at the head of the stack in "kv" mode (`kv_lead`) and is
    left out in "strict" mode. So a skipped token costs the layer nothing but its K/V, and routing adds no call
    to the step beyond where the STT layers cut the stacks. Rows split between the two go through `routed_layer`;
    so does CUDA, which never syncs."""
    if taken is None and x.device.type != "cuda":
        taken = int(selected.sum())
    rest = Segment(segment.start + 1, segment.stop, False)
    if taken == x.shape[0]:
        return dense_layers(steps, blocks, x, state, cache, segment, False, routers, previous)
    if taken == 0 and store_skipped:
        return dense_layers(steps, blocks, x, state, cache, segment, True, routers, previous)
    if taken == 0:  # "strict", every row skipped: the layer stores and computes nothing
        write = LayerWrite(state.trash, cache.lengths[segment.start])
    else:
        x, write = routed_layer(steps, blocks, x, selected, state, cache, segment.start, store_skipped)
    x, probs, inputs, writes = dense_layers(steps, blocks, x, state, cache, rest, False, routers[1:], previous[1:])
    return x, probs, inputs, [write, *writes]


def routed_layer(
    steps: DecodeSteps,
    blocks: list[BlockParts],
    x: torch.Tensor,
    selected: torch.Tensor,
    state: StepState,
    cache: KVCache,
    index: int,
    store_skipped: bool,
):
    """An STT layer under student routing on its own: only `selected` (B,) rows run the block. The skipped rows
    store their K/V too when `store_skipped` ("kv" skip mode), nothing otherwise ("strict")."""
    lengths = cache.lengths[index]
    if store_skipped:
        slots, write = lengths, LayerWrite(lengths, state.grown[index])
    else:
        slots = torch.where(selected, lengths, cache.max_len)
        write = LayerWrite(slots, lengths + selected)
    keys, values = cache.keys[index], cache.values[index]
    if x.device.type == "cuda":
        # No host sync: every row is computed and unselected outputs are discarded. Strict: unselected rows write to
        # the trash slot and see every key (their discarded output stays finite). Kv: every row stores its K/V, the
        # same as `kv_step` would (K/V depend only on the row's input), and the mask is a dense layer's.
        mask = state.visible[index] if store_skipped else state.visible[index] | ~selected[:, None, None, None]
        out = steps.block(
            blocks[index], x, keys, values, state.rows, slots, mask, state.cos, state.sin, state.span, False
        )
        return torch.where(selected[:, None], out, skipped_output(blocks[index], x)), write
    picked = selected.nonzero().squeeze(1)  # which rows: the shapes below depend on it
    if store_skipped:
        # The skipped rows' K/V through the stack call with a K/V-only lead (compiled when the step is).
        skipped = (~selected).nonzero().squeeze(1)
        carried, _, _ = steps.stack(
            (blocks[index],),
            x.index_select(0, skipped),
            (keys,),
            (values,),
            skipped,
            (lengths.index_select(0, skipped),),
            (state.bias[index],),  # unused by a K/V-only block
            state.cos.index_select(0, skipped),
            state.sin.index_select(0, skipped),
            state.span,
            True,
        )
        x = x.index_copy(0, skipped, carried)
    if picked.numel() == 0:
        return x, write
    out = steps.block(
        blocks[index],
        x.index_select(0, picked),
        keys,
        values,
        picked,
        lengths.index_select(0, picked),
        state.visible[index].index_select(0, picked),
        state.cos.index_select(0, picked),
        state.sin.index_select(0, picked),
        state.span,
        True,
    )
    return x.index_copy(0, picked, out), write


def compile_decode(model) -> None:
    """Run `model`'s decode with `block_step` and `stack_step` compiled by torch.compile (inductor), compiled now
    rather than at the first reply (`compiled_decode_steps`)."""
    model.runtime.compiled = compiled_decode_steps(model)
    model.runtime.note = "the decode step's blocks are compiled (torch.compile)"


def compiled_decode_steps(model) -> DecodeSteps:
    """`block_step` and `stack_step` compiled for `model` in this process and warmed up, Dynamo's guards on,
    without switching the model over to them (`compile_decode` does: the CUDA step).

    The graphs serve every layer: the step functions see tensors and modules of one shape, no layer index
    (torch.compile treats a module's parameters as inputs), and a dense layer's parts have an STT layer's types.
    Each call shape (batch 1 or more; a stack's length; all rows or a routed subset) has a compiled copy of its own
    (`CompiledByShape`); within one, batch size and cache span are dynamic. Inductor keeps compiled code on disk, so
    a later process compiles in seconds. The rest of the step (step state, routers, LM head) stays eager: compiling
    the whole step measured faster still but took minutes to compile, too long for a command that answers one
    prompt; stacks of `STACK_LAYERS` blocks measured as fast as longer ones (int8 and int4, batch 1).
    """
    configure_compiler()
    steps = DecodeSteps(CompiledByShape(block_step, _block_shape), CompiledByShape(stack_step, _stack_shape))
    warm_up(model, steps)
    return steps


def warm_up(model, steps: DecodeSteps) -> None:
    """Decode one token with `steps` in every call shape a decode step of `model` makes, as the engine decodes, so
    that compiling them (`compiled_decode_steps`) leaves none for the first reply.

    As the engine: the cache made and the step run in inference mode (tensors made there carry other dispatch keys,
    which compiled graphs' guards check; the engine makes its caches there), a few tokens already cached (one key
    is a shape of its own, which decode never sees). Batch 1 and batch 2 (batch 1 is a shape of its own), routing
    off and, when the model routes, the student's routing with every row selected at every STT layer, then none
    (`routed_segment`'s two stacks); then rows split at every STT layer, one of two selected, two of three, one of
    three (`routed_layer`'s subsets), each row given a cutoff of its own that selects it (0) or skips it (above 1).
    """

    def run(rows: int, student: bool, cutoff: float | torch.Tensor) -> None:
        with torch.inference_mode():
            cache = model.new_cache(rows, 64)
            ids = (torch.arange(rows * 3, device=model.device).view(rows, 3) * 7919 + 11) % model.config.vocab_size
            model.extend(ids, torch.full((rows,), 3, device=model.device), cache, routing="off")
            decode_step(model, ids[:, 0], cache, student, cutoff, steps)

    for rows in (1, 2):
        run(rows, False, 0.0)
        if model.routing_active:
            run(rows, True, 0.0)
            run(rows, True, 1.1)
    if model.routing_active:
        for cutoffs in ((0.0, 1.1), (0.0, 1.1, 0.0), (0.0, 1.1, 1.1)):
            run(len(cutoffs), True, torch.tensor(cutoffs, device=model.device))


def configure_compiler() -> None:
    """The compiler settings the decode graphs are made with. torch keeps its config per thread, so a thread that
    may recompile them (the engine's, when a shape comes up that the warm-up did not cover) calls this too."""
    import torch._dynamo
    import torch._inductor.config
    import torch.fx.experimental._config as fx_config

    # Sizes that happen to be equal at compile time (a cache row's offset and the head count, say) must not be
    # assumed equal forever: each such guard would recompile for another layer or step.
    fx_config.use_duck_shape = False
    # Each compiled copy holds one graph, or a few more when a model in another dtype shares the process.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    # No size and stride assertion on every input of every call: a stack of 3 blocks has ~90 inputs (each module's
    # tensors), and the checks cost ~70 us a call, 3.5% of a step of the default model at batch 1 in int4 (2-core
    # EPYC, 1 thread). What they would catch, a graph given shapes it was not made for, cannot happen: a call goes
    # to the graph compiled for its call shape (`CompiledByShape`), within which sizes are dynamic, and the inputs'
    # layouts are the step's own.
    torch._inductor.config.size_asserts = False


def decode_step(
    model,
    ids: torch.Tensor,
    cache: KVCache,
    student: bool,
    cutoff: float | torch.Tensor,
    steps: DecodeSteps | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch step: one token per row (`ids` (B,)); returns (logits (B, V), router_probs (L_stt, B, 1),
    selected (L_stt, B, 1)). A model with a native step tries that first (`STTForCausalLM.decode`).

    `student` applies the causal routers with threshold `cutoff` (a float, or one per row); otherwise every layer
    runs every row. `steps`: the block functions to run (default: the model's compiled ones when it has them, else
    eager).
    """
    runtime = model.runtime
    span = max(cache.reserve(1, 1), 1)
    state = step_state(model, cache, span)
    steps = steps or runtime.compiled or EAGER_STEPS
    layers, blocks = model.model.layers, block_parts(model)
    stt_slot = {index: slot for slot, index in enumerate(model.stt_layer_indices)}
    x = model.model.embed_tokens(ids)
    writes: list[LayerWrite] = []
    chosen = []
    # Per STT layer, its router's probability for this token and the input it read (the next token's x_{t-1}:
    # written to the cache once every router of the step has read the stored one).
    probs: dict[int, torch.Tensor] = {}
    inputs: dict[int, torch.Tensor] = {}
    stored = cache.prev_hidden.unbind(0)
    store_skipped = stores_skipped(model.config.skip_mode)
    # Batch 1 on a CPU: a decision is one number, read on the host, where the rule takes it as it is.
    one_row = ids.shape[0] == 1 and x.device.type != "cuda"
    for segment, readers in zip(decode_plan(model, student), plan_readers(model, student), strict=True):
        routers = tuple(None if i is None else layers[i] for i in readers)
        previous = tuple(None if i is None else stored[stt_slot[i]] for i in readers)
        if segment.routed:
            if segment.start not in probs:  # no call before it read its input: it is the first layer
                probs[segment.start] = router_probs(layers[segment.start], x, stored[stt_slot[segment.start]])
                inputs[segment.start] = x
            if one_row:
                selected, taken = None, int(select(probs[segment.start].item(), cutoff))
            else:
                selected, taken = select(probs[segment.start], cutoff), None
            chosen.append(selected if selected is not None else bool(taken))
            x, read, read_inputs, segment_writes = routed_segment(
                steps, blocks, x, selected, taken, state, cache, segment, store_skipped, routers, previous
            )
        else:
            x, read, read_inputs, segment_writes = dense_layers(
                steps, blocks, x, state, cache, segment, False, routers, previous
            )
        for index, prob, layer_input in zip([i for i in readers if i is not None], read, read_inputs, strict=True):
            probs[index], inputs[index] = prob, layer_input
        writes.extend(segment_writes)
    commit(cache, writes, state, every_row=not chosen or store_skipped)
    if stt_slot:
        torch.stack([inputs[i] for i in stt_slot], out=cache.prev_hidden)
    logits = model.lm_head(rms_norm(model.model.norm, x))
    batch, device = ids.shape[0], ids.device
    router = (
        torch.stack([probs[i] for i in stt_slot])[..., None] if stt_slot else torch.zeros(0, batch, 1, device=device)
    )
    if chosen and one_row:
        selected = torch.tensor(chosen, device=device).view(-1, 1, 1)
    elif chosen:
        selected = torch.stack(chosen)[..., None]
    else:
        selected = torch.ones(len(stt_slot), batch, 1, dtype=torch.bool, device=device)
    return logits, router, selected


def commit(cache: KVCache, writes: list[LayerWrite], state: StepState, every_row: bool) -> None:
    """Record the step in the cache: every layer's entry positions and lengths (one op each when every layer
    stored every row), and each row's token count."""
    if every_row:
        slots, lengths = cache.lengths, state.grown
    else:
        slots = torch.stack([w.slots for w in writes])
        lengths = torch.stack([w.lengths for w in writes])
    position = cache.seen.to(torch.int32)[None, :, None].expand(len(writes), -1, 1)
    cache.positions.scatter_(2, slots[..., None], position)
    cache.lengths.copy_(lengths)
    cache.seen += 1
