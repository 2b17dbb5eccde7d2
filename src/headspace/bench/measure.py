"""Measuring on a shared machine: the machine's description, round-robin timing, peak memory.

One job: the measuring helpers every benchmark uses (``benchmarks/*.py`` and ``headspace bench``).

* :func:`machine_info`: CPU, cores, threads, versions and load, written beside every result;
* :func:`timed` and :func:`round_robin`: wall times of callables, interleaved so that a change of load
  touches every case alike; :func:`spread`: median, min and max of a list of times;
* :func:`measure_peak_extra_mib`: the resident-set high-water mark of one step above the memory before
  it (Linux ``/proc``), exact to :func:`rss_counter_slack_mib`.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping

import torch


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn``, one per call."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def round_robin(fns: Mapping[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Wall seconds of every callable, ``rounds`` times, the callables taking turns within each round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].extend(timed(fn, 1))
    return times


def spread(times: list[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of a list of times."""
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def machine_info() -> dict:
    """CPU model, cores, threads, versions and load: what a reader needs to judge the numbers."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if hasattr(os, "getloadavg"):
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    return info


def read_status_kib(field: str) -> int | None:
    """A field of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``); None without /proc or the field."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_counter_slack_mib(threads: int | None = None) -> float:
    """How far :func:`measure_peak_extra_mib` may be off, in MiB, from the kernel's counting alone.

    Linux keeps each process's resident-page count in per-CPU counters (since 6.2; a counter may
    hold back up to ``max(32, 2 * cpus)`` pages per CPU before it is folded into the total that
    ``/proc/self/status`` reads) or, before 6.2, in per-thread caches (up to 64 page faults per
    thread). A measurement reads the count twice (the base and the high-water mark), so the bound is
    twice the larger of the two.
    """
    cpus = os.cpu_count() or 1
    threads = torch.get_num_threads() if threads is None else threads
    pages = max(max(32, 2 * cpus) * cpus, 64 * (threads + 1))  # +1: the calling thread
    return 2 * pages * 4096 / 2**20


def measure_peak_extra_mib(step: Callable[[], None]) -> float | None:
    """Run ``step`` once; return the growth of the resident-set high-water mark in MiB (None without /proc).

    Exact to :func:`rss_counter_slack_mib` (the kernel reads its page counters approximately).

    Sound only in a process started with ``MALLOC_MMAP_THRESHOLD_`` set (see the module docstring);
    :func:`_memory_probe` arranges that.
    """
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
    except OSError:
        return None
    base = read_status_kib("VmRSS")
    step()
    peak = read_status_kib("VmHWM")
    if base is None or peak is None:
        return None
    return max(0, peak - base) / 1024
