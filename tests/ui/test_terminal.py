"""Keys typed while `chatapp run` starts: the terminal is held as the app will read it, and given back as it was."""

from __future__ import annotations

import io
import os
import threading

import pytest

from chatapp.ui.terminal import end_on_hangup, keys_held_for_the_app

termios = pytest.importorskip("termios")


def test_the_terminal_is_held_for_the_app_and_restored() -> None:
    parent, child = os.openpty()
    try:
        with os.fdopen(child, "r", closefd=False) as stream:
            before = termios.tcgetattr(child)
            assert before[3] & termios.ICANON and before[3] & termios.ECHO and before[0] & termios.ICRNL
            with keys_held_for_the_app(stream):
                held = termios.tcgetattr(child)
                assert not held[3] & (termios.ICANON | termios.ECHO)  # no line wait, no echo on the shell's screen
                assert not held[0] & termios.ICRNL  # Enter stays Enter ("\r"), not a newline (ctrl+j in the app)
                os.write(parent, b"hi\r")
                assert os.read(child, 16) == b"hi\r"  # what was typed waits, as typed, for the app to read
            assert termios.tcgetattr(child) == before
    finally:
        os.close(parent)
        os.close(child)


def test_not_a_terminal_is_left_alone(monkeypatch) -> None:
    """A pipe or a test runner's stream: its settings are never read or set, and the block still runs."""
    touched: list[str] = []
    monkeypatch.setattr(termios, "tcgetattr", lambda *a: touched.append("tcgetattr") or [0] * 7)
    monkeypatch.setattr(termios, "tcsetattr", lambda *a: touched.append("tcsetattr"))
    ran = []
    read, write = os.pipe()
    try:
        with os.fdopen(read, "r", closefd=False) as piped, keys_held_for_the_app(piped):
            ran.append("pipe")
        with keys_held_for_the_app(io.StringIO("piped")):  # no file descriptor at all
            ran.append("string")
    finally:
        os.close(read)
        os.close(write)
    assert ran == ["pipe", "string"] and touched == []


def test_nothing_is_watched_without_a_terminal(tmp_path):
    with open(tmp_path / "input", "w+") as stream:  # a file, as a pipe or a test runner gives
        end_on_hangup(stream)
    assert "chatapp-hangup" not in {t.name for t in threading.enumerate()}
