"""How many threads a command gives torch, and OpenMP's wait policy, chosen from the machine's load.

On a shared machine torch's default (one thread per core, OpenMP threads spinning while they wait) is
slow: with one other CPU-bound process on 2 cores, ``circuit --method eap`` took 158 s against 49.7 s
with ``OMP_NUM_THREADS=1``, because every parallel region waits for the thread that the other process
holds off its core, and the spinning waiter takes that core's time too. The command line therefore
chooses, at its start and before torch (and its OpenMP runtime) is imported:

* **threads** (:func:`plan_threads`, a pure function of cores, load and environment):
  ``HEADSPACE_THREADS=N`` if set, else the user's ``OMP_NUM_THREADS`` (left as it is), else
  ``max(1, cores - others)``: the physical cores this process may run on (``os.sched_getaffinity``,
  hyperthreads counted once) less the other runnable tasks measured now (:func:`others_running`). A
  quiet machine keeps torch's default (a thread per physical core: 2 on a 2-core machine; nothing is
  set), the same machine with one competing process gets 1 (its own core: no wait for a thread it
  cannot schedule).
* **wait policy**: when other tasks share the machine and more than one thread is kept,
  ``OMP_WAIT_POLICY=PASSIVE`` and ``KMP_BLOCKTIME=0`` (Intel's OpenMP), so that a waiting thread sleeps
  instead of spinning on a core another process needs; on a quiet machine the runtime's default (a short
  spin, faster for torch's many small parallel regions) stays. A variable the user has set is never
  changed.

:func:`configure` measures and applies the plan (the environment variables, and
``torch.set_num_threads`` when torch is already imported); ``headspace``'s entry point calls it once.
``HEADSPACE_THREADS=auto`` is the default policy, spelled out.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field

from .errors import UsageError

__all__ = ["ThreadPlan", "configure", "cores_available", "others_running", "plan_threads"]

#: The variables a plan may set (each only where the user has not).
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "KMP_BLOCKTIME")


@dataclass(frozen=True)
class ThreadPlan:
    """What :func:`plan_threads` chose: ``threads`` for torch, the variables to set (``env``: none the
    user had set) and why, in words (``reason``)."""

    threads: int
    env: dict[str, str] = field(default_factory=dict)
    reason: str = ""


def _positive_int(text: str, name: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"{name} must be a positive integer or 'auto'; got {text!r}")
    return value


def plan_threads(cores: int, others: float, env: Mapping[str, str]) -> ThreadPlan:
    """The plan for a process that may run on ``cores`` cores while ``others`` other tasks are runnable,
    with environment ``env`` (see the module docstring). A bad ``HEADSPACE_THREADS`` is a one-line
    :class:`UsageError`; ``OMP_NUM_THREADS`` is left to OpenMP (its first number read as the threads)."""
    cores = max(1, int(cores))
    asked = env.get("HEADSPACE_THREADS", "").strip()
    if asked and asked.lower() != "auto":
        threads, reason = _positive_int(asked, "HEADSPACE_THREADS"), "HEADSPACE_THREADS"
        updates = {"OMP_NUM_THREADS": str(threads)}
    elif env.get("OMP_NUM_THREADS", "").strip():
        first = env["OMP_NUM_THREADS"].split(",")[0].strip()  # OpenMP's "4,2": 4 at the outer level
        threads, reason = (int(first) if first.isdigit() and int(first) > 0 else cores), "OMP_NUM_THREADS"
        updates = {}
    else:
        busy = max(0, round(others))
        threads = max(1, cores - busy)
        reason = f"{cores} cores, {busy} other runnable task{'s' * (busy != 1)}"
        # a quiet machine keeps torch's own default (a thread per physical core), set by nobody
        updates = {"OMP_NUM_THREADS": str(threads)} if busy else {}
    if round(others) > 0 and threads > 1:
        updates.update({"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"})
    kept = {k: v for k, v in updates.items() if k == "OMP_NUM_THREADS" or k not in env}  # never the user's
    return ThreadPlan(threads, kept, reason)


def cores_available() -> int:
    """The physical cores this process may run on: the CPUs of its affinity mask (``os.cpu_count()``
    where there is none), hyperthreads of one core counted once (Linux's ``thread_siblings_list``)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        try:
            with open(
                f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", encoding="ascii"
            ) as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def _running_now() -> int | None:
    """The runnable tasks (processes and threads) right now, this one included: ``/proc/loadavg``'s
    fourth field ``running/total``; None where there is no such file."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def others_running(
    samples: int = 5, gap: float = 0.01, read: Callable[[], int | None] = _running_now
) -> float:
    """Other runnable tasks now: the median over ``samples`` reads ``gap`` seconds apart of the runnable
    count less this process; where the count cannot be read, the 1-minute load average (which lags)."""
    counts: list[int] = []
    for i in range(samples):
        n = read()
        if n is None:
            break
        counts.append(n)
        if i + 1 < samples:
            time.sleep(gap)
    if counts:
        return max(0.0, statistics.median(counts) - 1)
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return 0.0


def configure(environ: MutableMapping[str, str] | None = None) -> ThreadPlan:
    """Measure the machine, choose the plan and apply it: its variables go into ``environ`` (default
    ``os.environ``; read by OpenMP when torch is first imported) and, when torch is already imported,
    ``torch.set_num_threads``. Returns the plan."""
    env = os.environ if environ is None else environ
    plan = plan_threads(cores_available(), others_running(), env)
    env.update(plan.env)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "set_num_threads") and "OMP_NUM_THREADS" in plan.env:
        torch.set_num_threads(plan.threads)
    return plan
