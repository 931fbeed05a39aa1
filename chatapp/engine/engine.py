"""The Engine: batched, streaming generation over the STT model's KV cache. This file tells the whole story.

    prompts ─► prefill (ragged, one chunked `extend` per batch) ─► replicate rows for num_samples
      loop:  grammar masks on the logits (`constraints.py`) ─► sample(logits) on device (`sampling.py`)
             ─► known tokens replace samples: a tool's queued output, tokens the grammar forces
             ─► the TTFA automaton steps (`programs.py`): feeds / timeouts replace tokens, zone tags
             ─► model.decode (or a ragged `extend` when some row fast-forwards a known run)
             ─► ONE device→host copy (tokens, routing, program state) ─► per-row host bookkeeping
                (detokenize, stop / length / context / program checks, tool machine, grammar) ─► Step event

What it does differently from nanochat's engine (REFERENCES.md lists that engine's weaknesses):
- Ragged batches: every row has its own position (`cache.seen[b]`); prompts of different lengths prefill together.
- Per-row randomness keyed by (seed, sample index, tokens emitted) — see `sampling.py` — so a row's tokens do not
  depend on what else is in the batch.
- `max_tokens` counts sampled tokens only; forced tokens (tool output, program feeds, grammar) never eat it.
- Finished rows stop costing compute: they are fed nothing (length 0) and the batch is compacted with
  `cache.select_rows` once at least a quarter of the device batch has finished (compacting copies the cache, so
  doing it on every single finish would cost more than it saves on large batches; small batches compact at once).
- The cache never overflows: the host mirrors each row's position, grows the cache on demand up to the model's
  context size, and ends a row that fills the context with finish reason "context" and a message.
- Every emitted token has been fed to the model before it is reported (the stop token too), so its routing
  probabilities/decisions are the ones of the forward that processed it, and a cancelled chat session's cache
  holds exactly the tokens the consumer saw.

Fast-forward. A row whose next tokens are already known (a tool's output block, the tokens a grammar leaves no
choice about, a program's feed — see `programs.py`) pushes the whole run through one
ragged `extend` call while the other rows advance by their one sampled token. The tokens are those of the
one-per-step path by construction: forced tokens are never sampled, and each forced token still consumes one
draw counter, so the row's later random draws are unchanged (tests compare both paths). When it pays off depends
on the hardware: the other rows of a ragged call are padded to the run's width, which is nearly free on a GPU
(decode is memory-bound) but is wasted compute on a CPU. Measured on CPU (benchmarks/engine_vs_transformers.py):
1.3-1.5x faster with one row, 0.8-1.0x with eight. So the default policy `fast_forward="auto"` fast-forwards when the
device batch has a single active row or runs on CUDA, and otherwise feeds forced tokens one per step (still
never sampled); `"always"` fast-forwards whenever the row's settings allow it.

Host work per step is O(rows) bookkeeping (detokenization, stop/length checks, the tool machine) on plain Python
values after the single copy; the device side has no per-row Python loop and no other synchronisation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import torch

from chatapp.engine.constraints import apply_masks, fresh_constraint
from chatapp.engine.detok import Detokenizer, TokenBytes
from chatapp.engine.events import FinishReason, PromptInfo, Step, TokenEvent, ToolEvent
from chatapp.engine.programs import ProgramRunner
from chatapp.engine.reply import Reply, fold_replies
from chatapp.engine.sampling import SamplingParams, sample
from chatapp.engine.tools import DEFAULT_MAX_EXPRESSION_TOKENS, ForcedToken, ToolBox, ToolMachine
from chatapp.errors import ChatappError, ContextOverflowError, ConversationError, SettingsError
from chatapp.settings import GenerationSettings
from chatapp.tools import TOOLS, Tool
from chatapp.tools.base import NANOCHAT_TOOL_MARKERS, ToolMarkers

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
class _Row:
    """Host-side state of one request row while it is generating."""

    index: int  # request row: prompt_index * num_samples + sample_index
    settings: GenerationSettings
    stops: frozenset[int]
    detok: Detokenizer
    tools: ToolMachine | None
    seen: int  # tokens in this row's cache: mirrors cache.seen without reading the device
    constraint: Any = None  # the row's chatapp.trie Constraint (grammar state), if any
    sampled: int = 0
    finished: bool = False

    def take_forced(self, room: int, fast_forward: bool) -> list[ForcedToken]:
        """The forced tokens to feed this step: the whole queued run (up to `room`) when fast-forwarding, else one."""
        assert self.tools is not None
        queue = self.tools.queue
        count = min(len(queue), room if fast_forward and self.settings.fast_forward else 1)
        return [queue.popleft() for _ in range(count)]


# Why a tool call that was still open when its row ended got no result (the refusal's reason).
_UNFINISHED_CALL = {
    "length": "the reply hit max_tokens",
    "context": "the reply hit the context limit",
    "program": "the program ended",
    "error": "the reply stopped on an error",
}


Source = Literal["model", "tool", "program", "grammar"]


class _Run(NamedTuple):
    """Known tokens a row feeds this step instead of a sampled one: a tool's output or grammar-forced tokens."""

    source: Source
    items: list[ForcedToken]


