"""What the samplers against repeats cost: a decode step of the default model with each of them off vs on.

Penalties (repetition, presence/frequency, DRY; `chatapp/engine/penalties.py`) keep each row's emitted tokens on the
device and change its logits before sampling; min-p is one more threshold in `sampling.py`. Off, none of that code
runs (no state is built and the plan skips min-p), so "off" is the engine as it was. On, the figure is the median of
the engine's own per-step time (`Step.seconds`) over every step of every round, each side in this one process on the
same engine and prompts, in interleaved rounds (each round rotates which side goes first), so all see the same load.

Step medians on a shared 2-core box move by several percent between runs, so the table also times the added device
work alone ("ops"): on random logits of the model's shape, with 256 tokens of history a row, the penalties'
`apply` and `append` plus `sample`, against `sample` alone, 100 repeats, median.

Run: .venv/bin/python benchmarks/sampling_cost.py [--model NAME|DIR] [--rounds 3] [--new-tokens 32] [--batches 1,16]
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch
from _machine import machine
from _timing import added_seconds

from chatapp.engine.engine import Engine
from chatapp.engine.penalties import PenaltyState
from chatapp.engine.sampling import SamplingParams, sample
from chatapp.models import load_engine
from chatapp.settings import GenerationSettings

QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bill becomes a law.",
    "Write a letter to my landlord about the broken heater.",
    "Make a plan for a three-day trip to Rome.",
    "What should I think about before adopting a cat?",
    "Write a poem about the sea at night.",
    "Describe how bread rises.",
    "Write a speech for the opening of a park.",
]

SIDES = {
    "repetition 1.1": {"repetition_penalty": 1.1},
    "presence 0.5 + frequency 0.5": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "min-p 0.05": {"min_p": 0.05},
    "DRY 0.8": {"dry_multiplier": 0.8},
    "all of them": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "min_p": 0.05, "dry_multiplier": 0.8},
}


def step_seconds(engine: Engine, prompts: list[str], settings: GenerationSettings) -> list[float]:
    """Per-step seconds of every step after the first (which carries the prefill)."""
    return [step.seconds for step in engine.generate(prompts, settings) if step.prompt is None]


def measure(engine: Engine, batch: int, base: GenerationSettings, rounds: int) -> dict[str, float]:
    """Median step seconds per side, off included, interleaved."""
    prompts = (QUESTIONS * batch)[:batch]
    sides = {"off": base, **{name: base.with_(**changes) for name, changes in SIDES.items()}}
    times: dict[str, list[float]] = {name: [] for name in sides}
    step_seconds(engine, prompts, sides["all of them"])  # warm-up: first calls allocate, breakers are looked up
    names = list(sides)
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            gc.collect()
            times[name] += step_seconds(engine, prompts, sides[name])
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def ops_seconds(engine: Engine, batch: int, settings: GenerationSettings, history: int = 256) -> float:
    """Median seconds the sampler's own work adds to `sample`, on random logits of the model's shape."""
    device, vocab = engine.device, int(engine.model.config.vocab_size)
    torch.manual_seed(0)
    logits = torch.randn(batch, vocab, device=device) * 3
    plain = SamplingParams.build([settings.with_(min_p=0.0)] * batch, [0] * batch, device)
    params = SamplingParams.build([settings] * batch, [0] * batch, device)
    counters = torch.zeros(batch, dtype=torch.long, device=device)
    state = PenaltyState.build([settings] * batch, vocab, device, engine.loop.breaker_mask)
    if state is not None:
        state.append(torch.randint(0, min(2000, vocab), (batch, history), device=device), torch.full((batch,), history))
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    ones = torch.ones(batch, dtype=torch.long, device=device)

    def off() -> None:
        sample(logits.clone(), plain, counters)  # the clone on both sides: the step's logits are its own

    def on() -> None:
        scores = logits.clone()
        if state is not None:
            state.apply(scores)
        sample(scores, params, counters)
        if state is not None:
            state.append(token, ones)

    with torch.inference_mode():
        return added_seconds(off, on, repeats=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model name or directory (default: the default model)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    args = parser.parse_args()

    engine = load_engine(args.model, args.device)
    config = engine.model.config
    print(f"model: {args.model or 'default'} ({config.num_hidden_layers} layers, vocabulary {config.vocab_size}) "
          f"on {engine.device}")
    print(f"machine: {machine()}")
    print(f"{args.rounds} interleaved rounds, {args.new_tokens} new tokens, sampled at temperature 0.8, top-k 40; "
          "median ms per step\n")
    print("| batch | sampler | off (ms/step) | on (ms/step) | on / off | ops (ms) | ops share |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    base = GenerationSettings(max_tokens=args.new_tokens, temperature=0.8, top_k=40, seed=1)
    for batch in args.batches:
        medians = measure(engine, batch, base, args.rounds)
        off = medians["off"]
        for name, changes in SIDES.items():
            ops = ops_seconds(engine, batch, base.with_(**changes))
            print(f"| {batch} | {name} | {off * 1e3:.2f} | {medians[name] * 1e3:.2f} | {medians[name] / off:.3f} "
                  f"| {ops * 1e3:.2f} | {ops / off:.1%} |", flush=True)
    print(f"\nmachine at the end: {machine()}")


if __name__ == "__main__":
    main()
