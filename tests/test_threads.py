"""CPU threading: free-core arithmetic, the governor following a neighbour, the wait policy, and
(slow) the contention benchmark's busy / idle ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hybridlm.threads as threads

ROOT = Path(__file__).resolve().parents[1]


def test_free_threads_rounds_a_partial_neighbour_up():
    assert threads._free_threads(2, 0.0) == 2
    assert threads._free_threads(2, 0.2) == 2  # a light neighbour does not take a thread
    assert threads._free_threads(2, 0.4) == 1
    assert threads._free_threads(2, 1.0) == 1
    assert threads._free_threads(2, 3.0) == 1  # never below one
    assert threads._free_threads(16, 1.0) == 15


def test_configure_pinned_turns_adaptation_off():
    before = torch.get_num_threads()
    try:
        info = threads.configure_threads(1)
        assert info["threads"] == 1 and info["source"] == "--threads"
        assert not info["adaptive"] and threads.governor() is None
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="--threads must be >= 1"):
            threads.configure_threads(0)
    finally:
        torch.set_num_threads(before)


def test_governor_follows_a_neighbour(monkeypatch):
    """Feed /proc/stat readings: a neighbour using one of two cores -> 1 thread; gone -> 2."""
    clock = {"busy": 0.0, "total": 0.0}
    monkeypatch.setattr(threads, "_cpu_times", lambda: (clock["busy"], clock["total"]))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    own = [0.0]
    monkeypatch.setattr(threads.os, "times", lambda: (own[0], 0.0, 0.0, 0.0, 0.0))
    before = torch.get_num_threads()
    try:
        gov = threads.ThreadGovernor(cpus=2, threads=2, interval_s=0.0)

        def tick(other_cores: float, own_cores: float) -> None:
            # 100 jiffies per core over one interval; this process's time counted in the busy sum
            clock["total"] += 200
            clock["busy"] += 100 * (other_cores + own_cores)
            own[0] += own_cores * 100 / threads.os.sysconf("SC_CLK_TCK")
            gov.poll()

        tick(0.0, 2.0)
        assert gov.threads == 2  # our own two threads are not a neighbour
        tick(0.9, 1.1)
        assert gov.threads == 1 and torch.get_num_threads() == 1
        tick(1.0, 1.0)
        assert gov.threads == 1
        tick(0.0, 1.0)
        assert gov.threads == 2 and torch.get_num_threads() == 2
        assert [n for _, n in gov.changes] == [1, 2]
    finally:
        torch.set_num_threads(before)


def test_configure_before_torch_sizes_the_pool():
    """Called before torch loads, the choice reaches torch and the environment of child processes
    (Ray workers, data workers), and the wait policy stays the runtime's."""
    code = (
        "import json, sys; from hybridlm.threads import configure_threads; "
        "assert 'torch' not in sys.modules; info = configure_threads(None); "
        "import os, torch; info['env'] = os.environ['OMP_NUM_THREADS']; "
        "info['torch_threads'] = torch.get_num_threads(); print(json.dumps(info))"
    )
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["omp_wait_policy"] == "runtime default" and not info["torch_imported_first"]
    assert info["torch_threads"] == info["threads"] == int(info["env"]) >= 1
    assert info["source"] == "free cores" and "busy_cpus_at_start" in info


@pytest.mark.slow
def test_contention_benchmark_ratio(tmp_path):
    """With one CPU-bound neighbour, hybridlm's threading keeps >= 40% of its idle speed."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "contention.py"),
            "--rounds",
            "2",
            "--seconds",
            "3",
            "--settings",
            "hybridlm",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["hybridlm/busy"]["train_ratio"] >= 0.4, out.stdout
    assert summary["hybridlm/busy"]["decode_ratio"] >= 0.4, out.stdout
    assert (tmp_path / "contention.png").stat().st_size > 0
