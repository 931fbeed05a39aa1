"""Loading a model directory (a registered model such as `tiny`, a chatapp checkpoint, or a local Qwen2 checkpoint),
and `load_engine`, the one way the CLI, the UI and the recipes get an `Engine` for a model.

A model directory is Hugging Face-shaped: `config.json`, `model.safetensors` (or sharded safetensors with an index)
and `tokenizer.json`. Everything is read from disk; nothing is ever downloaded. Problems a user can cause (a wrong
path, a missing or corrupt file) are reported as `ModelDirError` naming the directory, the file and the fix, before
any weights are touched where possible.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatapp.errors import ChatappError, ModelDirError
from chatapp.models.generation_config import read_sampling_defaults
from chatapp.models.registry import repair_hint, resolve_model

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

    from chatapp.chat import AnyChatFormat
    from chatapp.engine.engine import Engine
    from chatapp.stt import STTForCausalLM, served

# The weight format when no `dtype` is passed (a `--dtype` option wins over it): auto, float32, bfloat16, int8.
DTYPE_ENV = "CHATAPP_DTYPE"
# torch's CPU thread count for generation (see `configure_threads`).
THREADS_ENV = "CHATAPP_THREADS"
# "1" compiles the CUDA decode step (`chatapp.stt.decode.compile_decode`) at load when no `compile` argument says
# otherwise.
COMPILE_ENV = "CHATAPP_COMPILE"


@dataclass
class LoadedModel:
    """A model ready for the engine: weights on their device, the raw tokenizer and the chat format."""

    model: STTForCausalLM
    tokenizer: Tokenizer
    chat_format: AnyChatFormat
    path: Path
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # its generation_config.json's


def resolve_device(device: str | None) -> torch.device:
    """`None` or "auto" picks CUDA when it is available, else the CPU."""
    import torch

    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ModelDirError(f"unknown device {device!r}", hint="use 'cpu', 'cuda', 'cuda:N' or 'auto'") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelDirError(f"device {device!r} was asked for but CUDA is not available", hint="use --device cpu")
    return resolved


def load_engine(
    model: str | Path | None = None,
    device: str | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    compile: bool | None = None,
    **engine_options: Any,
) -> Engine:
    """An `Engine` over a model: a registered name (`tiny`, `default`), a model directory, or `None` for the default
    model. `engine_options` go to `Engine` (e.g. `context_size`, `fast_forward`)."""
    from chatapp.engine.engine import Engine

    loaded = load_model(model, device, dtype, compile=compile)
    return Engine(
        loaded.model, loaded.tokenizer, loaded.chat_format, sampling_defaults=loaded.sampling_defaults, **engine_options
    )


def load_model(
    model: str | Path | None = None,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    compile: bool | None = None,
) -> LoadedModel:
    """Load a model: a registered name (`tiny`, `default`), a model directory, or `None` for the default model.

    `dtype` is the weight format (`chatapp.stt.weights`): "float32", "bfloat16", "int8" or "int4"; None or "auto" takes
    `$CHATAPP_DTYPE` when set, else the per-device default (`stt.weights.default_format`, by the checkpoint's size).
    A quantized format is read from its stored served format (`_served_model`), converted from the float32 weights
    and stored the first time. What the decode step runs is the model's `DecodeRuntime`, filled in here, one path
    per device: an int8 model on a CPU decodes every batch in one native call a step (`stt.cpu_step`), from its
    first token and with nothing to compile; other CPU formats run the torch step eagerly; on CUDA `compile` (None:
    `$CHATAPP_COMPILE`, else no) compiles the torch step's blocks first.
    """
    import torch

    from chatapp.validation import parse_format

    check_environment()  # before the default model is prepared or any weight is read
    resolved = resolve_device(device)  # a bad --device too
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    fmt = parse_format(dtype) or parse_format(os.environ.get(DTYPE_ENV) or None)
    model_dir = resolve_model(model)
    hint = repair_hint(model, model_dir)  # the fix depends on what wrote the files (shipped, prepared, converted)
    check_model_dir(model_dir, hint=hint)
    _check_written_files(model_dir, hint)
    sampling_defaults = read_sampling_defaults(model_dir)  # a broken file is refused before the weights load
    tokenizer = _load_tokenizer(model_dir, hint)

    from chatapp.chat import chat_format_for
    from chatapp.stt.weights import default_format

    try:
        chat_format = chat_format_for(tokenizer, model_dir)
    except ModelDirError as err:
        if hint is None:  # the user's own checkpoint: the file's own fix (restore it, use another checkpoint)
            raise
        # Files chatapp wrote (the shipped or prepared model, a converted or routed copy) are remade by chatapp,
        # never restored from a checkpoint the user does not have.
        raise ModelDirError(err.message, hint=hint) from None
    count = _parameter_count(model_dir, hint)
    fmt = fmt or default_format(resolved, count)
    model = _served_model(model_dir, resolved, fmt, hint)
    _check_vocab(model_dir, tokenizer, int(model.config.vocab_size), hint)
    if resolved.type == "cpu":
        configure_threads(count)
    model.eval()
    if resolved.type == "cpu" and fmt == "int8":
        from chatapp.stt import cpu_step

        if not cpu_step.attach(model) and (problem := cpu_step.library_problem()):  # one native call a step
            _notice(problem)
    if compile if compile is not None else env_flag(COMPILE_ENV):
        _compile_decode(model, model_dir)
    _return_freed_memory()
    return LoadedModel(
        model=model, tokenizer=tokenizer, chat_format=chat_format, path=model_dir, sampling_defaults=sampling_defaults
    )


def _check_written_files(model_dir: Path, hint: str | None) -> None:
    """A model directory chatapp wrote with its files' checksums (a converted or routed copy; the prepared default
    model is checked, and prepared again, before this: `smollm2.ensure_prepared`) is refused when a file no longer
    matches, rather than run on changed weights. Costs a few `stat` calls unless a file was written to since it was
    last checked (`store.files_damage`)."""
    from chatapp import store
    from chatapp.settings import LOCKS_SUBDIR, data_dir

    if not store.has_checksums(model_dir):
        return  # a user's checkpoint, or written before chatapp recorded checksums
    # Outputs a user names (`convert`, `route`) keep their lock files in the data directory's lock directory.
    if problem := store.files_damage(model_dir, locks=data_dir() / LOCKS_SUBDIR):
        raise ModelDirError(
            f"the model directory {model_dir} is damaged: {problem}",
            hint=hint or f"remove {model_dir} and write it again with the chatapp command that made it",
        )


def _return_freed_memory() -> None:
    """Give the heap that loading freed (the tokenizer's and configs' parsing, the vocabulary check) back to the
    system: glibc keeps it otherwise, and it stays in the process's resident set for its whole life (16 MB of
    `chatapp generate`'s peak: 465 -> 449 MB). Best effort: a no-op without glibc."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library the interpreter runs on (no library search)
    except (OSError, AttributeError):
        return
    trim(0)


