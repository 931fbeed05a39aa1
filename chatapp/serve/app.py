"""The HTTP side of `chatapp serve`: OpenAI's endpoints over the engine loop (`scheduler.py`), as a Starlette app.

    POST body ─► read (413 past `MAX_BODY`) ─► check fields (`requests.py`) ─► render the prompt, map the settings,
    compile a schema, build the rows (`Engine.admission`, in a worker thread) ─► queue (`EngineLoop.submit`: 429 when
    full) ─► the loop's events, per choice: stop strings, log-probs, extension (`replies.py`) ─► JSON or SSE

Every failure is OpenAI's error object (`errors.py`); an unexpected one is a 500 object whose message says to look in
the server's log, never a traceback on the wire. A client that hangs up is noticed by a task that watches the
connection, which takes its rows out of the batch at the next step, streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from chatapp.engine.engine import Engine
from chatapp.errors import ChatappError, ConstraintError, ContextOverflowError
from chatapp.serve.errors import ApiError
from chatapp.serve.replies import Choice, Delta, completion_logprobs
from chatapp.serve.requests import ServeRequest, generation_settings, parse_request, read_body
from chatapp.serve.scheduler import Delivery, EngineLoop, Ticket
from chatapp.serve.stops import StopMatcher
from chatapp.validation import check_prompt_fits, prompt_chars

log = logging.getLogger("chatapp.serve")

MAX_BODY = 4 << 20  # bytes: a request body past this gets 413


@dataclass(frozen=True)
class ServeConfig:
    """What the server was started with."""

    model_id: str
    api_key: str | None = None
    routing_level: str | None = None
    request_timeout: float = 600.0  # seconds a request may take, queue included


class Service:
    """The engine, its loop and the server's settings: what every endpoint works with."""

    def __init__(self, engine: Engine, loop: EngineLoop, config: ServeConfig) -> None:
        self.engine = engine
        self.loop = loop
        self.config = config
        self.created = int(time.time())

    def model_card(self) -> dict[str, Any]:
        """OpenAI's model object, with what a chatapp client shows about the model under `chatapp`."""
        engine = self.engine
        config = engine.model.config
        markers = engine.tool_markers
        return {
            "id": self.config.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "chatapp",
            "chatapp": {
                "device": str(engine.device),
                "num_layers": engine.num_layers,
                "stt_layers": engine.stt_layers,
                "context_size": engine.context_size,
                "supports_tools": bool(engine.chat_format.supports_tools),
                "tool_markers": {
                    "call_start": markers.call_start,
                    "call_end": markers.call_end,
                    "output_start": markers.output_start,
                    "output_end": markers.output_end,
                },
                "skip_mode": str(getattr(config, "skip_mode", "strict")),
                "skip_cost": engine.skip_cost,
                "routing_levels": list(engine.routing_levels),
                "routing_level": self.config.routing_level,
            },
        }

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_id:
            raise ApiError(
                404,
                f"the model {name!r} does not exist here; this server serves {self.config.model_id!r}",
                param="model",
                code="model_not_found",
            )

    def admit(self, request: ServeRequest) -> Ticket:
        """The request's rows, checked and built (host work: run it in a worker thread)."""
        engine = self.engine
        param = "messages" if request.kind == "chat" else "prompt"
        try:
            check_prompt_fits(prompt_chars(request.prompt, request.messages), engine.context_size, engine.tokenizer)
            if request.kind == "chat":
                ids = engine.chat_format.render_for_completion(request.messages or [])
            else:
                bos = getattr(engine.chat_format, "bos_id", None)
                ids = ([] if bos is None else [bos]) + engine.chat_format.encode_text(request.prompt or "")
            if not ids:
                raise ApiError(400, "the prompt is empty", param=param, code="invalid_value")
            if len(ids) >= engine.context_size:
                raise ContextOverflowError(
                    f"the prompt has {len(ids)} tokens but the model's context holds {engine.context_size}, "
                    "with no room left to answer",
                    hint=f"shorten the prompt below {engine.context_size} tokens",
                )
            settings = generation_settings(
                request,
                room=engine.context_size - len(ids),
                routing_level=self.config.routing_level,
                model_defaults=engine.default_settings,
            )
            constraint = None
            if request.json_schema is not None:
                try:
                    constraint = engine.constraint(json_schema=request.json_schema)
                except ChatappError as err:
                    raise ApiError.from_chatapp(err, param="response_format") from None
            first = self.loop.first_row(request.n)
            admission = engine.admission(ids, settings, first_row=first, num_samples=request.n, constraint=constraint)
        except ConstraintError as err:
            raise ApiError.from_chatapp(err, param="response_format") from None
        except ChatappError as err:
            raise ApiError.from_chatapp(err, param=param) from None
        return Ticket(admission, deliver=lambda item: None)  # `Exchange` routes its deliveries to its queue


