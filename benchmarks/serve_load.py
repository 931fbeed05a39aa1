"""`chatapp serve` under load: 1, 4, 16 and 32 concurrent streaming clients against one server, beside the same
requests one after another (to the same server), beside `chatapp batch` of the same prompts and beside `chatapp
generate` one at a time, both from the shell (a fresh process each, model load included: what a user without a
server pays).

The server runs as its own process (`chatapp serve`, the default model), so its engine loop does not share this
process's interpreter with the clients; each client is a thread streaming `/v1/chat/completions` through the
project's own light client (`chatapp.serve.client`). Greedy requests, so every side answers the same text: every
reply is checked against `chatapp batch`'s, byte for byte. Sides run interleaved in rounds (the order
turning), so a shared machine's load falls on all of them alike. Reported per side: wall seconds, aggregate
completion tokens/s, time to first token (p50, p99 over requests) and inter-token latency (p50, p99 over every gap
between two content chunks of a reply). Then the soak: 32 clients x 5 requests each, every reply complete.

    .venv/bin/python benchmarks/serve_load.py [--max-tokens 48] [--rounds 1] [--cold 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from _machine import machine

from chatapp.serve.client import stream_chat

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["the sea", "prime numbers", "Paris", "a red fox", "rain", "the moon", "chess", "bread"]
FORMS = ["Write a short story about {}.", "Explain {} to a child.", "Tell me three facts about {}.", "Describe {}."]
CLIENTS = (1, 4, 16, 32)


def prompts(count: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(TOPICS[i // len(FORMS) % len(TOPICS)]) + f" ({i})" for i in range(count)]


@dataclass
class Reply:
    text: str
    tokens: int
    ttft: float
    gaps: list[float]
    finished: bool


@dataclass
class Run:
    seconds: float
    replies: list[Reply] = field(default_factory=list)
    generating: float | None = None  # of `seconds`, the generation's own (a command's start and model load aside)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.replies)


def ask(url: str, prompt: str, max_tokens: int) -> Reply:
    """One streamed greedy request: its text, completion tokens, time to first token and the gaps between chunks."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    text, tokens, finished = "", 0, False
    times: list[float] = []
    for chunk in stream_chat(url, body):
        for choice in chunk["choices"]:
            if choice["delta"].get("content"):
                times.append(time.perf_counter())
                text += choice["delta"]["content"]
            finished = finished or choice["finish_reason"] is not None
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    ttft = (times[0] if times else time.perf_counter()) - sent
    return Reply(text, tokens, ttft, [b - a for a, b in itertools.pairwise(times)], finished)


def concurrent(url: str, batch: list[str], max_tokens: int, per_client: int = 1) -> Run:
    """`len(batch)` clients at once, each asking its prompt `per_client` times in a row."""
    started = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        groups = list(pool.map(lambda p: [ask(url, p, max_tokens) for _ in range(per_client)], batch))
    return Run(time.perf_counter() - started, [r for group in groups for r in group])


def sequential(url: str, batch: list[str], max_tokens: int) -> Run:
    started = time.perf_counter()
    replies = [ask(url, p, max_tokens) for p in batch]
    return Run(time.perf_counter() - started, replies)


def cold_generate(batch: list[str], max_tokens: int) -> Run:
    """`chatapp generate` one prompt a process, as a user without a server runs it."""
    started = time.perf_counter()
    replies = []
    for prompt in batch:
        began = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "chatapp", "generate", prompt, "--max-tokens", str(max_tokens)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        replies.append(Reply(done.stdout, 0, time.perf_counter() - began, [], True))
    return Run(time.perf_counter() - started, replies)


