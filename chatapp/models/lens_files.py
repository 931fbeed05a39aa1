"""Where a model's tuned-lens translators live, and reading them (`chatapp.stt.lens.Translators`).

`chatapp lens fit MODEL` writes them into the data directory, `<data>/lenses/<key>/lens.safetensors` (`fitted_path`;
the key is the model's name for the built-in models, else its directory's name and a hash of its path): never into
the model directory, which is not the fit's to change. A prepared model is deleted and prepared again (damage, a new
version), a converted or routed one is replaced whole when its command runs again, and the tiny model is part of the
installed package; a lens kept beside any of them would go with it, without a word. A model directory may still
carry its own `lens.safetensors` beside its weights (one that came with it), and the default model ships one with
the parts it is prepared from (`smollm2_parts/lens.safetensors`). Lookup order: the user's fit, the model's own, the
shipped one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from chatapp.errors import ChatappError, ModelDirError
from chatapp.models.registry import tiny_model_dir
from chatapp.models.safetensors_header import read_header
from chatapp.models.smollm2 import PARTS_DIR, prepared_dir
from chatapp.settings import data_dir
from chatapp.store import atomic_write, check_output_file, check_writable_dir, read_regular_bytes

LENS_FILE = "lens.safetensors"
LENSES_SUBDIR = "lenses"
LENS_TENSORS = frozenset({"down", "up", "bias"})
MAX_LENS_BYTES = 64 * 1024 * 1024  # far above any translators a model would ship


def fitted_path(model_dir: Path) -> Path:
    """Where `chatapp lens fit` puts the translators of the model in `model_dir` by default (module docstring)."""
    resolved = model_dir.expanduser().resolve()
    if resolved == tiny_model_dir().resolve():
        key = "tiny"
    elif resolved == prepared_dir().resolve():
        key = "default"
    else:  # the path, not the name: two models called `out` must not share a lens
        key = f"{resolved.name or 'model'}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}"
    return data_dir() / LENSES_SUBDIR / key / LENS_FILE


def lens_file(model_dir: Path) -> Path | None:
    """The translators file for a model directory: the user's fit, else the model's own, else the shipped one for
    the default model."""
    fitted = fitted_path(model_dir)
    if fitted.exists():
        return fitted
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


def is_lens_file(path: Path) -> bool:
    """Whether `path` is a regular file holding a tuned lens (a safetensors file of exactly `down`, `up`, `bias`),
    which only `chatapp lens fit` writes: the one kind of existing file an output may replace."""
    try:
        return set(read_header(path).tensors) == LENS_TENSORS
    except (ChatappError, OSError, ValueError):
        return False


def check_lens_output(path: Path, what: str = "lens output") -> Path:
    """`path` as where a fitted lens may be written (`store.check_output_file`): a new file, or a lens file."""
    return check_output_file(path, what, ours=is_lens_file)


def save_translators(translators, path: Path, what: str = "lens output") -> None:
    """Write the translators to `path` whole or not at all, checked again just before (a fit takes minutes: what is
    at `path` may have changed since the command started)."""
    from safetensors.torch import save_file

    check_lens_output(path, what)
    check_writable_dir(path.parent, f"directory of the {what}")
    atomic_write(path, lambda staging: save_file(translators.tensors(), str(staging)), mode=0o644)
