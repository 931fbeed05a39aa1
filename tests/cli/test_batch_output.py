"""Batch output: whole-line appends, torn-tail repair on resume, ordered emission."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatapp.batch.output import FileSink, OrderedEmitter, RecordEmitter, StreamSink, encode_record, scan_output
from chatapp.errors import BatchFileError


def _result(request_id: object, sample: int) -> dict:
    return {"id": request_id, "sample": sample, "text": "x", "finish_reason": "stop"}


class ListSink:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def test_file_sink_appends_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text('{"id":0,"sample":0,"finish_reason":"stop"}\n')
    sink = FileSink(path, fsync=True)
    sink.write(_result("é", 1))
    sink.write({"id": 2, "line": 3, "error": "bad"})
    sink.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines[1:]] == [_result("é", 1), {"id": 2, "line": 3, "error": "bad"}]


def test_stream_sink_writes_one_flushed_line_per_record() -> None:
    stream = io.StringIO()
    StreamSink(stream).write(_result(1, 0))
    assert stream.getvalue() == encode_record(_result(1, 0)).decode()


def test_scan_of_a_missing_file_is_empty(tmp_path: Path) -> None:
    existing = scan_output(tmp_path / "nope.jsonl")
    assert existing.done == set() and existing.records == 0


def test_scan_collects_done_pairs_and_error_records(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    records = [
        _result(1, 0),
        _result("1", 1),
        {"id": 5, "line": 4, "error": "bad"},
        {"id": 6, "line": 5, "sample": 2, "error": "x"},
    ]
    path.write_bytes(b"".join(encode_record(r) for r in records))
    existing = scan_output(path)
    assert existing.done == {("1", 0), ('"1"', 1)}
    assert existing.errors == {(4, None, "bad"), (5, 2, "x")}
    assert existing.records == 4
    assert existing.truncated_bytes == 0


@given(st.integers(min_value=0, max_value=200))
def test_a_torn_tail_is_cut_at_any_byte(tmp_path_factory: pytest.TempPathFactory, cut: int) -> None:
    """A kill can stop a write anywhere: whatever is left, resume keeps exactly the complete lines."""
    path = tmp_path_factory.mktemp("torn") / "out.jsonl"
    whole = [encode_record(_result(i, 0)) for i in range(3)]
    torn = encode_record({**_result(99, 0), "text": "y" * 150})
    cut = min(cut, len(torn) - 1)  # the full line with its newline is not torn
    path.write_bytes(b"".join(whole) + torn[:cut])
    existing = scan_output(path)
    assert existing.done == {(str(i), 0) for i in range(3)}
    assert existing.truncated_bytes == cut
    assert path.read_bytes() == b"".join(whole)


def test_a_foreign_line_is_reported_and_the_file_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    content = encode_record(_result(1, 0)) + b"not a record\n" + b'{"id": 3'
    path.write_bytes(content)
    with pytest.raises(BatchFileError, match=r"out.jsonl:2 is not a chatapp batch record"):
        scan_output(path)
    assert path.read_bytes() == content


def test_unordered_emitter_writes_immediately_and_skips_none() -> None:
    sink = ListSink()
    emitter = RecordEmitter(sink)
    emitter.emit(3, 0, _result(3, 0))
    emitter.emit(1, None, None, closes_line=True)
    assert sink.records == [_result(3, 0)]


@given(st.data())
def test_ordered_emitter_writes_in_input_order_whatever_the_finish_order(data: st.DataObject) -> None:
    counts = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=6))
    lines = {2 * index + 1: count for index, count in enumerate(counts)}  # sparse line numbers, like blank lines
    # Each line finishes either with all its samples or with one whole-line error.
    failing = data.draw(st.sets(st.sampled_from(sorted(lines))))
    events = [(line, None) for line in failing]
    events += [(line, sample) for line, count in lines.items() if line not in failing for sample in range(count)]
    events = data.draw(st.permutations(events))
    sink = ListSink()
    emitter = OrderedEmitter(sink, lines)
    for line, sample in events:
        emitter.emit(line, sample, {"line": line, "sample": sample}, closes_line=sample is None)
    emitter.finish()
    expected = [
        {"line": line, "sample": sample}
        for line in sorted(lines)
        for sample in ([None] if line in failing else range(lines[line]))
    ]
    assert sink.records == expected


def test_ordered_emitter_holds_records_until_earlier_lines_finish() -> None:
    sink = ListSink()
    emitter = OrderedEmitter(sink, {1: 1, 2: 2})
    emitter.emit(2, 1, {"r": "2/1"})
    emitter.emit(2, 0, {"r": "2/0"})
    assert sink.records == []
    emitter.emit(1, 0, {"r": "1/0"})
    assert sink.records == [{"r": "1/0"}, {"r": "2/0"}, {"r": "2/1"}]
