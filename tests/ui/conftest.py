"""Fixtures for the UI tests: a scripted backend, a fixed clock, and an app factory."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chatapp.ui import ChatApp, make_app
from tests.ui.scripted import ScriptedBackend

# 2024-05-01 12:00:00 UTC: history timestamps and export names are fixed in tests.
FIXED_TIME = 1714564800.0
SIZE = (120, 36)


class FixedClock:
    """A clock that starts at FIXED_TIME and advances one minute per call, so orderings are stable."""

    def __init__(self) -> None:
        self.now = FIXED_TIME

    def __call__(self) -> float:
        self.now += 60
        return self.now


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend()


@pytest.fixture
def build_app(tmp_path: Path) -> Callable[..., ChatApp]:
    """Build an app on a scripted backend with its own history database."""

    def build(backend: ScriptedBackend | None = None, *, db: Path | None = None, **kwargs) -> ChatApp:
        return make_app(
            backend=backend or ScriptedBackend(),
            db_path=db or tmp_path / "history.sqlite3",
            clock=kwargs.pop("clock", FixedClock()),
            cursor_blink=False,
            **kwargs,
        )

    return build


async def wait_until(pilot, predicate: Callable[[], object], *, timeout: float = 10.0, what: str = "") -> None:
    """Let the app run until `predicate()` holds (no fixed sleeps: fast when the app is fast)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await pilot.pause(0.01)


async def ready(pilot) -> None:
    """Wait until the screen has processed its start-up messages, as `run_test` does before it yields the pilot.

    A snapshot's `run_before` starts earlier than that, and keys pressed then are lost."""
    await pilot._wait_for_screen()
    await wait_until(pilot, lambda: pilot.app.focused is not None, what="the app to focus a widget")


async def submit(pilot, text: str) -> None:
    """Type a message into the input and press Enter."""
    await ready(pilot)
    await pilot.click("#prompt")
    pilot.app.query_one("#prompt").insert(text)
    await pilot.press("enter")


async def send_and_wait(pilot, text: str) -> None:
    """Send a message and wait until its answer is on screen and finished."""
    app = pilot.app
    answers = len(app.transcript.answers())
    await submit(pilot, text)
    await wait_until(
        pilot, lambda: len(app.transcript.answers()) > answers and not app.is_generating, what="the answer to finish"
    )
    await pilot.pause()
