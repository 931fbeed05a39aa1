"""Which model directory a `--model` value means: a registered name, or a path.

Names win over paths: `--model tiny` is always the shipped model, `--model ./tiny` a directory called `tiny`.
The default model is decided in one place, `default_model_name()`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from chatapp.errors import ModelDirError


def tiny_model_dir() -> Path:
    """The 3.35M-parameter model shipped inside the package (tests and the fallback)."""
    return Path(__file__).resolve().parent / "tiny"


# Registered model names and where each one's directory is.
MODELS: dict[str, Callable[[], Path]] = {"tiny": tiny_model_dir}


def default_model_name() -> str:
    """The model used when none is named."""
    return "tiny"


def default_model_dir() -> Path:
    return MODELS[default_model_name()]()


def is_registered(name_or_path: str | Path | None) -> bool:
    """Whether `resolve_model(name_or_path)` gives a registered model (the default included) rather than a path."""
    return name_or_path is None or (isinstance(name_or_path, str) and name_or_path in MODELS)


def resolve_model(name_or_path: str | Path | None) -> Path:
    """The model directory for a registered name, a path, or `None` (the default model).

    A path must exist; whether it holds a usable checkpoint is checked when it is loaded (`check_model_dir`).
    """
    if name_or_path is None:
        return default_model_dir()
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        return MODELS[name_or_path]()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelDirError(
            f"model directory {path} does not exist",
            hint=f"pass a model directory holding config.json, model.safetensors and tokenizer.json, "
            f"or a model name ({', '.join(MODELS)})",
        )
    return path
