"""One choice of a reply as OpenAI's wire format shows it: text deltas after `stop` strings, log-probs, the finish
reason, and chatapp's extension field.

Each choice folds its row's token events with the engine's one reply fold (`engine/reply.py`), so its text is what
`chatapp generate` prints: a calculator call and its result are part of it, markers included (the default model
writes `<jupyter_code>37*45<jupyter_output>1665<jupyter_text>37*45 is 1665.`, its result tokens forced).

The extension field, `chatapp`, is sent only to a request that asked for it (`"chatapp": {"tokens": true}`). Each
chunk's choice (or the whole reply's choice) gets `{"tokens": [...]}`, one object per token whose text it carries:
`id`, `text`, `forced` (the system put it there: tool output, grammar), `special`, `zone` and `tags` (a TTFA zone),
`computed` and `router_probs` (per STT layer, in `stt_layers` order: did the layer compute this token), and
`tool` (a call, its result or refusal), `finish_reason` and `error` (chatapp's, on the row's last token, the final
stop token included though it adds no text), and `logprobs` (with the request's log-probs: the model's `logprob`,
`entropy`, `bytes` and `top` alternatives with their ids). The first chunk of a stream gives `prompt_tokens` and
`context_size`. The choice that finishes adds `finish` (chatapp's own finish reason, an
`error` when there is one, `forced_tokens`, `compute_saved` and the model's `stt_layers`). OpenAI clients ignore
fields they do not know, so they read the reply as any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from chatapp.engine.events import TokenEvent, TokenLogprobs
from chatapp.engine.reply import Reply
from chatapp.serve.stops import StopMatcher

# chatapp's finish reasons in OpenAI's words: a full context cut the reply as max_tokens would.
OPENAI_FINISH = {"stop": "stop", "length": "length", "context": "length", "program": "stop", "error": "stop"}


@dataclass
class Delta:
    """What one batch of a choice's events adds to the reply."""

    text: str = ""
    logprobs: list[Any] = field(default_factory=list)  # entries in the endpoint's shape
    tokens: list[dict[str, Any]] = field(default_factory=list)  # extension entries
    finish_reason: str | None = None

    def __bool__(self) -> bool:
        return bool(self.text or self.logprobs or self.tokens or self.finish_reason)


@dataclass
class Choice:
    """One row of a request, folded as its events arrive."""

    index: int
    reply: Reply
    stops: StopMatcher
    kind: Literal["chat", "completion"]
    top_logprobs: int | None
    insight: bool
    stt_layers: list[int]
    finish_reason: str | None = None
    text: str = ""
    completion_tokens: int = 0
    _held: list[tuple[Any, dict[str, Any] | None]] = field(default_factory=list)  # per token held with its text
    _offset: int = 0  # characters returned so far (completions' `text_offset`)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, events: list[TokenEvent]) -> Delta:
        """Fold this row's events of one step. A stop string ends the choice (the caller frees its row)."""
        delta = Delta()
        for event in events:
            if self.finished:
                break
            piece = self.reply.add(event)
            if event.finish_reason == "stop" and not piece:  # a final stop token is not part of the reply's text
                self._held.append((None, self._token_entry(event)))
            else:
                self.completion_tokens += 1
                self._held.append((self._logprob_entry(event), self._token_entry(event)))
            check = self.stops.push(piece)
            if check.stopped or not self.stops.held:
                self._release(delta, check.text, keep_tokens=bool(check.text) or not check.stopped)
            if check.stopped:
                self.finish_reason = "stop"
            elif event.finish_reason is not None:
                self._release(delta, self.stops.flush(), keep_tokens=True)
                self.finish_reason = OPENAI_FINISH.get(event.finish_reason, "stop")
        if self.finished:
            delta.finish_reason = self.finish_reason
        return delta

    def finish_info(self) -> dict[str, Any]:
        """The extension's summary of the finished row."""
        reply = self.reply
        return {
            "finish_reason": reply.finish_reason,
            "error": reply.error,
            "forced_tokens": reply.forced_count,
            "compute_saved": round(reply.compute_saved, 4),
            "stt_layers": self.stt_layers,
        }

    def _release(self, delta: Delta, text: str, *, keep_tokens: bool) -> None:
        delta.text += text
        self.text += text
        if keep_tokens:
            for logprob, token in self._held:
                if logprob is not None:
                    delta.logprobs.append(logprob)
                if token is not None:
                    delta.tokens.append(token)
        self._held = []

    def _logprob_entry(self, event: TokenEvent) -> Any:
        if self.top_logprobs is None or event.logprobs is None:
            return None
        lp: TokenLogprobs = event.logprobs
        top = lp.top[: self.top_logprobs]
        token = lp.piece.decode("utf-8", errors="replace")
        if self.kind == "completion":
            entry = (token, lp.logprob, {a.text: a.logprob for a in top}, self._offset)
            self._offset += len(event.text)
            return entry
        return {
            "token": token,
            "logprob": lp.logprob,
            "bytes": list(lp.piece),
            "top_logprobs": [{"token": a.text, "logprob": a.logprob, "bytes": list(a.piece)} for a in top],
        }

    def _token_entry(self, event: TokenEvent) -> dict[str, Any] | None:
        if not self.insight:
            return None
        tool = event.tool
        lp = event.logprobs
        return {
            "id": event.token,
            "text": event.text,
            "forced": event.forced,
            "special": event.special,
            "zone": event.zone,
            "tags": list(event.tags),
            "computed": None if event.computed is None else list(event.computed),
            "router_probs": None if event.router_probs is None else list(event.router_probs),
            "tool": None
            if tool is None
            else {"kind": tool.kind, "tool": tool.tool, "expression": tool.expression, "output": tool.output},
            "finish_reason": event.finish_reason,
            "error": event.error,
            "logprobs": None
            if lp is None or self.top_logprobs is None
            else {
                "logprob": lp.logprob,
                "entropy": lp.entropy,
                "bytes": list(lp.piece),
                "top": [{"id": a.token, "bytes": list(a.piece), "logprob": a.logprob} for a in lp.top],
            },
        }


def completion_logprobs(entries: list[Any]) -> dict[str, Any]:
    """Completions' log-probs object from (token, logprob, top, text_offset) entries."""
    return {
        "tokens": [e[0] for e in entries],
        "token_logprobs": [e[1] for e in entries],
        "top_logprobs": [e[2] for e in entries],
        "text_offset": [e[3] for e in entries],
    }
