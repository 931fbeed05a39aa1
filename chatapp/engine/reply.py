"""The reply fold: one row's `TokenEvent`s become its reply and the reply's statistics, the same way everywhere.

`chatapp generate`, the batch records, `generate_batch`, the TUI's stats panel and stored messages, and a chat
session's assistant message are all built by `Reply`, so they agree on what a reply is and on every number shown
about it. Plain host data, no torch: the UI folds with it too.

What a reply is:
- Every emitted token, forced or sampled, special or not, is in it, except a final stop token (finish reason
  `stop`): that token ends the reply and is kept apart as `stop_token`. `events` still has it, because it was
  generated and fed like any other token (it counts for speed, forced share and routing).
- `text` is the tokens' text exactly as detokenized (special tokens as their names); `content` is the chat
  message content rebuilt from the tokens: plain text, or nanochat's parts when the reply called a tool (chat
  framing tokens such as `<|assistant_end|>` left out, since re-rendering would turn them into plain text).

The statistics, each with one definition:
- `tokens_per_second`: emitted tokens over the seconds of the steps the row was active in (`Step.seconds`, the
  engine's own timing, so the figure is reproducible with a scripted backend).
- `forced_fraction`: forced emitted tokens over emitted tokens.
- `compute_saved`: the share of decoder-layer work (token x layer blocks, all layers) the STT routers skipped,
  over the emitted tokens that went through the model (`chatapp.compute_saved`, the one definition; a token
  skipped in "kv" skip mode counts as skipped). The prompt is left out: this is what the answer cost.
- `stt_skipped_fraction`: the same skipped blocks over the STT layers' blocks only.
- `layer_computed`: per STT layer, the fraction of those tokens the layer computed.
- `mean_surprise`: mean -log p (nats, under the model's distribution) of the emitted tokens that carry log-probs
  (`GenerationSettings.logprobs` > 0), forced ones included: the model's surprise is defined for every token it
  produced logits for.
- `layer_surprise`: per STT layer, the mean surprise of the routed tokens it computed and of those it skipped —
  does a layer spend its compute on the tokens the model found surprising?

`logprobs_content()` is the reply's log-probs in the shape of OpenAI's chat completions (`logprobs.content`): one
entry per reply token (the final stop token is not content, as in OpenAI's), `top_logprobs` the model's own
alternatives (`TokenLogprobs` explains the two distributions).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from chatapp.compute_saved import compute_saved
from chatapp.engine.events import Alternative, FinishReason, PromptInfo, Step, TokenEvent, TokenLogprobs, ToolEvent
from chatapp.tools.base import NANOCHAT_TOOL_MARKERS, ToolMarkers
from chatapp.tools.parts import Content, PartType


def is_structural(event: TokenEvent) -> bool:
    """Chat-format control tokens (`<|...|>`) frame a message; other special tokens (`<think>`) are content."""
    return event.special and event.text.startswith("<|") and event.text.endswith("|>")


@dataclass
class Segment:
    """A run of a reply's tokens shown as one block: plain text, or one tool call (indices into `Reply.events`).

    A tool segment runs from the call's start marker to the output's end marker inclusive, so the expression, the
    forced result and their markers live inside the collapsible block while the prose around it stays in the text.
    """

    kind: Literal["text", "tool"]
    start: int
    end: int
    call: ToolEvent | None = None
    outcome: ToolEvent | None = None  # the result or refusal, once it arrived
    closed: bool = False  # a tool segment closes with its output end marker; text after it starts a new segment


@dataclass(frozen=True, slots=True)
class ContentPiece:
    """Text the reply's content gained: appended to part `part` (a new part when `part` is past the last one)."""

    part: int
    type: PartType
    text: str


