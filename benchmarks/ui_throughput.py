"""Tokens/s of one greedy answer through the chat TUI (headless) versus the bare engine.

Both sides run in this process on the same model: the embedded default model when it has been trained, else a
random STT model (hidden 256, 6 layers, layers 1/3/5 routed) saved to a temporary directory with a locally trained
tokenizer. The engine side iterates `ChatSession.send` directly; the TUI side is `ChatApp` run headless
(`run_test`) with the real `EngineBackend`: a thread worker iterating the same session, batches posted ~30 times a
second, every batch saved to SQLite and drawn (transcript spans, heatmap, stats). Timed from the call that starts
the turn to the last token consumed (engine) or drawn (TUI). Each side runs `--repeats` times, interleaved, after a
warm-up; the best run of each is reported (on a shared machine the minimum is the least disturbed measurement, as
`timeit` argues), with the median beside it. The goal: the TUI keeps >= 90% of the engine's tokens/s.

Torch runs single-threaded by default on both sides (`--threads`): on a small shared CPU, spinning intra-op workers
only add noise, and it leaves the TUI's own thread a core, as on any machine with more cores than torch uses.

Run: .venv/bin/python benchmarks/ui_throughput.py [--repeats N] [--max-tokens N] [--threads N] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from chatapp.engine.engine import Engine
from chatapp.models.loader import load_model
from chatapp.settings import GenerationSettings, default_model_dir
from chatapp.ui.app import ChatApp
from chatapp.ui.backend import EngineBackend
from chatapp.ui.history import HistoryStore

PROMPT = "Tell me about Paris, the capital of France, and what 37*45 is."

TEXT = (
    "Hello! How are you today? I am fine, thank you. What is 37*45? Let me use the calculator. "
    "How many r are in strawberry? The word strawberry has 3 r letters. Paris is the capital of France. "
    "The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 12.5 100 1024 -7 3.14159. "
)


def random_model_dir(directory: Path) -> Path:
    """A random STT checkpoint with routers spread so that some tokens skip some layers."""
    from chatapp.models.tokenizer import train_bpe_tokenizer
    from chatapp.stt import STTConfig, STTForCausalLM

    tokenizer = train_bpe_tokenizer([TEXT] * 50, vocab_size=1024)
    torch.manual_seed(0)
    config = STTConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        routing_trained=True,
    )
    model = STTForCausalLM(config).eval()
    with torch.no_grad():
        for index in model.stt_layer_indices:
            router = model.model.layers[index].causal_router
            router.up.weight.normal_(std=0.5)
            router.out.weight.normal_(std=0.5)
            router.out.bias.zero_()
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def engine_run(engine: Engine, settings: GenerationSettings) -> tuple[list[int], float]:
    """One turn through a bare chat session: (tokens, seconds)."""
    session = engine.session()
    started = time.perf_counter()
    tokens = [event.token for step in session.send(PROMPT, settings) for event in step.tokens]
    return tokens, time.perf_counter() - started


async def tui_run(engine: Engine, model_dir: Path, settings: GenerationSettings, db: Path) -> tuple[list[int], float]:
    """One turn through the headless TUI: (tokens drawn, seconds from the turn's start to the last batch drawn)."""
    backend = EngineBackend(engine, model_dir=model_dir)
    backend.configure(settings, None)
    app = ChatApp(backend, HistoryStore(db), cursor_blink=False)
    async with app.run_test(size=(120, 36)):
        started = time.perf_counter()
        app.send(PROMPT)
        while app.is_generating:  # a plain sleep: Pilot.pause would also make the app's loop wait for idle
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
        tokens = [event.token for event in app.transcript.answers()[-1].events]
    return tokens, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on both sides")
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: embedded, else random)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_dir = args.model
        if model_dir is None:
            model_dir = default_model_dir() if (default_model_dir() / "config.json").is_file() else None
        source = "embedded default model" if model_dir == default_model_dir() else str(model_dir)
        if model_dir is None:
            model_dir = random_model_dir(tmp_path / "model")
            source = "random STT model (hidden 256, 6 layers, 3 STT)"
        loaded = load_model(model_dir, device="cpu")
        engine = Engine(loaded.model, loaded.tokenizer, loaded.chat_format)
        settings = GenerationSettings(max_tokens=args.max_tokens)

        engine_run(engine, settings)  # warm-up (allocator, kernels)
        asyncio.run(tui_run(engine, model_dir, settings, tmp_path / "warm.sqlite3"))
        engine_results, tui_results = [], []
        for i in range(args.repeats):  # interleaved, so machine load affects both sides alike
            engine_results.append(engine_run(engine, settings))
            tui_results.append(asyncio.run(tui_run(engine, model_dir, settings, tmp_path / f"h{i}.sqlite3")))

    engine_tokens = engine_results[0][0]
    same = all(tokens == engine_tokens for tokens, _ in engine_results + tui_results)
    rows = []
    for name, results in (("bare engine (ChatSession)", engine_results), ("TUI, headless (ChatApp)", tui_results)):
        count = len(results[0][0])
        best = min(s for _, s in results)
        median = statistics.median(s for _, s in results)
        rows.append((name, count, best, count / best, count / median))
    print(f"model: {source}; device cpu, {torch.get_num_threads()} threads; greedy, max_tokens {args.max_tokens}")
    print(f"{args.repeats} runs per side; identical tokens on both sides: {same}\n")
    print("| side | tokens | best s | tokens/s (best) | tokens/s (median) | vs engine (best) | vs engine (median) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, count, best, rate, median_rate in rows:
        print(
            f"| {name} | {count} | {best:.3f} | {rate:.1f} | {median_rate:.1f} "
            f"| {rate / rows[0][3]:.0%} | {median_rate / rows[0][4]:.0%} |"
        )


if __name__ == "__main__":
    main()
