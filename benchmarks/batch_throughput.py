"""Batch generation throughput: the same JSONL prompts through `chatapp batch` batched and one at a time.

Both sides call the batch runner in-process with the same model, prompts and settings; only `--batch-size`
differs (32 versus 1). It also checks that both sides wrote the same records (timings aside): batching must change
the speed, never the output.

    .venv/bin/python benchmarks/batch_throughput.py [--prompts 256] [--max-tokens 32] [--batch-size 32]

The embedded default model is used when it is present; otherwise a random model of the same shape (its build
recipe) with a locally trained tokenizer: the numbers then measure the machinery, not the answers.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from chatapp.batch.command import ModelPreparer
from chatapp.batch.requests import BatchDefaults
from chatapp.batch.runner import BatchOptions, run_batch
from chatapp.engine.engine import Engine
from chatapp.models import default_model_dir, load_engine
from chatapp.settings import GenerationSettings

TOPICS = ["the sea", "prime numbers", "Paris", "a red fox", "rain", "the moon", "chess", "bread"]


class CountingSink:
    """Keeps the records (to compare the two sides) instead of writing them anywhere."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def _random_model_dir(directory: Path) -> Path:
    """A random model with the default model's exact shape (its build recipe) and a locally trained tokenizer."""
    from chatapp.recipes.tiny.build import Recipe, build_config
    from chatapp.recipes.tiny.tokenizer import train_bpe_tokenizer
    from chatapp.stt import STTForCausalLM

    text = " ".join(
        f"Tell me about {t}. What is {a}*{b}? It is {a * b}." for t in TOPICS for a in range(12) for b in range(9)
    )
    tokenizer = train_bpe_tokenizer([text] * 4, vocab_size=Recipe().vocab_size)
    torch.manual_seed(0)
    model = STTForCausalLM(build_config(Recipe(), tokenizer.get_vocab_size())).eval()
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def _prompt_lines(count: int) -> list[str]:
    lines = []
    for i in range(count):
        prompt = f"Tell me about {TOPICS[i % len(TOPICS)]}." if i % 2 else f"What is {i % 13}*{i % 7 + 3}?"
        lines.append(json.dumps({"id": i, "prompt": prompt, "seed": i}))
    return lines


def _run(engine: Engine, lines: list[str], defaults: BatchDefaults, batch_size: int) -> tuple[float, CountingSink]:
    sink = CountingSink()
    preparer = ModelPreparer(engine)
    started = time.perf_counter()
    summary = run_batch(engine, preparer, lines, defaults, sink, options=BatchOptions(batch_size=batch_size))
    seconds = time.perf_counter() - started
    if summary.lines_failed:
        raise SystemExit(f"{summary.lines_failed} lines failed at batch size {batch_size}")
    return seconds, sink


def _interleaved(
    engine: Engine, sides: list[tuple[list[str], int]], defaults: BatchDefaults, rounds: int
) -> list[tuple[float, list[dict[str, Any]]]]:
    """Run each side's lines in `rounds` slices, alternating sides, and total each side's time and records.

    On a shared machine the load drifts over minutes; alternating short slices gives both sides the same
    conditions. A slice of the batched side is a whole number of device batches, so the chunking is unchanged.
    """
    totals: list[tuple[float, list[dict[str, Any]]]] = [(0.0, []) for _ in sides]
    for round_index in range(rounds):
        for side, (lines, batch_size) in enumerate(sides):
            per_round = -(-len(lines) // rounds)
            part = lines[round_index * per_round : (round_index + 1) * per_round]
            if part:
                seconds, sink = _run(engine, part, defaults, batch_size)
                totals[side] = (totals[side][0] + seconds, totals[side][1] + sink.records)
    return totals


def _comparable(records: list[dict[str, Any]]) -> list[str]:
    return sorted(json.dumps({k: v for k, v in r.items() if k != "timings"}, sort_keys=True) for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument(
        "--single-prompts",
        type=int,
        default=None,
        help="run the one-at-a-time side on the first N prompts only (tokens/s is a rate; this saves minutes on a "
        "shared machine); default: all of them",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        if (default_model_dir() / "config.json").is_file():
            model_dir, model_name = None, "embedded default model"
        else:
            model_dir, model_name = _random_model_dir(Path(scratch)), "random model of the default's shape"
        engine = load_engine(model_dir)
    defaults = BatchDefaults(settings=GenerationSettings(temperature=args.temperature, max_tokens=args.max_tokens))
    lines = _prompt_lines(args.prompts)
    single_lines = lines[: args.single_prompts or len(lines)]
    _run(engine, lines[:4], defaults, 4)  # warm-up: first-call allocations and kernels

    rounds = max(1, len(lines) // args.batch_size)
    (batched_s, batched), (single_s, single) = _interleaved(
        engine, [(lines, args.batch_size), (single_lines, 1)], defaults, rounds
    )
    batched_tokens = sum(len(r["tokens"]) for r in batched)
    single_tokens = sum(len(r["tokens"]) for r in single)
    batched_rate, single_rate = batched_tokens / batched_s, single_tokens / single_s
    # The one-at-a-time records must equal the batched records of the same lines.
    single_ids = {r["id"] for r in single}
    same = _comparable([r for r in batched if r["id"] in single_ids]) == _comparable(single)

    params = sum(p.numel() for p in engine.model.parameters())
    print(f"model: {model_name}, {params / 1e6:.2f}M parameters, device {engine.device}")
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(f"max_tokens {args.max_tokens}, temperature {args.temperature}")
    print()
    print("| mode | batch size | prompts | tokens | seconds | tokens/s | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| one at a time | 1 | {len(single_lines)} | {single_tokens} | {single_s:.1f} | {single_rate:.1f} | 1.00x |")
    print(
        f"| batched | {args.batch_size} | {len(lines)} | {batched_tokens} | {batched_s:.1f} | {batched_rate:.1f} "
        f"| {batched_rate / single_rate:.2f}x |"
    )
    print()
    print(f"identical records for the same lines (timings aside): {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
