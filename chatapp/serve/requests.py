"""A request's JSON body read into what the engine runs: which fields the server takes, and in one function
(`generation_settings`) how they become `GenerationSettings`.

Every field is checked here, before the request queues: a malformed body, a wrong type or a bad value is a 400
error object naming the field (`param`). A field chatapp does not implement is refused by name, never silently
ignored, unless its value asks for nothing (`presence_penalty: 0`, `logit_bias: {}`), which some clients always send.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

from chatapp.errors import ChatappError
from chatapp.serve.errors import ApiError, bad_value
from chatapp.settings import MAX_MAX_TOKENS, SAMPLING_FIELDS, GenerationSettings
from chatapp.tools.parts import PART_TYPES
from chatapp.validation import MAX_LOGPROBS

MAX_SAMPLES = 16  # `n`: rows one request may take in the batch
MAX_STOPS = 4  # OpenAI's limit on `stop` strings
MAX_STOP_CHARS = 256

# Fields of OpenAI's requests that chatapp does not implement, with the value that asks for nothing.
UNSUPPORTED: dict[str, Any] = {
    "logit_bias": {},
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "parallel_tool_calls": None,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
    "reasoning_effort": None,
    "web_search_options": None,
}
# Fields that change nothing about a reply: taken and ignored.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})

COMMON = frozenset(
    {"model", "max_tokens", "n", "seed", "stop", "stream", "stream_options", "chatapp", *SAMPLING_FIELDS}
)
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs"}


@dataclass(frozen=True)
class ServeRequest:
    """One checked request: its prompt (chat `messages` or a plain `prompt`) and what the reply must look like."""

    kind: Literal["chat", "completion"]
    body: dict[str, Any]
    model: str | None
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no log-probs; else how many alternatives each token lists
    json_schema: Any = None  # from response_format: the schema the reply is held to (None: free text)
    insight: bool = False  # the `chatapp` extension field asked for: per-token data in the reply


def read_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def parse_request(body: dict[str, Any], kind: Literal["chat", "completion"]) -> ServeRequest:
    """Check the fields of a `/v1/chat/completions` (`chat`) or `/v1/completions` body."""
    allowed = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    for name, value in body.items():
        if name in allowed or name in IGNORED:
            continue
        if name in UNSUPPORTED:
            if value is None or value == UNSUPPORTED[name]:
                continue
            raise ApiError(
                400,
                f"chatapp does not support {name!r}; leave it out (or send {json.dumps(UNSUPPORTED[name])})",
                param=name,
                code="unsupported_parameter",
            )
        raise ApiError(400, f"unknown field {name!r}", param=name, code="unknown_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_value("model", f"model must be a string, got {json.dumps(model)}")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad_value("stream_options", 'stream_options must be an object like {"include_usage": true}')
    include_usage = bool((options or {}).get("include_usage"))
    if include_usage and not stream:
        raise bad_value("stream_options", "stream_options needs stream: true")
    common = dict(
        kind=kind,
        body=body,
        model=model,
        n=_int(body, "n", 1, MAX_SAMPLES, default=1),
        stop=_stops(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        insight=_insight(body.get("chatapp")),
    )
    if kind == "chat":
        return ServeRequest(
            messages=_messages(body.get("messages")),
            top_logprobs=_chat_logprobs(body),
            json_schema=_response_format(body.get("response_format")),
            **common,
        )
    logprobs = body.get("logprobs")
    top = None if logprobs is None else _int(body, "logprobs", 0, MAX_LOGPROBS)
    return ServeRequest(prompt=_prompt(body.get("prompt")), top_logprobs=top, **common)


def generation_settings(
    request: ServeRequest,
    *,
    room: int,
    routing_level: str | None,
    model_defaults: Callable[[GenerationSettings, Collection[str]], GenerationSettings],
) -> GenerationSettings:
    """The one place request fields become engine settings. `room`: the tokens the context leaves after the prompt
    (the reply's length when the request names none, as OpenAI's chat endpoint does); `routing_level`: the server's.
    The samplers take the settings' own names, which are OpenAI's (`temperature`, `top_p`, `presence_penalty`,
    `frequency_penalty`) and llama.cpp's server's (`top_k`, `min_p`, `repeat_last_n`, the `dry_*` fields) where they
    have one, and vLLM's `repetition_penalty`. A sampler the request leaves out is the model's own default
    (`model_defaults`: its generation_config.json, as `chatapp generate` takes it), as llama.cpp's server does;
    OpenAI's own defaults (temperature 1) belong to OpenAI's models."""
    body = request.body
    default_max = min(room, MAX_MAX_TOKENS) if request.kind == "chat" else 16  # OpenAI's defaults
    names = ("max_completion_tokens", "max_tokens") if request.kind == "chat" else ("max_tokens",)
    max_tokens = default_max
    for name in names:
        if body.get(name) is not None:
            max_tokens = _int(body, name, 1, MAX_MAX_TOKENS)
            break
    chosen: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        if body.get(name) is None:
            continue
        value = body[name]
        if name == "dry_sequence_breakers":
            if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
                raise bad_value(name, f"{name} must be a list of non-empty strings, got {json.dumps(value)}")
            value = tuple(value)
        elif name in _WHOLE_SAMPLERS:
            value = _int(body, name, -1 if name.endswith("last_n") else 0, 1 << 20)
        else:
            value = _number(body, name, -math.inf, math.inf, default=0.0)
        chosen[name] = value
    if chosen.get("top_p") == 0:
        raise bad_value("top_p", "top_p must be above 0 (1 keeps every token)")
    if "temperature" in chosen and not 0 <= chosen["temperature"] <= 2:
        raise bad_value("temperature", f"temperature must be between 0 and 2, got {chosen['temperature']}")
    values = dict(
        # Without a seed every request draws anew, as OpenAI's do; with one, the same request gives the same reply.
        seed=_int(body, "seed", 0, (1 << 63) - 1, default=secrets.randbits(63)),
        max_tokens=max_tokens,
        logprobs=0 if request.top_logprobs is None else max(1, request.top_logprobs),
        routing_level=routing_level,
    )
    try:
        return model_defaults(GenerationSettings(**values).with_(**chosen), chosen)  # type: ignore[arg-type]
    except ChatappError as err:
        param = next((name for name in chosen if name in err.message), None)
        raise ApiError.from_chatapp(err, param=param) from None


# Samplers whose values are whole numbers (the rest are numbers, and the breakers a list of strings).
_WHOLE_SAMPLERS = frozenset({"top_k", "repeat_last_n", "dry_allowed_length", "dry_penalty_last_n"})


# ---------------------------------------------------------------------------------------------------- fields
def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_value(name, f"{name} must be true or false, got {json.dumps(value)}")
    return value


def _int(body: dict[str, Any], name: str, low: int, high: int, default: int | None = None) -> int:
    value = body.get(name)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_value(name, f"{name} must be an integer, got {json.dumps(value)}")
    if not low <= value <= high:
        raise bad_value(name, f"{name} must be between {low} and {high}, got {value}")
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_value(name, f"{name} must be a number, got {json.dumps(value)}")
    if not low <= value <= high:
        raise bad_value(name, f"{name} must be between {low} and {high}, got {value}")
    return float(value)


def _stops(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if value is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_value("stop", "stop must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise bad_value("stop", f"stop takes at most {MAX_STOPS} strings, got {len(stops)}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_value("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return tuple(dict.fromkeys(stops))


def _insight(value: Any) -> bool:
    """The extension's request: `"chatapp": {"tokens": true}`."""
    if value is None:
        return False
    if not isinstance(value, dict) or set(value) - {"tokens"} or not isinstance(value.get("tokens", False), bool):
        raise bad_value("chatapp", 'chatapp must be an object like {"tokens": true}')
    return bool(value.get("tokens"))


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    asked = _flag(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not asked:
        raise bad_value("top_logprobs", "top_logprobs needs logprobs: true")
    return None if not asked else _int(body, "top_logprobs", 0, MAX_LOGPROBS, default=0)


def _messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI's messages as chatapp's: content given as a list of text parts is joined into one string."""
    if not isinstance(value, list) or not value:
        raise bad_value("messages", "messages must be a non-empty list of {role, content} objects")
    messages = []
    for index, message in enumerate(value):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_value(param, f"{param} must be an object with role and content")
        content = message.get("content")
        if isinstance(content, list):
            if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                content = "".join(p["text"] for p in content)
            elif message.get("role") != "assistant" or not all(
                isinstance(p, dict) and p.get("type") in PART_TYPES for p in content
            ):
                raise bad_value(
                    f"{param}.content",
                    f"{param}.content: only text parts are supported (and chatapp's tool-call parts in an "
                    "assistant message)",
                )
        role = "system" if message.get("role") == "developer" else message.get("role")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise bad_value(param, f"{param} has fields chatapp does not support: {', '.join(sorted(extra))}")
        messages.append({"role": role, "content": content})
    return messages


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str):
        raise bad_value("prompt", "prompt must be a string (or a list of one string)")
    return value


def _response_format(value: Any) -> Any:
    """The JSON schema a reply is held to, or None. `json_object` is any JSON object."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_value("response_format", 'response_format json_schema needs {"json_schema": {"schema": {...}}}')
        return spec["schema"]
    raise bad_value("response_format", "response_format type must be text, json_object or json_schema")
