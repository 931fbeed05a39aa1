"""The engine's start-up, as the app hears of it.

A backend may still be loading its model when the app first draws (`ChatBackend.ready`). The app waits for it in a
worker thread (`ChatBackend.wait_ready`) and is told, by one of these messages, that the model is ready, or why it
will not be.
"""

from __future__ import annotations

from textual.message import Message

from chatapp.errors import ChatappError


class EngineReady(Message):
    """The backend's model is loaded: everything the backend knows about it can be read without waiting."""


class EngineFailed(Message):
    """The backend's model could not be loaded (a broken model directory, a start-up program that does not compile,
    the start timeout): `error` says what and how to fix it."""

    def __init__(self, error: ChatappError) -> None:
        super().__init__()
        self.error = error
