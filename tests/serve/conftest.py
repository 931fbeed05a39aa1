"""A `chatapp serve` server started by the test, in a thread, on a free port, over the tiny model (or another
engine), and the real `openai` client pointed at it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from chatapp.models import load_engine
from chatapp.serve.app import ServeConfig
from chatapp.serve.command import build_server


@dataclass
class RunningServer:
    url: str  # ends in /v1
    server: Any
    engine: Any

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def client(self, api_key: str = "unused", **options: Any):
        import openai

        return openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0, **options)


@contextmanager
def running_server(engine, **options: Any) -> Iterator[RunningServer]:
    """Serve `engine` on a free port until the block ends (`ServeConfig` fields and `build_server` options)."""
    config_fields = {k: options.pop(k) for k in ("api_key", "request_timeout") if k in options}
    config = ServeConfig(model_id=options.pop("model_id", "tiny"), **config_fields)
    ready = threading.Event()
    urls: list[str] = []

    def on_ready(url: str) -> None:
        urls.append(url)
        ready.set()

    server = build_server(engine, config, port=0, on_ready=on_ready, **options)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    try:
        yield RunningServer(urls[0], server, engine)
    finally:
        server.should_exit = True
        thread.join(20)
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="session")
def tiny_engine():
    return load_engine("tiny", "cpu")


@pytest.fixture(scope="module")
def served(tiny_engine) -> Iterator[RunningServer]:
    with running_server(tiny_engine) as server:
        yield server


@pytest.fixture
def serve_with(tiny_engine) -> Callable[..., Any]:
    """A server of the tiny model with other options, for the test's own `with` block."""
    return lambda **options: running_server(tiny_engine, **options)