@dataclass
class Reply:
    """One row's reply, folded from its events as they stream. `num_layers` (all of the model's decoder layers) is
    the denominator of `compute_saved`; `stt_layers` (their indices) key `layer_computed`.

    The fold is incremental and the only one: each token adds to the content parts (`parts`), the display segments
    (`segments`) and the statistics once, so a consumer reads them instead of folding again, and `pieces_since`
    hands a store only the content added since its last write."""

    row: int = 0
    num_layers: int = 0
    stt_layers: Sequence[int] = ()
    markers: ToolMarkers = NANOCHAT_TOOL_MARKERS  # the chat format's tool protocol
    skip_cost: float = 0.0  # share of a block a skipped token still computes (`chatapp.compute_saved.skip_cost`)
    events: list[TokenEvent] = field(default_factory=list)  # every emitted token, a final stop token included
    stop_token: int | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    tool_events: list[ToolEvent] = field(default_factory=list)
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    context_used: int = 0
    context_size: int = 0
    forced_count: int = 0
    routed_tokens: int = 0  # emitted tokens that went through the model with routing reported
    computed_per_layer: list[int] = field(default_factory=list)  # per STT layer: how many of those it computed
    surprise_total: float = 0.0  # sum of -log p over the tokens with log-probs
    surprise_count: int = 0
    # Per STT layer, over routed tokens with log-probs: [surprise sum, count] of the computed, then of the skipped.
    layer_surprise_sums: list[list[float]] = field(default_factory=list)
    parts: list[dict[str, str]] = field(default_factory=list)  # the content so far, as parts
    segments: list[Segment] = field(default_factory=list)  # every event's display block, the stop token included
    _mode: PartType = "text"
    _held: TokenEvent | None = None  # a stop token: content only if more tokens follow it
    _pieces: list[ContentPiece] = field(default_factory=list)  # every content addition, in order

    @classmethod
    def of(cls, events: Iterable[TokenEvent], markers: ToolMarkers = NANOCHAT_TOOL_MARKERS) -> Reply:
        """The reply of a finished (or stored) token stream, e.g. a message read back from the history."""
        reply = cls(markers=markers)
        for event in events:
            reply.add(event)
        return reply

    # ------------------------------------------------------------------------------------------------ folding
    def start(self, prompt: PromptInfo) -> None:
        """Take the prefill's facts for this row from the first Step's `PromptInfo`."""
        row = self.row if self.row < len(prompt.prompt_tokens) else 0
        self.prompt_tokens = prompt.prompt_tokens[row] if prompt.prompt_tokens else 0
        self.prefill_seconds = prompt.prefill_seconds
        self.context_used = prompt.context_used[row] if prompt.context_used else self.prompt_tokens
        self.context_size = prompt.context_size

    def add(self, event: TokenEvent) -> str:
        """Fold one token; returns the text it adds to the reply ("" for a final stop token)."""
        self.stop_token = None  # a stop token followed by more tokens was not final
        if self._held is not None:
            self._add_content(self._held)
            self._held = None
        self._add_segment(len(self.events), event)
        self.events.append(event)
        self.forced_count += event.forced
        if event.computed is not None:
            if not self.computed_per_layer:
                self.computed_per_layer = [0] * len(event.computed)
            self.routed_tokens += 1
            for layer, computed in enumerate(event.computed):
                self.computed_per_layer[layer] += bool(computed)
        if event.logprobs is not None:
            self._add_surprise(event.logprobs.surprise, event.computed)
        # Every emitted token but a final stop token that was never fed now occupies the context.
        if event.finish_reason is None or event.computed is not None:
            self.context_used += 1
        if event.tool is not None:
            self.tool_events.append(event.tool)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.error = event.error
            if event.finish_reason == "stop":
                self.stop_token = event.token
                self._held = event
                return ""
        self._add_content(event)
        return event.text

    def _add_content(self, event: TokenEvent) -> None:
        """Fold one reply token into the content parts: a tool marker switches the part, chat framing is left out."""
        if event.special and (after := self.markers.part_after(event.text)) is not None:
            self._mode = after
            return
        if is_structural(event) or not event.text:
            return
        if not self.parts or self.parts[-1]["type"] != self._mode:
            self.parts.append({"type": self._mode, "text": ""})
        self.parts[-1]["text"] += event.text
        self._pieces.append(ContentPiece(len(self.parts) - 1, self._mode, event.text))

    def _add_segment(self, index: int, event: TokenEvent) -> None:
        """Fold one token into the display segments: a call start marker opens a tool segment, which its output end
        marker closes."""
        current = self.segments[-1] if self.segments else None
        if event.special and event.text == self.markers.call_start:
            current = Segment("tool", index, index)
            self.segments.append(current)
        elif current is None or current.closed:
            current = Segment("text", index, index)
            self.segments.append(current)
        current.end = index + 1
        if event.tool is not None:
            if event.tool.kind == "call":
                current.call = event.tool
            else:
                current.outcome = event.tool
        if event.special and event.text == self.markers.output_end:
            current.closed = True

    def pieces_since(self, mark: int) -> tuple[list[ContentPiece], int]:
        """The content added since `mark` (0: from the start) and the mark to pass next time: what a store appends
        per batch instead of rewriting the whole content."""
        return self._pieces[mark:], len(self._pieces)

    def segments_since(self, index: int) -> list[Segment]:
        """The segments holding events from `index` on (those a batch starting there created or grew), in order."""
        return [segment for segment in self.segments if segment.end > index]

    def add_step(self, step: Step) -> str:
        """Fold one Step of a stream this row runs in (its seconds, the prompt on the first one, this row's tokens);
        returns the text the reply gained. For a batch stream, where a row's time ends with its finish, fold with
        `fold_replies` (or `start` / `add` and add the seconds of the steps the row was active in)."""
        if step.prompt is not None:
            self.start(step.prompt)
        self.decode_seconds += step.seconds
        return "".join(self.add(event) for event in step.tokens if event.row == self.row)

    def _add_surprise(self, surprise: float, computed: tuple[bool, ...] | None) -> None:
        self.surprise_total += surprise
        self.surprise_count += 1
        if computed is None:
            return
        if not self.layer_surprise_sums:
            self.layer_surprise_sums = [[0.0, 0, 0.0, 0] for _ in computed]
        for sums, was_computed in zip(self.layer_surprise_sums, computed, strict=True):
            at = 0 if was_computed else 2
            sums[at] += surprise
            sums[at + 1] += 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # ---------------------------------------------------------------------------------------------- the reply
    def _reply_events(self) -> list[TokenEvent]:
        return self.events[:-1] if self.stop_token is not None else self.events

    @property
    def tokens(self) -> list[int]:
        """The reply's token ids (a final stop token is `stop_token`, not here)."""
        return [event.token for event in self._reply_events()]

    @property
    def forced(self) -> list[bool]:
        """Per reply token: forced (tool output, program feed, grammar) rather than sampled."""
        return [event.forced for event in self._reply_events()]

    @property
    def text(self) -> str:
        return "".join(event.text for event in self._reply_events())

    @property
    def content(self) -> Content:
        """The chat message content: plain text, or nanochat's parts (text / python / python_output)."""
        return parts_content(self.parts)

    @property
    def tool_calls(self) -> list[dict[str, str]]:
        """Each tool call with its `result` or `refusal`: `{"tool", "expression", "result" | "refusal"}`."""
        calls: list[dict[str, str]] = []
        for tool in self.tool_events:
            if tool.kind == "call":
                calls.append({"tool": tool.tool, "expression": tool.expression})
                continue
            # An outcome answers the latest call of that expression that has none yet; one without a call is kept.
            for call in reversed(calls):
                if call["expression"] == tool.expression and "result" not in call and "refusal" not in call:
                    call[tool.kind] = tool.output or ""
                    break
            else:
                calls.append({"tool": tool.tool, "expression": tool.expression, tool.kind: tool.output or ""})
        return calls

    # ------------------------------------------------------------------------------------------------- stats
    @property
    def emitted(self) -> int:
        """Tokens the row emitted, a final stop token included."""
        return len(self.events)

    @property
    def sampled_tokens(self) -> int:
        """Reply tokens the model sampled (what `max_tokens` counts)."""
        held_sampled = self.stop_token is not None and not self.events[-1].forced
        return len(self.events) - self.forced_count - held_sampled

    @property
    def tokens_per_second(self) -> float:
        return self.emitted / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def forced_fraction(self) -> float:
        return self.forced_count / self.emitted if self.emitted else 0.0

    @property
    def _skipped_blocks(self) -> int:
        return self.routed_tokens * len(self.computed_per_layer) - sum(self.computed_per_layer)

    @property
    def compute_saved(self) -> float:
        """Share of all (token, decoder layer) blocks the STT routers skipped; see the module docstring."""
        return compute_saved(self._skipped_blocks, self.routed_tokens, self.num_layers, self.skip_cost)

    @property
    def stt_skipped_fraction(self) -> float:
        """Share of (token, STT layer) blocks the routers skipped."""
        return compute_saved(self._skipped_blocks, self.routed_tokens, len(self.computed_per_layer), self.skip_cost)

    def layer_computed(self) -> dict[int, float]:
        """Per STT layer index: the fraction of this row's routed tokens the layer computed ({} with routing off)."""
        if not self.routed_tokens:
            return {}
        return {
            layer: count / self.routed_tokens
            for layer, count in zip(self.stt_layers, self.computed_per_layer, strict=True)
        }


    # ------------------------------------------------------------------------------------------------- log-probs
    @property
    def logprobs(self) -> list[TokenLogprobs | None]:
        """Per reply token: what the model thought of it (None where the row did not ask)."""
        return [event.logprobs for event in self._reply_events()]

    @property
    def mean_surprise(self) -> float | None:
        """Mean -log p of the emitted tokens with log-probs (None: none asked)."""
        return self.surprise_total / self.surprise_count if self.surprise_count else None

    def layer_surprise(self) -> dict[int, LayerSurprise]:
        """Per STT layer index: the mean surprise of the tokens it computed and of those it skipped ({} without
        routing or log-probs)."""
        return {
            layer: LayerSurprise(
                computed=computed_sum / computed_count if computed_count else None,
                skipped=skipped_sum / skipped_count if skipped_count else None,
                computed_tokens=int(computed_count),
                skipped_tokens=int(skipped_count),
            )
            for layer, (computed_sum, computed_count, skipped_sum, skipped_count) in zip(
                self.stt_layers, self.layer_surprise_sums, strict=False
            )
        }

    def logprobs_content(self) -> list[dict[str, Any]] | None:
        """OpenAI's `logprobs.content` for the reply's tokens (None when the row did not ask for log-probs)."""
        events = self._reply_events()
        if not events or any(event.logprobs is None for event in events):
            return None
        return [_openai_entry(event.logprobs, _own(event)) for event in events if event.logprobs is not None]


