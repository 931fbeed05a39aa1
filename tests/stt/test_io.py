"""Model directories: save/load round trips, plain Qwen2 checkpoints, and broken directories."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2ForCausalLM

from chatapp.errors import ModelDirError
from chatapp.stt import STTConfig, STTForCausalLM
from chatapp.stt.config import betas_at

from .conftest import routed_model


def logits_of(model: STTForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(ids.shape[0], 32)
    return model.extend(ids, torch.full((ids.shape[0],), ids.shape[1]), cache, all_logits=True).logits


def test_config_defaults_follow_the_reference_and_round_trip(tmp_path):
    config = STTConfig(
        num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
    )
    assert config.stt_layers == [1, 3, 5]
    assert (config.capacity, config.g_threshold, config.ma_window) == (0.5, 0.75, 100)
    assert (config.tpn_loss_weight, config.causal_loss_weight, config.g_reg_loss_weight) == (0.05, 0.01, 0.001)
    assert (config.lr_base, config.lr_transition_network, config.lr_predictive_router) == (1e-5, 1e-3, 1e-2)
    assert betas_at(config, 0) == pytest.approx((0.1, 0.1))
    assert betas_at(config, config.beta_warmup_steps) == pytest.approx((100.0, 100.0))
    config.gated_second_pass = True
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["stt_layers"] == [1, 3, 5] and saved["gated_second_pass"] is True
    assert STTConfig.from_pretrained(tmp_path).gated_second_pass is True


def test_save_and_load_round_trip(tmp_path):
    model = routed_model(seed=5, stt_layers=[0, 2], gated_second_pass=True)
    model.save_pretrained(tmp_path)
    loaded = STTForCausalLM.from_pretrained(tmp_path)
    assert loaded.stt_layer_indices == [0, 2]
    assert loaded.config.routing_trained is True and loaded.config.gated_second_pass is True
    ids = torch.randint(0, 300, (2, 9))
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(model, ids))


def test_tied_embeddings_are_saved_once_and_stay_tied(tmp_path):
    model = routed_model(seed=6, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    loaded = STTForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 300, (1, 7))
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(model, ids))


def test_plain_qwen2_loads_with_fresh_routers_and_stock_transformers_reads_stt_dirs(qwen2_dir, tmp_path):
    reference, path = qwen2_dir
    model = STTForCausalLM.from_pretrained(path)
    assert model.config.routing_trained is False
    assert model.stt_layer_indices == [1, 3]
    model.save_pretrained(tmp_path / "stt")
    back = Qwen2ForCausalLM.from_pretrained(tmp_path / "stt").eval()
    ids = torch.randint(0, 300, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, reference(ids).logits)


def test_missing_directory_names_the_path(tmp_path):
    with pytest.raises(ModelDirError, match="nowhere"):
        STTForCausalLM.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_missing_file_names_the_path_and_the_file(qwen2_dir, missing):
    _, path = qwen2_dir
    (path / missing).unlink()
    with pytest.raises(ModelDirError, match=missing) as info:
        STTForCausalLM.from_pretrained(path)
    assert str(path) in str(info.value)


def test_corrupt_files_raise_model_dir_errors(qwen2_dir):
    _, path = qwen2_dir
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelDirError, match="weights"):
        STTForCausalLM.from_pretrained(path)
    (path / "config.json").write_text("{ broken")
    with pytest.raises(ModelDirError, match=r"config\.json"):
        STTForCausalLM.from_pretrained(path)


def test_weights_from_another_model_are_rejected(qwen2_dir, tmp_path):
    _, path = qwen2_dir
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 5
    del config["layer_types"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirError, match="missing"):
        STTForCausalLM.from_pretrained(path)
    config["num_hidden_layers"], config["intermediate_size"] = 4, 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirError, match="shapes"):
        STTForCausalLM.from_pretrained(path)


def test_invalid_config_values_raise_model_dir_errors(qwen2_dir):
    _, path = qwen2_dir
    config = json.loads((path / "config.json").read_text())
    config["hidden_size"] = "wide"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirError, match="not a valid model config"):
        STTForCausalLM.from_pretrained(path)


def test_merged_adapters_round_trip_and_reject_damage(tmp_path):
    from chatapp.stt.io import MERGED_ADAPTERS_NAME, load_merged_adapters, save_merged_adapters

    assert load_merged_adapters(tmp_path) == {}  # a model without adapters
    adapters = {"model.layers.0.mlp.up_proj": (torch.randn(4, 16), torch.randn(32, 4))}
    save_merged_adapters(adapters, tmp_path)
    loaded = load_merged_adapters(tmp_path)
    assert list(loaded) == ["model.layers.0.mlp.up_proj"]
    got, want = loaded["model.layers.0.mlp.up_proj"], adapters["model.layers.0.mlp.up_proj"]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    (tmp_path / MERGED_ADAPTERS_NAME).write_bytes(b"\x00" * 12)
    with pytest.raises(ModelDirError, match=MERGED_ADAPTERS_NAME):
        load_merged_adapters(tmp_path)
