"""The events the Engine streams to its consumers (the TUI, the batch CLI, tests).

These are plain host-side data: no tensors cross this boundary. One `Step` is produced per model forward; it holds
a `TokenEvent` for every token emitted in that forward. A row usually emits one token per step, but a fast-forward
(a known run of forced tokens pushed through the model in one forward) emits several tokens for one row in one
step, in order. Rows are identified by `row`, the index of the request row (prompt x sample) in the `generate`
call, which never changes even when finished rows are dropped from the device batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "program", "context", "cancelled", "error"]
"""Why a row ended: `stop` a stop token (e.g. <|assistant_end|>), `length` max_tokens sampled tokens, `program`
its TTFA program halted, `context` the KV cache is full, `cancelled` the consumer stopped it, `error` the tool
machine or a constraint hit an unrecoverable state (message in `TokenEvent.error`)."""


@dataclass(frozen=True, slots=True)
class ToolEvent:
    """A tool call seen in the stream. `kind == "call"` arrives with the token that closed the call
    (<|python_end|>); `result` / `refusal` arrive with the first forced output token (<|output_start|>)."""

    kind: Literal["call", "result", "refusal"]
    tool: str
    expression: str
    output: str | None = None  # the result text, or the refusal reason


@dataclass(frozen=True, slots=True)
class Alternative:
    """A token the model could have emitted at a position, with its log-probability (natural log)."""

    token: int
    piece: bytes  # the token's own bytes (a special token's name): what OpenAI's `bytes` lists
    logprob: float

    @property
    def text(self) -> str:
        return self.piece.decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """What the model thought of one emitted token (requested with `GenerationSettings.logprobs = N`).

    Two distributions are reported, because they answer different questions:
    - the model's: softmax of the raw logits at temperature 1, before any mask (top-k/top-p, grammar). `logprob`,
      `entropy` and `top` are about it: how surprised the model was, how unsure, what else it nearly said. This
      is what OpenAI's `logprobs` / `top_logprobs` report, so `top` is what the batch records' `top_logprobs` list.
      Forced tokens (tool output, program feeds, grammar-forced tokens) get it too: the model produced logits for
      their position, fast-forwarded runs included (the run's forward computes every position's logits).
    - the sampling distribution actually drawn from: temperature, top-k, top-p and the grammar mask applied.
      `sampling_logprob` / `sampling_top` are about it; forbidden tokens never appear in `sampling_top`. A greedy
      row's sampling distribution is the argmax alone (log-probability 0). Forced tokens were not drawn, so they
      have None / () here.
    """

    logprob: float  # of the emitted token under the model's distribution
    piece: bytes  # the emitted token's own bytes (its text may come out with a later token's)
    entropy: float  # of the model's distribution, in nats: within [0, log V]
    top: tuple[Alternative, ...]  # the model's N most likely tokens, most likely first
    sampling_logprob: float | None = None  # of the emitted token under the sampling distribution (None: forced)
    sampling_top: tuple[Alternative, ...] = ()  # that distribution's N most likely tokens with probability > 0

    @property
    def surprise(self) -> float:
        """-log p under the model, in nats: 0 for a certain token, large for a surprising one."""
        return -self.logprob

    @property
    def probability(self) -> float:
        return math.exp(self.logprob)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One emitted token of one row."""

    row: int
    token: int
    forced: bool
    # Decoded text delta: UTF-8-safe incremental detokenization, so it may be "" while a character's bytes are
    # incomplete and the bytes appear with a later token. Special tokens decode to their literal name, e.g.
    # "<|python_start|>"; `special` says so, and the UI shows a readable marker instead.
    text: str
    special: bool = False
    # Zone tags of the TTFA zone the token was emitted in (empty without a program).
    tags: tuple[str, ...] = ()
    zone: str | None = None
    # Router probability and decision of each STT layer when this token was processed by the model, ordered as
    # `Engine.stt_layers`. None for a token that was never fed to the model (the final stop token).
    router_probs: tuple[float, ...] | None = None
    computed: tuple[bool, ...] | None = None
    tool: ToolEvent | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    # With `GenerationSettings.logprobs` > 0: the token's log-probability, entropy and alternatives.
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True, slots=True)
class PromptInfo:
    """What a `generate` call prefilled; carried by its first Step."""

    rows: int
    prompt_tokens: tuple[int, ...]  # per row
    prefill_seconds: float
    # Per row: router probs / decisions for each prompt token, [tokens][stt_layers]; None with routing off.
    router_probs: tuple[tuple[tuple[float, ...], ...], ...] | None = None
    computed: tuple[tuple[tuple[bool, ...], ...], ...] | None = None
    context_used: tuple[int, ...] = field(default_factory=tuple)
    context_size: int = 0


@dataclass(frozen=True, slots=True)
class Step:
    """All tokens emitted by one model forward, plus timing for stats."""

    index: int
    tokens: tuple[TokenEvent, ...]
    # Seconds spent in this step (forward + sampling + automaton), measured on the host after the device copy.
    seconds: float = 0.0
    # Number of rows still running after this step.
    active_rows: int = 0
    # Set on the first Step of a `generate` call only: what was prefilled.
    prompt: PromptInfo | None = None
