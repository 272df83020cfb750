"""How much of the machine is free: the one CPU meter every part of the framework reads.

:func:`read_cpu` measures the idle cores this process may use (their affinity, capped by a
cgroup CPU quota) over a short window, from ``/proc/stat`` (psutil or the load average
elsewhere). The executors size each batch of trainings to it (:func:`plan_workers`), and
the embedded model picks its thread count from it (``core.llm.embedded.busy_cores``), so
both see the same machine.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class CpuReading:
    """How much of the machine this process may use, and how much of that is idle."""

    cores: int  # cores this process may run on (affinity, capped by a cgroup CPU quota)
    free: float  # of those, cores' worth idle over the reading's window (0 .. cores)
    load_avg: float | None = None  # 1-minute load average at the time, for the record
    source: str = "none"  # where ``free`` came from: proc, psutil, loadavg or none (assumed idle)


Reader = Callable[[], CpuReading]


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def _cgroup_quota() -> float | None:
    """Cores' worth of CPU time the cgroup may use (``cpu.max``), or None without a quota."""
    try:
        limit, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        return None


def cpu_times(text: str, cpus: set[int] | None = None) -> tuple[float, float]:
    """(idle, total) jiffies of the given CPUs (all when None) from ``/proc/stat`` text.

    Idle counts ``idle`` and ``iowait``; total counts user through steal (guest time is
    already inside user).
    """
    idle = total = 0.0
    for line in text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        values = [float(v) for v in fields[:8]]
        idle += values[3] + values[4]
        total += sum(values)
    return idle, total


def read_cpu(window_s: float = 0.5) -> CpuReading:
    """Measure the idle cores this process may use over ``window_s`` seconds.

    Threads of this process count as busy too (an LLM generating beside training is
    work the training would compete with). A cgroup quota caps the result by what the
    cgroup has left of it.
    """
    cores = usable_cores()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    stat, cgroup_stat = Path("/proc/stat"), Path("/sys/fs/cgroup/cpu.stat")
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = None
    if stat.exists():
        quota = _cgroup_quota()
        idle0, total0 = cpu_times(stat.read_text(), cpus)
        used0 = _cgroup_usage_s(cgroup_stat) if quota else None
        start = time.perf_counter()
        time.sleep(window_s)
        idle1, total1 = cpu_times(stat.read_text(), cpus)
        elapsed = time.perf_counter() - start
        ncpus = len(cpus) if cpus is not None else (os.cpu_count() or 1)
        free = ncpus * (idle1 - idle0) / max(total1 - total0, 1e-9)
        if quota and used0 is not None:
            used1 = _cgroup_usage_s(cgroup_stat)
            if used1 is not None:
                free = min(free, quota - (used1 - used0) / elapsed)
        return CpuReading(cores, max(0.0, min(float(cores), free)), load, "proc")
    with contextlib.suppress(ImportError):
        import psutil

        idle = sum(100.0 - p for p in psutil.cpu_percent(interval=window_s, percpu=True)) / 100.0
        return CpuReading(cores, max(0.0, min(float(cores), idle)), load, "psutil")
    if load is not None:
        return CpuReading(cores, max(0.0, cores - load), load, "loadavg")
    return CpuReading(cores, float(cores), None, "none")


def _cgroup_usage_s(path: Path) -> float | None:
    try:
        for line in path.read_text().splitlines():
            key, value = line.split()
            if key == "usage_usec":
                return int(value) / 1e6
    except (OSError, ValueError):
        pass
    return None


def workers_setting(value: Any) -> int | str:
    """``executor.workers`` checked: ``"auto"`` or a positive int.

    :raises core.errors.UserError: for anything else.
    """
    if isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    from core.errors import UserError

    raise UserError(f"executor.workers must be 'auto' or a positive number of workers, got {value!r}.")


def plan_workers(workers: int | str, jobs: int, reading: CpuReading | None = None) -> int:
    """Jobs to train at once: ``workers`` if a number, else sized to ``reading``.

    ``auto``: one for the driver's own core plus one per free core (a core at least half
    idle counts), at most the usable cores; never more than ``jobs``, never less than 1.
    1 means: train in this process.
    """
    workers = workers_setting(workers)
    if workers == "auto":
        reading = reading or read_cpu()
        workers = min(reading.cores, 1 + int(math.floor(reading.free + 0.5)))
    return max(1, min(int(workers), jobs))


def load_average() -> float:
    """The 1-minute load average (NaN where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return float("nan")