def _served_model(model_dir: Path, device: torch.device, fmt: str, hint: str | None) -> STTForCausalLM:
    """The model of `model_dir` in weight format `fmt` on `device`: from its stored served format when there is
    one (`stt.served`: memory-mapped, nothing converted), else converted from the checkpoint's weights and stored
    for the next process. float32 needs no store (the checkpoint is memory-mapped as it is), nor does a GPU (not
    measured there). A store that cannot be read (damaged: its checksums do not match) is rebuilt, with a one-line
    notice on stderr naming it; one that cannot be written leaves this process its converted model."""
    from chatapp.store import is_complete
    from chatapp.stt import served

    if fmt == "float32" or device.type != "cpu":
        return _converted_model(model_dir, device, fmt, hint)
    try:
        entry = served_entry(model_dir, fmt)
    except (OSError, ChatappError) as err:  # a source file unreadable now: the conversion names it
        _notice(f"the stored {fmt} weights cannot be looked up ({_first_line(err)})")
        return _converted_model(model_dir, device, fmt, hint)
    if is_complete(entry.path):
        try:
            model = served.read(entry.path, device)
        except served.ServedFormatError as err:
            _notice(f"{_first_line(err)}; converting the weights again")
        else:
            served.remember(entry)
            return model
    model = _converted_model(model_dir, device, fmt, hint)
    try:
        _store_served(model, entry)
    except (OSError, ChatappError) as err:  # a full or read-only disk: this process still has its model
        _notice(f"the {fmt} weights are not stored for the next start ({_first_line(err)})")
    return model


def served_entry(model_dir: Path, fmt: str) -> served.ServedEntry:
    """Where the served format `fmt` of `model_dir` is stored: the data directory, one entry per `served_key`
    (by the source's content, not its path: `stt.served.find_entry`)."""
    from chatapp.settings import data_dir
    from chatapp.stt.served import ServedSource, find_entry

    source = ServedSource(model_dir=model_dir, files=tuple(_source_files(model_dir)), weight_format=fmt)
    return find_entry(source, data_dir() / "served")


def served_dir(model_dir: Path, fmt: str) -> Path:
    """The directory of `served_entry` (written or not)."""
    return served_entry(model_dir, fmt).path


def _source_files(model_dir: Path) -> list[Path]:
    from chatapp.stt.io import MERGED_ADAPTERS_NAME, SHARD_INDEX_NAME

    extra = [model_dir / name for name in ("config.json", MERGED_ADAPTERS_NAME, SHARD_INDEX_NAME)]
    return _weight_files(model_dir) + [path for path in extra if path.is_file()]


