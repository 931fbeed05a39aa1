"""The engine in its own process, so that drawing the UI never slows generation down.

In one process the TUI and the engine share one interpreter lock: every torch op the generation thread runs hands
the lock back and has to win it again, and while Textual lays out or paints a frame (milliseconds of pure Python)
the engine waits for it. vLLM's V1 moved its engine core out of the API server's process for the same reason.
Here `ProcessBackend` is the app's `ChatBackend` and an `EngineBackend` lives in a spawned child process: the UI's
thread worker still iterates a `StepStream` (the app does not know the difference), but the stream now reads
`Step` events, plain picklable data, from a pipe.

Start-up: constructing a `ProcessBackend` only starts the child; the app draws and takes keys while the child
imports torch and loads the model (~3 s of the ~4 s until a first answer). The child's first message says it is
ready, or why it is not; `wait_ready` reads it (the app does so in a worker thread).

Protocol (one request at a time; the app never overlaps them, and a stream is always drained or closed before the
next request):

    parent                         child
                            <-     ("ok", (ModelInfo, settings, built-in programs, start-up program)) once loaded,
                                   or ("error", ChatappError) and the child exits
    (method, args)          ->     calls EngineBackend.method(*args)
                            <-     ("ok", value) | ("error", ChatappError)
    a generating method     ->     ("open", None), then ("steps", [Step, ...]) batches, then ("end", None) or
                                   ("error", err)
    ("cancel", ()) mid-stream ->   the child closes the stream at its next step, sends what it still holds and
                                   ends it with ("end", None)

The child ignores SIGINT (the parent owns its life) and exits when the pipe closes, so it never outlives the app.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

from chatapp.engine.lens import LensRequest, ReplyLens
from chatapp.errors import ChatappError, ModelDirError
from chatapp.settings import GenerationSettings
from chatapp.ui.backend import BackendState, Message, ModelInfo, ProgramInfo, StepStream

# EngineBackend methods that return a StepStream.
_GENERATING = frozenset({"send", "regenerate", "edit_last", "compare_last"})
# And those that answer once.
_CALLS = frozenset({"new_session", "switch_program", "configure", "configure_checked", "lens"})
# Seconds between two batches of steps sent to the UI process (it draws at 30 Hz; see `_pump`).
SEND_INTERVAL = 1 / 60


class ProcessBackend(BackendState):
    """`ChatBackend` whose engine (and its `ChatSession`) runs in a child process.

    Construction starts the child and returns at once; the child loads the model (and switches to `program`, if
    given) meanwhile. `wait_ready` says when it is done, or raises what stopped it (`ModelDirError` naming the
    directory, a `ProgramError`, or `start_timeout` passing). Any other member waits for the model first: the app
    uses none of them before `ready`, so its thread never waits on the load. `close()` (or leaving a `with` block)
    stops the child.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str | None = None,
        program: str | None = None,
        routing_level: str | None = None,
        log_path: Path | None = None,
        start_timeout: float = 300.0,
    ) -> None:
        context = multiprocessing.get_context("spawn")  # fork would copy the parent's threads and CUDA state
        self._conn, child_conn = context.Pipe()
        self._model_dir = Path(model_dir)
        # The child's stdout/stderr (loading progress, warnings, a crash's traceback) go to `log_path`: written to
        # the terminal they would tear through the TUI's screen.
        self.log_path = log_path
        self._process = context.Process(
            target=_engine_main,
            args=(
                child_conn, str(model_dir), device, None if log_path is None else str(log_path), program, routing_level
            ),
            name="chatapp-engine",
            daemon=True,
        )
        self._process.start()
        child_conn.close()  # the child's end lives in the child: EOF reaches us if it dies
        self._streaming = False
        self._cancelling = False
        self._stream_gen: StepStream | None = None
        # One call at a time on the pipe: a program compiles in a UI worker thread while the UI thread may make the
        # next call (after esc cancelled that compile, before its reply is in); that call waits for the reply.
        self._lock = threading.RLock()
        self._start_timeout = start_timeout
        self._deadline = time.monotonic() + start_timeout
        self._ready = False
        self._start_error: ChatappError | None = None
        self._closed = False

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def model_path(self) -> str:
        return str(self._model_dir)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Read the child's first message when it comes (see `ChatBackend.wait_ready`).

        The pipe is polled in short slices without the lock, so that a caller waiting here does not hold up `close`
        from another thread (quitting while the model loads)."""
        until = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            if self._start_error is not None:
                raise self._start_error
            if self._closed:
                raise ChatappError(
                    "the engine process was closed before the model was loaded", hint="start the app again"
                )
            now = time.monotonic()
            if now >= self._deadline:
                self._fail_start(
                    ModelDirError(
                        f"the engine process did not load {self._model_dir} within {self._start_timeout:.0f}s",
                        hint=f"its output is in {self.log_path}" if self.log_path else None,
                    )
                )
            wait = min(0.1, self._deadline - now)
            if until is not None:
                wait = max(0.0, min(wait, until - now))
            try:
                arrived = self._conn.poll(wait)
            except (OSError, ValueError):  # closed by `close` meanwhile: the next round says so
                continue
            if arrived:
                with self._lock:
                    if not self._ready and self._start_error is None:
                        self._read_start()
            elif until is not None and time.monotonic() >= until:
                return False
        return True

    def _read_start(self) -> None:
        """The child's first message: what the UI mirrors of the loaded engine, or what stopped it loading."""
        try:
            kind, payload = self._receive()
        except ChatappError as err:  # it died without a word (killed, out of memory)
            self._fail_start(err)
        if kind == "error":
            self._fail_start(payload)
        # The state properties (`BackendState`) are mirrored on this side: the UI reads them every frame.
        self._info, self._settings, self._builtin, self._program = payload
        self._ready = True

    def _fail_start(self, error: ChatappError) -> NoReturn:
        self._start_error = error
        self.close()
        raise error

    @property
    def info(self) -> ModelInfo:
        self.wait_ready()
        return self._info

    @property
    def settings(self) -> GenerationSettings:
        self.wait_ready()
        return self._settings

    @property
    def pid(self) -> int | None:
        """The engine process's id (None once it has been closed)."""
        return self._process.pid if self._process.is_alive() else None

    def builtin_programs(self) -> Sequence[str]:
        self.wait_ready()
        return self._builtin

    # --- calls --------------------------------------------------------------------------------------------------
    def new_session(self, history: Sequence[Message] = ()) -> None:
        self._call("new_session", [dict(message) for message in history])

    def switch_program(
        self, name_or_path: str | None, cancel: threading.Event | None = None
    ) -> ProgramInfo | None:
        """Compile and switch in the engine process (it has the tokenizer). While it compiles, setting `cancel`
        sends ("cancel", ()), which stops the child's compile at its next check; the reply says what happened."""
        with self._lock:
            self._request("switch_program", (name_or_path,))
            sent_cancel = False
            while not self._conn.poll(0.05):
                if cancel is not None and cancel.is_set() and not sent_cancel:
                    sent_cancel = True
                    with contextlib.suppress(BrokenPipeError, OSError):  # a dead child: the read below says so
                        self._conn.send(("cancel", ()))
            kind, payload = self._receive()
        if kind == "error":
            raise payload
        self._program = payload
        return self._program

    def configure(self, settings: GenerationSettings, constraint: str | None) -> None:
        # The regex compiles here, in the caller's thread (the settings screen runs it in a cancellable worker, and
        # the compile is cached), not in the engine process, where the UI thread would wait on the pipe for it.
        if constraint:
            from chatapp.trie.regex import compile_regex

            compile_regex(constraint)  # raises ConstraintError naming the regex
        self._call("configure_checked", settings, constraint)
        self._settings, self._constraint = settings, constraint or None

    def lens(self, request: LensRequest) -> ReplyLens:
        return self._call("lens", request)

    def send(self, text: str) -> StepStream:
        return self._open("send", text)

    def regenerate(self) -> StepStream:
        return self._open("regenerate")

    def edit_last(self, text: str) -> StepStream:
        return self._open("edit_last", text)

    def compare_last(self) -> StepStream:
        return self._open("compare_last")

    def cancel(self, stream: StepStream) -> None:
        """Ask the child to stop at its next step. The stream then yields the steps the child had already sent
        (it runs a few ahead of the UI) and ends: they are part of the interrupted answer, which the child's session
        keeps too, so what the UI shows and saves is exactly what the conversation continues from."""
        if self._streaming and not self._cancelling:
            self._cancelling = True
            with contextlib.suppress(BrokenPipeError, OSError):  # a dead child: the stream's next read says so
                self._conn.send(("cancel", ()))

    def close(self) -> None:
        """Stop the engine process (idempotent)."""
        self._closed = True
        if self._process.is_alive():
            if self._ready:
                with contextlib.suppress(BrokenPipeError, OSError):
                    self._conn.send(("close", ()))
                self._process.join(timeout=5)
            else:  # still loading: it reads no request until it has loaded, and has nothing to keep
                self._process.terminate()
                self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()

    def __enter__(self) -> ProcessBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the pipe -----------------------------------------------------------------------------------------------
    def _request(self, method: str, args: tuple[Any, ...]) -> None:
        self.wait_ready()
        if self._streaming and inspect.getgeneratorstate(self._stream_gen) == inspect.GEN_CLOSED:
            # Closed before it was ever iterated, so its `finally` never ran: stop the child's answer now.
            self._streaming = False
            self._cancel_and_drain()
        if self._streaming:
            raise RuntimeError(f"{method}() while an answer is still streaming: close the stream first")
        try:
            self._conn.send((method, args))
        except (BrokenPipeError, OSError):
            raise self._died() from None

    def _receive(self) -> tuple[str, Any]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._died() from None

    def _died(self) -> ChatappError:
        self._process.join(timeout=5)
        where = f"its output is in {self.log_path}" if self.log_path else "its output went to this terminal"
        return ChatappError(
            f"the engine process stopped (exit code {self._process.exitcode}); {where}",
            hint="start chatapp again; if it keeps happening, run with --in-process to see the engine's own error",
        )

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            self._request(method, args)
            kind, payload = self._receive()
        if kind == "error":
            raise payload
        return payload

    def _open(self, method: str, *args: Any) -> StepStream:
        """Validate on the child now (raising here, as `ChatSession` does), stream when iterated."""
        self._call(method, *args)  # ("open", None) or the error that refused the call
        self._streaming, self._cancelling = True, False
        self._stream_gen = self._stream()
        return self._stream_gen

    def _stream(self) -> StepStream:
        ended = False
        try:
            while True:
                kind, payload = self._receive()
                if kind == "steps":
                    yield from payload
                    continue
                ended = True
                if kind == "error":
                    raise payload
                return
        finally:
            if not ended:  # closed before its end: stop the child, drop what it still sends
                self._cancel_and_drain()
            self._streaming = False

    def _cancel_and_drain(self) -> None:
        try:
            if not self._cancelling:
                self._conn.send(("cancel", ()))
            while self._receive()[0] == "steps":
                pass
        except (ChatappError, BrokenPipeError, OSError):
            pass  # the child died meanwhile: the next request reports it