def client_start(url: str, rounds: int) -> tuple[list[float], list[float]]:
    """Wall seconds of `chatapp --help` and of `chatapp generate --server URL "Hi" --max-tokens 1`, interleaved."""
    help_times, remote_times = [], []
    for _ in range(rounds):
        for command, times in (
            (["--help"], help_times),
            (["generate", "--server", url, "Hi", "--max-tokens", "1"], remote_times),
        ):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "chatapp", *command], cwd=ROOT, capture_output=True, check=True)
            times.append(time.perf_counter() - started)
    return help_times, remote_times


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_server(port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "chatapp", "serve", "--port", str(port), "--max-rows", "32", "--max-queue", "256"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cold", type=int, default=2, help="prompts for the cold `chatapp generate` side")
    parser.add_argument("--soak-tokens", type=int, default=24, help="max_tokens of the 32 x 5 soak's requests")
    parser.add_argument("--client-rounds", type=int, default=5, help="rounds of the client start-up comparison")
    parser.add_argument("--client-only", action="store_true", help="only the client start-up comparison")
    args = parser.parse_args()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = start_server(port)
    scratch = Path(tempfile.mkdtemp(prefix="serve_load-"))
    if args.client_only:
        try:
            help_times, remote_times = client_start(url, args.client_rounds)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
        print_client_start(help_times, remote_times)
        return
    try:
        everything = prompts(max(CLIENTS))
        # The reference: `chatapp batch`'s greedy text of every prompt (a reply does not depend on its batch).
        reference = batch_command(everything, args.max_tokens, scratch).replies
        expected = {p: r.text for p, r in zip(everything, reference, strict=True)}
        soak_reference = batch_command(everything, args.soak_tokens, scratch).replies
        soak_expected = {p: r.text for p, r in zip(everything, soak_reference, strict=True)}
        ask(url, "Hi", 4)  # warm-up

        sides: list[tuple[str, int, Callable[[], Run]]] = []
        for n in CLIENTS:
            batch = everything[:n]
            sides.append((f"serve, {n} concurrent clients", n, lambda b=batch: concurrent(url, b, args.max_tokens)))
            sides.append(
                (
                    f"`chatapp batch` of {n}, from the shell",
                    n,
                    lambda b=batch: batch_command(b, args.max_tokens, scratch),
                )
            )
        sides.append(("serve, 16 one after another", 16, lambda: sequential(url, everything[:16], args.max_tokens)))
        sides.append(
            (
                "`chatapp generate`, from the shell, one at a time",
                args.cold,
                lambda: cold_generate(everything[: args.cold], args.max_tokens),
            )
        )

        runs: dict[str, list[Run]] = {name: [] for name, _, _ in sides}
        for round_ in range(args.rounds):
            turn = round_ % len(sides)
            for name, _, run in sides[turn:] + sides[:turn]:
                runs[name].append(run())
                print(f"  {name}: {runs[name][-1].seconds:.1f} s", flush=True)
        wrong = [
            name
            for name, n, _ in sides
            for run in runs[name]
            for p, r in zip(everything[:n], run.replies, strict=True)
            if r.text != expected[p]
        ]

        help_times, remote_times = client_start(url, args.client_rounds)
        soak = concurrent(url, everything[:32], args.soak_tokens, per_client=5)
        soak_ok = sum(
            r.finished and r.text == soak_expected[p]
            for p, r in zip([p for p in everything[:32] for _ in range(5)], soak.replies, strict=True)
        )
    finally:
        server.send_signal(signal.SIGTERM)
        stopped = time.perf_counter()
        code = server.wait(timeout=30)
        stop_seconds = time.perf_counter() - stopped

    print(f"\nmachine: {machine()}")
    print(f"model: the default model, int8, CPU; greedy, max_tokens {args.max_tokens}, {args.rounds} round(s), median")
    print()
    print(
        "| side | requests | seconds | tokens | aggregate tok/s | TTFT p50 | TTFT p99 | inter-token p50 | inter-token p99 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, n, _ in sides:
        done = runs[name]
        seconds = statistics.median(r.seconds for r in done)
        tokens = statistics.median(r.tokens for r in done)
        ttft = [x.ttft for r in done for x in r.replies]
        gaps = [g for r in done for x in r.replies for g in x.gaps]
        rate = f"{tokens / seconds:.1f}" if tokens else "-"
        if done[0].generating is not None:  # the command's own generation time beside its wall time
            generating = statistics.median(r.generating for r in done)
            rate += f" ({tokens / generating:.1f} generating, {generating:.1f} s)"
        print(
            f"| {name} | {n} | {seconds:.1f} | {tokens:.0f} | {rate} | {percentile(ttft, 0.5):.2f} s "
            f"| {percentile(ttft, 0.99):.2f} s | {fmt_ms(percentile(gaps, 0.5))} | {fmt_ms(percentile(gaps, 0.99))} |"
        )
    together = statistics.median(r.seconds for r in runs["serve, 16 concurrent clients"])
    apart = statistics.median(r.seconds for r in runs["serve, 16 one after another"])
    print()
    print(f"16 concurrent streamed requests vs the same 16 one after another: {apart / together:.2f}x faster")
    print(f"replies equal to `chatapp batch`'s greedy text: {'all' if not wrong else f'NOT {wrong}'}")
    print(
        f"soak, 32 clients x 5 requests (max_tokens {args.soak_tokens}): {soak_ok}/160 complete and correct in {soak.seconds:.1f} s"
    )
    print(f"SIGTERM: the server exited {code} in {stop_seconds:.2f} s")
    print_client_start(help_times, remote_times)


def print_client_start(help_times: list[float], remote_times: list[float]) -> None:
    help_median, remote_median = statistics.median(help_times), statistics.median(remote_times)
    print(
        f'`chatapp generate --server URL "Hi" --max-tokens 1`: {remote_median:.3f} s median against `chatapp --help` '
        f"{help_median:.3f} s ({remote_median - help_median:+.3f} s; {len(help_times)} interleaved rounds)"
    )


def batch_command(batch: list[str], max_tokens: int, scratch: Path) -> Run:
    """`chatapp batch` of the prompts from the shell (all of them in one device batch), model load included."""
    source, out = scratch / "in.jsonl", scratch / "out.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(batch)))
    out.unlink(missing_ok=True)
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "chatapp",
            "batch",
            str(source),
            "-o",
            str(out),
            "--ordered",
            "--temperature",
            "0",
            "--max-tokens",
            str(max_tokens),
            "--batch-size",
            "32",
        ],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    seconds = time.perf_counter() - started
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # One device batch: its prefill (every prompt's), then decode steps until its longest row ends.
    generating = max(r["timings"]["prefill_s"] for r in records) + max(r["timings"]["decode_s"] for r in records)
    return Run(seconds, [Reply(r["text"], len(r["tokens"]), float("nan"), [], True) for r in records], generating)


def fmt_ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.0f} ms"


if __name__ == "__main__":
    main()
