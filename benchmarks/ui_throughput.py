"""Tokens/s of the same greedy chat through the chat TUI versus the bare engine: headless, and in a real terminal.

`--terminal`: what a user sees. `chatapp run` in a tmux pane (160x48) is sent STORY, and the screen is read every
50 ms until the answer stops at its max tokens (256, the default; a new chat for each answer); `chatapp generate
STORY --verbose` answers the same prompt in its own process. Each round runs every side once (interleaved, so the
machine's load reaches them alike) after a warm-up round; the table gives medians:
- engine tokens/s: `generate`'s "eval rate", the TUI's stats panel (both: tokens over the seconds of the decode
  steps, measured in the process that decodes);
- on-screen tokens/s (TUI): the slope of the stats panel's token count over the times the screen showed it change,
  i.e. the rate the answer reached the terminal at;
- the CPU each of the TUI's processes used per second of streaming (/proc: the UI process, the engine process),
  in cores: the UI's share is what the engine's threads compete with on a small machine.
`--kernel-threads 1,2` adds a TUI side per count (`$CHATAPP_KERNEL_THREADS` in the engine process) beside the
engine process's default. The goal: the TUI's on-screen rate >= 85% of `generate`'s eval rate.

The headless sides (the default):

All sides run from this process on the same model and the same turns: the engine side iterates `ChatSession.send`
directly; the TUI sides are `ChatApp` run headless (`run_test`): a thread worker iterating the backend's stream,
batches handed to the UI ~30 times a second, every batch saved to SQLite and drawn (transcript, heatmap, zone
pills, stats). "TUI, engine process" is what `chatapp run` does (`ProcessBackend`: the engine and its session in a
spawned child, steps over a pipe); "TUI, in-process" is `chatapp run --in-process` (`EngineBackend`: the engine in
the UI's process, sharing its interpreter lock). Timed from the first turn's start to the last token consumed
(engine) or drawn (TUI); the TUI sides start the clock once the app has finished starting up.

Models: the embedded default model when it has been trained (its answers are short, so it answers several
questions in one conversation: every turn pays its own start-up, as in use), and a random STT model (hidden 256,
6 layers, layers 1/3/5 routed, saved to a temporary directory with a locally trained tokenizer), which never stops
early, for one long answer. `--model DIR` runs just that model directory.

Each side runs `--repeats` times, interleaved, after a warm-up, with garbage collected before each run; the best run
of each is reported (on a shared machine the minimum is the least disturbed measurement, as `timeit` argues), the
median beside it, and the UI thread's CPU time per TUI run (median). Besides the whole-run rate, each turn is split
into its wait for the first token (engine: first step out of the session; TUI: first batch drawn) and the stream
after it, whose rate ("streaming tokens/s": tokens after each turn's first over the time after it) is the speed a
reader sees text arrive at. The goal: the TUI keeps >= 90% of the engine's tokens/s.

The log-probability views are on, as in `chatapp run`: every side asks for `--logprobs` alternatives per token
(default 5, the TUI's own default; so the bare engine does the same device work and the ratio is the UI's cost),
the heatmap draws its surprise row and the stats their per-layer surprise, and the transcript colours tokens by
probability (`--no-colours` turns that off).

Torch runs single-threaded by default on both sides (`--threads`): on a small shared CPU, spinning intra-op workers
only add noise, and it leaves the TUI's own thread a core, as on any machine with more cores than torch uses.

Run: .venv/bin/python benchmarks/ui_throughput.py [--repeats N] [--max-tokens N] [--threads N] [--model DIR]
     [--hidden N --layers N]  (size of the random model; a bigger one is a slower engine)
     .venv/bin/python benchmarks/ui_throughput.py --terminal [--repeats N] [--kernel-threads 1,2]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from chatapp.engine.engine import Engine
from chatapp.models import default_model_dir, load_engine
from chatapp.settings import GenerationSettings
from chatapp.ui.app import ChatApp
from chatapp.ui.backend import ChatBackend, EngineBackend
from chatapp.ui.history import HistoryStore
from chatapp.ui.process import ProcessBackend

PROMPT = "Tell me about Paris, the capital of France, and what 37*45 is."
# For the default model: one question from each skill it was trained on, asked in one conversation.
DEFAULT_MODEL_TURNS = (
    PROMPT,
    'How many times does the letter "r" appear in "strawberry"?',
    "Answer in JSON: what is the capital of Italy?",
    "What is 128 divided by 4?",
)

TEXT = (
    "Hello! How are you today? I am fine, thank you. What is 37*45? Let me use the calculator. "
    "How many r are in strawberry? The word strawberry has 3 r letters. Paris is the capital of France. "
    "The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 12.5 100 1024 -7 3.14159. "
)


def random_model_dir(directory: Path, hidden: int = 256, layers: int = 6) -> Path:
    """A random STT checkpoint with routers spread so that some tokens skip some layers."""
    from chatapp.recipes.tiny.tokenizer import train_bpe_tokenizer
    from chatapp.stt import STTConfig, STTForCausalLM

    tokenizer = train_bpe_tokenizer([TEXT] * 50, vocab_size=1024)
    torch.manual_seed(0)
    config = STTConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
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


@dataclass
class Run:
    """One timed run of a side: the tokens shown, wall seconds, the seconds each turn waited for its first token
    (summed over turns), and the UI thread's CPU seconds (TUI sides)."""

    tokens: list[int]
    seconds: float
    first_token: float
    first_count: int  # tokens that arrived with each turn's first (summed over turns)
    ui_cpu: float = 0.0

    @property
    def streaming_rate(self) -> float:
        """Tokens/s once each answer has started: tokens after each turn's first arrival (a step, or a batch drawn),
        over the time after it."""
        return (len(self.tokens) - self.first_count) / (self.seconds - self.first_token)


