"""Batch generation throughput: the same JSONL prompts through `chatapp batch` batched and one at a time.

Every side calls the batch runner in-process with the same model, prompts and settings, in interleaved rounds (each
side once per round, the order turning, so all of them see the same machine load); the table reports medians:

- batched (`--batch-size`, 32 by default), the decode step as the app runs it (int8 on a CPU: the native C step,
  `chatapp.stt.cpu_step`);
- batched through the torch decode step instead (the model's `DecodeRuntime.native` off): what the C step gives at
  that batch size; left out, with a line saying so, when the model does not decode through the C step;
- batched with the device batch's prompts prefilled together, padded, one product per chunk (`batched_prefill`):
  how the loop prefilled before a prompt got its own row, when a row's numbers depended on its batch. The app's
  side against it is what batch invariance costs;
- one at a time (`--batch-size 1`), the app's step: generate's batch-1 rate, which the others are compared with;
- llama.cpp decoding the same chat prompts side by side in one context (greedy, no stop token, `--max-tokens`
  each), when `llama_cpp` (llama-cpp-python) is importable and the model is the default one (its GGUF is the
  file the default model is prepared from).

Each side's tokens/s counts the whole call (prefill, decode, the runner); its decode tokens/s counts the emitted
tokens over the decode steps' seconds only (`timings.decode_s` of the records: per device batch, its longest row's),
the target's figure (a batch of 32 decoding at >= 3x generate's batch-1 rate). The batched and one-at-a-time sides of
the app are compared record by record (timings aside): a row's numbers do not depend on its batch (each prompt is
prefilled in its own row, and every decode step of an int8 batch is the C step, which sums every row in the same
order whatever rows are beside it), so every record is identical.

    .venv/bin/python benchmarks/batch_throughput.py [--prompts 32] [--max-tokens 128] [--batch-size 32] [--rounds 3]
    .venv/bin/python benchmarks/batch_throughput.py --quick   # a smoke run: 8 prompts x 8 tokens at batch 4

The embedded default model is used when it is present; otherwise a random model of the same shape (its build
recipe) with a locally trained tokenizer: the numbers then measure the machinery, not the answers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _machine import machine
from _steps import Step

from chatapp.batch.command import ModelPreparer
from chatapp.batch.requests import BatchDefaults
from chatapp.batch.runner import BatchOptions, run_batch
from chatapp.engine.engine import Engine
from chatapp.models import default_model_dir, load_engine
from chatapp.settings import GenerationSettings

TOPICS = ["the sea", "prime numbers", "Paris", "a red fox", "rain", "the moon", "chess", "bread"]


class CountingSink:
    """Keeps the records (to compare the sides) instead of writing them anywhere."""

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


def _prompt(i: int, long: bool) -> str:
    topic = TOPICS[i % len(TOPICS)]
    if long:  # replies that run to the token limit: every row decodes `--max-tokens` tokens
        return f"Write a long story about {topic}." if i % 2 else f"Explain {topic} in great detail, step by step."
    return f"Tell me about {topic}." if i % 2 else f"What is {i % 13}*{i % 7 + 3}?"


def _prompt_lines(count: int, long: bool = False) -> list[str]:
    return [json.dumps({"id": i, "prompt": _prompt(i, long), "seed": i}) for i in range(count)]


# ------------------------------------------------------------------------------------------------------ sides
@dataclass(frozen=True)
class Timing:
    """One call of a side: its wall seconds and the tokens it emitted; the seconds of its decode steps and the
    tokens those emitted."""

    seconds: float
    tokens: int
    decode_seconds: float
    decode_tokens: int

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_rate(self) -> float:
        return self.decode_tokens / self.decode_seconds


@dataclass
class Side:
    name: str
    batch_size: int
    prompts: int
    run: Callable[[], tuple[Timing, list[dict[str, Any]] | None]]
    timings: list[Timing] = field(default_factory=list)
    records: list[list[dict[str, Any]]] = field(default_factory=list)  # per round (chatapp sides only)

    def median(self, measure: Callable[[Timing], float]) -> float:
        return statistics.median(measure(t) for t in self.timings)


def run_runner(
    engine: Engine, lines: list[str], defaults: BatchDefaults, batch_size: int, step: Step, prefill=nullcontext
):
    """One `chatapp batch` run of `lines` in-process, decoding with `step`, prefilling as `prefill()` has the loop
    do: its timing and records."""
    sink = CountingSink()
    with step.used_by(engine.model), prefill():
        started = time.perf_counter()
        summary = run_batch(
            engine, ModelPreparer(engine), lines, defaults, sink, options=BatchOptions(batch_size=batch_size)
        )
        seconds = time.perf_counter() - started
    if summary.lines_failed:
        raise SystemExit(f"{summary.lines_failed} lines failed at batch size {batch_size}")
    tokens = sum(len(r["tokens"]) for r in sink.records)
    # Every step of a row samples a token and feeds it: a row's decode steps emitted all its tokens.
    return Timing(seconds, tokens, _decode_seconds(sink.records, lines, batch_size), tokens), sink.records


def _decode_seconds(records: list[dict[str, Any]], lines: list[str], batch_size: int) -> float:
    """The seconds the decode steps of a run took: per device batch (the runner takes the lines in order,
    `batch_size` at a time), the decode time of its longest-running row, which was in every step."""
    batch_of = {json.loads(line)["id"]: index // batch_size for index, line in enumerate(lines)}
    longest: dict[int, float] = {}
    for record in records:
        batch = batch_of[record["id"]]
        longest[batch] = max(longest.get(batch, 0.0), record["timings"]["decode_s"])
    return sum(longest.values())


@contextmanager
def batched_prefill() -> Iterator[None]:
    """Inside the block the decode loop prefills a device batch's prompts together: right-padded, one product per
    chunk of the longest prompt (`PREFILL_TOKENS` split over the rows, at least 512 wide). A row's prefill then took
    the dense product or the int8 kernel by the whole batch's token count, so its numbers depended on its batch; the
    loop now prefills each prompt in its own row (`engine.loop.prefill_row`)."""
    from chatapp.engine import loop

    def prefill(self, prompt_ids, cache, routing, threshold):
        routing = loop.prompt_routing(self.model, routing)
        lengths = torch.tensor([len(ids) for ids in prompt_ids])
        longest = int(lengths.max())
        padded = torch.zeros(len(prompt_ids), longest, dtype=torch.long)
        for i, ids in enumerate(prompt_ids):
            padded[i, : len(ids)] = torch.tensor(ids)
        chunk = max(512, loop.PREFILL_TOKENS // len(prompt_ids))
        logits, probs, chosen = None, [], []
        for start in range(0, longest, chunk):
            width = min(chunk, longest - start)
            chunk_lengths = (lengths - start).clamp(0, width)
            out = self.model.extend(
                padded[:, start : start + width], chunk_lengths, cache, routing=routing, threshold=threshold
            )
            ends_here = (chunk_lengths > 0) & (lengths <= start + width)
            logits = out.logits if logits is None else torch.where(ends_here[:, None], out.logits, logits)
            probs.append(out.router_probs)
            chosen.append(out.selected)
        if routing == "off":
            return logits, None
        probs_host = torch.cat(probs, dim=2).permute(1, 2, 0).tolist()
        chosen_host = torch.cat(chosen, dim=2).permute(1, 2, 0).tolist()
        return logits, [
            [(tuple(probs_host[b][t]), tuple(chosen_host[b][t])) for t in range(len(ids))]
            for b, ids in enumerate(prompt_ids)
        ]

    original = loop.DecodeLoop._prefill
    loop.DecodeLoop._prefill = prefill
    try:
        yield
    finally:
        loop.DecodeLoop._prefill = original


def _comparable(records: list[dict[str, Any]]) -> list[str]:
    return sorted(json.dumps({k: v for k, v in r.items() if k != "timings"}, sort_keys=True) for r in records)


# -------------------------------------------------------------------------------------------------- llama.cpp
class LlamaBatched:
    """llama.cpp greedy-decoding rows side by side in one context, one sequence per row (llama.cpp's `batched`
    example), through llama-cpp-python's C API: its `Llama` class decodes one sequence at a time."""

    def __init__(self, gguf: Path, rows: int, longest_prompt: int, prompt_tokens: int, new_tokens: int, threads: int):
        """A context for `rows` sequences of up to `longest_prompt` + `new_tokens` tokens, whose prefill takes
        `prompt_tokens` tokens in one call."""
        import llama_cpp

        self.api = api = llama_cpp
        api.llama_backend_init()
        self.model = api.llama_model_load_from_file(str(gguf).encode(), api.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf}")
        params = api.llama_context_default_params()
        params.n_seq_max = rows
        params.n_ctx = rows * (longest_prompt + new_tokens + 1)  # each sequence's share of the cache holds a row
        params.n_batch = max(prompt_tokens, rows)  # the whole prefill in one `llama_decode`
        params.n_threads = params.n_threads_batch = threads
        self.context = api.llama_init_from_model(self.model, params)
        if not self.context:
            raise SystemExit(f"llama.cpp could not make a context of {params.n_ctx} tokens for {rows} rows")
        self.vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model))
        self.batch = api.llama_batch_init(params.n_batch, 0, 1)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> Timing:
        """Prefill every prompt in one call, then decode `new_tokens` greedy tokens a row, all rows a step."""
        api = self.api
        api.llama_memory_clear(api.llama_get_memory(self.context), True)
        started = time.perf_counter()
        tokens = self._decode(
            [(token, pos, row, pos == len(p) - 1) for row, p in enumerate(prompts) for pos, token in enumerate(p)],
            len(prompts),
        )
        first = time.perf_counter()
        for step in range(1, new_tokens):
            tokens = self._decode(
                [(token, len(prompts[row]) + step - 1, row, True) for row, token in enumerate(tokens)], len(prompts)
            )
        ended = time.perf_counter()
        # The first token comes from the prefill's logits: the decode steps emitted the others.
        rows = len(prompts)
        return Timing(ended - started, rows * new_tokens, ended - first, rows * (new_tokens - 1))

    def _decode(self, items: list[tuple[int, int, int, bool]], rows: int) -> list[int]:
        """Feed (token, position, sequence, wants logits) items; the argmax of each row's logits, in row order."""
        batch = self.batch
        batch.n_tokens = len(items)
        for i, (token, pos, sequence, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = sequence
        if (status := self.api.llama_decode(self.context, batch)) != 0:
            raise SystemExit(f"llama_decode failed with status {status}")
        logits = np.ctypeslib.as_array(self.api.llama_get_logits(self.context), shape=(rows, self.vocab))
        return logits.argmax(axis=1).tolist()


def llama_side(engine: Engine, args, uses_default_model: bool) -> Side | None:
    """llama.cpp's batched side, or None with the reason printed."""
    if importlib.util.find_spec("llama_cpp") is None:
        print(
            "llama.cpp row left out: llama-cpp-python is not installed (it builds from source, ~10 min: "
            'CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install llama-cpp-python)'
        )
        return None
    if not uses_default_model:
        print("llama.cpp row left out: its GGUF is the default model's, and this run uses a random model")
        return None
    from chatapp.models.smollm2 import gguf_path

    chat = engine.chat_format
    prompts = [
        list(chat.render_for_completion([{"role": "user", "content": _prompt(i, args.long)}]))
        for i in range(args.prompts)
    ]
    batches = [prompts[start : start + args.batch_size] for start in range(0, len(prompts), args.batch_size)]
    llama = LlamaBatched(
        gguf_path(),
        len(batches[0]),
        max(map(len, prompts)),
        max(sum(map(len, b)) for b in batches),
        args.max_tokens,
        torch.get_num_threads(),
    )

    def run() -> tuple[Timing, None]:
        parts = [llama.generate(batch, args.max_tokens) for batch in batches]
        fields = ("seconds", "tokens", "decode_seconds", "decode_tokens")
        return Timing(*(sum(getattr(part, name) for part in parts) for name in fields)), None

    llama.generate(batches[0][:1], 2)  # warm-up
    return Side("llama.cpp, batched (greedy, no stop)", args.batch_size, len(prompts), run)


# ------------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=None, help="prompts a side runs (default 32; --quick 8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens a prompt (default 128; --quick 8)")
    parser.add_argument("--batch-size", type=int, default=None, help="rows a device batch (default 32; --quick 4)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick 1)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--dtype", default="int8", help="weight format (default int8, the C step's; auto: the app's)")
    parser.add_argument(
        "--single-prompts",
        type=int,
        default=None,
        help="run the one-at-a-time side on the first N prompts only (tokens/s is a rate; this saves minutes on a "
        "shared machine); default: all of them",
    )
    parser.add_argument("--quick", action="store_true", help="smoke-run sizes for the options not given")
    parser.add_argument(
        "--long",
        action="store_true",
        help="prompts whose replies run to --max-tokens (stories, explanations), so every row of a batch decodes to "
        "the end; default: a mix of questions and chat whose replies end when the model stops",
    )
    args = parser.parse_args()
    for name, full, quick in (("prompts", 32, 8), ("max_tokens", 128, 8), ("batch_size", 32, 4), ("rounds", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)

    with tempfile.TemporaryDirectory() as scratch:
        uses_default_model = (default_model_dir() / "config.json").is_file()
        if uses_default_model:
            model_dir, model_name = None, "embedded default model"
        else:
            model_dir, model_name = _random_model_dir(Path(scratch)), "random model of the default's shape"
        engine = load_engine(model_dir, dtype=args.dtype)
    runtime = engine.model.runtime
    note = runtime.note
    # The step as loaded (int8 on a CPU: the C step), and the torch step the model would run without it.
    app, torch_step = Step(runtime.native, runtime.compiled), Step(None, runtime.compiled)
    defaults = BatchDefaults(settings=GenerationSettings(temperature=args.temperature, max_tokens=args.max_tokens))
    lines = _prompt_lines(args.prompts, args.long)
    single_lines = lines[: args.single_prompts or len(lines)]
    run_runner(engine, lines[:4], defaults, 4, app)  # warm-up: first-call allocations and kernels

    def runner_side(name: str, side_lines: list[str], batch_size: int, step: Step, prefill=nullcontext) -> Side:
        return Side(
            name,
            batch_size,
            len(side_lines),
            lambda: run_runner(engine, side_lines, defaults, batch_size, step, prefill),
        )

    app_name = "C step" if app.native is not None else "torch step"
    batched = runner_side(f"batched, {app_name}", lines, args.batch_size, app)
    together = runner_side(
        f"batched, {app_name}, prompts prefilled together (not invariant)", lines, args.batch_size, app, batched_prefill
    )
    single = runner_side(f"one at a time, {app_name}", single_lines, 1, app)
    sides = [batched, together, single]
    if app.native is not None:
        run_runner(engine, lines[:4], defaults, 4, torch_step)  # warm-up of the torch step
        sides.insert(1, runner_side("batched, torch step", lines, args.batch_size, torch_step))
    else:
        print(f"torch-step row left out: this model decodes through the torch step already ({note})")
    if (llama := llama_side(engine, args, uses_default_model)) is not None:
        sides.append(llama)

    for round_ in range(args.rounds):
        turn = round_ % len(sides)
        for side in sides[turn:] + sides[:turn]:
            timing, records = side.run()
            side.timings.append(timing)
            if records is not None:
                side.records.append(records)
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)

    # The one-at-a-time records must equal the batched records of the same lines, in every round.
    single_ids = {json.loads(line)["id"] for line in single_lines}
    pairs = [
        (_comparable([r for r in b if r["id"] in single_ids]), _comparable(s))
        for b, s in zip(batched.records, single.records, strict=True)
    ]
    same = sum(len(set(b) & set(s)) for b, s in pairs)
    compared = sum(len(s) for _, s in pairs)
    base_rate, base_decode = single.median(lambda t: t.rate), single.median(lambda t: t.decode_rate)

    config = engine.model.config
    print(
        f"model: {model_name} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, vocabulary "
        f"{config.vocab_size}), {args.dtype}, device {engine.device}; {note}"
    )
    print(f"machine: {machine()}")
    print(
        f"{args.prompts} {'long-reply ' if args.long else ''}prompts, max_tokens {args.max_tokens}, temperature "
        f"{args.temperature}, median of "
        f"{args.rounds} interleaved rounds"
    )
    print()
    print(
        "| side | batch size | prompts | tokens | seconds | tokens/s | vs one at a time | decode tokens/s "
        "| vs one at a time |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for side in sides:
        rate, decode = side.median(lambda t: t.rate), side.median(lambda t: t.decode_rate)
        tokens, seconds = side.median(lambda t: t.tokens), side.median(lambda t: t.seconds)
        print(
            f"| {side.name} | {side.batch_size} | {side.prompts} | {tokens:.0f} | {seconds:.1f} | {rate:.1f} "
            f"| {rate / base_rate:.2f}x | {decode:.1f} | {decode / base_decode:.2f}x |"
        )
    print()
    cost = batched.median(lambda t: t.rate) / together.median(lambda t: t.rate)
    print(f"batch invariance (each prompt prefilled in its own row): {cost:.3f}x the throughput of prefilling together")
    print(f"identical records, {batched.name} vs {single.name} (timings aside): {same} of {compared}")


if __name__ == "__main__":
    main()