# ------------------------------------------------------------------------------------------------ one request
class Exchange:
    """One request in flight: its ticket in the loop, the queue its events arrive on, and its choices."""

    def __init__(self, service: Service, request: ServeRequest, ticket: Ticket) -> None:
        self.service = service
        self.request = request
        self.ticket = ticket
        self.id = ("chatcmpl-" if request.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.deadline = time.monotonic() + service.config.request_timeout
        self.queue: asyncio.Queue[Delivery | None] = asyncio.Queue()
        self.gone = False
        engine = service.engine
        self.choices = {
            row: Choice(
                index=i,
                reply=engine.new_reply(row),
                stops=StopMatcher(request.stop),
                kind=request.kind,
                top_logprobs=request.top_logprobs,
                insight=request.insight,
                stt_layers=engine.stt_layers,
            )
            for i, row in enumerate(ticket.rows)
        }
        self.prompt_tokens = len(ticket.admission.prompt_ids)
        aloop = asyncio.get_running_loop()

        def deliver(item: Delivery) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop closed (shutdown): nobody is listening
                aloop.call_soon_threadsafe(self.queue.put_nowait, item)

        ticket.deliver = deliver

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices.values())

    def hang_up(self) -> None:
        """The client left: free the rows now."""
        self.gone = True
        self.service.loop.cancel(self.ticket)
        self.queue.put_nowait(None)

    async def deltas(self) -> AsyncIterator[dict[int, Delta]]:
        """Per step, what each choice gained, until every choice finished (or the client left)."""
        while not self.finished:
            remaining = self.deadline - time.monotonic()
            try:
                item = await asyncio.wait_for(self.queue.get(), max(remaining, 0.001))
            except TimeoutError:
                self.service.loop.cancel(self.ticket)
                raise ApiError(
                    408,
                    f"the request took longer than the server's limit of {self.service.config.request_timeout:g} s",
                    code="timeout",
                ) from None
            if item is None:
                return
            if isinstance(item, ApiError):
                raise item
            if isinstance(item, BaseException):
                raise ApiError(500, "the engine failed this request; the server's log has the details") from item
            by_row: dict[int, list] = {}
            for event in item:
                by_row.setdefault(event.row, []).append(event)
            out: dict[int, Delta] = {}
            stopped = False
            for row, events in by_row.items():
                choice = self.choices[row]
                was_running = not choice.finished
                out[row] = choice.add(events)
                if was_running and choice.finished and events[-1].finish_reason is None:
                    stopped = True  # a stop string ended it: its row is still generating
            if stopped:
                self.service.loop.cancel_rows(self.ticket, [row for row, c in self.choices.items() if c.finished])
            yield out

    def usage(self) -> dict[str, int]:
        completion = sum(c.completion_tokens for c in self.choices.values())
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    # ------------------------------------------------------------------------------------------- wire shapes
    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.request.kind == "chat" else "text_completion"
        body: dict[str, Any] = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.service.config.model_id,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return body

    def delta_choice(self, row: int, delta: Delta) -> dict[str, Any]:
        choice = self.choices[row]
        body: dict[str, Any] = {"index": choice.index}
        if self.request.kind == "chat":
            body["delta"] = {"content": delta.text} if delta.text else {}
            body["logprobs"] = {"content": delta.logprobs} if self.request.top_logprobs is not None else None
        else:
            body["text"] = delta.text
            body["logprobs"] = completion_logprobs(delta.logprobs) if self.request.top_logprobs is not None else None
        body["finish_reason"] = delta.finish_reason
        self._extension(body, choice, delta.tokens, delta.finish_reason is not None)
        return body

    def whole_choice(self, row: int, tokens: list[dict[str, Any]], logprobs: list[Any]) -> dict[str, Any]:
        choice = self.choices[row]
        body: dict[str, Any] = {"index": choice.index}
        if self.request.kind == "chat":
            body["message"] = {"role": "assistant", "content": choice.text, "refusal": None}
            body["logprobs"] = {"content": logprobs} if self.request.top_logprobs is not None else None
        else:
            body["text"] = choice.text
            body["logprobs"] = completion_logprobs(logprobs) if self.request.top_logprobs is not None else None
        body["finish_reason"] = choice.finish_reason
        self._extension(body, choice, tokens, True)
        return body

    def _extension(self, body: dict[str, Any], choice: Choice, tokens: list[dict[str, Any]], final: bool) -> None:
        if not self.request.insight:
            return
        body["chatapp"] = {"tokens": tokens}
        if final:
            body["chatapp"]["finish"] = choice.finish_info()


