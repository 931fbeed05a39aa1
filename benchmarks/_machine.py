"""The line every benchmark prints about the box it ran on (its tables are only comparable on the same one)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def machine() -> str:
    """CPU model, cores, torch version and CPU capability, torch threads, and the load average now."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
        f"{torch.get_num_threads()} torch threads, load average {load:.1f}"
    )
