"""`load_model` and the stored served format: converted once and stored, read back by every later load (the same
tokens), rebuilt with a one-line notice when damaged or stale, never a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chatapp.models import loader
from chatapp.models.loader import load_engine, load_model, served_dir
from chatapp.settings import GenerationSettings
from chatapp.stt import served


def greedy(engine) -> list[int]:
    settings = GenerationSettings(max_tokens=12)
    return [e.token for step in engine.generate(["hello there", "a b c"], settings) for e in step.tokens]


def refuse_conversion(monkeypatch) -> None:
    def converted(*args, **kwargs):
        raise AssertionError("the weights were converted again instead of read from the store")

    monkeypatch.setattr(loader, "_converted_model", converted)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_first_load_stores_the_format_and_later_loads_read_it(routed_model_dir: Path, monkeypatch, fmt: str):
    first = load_engine(routed_model_dir, "cpu", dtype=fmt, compile=False)
    stored = served_dir(routed_model_dir, fmt)
    assert (stored / served.LAYOUT_FILE).is_file()
    expected = greedy(first)

    refuse_conversion(monkeypatch)
    second = load_engine(routed_model_dir, "cpu", dtype=fmt, compile=False)
    assert greedy(second) == expected


def test_float32_needs_no_store(routed_model_dir: Path):
    load_model(routed_model_dir, "cpu", dtype="float32", compile=False)
    assert not served_dir(routed_model_dir, "float32").parent.exists()


def test_a_damaged_store_is_rebuilt_with_a_notice(routed_model_dir: Path, capsys):
    expected = greedy(load_engine(routed_model_dir, "cpu", dtype="int4", compile=False))
    weights = served_dir(routed_model_dir, "int4") / served.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()

    again = load_engine(routed_model_dir, "cpu", dtype="int4", compile=False)
    notice = capsys.readouterr().err
    assert f"{weights} is damaged" in notice and "converting the weights again" in notice
    assert "Traceback" not in notice
    assert greedy(again) == expected
    assert served.read(served_dir(routed_model_dir, "int4")) is not None  # stored again, whole


def test_changed_weights_give_a_new_store_and_the_old_one_is_removed(routed_model_dir: Path, tmp_path: Path):
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "model"
    shutil.copytree(routed_model_dir, model_dir)
    load_model(model_dir, "cpu", dtype="int8", compile=False)
    before = served_dir(model_dir, "int8")
    weights = model_dir / "model.safetensors"
    state = load_file(weights)
    name = next(name for name in state if name.endswith("down_proj.weight"))
    state[name] = state[name] * 0.5
    save_file(state, weights, metadata={"format": "pt"})

    load_model(model_dir, "cpu", dtype="int8", compile=False)
    after = served_dir(model_dir, "int8")
    assert after != before and after.is_dir() and not before.exists()


def test_new_dates_alone_keep_the_store(routed_model_dir: Path, tmp_path: Path, monkeypatch):
    """The key is the sources' content: touched files are hashed once, found the same, and the entry is read."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(routed_model_dir, model_dir)
    load_model(model_dir, "cpu", dtype="int8", compile=False)
    before = served_dir(model_dir, "int8")
    weights = model_dir / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))

    refuse_conversion(monkeypatch)
    load_model(model_dir, "cpu", dtype="int8", compile=False)
    hashed = []
    monkeypatch.setattr(served, "content_digest", lambda source: hashed.append(source) or "")
    assert served_dir(model_dir, "int8") == before and not hashed  # the new stamp is remembered


def test_a_fifo_in_the_store_is_rebuilt_not_waited_on(routed_model_dir: Path, capsys):
    """A FIFO in place of a stored file would block a plain read forever: it is refused at once and the format is
    stored again."""
    import threading

    load_model(routed_model_dir, "cpu", dtype="int8", compile=False)
    weights = served_dir(routed_model_dir, "int8") / served.WEIGHTS_FILE
    weights.unlink()
    os.mkfifo(weights)
    capsys.readouterr()
    loaded = []
    thread = threading.Thread(target=lambda: loaded.append(load_model(routed_model_dir, "cpu", dtype="int8")))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "loading waited on the FIFO"
    assert loaded and "is not a regular file" in capsys.readouterr().err
    assert weights.is_file()
