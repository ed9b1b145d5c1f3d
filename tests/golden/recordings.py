"""Where the golden recordings live and which one a machine replays (`tests/test_golden.py`).

    tests/golden/recordings/<platform>/<stage>.json

A recording holds `stage`, `recorded_with` (below), `settings` (the run's configuration),
`steps` (one row per optimizer step) and `other_rows` (`stages.py`). fp32 results depend on the
platform, so every platform keeps its own recordings; a platform is what decides the float
results of the runs, read from a recording's `recorded_with`:

- `machine` (`platform.machine()`: x86_64, aarch64),
- `cpu_capability`: the vector width of torch's CPU kernels
  (`torch.backends.cpu.get_cpu_capability()`: AVX512, AVX2, DEFAULT; `ATEN_CPU_CAPABILITY`
  lowers it): softmax, log_softmax and SDPA round differently per width,
- `native_kernels`: whether `hybridlm.ops.native` is on (off without a C compiler or with
  `HYBRIDLM_NATIVE=0`): its fused Mamba-2 chains round differently from torch's ops,
- `cpu`, the CPU model (/proc/cpuinfo), only when the native kernels are on: they are compiled
  with `-march=native`, so their vector code depends on the CPU (torch's own kernels are chosen
  by `cpu_capability`).

Not part of it (recorded, and named by a failing test when they differ): the torch version (the
runs repeat bit for bit across torch 2.13 and 2.14.1), Python, the thread count (the runs use
one thread) and `native_build`, the compiler and flags the native kernels were built with. If
one of these turns out to change the numbers, add it to `platform_of`.

The directory name is the platform written as a slug (`x86_64-avx512-native-amd-epyc`,
`x86_64-avx2-torch`); which recording is a machine's own is decided by comparing
`platform_of(recorded_with)`, not by the name.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from hybridlm.ops import native
from hybridlm.provenance import cpu_info

HERE = Path(__file__).resolve().parent
RECORDINGS = HERE / "recordings"

Platform = dict[str, Any]
# the fields of a platform, in the order `nearest` weighs them (measured: a replay is closer to
# a recording from the same CPU model on another kernel family than to one from another CPU
# model on the same family)
FIELDS = ("machine", "native_kernels", "cpu", "cpu_capability")


def platform_of(recorded_with: dict[str, Any]) -> Platform:
    """The platform a recording was made on (module docstring)."""
    native_on = bool(recorded_with.get("native_kernels", False))
    return {
        "machine": recorded_with.get("machine"),
        "native_kernels": native_on,
        "cpu": recorded_with.get("cpu") if native_on else None,
        "cpu_capability": recorded_with.get("cpu_capability"),
    }


def current_platform() -> Platform:
    """This machine's platform, as `platform_of(recorded_with())` but without git."""
    return platform_of(
        {
            "machine": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_kernels": native.available(),
            "cpu": cpu_info()["model"],
        }
    )


def slug(plat: Platform) -> str:
    """The directory name of a platform's recordings."""

    def clean(text: str) -> str:
        text = re.sub(r"\((r|tm|c)\)", "", str(text).lower())
        return re.sub(r"[^a-z0-9_]+", "-", text).strip("-")

    parts = [clean(plat["machine"]), clean(plat["cpu_capability"])]
    parts += ["native", clean(plat["cpu"])] if plat["native_kernels"] else ["torch"]
    return "-".join(parts)


def describe(plat: Platform) -> str:
    kernels = f"native kernels on {plat['cpu']}" if plat["native_kernels"] else "no native kernels"
    return f"{plat['machine']}, {plat['cpu_capability']} CPU kernels, {kernels}"


def _native_build() -> str:
    """How the native kernels were built: compiler version and flags (or why they are off)."""
    status = native.status()
    if not native.available():
        return status or "off"
    build = status.rsplit(" (", 1)[-1].rstrip(")")  # "<cc> <flags>"
    cc = build.split(" ", 1)[0]
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, check=True
        ).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        version = shutil.which(cc) or cc
    return f"{version}; {build}"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.strip()


def recorded_with() -> dict[str, Any]:
    """What a recording made here now says it was recorded with (the platform and the rest)."""
    changed = _git("status", "--porcelain", "--", str(HERE.parents[1] / "src"))
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "hybridlm_commit": _git("rev-parse", "HEAD") + (" (src/ modified)" if changed else ""),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_kernels": native.available(),
        "machine": platform.machine(),
        "cpu": cpu_info()["model"],
        "native_build": _native_build(),
    }


def load(stage: str) -> dict[str, dict[str, Any]]:
    """Every recording of `stage`, by platform directory name (sorted)."""
    return {
        p.parent.name: json.loads(p.read_text()) for p in sorted(RECORDINGS.glob(f"*/{stage}.json"))
    }


def own(recordings: dict[str, dict[str, Any]], plat: Platform) -> tuple[str, dict[str, Any]] | None:
    """The recording made on platform `plat`, as (directory, recording), or None."""
    mine = [(k, g) for k, g in recordings.items() if platform_of(g["recorded_with"]) == plat]
    if len(mine) > 1:
        raise ValueError(f"two recordings of one platform {plat}: {[k for k, _ in mine]}")
    return mine[0] if mine else None


def _as_compared(recorded_with: dict[str, Any]) -> Platform:
    """A recording's platform with its CPU model even where the platform leaves it out."""
    return {**platform_of(recorded_with), "cpu": recorded_with.get("cpu")}


def _here(plat: Platform) -> Platform:
    return {**plat, "cpu": plat["cpu"] if plat["native_kernels"] else cpu_info()["model"]}


def differing(recorded_with: dict[str, Any], plat: Platform) -> list[str]:
    """The fields (`FIELDS`, the CPU model included) in which a recording's platform differs
    from `plat`."""
    theirs, here = _as_compared(recorded_with), _here(plat)
    return [f for f in FIELDS if theirs[f] != here[f]]


def nearest(
    recordings: dict[str, dict[str, Any]], plat: Platform
) -> tuple[str, dict[str, Any]] | None:
    """The recording from the platform most like `plat` (the fields in `FIELDS` order; the CPU
    model counts even where it is not part of the platform), or None when there is none."""
    here = _here(plat)

    def distance(item: tuple[str, dict[str, Any]]) -> tuple:
        theirs = _as_compared(item[1]["recorded_with"])
        return tuple(theirs[f] != here[f] for f in FIELDS), item[0]

    return min(recordings.items(), key=distance, default=None)


def informational_diff(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`recorded_with` fields outside the platform that differ (torch, python, native_build):
    the suspects when a replay on the recorded platform does not reproduce its recording."""
    return [
        f"{k}: recorded {recorded[k]!r}, now {now[k]!r}"
        for k in ("torch", "python", "native_build")
        if k in recorded and k in now and recorded[k] != now[k]
    ]
