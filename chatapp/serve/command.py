"""`chatapp serve`: load the model once, start the engine loop, and run the app on uvicorn until a signal.

Why Starlette on uvicorn, not FastAPI: the server is five routes whose bodies are checked by hand (`requests.py`),
because OpenAI's error object and `param` names are part of the contract and FastAPI's validation answers 422 in
its own shape; what FastAPI adds on top of Starlette (pydantic models, generated OpenAPI pages) would go unused,
and cost a start-up import of pydantic. uvicorn is the ASGI server Starlette's own docs run. This module is
imported only by the `serve` command, so neither is imported by any other command.

Shutdown: the first SIGTERM or Ctrl-C stops accepting connections and makes the loop refuse new requests (503);
replies in flight get `GRACE_SECONDS` to finish, then are cancelled; the process exits 0. A second Ctrl-C (or
SIGTERM) skips the wait.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from chatapp.engine.engine import Engine
from chatapp.serve.app import ServeConfig, Service, create_app
from chatapp.serve.scheduler import EngineLoop

GRACE_SECONDS = 10  # replies in flight may finish within this after a first signal
HANDLED = (signal.SIGINT, signal.SIGTERM)


def build_server(
    engine: Engine,
    config: ServeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_rows: int = 32,
    max_queue: int = 64,
    log_level: str = "warning",
    on_ready: Callable[[str], None] | None = None,
) -> DrainingServer:
    """A server for `engine`, not yet running: `run()` serves until a signal (or `should_exit`), on any thread."""
    engine.prepare_tool_grammars()
    _ = engine.constraint_vocab  # `response_format` compiles against it: built now, not by the first such request
    loop = EngineLoop(engine, max_rows=max_rows, max_queue=max_queue)
    app = create_app(Service(engine, loop, config))
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level in ("info", "debug", "trace"),
        timeout_graceful_shutdown=GRACE_SECONDS,
        lifespan="off",
    )
    return DrainingServer(uv_config, loop, on_ready)


class DrainingServer(uvicorn.Server):
    """uvicorn's `Server` that owns the engine loop: the loop drains on the first signal, a second signal skips the
    grace period, and no signal is re-raised after a clean shutdown (uvicorn's own re-raises it, which would end
    the process by the signal instead of exit 0)."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, on_ready: Callable[[str], None] | None) -> None:
        super().__init__(config)
        self.engine_loop = loop
        self.on_ready = on_ready

    def run(self, sockets: Any = None) -> None:
        self.engine_loop.start()
        try:
            super().run(sockets)
        finally:
            self.engine_loop.stop(timeout=2.0)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine_loop.drain()
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.should_exit:  # the port could not be bound (uvicorn logged why)
            return
        host, port = self.config.host, self.config.port
        for server in self.servers:  # the port actually bound (port 0: the system's choice)
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
        url = f"http://{host}:{port}/v1"
        if self.on_ready is not None:
            self.on_ready(url)
        else:
            print(f"chatapp serve: listening at {url}", file=sys.stderr, flush=True)