# --- the child ------------------------------------------------------------------------------------------------


# Seconds without a request after which the engine prepares what the first tool call needs (see `serve`).
PREPARE_AFTER_IDLE = 3.0


def start_engine(
    model_dir: str | Path, device: str | None = None, program: str | None = None, routing_level: str | None = None
) -> ProcessBackend:
    """The app's backend for `model_dir` (a name or a directory): an engine process that loads it (and switches to
    `program` and `routing_level`), its output to the engine log. Returns at once: the app draws while the model
    loads."""
    from chatapp.models import resolve_model
    from chatapp.settings import engine_log_path

    return ProcessBackend(
        resolve_model(model_dir),
        device=device,
        program=program,
        routing_level=routing_level,
        log_path=engine_log_path(),
    )


def _engine_main(*args: Any) -> None:
    """The engine process's target: `serve`, then the end without Python's finalization (`chatapp.lifecycle`),
    which the app's quit would otherwise wait ~0.6 s for."""
    from chatapp.lifecycle import exit_process

    serve(*args)
    exit_process(0)


def serve(
    conn: Connection,
    model_dir: str,
    device: str | None,
    log_path: str | None = None,
    program: str | None = None,
    routing_level: str | None = None,
) -> None:
    """The engine process: load the model (and switch to `program` and `routing_level`), then answer requests until
    the pipe closes or `close` arrives."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ctrl+c belongs to the UI; it closes us through the pipe
    if log_path is not None:
        _redirect_output(log_path)
    # The UI draws the stream beside this process: the int8 step's thread count follows the cores it leaves free
    # (`stt.thread_governor`), where a fixed count of one fewer than the cores gave up a second thread even while
    # the UI was idle between batches.
    from chatapp.lifecycle import starting_up
    from chatapp.ui.backend import EngineBackend

    try:
        with starting_up():
            backend = EngineBackend.load(Path(model_dir), device=device)
        if program is not None:
            backend.switch_program(program)
        if routing_level is not None:
            backend.set_routing_level(routing_level)
    except ChatappError as err:
        conn.send(("error", err))
        return
    except Exception as err:  # anything else is reported as a model-directory problem
        conn.send(
            (
                "error",
                ModelDirError(
                    f"cannot load {model_dir}: {type(err).__name__}: {err}",
                    hint="check the model directory (`chatapp generate --model DIR hi` shows the same error in full)",
                ),
            )
        )
        return
    conn.send(("ok", (backend.info, backend.settings, tuple(backend.builtin_programs()), backend.program)))
    # Work the first tool call would otherwise wait for, done while the user writes: the tool grammar's index
    # (~0.5 s). It starts once the user has been quiet for `PREPARE_AFTER_IDLE` seconds or the first reply is done,
    # whichever comes first: started at once, it made a message typed straight away wait for it.
    prepared = False
    while True:
        if not prepared and not conn.poll(PREPARE_AFTER_IDLE):
            backend.prepare_in_background()
            prepared = True
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        if method == "close":
            return
        if method == "cancel":  # arrived after the stream had already ended: nothing left to stop
            continue
        if method not in _GENERATING | _CALLS:
            conn.send(
                (
                    "error",
                    ChatappError(
                        f"unknown engine request {method!r}",
                        hint="this is a chatapp bug: please report it with the engine log (F1 shows its path)",
                    ),
                )
            )
            continue
        try:
            if method == "switch_program":
                result = _switch_program(conn, backend, *args)
            else:
                result = getattr(backend, method)(*args)
        except ChatappError as err:
            conn.send(("error", err))
            continue
        except Exception as err:  # an engine bug refuses this call; it does not stop the process
            conn.send(
                (
                    "error",
                    ChatappError(
                        f"the engine failed: {type(err).__name__}: {err}",
                        hint="this is a chatapp bug: please report it with the engine log (F1 shows its path)",
                    ),
                )
            )
            continue
        if method in _CALLS:
            conn.send(("ok", result))
        else:
            conn.send(("open", None))
            _pump(conn, backend, result)
            if not prepared:
                backend.prepare_in_background()
                prepared = True


def _switch_program(conn: Connection, backend: Any, name_or_path: str | None) -> Any:
    """Compile and switch while a watcher thread turns any message from the parent (its "cancel", or "close" when
    the app quits) into the compile's cancel flag. The message itself stays in the pipe for the request loop."""
    cancel = threading.Event()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                if conn.poll(0.05):
                    cancel.set()
                    return
            except (EOFError, OSError):
                cancel.set()
                return

    watcher = threading.Thread(target=watch, name="chatapp-compile-watch", daemon=True)
    watcher.start()
    try:
        return backend.switch_program(name_or_path, cancel)
    finally:
        done.set()
        watcher.join()


