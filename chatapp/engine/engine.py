"""The Engine: batched, streaming generation over the STT model's KV cache. This file tells the whole story.

    prompts ─► prefill (ragged, one chunked `extend` per batch) ─► replicate rows for num_samples
      loop:  sample(logits) on device ─► forced tokens from the rows' tool queues replace samples
             ─► model.decode (or a ragged `extend` when some row fast-forwards a forced run)
             ─► ONE device→host copy (tokens + routing) ─► per-row host bookkeeping ─► Step event

What it does differently from nanochat's engine (REFERENCES.md lists that engine's weaknesses):
- Ragged batches: every row has its own position (`cache.seen[b]`); prompts of different lengths prefill together.
- Per-row randomness keyed by (seed, sample index, tokens emitted) — see `sampling.py` — so a row's tokens do not
  depend on what else is in the batch.
- `max_tokens` counts sampled tokens only; forced tool output never eats the budget.
- Finished rows stop costing compute: they are fed nothing (length 0) and the batch is compacted with
  `cache.select_rows` once at least a quarter of the device batch has finished (compacting copies the cache, so
  doing it on every single finish would cost more than it saves on large batches; small batches compact at once).
- The cache never overflows: the host mirrors each row's position, grows the cache on demand up to the model's
  context size, and ends a row that fills the context with finish reason "context" and a message.
- Every emitted token has been fed to the model before it is reported (the stop token too), so its routing
  probabilities/decisions are the ones of the forward that processed it, and a cancelled chat session's cache
  holds exactly the tokens the consumer saw.

Fast-forward. A row whose next tokens are already known (a tool's output block) pushes the whole run through one
ragged `extend` call while the other rows advance by their one sampled token. The tokens are those of the
one-per-step path by construction: forced tokens are never sampled, and each forced token still consumes one
draw counter, so the row's later random draws are unchanged (tests compare both paths). When it pays off depends
on the hardware: the other rows of a ragged call are padded to the run's width, which is nearly free on a GPU
(decode is memory-bound) but is wasted compute on a CPU. Measured on CPU (benchmarks/engine_vs_transformers.py):
1.5x faster with one row, 0.85x with eight. So the default policy `fast_forward="auto"` fast-forwards when the
device batch has a single active row or runs on CUDA, and otherwise feeds forced tokens one per step (still
never sampled); `"always"` fast-forwards whenever the row's settings allow it.

Host work per step is O(rows) bookkeeping (detokenization, stop/length checks, the tool machine) on plain Python
values after the single copy; the device side has no per-row Python loop and no other synchronisation.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from chatapp.engine.detok import Detokenizer, TokenBytes
from chatapp.engine.events import FinishReason, PromptInfo, Step, TokenEvent, ToolEvent
from chatapp.engine.sampling import SamplingParams, sample
from chatapp.engine.tools import DEFAULT_MAX_EXPRESSION_TOKENS, ForcedToken, ToolBox, ToolMachine
from chatapp.errors import ContextOverflowError, ConversationError, SettingsError
from chatapp.settings import GenerationSettings
from chatapp.tools import TOOLS, Tool

PREFILL_CHUNK = 512  # prompt tokens per row per prefill forward: bounds the attention scores' memory
CACHE_SLACK = 64  # extra cache slots allocated up front for forced tool output


class ChatFormatLike(Protocol):
    """What the engine needs from `chatapp.chat.ChatFormat` / `TemplateChatFormat` (the engine sits below `chat`
    in the import layering, so it takes the object without importing its class)."""

    supports_tools: bool
    assistant_end_id: int | None
    stop_token_ids: tuple[int, ...]

    def encode_text(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def render_conversation(
        self, messages: Sequence[Any], max_tokens: int | None = None
    ) -> tuple[list[int], list[int]]: ...
    def render_for_completion(self, messages: Sequence[Any]) -> list[int]: ...


@dataclass
class GenerationResult:
    """One row of `generate_batch`: what it emitted, without the final stop token (kept in `stop_token`)."""

    row: int
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_token: int | None = None
    tool_events: list[ToolEvent] = field(default_factory=list)
    error: str | None = None

    @property
    def sampled_tokens(self) -> int:
        return self.forced.count(False)


@dataclass
class _Row:
    """Host-side state of one request row while it is generating."""

    index: int  # request row: prompt_index * num_samples + sample_index
    settings: GenerationSettings
    stops: frozenset[int]
    detok: Detokenizer
    tools: ToolMachine | None
    seen: int  # tokens in this row's cache: mirrors cache.seen without reading the device
    sampled: int = 0
    finished: bool = False

    def take_forced(self, room: int, fast_forward: bool) -> list[ForcedToken]:
        """The forced tokens to feed this step: the whole queued run (up to `room`) when fast-forwarding, else one."""
        assert self.tools is not None
        queue = self.tools.queue
        count = min(len(queue), room if fast_forward and self.settings.fast_forward else 1)
        return [queue.popleft() for _ in range(count)]


@dataclass
class _Batch:
    """The device batch: rows in device order and the tensors that follow them through compaction."""

    rows: list[_Row]
    cache: Any  # chatapp.stt.KVCache (or a test double with the same interface)
    logits: torch.Tensor  # (B, V) for the next token of every row
    params: SamplingParams
    counters: torch.Tensor  # (B,) int64: tokens emitted per row = its next random draw number
    routing: str
    threshold: float | None
    may_compact: bool  # False when the caller owns the cache object (chat sessions)
    finished: int = 0  # rows finished but still occupying a device slot

    @property
    def active(self) -> int:
        return len(self.rows) - self.finished


class Engine:
    """Generation over an STT (or plain Qwen2) model: streaming `generate`, collected `generate_batch`, sessions."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        chat_format: ChatFormatLike,
        *,
        tools: Iterable[Tool] | None = None,
        context_size: int | None = None,
        max_expression_tokens: int = DEFAULT_MAX_EXPRESSION_TOKENS,
        fast_forward: Literal["auto", "always"] = "auto",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.token_bytes = TokenBytes(tokenizer)
        self.context_size = int(context_size or model.config.max_position_embeddings)
        self.fast_forward = fast_forward  # policy for rows whose settings allow it; see the module docstring
        box = ToolBox(
            TOOLS if tools is None else tools,
            token_id=tokenizer.token_to_id,
            encode_text=chat_format.encode_text,
            decode=chat_format.decode,
            max_expression_tokens=max_expression_tokens,
        )
        self.toolbox = box if chat_format.supports_tools and box else None

    @property
    def stt_layers(self) -> list[int]:
        """Indices of the model's STT layers: the order of every routing tuple in the events."""
        return list(self.model.stt_layer_indices)

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ---------------------------------------------------------------------------------------------- public API
    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str],
        settings: GenerationSettings | Sequence[GenerationSettings] = GenerationSettings(),
        num_samples: int = 1,
        programs: Sequence[Any] | None = None,
        constraints: Sequence[Any] | None = None,
    ) -> Iterator[Step]:
        """Stream `Step`s for `prompts` (token ids, or strings rendered as one user turn). `settings` is one for
        all prompts or one per prompt. Row index = prompt_index * num_samples + sample_index.

        Input errors raise here, before the first step. Closing the returned generator frees everything.
        """
        if programs is not None or constraints is not None:
            raise SettingsError(
                "TTFA programs and constraints are not wired into this engine yet",
                hint="generate without programs/constraints",
            )
        if num_samples < 1:
            raise SettingsError(f"num_samples must be >= 1, got {num_samples}")
        feeds = [self._prompt_ids(p) for p in prompts]
        per_prompt = self._settings_per_prompt(settings, len(feeds))
        for i, feed in enumerate(feeds):
            self._check_fits(i, 0, len(feed))
        initial = max(len(f) for f in feeds) + max(s.max_tokens for s in per_prompt) + CACHE_SLACK
        cache = self.model.new_cache(len(feeds), min(self.context_size, initial))
        rows = [
            self._new_row(p * num_samples + s, per_prompt[p], seen=0)
            for p in range(len(feeds))
            for s in range(num_samples)
        ]
        return self._stream(feeds, rows, cache, num_samples=num_samples, may_compact=True)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str],
        settings: GenerationSettings | Sequence[GenerationSettings] = GenerationSettings(),
        num_samples: int = 1,
        programs: Sequence[Any] | None = None,
        constraints: Sequence[Any] | None = None,
    ) -> list[GenerationResult]:
        """Run `generate` to the end and collect each row's tokens, forced mask, text, finish reason, tool events."""
        results: list[GenerationResult] = []
        for step in self.generate(prompts, settings, num_samples, programs, constraints):
            if step.prompt is not None:
                results = [GenerationResult(i, n) for i, n in enumerate(step.prompt.prompt_tokens)]
            for event in step.tokens:
                collect_event(results[event.row], event)
        return results

    def session(self, system: str | None = None) -> Any:
        """A multi-turn chat that keeps its KV cache between turns (`chatapp.engine.session.ChatSession`)."""
        from chatapp.engine.session import ChatSession

        return ChatSession(self, system=system)

    # ------------------------------------------------------------------------------------------------ requests
    def _prompt_ids(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            return self.chat_format.render_for_completion([{"role": "user", "content": prompt}])
        ids = [int(t) for t in prompt]
        if not ids:
            raise ConversationError("a prompt has no tokens", hint="give at least one token (e.g. <|bos|>)")
        return ids

    @staticmethod
    def _settings_per_prompt(
        settings: GenerationSettings | Sequence[GenerationSettings], prompts: int
    ) -> list[GenerationSettings]:
        per_prompt = [settings] * prompts if isinstance(settings, GenerationSettings) else list(settings)
        if len(per_prompt) != prompts:
            raise SettingsError(f"got {len(per_prompt)} settings for {prompts} prompts", hint="give one per prompt")
        # One model call serves the whole batch, so routing is a property of the call, not of a row.
        if len({(s.routing, s.routing_threshold) for s in per_prompt}) > 1:
            raise SettingsError(
                "rows of one generate call must share routing and routing_threshold",
                hint="run prompts with different routing settings in separate calls",
            )
        return per_prompt

    def _check_fits(self, index: int, used: int, new: int) -> None:
        """A prompt must leave room for at least one generated token."""
        if used + new >= self.context_size:
            raise ContextOverflowError(
                f"prompt {index} needs {used + new} tokens but the model's context holds {self.context_size}, "
                "with no room left to answer",
                hint="shorten the prompt, or start a new conversation",
            )

    def _new_row(self, index: int, settings: GenerationSettings, seen: int) -> _Row:
        stops = frozenset(settings.stop_tokens) | frozenset(self.chat_format.stop_token_ids)
        tools = ToolMachine(self.toolbox) if self.toolbox is not None else None
        return _Row(index, settings, stops, Detokenizer(self.token_bytes), tools, seen)

    # --------------------------------------------------------------------------------------------- generation
    def _stream(
        self,
        feeds: list[list[int]],
        rows: list[_Row],
        cache: Any,
        *,
        num_samples: int = 1,
        may_compact: bool = True,
    ) -> Iterator[Step]:
        """Prefill `feeds` (one per prompt) into `cache`, then decode until every row finished."""
        started = time.perf_counter()
        first = rows[0].settings
        # inference_mode (cheaper than no_grad) is entered per step, never across a `yield`: the consumer's own
        # code must not run in it.
        with torch.inference_mode():
            logits, prompt_routing = self._prefill(feeds, cache, first.routing, first.routing_threshold)
            if num_samples > 1:
                index = torch.arange(len(feeds), device=self.device).repeat_interleave(num_samples)
                cache = cache.select_rows(index)
                logits = logits.index_select(0, index)
        for row, feed in zip(rows, (f for f in feeds for _ in range(num_samples)), strict=True):
            row.seen += len(feed)
        info = self._prompt_info(feeds, rows, num_samples, prompt_routing, time.perf_counter() - started)
        batch = _Batch(
            rows=rows,
            cache=cache,
            logits=logits,
            params=SamplingParams.build([r.settings for r in rows], [r.index % num_samples for r in rows], self.device),
            counters=torch.zeros(len(rows), dtype=torch.long, device=self.device),
            routing=first.routing,
            threshold=first.routing_threshold,
            may_compact=may_compact,
        )
        index = 0
        while batch.active:
            with torch.inference_mode():
                step = self._step(batch, index)
                self._maybe_compact(batch)
            yield step if index else Step(step.index, step.tokens, step.seconds, step.active_rows, prompt=info)
            index += 1

    def _prefill(
        self, feeds: list[list[int]], cache: Any, routing: str, threshold: float | None
    ) -> tuple[torch.Tensor, list[list[tuple[tuple[float, ...], tuple[bool, ...]]]] | None]:
        """Feed every row's prompt (ragged, in chunks) and return the logits after each row's last token, plus
        per-row per-token routing (None with routing off). One host copy for the routing, at the end."""
        device = self.device
        lengths = torch.tensor([len(f) for f in feeds], dtype=torch.long)
        longest = int(lengths.max())
        padded = torch.zeros(len(feeds), longest, dtype=torch.long)
        for i, feed in enumerate(feeds):
            padded[i, : len(feed)] = torch.tensor(feed, dtype=torch.long)
        padded, lengths = padded.to(device), lengths.to(device)
        logits = None
        probs, chosen = [], []
        for start in range(0, longest, PREFILL_CHUNK):
            width = min(PREFILL_CHUNK, longest - start)
            chunk_lengths = (lengths - start).clamp(0, width)
            out = self.model.extend(
                padded[:, start : start + width], chunk_lengths, cache, routing=routing, threshold=threshold
            )
            ends_here = (chunk_lengths > 0) & (lengths <= start + width)
            logits = out.logits if logits is None else torch.where(ends_here[:, None], out.logits, logits)
            probs.append(out.router_probs)
            chosen.append(out.selected)
        assert logits is not None
        if routing == "off":
            _synchronize(device)
            return logits, None
        probs_host = torch.cat(probs, dim=2).permute(1, 2, 0).cpu().tolist()  # (B, T, L)
        chosen_host = torch.cat(chosen, dim=2).permute(1, 2, 0).cpu().tolist()
        routing_rows = [
            [(tuple(probs_host[b][t]), tuple(chosen_host[b][t])) for t in range(len(feed))]
            for b, feed in enumerate(feeds)
        ]
        return logits, routing_rows

    def _prompt_info(
        self,
        feeds: list[list[int]],
        rows: list[_Row],
        num_samples: int,
        routing: list[list[tuple[tuple[float, ...], tuple[bool, ...]]]] | None,
        seconds: float,
    ) -> PromptInfo:
        per_row = [p for p in range(len(feeds)) for _ in range(num_samples)]
        return PromptInfo(
            rows=len(rows),
            prompt_tokens=tuple(len(feeds[p]) for p in per_row),
            prefill_seconds=seconds,
            router_probs=None if routing is None else tuple(tuple(t[0] for t in routing[p]) for p in per_row),
            computed=None if routing is None else tuple(tuple(t[1] for t in routing[p]) for p in per_row),
            context_used=tuple(r.seen for r in rows),
            context_size=self.context_size,
        )

    def _step(self, batch: _Batch, index: int) -> Step:
        """One model forward: sample, apply forced runs, feed, copy to host once, update rows, build events."""
        started = time.perf_counter()
        rows = batch.rows
        sampled = sample(batch.logits, batch.params, batch.counters)
        fast = self.fast_forward == "always" or batch.active == 1 or self.device.type == "cuda"
        runs = {
            i: row.take_forced(self.context_size - row.seen, fast)
            for i, row in enumerate(rows)
            if row.tools is not None and row.tools.queue and not row.finished
        }
        width = max((len(run) for run in runs.values()), default=1)
        self._ensure_capacity(batch.cache, width)
        if not runs and not batch.finished:  # the common case: every row feeds its sampled token
            first = sampled
            out = self.model.decode(sampled, batch.cache, routing=batch.routing, threshold=batch.threshold)
            batch.counters += 1
        else:
            first, out = self._feed_ragged(batch, sampled, runs, width)
        batch.logits = out.logits
        tokens, probs, chosen = self._to_host(first, out, batch.routing != "off")

        events: list[TokenEvent] = []
        for i, row in enumerate(rows):
            if row.finished:
                continue
            run = runs.get(i)
            if run is None:
                emitted = [(tokens[i], False, None)]
            else:
                emitted = [(f.token, True, f.event) for f in run]
            events.extend(self._advance_row(row, emitted, i, probs, chosen))
            if row.finished:
                batch.finished += 1
        return Step(index, tuple(events), time.perf_counter() - started, batch.active)

    def _feed_ragged(
        self, batch: _Batch, sampled: torch.Tensor, runs: dict[int, list[ForcedToken]], width: int
    ) -> tuple[torch.Tensor, Any]:
        """Feed a step where some rows fast-forward a forced run or are finished (length 0): one `extend` call.

        Built on the host (these steps are rare: tool output, or rows awaiting compaction) and copied over once.
        """
        size = len(batch.rows)
        ids = [[0] * width for _ in range(size)]
        lengths = [0 if row.finished else 1 for row in batch.rows]
        is_forced = [False] * size
        for i, run in runs.items():
            ids[i][: len(run)] = [f.token for f in run]
            lengths[i] = len(run)
            is_forced[i] = True
        device = self.device
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)
        forced_t = torch.tensor(is_forced, device=device)
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
        ids_t[:, 0] = torch.where(forced_t, ids_t[:, 0], sampled)
        out = self.model.extend(ids_t, lengths_t, batch.cache, routing=batch.routing, threshold=batch.threshold)
        batch.counters += lengths_t
        return ids_t[:, 0], out

    def _ensure_capacity(self, cache: Any, width: int) -> None:
        """Grow the cache (doubling, up to the context size) before a call could need more slots than it has.

        `cache.host_bound` is the cache's own host-side upper bound on any row's length, so this needs no device
        read; rows never pass the context size because the engine ends them there.
        """
        needed = cache.host_bound + width
        if needed > cache.max_len and cache.max_len < self.context_size:
            cache.grow(min(self.context_size, max(2 * cache.max_len, needed)))

    def _to_host(
        self, first: torch.Tensor, out: Any, with_routing: bool
    ) -> tuple[list[int], list[Any] | None, list[Any] | None]:
        """The step's one device→host copy: tokens, and routing (L_stt, B, T) when it is reported."""
        if not with_routing:
            return first.cpu().tolist(), None, None
        probs, chosen = out.router_probs, out.selected
        layers, size, width = probs.shape
        packed = torch.cat((first.double(), probs.double().flatten(), chosen.double().flatten())).cpu()
        tokens = packed[:size].long().tolist()
        block = layers * size * width
        probs_host = packed[size : size + block].view(layers, size, width).permute(1, 2, 0).tolist()
        chosen_host = packed[size + block :].view(layers, size, width).permute(1, 2, 0).bool().tolist()
        return tokens, probs_host, chosen_host

    def _advance_row(
        self,
        row: _Row,
        emitted: list[tuple[int, bool, ToolEvent | None]],
        slot: int,
        probs: list[Any] | None,
        chosen: list[Any] | None,
    ) -> list[TokenEvent]:
        """Account for the tokens a row emitted this step (all already fed) and return their events."""
        pieces: list[dict[str, Any]] = []
        finish: FinishReason | None = None
        for position, (token, forced, tool_event) in enumerate(emitted):
            text, special = row.detok.push(token)
            if not forced:
                row.sampled += 1
                if token in row.stops:
                    finish = "stop"
                    tool_event = row.tools.interrupt("the reply ended") if row.tools else None
                elif row.tools is not None:
                    tool_event = row.tools.observe(token)
            pieces.append(
                {
                    "token": token,
                    "forced": forced,
                    "text": text,
                    "special": special,
                    "router_probs": None if probs is None else tuple(probs[slot][position]),
                    "computed": None if chosen is None else tuple(chosen[slot][position]),
                    "tool": tool_event,
                }
            )
        row.seen += len(emitted)
        error = None
        if finish is None:
            queued = row.tools is not None and bool(row.tools.queue)
            if row.seen >= self.context_size:
                finish = "context"
                error = f"the context is full ({self.context_size} tokens); the reply was cut here"
            elif not queued and row.sampled >= row.settings.max_tokens:
                finish = "length"
        if finish is not None:
            row.finished = True
            last = pieces[-1]
            last["text"] += row.detok.flush()
            last["finish_reason"] = finish
            last["error"] = error
            if finish != "stop" and row.tools is not None:
                limit = "max_tokens" if finish == "length" else "the context limit"
                last["tool"] = last["tool"] or row.tools.interrupt(f"the reply hit {limit}")
        return [TokenEvent(row=row.index, **piece) for piece in pieces]

    def _maybe_compact(self, batch: _Batch) -> None:
        """Drop finished rows from the device batch once they are at least a quarter of it (see module doc)."""
        if not batch.finished or not batch.active or not batch.may_compact:
            return
        if batch.finished < max(1, len(batch.rows) // 4):
            return
        keep = [i for i, row in enumerate(batch.rows) if not row.finished]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        batch.rows = [batch.rows[i] for i in keep]
        batch.cache = batch.cache.select_rows(index)
        batch.logits = batch.logits.index_select(0, index)
        batch.params = batch.params.select(index)
        batch.counters = batch.counters.index_select(0, index)
        batch.finished = 0


def collect_event(result: GenerationResult, event: TokenEvent) -> None:
    """Fold one streamed token into a `GenerationResult` (the final stop token is kept apart)."""
    if event.tool is not None:
        result.tool_events.append(event.tool)
    if event.finish_reason is not None:
        result.finish_reason = event.finish_reason
        result.error = event.error
    if event.finish_reason == "stop":  # the terminator is not part of the reply (as in nanochat)
        result.stop_token = event.token
        return
    result.tokens.append(event.token)
    result.forced.append(event.forced)
    result.text += event.text


def _synchronize(device: torch.device) -> None:
    """Wait for queued device work (timing only); free on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
