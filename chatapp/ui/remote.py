"""`chatapp run --server URL`: the TUI over a running `chatapp serve` instead of a model of its own.

`ServerBackend` is a `ChatBackend` (`backend.py`) whose answers stream from the server's `/v1/chat/completions`
with chatapp's extension field asked for, and turns each chunk back into the `Step` events the app draws: every
token with its forced flag, zone tags, per-layer routing (the heatmap), tool events and log-probs, so the app shows
what it shows over a local model. The conversation is kept here and sent whole with every turn (the server keeps
no sessions). What needs the model in this process (the layer lens, comparing with routing off, TTFA programs,
regex constraints, another routing level) is refused with a message saying so.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from chatapp.engine.events import (
    Alternative,
    PromptInfo,
    Step,
    TokenEvent,
    TokenLogprobs,
    ToolEvent,
)
from chatapp.engine.lens import LensRequest, ReplyLens
from chatapp.engine.reply import Reply
from chatapp.errors import ConversationError, SettingsError
from chatapp.serve.client import get_json, stream_chat
from chatapp.settings import GenerationSettings
from chatapp.tools.base import ToolMarkers
from chatapp.ui.backend import TUI_SETTINGS, BackendState, Message, ModelInfo, ProgramInfo, StepStream

_LOCAL_ONLY = "run without --server to use it (the model must run in this process)"


class ServerBackend(BackendState):
    """`ChatBackend` over a `chatapp serve` server."""

    def __init__(self, url: str, *, api_key: str | None = None, settings: GenerationSettings | None = None) -> None:
        self._url = url
        self._api_key = api_key
        listing = get_json(url, "/models", api_key=api_key)
        card = listing["data"][0]
        self._model_id = card["id"]
        extra = card.get("chatapp") or {}
        if not extra:
            raise SettingsError(
                f"the server at {url} is not a chatapp server (its models carry no `chatapp` field)",
                hint="point --server at `chatapp serve`; other servers work with `generate --server`",
            )
        self._info = ModelInfo(
            name=self._model_id,
            path=f"{url} ({self._model_id})",
            device=f"server: {extra['device']}",
            num_layers=int(extra["num_layers"]),
            stt_layers=tuple(extra["stt_layers"]),
            context_size=int(extra["context_size"]),
            supports_tools=bool(extra["supports_tools"]),
            tool_markers=ToolMarkers(**extra["tool_markers"]),
            skip_mode=extra["skip_mode"],
            skip_cost=float(extra["skip_cost"]),
            routing_levels=tuple(extra["routing_levels"]),
        )
        self._routing_level = extra.get("routing_level")
        self._settings = (settings or TUI_SETTINGS).with_(routing_level=self._routing_level)
        self._constraint = None
        self._program = None
        self._messages: list[Message] = []

    # --- session ----------------------------------------------------------------------------------------------
    def builtin_programs(self) -> Sequence[str]:
        return ()

    def new_session(self, history: Sequence[Message] = ()) -> None:
        self._messages = [dict(message) for message in history]

    def send(self, text: str) -> StepStream:
        self._messages.append({"role": "user", "content": text})
        return self._answer()

    def regenerate(self) -> StepStream:
        if self._messages and self._messages[-1]["role"] == "assistant":
            self._messages.pop()
        if not self._messages or self._messages[-1]["role"] != "user":
            raise ConversationError("there is no message to answer again", hint="send a message first")
        return self._answer()

    def edit_last(self, text: str) -> StepStream:
        if self._messages and self._messages[-1]["role"] == "assistant":
            self._messages.pop()
        if not self._messages or self._messages[-1]["role"] != "user":
            raise ConversationError("there is no message to edit", hint="send a message first")
        self._messages[-1] = {"role": "user", "content": text}
        return self._answer()

    def compare_last(self) -> StepStream:
        raise SettingsError("comparing with routing off needs the server's routing changed", hint=_LOCAL_ONLY)

    def switch_program(self, name_or_path: str | None, cancel: Any = None) -> ProgramInfo | None:
        if name_or_path is not None:
            raise SettingsError(f"TTFA programs ({name_or_path}) do not run through a server", hint=_LOCAL_ONLY)
        return None

    def set_routing_level(self, level: str | None) -> None:
        if level is not None and level != self._routing_level:
            raise SettingsError(
                f"the server answers at routing level {self._routing_level!r}, not {level!r}",
                hint=f"start the server with --routing {level}, or {_LOCAL_ONLY}",
            )

    def configure(self, settings: GenerationSettings, constraint: str | None) -> None:
        if constraint:
            raise SettingsError("a regex constraint does not run through a server", hint=_LOCAL_ONLY)
        self._settings = settings.with_(routing_level=self._routing_level)

    def cancel(self, stream: StepStream) -> None:
        stream.close()  # closes the connection: the server frees the row at its next step

    def lens(self, request: LensRequest) -> ReplyLens:
        raise SettingsError("the layer lens replays the answer through the model", hint=_LOCAL_ONLY)

    # --- one answer -------------------------------------------------------------------------------------------
    def _answer(self) -> StepStream:
        settings = self._settings
        body: dict[str, Any] = {
            "model": self._model_id,
            "messages": list(self._messages),
            "max_tokens": settings.max_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "seed": settings.seed,
            "chatapp": {"tokens": True},
        }
        if settings.top_k:
            body["top_k"] = settings.top_k
        if settings.logprobs:
            body |= {"logprobs": True, "top_logprobs": settings.logprobs}
        return self._steps(stream_chat(self._url, body, api_key=self._api_key))

    def close(self) -> None:
        """Nothing to stop: the server runs on its own (an answer in flight is closed by `cancel`)."""

    def _steps(self, chunks: Iterator[dict[str, Any]]) -> StepStream:
        """Each chunk as one Step; the answer (as far as it got) joins the conversation when the stream ends, as the
        engine's session keeps it (the reply fold's content: text and tool-call parts)."""
        answer: list[TokenEvent] = []
        index = 0
        last = started = time.perf_counter()
        try:
            for chunk in chunks:
                for choice in chunk.get("choices", ()):
                    extension = choice.get("chatapp") or {}
                    now = time.perf_counter()
                    if "prompt_tokens" in extension:
                        prompt = extension["prompt_tokens"]
                        info = PromptInfo(
                            rows=1,
                            prompt_tokens=(prompt,),
                            prefill_seconds=0.0,
                            context_used=(prompt,),
                            context_size=int(extension.get("context_size", self._info.context_size)),
                        )
                        yield Step(index, (), 0.0, 1, prompt=info)
                        index += 1
                        last = now
                        continue
                    events = tuple(token_event(entry) for entry in extension.get("tokens", ()))
                    if not events:
                        continue
                    answer.extend(events)
                    finished = any(event.finish_reason is not None for event in events)
                    prefill = now - started if index <= 1 else 0.0
                    yield Step(index, events, now - last - prefill, 0 if finished else 1)
                    index += 1
                    last = now
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
            if answer:
                content = Reply.of(answer, self._info.tool_markers).content
                self._messages.append({"role": "assistant", "content": content})


def token_event(entry: dict[str, Any]) -> TokenEvent:
    """One token of the extension field as the engine's `TokenEvent`."""
    tool = entry.get("tool")
    logprobs = entry.get("logprobs")
    return TokenEvent(
        row=0,
        token=int(entry["id"]),
        forced=bool(entry["forced"]),
        text=entry["text"],
        special=bool(entry["special"]),
        tags=tuple(entry.get("tags") or ()),
        zone=entry.get("zone"),
        router_probs=None if entry.get("router_probs") is None else tuple(entry["router_probs"]),
        computed=None if entry.get("computed") is None else tuple(entry["computed"]),
        tool=None if tool is None else ToolEvent(tool["kind"], tool["tool"], tool["expression"], tool["output"]),
        finish_reason=entry.get("finish_reason"),
        error=entry.get("error"),
        logprobs=None
        if logprobs is None
        else TokenLogprobs(
            logprob=float(logprobs["logprob"]),
            piece=bytes(logprobs["bytes"]),
            entropy=float(logprobs["entropy"]),
            top=tuple(Alternative(int(a["id"]), bytes(a["bytes"]), float(a["logprob"])) for a in logprobs["top"]),
        ),
    )