class TimedChatApp(ChatApp):
    """The chat app, noting when the first batch of each answer is drawn (for the time to first token)."""

    # Textual resolves relative CSS paths against the module of the class that is run: anchor them to ChatApp's.
    CSS_PATH = [Path(inspect.getfile(ChatApp)).parent / path for path in ChatApp.CSS_PATH]
    first_drawn: float | None = None
    first_count = 0
    answered: asyncio.Event | None = None  # set when an answer's last batch has been drawn

    def _apply(self, generation, steps, *, final=False):
        events = super()._apply(generation, steps, final=final)
        if events and self.first_drawn is None:
            self.first_drawn, self.first_count = time.perf_counter(), len(events)
        if final and self.answered is not None:
            # Called from the handler that ends the answer; the benchmark resumes only after that handler returns.
            self.answered.set()
        return events


def engine_run(engine: Engine, settings: GenerationSettings, turns: Sequence[str]) -> Run:
    """The turns through a bare chat session."""
    gc.collect()
    session = engine.session()
    tokens: list[int] = []
    first_token, first_count = 0.0, 0
    started = time.perf_counter()
    for text in turns:
        sent: float | None = time.perf_counter()
        for step in session.send(text, settings):
            if step.tokens and sent is not None:
                first_token += time.perf_counter() - sent
                first_count += len(step.tokens)
                sent = None
            tokens.extend(event.token for event in step.tokens)
    return Run(tokens, time.perf_counter() - started, first_token, first_count)


async def tui_run(
    backend: ChatBackend, settings: GenerationSettings, turns: Sequence[str], db: Path, colours: bool = True
) -> Run:
    """The turns through the headless TUI on a fresh session of `backend`, each sent once the previous answer is
    drawn; `colours`: the transcript colours tokens by probability (f6)."""
    backend.new_session()
    backend.configure(settings, None)
    app = TimedChatApp(backend, HistoryStore(db), cursor_blink=False)
    app.probability_colours = colours
    first_token, first_count = 0.0, 0
    async with app.run_test(size=(120, 36)) as pilot:
        # The app finishes starting up (footer keys, first paints) before the user types: not part of an answer.
        await pilot.pause()
        await asyncio.sleep(0.1)
        gc.collect()
        started, cpu_started = time.perf_counter(), time.thread_time()  # run_test runs the app on this thread
        for text in turns:
            app.first_drawn, app.first_count = None, 0
            app.answered = asyncio.Event()  # awaited, not polled: a poll's sleep would be charged to the TUI
            sent = time.perf_counter()
            app.send(text)
            if not app.is_generating:  # refused (e.g. the context is full): it said so in a notification
                raise RuntimeError(f"the app refused to answer {text!r} (too long for the model's context?)")
            await app.answered.wait()
            assert not app.is_generating
            first_token += (app.first_drawn or time.perf_counter()) - sent
            first_count += app.first_count
        elapsed, ui_cpu = time.perf_counter() - started, time.thread_time() - cpu_started
        tokens = [event.token for answer in app.transcript.answers() for event in answer.events]
    return Run(tokens, elapsed, first_token, first_count, ui_cpu)


