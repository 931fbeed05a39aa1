"""How many threads the native decode step runs with: the count that measures fastest on the cores it gets now.

A decode step of a small model makes ~150 OpenMP joins (four products a layer split across the team, attention, the
head). At every join the team waits for its slowest thread. When another process holds one of the cores, the
thread that shares that core is descheduled a scheduler slice at a time, and every join waits for it: on the 2-core
box with one busy-loop process beside it, two threads decoded at 15% of their idle rate, where one thread alone
runs on the free core at its full single-thread rate (~70% of two threads' idle rate). Spinning less at the join
(`lifecycle.SPIN_COUNT`) helps, and cannot help enough: the wait is for a thread that is not running.

No count is right at every moment: idle, the whole team is fastest; under load, fewer threads than cores. So the
count follows the machine (`ThreadGovernor`):
- what else runs: the CPU time other processes used since the last look (`OtherLoad`, from /proc/stat less this
  process's own time). When the free cores cannot hold the current count, or other work takes a share of a core
  (`BUSY`), the count below is a candidate; when they can hold the count above, that one. Niced work is left out:
  the scheduler gives way to ours over it;
- what the steps measure: a candidate count runs a few steps (a probe) and is kept only if it is faster than the
  current count's recent steps of the same work (`shape`: the rows fed; 8 rows take longer than 1 at any count).
  Steps turning much slower than when the count was chosen (a busy process started) call a look at once; the looks
  are otherwise spaced out, doubling from a few steps after the start to 512.
An idle machine probes nothing (its other load is ~0), so the idle step is the one it was. Without /proc/stat
(not Linux) every probe runs on the schedule; a probe that confirms the count costs a few steps at a worse count,
~0.5% of the steps once spaced out.

A row's numbers do not depend on the count: each output channel of a product and each attention task is summed
by one thread in one order, whichever thread that is (tests compare the logits bit for bit).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# Consecutive steps a probe runs at the candidate count (one alone is at the mercy of a single preemption); a first
# step that is already this much slower than the current count's ends it.
PROBE_STEPS, CLEARLY_SLOWER = 3, 2.0
# Steps between looks: the first soon after the start (a one-shot reply is ~100 steps), doubling while the count
# holds, up to LONGEST_WAIT.
FIRST_WAIT, LONGEST_WAIT = 2, 512
# A probe must win by this factor to move the count: two counts within noise of each other keep the current one.
MARGIN = 0.9
# Steps this much slower (median of the last four) than when the count was chosen mean the machine changed.
SLOWDOWN = 1.5
RECENT = 8
# Other processes' use, in cores, past which the joins may stall: a quarter of a core busy on average (a UI drawing
# a stream beside the engine) already deschedules a thread sharing it now and then. It calls a probe, not a switch.
BUSY = 0.25


class OtherLoad:
    """Cores' worth of CPU time other processes used (not niced: the scheduler favours ours over them) since the
    previous call, from /proc/stat's totals less this process's own CPU time; None where there is no /proc/stat."""

    STAT = "/proc/stat"

    def __init__(self) -> None:
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            with open(self.STAT, "rb") as stat:
                fields = stat.readline().split()
        except OSError:
            return None
        if len(fields) < 9 or fields[0] != b"cpu":
            return None
        # user nice system idle iowait irq softirq steal: the time the CPUs ran something other than idle or niced
        # work, steal too (the hypervisor ran another guest: our threads did not run either).
        user, _nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
        busy = (user + system + irq + softirq + steal) / self._ticks
        mine = os.times()
        return time.monotonic(), busy, mine.user + mine.system

    def __call__(self) -> float | None:
        now = self._sample()
        if now is None or self._last is None:
            return None
        (then, busy_then, mine_then), self._last = self._last, now
        wall = now[0] - then
        if wall < 0.05:  # too short to tell: 10 ms ticks
            return None
        return max(0.0, (now[1] - busy_then) - (now[2] - mine_then)) / wall


@dataclass
class _Samples:
    """Recent step times of one shape at the current count, and their level when the count was chosen."""

    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    baseline: float | None = None


class ThreadGovernor:
    """Picks each step's thread count (`threads`) from the machine's load and the times of earlier steps
    (`record`). One model decodes one step at a time, so it is not shared between threads."""

    def __init__(self, ceiling: int, load: Callable[[], float | None] | None = None) -> None:
        if ceiling < 1:
            raise ValueError(f"a thread ceiling must be at least 1, got {ceiling}")
        self.ceiling = self.current = ceiling
        self.load = load if load is not None else OtherLoad()
        self._wait = self._until_look = FIRST_WAIT
        self._probe: int | None = None  # the count a probe in progress runs
        self._probe_times: list[tuple[object, float]] = []
        self._samples: dict[object, _Samples] = {}

    @property
    def ladder(self) -> list[int]:
        """The counts tried: the ceiling, halved down to 1."""
        counts, n = {1}, self.ceiling
        while n > 1:
            counts.add(n)
            n //= 2
        return sorted(counts)

    def threads(self) -> int:
        """The count the next step runs with."""
        return self._probe if self._probe is not None else self.current

    def record(self, shape: object, threads: int, seconds: float) -> None:
        """A step of work `shape` took `seconds` at `threads` threads."""
        if self._probe is not None and threads == self._probe:
            self._probe_times.append((shape, seconds))
            reference = self._reference(shape)
            if len(self._probe_times) >= PROBE_STEPS or (reference and seconds > CLEARLY_SLOWER * reference):
                self._decide()
            return
        if threads != self.current:
            return  # a step from before the count changed
        samples = self._samples.setdefault(shape, _Samples())
        samples.recent.append(seconds)
        if samples.baseline is None and len(samples.recent) >= PROBE_STEPS:
            samples.baseline = statistics.median(samples.recent)
        elif samples.baseline is not None and len(samples.recent) >= 4:
            latest = statistics.median(list(samples.recent)[-4:])
            if latest > SLOWDOWN * samples.baseline:  # the machine got busier: look again now
                self._wait, self._until_look = FIRST_WAIT, 0
                samples.baseline = latest
        self._until_look -= 1
        if self._until_look <= 0:
            self._look()

    def _reference(self, shape: object) -> float | None:
        samples = self._samples.get(shape)
        return statistics.median(samples.recent) if samples and samples.recent else None

    def _look(self) -> None:
        """Probe the neighbouring count the machine's load points to, if any; else wait twice as long."""
        ladder, others = self.ladder, self.load()
        at = ladder.index(self.current)
        below = ladder[at - 1] if at > 0 else None
        above = ladder[at + 1] if at + 1 < len(ladder) else None
        free = None if others is None else self.ceiling - others
        if free is None:  # no load reading: probe on the schedule, below first
            candidate = below or above
        elif below is not None and free < self.current - 1 + BUSY:
            candidate = below  # the current count does not fit on the free cores
        elif above is not None and free >= above - BUSY:
            candidate = above  # a larger count fits again
        elif below is not None and others >= BUSY:
            candidate = below  # it fits, barely: measure whether fewer threads wait less
        else:
            candidate = None
        if candidate is None:
            self._wait = min(self._wait * 2, LONGEST_WAIT)
            self._until_look = self._wait
        else:
            self._probe, self._probe_times = candidate, []

    def _decide(self) -> None:
        """The probe's steps against the current count's recent steps of the same shapes."""
        pairs = [(seconds, reference) for shape, seconds in self._probe_times if (reference := self._reference(shape))]
        probed, self._probe = self._probe, None
        if pairs and statistics.median(p for p, _ in pairs) < MARGIN * statistics.median(r for _, r in pairs):
            self.current = probed
            self._samples.clear()  # times at the old count say nothing about the new one
            self._wait = FIRST_WAIT * 4
        else:
            self._wait = min(self._wait * 2, LONGEST_WAIT)
        self._until_look = self._wait
