"""Batch generation throughput: the same JSONL prompts through `chatapp generate` batched and one at a time.

Both sides call the batch runner in-process with the same model, prompts and settings; only `--batch-size`
differs (32 versus 1). It also checks that both sides wrote the same records (timings aside): batching must change
the speed, never the output.

    .venv/bin/python benchmarks/batch_throughput.py [--prompts 256] [--max-tokens 32] [--batch-size 32]

The embedded default model is used when it is present; otherwise a random model of a similar small shape with a
locally trained tokenizer (numbers then measure the machinery, not the answers).
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
from chatapp.models.loader import load_model
from chatapp.settings import GenerationSettings, default_model_dir

# Used only when the default model is missing: roughly the size of a small chat model for a CPU.
FALLBACK_SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
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
    from chatapp.models.tokenizer import train_bpe_tokenizer
    from chatapp.stt import STTConfig, STTForCausalLM

    text = " ".join(
        f"Tell me about {t}. What is {a}*{b}? It is {a * b}." for t in TOPICS for a in range(12) for b in range(9)
    )
    tokenizer = train_bpe_tokenizer([text] * 4, vocab_size=2048)
    torch.manual_seed(0)
    model = STTForCausalLM(STTConfig(vocab_size=tokenizer.get_vocab_size(), **FALLBACK_SHAPE)).eval()
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


def _comparable(records: list[dict[str, Any]]) -> list[str]:
    return sorted(json.dumps({k: v for k, v in r.items() if k != "timings"}, sort_keys=True) for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        if (default_model_dir() / "config.json").is_file():
            model_dir, model_name = None, "embedded default model"
        else:
            model_dir, model_name = _random_model_dir(Path(scratch)), "random model (default model missing)"
        loaded = load_model(model_dir)
    engine = Engine(loaded.model, loaded.tokenizer, loaded.chat_format)
    defaults = BatchDefaults(settings=GenerationSettings(temperature=args.temperature, max_tokens=args.max_tokens))
    lines = _prompt_lines(args.prompts)
    _run(engine, lines[:4], defaults, 4)  # warm-up: first-call allocations and kernels

    batched_s, batched = _run(engine, lines, defaults, args.batch_size)
    single_s, single = _run(engine, lines, defaults, 1)
    tokens = sum(len(r["tokens"]) for r in batched.records)
    same = _comparable(batched.records) == _comparable(single.records)

    params = sum(p.numel() for p in loaded.model.parameters())
    print(f"model: {model_name}, {params / 1e6:.1f}M parameters, device {engine.device}")
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(f"{args.prompts} prompts, max_tokens {args.max_tokens}, temperature {args.temperature}, {tokens} tokens")
    print()
    print("| mode | batch size | seconds | tokens/s | speed-up |")
    print("|---|---:|---:|---:|---:|")
    print(f"| one at a time | 1 | {single_s:.2f} | {tokens / single_s:.1f} | 1.00x |")
    print(f"| batched | {args.batch_size} | {batched_s:.2f} | {tokens / batched_s:.1f} | {single_s / batched_s:.2f}x |")
    print()
    print(f"identical records (timings aside): {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
