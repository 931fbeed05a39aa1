"""Writing batch records so that no kill, at any moment, loses or tears one.

Every record is one JSON line written with a single `os.write` of the whole encoded line to a file opened with
O_APPEND, then flushed (and optionally fsynced). A process killed with SIGKILL therefore leaves at most one partial
line, and only at the very end of the file; `scan_output` cuts it off before a resumed run appends, and reports which
(id, sample) pairs are already complete so the resumed run skips exactly those.

Two kinds of records share the file:
- result records carry `finish_reason` (plus `id`, `sample`, `text`, `tokens`, ...);
- error records carry `line` and `error` and no `finish_reason`: a line that could not be generated. They are not
  "complete": a resumed run tries the line again (the user may have fixed it) and only writes a new error record if
  the error differs from the one already there.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from chatapp.batch.requests import id_key
from chatapp.errors import BatchFileError

DoneKey = tuple[str, int]
"""(id_key(id), sample) of a complete result record."""
ErrorKey = tuple[int, int | None, str]
"""(line, sample or None, error) of an error record."""


def encode_record(record: dict[str, Any]) -> bytes:
    """One compact JSON line, UTF-8, newline-terminated (token lists make the compact form worth it).

    A record that holds text UTF-8 cannot encode (a lone surrogate echoed from input) is written with `\\u` escapes
    instead: still one valid JSON line, never a crash that loses the record.
    """
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record, ensure_ascii=True, separators=(",", ":")) + "\n").encode("utf-8")


def is_result_record(record: dict[str, Any]) -> bool:
    return "finish_reason" in record


def error_key(record: dict[str, Any]) -> ErrorKey:
    return (record["line"], record.get("sample"), record["error"])


@dataclass
class ExistingOutput:
    """What an earlier run already wrote to an output file."""

    done: set[DoneKey] = field(default_factory=set)
    errors: set[ErrorKey] = field(default_factory=set)
    records: int = 0
    truncated_bytes: int = 0  # size of the torn trailing line that was cut off


RECORD_START = b'{"id":'
"""How every record line starts (`encode_record` of a dict whose first key is `id`): a torn line starts so too."""


def _is_sample(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_id(value: object) -> bool:
    return value is None or (isinstance(value, str | int) and not isinstance(value, bool))


def _record_kind(record: object) -> str | None:
    """"result", "error", or None for anything that is not a record this module writes."""
    if not isinstance(record, dict):
        return None
    if is_result_record(record):
        if {"id", "sample"} <= record.keys() and _is_id(record["id"]) and record["id"] is not None:
            return "result" if _is_sample(record["sample"]) else None
        return None
    if {"line", "error"} <= record.keys() and _is_id(record.get("id")) and isinstance(record["error"], str):
        line, sample = record["line"], record.get("sample")
        if isinstance(line, int) and not isinstance(line, bool) and (sample is None or _is_sample(sample)):
            return "error"
    return None


def _not_resumable(path: Path, why: str) -> BatchFileError:
    return BatchFileError(
        f"{path} {why}, so it cannot be resumed; it was left untouched",
        hint="resume only files written by `chatapp batch`, or write to a new output file",
    )


def _parse_existing(path: Path, data: bytes) -> ExistingOutput:
    existing = ExistingOutput()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            record = None
        kind = _record_kind(record)
        if kind is None:
            raise BatchFileError(
                f"{path}:{number} is not a chatapp batch record, so the file cannot be resumed; it was left untouched",
                hint="resume only files written by `chatapp batch`, or write to a new output file",
            )
        existing.records += 1
        if kind == "result":
            existing.done.add((id_key(record["id"]), record["sample"]))
        else:
            existing.errors.add(error_key(record))
    return existing


def scan_output(path: Path) -> ExistingOutput:
    """Read an earlier run's output for `--resume`, cutting off a torn trailing line first.

    Only the last line can be torn (records are appended whole), so everything up to the last newline is intact.
    The file is checked completely before it is modified: a file that is not ours is reported, never truncated.
    A tail is cut only when it follows at least one valid record and looks like the start of one; anything else (a
    note without a newline, a binary, a one-line JSON file) is refused and left as it is.
    """
    if not path.exists():
        return ExistingOutput()
    if not path.is_file():
        raise _not_resumable(path, "is not a regular file")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise BatchFileError(
            f"cannot read {path}: {err.strerror}", hint="fix the permissions of the output file, or choose another"
        ) from None
    keep = data.rfind(b"\n") + 1  # 0 when there is no complete line at all
    existing = _parse_existing(path, data[:keep])
    tail = data[keep:]
    if tail:
        if existing.records == 0:
            raise _not_resumable(path, "holds no complete chatapp batch record")
        if not (tail.startswith(RECORD_START) or RECORD_START.startswith(tail)):
            raise _not_resumable(path, f"ends in {len(tail)} bytes that are not the start of a chatapp batch record")
        try:
            with path.open("r+b") as handle:
                handle.truncate(keep)
        except OSError as err:
            raise BatchFileError(
                f"cannot cut the torn last line ({len(tail)} bytes) off {path}: {err.strerror}; it was left untouched",
                hint="make the file writable (or copy it) and resume again",
            ) from None
        existing.truncated_bytes = len(tail)
    return existing


class RecordSink(Protocol):
    """Where finished records go, one whole line at a time."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class FileSink:
    """Appends records to a file, each with one `os.write` so a kill never leaves half a record mid-file."""

    def __init__(self, path: Path, *, fsync: bool = False) -> None:
        self.path = path
        self._fsync = fsync
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as err:
            if isinstance(err, NotADirectoryError) and (blocker := _file_above(path)) is not None:
                # Creating a directory cannot help: one of the path's directories is a file.
                raise BatchFileError(
                    f"cannot open {path} for writing: {blocker} is a file, not a directory",
                    hint="choose an output file in a directory (or move the file away)",
                ) from None
            missing = isinstance(err, FileNotFoundError | NotADirectoryError)
            raise BatchFileError(
                f"cannot open {path} for writing: {err.strerror}",
                hint=f"create {path.parent} first, or choose another output file"
                if missing
                else "fix the permissions of the output's directory, or choose another output file",
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        data = memoryview(encode_record(record))
        # A regular-file write is complete in one call in practice; the loop covers the rare short write (e.g. a
        # signal), and a torn tail is still repaired on resume.
        try:
            while data:
                written = os.write(self._fd, data)
                data = data[written:]
            if self._fsync:
                os.fsync(self._fd)
        except OSError as err:
            raise BatchFileError(
                f"cannot write to {self.path}: {err.strerror}",
                hint="free space or pick another output file, then rerun with --resume to finish the rest",
            ) from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _file_above(path: Path) -> Path | None:
    """The nearest of `path`'s parents that exists and is not a directory, if any."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


class StreamSink:
    """Writes records to a text stream (stdout for `-o -`), flushing after each so a pipe sees whole lines."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def write(self, record: dict[str, Any]) -> None:
        stream = self._stream or sys.stdout  # looked up late: test runners swap sys.stdout
        try:
            stream.write(encode_record(record).decode("utf-8"))
            stream.flush()
        except BrokenPipeError:
            # The reader went away (`... | head`). Stop with one clear message rather than a traceback; Python would
            # hit the same error again flushing stdout at exit, so stdout is pointed at /dev/null first.
            _discard_stream(stream)
            raise BatchFileError(
                "the output stream was closed before every record was written",
                hint="write to a file with -o OUT.jsonl, then read it at leisure",
            ) from None
        except OSError as err:  # e.g. stdout redirected to a full disk
            _discard_stream(stream)
            raise BatchFileError(
                f"cannot write records to the output stream: {err.strerror}",
                hint="write to a file with -o OUT.jsonl on a disk with free space",
            ) from None

    def close(self) -> None:
        stream = self._stream or sys.stdout
        try:
            stream.flush()
        except OSError:
            _discard_stream(stream)  # write() already reported it; the flush at exit must not raise again


def _discard_stream(stream: TextIO) -> None:
    """Point a closed pipe's file descriptor at /dev/null so later flushes (at exit) succeed silently."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not backed by a file descriptor (e.g. a test runner's buffer)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


class RecordEmitter:
    """Hands records to a sink as they finish (output order may differ from input order)."""

    def __init__(self, sink: RecordSink) -> None:
        self.sink = sink

    def emit(self, line: int, sample: int | None, record: dict[str, Any] | None, *, closes_line: bool = False) -> None:
        """Write `record` (None: nothing to write, but the slot is done) for sample `sample` of input line `line`."""
        if record is not None:
            self.sink.write(record)

    def finish(self) -> None:
        """Called once at the end of the run."""


class OrderedEmitter(RecordEmitter):
    """Holds records back until every earlier input line is complete, then writes them in input order.

    `expected` maps each line still to be produced to the number of records it will produce (its pending samples).
    Within a line, records go out by sample number; an error for the whole line (`closes_line`) replaces them.
    """

    def __init__(self, sink: RecordSink, expected: dict[int, int]) -> None:
        super().__init__(sink)
        self._order = sorted(expected)
        self._remaining = dict(expected)
        self._held: dict[int, list[tuple[int, dict[str, Any]]]] = {line: [] for line in expected}
        self._next = 0

    def emit(self, line: int, sample: int | None, record: dict[str, Any] | None, *, closes_line: bool = False) -> None:
        if record is not None:
            self._held[line].append((-1 if sample is None else sample, record))
        self._remaining[line] = 0 if closes_line else self._remaining[line] - 1
        self._release()

    def _release(self) -> None:
        while self._next < len(self._order) and self._remaining[line := self._order[self._next]] <= 0:
            for _, record in sorted(self._held.pop(line), key=lambda item: item[0]):
                self.sink.write(record)
            self._next += 1

    def finish(self) -> None:
        # Every line is complete by the end of a run; this only matters if a run stops early (e.g. a crash in the
        # engine), where writing what is held is better than losing it: resume still finds exactly what is done.
        for line in self._order[self._next :]:
            for _, record in sorted(self._held.pop(line, []), key=lambda item: item[0]):
                self.sink.write(record)
        self._next = len(self._order)
