"""Where a model's tuned-lens translators live, and reading them (`chatapp.stt.lens.Translators`).

A model directory keeps them as `lens.safetensors` beside its weights (`chatapp lens fit MODEL` writes them there).
The default model ships its own with the parts it is prepared from (`smollm2_parts/lens.safetensors`), so preparing
the model again never loses them.
"""

from __future__ import annotations

from pathlib import Path

from chatapp.errors import ModelDirError
from chatapp.models.smollm2 import PARTS_DIR, prepared_dir
from chatapp.store import atomic_write, read_regular_bytes

LENS_FILE = "lens.safetensors"
MAX_LENS_BYTES = 64 * 1024 * 1024  # far above any translators a model would ship


def lens_file(model_dir: Path) -> Path | None:
    """The translators file for a model directory: its own, else the shipped one for the default model."""
    own = model_dir / LENS_FILE
    if own.is_file():
        return own
    shipped = PARTS_DIR / LENS_FILE
    if shipped.is_file() and model_dir.resolve() == prepared_dir().resolve():
        return shipped
    return None


def lens_translators(model_dir: Path, config):
    """The model's tuned-lens translators, or None when it has none. Raises `ModelDirError` for a file that is not a
    lens for this model (damaged, or fitted for another)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    from chatapp.stt.lens import Translators

    path = lens_file(model_dir)
    if path is None:
        return None
    hint = f"fit it again with `chatapp lens fit {model_dir}`, or remove {path}"
    try:
        tensors = load(read_regular_bytes(path, MAX_LENS_BYTES))
        return Translators.from_tensors(tensors, int(config.num_hidden_layers), int(config.hidden_size))
    except (SafetensorError, ValueError) as err:
        raise ModelDirError(f"{path} is not a tuned lens for this model: {err}", hint=hint) from None


def save_translators(translators, path: Path) -> None:
    """Write the translators to `path` whole or not at all."""
    from safetensors.torch import save_file

    atomic_write(path, lambda staging: save_file(translators.tensors(), str(staging)))