def compare(label: str, model_dir: Path, turns: Sequence[str], args: argparse.Namespace, tmp: Path) -> None:
    """Warm up, run the sides interleaved, print the table."""
    engine = load_engine(model_dir, device="cpu")
    settings = GenerationSettings(max_tokens=args.max_tokens, logprobs=args.logprobs)
    colours = not args.no_colours
    in_process = EngineBackend(engine, model_dir=model_dir)
    with ProcessBackend(model_dir, device="cpu") as remote:  # started (model loaded) before any clock runs
        sides: dict[str, Callable[[int], Run]] = {
            "bare engine (ChatSession)": lambda i: engine_run(engine, settings, turns),
            "TUI, engine process (chatapp run)": lambda i: asyncio.run(
                tui_run(remote, settings, turns, tmp / f"{label}-p{i}.sqlite3", colours)
            ),
            "TUI, in-process (--in-process)": lambda i: asyncio.run(
                tui_run(in_process, settings, turns, tmp / f"{label}-t{i}.sqlite3", colours)
            ),
        }
        for run in sides.values():  # warm-up (allocator, kernels, the child's first forward)
            run(-1)
        results: dict[str, list[Run]] = {name: [] for name in sides}
        for i in range(args.repeats):  # interleaved, so machine load affects every side alike
            for name, run in sides.items():
                gc.collect()
                results[name].append(run(i))

    engine_runs = results["bare engine (ChatSession)"]
    same = all(run.tokens == engine_runs[0].tokens for runs in results.values() for run in runs)
    views = f"logprobs {args.logprobs}, probability colours {'off' if args.no_colours else 'on'}"
    print(f"model: {label}; {len(turns)} turn(s), greedy, max_tokens {args.max_tokens}; {views}")
    print(
        f"device cpu ({os.cpu_count()} cores), torch {torch.get_num_threads()} thread(s) in each process; "
        f"{args.repeats} runs per side"
    )
    print(f"identical tokens on every side: {same}\n")
    print(
        "| side | tokens | tokens/s (best) | tokens/s (median) | vs engine (best / median) | first token ms (median) "
        "| streaming tokens/s (median) | vs engine | UI thread CPU (median) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for name, runs in results.items():
        count = len(runs[0].tokens)
        rate = count / min(run.seconds for run in runs)
        median_rate = count / statistics.median(run.seconds for run in runs)
        streaming = statistics.median(run.streaming_rate for run in runs)
        first = statistics.median(run.first_token for run in runs) / len(turns)
        base = base or (rate, median_rate, streaming)
        ui_cpu = statistics.median(run.ui_cpu for run in runs)
        print(
            f"| {name} | {count} | {rate:.1f} | {median_rate:.1f} | {rate / base[0]:.0%} / {median_rate / base[1]:.0%} "
            f"| {first * 1000:.1f} | {streaming:.1f} | {streaming / base[2]:.0%} | {ui_cpu * 1000:.0f} ms |"
        )
    print()


# --- the real terminal ----------------------------------------------------------------------------------------
STORY = "Tell me a long story about a dragon who learns to bake bread."
# What a user types, with this checkout's code (`python -m chatapp` from the repository root).
CHATAPP = [sys.executable, "-m", "chatapp"]
REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class TerminalRun:
    """One answer in a terminal: the engine's own rate (`generate`'s "eval rate", the TUI's stats panel), the rate
    the tokens reached the screen at (TUI: the slope of the stats panel's token count over the times it changed),
    and each process's CPU seconds per second of streaming (TUI)."""

    tokens: int
    engine_rate: float
    screen_rate: float = float("nan")
    ui_cpu: float = float("nan")
    engine_cpu: float = float("nan")

    FIELDS = ("tokens", "engine_rate", "screen_rate", "ui_cpu", "engine_cpu")


def generate_run(prompt: str, env: dict[str, str]) -> TerminalRun:
    """`chatapp generate PROMPT --verbose`, its reply into a pipe: its eval count and rate."""
    done = subprocess.run(
        [*CHATAPP, "generate", prompt, "--verbose"], capture_output=True, text=True, env=env, cwd=REPO, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"chatapp generate failed:\n{done.stderr[-2000:]}")
    count = re.search(r"^eval count:\s+(\d+)", done.stderr, re.MULTILINE)
    rate = re.search(r"^eval rate:\s+([\d.]+)", done.stderr, re.MULTILINE)
    if count is None or rate is None:
        raise SystemExit(f"chatapp generate printed no eval rate:\n{done.stderr[-2000:]}")
    return TerminalRun(int(count[1]), float(rate[1]))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _engine_pid(ui_pid: int) -> int:
    """The TUI's engine process: the child of `ui_pid` that multiprocessing spawned."""
    for child in Path(f"/proc/{ui_pid}/task/{ui_pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise SystemExit(f"chatapp run (pid {ui_pid}) has no engine process")


class TerminalTUI:
    """`chatapp run` in a tmux pane: types a message, watches the screen until the answer is done."""

    SHOWN = re.compile(r"│ tokens\s+(\d+)\s+\(prompt")
    RATE = re.compile(r"│ tokens/s\s+([\d.]+)")

    def __init__(self, env: dict[str, str], db: Path, size: tuple[int, int] = (160, 48)) -> None:
        self.session = f"chatapp-ui-throughput-{os.getpid()}-{db.stem}"
        self.env = {**env, "TEXTUAL_ANIMATIONS": "none"}
        # tmux's server keeps the environment it started with: the pane's command sets what it needs itself.
        exports = [f"{name}={value}" for name, value in self.env.items() if name.startswith(("CHATAPP_", "TEXTUAL_"))]
        line = " ".join(["env", *exports, *CHATAPP, "run", "--db", str(db)])
        subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)
        subprocess.run(
            [
                "tmux",
                "new-session",
                "-d",
                "-s",
                self.session,
                "-c",
                str(REPO),
                "-x",
                str(size[0]),
                "-y",
                str(size[1]),
                line,
            ],
            check=True,
            env=self.env,
        )
        self.wait_for(lambda screen: "enter send" in screen, 120, "its message box")
        pane = subprocess.run(
            ["tmux", "display", "-p", "-t", self.session, "#{pane_pid}"], capture_output=True, text=True, check=True
        )
        self.ui_pid = int(pane.stdout)
        self.engine_pid = _engine_pid(self.ui_pid)

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.session], capture_output=True, text=True).stdout

    def wait_for(self, ready: Callable[[str], bool], timeout: float, what: str) -> str:
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            if ready(screen := self.screen()):
                return screen
            time.sleep(0.1)
        raise SystemExit(f"chatapp run did not show {what} in {timeout:.0f} s:\n{self.screen()}")

    def answer(self, prompt: str, timeout: float = 300.0, poll: float = 0.05) -> TerminalRun:
        """Start a new chat, send `prompt`, and watch until the answer stops at its max tokens."""
        subprocess.run(["tmux", "send-keys", "-t", self.session, "C-n"], check=True)
        self.wait_for(lambda screen: "assistant" not in screen, 30, "a new chat")
        subprocess.run(["tmux", "send-keys", "-t", self.session, "-l", prompt], check=True)
        subprocess.run(["tmux", "send-keys", "-t", self.session, "Enter"], check=True)
        seen: list[tuple[float, int]] = []  # (when, tokens) each time the stats' count changed while streaming
        cpu: tuple[float, float] | None = None
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            screen = self.screen()
            now = time.perf_counter()
            if "stopped at max tokens" in screen:
                break
            if (shown := self.SHOWN.search(screen)) and (not seen or int(shown[1]) != seen[-1][1]):
                if cpu is None:
                    cpu = (_cpu_seconds(self.ui_pid), _cpu_seconds(self.engine_pid))
                seen.append((now, int(shown[1])))
            time.sleep(poll)
        else:
            raise SystemExit(f"chatapp run's answer did not stop at max tokens in {timeout:.0f} s:\n{screen}")
        ui_cpu, engine_cpu = _cpu_seconds(self.ui_pid), _cpu_seconds(self.engine_pid)
        # The stats panel shows the final figures in the frame that ends the answer, or in the next one.
        time.sleep(0.2)
        screen = self.screen()
        total = self.SHOWN.search(screen)
        rate = self.RATE.search(screen)
        if total is None or rate is None or cpu is None or len(seen) < 3:
            raise SystemExit(f"chatapp run's stats panel was not read:\n{screen}")
        streamed = seen[-1][0] - seen[0][0]
        return TerminalRun(
            tokens=int(total[1]),
            engine_rate=float(rate[1]),
            screen_rate=_slope(seen),
            ui_cpu=(ui_cpu - cpu[0]) / streamed,
            engine_cpu=(engine_cpu - cpu[1]) / streamed,
        )

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)


