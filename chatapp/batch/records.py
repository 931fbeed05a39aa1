"""Turning one row's stream of `TokenEvent`s into its output record."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chatapp.batch.requests import RequestId
from chatapp.engine.events import FinishReason, TokenEvent, ToolEvent


@dataclass
class RowTimings:
    """Seconds one row spent: the prefill of the call it was in, then decode steps until it finished."""

    prefill_s: float = 0.0
    decode_s: float = 0.0

    def as_record(self, tokens: int) -> dict[str, float]:
        rate = tokens / self.decode_s if self.decode_s > 0 else 0.0
        return {
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "tokens_per_s": round(rate, 3),
        }


@dataclass
class RowAccumulator:
    """Collects one row's tokens as they stream; `record()` builds the JSON record once it finished."""

    stt_layers: Sequence[int]
    tokens: list[int] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)
    tags: list[list[str]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    special: list[bool] = field(default_factory=list)
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    # Per STT layer: how many of this row's model-processed tokens the layer computed, and of how many.
    computed: list[int] = field(default_factory=list)
    routed_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    timings: RowTimings = field(default_factory=RowTimings)

    def __post_init__(self) -> None:
        self.computed = [0] * len(self.stt_layers)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: TokenEvent) -> None:
        self.tokens.append(event.token)
        self.forced.append(event.forced)
        self.tags.append(list(event.tags))
        self.texts.append(event.text)
        self.special.append(event.special)
        if event.computed is not None:
            self.routed_tokens += 1
            for layer, was_computed in enumerate(event.computed):
                self.computed[layer] += bool(was_computed)
        if event.tool is not None:
            self._add_tool_event(event.tool)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.error = event.error

    def _add_tool_event(self, tool: ToolEvent) -> None:
        if tool.kind == "call":
            self.tool_calls.append({"tool": tool.tool, "expression": tool.expression})
            return
        # A result or refusal answers the latest call of that expression that has no outcome yet.
        for call in reversed(self.tool_calls):
            if call["expression"] == tool.expression and "result" not in call and "refusal" not in call:
                call[tool.kind] = tool.output or ""
                return
        # The engine sent an outcome without a call event: keep it rather than lose it.
        self.tool_calls.append({"tool": tool.tool, "expression": tool.expression, tool.kind: tool.output or ""})

    def text(self) -> str:
        """The decoded answer: every token's text, except a final stop token (it ends the answer, it is not in it)."""
        texts = self.texts
        if self.finish_reason == "stop" and self.special and self.special[-1]:
            texts = texts[:-1]
        return "".join(texts)

    def routing(self) -> dict[str, float]:
        """Fraction of this row's processed tokens each STT layer computed, keyed by layer index."""
        if not self.routed_tokens:
            return {}
        return {
            str(layer): round(count / self.routed_tokens, 6)
            for layer, count in zip(self.stt_layers, self.computed, strict=True)
        }

    def record(self, request_id: RequestId, sample: int) -> dict[str, Any]:
        record: dict[str, Any] = {
            "id": request_id,
            "sample": sample,
            "text": self.text(),
            "finish_reason": self.finish_reason,
            "tokens": self.tokens,
            "forced": self.forced,
            "tags": self.tags,
            "tool_calls": self.tool_calls,
            "routing": self.routing(),
            "timings": self.timings.as_record(len(self.tokens)),
        }
        if self.error is not None:
            record["error"] = self.error
        return record
