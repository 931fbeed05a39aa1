"""A light client of a `chatapp serve` server (or any OpenAI-compatible one) for the CLI: `generate --server URL`.

The standard library only (`http.client`), so a command that talks to a server starts as fast as `chatapp --help`:
no torch, no HTTP library. It streams `/v1/chat/completions` and yields each server-sent event's JSON.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from chatapp.errors import ServerError

SERVER_ENV = "CHATAPP_SERVER"
API_KEY_ENV = "CHATAPP_API_KEY"


def check_api_key(key: str | None) -> None:
    """An API key travels in an HTTP header: printable ASCII without spaces, or it could never be sent."""
    if key is not None and (not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key)):
        raise ServerError(
            f"the API key (--api-key or {API_KEY_ENV}) must be printable ASCII without spaces",
            hint="use a key of letters, digits and punctuation",
        )


def api_base(url: str) -> tuple[str, int, str, bool]:
    """(host, port, path prefix, https) of a server URL: `http://host:port`, with or without `/v1`."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(
            f"--server (or {SERVER_ENV}) {url!r} is not an http(s) URL",
            hint="give the server's URL, e.g. http://127.0.0.1:8000",
        )
    https = parts.scheme == "https"
    try:
        port = parts.port or (443 if https else 80)
    except ValueError:
        raise ServerError(
            f"--server (or {SERVER_ENV}) {url!r} has a bad port", hint="e.g. http://127.0.0.1:8000"
        ) from None
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return parts.hostname, port, path, https


def get_json(url: str, path: str, *, api_key: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """GET `path` (under the API's `/v1`) and return its JSON; a refusal raises `ServerError`."""
    check_api_key(api_key)
    host, port, prefix, https = api_base(url)
    connection_class = http.client.HTTPSConnection if https else http.client.HTTPConnection
    connection = connection_class(host, port, timeout=timeout)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        try:
            connection.request("GET", f"{prefix}{path}", headers=headers)
            response = connection.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as err:
            raise _unreachable(url, err) from None
        if response.status != 200:
            raise _refusal(url, response.status, body)
        return json.loads(body)
    finally:
        connection.close()


def stream_chat(
    url: str, body: dict[str, Any], *, api_key: str | None = None, timeout: float = 600.0
) -> Iterator[dict[str, Any]]:
    """POST `body` (with `stream: true`) to the server's `/chat/completions` and yield each event's JSON until
    `[DONE]`. A refused request raises `ServerError` with the server's own message."""
    check_api_key(api_key)
    host, port, prefix, https = api_base(url)
    connection_class = http.client.HTTPSConnection if https else http.client.HTTPConnection
    connection = connection_class(host, port, timeout=timeout)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        try:
            connection.request("POST", f"{prefix}/chat/completions", json.dumps({**body, "stream": True}), headers)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as err:
            raise _unreachable(url, err) from None
        if response.status != 200:
            raise _refusal(url, response.status, response.read())
        for raw in response:
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise _refusal(url, 200, data.encode())
            yield event
    except TimeoutError:
        raise ServerError(f"the server at {url} did not answer within {timeout:g} s", hint="try again") from None
    finally:
        connection.close()


def _unreachable(url: str, err: Exception) -> ServerError:
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err) or type(err).__name__
    return ServerError(
        f"cannot reach the server at {url} (--server or {SERVER_ENV}): {reason}",
        hint="start one with `chatapp serve`, or check the URL and port",
    )


def _refusal(url: str, status: int, body: bytes) -> ServerError:
    """The server's error object as a `ServerError` (its message, and a fix by status)."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", errors="replace")[:200] or f"HTTP {status}"
    hints = {
        401: "pass the server's key with --api-key (or $CHATAPP_API_KEY)",
        404: "check the URL, and --model against the server's /v1/models",
        429: "the server is busy: try again shortly",
        503: "the server is shutting down: start it again",
    }
    return ServerError(f"the server at {url} refused the request: {message}", hint=hints.get(status, "see the message"))
