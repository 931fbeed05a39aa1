"""The trainers' checkpoints: a new one replaces the last whole, a failed write leaves the last in place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chatapp.training.checkpoint import latest_step, save_state, save_step


def _write(value: str):
    def write(directory: Path) -> None:
        (directory / "weights.txt").write_text(value, encoding="utf-8")

    return write


def test_each_step_replaces_the_last_and_leaves_nothing_else(tmp_path):
    root = tmp_path / "checkpoints"
    assert latest_step(root) is None
    save_step(root, 2, _write("two"))
    final = save_step(root, 4, _write("four"))
    assert latest_step(root) == final == root / "step_000004"
    assert (final / "weights.txt").read_text() == "four"
    # The older step, every lock file and every staging directory are gone: one checkpoint and the pointer.
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004"]


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    save_step(root, 2, _write("two"))

    def broken(directory: Path) -> None:
        (directory / "weights.txt").write_text("half", encoding="utf-8")
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        save_step(root, 4, broken)
    assert latest_step(root) == root / "step_000002"
    assert (root / "step_000002" / "weights.txt").read_text() == "two"
    assert not [p for p in root.iterdir() if "staging" in p.name]


def test_save_state_round_trips_and_replaces_atomically(tmp_path):
    path = tmp_path / "train.pt"
    save_state({"step": 3, "w": torch.ones(2)}, path)
    save_state({"step": 5, "w": torch.zeros(2)}, path)
    saved = torch.load(path, weights_only=True)
    assert saved["step"] == 5 and torch.equal(saved["w"], torch.zeros(2))
    assert [p.name for p in tmp_path.iterdir()] == ["train.pt"]  # no temporary file left beside it