class _Emitted(NamedTuple):
    """One token a row emitted in a step, and where it came from."""

    token: int
    source: Source
    tool: ToolEvent | None
    tags: tuple[str, ...]
    zone: str | None


@dataclass
class _HostStep:
    """A step's device results on the host (the unpacked single copy); `None` for what was not reported."""

    tokens: list[int]
    probs: list[Any] | None = None
    chosen: list[Any] | None = None
    program_forced: list[bool] | None = None
    tags: list[tuple[str, ...]] | None = None
    zones: list[str | None] | None = None
    halted: list[bool] | None = None
    pending: list[int] | None = None  # program feed tokens each row emits before the model's next token
    feed: list[tuple[list[int], list[tuple[str, ...]], list[str | None]]] | None = None  # fast-forwarded feeds


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
    program: ProgramRunner | None = None  # the TTFA automaton when any row runs a program
    pending: list[int] | None = None  # host copy of the program's pending feed per row (from the last step)
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
            markers=getattr(chat_format, "tool_markers", None),
        )
        self.toolbox = box if chat_format.supports_tools and box else None
        self._constraint_vocab: Any = None

    @property
    def stt_layers(self) -> list[int]:
        """Indices of the model's STT layers: the order of every routing tuple in the events."""
        return list(self.model.stt_layer_indices)

    @property
    def num_layers(self) -> int:
        """All decoder layers of the model: the denominator of a reply's `compute_saved`."""
        return int(self.model.config.num_hidden_layers)

    def new_reply(self, row: int = 0) -> Reply:
        """An empty reply fold for one row of this engine's output."""
        return Reply(row, self.num_layers, self.stt_layers, self.tool_markers)

    @property
    def tool_markers(self) -> ToolMarkers:
        """The chat format's tool protocol (nanochat's markers for a format that names none)."""
        return getattr(self.chat_format, "tool_markers", None) or NANOCHAT_TOOL_MARKERS

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
        all prompts or one per prompt; `programs` (compiled TTFA programs, `chatapp.ttfa.load_program`) is one
        per prompt, None entries running free. Row index = prompt_index * num_samples + sample_index.

        Input errors raise here, before the first step. Closing the returned generator frees everything.
        """
        if num_samples < 1:
            raise SettingsError(f"num_samples must be >= 1, got {num_samples}")
        feeds = [self._prompt_ids(p) for p in prompts]
        per_prompt = self._settings_per_prompt(settings, len(feeds))
        if programs is not None:
            self._check_programs(programs, len(feeds))
        if constraints is not None and len(constraints) != len(feeds):
            raise SettingsError(f"got {len(constraints)} constraints for {len(feeds)} prompts", hint="one per prompt")
        for i, feed in enumerate(feeds):
            self._check_fits(i, 0, len(feed))
        initial = max(len(f) for f in feeds) + max(s.max_tokens for s in per_prompt) + CACHE_SLACK
        cache = self.model.new_cache(len(feeds), min(self.context_size, initial))
        rows = [
            self._new_row(
                p * num_samples + s, per_prompt[p], seen=0, constraint=None if constraints is None else constraints[p]
            )
            for p in range(len(feeds))
            for s in range(num_samples)
        ]
        row_programs = None if programs is None else [p for p in programs for _ in range(num_samples)]
        return self._stream(feeds, rows, cache, num_samples=num_samples, may_compact=True, programs=row_programs)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str],
        settings: GenerationSettings | Sequence[GenerationSettings] = GenerationSettings(),
        num_samples: int = 1,
        programs: Sequence[Any] | None = None,
        constraints: Sequence[Any] | None = None,
    ) -> list[Reply]:
        """Run `generate` to the end and fold each row's reply (tokens, forced mask, text, finish reason, tools)."""
        steps = self.generate(prompts, settings, num_samples, programs, constraints)
        return fold_replies(
            steps, num_layers=self.num_layers, stt_layers=self.stt_layers, markers=self.tool_markers
        )

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

    @staticmethod
    def _check_programs(programs: Sequence[Any], prompts: int) -> None:
        from chatapp.ttfa import Program

        if len(programs) != prompts:
            raise SettingsError(f"got {len(programs)} programs for {prompts} prompts", hint="give one per prompt")
        for program in programs:
            if program is not None and not isinstance(program, Program):
                raise SettingsError(
                    f"a program must be a compiled TTFA program, got {type(program).__name__}",
                    hint="compile it with chatapp.ttfa.load_program(name_or_path, tokenizer)",
                )

    def _check_fits(self, index: int, used: int, new: int) -> None:
        """A prompt must leave room for at least one generated token."""
        if used + new >= self.context_size:
            raise ContextOverflowError(
                f"prompt {index} needs {used + new} tokens but the model's context holds {self.context_size}, "
                "with no room left to answer",
                hint="shorten the prompt, or start a new conversation",
            )

    def _new_row(self, index: int, settings: GenerationSettings, seen: int, constraint: Any = None) -> _Row:
        """Host state for one request row; `constraint` is a regex string or a `Constraint` (copied fresh)."""
        stops = frozenset(settings.stop_tokens) | frozenset(self.chat_format.stop_token_ids)
        tools = ToolMachine(self.toolbox) if self.toolbox is not None else None
        grammar = None if constraint is None else fresh_constraint(constraint, self._regex_constraint)
        return _Row(index, settings, stops, Detokenizer(self.token_bytes), tools, seen, grammar)

    @property
    def constraint_vocab(self) -> Any:
        """The vocabulary index grammar constraints walk (token bytes, trie): built once per engine, on first use."""
        from chatapp.trie.vocab import ConstraintVocab

        if self._constraint_vocab is None:
            self._constraint_vocab = ConstraintVocab.from_tokenizer(self.tokenizer, self.model.config.vocab_size)
        return self._constraint_vocab

    def constraint(self, *, regex: str | None = None, json_schema: Any = None) -> Any:
        """A `chatapp.trie` Constraint over this model's vocabulary for a regex or a JSON schema, ending at the chat
        format's end of turn. Raises `ConstraintError` naming what is wrong with the pattern or schema."""
        from chatapp.trie.constraint import Constraint

        if (regex is None) == (json_schema is None):
            raise SettingsError("a constraint needs exactly one of a regex or a JSON schema")
        end = self.chat_format.assistant_end_id
        if regex is not None:
            return Constraint.regex(regex, self.constraint_vocab, end)
        return Constraint.json_schema(json_schema, self.constraint_vocab, end)

    def _regex_constraint(self, pattern: str) -> Any:
        return self.constraint(regex=pattern)

    # --------------------------------------------------------------------------------------------- generation
    def _stream(
        self,
        feeds: list[list[int]],
        rows: list[_Row],
        cache: Any,
        *,
        num_samples: int = 1,
        may_compact: bool = True,
        programs: Sequence[Any] | None = None,
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
        if programs and any(p is not None for p in programs):
            batch.program = ProgramRunner(programs, self.device)
            batch.pending = batch.program.pending_feed().tolist()  # later steps bring it in their one copy
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
        """One model forward: sample, apply forced tokens (known runs, then the program), feed, copy to host once,
        update rows, build events."""
        started = time.perf_counter()
        rows, program = batch.rows, batch.program
        if any(row.constraint is not None and not row.finished for row in rows):
            apply_masks(batch.logits, [None if r.finished else r.constraint for r in rows], batch.logits.shape[-1])
        sampled = sample(batch.logits, batch.params, batch.counters)
        fast = self.fast_forward == "always" or batch.active == 1 or self.device.type == "cuda"
        # Tool output is fast-forwarded only without a program: with one, every tool token must pass the automaton.
        runs = {
            i: run
            for i, row in enumerate(rows)
            if not row.finished and (run := self._known_run(row, fast and not program))
        }
        feeds = self._feed_runs(batch, runs) if program is not None and fast else {}
        width = max([1, *(len(run.items) for run in runs.values()), *feeds.values()])
        self._ensure_capacity(batch.cache, width)
        ids = self._forced_ids(batch, runs, width) if runs else None
        first = sampled if ids is None else torch.where(ids[1], ids[0][:, 0], sampled)
        stepped = peeked = None
        if program is not None:
            if feeds:
                peeked = program.peek(max(feeds.values()))
                counts = torch.tensor([feeds.get(i, 0) for i in range(len(rows))], device=self.device)
                first, program_forced, tags, pcs = program.step_and_advance(first, counts)
            else:
                first, program_forced, tags, pcs = program.step(first)
            stepped = (program_forced, tags, pcs, program.halted(), program.pending_feed())
        if width == 1 and not batch.finished:  # the common case: every row feeds one token
            out = self.model.decode(first, batch.cache, routing=batch.routing, threshold=batch.threshold)
            batch.counters += 1
        else:
            out = self._feed_ragged(batch, first, runs, feeds, width, ids, peeked)
        batch.logits = out.logits
        host = self._to_host(first, out, batch.routing != "off", stepped, peeked, program)
        batch.pending = host.pending

        events: list[TokenEvent] = []
        for i, row in enumerate(rows):
            if row.finished:
                continue
            emitted = self._emitted(row, i, runs.get(i), feeds.get(i, 0), host)
            events.extend(self._advance_row(row, emitted, i, host))
            if row.finished:
                batch.finished += 1
        return Step(index, tuple(events), time.perf_counter() - started, batch.active)

    def _feed_runs(self, batch: _Batch, runs: dict[int, _Run]) -> dict[int, int]:
        """Rows that fast-forward their program's pending feed this step, and how many feed tokens each emits.
        A one-token feed is simply stepped (nothing to save); a row with a tool or grammar run steps it first."""
        if batch.pending is None:
            return {}
        return {
            i: min(pending, self.context_size - row.seen)
            for i, (row, pending) in enumerate(zip(batch.rows, batch.pending, strict=True))
            if pending >= 2 and not row.finished and i not in runs and row.settings.fast_forward
        }

    def _forced_ids(self, batch: _Batch, runs: dict[int, _Run], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (B, width), is_forced (B,)) on the device for a step where some rows feed queued tool tokens.

        Built on the host and copied over once: these steps are rare (tool output)."""
        ids = [[0] * width for _ in batch.rows]
        is_forced = [False] * len(batch.rows)
        for i, run in runs.items():
            ids[i][: len(run.items)] = [f.token for f in run.items]
            is_forced[i] = True
        device = self.device
        return torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(is_forced, device=device)

    def _feed_ragged(
        self,
        batch: _Batch,
        first: torch.Tensor,
        runs: dict[int, _Run],
        feeds: dict[int, int],
        width: int,
        ids: tuple[torch.Tensor, torch.Tensor] | None,
        peeked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> Any:
        """Feed a step where some rows fast-forward a known run or a program feed, or are finished (length 0):
        one `extend` call; every other row feeds its one token of `first`."""
        lengths = [0 if row.finished else 1 for row in batch.rows]
        for i, run in runs.items():
            lengths[i] = len(run.items)
        for i, count in feeds.items():
            lengths[i] = count
        device = self.device
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
        ids_t = ids[0] if ids is not None else torch.zeros(len(batch.rows), width, dtype=torch.long, device=device)
        ids_t[:, 0] = first
        if peeked is not None:
            feed_ids = peeked[0]
            feeding = torch.tensor([i in feeds for i in range(len(batch.rows))], device=device)
            ids_t[:, : feed_ids.shape[1]] = torch.where(feeding[:, None], feed_ids, ids_t[:, : feed_ids.shape[1]])
        out = self.model.extend(ids_t, lengths_t, batch.cache, routing=batch.routing, threshold=batch.threshold)
        batch.counters += lengths_t
        return out

    def _known_run(self, row: _Row, fast: bool) -> _Run | None:
        """The tokens a row will emit next that are already known: its tool's queued output, else the tokens its
        grammar leaves no choice about. The whole run when fast-forwarding (up to the room left), else one."""
        room = self.context_size - row.seen
        if row.tools is not None and row.tools.queue:
            return _Run("tool", row.take_forced(room, fast))
        if row.constraint is not None and (known := row.constraint.ff_tokens()):
            return _Run("grammar", [ForcedToken(t) for t in known[: room if fast and row.settings.fast_forward else 1]])
        return None

    @staticmethod
    def _emitted(row: _Row, slot: int, run: _Run | None, feed: int, host: _HostStep) -> list[_Emitted]:
        """What a row emitted this step, with each token's source. A program that replaced a known token (a feed
        or a timeout) wins; a tool token goes back to the front of its queue (grammar tokens are recomputed)."""
        if feed:
            assert host.feed is not None
            tokens, tags, zones = host.feed[slot]
            return [_Emitted(t, "program", None, g, z) for t, g, z in zip(tokens[:feed], tags, zones, strict=False)]
        token = host.tokens[slot]
        by_program = host.program_forced is not None and host.program_forced[slot]
        tags = host.tags[slot] if host.tags is not None else ()
        zone = host.zones[slot] if host.zones is not None else None
        if run is None:
            return [_Emitted(token, "program" if by_program else "model", None, tags, zone)]
        first = run.items[0]
        if by_program and token != first.token:
            if run.source == "tool":
                assert row.tools is not None
                row.tools.queue.appendleft(first)
            return [_Emitted(token, "program", None, tags, zone)]
        if host.program_forced is not None:  # a program runs: the run is one token that passed the automaton
            return [_Emitted(first.token, run.source, first.event, tags, zone)]
        return [_Emitted(f.token, run.source, f.event, (), None) for f in run.items]

    def _ensure_capacity(self, cache: Any, width: int) -> None:
        """Grow the cache (doubling, up to the context size) before a call could need more slots than it has.

        `cache.host_bound` is the cache's own host-side upper bound on any row's length, so this needs no device
        read; rows never pass the context size because the engine ends them there.
        """
        needed = cache.host_bound + width
        if needed > cache.max_len and cache.max_len < self.context_size:
            cache.grow(min(self.context_size, max(2 * cache.max_len, needed)))

    @staticmethod
    def _to_host(
        first: torch.Tensor,
        out: Any,
        with_routing: bool,
        stepped: Any,
        peeked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        program: ProgramRunner | None,
    ) -> _HostStep:
        """The step's one device→host copy: tokens; routing (L_stt, B, T) when it is reported; the program's
        forced flags, tags, zones, halts and pending feeds when a program runs, and the fast-forwarded feeds.
        Everything is packed into one float64 tensor (exact for token ids, flags and float32 probabilities)."""
        size = first.shape[0]
        parts = [first.double()]
        if with_routing:
            parts += [out.router_probs.double().flatten(), out.selected.double().flatten()]
        if stepped is not None:
            parts += [t.double().flatten() for t in stepped]
        if peeked is not None:
            parts += [t.double().flatten() for t in peeked]
        packed = parts[0].cpu() if len(parts) == 1 else torch.cat(parts).cpu()
        host = _HostStep(tokens=packed[:size].long().tolist())
        offset = size

        def take(*shape: int) -> torch.Tensor:
            nonlocal offset
            count = math.prod(shape)
            chunk = packed[offset : offset + count].view(*shape)
            offset += count
            return chunk

        if with_routing:
            layers, _, width = out.router_probs.shape
            host.probs = take(layers, size, width).permute(1, 2, 0).tolist()
            host.chosen = take(layers, size, width).permute(1, 2, 0).bool().tolist()
        if stepped is not None and program is not None:
            tag_count = stepped[1].shape[1]
            host.program_forced = take(size).bool().tolist()
            host.tags = [program.tag_tuple(f) for f in take(size, tag_count).bool().tolist()]
            host.zones = program.zone_labels(take(size).long().tolist())
            host.halted = take(size).bool().tolist()
            host.pending = take(size).long().tolist()
            if peeked is not None:
                k = peeked[0].shape[1]
                tokens = take(size, k).long().tolist()
                tags = take(size, k, tag_count).bool().tolist()
                zones = take(size, k).long().tolist()
                host.feed = [
                    (tokens[b], [program.tag_tuple(f) for f in tags[b]], program.zone_labels(zones[b]))
                    for b in range(size)
                ]
        return host

    def _advance_row(self, row: _Row, emitted: list[_Emitted], slot: int, host: _HostStep) -> list[TokenEvent]:
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
                    finish, error = "error", err.message
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
                    "router_probs": None if host.probs is None else tuple(host.probs[slot][position]),
                    "computed": None if host.chosen is None else tuple(host.chosen[slot][position]),
                    "tool": tool_event,
                }
            )
        row.seen += len(emitted)
        if finish is None:
            queued = row.tools is not None and bool(row.tools.queue)
            if row.seen >= self.context_size:
                finish = "context"
                error = f"the context is full ({self.context_size} tokens); the reply was cut here"
            elif host.halted is not None and host.halted[slot]:
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
        if batch.program is not None:
            batch.program.select_rows(index)
        if batch.pending is not None:
            batch.pending = [batch.pending[i] for i in keep]
        batch.finished = 0


def _synchronize(device: torch.device) -> None:
    """Wait for queued device work (timing only); free on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
