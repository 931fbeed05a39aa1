"""chatapp's Engine vs transformers' `generate`: greedy decoding with the same random weights, routing off.

Both sides run in this process on the same checkpoint (saved once, loaded by `transformers.Qwen2ForCausalLM` and
by `chatapp.stt.STTForCausalLM`). Shapes follow nanochat's infer_bench at a CPU-friendly size: 128-token prompts,
128 new tokens, batch 1 and 8. Reported: time to first token (TTFT), new tokens per second over the whole call,
the ratio Engine / transformers (default dynamic cache, and the static cache), and whether the greedy tokens are
identical. The GPU section (skipped without CUDA) uses a Qwen2.5-0.5B-shaped random bf16 model and compares the
Engine's decode step with the memory-bandwidth floor (weights + KV cache read once per step).

Run: .venv/bin/python benchmarks/engine_vs_transformers.py [--repeats N] [--threads N] [--clock wall|process]
     [--gpu-only | --cpu-only]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from _formats import NoStopFormat
from transformers import Qwen2Config, Qwen2ForCausalLM

from chatapp.engine.engine import Engine
from chatapp.recipes.tiny.tokenizer import train_bpe_tokenizer
from chatapp.settings import GenerationSettings
from chatapp.stt import STTForCausalLM

PROMPT_TOKENS = 128
NEW_TOKENS = 128

CPU_SHAPE = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
# Qwen2.5-0.5B's shape (random weights).
GPU_SHAPE = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


@dataclass
class Timing:
    ttft: float  # seconds to the first new token
    total: float  # seconds for the whole call
    tokens: list[list[int]]

    def rate(self, batch: int) -> float:
        return batch * NEW_TOKENS / self.total


CLOCK: Callable[[], float] = time.perf_counter


def use_clock(name: str) -> None:
    """`wall` (perf_counter) or `process` (this process's CPU time). On a CPU shared with other jobs the wall
    clock mostly measures the other jobs; with one torch thread, process time is the time the run computed."""
    global CLOCK
    CLOCK = time.process_time if name == "process" else time.perf_counter


def best_of(repeats: int, run: Callable[[], Timing]) -> Timing:
    runs = [run() for _ in range(repeats)]
    return Timing(min(r.ttft for r in runs), min(r.total for r in runs), runs[0].tokens)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_engine(engine: Engine, prompts: list[list[int]], device: torch.device) -> Timing:
    settings = GenerationSettings(max_tokens=NEW_TOKENS, routing="off")
    rows: list[list[int]] = [[] for _ in prompts]
    synchronize(device)
    start = CLOCK()
    ttft = None
    for step in engine.generate(prompts, settings):
        if ttft is None:
            ttft = CLOCK() - start
        for event in step.tokens:
            rows[event.row].append(event.token)
    return Timing(ttft or 0.0, CLOCK() - start, rows)


def time_transformers(model: Qwen2ForCausalLM, prompts: list[list[int]], cache: str | None) -> Timing:
    ids = torch.tensor(prompts, device=model.device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    if cache is not None:
        kwargs["cache_implementation"] = cache
    synchronize(model.device)
    start = CLOCK()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    synchronize(model.device)
    ttft = CLOCK() - start
    start = CLOCK()
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **kwargs)
    synchronize(model.device)
    return Timing(ttft, CLOCK() - start, out[:, ids.shape[1] :].tolist())


def build(shape: dict, device: torch.device, dtype: torch.dtype, workdir: Path):
    torch.manual_seed(0)
    config = Qwen2Config(**shape)
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(workdir)
    reference = Qwen2ForCausalLM.from_pretrained(workdir, dtype=dtype).to(device).eval()
    reference.generation_config.eos_token_id = None
    model = STTForCausalLM.from_pretrained(workdir, device=device, dtype=dtype).eval()
    tokenizer = train_bpe_tokenizer(["chatapp benchmark text " * 50], vocab_size=300)
    return reference, Engine(model, tokenizer, NoStopFormat(tokenizer))


def compare(title: str, shape: dict, device: torch.device, dtype: torch.dtype, repeats: int) -> list[str]:
    lines = [f"### {title}", ""]
    lines.append("| batch | side | TTFT ms | tokens/s | engine speed-up | greedy tokens equal |")
    lines.append("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        reference, engine = build(shape, device, dtype, Path(tmp))
        generator = torch.Generator().manual_seed(1)
        for batch in (1, 8):
            prompts = torch.randint(3, shape["vocab_size"], (batch, PROMPT_TOKENS), generator=generator).tolist()
            time_engine(engine, prompts, device)  # warm-up
            ours = best_of(repeats, lambda prompts=prompts: time_engine(engine, prompts, device))
            lines.append(f"| {batch} | chatapp Engine | {ours.ttft * 1e3:.1f} | {ours.rate(batch):.0f} | | |")
            for cache in (None, "static"):
                time_transformers(reference, prompts, cache)  # warm-up (and compile the static cache's shapes)
                theirs = best_of(repeats, lambda p=prompts, c=cache: time_transformers(reference, p, c))
                equal = "yes" if theirs.tokens == ours.tokens else "NO"
                label = f"transformers ({cache or 'dynamic'} cache)"
                ratio = ours.rate(batch) / theirs.rate(batch)
                lines.append(
                    f"| {batch} | {label} | {theirs.ttft * 1e3:.1f} | {theirs.rate(batch):.0f} | {ratio:.2f}x | {equal} |"
                )
        if device.type == "cuda":
            lines += ["", *bandwidth_floor(engine, shape, dtype, device)]
    return lines


def bandwidth_floor(engine: Engine, shape: dict, dtype: torch.dtype, device: torch.device) -> list[str]:
    """The Engine's batch-1 decode step vs the time to read every weight and the KV cache once."""
    scratch = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    copy = torch.empty_like(scratch)
    copy.copy_(scratch)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(20):
        copy.copy_(scratch)
    synchronize(device)
    bandwidth = 2 * scratch.numel() * 20 / (time.perf_counter() - start)  # read + write bytes per second
    del scratch, copy
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    layers, kv_heads = shape["num_hidden_layers"], shape["num_key_value_heads"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    context = PROMPT_TOKENS + NEW_TOKENS // 2
    kv = 2 * layers * kv_heads * head_dim * context * torch.finfo(dtype).bits // 8
    floor = (weights + kv) / bandwidth
    timing = time_engine(engine, [[5] * PROMPT_TOKENS], device)
    step = (timing.total - timing.ttft) / (NEW_TOKENS - 1)
    return [
        f"Decode step at batch 1: {step * 1e6:.0f} µs; memory-bandwidth floor {floor * 1e6:.0f} µs "
        f"({(weights + kv) / 1e6:.0f} MB at a measured {bandwidth / 1e9:.0f} GB/s copy bandwidth): "
        f"{floor / step:.0%} of the floor."
    ]


class ToolCallingModel:
    """Wraps a model so every row writes a calculator call every `every` positions, the rest being the model's own
    tokens: a tool-heavy workload where fast-forward has output blocks to push. The script depends on the absolute
    position only (never on the device row, which compaction changes); prompts of different lengths give the rows
    different phases."""

    def __init__(self, model: STTForCausalLM, call: list[int], every: int = 24) -> None:
        self._model, self._call, self._every = model, call, every

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def extend(self, ids: torch.Tensor, lengths: torch.Tensor, cache, **kwargs):
        out = self._model.extend(ids, lengths, cache, **kwargs)
        for row, position in enumerate(cache.seen.tolist()):
            offset = (position - PROMPT_TOKENS) % self._every
            if position >= PROMPT_TOKENS and offset < len(self._call):
                out.logits[row] = float("-inf")
                out.logits[row, self._call[offset]] = 0.0
        return out

    def decode(self, ids: torch.Tensor, cache, **kwargs):
        return self.extend(ids[:, None], torch.ones_like(ids), cache, **kwargs)


def fast_forward_section(device: torch.device, dtype: torch.dtype, shape: dict, repeats: int) -> list[str]:
    """Tool-heavy generation with forced tokens fed one per step ("off"), always fast-forwarded ("always") and
    under the engine's default policy ("auto"): time, calls, and the tokens (which must be identical)."""
    from chatapp.chat import ChatFormat

    lines = [f"### Fast-forward on {device.type}: tool output pushed in one forward vs one token per step", ""]
    lines += ["| batch | fast-forward | tokens/s (all tokens) | forced % | model calls | speed-up | tokens equal |"]
    lines += ["|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        reference, plain = build(shape, device, dtype, Path(tmp))
        del reference
        tokenizer = train_bpe_tokenizer(["What is 1234*5678? " * 50], vocab_size=300)
        chat = ChatFormat(tokenizer)
        chat.stop_token_ids = ()
        call = [chat.python_start_id, *chat.encode_text("1234*5678"), chat.python_end_id]
        model = ToolCallingModel(plain.model, call)
        engines = {
            "off": Engine(model, tokenizer, chat),
            "always": Engine(model, tokenizer, chat, fast_forward="always"),
        }
        engines["auto"] = Engine(model, tokenizer, chat)
        generator = torch.Generator().manual_seed(2)
        for batch in (1, 8):
            ids = torch.randint(3, shape["vocab_size"], (batch, PROMPT_TOKENS + 5 * batch), generator=generator)
            prompts = [ids[row, : PROMPT_TOKENS + 5 * row].tolist() for row in range(batch)]
            results = {}
            for mode, engine in engines.items():
                settings = GenerationSettings(max_tokens=NEW_TOKENS, routing="off", fast_forward=mode != "off")

                def run(engine=engine, prompts=prompts, settings=settings):
                    synchronize(device)
                    start = CLOCK()
                    steps = list(engine.generate(prompts, settings))
                    return CLOCK() - start, steps

                run()  # warm-up
                seconds, steps = min((run() for _ in range(repeats)), key=lambda r: r[0])
                events = [e for s in steps for e in s.tokens]
                tokens = sorted(((e.row, e.token, e.forced) for e in events), key=lambda t: t[0])
                results[mode] = (seconds, tokens, len(steps), sum(e.forced for e in events) / len(events))
            base = results["off"]
            for mode, (seconds, tokens, calls, forced) in results.items():
                speedup = f"{base[0] / seconds:.2f}x" if mode != "off" else ""
                equal = ("yes" if tokens == base[1] else "NO") if mode != "off" else ""
                lines.append(
                    f"| {batch} | {mode} | {len(tokens) / seconds:.0f} | {forced:.0%} | {calls} | {speedup} | {equal} |"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall", help="see use_clock()")
    parser.add_argument("--cpu-only", action="store_true")
    parser.add_argument("--gpu-only", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    use_clock(args.clock)
    lines: list[str] = []
    if not args.gpu_only:
        shape = ", ".join(f"{k}={v}" for k, v in CPU_SHAPE.items() if k != "max_position_embeddings")
        title = f"CPU float32, {torch.get_num_threads()} thread(s), {args.clock} clock ({shape})"
        lines += compare(title, CPU_SHAPE, torch.device("cpu"), torch.float32, args.repeats)
    if not args.gpu_only:
        lines += ["", *fast_forward_section(torch.device("cpu"), torch.float32, CPU_SHAPE, args.repeats)]
    if not args.cpu_only:
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            cuda = torch.device("cuda")
            lines += [
                "",
                *compare(f"GPU {name}, bf16, Qwen2.5-0.5B shape", GPU_SHAPE, cuda, torch.bfloat16, args.repeats),
            ]
            lines += ["", *fast_forward_section(cuda, torch.bfloat16, GPU_SHAPE, args.repeats)]
        else:
            lines += ["", "GPU section skipped: CUDA is not available."]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
