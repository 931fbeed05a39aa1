"""load_model: a model directory in, model + tokenizer + chat format out; bad directories name the file and the fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from chatapp.chat import ChatFormat
from chatapp.errors import ModelDirError
from chatapp.models.loader import LoadedModel, load_model, resolve_device
from chatapp.models.registry import MODELS


@pytest.fixture
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


def broken_copy(model_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(model_dir, target)
    return target


def test_loads_model_tokenizer_and_chat_format(model_dir: Path) -> None:
    loaded = load_model(model_dir, device="cpu")
    assert isinstance(loaded, LoadedModel) and loaded.path == model_dir
    assert isinstance(loaded.chat_format, ChatFormat) and loaded.chat_format.tokenizer is loaded.tokenizer
    assert loaded.model.dtype == torch.float32 and loaded.model.device.type == "cpu"
    assert not loaded.model.training
    assert loaded.model.config.vocab_size == loaded.tokenizer.get_vocab_size()


def test_half_precision_weights_load_as_float32(model_dir: Path, tmp_path: Path) -> None:
    target = broken_copy(model_dir, tmp_path)
    reference = load_model(model_dir, device="cpu").model
    reference.to(torch.float16).save_pretrained(target)
    loaded = load_model(target, device="cpu").model
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded.lm_head.weight, reference.lm_head.weight.float())


def test_device_auto_is_cuda_only_when_present() -> None:
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto") == resolve_device(None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_a_clear_error(model_dir: Path) -> None:
    with pytest.raises(ModelDirError, match="CUDA is not available"):
        load_model(model_dir, device="cuda")


def test_missing_directory_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelDirError, match="does not exist") as info:
        load_model(missing)
    assert str(missing) in str(info.value) and info.value.hint


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("tokenizer.json", "no tokenizer.json"),
        ("config.json", "no config.json"),
        ("model.safetensors", "model.safetensors"),
    ],
)
def test_missing_file_is_named(model_dir: Path, tmp_path: Path, remove: str, message: str) -> None:
    target = broken_copy(model_dir, tmp_path)
    (target / remove).unlink()
    with pytest.raises(ModelDirError, match=message) as info:
        load_model(target)
    assert str(target) in str(info.value) and info.value.hint


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("config.json", "{not json", "config.json is not valid JSON"),
        ("config.json", "[1, 2]", "config.json is not a model config"),
        ("tokenizer.json", "{}", "cannot read .*tokenizer.json"),
        ("model.safetensors", "garbage", "cannot read the weights"),
    ],
)
def test_corrupt_file_is_named(model_dir: Path, tmp_path: Path, name: str, content: str, message: str) -> None:
    target = broken_copy(model_dir, tmp_path)
    (target / name).write_text(content, encoding="utf-8")
    with pytest.raises(ModelDirError, match=message) as info:
        load_model(target)
    assert info.value.hint


def test_shipped_model_errors_point_at_make_train_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MODELS, "tiny", lambda: tmp_path / "tiny")
    with pytest.raises(ModelDirError) as info:
        load_model()
    assert "make train-tiny" in (info.value.hint or "")
