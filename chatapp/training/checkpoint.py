"""Checkpoints of the trainers, written through `chatapp.store` like everything else the app writes.

Two shapes, one rule (a reader, or a run resumed after kill -9, sees the previous checkpoint or the whole new one):

- `save_state`: one `torch.save` file (the recipes' and the fine-tune's trainable tensors and optimizer state),
  through `store.atomic_write`;
- `save_step` / `latest_step`: a `root/step_NNNNNN/` directory per checkpoint (the generic loop's: a whole model
  directory and the trainer state), through `store.staged_dir`, then a `latest` pointer file replaced atomically.
  Older step directories are removed once the pointer names the new one, so a crash between the two leaves both.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chatapp import store

LATEST = "latest"


def save_state(obj: Any, path: Path) -> None:
    """`torch.save(obj)` to `path`, atomically."""
    import torch

    store.atomic_write(path, lambda tmp: torch.save(obj, tmp))


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def save_step(root: Path, step: int, write: Callable[[Path], object]) -> Path:
    """Call `write(directory)` to fill checkpoint `step` under `root`, put it in place whole, point `latest` at it,
    then drop the older ones. Returns the checkpoint's directory."""
    root.mkdir(parents=True, exist_ok=True)
    name = step_name(step)
    with store.staged_dir(root / name, what="checkpoint") as staging:
        write(staging)
    store.atomic_write(root / LATEST, lambda tmp: tmp.write_text(name + "\n", encoding="utf-8"))
    for old in root.glob("step_*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)  # its lock file went as its writer finished (`store.target_lock`)
    return root / name


def latest_step(root: Path) -> Path | None:
    """The checkpoint directory `root/latest` names, or None when there is none (yet)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text(encoding="utf-8").strip()
    return path if path.is_dir() else None
