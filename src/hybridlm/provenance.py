"""Where a run came from: command line, settings that differ from a reference config, code
version, library versions, threads and hardware, written as `provenance.json` in the run directory
so that reports rendered later (from files only) can say what produced the numbers.

    collect(argv=sys.argv, config=cfg.to_dict(), defaults=defaults.to_dict(), threads=info)

Everything here is best effort: a missing `git`, a tree that is not a git checkout, an unreadable
/proc or a library that is not installed is recorded as such, never raised.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from .threads import available_cpus

FORMAT = 1
# the libraries whose versions change the numbers of a run
LIBRARIES = ("hybridlm", "torch", "numpy", "transformers", "tokenizers", "ray", "matplotlib")
# settings whose difference from the reference does not change what the run computes
NEUTRAL_KEYS = ("out_dir",)


def now_iso() -> str:
    """The local time with its UTC offset, to the second (`2025-01-31T14:02:07+01:00`)."""
    return _dt.datetime.now().astimezone().replace(microsecond=0).isoformat()


def command_line(argv: list[str] | None = None) -> str:
    """The command as a shell would take it, the program named by its file name."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    return shlex.join([Path(argv[0]).name, *argv[1:]])


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a plain config tree (`pretrain.train.max_steps`, `rl.data.envs.0.seed`)."""
    out: dict[str, Any] = {}
    if isinstance(tree, dict) and tree:
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(tree, list) and tree and all(isinstance(x, dict) for x in tree):
        for i, v in enumerate(tree):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = tree
    return out


def config_diff(config: dict[str, Any], defaults: dict[str, Any]) -> list[dict[str, Any]]:
    """Every dotted setting whose value differs from the reference, in the config's order:
    `{"key", "default", "value"}` (a key absent on one side has `None` there)."""
    cur, ref = flatten(config), flatten(defaults)
    rows = []
    for key in [*cur, *(k for k in ref if k not in cur)]:
        a, b = cur.get(key), ref.get(key)
        if a != b:
            rows.append({"key": key, "default": b, "value": a})
    return rows


def git_state(path: str | Path) -> dict[str, Any]:
    """Commit and dirty flag of the checkout holding `path` (read-only git commands)."""

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(path), *args],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip()

    try:
        root = git("rev-parse", "--show-toplevel")
        commit = git("rev-parse", "HEAD")
        changed = [line for line in git("status", "--porcelain").splitlines() if line.strip()]
    except FileNotFoundError:
        return {"commit": None, "note": "git is not installed"}
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return {"commit": None, "note": f"not a git checkout ({path})"}
    return {"commit": commit, "dirty": bool(changed), "changed_files": len(changed), "root": root}


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    """Installed versions (None: not installed); Python's own first."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_info() -> dict[str, Any]:
    """CPU model (/proc/cpuinfo), logical cores, the cores this process may use, memory."""
    info: dict[str, Any] = {"model": platform.processor() or platform.machine() or None}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                info["model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["logical_cores"] = os.cpu_count()
    info["usable_cores"] = available_cpus()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except (OSError, ValueError, IndexError):
        pass
    return info


def thread_info(configured: dict[str, Any] | None = None) -> dict[str, Any]:
    """torch's thread pools as they are now, the OpenMP / MKL environment, and the result of
    `hybridlm.threads.configure_threads` when the caller has one (recorded as given)."""
    out: dict[str, Any] = {}
    try:
        import torch

        out["torch_threads"] = torch.get_num_threads()
        out["torch_interop_threads"] = torch.get_num_interop_threads()
        if torch.cuda.is_available():
            out["cuda_devices"] = [
                torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
            ]
    except ImportError:
        pass
    out["env"] = {
        k: os.environ[k]
        for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")
        if k in os.environ
    }
    out["configured"] = dict(configured) if configured else None
    return out


def collect(
    *,
    argv: list[str] | None = None,
    config: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
    defaults_path: str | Path | None = None,
    threads: dict[str, Any] | None = None,
    code_path: str | Path | None = None,
) -> dict[str, Any]:
    """The provenance record of a run starting now (see the module docstring)."""
    rec: dict[str, Any] = {
        "format": FORMAT,
        "started": now_iso(),
        "command": command_line(argv),
        "cwd": os.getcwd(),
    }
    if config is not None and defaults is not None:
        diff = config_diff(config, defaults)
        rec["defaults"] = str(defaults_path) if defaults_path else None
        rec["overrides"] = [d for d in diff if d["key"] not in NEUTRAL_KEYS]
        rec["neutral_overrides"] = [d for d in diff if d["key"] in NEUTRAL_KEYS]
        rec["is_default"] = not rec["overrides"]
    else:
        rec["defaults"] = None
        rec["overrides"] = None
        rec["is_default"] = None
    rec["git"] = git_state(code_path or Path(__file__).resolve().parent)
    rec["versions"] = library_versions()
    rec["threads"] = thread_info(threads)
    rec["cpu"] = cpu_info()
    rec["platform"] = platform.platform()
    return rec
