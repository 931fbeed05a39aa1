"""The decode loop: prefill, then one model forward per step over the device batch. This file tells the story.

    prompts ─► prefill (each prompt in its own row of the cache: `prefill_row`) ─► replicate rows for num_samples
      loop:  grammar masks on the logits (`constraints.py`) ─► penalties on repeats (`penalties.py`, when a row
             asks) ─► sample(logits) on device (`sampling.py`)
             ─► known tokens replace samples: a tool's queued output, tokens the grammar forces
             ─► the TTFA automaton steps (`programs.py`): feeds / timeouts replace tokens, zone tags
             ─► model.decode (or `model.feed` when some row fast-forwards a known run or has finished)
             ─► log-probs, entropy, top-N alternatives when a row asks (`logprobs.py`)
             ─► ONE device→host copy (tokens, routing, program state, log-probs) ─► per-row host bookkeeping
                (detokenize, stop / length / context / program checks, tool machine, grammar) ─► Step event

The request front (`engine.py`) validates a call and builds the rows; this module runs them. What it does
differently from nanochat's engine (docs/architecture.md lists that engine's weaknesses):
- Ragged batches: every row has its own position (`cache.seen[b]`), and its numbers never depend on the batch:
  each prompt is prefilled on its own, in chunks of its own length (`prefill_row`), and on a CPU every decode step
  of an int8 batch is the native step, which computes a row the same whatever rows are beside it (finished rows
  idle in its call, known runs fed a position a call: `STTForCausalLM.feed`). Greedy `batch` answers as
  `generate` does, token for token.
- Per-row randomness keyed by (seed, sample index, tokens emitted) — see `sampling.py` — so a row's sampled tokens
  do not depend on what else is in the batch either.
- `max_tokens` counts sampled tokens only; forced tokens (tool output, program feeds, grammar) never eat it.
- Finished rows stop costing compute: they are fed nothing (idle in the native step's call, length 0 in a ragged
  `extend`) and the batch is compacted with
  `cache.select_rows` once at least a quarter of the device batch has finished (compacting copies the cache, so
  doing it on every single finish would cost more than it saves on large batches; small batches compact at once).
- The cache never overflows: the host mirrors each row's position, grows the cache on demand up to the model's
  context size, and ends a row that fills the context with finish reason "context" and a message.
- Every emitted token has been fed to the model before it is reported (the stop token too), so its routing
  probabilities/decisions are the ones of the forward that processed it, and a cancelled chat session's cache
  holds exactly the tokens the consumer saw.

Fast-forward. A row whose next tokens are already known (a tool's output block, the tokens a grammar leaves no
choice about, a program's feed — see `programs.py`) pushes the whole run through one step while the other rows
advance by their one sampled token (`STTForCausalLM.feed`: a native call per position, the row's tokens computed as
one a step; on the torch path one ragged `extend`). The tokens are those of the one-per-step path by construction:
forced tokens are never sampled, and each forced token still consumes one draw counter, so the row's later random
draws are unchanged (tests compare both paths). When it pays off depends on the hardware: the other rows of a
ragged call are padded to the run's width, which is nearly free on a GPU (decode is memory-bound) but is wasted
compute on a CPU (benchmarks/engine_vs_transformers.py: 1.3-1.5x faster with one row, 0.8-1.0x with eight on
CPU). So the default policy `fast_forward="auto"` fast-forwards when the device batch has a single active row or
runs on CUDA, and otherwise feeds forced tokens one per step (still never sampled); `"always"` fast-forwards
whenever the row's settings allow it.

Host work per step is O(rows) bookkeeping (detokenization, stop/length checks, the tool machine) on plain Python
values after the single copy; the device side has no per-row Python loop and no other synchronisation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch

from chatapp.engine.constraints import apply_masks
from chatapp.engine.detok import Detokenizer
from chatapp.engine.events import FinishReason, PromptInfo, Step, TokenEvent, TokenLogprobs, ToolEvent
from chatapp.engine.logprobs import HostLogprobs, LogprobTensors, measure, model_log_probs
from chatapp.engine.penalties import BreakerMask, PenaltyState, breaker_mask_for
from chatapp.engine.programs import ProgramRunner
from chatapp.engine.protocols import ConstraintLike, ForwardOutput, KVCacheLike, ModelLike
from chatapp.engine.sampling import SamplingParams, sample, sample_with_log_probs
from chatapp.engine.tools import ForcedToken, ToolMachine
from chatapp.errors import ChatappError, ContextOverflowError, user_message
from chatapp.settings import GenerationSettings
from chatapp.stt.config import routing_level, routing_levels

if TYPE_CHECKING:
    from chatapp.ttfa import Program

# Prompt tokens per prefill forward (a prompt is prefilled on its own: `DecodeLoop._prefill`). It bounds the
# activations' memory (the MLP's is ~12 KB a token in float32); attention's stays small at any width, because
# torch's CPU attention kernel runs in blocks whether or not it is given a mask. A prompt that fits one chunk is
# prefilled with plain causal attention (`STTForCausalLM.extend`), which skips the masked half of the scores:
# a later chunk needs a mask over the cache. At one row, a 1,000-token prompt in one chunk is ~14% faster to its
# first token than in two 512-token chunks.
PREFILL_TOKENS = 2048

Source = Literal["model", "tool", "program", "grammar"]

# Why a tool call that was still open when its row ended got no result (the refusal's reason).
_UNFINISHED_CALL = {
    "length": "the reply hit max_tokens",
    "context": "the reply hit the context limit",
    "program": "the program ended",
    "error": "the reply stopped on an error",
}

def call_routing(config: Any, settings: GenerationSettings) -> tuple[str, float | None]:
    """The routing ("student" or "off") and router threshold a call runs at: its settings', or those of its named
    level (`routing_level`, one of the model's `stt.config.routing_levels`)."""
    if settings.routing_level is None:
        return settings.routing, settings.routing_threshold
    threshold = routing_levels(config)[routing_level(config, settings.routing_level)]
    return ("off", None) if threshold is None else ("student", threshold)


def prompt_routing(model: ModelLike, routing: str) -> str:
    """The routing a call's prompts run at: a model whose config says `route_prompt = False` runs its prompts through
    every layer, and only generated tokens skip."""
    return routing if getattr(model.config, "route_prompt", True) else "off"


def prefill_row(
    model: ModelLike, cache: KVCacheLike, ids: Sequence[int], routing: str, threshold: float | None, capture: bool = False
) -> ForwardOutput:
    """Prefill one prompt into a cache of one row (a batch's row: `KVCache.row`) in chunks of `PREFILL_TOKENS`, and
    return the last chunk's output with the routing of every chunk joined, (L_stt, 1, T). The chunks depend on the
    prompt's own length only, so its numbers never depend on the prompts beside it: a product's kernel, and the
    order of its sums, depend on how many rows it is given (`stt.weights.DEQUANT_ROWS`, and oneDNN's own choice of
    kernel by shape). Prefilling a batch's prompts together in one product is faster (32 short prompts: 0.66 s
    against ~3.4 s one by one, 0.68x the whole batch's throughput) but gives a row other numbers than alone
    (docs/benchmarks.md, batch_throughput.py). `capture`: every layer's output at the last token (the lens)."""
    tokens = torch.tensor(ids, dtype=torch.long, device=model.device)[None]
    outs = []
    for start in range(0, len(ids), PREFILL_TOKENS):
        chunk = tokens[:, start : start + PREFILL_TOKENS]
        width = torch.full((1,), chunk.shape[1], dtype=torch.long, device=model.device)
        last = start + PREFILL_TOKENS >= len(ids)
        kept = "last" if capture and last else None
        outs.append(model.extend(chunk, width, cache, routing=routing, threshold=threshold, capture=kept))
    out = outs[-1]
    if len(outs) > 1:
        out = replace(
            out,
            router_probs=torch.cat([o.router_probs for o in outs], dim=2),
            selected=torch.cat([o.selected for o in outs], dim=2),
        )
    return out


# A prompt token's routing: per STT layer, (router probabilities, computed flags).
TokenRouting = tuple[tuple[float, ...], tuple[bool, ...]]


@dataclass
class RowState:
    """Host-side state of one request row while it is generating."""

    index: int  # request row: prompt_index * num_samples + sample_index
    settings: GenerationSettings
    stops: frozenset[int]
    detok: Detokenizer
    tools: ToolMachine | None
    seen: int  # tokens in this row's cache: mirrors cache.seen without reading the device
    constraint: ConstraintLike | None = None  # the row's grammar state, if any
    sampled: int = 0
    finished: bool = False

    @property
    def grammar(self) -> ConstraintLike | None:
        """The grammar that masks and fast-forwards the row now: its request's constraint, else the open tool call's
        (`tools.py`). A request's constraint covers its tool calls too."""
        if self.constraint is not None:
            return self.constraint
        return None if self.tools is None else self.tools.grammar


@dataclass(frozen=True)
class KnownRun:
    """Known tokens a row feeds this step instead of a sampled one: a tool's output or grammar-forced tokens."""

    source: Source
    items: list[ForcedToken]


@dataclass(frozen=True)
class Emitted:
    """One token a row emitted in a step, and where it came from."""

    token: int
    source: Source
    tool: ToolEvent | None
    tags: tuple[str, ...]
    zone: str | None


@dataclass(frozen=True)
class ProgramOutputs:
    """The automaton's step results on the device (per row): what it forced, tags, zone row, halted, pending feed."""

    forced: torch.Tensor  # (B,) bool
    tags: torch.Tensor  # (B, N) bool
    zone_rows: torch.Tensor  # (B,) the zone row each token was emitted in
    halted: torch.Tensor  # (B,) bool
    pending: torch.Tensor  # (B,) feed tokens each row emits before the model's next token

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.forced, self.tags, self.zone_rows, self.halted, self.pending


@dataclass(frozen=True)
class FeedPeek:
    """The program feeds some rows fast-forward this step, on the device: (B, k) ids, (B, k, N) tags, (B, k) zones."""

    ids: torch.Tensor
    tags: torch.Tensor
    zone_rows: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.tags, self.zone_rows


@dataclass(frozen=True)
class HostFeed:
    """One row's fast-forwarded program feed on the host: its tokens with their tags and zones."""

    tokens: list[int]
    tags: list[tuple[str, ...]]
    zones: list[str | None]


@dataclass
class HostProgram:
    """The automaton's step results on the host, per row."""

    forced: list[bool]
    tags: list[tuple[str, ...]]
    zones: list[str | None]
    halted: list[bool]
    pending: list[int]
    feeds: list[HostFeed] | None = None  # with fast-forwarded feeds this step


@dataclass
class HostStep:
    """A step's device results on the host (the unpacked single copy)."""

    tokens: list[int]  # the token each row fed first
    router_probs: list[list[list[float]]] | None = None  # [row][position][stt layer], with routing reported
    computed: list[list[list[bool]]] | None = None
    program: HostProgram | None = None
    logprobs: HostLogprobs | None = None  # with log-probs asked by some row


@dataclass(frozen=True)
class Fed:
    """What a step fed the model and what came back: the fed tokens (B, W) — exactly the tokens the rows emit —,
    the forward's output with each row's last logits (B, V), and, for a fast-forward step with log-probs on,
    every position's logits (B, W, V) (None otherwise)."""

    ids: torch.Tensor
    out: ForwardOutput
    logits: torch.Tensor
    position_logits: torch.Tensor | None = None
    lengths: torch.Tensor | None = None  # (B,) tokens each row fed, on a ragged step (None: one each)


@dataclass
class DeviceBatch:
    """The device batch: rows in device order and the tensors that follow them through compaction."""

    rows: list[RowState]
    cache: KVCacheLike
    logits: torch.Tensor  # (B, V) for the next token of every row
    params: SamplingParams
    counters: torch.Tensor  # (B,) int64: tokens emitted per row = its next random draw number
    routing: str
    threshold: float | None
    may_compact: bool  # False when the caller owns the cache object (chat sessions)
    program: ProgramRunner | None = None  # the TTFA automaton when any row runs a program
    pending: list[int] | None = None  # host copy of the program's pending feed per row (from the last step)
    finished: int = 0  # rows finished but still occupying a device slot
    top_n: int = 0  # alternatives to measure per token: the most any row asks for (0: no log-probs at all)
    penalties: PenaltyState | None = None  # the rows' penalties on repeats, when any row has one

    @property
    def active(self) -> int:
        return len(self.rows) - self.finished


@dataclass
class DecodeLoop:
    """Runs prepared rows over a model: prefill, then steps until every row finished."""

    model: ModelLike
    context_size: int
    fast_forward: Literal["auto", "always"] = "auto"  # policy for rows whose settings allow it (module doc)
    token_bytes: Callable[[int], bytes] | None = None  # each token's text, for DRY's sequence breakers
    _breakers: BreakerMask | None = field(default=None, init=False, repr=False)

    def breaker_mask(self, breakers: tuple[str, ...]) -> torch.Tensor:
        """(V,) bool: the tokens whose text holds one of `breakers` (DRY's sequence breakers), found once a set."""
        if self._breakers is None:
            vocab = int(self.model.config.vocab_size)
            text = self.token_bytes if self.token_bytes is not None else (lambda token: b"")
            self._breakers = breaker_mask_for(text, vocab, self.device)
        return self._breakers(breakers)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def stream(
        self,
        prompt_ids: list[list[int]],
        rows: list[RowState],
        cache: KVCacheLike,
        *,
        num_samples: int = 1,
        may_compact: bool = True,
        programs: Sequence[Program | None] | None = None,
    ) -> Iterator[Step]:
        """Prefill `prompt_ids` (one list per prompt) into `cache`, then decode until every row finished."""
        batch, info = self.open(prompt_ids, rows, cache, num_samples=num_samples, may_compact=may_compact)
        if programs and any(p is not None for p in programs):
            batch.program = ProgramRunner(programs, self.device)
            batch.pending = batch.program.pending_feed().tolist()  # later steps bring it in their one copy
        index = 0
        while batch.active:
            step = self.step(batch, index)
            yield step if index else Step(step.index, step.tokens, step.seconds, step.active_rows, prompt=info)
            index += 1

    def open(
        self,
        prompt_ids: list[list[int]],
        rows: list[RowState],
        cache: KVCacheLike,
        *,
        num_samples: int = 1,
        may_compact: bool = True,
    ) -> tuple[DeviceBatch, PromptInfo]:
        """Prefill `prompt_ids` into `cache` (each prompt in its own row, replicated for `num_samples`) and return
        the device batch ready for its first step, with what was prefilled."""
        started = time.perf_counter()
        # Routing is a property of the whole call (checked by the front).
        routing, threshold = call_routing(self.model.config, rows[0].settings)
        # inference_mode (cheaper than no_grad) is entered per step, never across a `yield`: the consumer's own
        # code must not run in it.
        with torch.inference_mode():
            logits, prompt_routing = self._prefill(prompt_ids, cache, routing, threshold)
            if num_samples > 1:
                index = torch.arange(len(prompt_ids), device=self.device).repeat_interleave(num_samples)
                cache = cache.select_rows(index)
                logits = logits.index_select(0, index)
        for row, ids in zip(rows, (p for p in prompt_ids for _ in range(num_samples)), strict=True):
            row.seen += len(ids)
        info = self._prompt_info(prompt_ids, rows, num_samples, prompt_routing, time.perf_counter() - started)
        batch = DeviceBatch(
            rows=rows,
            cache=cache,
            logits=logits,
            params=SamplingParams.build(
                [r.settings for r in rows], [i % num_samples for i in range(len(rows))], self.device
            ),
            counters=torch.zeros(len(rows), dtype=torch.long, device=self.device),
            routing=routing,
            threshold=threshold,
            may_compact=may_compact,
            top_n=max(r.settings.logprobs for r in rows),
            penalties=PenaltyState.build([r.settings for r in rows], logits.shape[-1], self.device, self.breaker_mask),
        )
        return batch, info

    def step(self, batch: DeviceBatch, index: int) -> Step:
        """One decode step of `batch` (every active row emits its next token or known run), then compaction."""
        with torch.inference_mode():
            step = self._step(batch, index)
            self._maybe_compact(batch)
        return step

    def admit(self, batch: DeviceBatch, newcomers: Sequence[DeviceBatch]) -> None:
        """Join the rows of `newcomers` (batches `open` prefilled, each into a cache of its own) to `batch` between
        two steps, in one copy of the cache: continuous batching. Each newcomer was prefilled alone, and a decode
        step computes every row the same whatever rows are beside it, so an admitted row emits what it would
        alone."""
        for new in newcomers:
            if new.program is not None or batch.program is not None:
                raise ValueError("rows running TTFA programs cannot join a running batch")
            if (new.routing, new.threshold) != (batch.routing, batch.threshold):
                raise ValueError("rows joining a running batch must share its routing")
        with torch.inference_mode():
            batch.cache = batch.cache.join(*(new.cache for new in newcomers))
            batch.logits = torch.cat([batch.logits, *(new.logits for new in newcomers)])
            batch.params = batch.params.join(*(new.params for new in newcomers))
            batch.counters = torch.cat([batch.counters, *(new.counters for new in newcomers)])
            batch.penalties = PenaltyState.join([(b.penalties, len(b.rows)) for b in (batch, *newcomers)])
        for new in newcomers:
            batch.rows = batch.rows + new.rows
            batch.finished += new.finished
            batch.top_n = max(batch.top_n, new.top_n)

    def cancel(self, batch: DeviceBatch, indices: set[int]) -> list[int]:
        """End the rows whose request row index is in `indices` (their consumer left): they are fed nothing from
        the next step on, and the batch drops them at once. Returns the indices that were still running."""
        ended = []
        for row in batch.rows:
            if row.index in indices and not row.finished:
                row.finished = True
                batch.finished += 1
                ended.append(row.index)
        if ended:
            with torch.inference_mode():
                self._maybe_compact(batch, at_once=True)
        return ended

    # ------------------------------------------------------------------------------------------------ prefill
    def _prefill(
        self, prompt_ids: list[list[int]], cache: KVCacheLike, routing: str, threshold: float | None
    ) -> tuple[torch.Tensor, list[list[TokenRouting]] | None]:
        """Feed every row's prompt and return the logits after each row's last token, plus per-row per-token routing
        (None with routing off). One host copy for the routing, at the end. A model whose config says
        `route_prompt = False` runs its prompts through every layer: only generated tokens skip."""
        routing = prompt_routing(self.model, routing)
        device = self.device
        logits: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        chosen: list[torch.Tensor] = []
        # Each prompt is prefilled on its own, into its row of the cache (`prefill_row`): its numbers then never
        # depend on the prompts beside it, so a batch answers as each of its prompts alone does.
        bound = cache.host_bound  # every row starts from the cache's bound before the call, whatever rows came first
        for b, ids in enumerate(prompt_ids):
            row = cache.row(b)
            row.host_bound = bound
            out = prefill_row(self.model, row, ids, routing, threshold)
            logits.append(out.logits[0])
            probs.append(out.router_probs[:, 0])
            chosen.append(out.selected[:, 0])
            cache.host_bound = max(cache.host_bound, row.host_bound)
        if routing == "off":
            _synchronize(device)
            return torch.stack(logits), None
        probs_host = torch.cat(probs, dim=1).T.cpu().tolist()  # (sum T, L)
        chosen_host = torch.cat(chosen, dim=1).T.cpu().tolist()
        routing_rows, at = [], 0
        for ids in prompt_ids:
            routing_rows.append([(tuple(probs_host[t]), tuple(chosen_host[t])) for t in range(at, at + len(ids))])
            at += len(ids)
        return torch.stack(logits), routing_rows

    def _prompt_info(
        self,
        prompt_ids: list[list[int]],
        rows: list[RowState],
        num_samples: int,
        routing: list[list[TokenRouting]] | None,
        seconds: float,
    ) -> PromptInfo:
        per_row = [p for p in range(len(prompt_ids)) for _ in range(num_samples)]
        return PromptInfo(
            rows=len(rows),
            prompt_tokens=tuple(len(prompt_ids[p]) for p in per_row),
            prefill_seconds=seconds,
            router_probs=None if routing is None else tuple(tuple(t[0] for t in routing[p]) for p in per_row),
            computed=None if routing is None else tuple(tuple(t[1] for t in routing[p]) for p in per_row),
            context_used=tuple(r.seen for r in rows),
            context_size=self.context_size,
        )

    # --------------------------------------------------------------------------------------------------- step
    def _step(self, batch: DeviceBatch, index: int) -> Step:
        """One model forward: sample, apply forced tokens (known runs, then the program), feed, copy to host once,
        update rows, build events."""
        started = time.perf_counter()
        rows, program = batch.rows, batch.program
        # The model's own view of the next token, taken before the grammar masks the logits in place.
        head_log_probs = model_log_probs(batch.logits) if batch.top_n else None
        if any(row.grammar is not None and not row.finished for row in rows):
            apply_masks(batch.logits, [None if r.finished else r.grammar for r in rows], batch.logits.shape[-1])
        if batch.penalties is not None:
            batch.penalties.apply(batch.logits)
        if batch.top_n:
            sampled, sampling_log_probs = sample_with_log_probs(batch.logits, batch.params, batch.counters)
        else:
            sampled, sampling_log_probs = sample(batch.logits, batch.params, batch.counters), None
        fast = self.fast_forward == "always" or batch.active == 1 or self.device.type == "cuda"
        # Tool output is fast-forwarded only without a program: with one, every tool token must pass the automaton.
        runs = {
            i: run
            for i, row in enumerate(rows)
            if not row.finished and (run := self._known_run(row, fast and not program))
        }
        feed_counts = self._feed_counts(batch, runs) if program is not None and fast else {}
        width = max([1, *(len(run.items) for run in runs.values()), *feed_counts.values()])
        self._ensure_capacity(batch.cache, width)
        known = self._known_ids(batch, runs, width) if runs else None
        # The token each row feeds first: its sample, a known run's first token, or what the program puts instead.
        heads = sampled if known is None else torch.where(known[1], known[0][:, 0], sampled)
        outputs = peek = None
        if program is not None:
            if feed_counts:
                peek = FeedPeek(*program.peek(max(feed_counts.values())))
                counts = torch.tensor([feed_counts.get(i, 0) for i in range(len(rows))], device=self.device)
                heads, forced, tags, zone_rows = program.step_and_advance(heads, counts)
            else:
                heads, forced, tags, zone_rows = program.step(heads)
            outputs = ProgramOutputs(forced, tags, zone_rows, program.halted(), program.pending_feed())
        if width == 1 and not batch.finished:  # the common case: every row feeds one token
            out = self.model.decode(heads, batch.cache, routing=batch.routing, threshold=batch.threshold)
            batch.counters += 1
            fed = Fed(heads[:, None], out, out.logits)
        else:
            fed = self._feed_ragged(batch, heads, runs, feed_counts, width, known, peek)
        batch.logits = fed.logits
        if batch.penalties is not None:
            batch.penalties.append(fed.ids, self._seen_counts(fed, runs, known))
        logprobs = None
        if head_log_probs is not None and sampling_log_probs is not None:
            logprobs = measure(self._emitted_log_probs(head_log_probs, fed), fed.ids, sampling_log_probs, batch.top_n)
        host = self._to_host(heads, fed.out, batch.routing != "off", outputs, peek, program, logprobs)
        batch.pending = host.program.pending if host.program is not None else None

        events: list[TokenEvent] = []
        for i, row in enumerate(rows):
            if row.finished:
                continue
            emitted = self._emitted(row, i, runs.get(i), feed_counts.get(i, 0), host)
            events.extend(self._advance_row(row, emitted, i, host))
            if row.finished:
                batch.finished += 1
        return Step(index, tuple(events), time.perf_counter() - started, batch.active)

    @staticmethod
    def _emitted_log_probs(head: torch.Tensor, fed: Fed) -> torch.Tensor:
        """(B, W, V) the model's log-probs for each token the rows emitted this step: token 0 from the logits the
        last step left (`head`, unmasked), token j of a fast-forwarded run from the run's own position j - 1."""
        if fed.position_logits is None or fed.ids.shape[1] == 1:
            return head[:, None]
        return torch.cat([head[:, None], model_log_probs(fed.position_logits[:, :-1])], dim=1)

    def _seen_counts(
        self, fed: Fed, runs: dict[int, KnownRun], known: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """(B,) how many of the tokens each row fed this step its penalties see: all of them, except a tool's
        output (unless the program put its own token in the tool token's place) and a finished row's nothing."""
        rows = fed.ids.shape[0]
        counts = fed.lengths if fed.lengths is not None else torch.ones(rows, dtype=torch.long, device=self.device)
        tools = [i for i, run in runs.items() if run.source == "tool"]
        if tools and known is not None:
            is_tool = torch.zeros(rows, dtype=torch.bool, device=self.device)
            is_tool[tools] = True
            counts = torch.where(is_tool & (fed.ids[:, 0] == known[0][:, 0]), 0, counts)
        return counts

    def _feed_counts(self, batch: DeviceBatch, runs: dict[int, KnownRun]) -> dict[int, int]:
        """Rows that fast-forward their program's pending feed this step, and how many feed tokens each emits.
        A one-token feed is simply stepped (nothing to save); a row with a tool or grammar run steps it first."""
        if batch.pending is None:
            return {}
        return {
            i: min(pending, self.context_size - row.seen)
            for i, (row, pending) in enumerate(zip(batch.rows, batch.pending, strict=True))
            if pending >= 2 and not row.finished and i not in runs and row.settings.fast_forward
        }

    def _known_ids(
        self, batch: DeviceBatch, runs: dict[int, KnownRun], width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (B, width), is_known (B,)) on the device for a step where some rows feed known runs.

        Built on the host and copied over once: these steps are rare (tool output, grammar-forced tokens)."""
        ids = [[0] * width for _ in batch.rows]
        is_known = [False] * len(batch.rows)
        for i, run in runs.items():
            ids[i][: len(run.items)] = [f.token for f in run.items]
            is_known[i] = True
        device = self.device
        return torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(is_known, device=device)

    def _feed_ragged(
        self,
        batch: DeviceBatch,
        heads: torch.Tensor,
        runs: dict[int, KnownRun],
        feed_counts: dict[int, int],
        width: int,
        known: tuple[torch.Tensor, torch.Tensor] | None,
        peek: FeedPeek | None,
    ) -> Fed:
        """Feed a step where some rows fast-forward a known run or a program feed, or are finished (length 0):
        one `extend` call; every other row feeds its one token of `heads`. With log-probs on, the call returns every
        position's logits (one LM-head product per fed token, only on these rare steps)."""
        lengths = [0 if row.finished else 1 for row in batch.rows]
        for i, run in runs.items():
            lengths[i] = len(run.items)
        for i, count in feed_counts.items():
            lengths[i] = count
        device = self.device
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
        ids = known[0] if known is not None else torch.zeros(len(batch.rows), width, dtype=torch.long, device=device)
        ids[:, 0] = heads
        if peek is not None:
            k = peek.ids.shape[1]
            feeding = torch.tensor([i in feed_counts for i in range(len(batch.rows))], device=device)
            ids[:, :k] = torch.where(feeding[:, None], peek.ids, ids[:, :k])
        every_position = bool(batch.top_n)
        out = self.model.feed(
            ids, lengths_t, batch.cache, routing=batch.routing, threshold=batch.threshold, all_logits=every_position
        )
        batch.counters += lengths_t
        if not every_position:
            return Fed(ids, out, out.logits, lengths=lengths_t)
        last = out.logits[torch.arange(len(batch.rows), device=device), (lengths_t - 1).clamp(min=0)]
        return Fed(ids, out, last, out.logits, lengths=lengths_t)

    def _known_run(self, row: RowState, fast: bool) -> KnownRun | None:
        """The tokens a row will emit next that are already known: its tool's queued output, else the tokens its
        grammar leaves no choice about. The whole run when fast-forwarding (up to the room left), else one."""
        room = self.context_size - row.seen
        count = room if fast and row.settings.fast_forward else 1
        if row.tools is not None and row.tools.queue:
            queue = row.tools.queue
            return KnownRun("tool", [queue.popleft() for _ in range(min(len(queue), count))])
        if row.grammar is not None and (known := row.grammar.ff_tokens()):
            return KnownRun("grammar", [ForcedToken(t) for t in known[:count]])
        return None

    @staticmethod
    def _emitted(row: RowState, slot: int, run: KnownRun | None, feed_count: int, host: HostStep) -> list[Emitted]:
        """What a row emitted this step, with each token's source. A program that replaced a known token (a feed
        or a timeout) wins; a tool token goes back to the front of its queue (grammar tokens are recomputed)."""
        program = host.program
        if feed_count:
            assert program is not None and program.feeds is not None
            feed = program.feeds[slot]
            return [
                Emitted(t, "program", None, g, z)
                for t, g, z in zip(feed.tokens[:feed_count], feed.tags, feed.zones, strict=False)
            ]
        token = host.tokens[slot]
        by_program = program is not None and program.forced[slot]
        tags = program.tags[slot] if program is not None else ()
        zone = program.zones[slot] if program is not None else None
        if run is None:
            return [Emitted(token, "program" if by_program else "model", None, tags, zone)]
        head = run.items[0]
        if by_program and token != head.token:
            if run.source == "tool":
                assert row.tools is not None
                row.tools.queue.appendleft(head)
            return [Emitted(token, "program", None, tags, zone)]
        if program is not None:  # a program runs: the run is one token that passed the automaton
            return [Emitted(head.token, run.source, head.event, tags, zone)]
        return [Emitted(f.token, run.source, f.event, (), None) for f in run.items]

    def _ensure_capacity(self, cache: KVCacheLike, width: int) -> None:
        """Grow the cache (doubling, up to the context size) before a call could need more slots than it has.

        `cache.host_bound` is the cache's own host-side upper bound on any row's length, so this needs no device
        read; rows never pass the context size because the loop ends them there.
        """
        needed = cache.host_bound + width
        if needed > cache.max_len and cache.max_len < self.context_size:
            cache.grow(min(self.context_size, max(2 * cache.max_len, needed)))

    @staticmethod
    def _to_host(
        heads: torch.Tensor,
        out: ForwardOutput,
        with_routing: bool,
        outputs: ProgramOutputs | None,
        peek: FeedPeek | None,
        program: ProgramRunner | None,
        logprobs: LogprobTensors | None = None,
    ) -> HostStep:
        """The step's one device→host copy: tokens; routing (L_stt, B, T) when it is reported; the program's
        outputs when a program runs, and the fast-forwarded feeds; log-probs when asked. Everything is packed into
        one float64 tensor (exact for token ids, flags and float32 probabilities, -inf included)."""
        size = heads.shape[0]
        parts = [heads.double()]
        if with_routing:
            parts += [out.router_probs.double().flatten(), out.selected.double().flatten()]
        if outputs is not None:
            parts += [t.double().flatten() for t in outputs.tensors()]
        if peek is not None:
            parts += [t.double().flatten() for t in peek.tensors()]
        if logprobs is not None:
            parts += [t.double().flatten() for t in logprobs.tensors()]
        packed = parts[0].cpu() if len(parts) == 1 else torch.cat(parts).cpu()
        host = HostStep(tokens=packed[:size].long().tolist())
        offset = size

        def take(*shape: int) -> torch.Tensor:
            nonlocal offset
            count = math.prod(shape)
            chunk = packed[offset : offset + count].view(*shape)
            offset += count
            return chunk

        if with_routing:
            layers, _, width = out.router_probs.shape
            host.router_probs = take(layers, size, width).permute(1, 2, 0).tolist()
            host.computed = take(layers, size, width).permute(1, 2, 0).bool().tolist()
        if outputs is not None and program is not None:
            tag_count = outputs.tags.shape[1]
            host.program = HostProgram(
                forced=take(size).bool().tolist(),
                tags=[program.tag_tuple(f) for f in take(size, tag_count).bool().tolist()],
                zones=program.zone_labels(take(size).long().tolist()),
                halted=take(size).bool().tolist(),
                pending=take(size).long().tolist(),
            )
            if peek is not None:
                k = peek.ids.shape[1]
                tokens = take(size, k).long().tolist()
                tags = take(size, k, tag_count).bool().tolist()
                zones = take(size, k).long().tolist()
                host.program.feeds = [
                    HostFeed(tokens[b], [program.tag_tuple(f) for f in tags[b]], program.zone_labels(zones[b]))
                    for b in range(size)
                ]
        if logprobs is not None:
            _, width, top_n = logprobs.top_ids.shape
            host.logprobs = HostLogprobs.unpack(take, size, width, top_n)
        return host

    def _advance_row(self, row: RowState, emitted: list[Emitted], slot: int, host: HostStep) -> list[TokenEvent]:
        """Account for the tokens a row emitted this step (all already fed) and return their events."""
        pieces: list[dict[str, Any]] = []
        finish: FinishReason | None = None
        error = None
        for position, item in enumerate(emitted):
            token, tool_event = item.token, item.tool
            text, special = row.detok.push(token)
            if item.source == "model":
                row.sampled += 1
            if item.source != "tool" and row.constraint is not None and finish is None:
                try:
                    row.constraint.consume(token)
                except ChatappError as err:  # a forced token the grammar rejects: the row cannot go on
                    finish, error = "error", user_message(err).one_line()
            if item.source != "tool":  # the model's tokens and the program's both end turns and open tool calls
                if token in row.stops:
                    finish = "stop"
                    tool_event = row.tools.interrupt("the reply ended") if row.tools else None
                elif row.tools is not None:
                    tool_event = row.tools.observe(token)
            pieces.append(
                {
                    "token": token,
                    "forced": item.source != "model",
                    "text": text,
                    "special": special,
                    "tags": item.tags,
                    "zone": item.zone,
                    "router_probs": None if host.router_probs is None else tuple(host.router_probs[slot][position]),
                    "computed": None if host.computed is None else tuple(host.computed[slot][position]),
                    "tool": tool_event,
                    "logprobs": self._token_logprobs(row, slot, position, item, host),
                }
            )
        row.seen += len(emitted)
        if finish is None:
            queued = row.tools is not None and bool(row.tools.queue)
            if row.seen >= self.context_size:
                finish = "context"
                error = user_message(
                    ContextOverflowError(
                        f"the context is full ({self.context_size} tokens); the reply was cut here",
                        hint="shorten the prompt (or the conversation) to leave the reply room",
                    )
                ).one_line()
            elif host.program is not None and host.program.halted[slot]:
                finish = "program"
            elif not queued and row.sampled >= row.settings.max_tokens:
                finish = "length"
        if finish is not None:
            row.finished = True
            last = pieces[-1]
            last["text"] += row.detok.flush()
            last["finish_reason"] = finish
            last["error"] = error
            if finish != "stop" and row.tools is not None:
                last["tool"] = last["tool"] or row.tools.interrupt(_UNFINISHED_CALL[finish])
        return [TokenEvent(row=row.index, **piece) for piece in pieces]

    @staticmethod
    def _token_logprobs(
        row: RowState, slot: int, position: int, item: Emitted, host: HostStep
    ) -> TokenLogprobs | None:
        """The token's `TokenLogprobs` when its row asked for them (None otherwise)."""
        if host.logprobs is None or not row.settings.logprobs:
            return None
        drawn = item.source == "model"
        return host.logprobs.token(slot, position, item.token, row.settings.logprobs, drawn, row.detok.token_bytes)

    def _maybe_compact(self, batch: DeviceBatch, at_once: bool = False) -> None:
        """Drop finished rows from the device batch once they are at least a quarter of it (see module doc), or
        now with `at_once`."""
        if not batch.finished or not batch.active or not batch.may_compact:
            return
        if not at_once and batch.finished < max(1, len(batch.rows) // 4):
            return
        keep = [i for i, row in enumerate(batch.rows) if not row.finished]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        batch.rows = [batch.rows[i] for i in keep]
        batch.cache = batch.cache.select_rows(index)
        batch.logits = batch.logits.index_select(0, index)
        batch.params = batch.params.select(index)
        batch.counters = batch.counters.index_select(0, index)
        if batch.penalties is not None:
            batch.penalties = batch.penalties.select(index)
        if batch.program is not None:
            batch.program.select_rows(index)
        if batch.pending is not None:
            batch.pending = [batch.pending[i] for i in keep]
        batch.finished = 0


def _synchronize(device: torch.device) -> None:
    """Wait for queued device work (timing only); free on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