def _slope(points: list[tuple[float, int]]) -> float:
    """Least-squares tokens per second through (time, tokens) points."""
    mean_t = statistics.fmean(t for t, _ in points)
    mean_n = statistics.fmean(n for _, n in points)
    return sum((t - mean_t) * (n - mean_n) for t, n in points) / sum((t - mean_t) ** 2 for t, _ in points)


def terminal_compare(args: argparse.Namespace, tmp: Path) -> None:
    """The `--terminal` comparison (module docstring): interleaved rounds, medians."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _machine import machine

    if shutil.which("tmux") is None:
        raise SystemExit("--terminal needs tmux (apt-get install tmux)")
    env = dict(os.environ)
    env.pop("CHATAPP_KERNEL_THREADS", None)  # each side sets its own
    tuis = {"chatapp run": TerminalTUI(env, tmp / "default.sqlite3")}
    for threads in args.kernel_threads:
        tuis[f"chatapp run, {threads} kernel thread(s)"] = TerminalTUI(
            {**env, "CHATAPP_KERNEL_THREADS": str(threads)}, tmp / f"threads-{threads}.sqlite3"
        )
    runs: dict[str, list[TerminalRun]] = {"chatapp generate": [], **{name: [] for name in tuis}}
    print(machine())
    try:
        for round_ in range(args.repeats + 1):  # round 0 warms up (page cache, the engine's first answer)
            for name in runs:
                run = generate_run(STORY, env) if name == "chatapp generate" else tuis[name].answer(STORY)
                if round_:
                    runs[name].append(run)
            print(f"round {round_}{' (warm-up, dropped)' if not round_ else ''} done", file=sys.stderr)
    finally:
        for tui in tuis.values():
            tui.close()
    base = statistics.median(run.engine_rate for run in runs["chatapp generate"])
    print(f"\nprompt {STORY!r}, greedy, 256 tokens; medians of {args.repeats} interleaved rounds\n")
    print(
        "| side | tokens | engine tokens/s | on-screen tokens/s | on screen / generate | UI process CPU "
        "| engine process CPU |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, side_runs in runs.items():
        median = {field: statistics.median(getattr(r, field) for r in side_runs) for field in TerminalRun.FIELDS}
        row = f"| {name} | {median['tokens']:.0f} | {median['engine_rate']:.1f} |"
        if name == "chatapp generate":
            print(row + " | | | |")
            continue
        shown = median["screen_rate"]
        print(f"{row} {shown:.1f} | {shown / base:.0%} | {median['ui_cpu']:.2f} | {median['engine_cpu']:.2f} |")
    print(
        "\nper round (engine / on-screen tokens/s): "
        + "; ".join(
            f"{name}: " + ", ".join(f"{r.engine_rate:.1f}/{r.screen_rate:.1f}" for r in side_runs)
            for name, side_runs in runs.items()
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on both sides")
    parser.add_argument("--logprobs", type=int, default=5, help="alternatives per token on every side (0 = off)")
    parser.add_argument("--no-colours", action="store_true", help="leave the probability colouring off")
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: embedded and random)")
    # The UI's cost is per frame and per answer, so its share depends on the engine's speed: a bigger random model
    # (e.g. --hidden 512 --layers 8) measures the TUI against a slower engine.
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the random model")
    parser.add_argument("--layers", type=int, default=6, help="layers of the random model (odd ones are STT)")
    parser.add_argument("--terminal", action="store_true", help="chatapp run in a real terminal (tmux) vs generate")
    parser.add_argument(
        "--kernel-threads",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[],
        help="with --terminal: a TUI side per kernel thread count too (e.g. 1,2)",
    )
    args = parser.parse_args()
    if args.terminal:
        with tempfile.TemporaryDirectory() as tmp:
            terminal_compare(args, Path(tmp))
        return
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine process's torch reads it when it starts

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        if args.model is not None:
            compare(str(args.model), args.model, (PROMPT,), args, tmp_path)
            return
        if (default_model_dir() / "config.json").is_file():
            compare("embedded default model", default_model_dir(), DEFAULT_MODEL_TURNS, args, tmp_path)
        random_dir = random_model_dir(tmp_path / "model", args.hidden, args.layers)
        label = f"random STT model (hidden {args.hidden}, {args.layers} layers, {args.layers // 2} STT)"
        compare(label, random_dir, (PROMPT,), args, tmp_path)


if __name__ == "__main__":
    main()