def _store_served(model: STTForCausalLM, entry: served.ServedEntry) -> None:
    """Write the served format through the data directory's store (staged, locked, stamped, renamed into place),
    then remove the entries nothing reads again (`stt.served.remove_unused`: the same model and format stored from
    older weights or code, those of deleted models), 200 MB each for the default model."""
    from chatapp.store import staged_dir
    from chatapp.stt import served

    with staged_dir(entry.path, what="stored model") as staging:
        served.write(model, staging)
        served.record_source(entry, staging)
    served.remove_unused(entry)


def _converted_model(model_dir: Path, device: torch.device, fmt: str, hint: str | None) -> STTForCausalLM:
    """The checkpoint's float32 weights, checked, put in weight format `fmt` (`stt.weights.prepare_weights`)."""
    import torch

    from chatapp.stt import STTForCausalLM
    from chatapp.stt.io import load_merged_adapters
    from chatapp.stt.weights import prepare_weights

    try:
        model = STTForCausalLM.from_pretrained(model_dir, device=device, dtype=torch.float32)
    except ModelDirError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise ModelDirError(
            f"cannot load the weights in {model_dir}: {err}",
            hint=hint or "check that config.json and the safetensors files come from the same checkpoint",
        ) from None
    _check_finite(model_dir, model, hint)  # before any weight-format conversion
    return prepare_weights(model, fmt, load_merged_adapters(model_dir) if fmt == "int4" else None)


def _parameter_count(model_dir: Path, hint: str | None) -> int:
    """The checkpoint's number of weights, from the safetensors headers (no tensor is read)."""
    from chatapp.models.registry import safetensors_parameter_count

    try:
        return safetensors_parameter_count(_weight_files(model_dir))
    except (OSError, ValueError, KeyError, TypeError, ChatappError) as err:
        raise ModelDirError(
            f"cannot read the weights in {model_dir}: {err}",
            hint=hint or "re-copy the safetensors files from the checkpoint",
        ) from None


def _notice(line: str) -> None:
    print(f"notice: {line}", file=sys.stderr, flush=True)


def check_environment() -> None:
    """Refuse a bad `$CHATAPP_COMPILE`, `$CHATAPP_DTYPE`, `$CHATAPP_THREADS`, `$CHATAPP_KERNEL_THREADS`,
    `$GOMP_SPINCOUNT` or `$CHATAPP_DEFAULT_MODEL` before any work (a model load takes seconds; a bad value found
    after it wastes them). Raises a `ChatappError` naming the variable and the fix. (`$CHATAPP_HOME` is checked
    where the data directory is first written, `settings.check_data_dir`.)"""
    from chatapp.errors import ChatappError, SettingsError
    from chatapp.models.registry import default_model_name
    from chatapp.settings import KERNEL_THREADS_ENV, check_spin_count, threads_from_env
    from chatapp.validation import parse_format

    env_flag(COMPILE_ENV)
    value = os.environ.get(DTYPE_ENV)
    if value:
        try:
            parse_format(value)
        except ChatappError as err:
            raise SettingsError(f"{DTYPE_ENV}={value!r}: {err.message}", hint=err.hint) from None
    threads_from_env(THREADS_ENV)
    threads_from_env(KERNEL_THREADS_ENV)
    check_spin_count()  # the TUI's engine process and library callers load through here, not the CLI's group
    default_model_name()


def env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ModelDirError(f"{name}={os.environ[name]!r} is not a yes/no value", hint=f"set {name}=1 or {name}=0")


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:1000] if text else type(err).__name__


def _compile_decode(model: STTForCausalLM, model_dir: Path) -> None:
    """Compile the torch decode step now (CUDA), or say why it cannot be and how to go on without it. On a CPU
    there is nothing to compile: the int8 step runs natively, other formats eagerly (docs/cpu-kernel.md)."""
    from chatapp.stt.decode import compile_decode

    if model.device.type != "cuda":
        _notice("--compile / $CHATAPP_COMPILE compiles the CUDA decode step; on a CPU the step is not compiled")
        return
    try:
        compile_decode(model)
    except Exception as err:  # torch.compile's failures have no common type (compiler missing, backend errors)
        model.runtime.compiled = None
        raise ModelDirError(
            f"compiling the decode step of {model_dir} failed: {_first_line(err)}",
            hint=f"run without --compile / {COMPILE_ENV}=1: the step then runs eagerly",
        ) from None