def parts_content(parts: Sequence[dict[str, str]]) -> Content:
    """Content parts as a message's content: one string when all are text."""
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return [dict(part) for part in parts]


@dataclass(frozen=True)
class LayerSurprise:
    """One STT layer's share of the reply's surprise: mean -log p of the tokens it computed vs skipped."""

    computed: float | None
    skipped: float | None
    computed_tokens: int
    skipped_tokens: int


def _own(event: TokenEvent) -> Alternative:
    """The emitted token as an alternative of its own position (for OpenAI's `token` / `bytes` / `logprob`)."""
    assert event.logprobs is not None
    return Alternative(event.token, event.logprobs.piece, event.logprobs.logprob)


def _openai_entry(logprobs: TokenLogprobs, own: Alternative) -> dict[str, Any]:
    def entry(alternative: Alternative) -> dict[str, Any]:
        return {"token": alternative.text, "logprob": alternative.logprob, "bytes": list(alternative.piece)}

    return {**entry(own), "top_logprobs": [entry(a) for a in logprobs.top]}


def fold_replies(
    steps: Iterable[Step],
    *,
    num_layers: int = 0,
    stt_layers: Sequence[int] = (),
    markers: ToolMarkers = NANOCHAT_TOOL_MARKERS,
    skip_cost: float = 0.0,
) -> list[Reply]:
    """Run a `generate` stream to its end and fold every row's reply (rows in request order)."""
    replies: list[Reply] = []
    for step in steps:
        if step.prompt is not None:
            replies = [Reply(row, num_layers, stt_layers, markers, skip_cost) for row in range(step.prompt.rows)]
            for reply in replies:
                reply.start(step.prompt)
        for reply in replies:
            if not reply.finished:
                reply.decode_seconds += step.seconds
        for event in step.tokens:
            replies[event.row].add(event)
    return replies