async def watch_connection(receive: Receive, exchange: Exchange) -> None:
    """Wait for the client to hang up, then free its rows."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            exchange.hang_up()
            return


class EventStream:
    """A server-sent-events response that notices the client leaving while it waits for tokens (Starlette's
    `StreamingResponse` notices only when a write fails, on some ASGI servers)."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = self.exchange
        watcher = asyncio.create_task(watch_connection(receive, exchange))
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for event in self._events():
                if exchange.gone:
                    return
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went while we wrote
            exchange.hang_up()
        finally:
            watcher.cancel()
            if not exchange.finished and not exchange.gone:
                exchange.service.loop.cancel(exchange.ticket)

    async def _events(self) -> AsyncIterator[bytes]:
        exchange = self.exchange
        request = exchange.request
        if request.kind == "chat":  # OpenAI's first chunk gives each choice its role
            first = [
                {
                    "index": c.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for c in exchange.choices.values()
            ]
            if request.insight:
                context = exchange.service.engine.context_size
                for choice in first:
                    choice["chatapp"] = {"tokens": [], "prompt_tokens": exchange.prompt_tokens, "context_size": context}
            yield sse(exchange.chunk(first))
        try:
            async for deltas in exchange.deltas():
                choices = [exchange.delta_choice(row, delta) for row, delta in deltas.items() if delta]
                if choices:
                    yield sse(exchange.chunk(choices))
        except ApiError as err:
            yield sse(err.body())
            yield b"data: [DONE]\n\n"
            return
        if request.include_usage:
            yield sse(exchange.chunk([], usage=exchange.usage()))
        yield b"data: [DONE]\n\n"


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


# --------------------------------------------------------------------------------------------------- the app
def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def read_limited(request: Request) -> bytes:
    """The body, refused with 413 past `MAX_BODY` (by its declared length, or as it arrives)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
        raise ApiError(413, f"the request body is {int(declared):,} bytes; the limit is {MAX_BODY:,}", code="too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"the request body is over the limit of {MAX_BODY:,} bytes", code="too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(service: Service) -> Starlette:
    """The ASGI app: `/v1/models`, `/v1/models/{id}`, `/v1/chat/completions`, `/v1/completions`, `/health`."""
    from starlette.concurrency import run_in_threadpool

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [service.model_card()]})

    async def model(request: Request) -> Response:
        service.check_model(request.path_params["model"])
        return JSONResponse(service.model_card())

    async def health(request: Request) -> Response:
        rows, waiting = service.loop.load
        return JSONResponse({"status": "ok", "rows": rows, "waiting": waiting})

    async def complete(request: Request, kind: Literal["chat", "completion"]) -> Response:
        parsed = parse_request(read_body(await read_limited(request)), kind)
        service.check_model(parsed.model)
        ticket = await run_in_threadpool(service.admit, parsed)
        exchange = Exchange(service, parsed, ticket)
        service.loop.submit(ticket)
        if parsed.stream:
            return EventStream(exchange)  # type: ignore[return-value]
        return await whole_reply(request, exchange)

    async def chat(request: Request) -> Response:
        return await complete(request, "chat")

    async def completions(request: Request) -> Response:
        return await complete(request, "completion")

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        message = "no such endpoint" if status == 404 else str(exc.detail)
        return error_response(ApiError(status, f"{message}: {request.method} {request.url.path}"))

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error serving %s", request.url.path, exc_info=exc)
        return error_response(ApiError(500, "the server failed this request; its log has the details"))

    app = Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: unexpected},
    )
    if service.config.api_key is not None:
        return require_key(app, service.config.api_key)  # type: ignore[return-value]
    return app


async def whole_reply(request: Request, exchange: Exchange) -> Response:
    """A non-streamed reply: every choice to its end, while a task watches for the client hanging up."""
    watcher = asyncio.create_task(watch_connection(request.receive, exchange))
    tokens: dict[int, list[dict[str, Any]]] = {row: [] for row in exchange.choices}
    logprobs: dict[int, list[Any]] = {row: [] for row in exchange.choices}
    try:
        async for deltas in exchange.deltas():
            for row, delta in deltas.items():
                tokens[row] += delta.tokens
                logprobs[row] += delta.logprobs
    finally:
        watcher.cancel()
        if not exchange.finished and not exchange.gone:
            exchange.service.loop.cancel(exchange.ticket)
    if exchange.gone:
        return Response(status_code=499)  # nobody reads it
    kind = "chat.completion" if exchange.request.kind == "chat" else "text_completion"
    body = exchange.chunk([exchange.whole_choice(row, tokens[row], logprobs[row]) for row in exchange.choices])
    body["object"] = kind
    body["usage"] = exchange.usage()
    return JSONResponse(body)


def require_key(app: Any, key: str) -> Any:
    """ASGI middleware: every HTTP request but `/health` needs `Authorization: Bearer KEY` (401 otherwise)."""
    expected = f"Bearer {key}".encode()

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                err = ApiError(
                    401,
                    "missing or wrong API key: send the server's key as `Authorization: Bearer KEY`",
                    code="invalid_api_key",
                )
                await error_response(err)(scope, receive, send)
                return
        await app(scope, receive, send)

    return guarded
