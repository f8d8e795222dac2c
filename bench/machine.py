"""What every benchmark prints about the machine it ran on (these machines are shared and their CPUs
differ, so a figure without its CPU model and load says little)."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (a process's affinity is per thread; threads created
    later inherit their creator's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)
