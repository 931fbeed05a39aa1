"""`chatapp.store`: staged writes renamed into place, per-target locks, stale staging removed, regular-file reads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.errors import ChatappError, DataDirError
from chatapp.store import (
    STAMP,
    check_writable_dir,
    clean_stale,
    is_complete,
    open_regular,
    read_regular_bytes,
    staged_dir,
    target_lock,
    writable_dir_problem,
)

ROOT = Path(__file__).resolve().parents[1]


def _hidden(parent: Path) -> list[str]:
    """Hidden entries other than lock files: what a crash could leave behind."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock"))


def test_a_staged_directory_is_renamed_into_place_with_a_stamp(tmp_path: Path) -> None:
    target = tmp_path / "models" / "m"
    with staged_dir(target) as staging:
        assert staging.parent == target.parent and not target.exists()
        (staging / "a.bin").write_bytes(b"abc")
    assert (target / "a.bin").read_bytes() == b"abc" and (target / STAMP).is_file()
    assert is_complete(target)
    assert _hidden(target.parent) == []


def test_an_exception_leaves_the_earlier_target_and_no_staging(tmp_path: Path) -> None:
    target = tmp_path / "m"
    with staged_dir(target) as staging:
        (staging / "v").write_text("1")
    with pytest.raises(KeyboardInterrupt), staged_dir(target) as staging:
        (staging / "v").write_text("2")
        raise KeyboardInterrupt
    assert (target / "v").read_text() == "1" and is_complete(target)
    assert _hidden(tmp_path) == []


def test_a_second_write_replaces_the_first_whole(tmp_path: Path) -> None:
    target = tmp_path / "m"
    with staged_dir(target) as staging:
        (staging / "old").write_text("x")
    with staged_dir(target) as staging:
        (staging / "new").write_text("y")
    assert sorted(p.name for p in target.iterdir()) == [STAMP, "new"]
    assert _hidden(tmp_path) == []


def test_without_a_stamp_the_target_is_not_complete(tmp_path: Path) -> None:
    with staged_dir(tmp_path / "m", stamp=False) as staging:
        (staging / "f").write_text("x")
    assert not is_complete(tmp_path / "m") and (tmp_path / "m" / "f").is_file()
    assert not is_complete(tmp_path / "absent")


def test_stale_staging_is_removed_only_when_its_lock_is_free(tmp_path: Path) -> None:
    stale = tmp_path / ".m.staging-abcd1234"
    stale.mkdir()
    (stale / "weights").write_bytes(b"0" * 10)
    held, release = threading.Event(), threading.Event()

    def writer() -> None:  # another open file description: the lock is held as by another process
        with target_lock(tmp_path / "m"):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    held.wait(10)
    try:
        assert clean_stale(tmp_path) == [] and stale.exists()
    finally:
        release.set()
        thread.join()
    assert clean_stale(tmp_path) == [stale] and not stale.exists()


def test_legacy_staging_names_are_removed_only_when_asked(tmp_path: Path) -> None:
    legacy = tmp_path / ".smollm2-135m-stt.k2j_9x0a"
    legacy.mkdir()
    assert clean_stale(tmp_path) == [] and legacy.exists()
    assert clean_stale(tmp_path, legacy=True) == [legacy]


def test_clean_stale_never_touches_a_live_staging_of_its_own(tmp_path: Path) -> None:
    with staged_dir(tmp_path / "m") as staging:
        assert clean_stale(tmp_path) == [] and staging.is_dir()
    assert clean_stale(tmp_path / "absent") == []


def test_a_fifo_is_refused_at_once_instead_of_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "stack-0.bin"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(DataDirError, match=r"is not a regular file \(a FIFO\)"):
        open_regular(fifo)
    with pytest.raises(DataDirError, match="FIFO"):
        read_regular_bytes(fifo, 10)
    assert time.monotonic() - start < 2


def test_reads_check_type_and_size(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"12345")
    assert read_regular_bytes(tmp_path / "f", 5) == b"12345"
    with open_regular(tmp_path / "f") as fh:
        assert fh.read() == b"12345"
    with pytest.raises(DataDirError, match="more than the 4 expected"):
        read_regular_bytes(tmp_path / "f", 4)
    with pytest.raises(DataDirError, match="a directory"):
        open_regular(tmp_path)
    with pytest.raises(DataDirError, match="cannot read"):
        open_regular(tmp_path / "missing")


def test_check_writable_dir_names_the_path_and_the_fix(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert check_writable_dir(tmp_path / "new" / "deep", "data directory").is_dir()
    with pytest.raises(DataDirError, match="is not a directory") as err:
        check_writable_dir(afile, "data directory")
    assert err.value.hint and "remove the file" in err.value.hint
    with pytest.raises(DataDirError, match="is a file, not a directory"):
        check_writable_dir(afile / "sub", "output directory")
    assert isinstance(err.value, ChatappError)
    assert writable_dir_problem(afile / "sub", "x") and writable_dir_problem(tmp_path, "x") is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through mode bits")
def test_a_read_only_directory_is_not_writable(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(DataDirError, match="not writable"):
            check_writable_dir(ro, "data directory")
    finally:
        ro.chmod(0o700)


_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from chatapp.store import staged_dir
    with staged_dir(Path(sys.argv[1])) as staging:
        for i in range(12):
            (staging / f"part-{i}").write_bytes(bytes([i]) * 200_000)
            time.sleep(0.004)
    """
)


@settings(max_examples=12)
@given(delay=st.floats(0.0, 0.45), existing=st.booleans())
def test_a_write_killed_at_any_point_leaves_no_staging_and_no_half_target(tmp_path_factory, delay, existing) -> None:
    parent = tmp_path_factory.mktemp("killed")
    target = parent / "m"
    if existing:
        with staged_dir(target) as staging:
            (staging / "old").write_text("old")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(target)], env=env)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    clean_stale(parent)  # what the next start does
    assert _hidden(parent) == []
    if target.exists():
        assert is_complete(target)
        names = sorted(p.name for p in target.iterdir())
        assert names in ([STAMP, "old"], sorted([STAMP, *(f"part-{i}" for i in range(12))]))
    # else: killed before the rename (or between the two renames of a replacement): no target, and no staging
