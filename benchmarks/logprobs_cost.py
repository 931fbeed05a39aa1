"""What per-token log-probabilities cost: a decode step of the default model with `logprobs` off vs on.

With `GenerationSettings.logprobs = N` the decode loop also takes the model's log-softmax over the vocabulary (before
the grammar mask), the sampling distribution's log-probs, the emitted token's log p under both, the entropy and two
top-N, all on the device, and ships them in the step's one device→host copy (`chatapp/engine/logprobs.py`). The
goal: at most 5% of a decode step of the default model (SmolLM2-135M, vocabulary 49,152).

Both sides run in this one process on the same engine and the same prompts, in interleaved rounds (off, on, off,
on, ...; each round alternates which goes first), so both see the same machine load. The figure is the median of
the engine's own per-step time (`Step.seconds`: forward, sampling, log-probs, the copy and host bookkeeping) over
every step of every round; tokens are checked identical on both sides (log-probs must not change what is emitted).
Greedy and sampled (temperature 0.8, top-p 0.9) decoding, batch 1 and 8; routing as shipped (student).

Step medians on a shared 2-core box move by several percent between runs, more than the cost measured, so the
table also times the added device work alone ("ops"): on the model's (B, V) logits, `sample` (off) against the
log-softmax, `sample_with_log_probs` and `logprobs.measure` (on), 200 repeats, median; that difference over the
step median is the "ops share" column.

Run: .venv/bin/python benchmarks/logprobs_cost.py [--model NAME|DIR] [--rounds 5] [--new-tokens 48] [--top 5]
     [--batches 1,8]
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch
from _machine import machine
from _timing import added_seconds

from chatapp.engine.engine import Engine
from chatapp.models import load_engine
from chatapp.settings import GenerationSettings

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "What is 37*45?",
    "Name three colours of the rainbow.",
    "How do plants make food?",
    "Tell me a fun fact about octopuses.",
    "What does a compiler do?",
]


def run(engine: Engine, prompts: list[str], settings: GenerationSettings) -> tuple[list[float], list[list[int]]]:
    """Per-step seconds (every step after the first, which carries the prefill) and each row's tokens."""
    rows: list[list[int]] = [[] for _ in prompts]
    seconds: list[float] = []
    for step in engine.generate(prompts, settings):
        if step.prompt is None:
            seconds.append(step.seconds)
        for event in step.tokens:
            rows[event.row].append(event.token)
    return seconds, rows


def measure(engine: Engine, batch: int, settings: GenerationSettings, top: int, rounds: int) -> tuple[float, float]:
    """Median step seconds with log-probs off and on, interleaved."""
    prompts = (QUESTIONS * batch)[:batch]
    sides = {"off": settings, "on": settings.with_(logprobs=top)}
    times: dict[str, list[float]] = {"off": [], "on": []}
    run(engine, prompts, sides["on"])  # warm-up: first calls allocate
    for index in range(rounds):
        order = ("off", "on") if index % 2 == 0 else ("on", "off")
        tokens = {}
        for name in order:
            gc.collect()
            seconds, tokens[name] = run(engine, prompts, sides[name])
            times[name] += seconds
        assert tokens["off"] == tokens["on"], "log-probs changed the emitted tokens"
    return statistics.median(times["off"]), statistics.median(times["on"])


def ops_seconds(batch: int, vocab: int, settings: GenerationSettings, top: int, device: torch.device) -> float:
    """Median seconds the log-prob work adds to sampling, on random logits of the model's shape."""

    from chatapp.engine.logprobs import measure as measure_logprobs
    from chatapp.engine.logprobs import model_log_probs
    from chatapp.engine.sampling import SamplingParams, sample, sample_with_log_probs

    torch.manual_seed(0)
    logits = torch.randn(batch, vocab, device=device) * 3
    params = SamplingParams.build([settings] * batch, [0] * batch, device)
    counters = torch.zeros(batch, dtype=torch.long, device=device)

    def off() -> None:
        sample(logits, params, counters)

    def on() -> None:
        model = model_log_probs(logits)
        tokens, sampling = sample_with_log_probs(logits, params, counters)
        measure_logprobs(model[:, None], tokens[:, None], sampling, top)

    with torch.inference_mode():
        return added_seconds(off, on, repeats=200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model name or directory (default: the default model)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--top", type=int, default=5, help="alternatives per token (the TUI's default)")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    args = parser.parse_args()

    engine = load_engine(args.model, args.device)
    config = engine.model.config
    print(f"model: {args.model or 'default'} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"vocabulary {config.vocab_size}) on {engine.device}")
    print(f"machine: {machine()}")
    print(f"{args.rounds} interleaved rounds, {args.new_tokens} new tokens, logprobs={args.top}; median ms per step\n")
    print("| batch | decoding | logprobs off (ms/step) | on (ms/step) | on / off | step cost | ops (ms) | ops share |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    greedy = GenerationSettings(max_tokens=args.new_tokens)
    sampled = greedy.with_(temperature=0.8, top_p=0.9, seed=1)
    for batch in args.batches:
        for name, settings in (("greedy", greedy), ("sampled", sampled)):
            off, on = measure(engine, batch, settings, args.top, args.rounds)
            ops = ops_seconds(batch, config.vocab_size, settings, args.top, engine.device)
            print(f"| {batch} | {name} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off:.3f} | {on / off - 1:+.1%} "
                  f"| {ops * 1e3:.2f} | {ops / off:.1%} |", flush=True)
    print(f"\nmachine at the end: {machine()}")


if __name__ == "__main__":
    main()
