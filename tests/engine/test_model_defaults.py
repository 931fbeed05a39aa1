"""A model's own sampling defaults: read from its generation_config.json, applied by `generate` and `batch` under
the user's options, shown with their source by `--verbose`; a broken file is a clear user error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from chatapp.cli import app
from chatapp.errors import ModelDirError
from chatapp.models.generation_config import read_sampling_defaults
from chatapp.settings import GenerationSettings, setting_sources, with_model_defaults

MODEL_DEFAULTS = {"do_sample": False, "repetition_penalty": 1.5, "dry_multiplier": 1.0, "top_k": 40.0}


@pytest.fixture
def model_dir(qwen_dir, chat_tokenizer, tmp_path) -> Path:
    """The tiny checkpoint with its tokenizer and a generation_config.json that gives sampling defaults."""
    path = tmp_path / "model"
    shutil.copytree(qwen_dir, path)
    chat_tokenizer.save(str(path / "tokenizer.json"))
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **MODEL_DEFAULTS}))
    return path


def write(tmp_path: Path, config: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_sampling_keys_are_read_and_the_rest_left_alone(tmp_path) -> None:
    got = read_sampling_defaults(write(tmp_path, {"eos_token_id": 2, "temperature": 0.7, "top_k": 40.0, "min_p": 0}))
    assert got == {"temperature": 0.7, "top_k": 40, "min_p": 0.0}
    assert read_sampling_defaults(write(tmp_path, {"bos_token_id": 1, "eos_token_id": 2})) == {}
    breakers = read_sampling_defaults(write(tmp_path, {"dry_sequence_breakers": ["\n", "."]}))
    assert breakers == {"dry_sequence_breakers": ("\n", ".")}


def test_do_sample_decides_greedy_as_transformers_does(tmp_path) -> None:
    assert read_sampling_defaults(write(tmp_path, {"do_sample": False, "temperature": 0.7}))["temperature"] == 0.0
    assert read_sampling_defaults(write(tmp_path, {"do_sample": True}))["temperature"] == 1.0
    assert read_sampling_defaults(write(tmp_path, {"do_sample": True, "temperature": 0.6}))["temperature"] == 0.6


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ("{not json", "not readable JSON"),
        ([1, 2], "must hold a JSON object"),
        ({"top_p": 2}, "top_p"),
        ({"top_k": 4.5}, "top_k"),
        ({"repetition_penalty": "high"}, "repetition_penalty"),
        ({"do_sample": "yes"}, "do_sample"),
        ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_a_broken_file_names_itself_the_key_and_the_fix(tmp_path, config, named) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ModelDirError) as info:
        read_sampling_defaults(tmp_path)
    assert named in info.value.message and str(path) in info.value.message and info.value.hint


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    config=st.dictionaries(
        st.sampled_from(["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "do_sample", "dry_base"]),
        st.none() | st.booleans() | st.integers(-5, 100) | st.floats(allow_nan=True) | st.text(max_size=3),
    )
)
def test_any_file_gives_valid_defaults_or_a_model_dir_error(tmp_path, config) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    try:
        defaults = read_sampling_defaults(tmp_path)
    except ModelDirError:
        return
    GenerationSettings().with_(**defaults)


def test_options_override_the_model_and_the_model_the_built_ins() -> None:
    model = {"temperature": 0.7, "top_p": 0.9}
    chosen = {"temperature": 0.0}
    settings = with_model_defaults(GenerationSettings().with_(**chosen), model, chosen)
    assert (settings.temperature, settings.top_p, settings.top_k) == (0.0, 0.9, 0)
    sources = setting_sources(model, chosen)
    assert (sources["temperature"], sources["top_p"], sources["top_k"]) == ("option", "model", "built-in")


def test_generate_uses_the_models_defaults_and_says_so(model_dir, engine) -> None:
    result = CliRunner().invoke(app, ["generate", "Hello", "--model", str(model_dir), "--max-tokens", "12", "-v"])
    assert result.exit_code == 0, result.output
    expected = engine.generate_batch(
        ["Hello"], GenerationSettings(max_tokens=12, repetition_penalty=1.5, dry_multiplier=1.0, top_k=40)
    )[0]
    assert result.output.startswith(expected.text)
    for line in (
        "temperature:           0.0  (the model's generation_config.json)",  # its do_sample: false
        "repetition_penalty:    1.5  (the model's generation_config.json)",
        "min_p:                 0.0  (built-in)",
    ):
        assert line in result.output


def test_an_option_overrides_the_models_default(model_dir, engine) -> None:
    args = ["generate", "Hello", "--model", str(model_dir), "--max-tokens", "12", "-v", "--repetition-penalty", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    expected = engine.generate_batch(["Hello"], GenerationSettings(max_tokens=12, dry_multiplier=1.0, top_k=40))[0]
    assert result.output.startswith(expected.text)
    assert "repetition_penalty:    1.0  (option)" in result.output


def test_a_broken_generation_config_is_refused_before_loading(model_dir) -> None:
    (model_dir / "generation_config.json").write_text('{"top_p": 0}')
    result = CliRunner().invoke(app, ["generate", "Hello", "--model", str(model_dir)])
    assert result.exit_code == 1
    assert "top_p" in result.output and "generation_config.json" in result.output
    assert "Traceback" not in result.output


def test_batch_lines_take_the_models_defaults_under_their_own_fields(model_dir, engine) -> None:
    lines = [
        {"id": "model", "prompt": "Hello", "max_tokens": 12},
        {"id": "line", "prompt": "Hello", "max_tokens": 12, "repetition_penalty": 1.0, "dry_multiplier": 0},
    ]
    text = "\n".join(json.dumps(line) for line in lines)
    result = CliRunner().invoke(app, ["batch", "-", "--model", str(model_dir), "--ordered"], input=text)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    own = GenerationSettings(max_tokens=12, repetition_penalty=1.5, dry_multiplier=1.0, top_k=40)
    assert records[0]["text"] == engine.generate_batch(["Hello"], own)[0].text
    plain = GenerationSettings(max_tokens=12, top_k=40)
    assert records[1]["text"] == engine.generate_batch(["Hello"], plain)[0].text