def _pump(conn: Connection, backend: Any, stream: StepStream) -> None:
    """Send a stream's steps until it ends or the parent cancels (checked after every step).

    Steps go in batches: one message per `SEND_INTERVAL` rather than per step, because every message wakes the UI
    process's reader thread, which then competes with the UI thread for that process's interpreter lock. The UI
    draws at 30 Hz, so nothing it shows waits on the batching; an answer's first tokens go at once (they end the
    user's wait), and whatever is pending goes before the stream's end or error.
    """
    pending: list[Any] = []
    last_send = previous = time.perf_counter()
    started = False  # an answer's first tokens have been sent

    def flush() -> None:
        nonlocal last_send
        if pending:
            conn.send(("steps", pending))  # pickled here, so the list can be reused
            pending.clear()
            last_send = time.perf_counter()

    try:
        for step in stream:
            pending.append(step)
            now = time.perf_counter()
            # Send if the next step (assumed as slow as this one) would arrive after the interval: a step is never
            # held much longer than `SEND_INTERVAL`, even when the engine is slower than the UI's frame rate.
            if not started or now - last_send + (now - previous) >= SEND_INTERVAL:
                started = started or bool(step.tokens)
                flush()
            previous = now
            if conn.poll():
                request = conn.recv()
                if request[0] == "cancel":
                    backend.cancel(stream)
                    break
    except ChatappError as err:
        flush()
        conn.send(("error", err))
        return
    except Exception as err:  # an engine bug ends this answer, not the process or the app
        flush()
        conn.send(
            (
                "error",
                ChatappError(
                    f"the engine failed: {type(err).__name__}: {err}",
                    hint="this is a chatapp bug: please report it with the engine log (F1 shows its path)",
                ),
            )
        )
        return
    finally:
        stream.close()
    flush()
    conn.send(("end", None))


def _redirect_output(log_path: str) -> None:
    """Point this process's stdout and stderr (the file descriptors, so C++ and child output follow) at the log.

    A log that cannot be written (read-only or full data directory, a directory in its place) costs the log, not
    the engine: its output is dropped rather than drawn over the TUI's screen."""
    try:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        fd = os.open(os.devnull, os.O_WRONLY)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
