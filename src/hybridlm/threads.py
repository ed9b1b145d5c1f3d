"""CPU threading that holds up when the machine is shared.

PyTorch's CPU kernels run on an OpenMP pool of one thread per core, and every parallel region ends
in a barrier: a region is as slow as its slowest thread. When another process keeps one core busy,
the thread that shares that core runs only in the scheduler's time slices, so each of the thousands
of small regions of a training or decode step waits milliseconds for it. On a 2-core machine
with one CPU-bound neighbour this made pretraining 4-25x slower (`benchmarks/contention.py`).
So the thread count follows the share of the machine that is free:

- at start, the cores this process may use (its affinity mask) minus the cores other processes
  keep busy (sampled from /proc/stat over 0.2 s), at least one;
- while it runs, every `interval_s` seconds (2 by default) the thread that runs the model
  re-reads /proc/stat, subtracts its own process's CPU time, and sets the count to the cores
  left free, so a neighbour that starts or stops later is followed. The check rides on a global
  module forward pre-hook (`torch.nn.modules.module.register_module_forward_pre_hook`), so
  training, decoding, serving and evaluation loops need no call of their own; between checks
  the hook costs one clock read per module call.

The OpenMP wait policy is left to the runtime (or the user's `OMP_WAIT_POLICY`): measured on
2 cores, `PASSIVE` (threads sleep at once) cost 30-40% of idle training speed and ~40% of decode
speed, and `ACTIVE` (threads never sleep) kept 0.41 of idle training speed against a neighbour
that starts late, against 0.56 for the runtime default, which did best in all three conditions.

`configure_threads(n)` pins the count (`hybridlm ... --threads n`) and turns the adaptation
off; so does `OMP_NUM_THREADS` when the user sets it.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["ThreadGovernor", "available_cpus", "busy_cpus", "configure_threads", "describe"]


def available_cpus() -> int:
    """The cores this process may run on (its affinity mask; cgroup quotas are not read)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies summed over all cores, from /proc/stat; None where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [float(v) for v in fields[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
    total = sum(values[:8])  # guest time is already counted in user / nice
    return total - idle, total


def _sample() -> tuple[float, float, float] | None:
    """`_cpu_times()` and this process's own CPU time (user + system), all in jiffies."""
    times = _cpu_times()
    if times is None:
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return times[0], times[1], sum(os.times()[:2]) * ticks


def _busy_others(a: tuple | None, b: tuple | None) -> float | None:
    """Cores that other processes kept busy between two `_sample()`s (None where unknown)."""
    if a is None or b is None or b[1] <= a[1]:
        return None
    others = max(0.0, (b[0] - a[0]) - (b[2] - a[2]))
    return others / (b[1] - a[1]) * (os.cpu_count() or 1)


def busy_cpus(window_s: float = 0.2) -> float:
    """How many cores other processes keep busy, averaged over `window_s` (0.0 where unknown)."""
    a = _sample()
    if a is None:
        return 0.0
    time.sleep(window_s)
    return _busy_others(a, _sample()) or 0.0


def _free_threads(cpus: int, busy_others: float) -> int:
    """Cores left by neighbours; a neighbour using 0.3 of a core still takes a slot now and then."""
    return max(1, min(cpus, cpus - int(busy_others + 0.7)))


class ThreadGovernor:
    """Follows the cores that other processes leave free and sets torch's thread count to them.

    `poll()` is cheap between checks (one clock read); a check reads /proc/stat and this
    process's CPU time and calls `torch.set_num_threads` in the calling thread (OpenMP thread
    counts are per thread, so it must be the one that runs the model) when the count changes.
    """

    def __init__(self, cpus: int, threads: int, interval_s: float = 2.0) -> None:
        self.cpus, self.threads, self.interval_s = cpus, threads, interval_s
        self.changes: list[tuple[float, int]] = []
        self._next = time.monotonic() + interval_s
        self._last = _sample()

    def poll(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        cur = _sample()
        others = _busy_others(self._last, cur)
        self._last = cur
        if others is None:
            return
        target = _free_threads(self.cpus, others)
        if target != self.threads:
            import torch

            torch.set_num_threads(target)
            self.threads = target
            self.changes.append((time.time(), target))

    def _hook(self, module, args) -> None:
        if time.monotonic() >= self._next:
            self.poll()


_GOVERNOR: ThreadGovernor | None = None
_HOOK = None
_INFO: dict | None = None


def configure_threads(requested: int | None = None, *, window_s: float = 0.2) -> dict:
    """Choose and apply torch's intra-op thread count; return what was done (and the wait policy).

    `requested` pins the count; otherwise `OMP_NUM_THREADS` if set, else the free cores at start.
    Call it before the first `import torch` of the process: `OMP_NUM_THREADS` then also sizes
    the OpenMP pool that torch starts.
    The automatic choice is made once per process: later calls with `requested=None` return it
    unchanged (a library or test that pinned the count keeps it); a number always re-pins.
    """
    global _GOVERNOR, _HOOK, _INFO
    if requested is not None and requested < 1:
        raise ValueError(f"--threads must be >= 1, got {requested}")
    if requested is None and _INFO is not None:
        return _INFO
    torch_loaded = "torch" in sys.modules
    cpus = available_cpus()
    info: dict = {"cpus": cpus}
    env_threads = os.environ.get("OMP_NUM_THREADS", "")
    if requested is not None:
        threads, source = requested, "--threads"
    elif env_threads.isdigit() and int(env_threads) >= 1:
        threads, source = int(env_threads), "OMP_NUM_THREADS"
    else:
        busy = busy_cpus(window_s) if cpus > 1 else 0.0
        threads = _free_threads(cpus, busy)
        source = "free cores"
        info["busy_cpus_at_start"] = round(busy, 2)
    info.update(threads=threads, source=source)

    info["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY") or "runtime default"
    info["torch_imported_first"] = torch_loaded
    # child processes (Ray workers, data workers, tokenizers) start from the same settings
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("MKL_NUM_THREADS", str(threads))

    import torch

    torch.set_num_threads(threads)
    try:
        # inter-op parallelism is unused by eager training and decode; one pool is enough
        torch.set_num_interop_threads(1)
        info["interop_threads"] = 1
    except RuntimeError:  # already started by earlier parallel work in this process
        info["interop_threads"] = torch.get_num_interop_threads()

    if _HOOK is not None:
        _HOOK.remove()
        _GOVERNOR = _HOOK = None
    adapt = source == "free cores" and cpus > 1
    info["adaptive"] = adapt
    if adapt:
        _GOVERNOR = ThreadGovernor(cpus, threads)
        # a plain function: wrapping it in torch.compiler.disable costs ~8% of a tiny model's decode
        _HOOK = torch.nn.modules.module.register_module_forward_pre_hook(_GOVERNOR._hook)
    _INFO = info
    return info


def governor() -> ThreadGovernor | None:
    """The running governor (None when the thread count is pinned or not configured)."""
    return _GOVERNOR


def describe(info: dict) -> str:
    """One line for the log: `threads 2 of 2 CPUs (free cores; 0.0 busy at start), OpenMP ...`."""
    why = info.get("source", "")
    if "busy_cpus_at_start" in info:
        why += f"; {info['busy_cpus_at_start']:.1f} busy at start"
    if info.get("adaptive"):
        why += "; follows free cores"
    return (
        f"threads {info.get('threads')} of {info.get('cpus')} CPUs ({why}), "
        f"OpenMP wait policy {info.get('omp_wait_policy')}"
    )