def configure_threads(num_parameters: int) -> int:
    """Set torch's CPU thread count for generating with a model of `num_parameters` and return it:
    `$CHATAPP_THREADS` when set, one thread for a small model (`stt.weights.fits_in_cache`), torch's default
    otherwise.

    A small model's decode step is hundreds of tiny ops, and every multi-threaded op waits for the whole thread
    pool: on a CPU shared with another busy process that wait is a scheduler time slice. Measured on the 2-core
    box at load ~8 (the tiny model, `chatapp generate IN.jsonl`, the same run): one thread 175 tokens/s at batch 1
    and 1157 at batch 16; two threads 12.9 and 16.8. On a quiet box one thread is as fast for this model.
    """
    import torch

    from chatapp.settings import threads_from_env
    from chatapp.stt.weights import fits_in_cache

    threads = threads_from_env(THREADS_ENV)
    if threads is None:
        threads = torch.get_num_threads() if not fits_in_cache(num_parameters) else 1
    torch.set_num_threads(threads)  # the int8 kernel (`stt.cpu_step`) takes the same count unless told otherwise
    return threads


def is_complete_model_dir(model_dir: Path) -> bool:
    """Whether `model_dir` has its config, tokenizer and weights (a quick look, no file is read)."""
    files = ("config.json", "tokenizer.json")
    return all((model_dir / name).is_file() for name in files) and bool(_weight_files(model_dir))


def _check_vocab(model_dir: Path, tokenizer: Tokenizer, vocab_size: int, hint: str | None) -> None:
    """Every token id the tokenizer can produce must have a row in the model's embedding."""
    ids = tokenizer.get_vocab().values()
    largest = max(ids, default=-1)
    if largest >= vocab_size:
        raise ModelDirError(
            f"{model_dir / 'tokenizer.json'} has token ids up to {largest}, but the model's vocabulary "
            f"(vocab_size in config.json) has {vocab_size} rows",
            hint=hint or "use the tokenizer.json that came with these weights",
        )


def _check_finite(model_dir: Path, model: STTForCausalLM, hint: str | None) -> None:
    """NaN or infinite weights make every logit NaN: the model would answer nothing, silently."""
    import torch

    for name, tensor in model.named_parameters():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ModelDirError(
                f"the weights in {model_dir} hold NaN or infinite values ({name})",
                hint=hint or "re-copy the weights, or retrain: the checkpoint is damaged",
            )


def check_model_dir(model_dir: Path, hint: str | None = None) -> dict[str, Any]:
    """Raise `ModelDirError` unless `model_dir` has a readable config.json, weights and tokenizer.json; its config."""
    if not model_dir.exists():
        raise ModelDirError(
            f"model directory {model_dir} does not exist",
            hint=hint or "pass the path of a directory holding config.json, model.safetensors and tokenizer.json",
        )
    if not model_dir.is_dir():
        if _is_gguf_file(model_dir):
            raise ModelDirError(
                f"{model_dir} is a GGUF file, not a model directory",
                hint=f"convert it once with `chatapp convert {model_dir} DIR`, then pass --model DIR",
            )
        raise ModelDirError(
            f"{model_dir} is a file, not a model directory", hint=hint or "pass the model's directory, not a file"
        )
    config = _read_config(model_dir, hint)
    if not _weight_files(model_dir):
        raise ModelDirError(
            f"{model_dir} has no weights: model.safetensors is missing",
            hint=hint or "copy model.safetensors (or the model-*.safetensors shards and their index) into it",
        )
    if not (model_dir / "tokenizer.json").is_file():
        raise ModelDirError(
            f"{model_dir} has no tokenizer.json",
            hint=hint or "copy tokenizer.json from the checkpoint (chatapp reads the fast-tokenizer file only)",
        )
    return config


def _is_gguf_file(path: Path) -> bool:
    """A regular file named .gguf or starting with GGUF's magic (a FIFO is never opened: that would block)."""
    from chatapp.models.gguf import is_gguf

    return path.is_file() and (path.suffix.lower() == ".gguf" or is_gguf(path))


def _read_config(model_dir: Path, hint: str | None) -> dict[str, Any]:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelDirError(
            f"{model_dir} has no config.json", hint=hint or "copy config.json from the checkpoint into the directory"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelDirError(
            f"{config_path} is not valid JSON: {err}", hint=hint or "restore config.json from the checkpoint"
        ) from None
    if not isinstance(config, dict) or "hidden_size" not in config:
        raise ModelDirError(
            f"{config_path} is not a model config (no 'hidden_size')",
            hint=hint or "restore config.json from the checkpoint",
        )
    return config


def _weight_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(model_dir.glob("model-*.safetensors"))


def _load_tokenizer(model_dir: Path, hint: str | None) -> Tokenizer:
    from tokenizers import Tokenizer

    tokenizer_path = model_dir / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(tokenizer_path))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise ModelDirError(
            f"cannot read {tokenizer_path}: {err}", hint=hint or "restore tokenizer.json from the checkpoint"
        ) from None
