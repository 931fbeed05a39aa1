"""Reading and writing HF-style model directories: config.json, model.safetensors (or shards), tokenizer files.

A plain Qwen2 directory loads into an STT model with freshly initialised routers and `routing_trained = False`
(student routing then runs every token, so the model behaves exactly like the Qwen2 it came from). Files are
written to a temporary name and moved into place, so an interrupted save never leaves a half-written model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from chatapp.errors import ModelDirError
from chatapp.store import atomic_write
from chatapp.stt.config import STTConfig, config_problem

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SHARD_INDEX_NAME = "model.safetensors.index.json"
# Optional: the low-rank adapters already merged into model.safetensors, as `{module}.lora_A` (r, in) and
# `{module}.lora_B` (out, r) with the scale folded into B, so that W = W_base + B @ A. A loader that quantizes
# coarsely can take them back out, quantize the base alone and run the adapters beside it (QLoRA's split).
MERGED_ADAPTERS_NAME = "merged_adapters.safetensors"
# Copied along by `convert` when present; tokenizer.json is what chatapp itself reads.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
ROUTER_PARTS = (".transition_network.", ".predictive_router.", ".causal_router.", ".skip_predictor.")


def _require_dir(model_dir: Path) -> None:
    if model_dir.exists() and not model_dir.is_dir():
        raise ModelDirError(
            f"{model_dir} is a file, not a model directory",
            hint="pass the directory holding config.json and model.safetensors",
        )
    if not model_dir.is_dir():
        raise ModelDirError(
            f"model directory {model_dir} does not exist",
            hint="pass a directory holding config.json and model.safetensors",
        )


def _missing_file(model_dir: Path, name: str) -> ModelDirError:
    return ModelDirError(
        f"model directory {model_dir} has no {name}",
        hint="use a Hugging Face-style directory (config.json + model.safetensors) saved by chatapp or transformers",
    )


def load_config(model_dir: str | Path) -> tuple[STTConfig, bool]:
    """The directory's config as an STTConfig, and whether it already was an STT config."""
    model_dir = Path(model_dir)
    _require_dir(model_dir)
    path = model_dir / CONFIG_NAME
    if not path.is_file():
        raise _missing_file(model_dir, CONFIG_NAME)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelDirError(
            f"{path} is not readable JSON: {err}", hint="restore the file from the original model"
        ) from None
    if not isinstance(raw, dict):
        raise ModelDirError(f"{path} does not hold a JSON object", hint="restore the file from the original model")
    model_type = raw.get("model_type", "qwen2")
    if model_type != "qwen2":
        raise ModelDirError(
            f"{path} describes a {model_type!r} model; chatapp runs Qwen2-architecture models",
            hint="use a Qwen2 / Qwen2.5 checkpoint or a directory written by chatapp",
        )
    is_stt = "stt_layers" in raw
    raw.pop("model_type", None)
    try:
        config = STTConfig.from_dict(raw)
        config.validate_stt()
    except (TypeError, ValueError) as err:
        raise ModelDirError(
            f"{path} is not a valid model config: {config_problem(err)}", hint="fix or regenerate config.json"
        ) from None
    if not is_stt:
        config.routing_trained = False
    return config, is_stt


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint, on the CPU."""
    single, index = model_dir / WEIGHTS_NAME, model_dir / SHARD_INDEX_NAME
    try:
        if single.is_file():
            return load_file(single)
        if not index.is_file():
            raise _missing_file(model_dir, WEIGHTS_NAME)
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            if not (model_dir / shard).is_file():
                raise _missing_file(model_dir, shard)
            state.update(load_file(model_dir / shard))
        return state
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as err:
        raise ModelDirError(
            f"cannot read the weights in {model_dir}: {err}", hint="re-copy or re-download the safetensors files"
        ) from None


def save_merged_adapters(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], model_dir: str | Path) -> None:
    """Write `{module: (A (r, in), B (out, r))}` (scale folded into B) as `MERGED_ADAPTERS_NAME` in `model_dir`."""
    state = {}
    for module, (a, b) in adapters.items():
        state[f"{module}.lora_A"] = a.detach().float().contiguous().cpu()
        state[f"{module}.lora_B"] = b.detach().float().contiguous().cpu()
    path = Path(model_dir) / MERGED_ADAPTERS_NAME
    atomic_write(path, lambda p: save_file(state, str(p), metadata={"format": "pt"}))


def load_merged_adapters(model_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapters merged into `model_dir`'s weights (empty when it has none): `{module: (A, B)}`."""
    path = model_dir / MERGED_ADAPTERS_NAME
    if not path.is_file():
        return {}
    try:
        state = load_file(path)
    except (SafetensorError, OSError) as err:
        raise ModelDirError(
            f"cannot read {path}: {err}", hint="prepare the model again (int4 needs it), or use another --dtype"
        ) from None
    modules = {k.removesuffix(".lora_A") for k in state if k.endswith(".lora_A")}
    if any(f"{m}.lora_B" not in state for m in modules) or len(state) != 2 * len(modules):
        raise ModelDirError(
            f"{path} does not pair every lora_A with a lora_B", hint="prepare the model again, or use another --dtype"
        )
    return {m: (state[f"{m}.lora_A"], state[f"{m}.lora_B"]) for m in sorted(modules)}


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on the CPU (bf16 matmuls are slow there); bfloat16 on CUDA."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(
    model_class: Any,
    model_dir: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Any:
    """Build a `model_class` (`STTForCausalLM`, whose `from_pretrained` is the usual way in: this module is below
    the model's and does not import it) from a directory; see the module docstring for plain Qwen2 directories."""
    model_dir = Path(model_dir)
    config, is_stt = load_config(model_dir)
    state = load_state_dict(model_dir)
    # Built on the meta device (no memory, no random initialisation) when the checkpoint holds every weight;
    # a plain Qwen2 checkpoint has no routers, and those need their initialisation.
    model = model_class.empty(config) if is_stt else model_class(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if not is_stt:  # a plain Qwen2 checkpoint: fresh routers are expected to be missing
        missing = [k for k in missing if not any(part in k for part in ROUTER_PARTS)]
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        detail = f"missing {missing[:4]}" if missing else f"unexpected {unexpected[:4]}"
        raise ModelDirError(
            f"weights in {model_dir} do not match its config.json ({detail})",
            hint="the directory mixes files from different models; re-copy it from one source",
        )
    own = model.state_dict()
    wrong = [name for name in sorted(state) if name in own and tuple(state[name].shape) != tuple(own[name].shape)]
    if wrong:
        shown = "; ".join(
            f"{name}: {tuple(state[name].shape)} in the file, {tuple(own[name].shape)} in config.json"
            for name in wrong[:3]
        )
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise ModelDirError(
            f"weights in {model_dir} have the wrong shapes for its config.json: {shown}{more}",
            hint="the directory mixes files from different models; re-copy it from one source",
        )
    try:
        # `assign` keeps the file's tensors (memory-mapped by safetensors) instead of copying them into the model's.
        model.load_state_dict(state, strict=False, assign=is_stt)
        model.finish_load()
    except RuntimeError as err:
        raise ModelDirError(f"weights in {model_dir} do not load: {str(err)[:500]}", hint="re-copy the model") from None
    device = torch.device(device) if device is not None else torch.device("cpu")
    return model.to(device=device, dtype=dtype or default_dtype(device)).eval()


def save_model(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Write config.json and model.safetensors into `model_dir` (created if needed)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config_text = json.dumps(model.config.to_dict(), indent=2, sort_keys=True) + "\n"
    atomic_write(model_dir / WEIGHTS_NAME, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    atomic_write(model_dir / CONFIG_NAME, lambda p: p.write_text(config_text, encoding="utf-8"))


def copy_tokenizer_files(source: str | Path, target: str | Path) -> list[str]:
    """Copy the tokenizer / generation files that exist in `source` into `target`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(target) / name)
            copied.append(name)
    return copied


def convert_qwen2(model_class: Any, source: str | Path, target: str | Path) -> Any:
    """Turn a Qwen2 directory into an STT directory of a `model_class` (fresh routers, routing off until trained)."""
    model = load_model(model_class, source)
    save_model(model, target)
    copy_tokenizer_files(source, target)
    return model
