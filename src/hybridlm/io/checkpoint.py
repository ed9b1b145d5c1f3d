"""The training-checkpoint format: boring, versioned, atomic (DESIGN habit 14).

    <out>/checkpoints/step_00000500/
        model.safetensors    weights and persistent buffers (MoE correction bias), tied once
        optimizer.pt         torch.optim state_dict
        meta.json            format version, run config, step, tokens seen, loader state,
                             python / numpy / torch RNG states

A checkpoint is written into `<out>/checkpoints/.tmp-step_...` and renamed into place with
`os.replace`, so a directory named `step_*` is always complete; a crash leaves at most a `.tmp-*`
directory, which `latest_checkpoint` ignores and the next save removes.

meta.json records the size and SHA-256 of every other file of the checkpoint (`files`), so a file
truncated or changed after the save (a full disk, a bad copy) is found before it is loaded. On
resume `resume_checkpoint` verifies the newest checkpoint (files present, sizes, the safetensors
header, checksums); a damaged one is moved aside to `checkpoints/damaged-step_*` with one line
saying why, and the newest intact one is used (none intact: an error, nothing moved).
Checkpoints saved before checksums were recorded get the checks that need none. Cost, measured
on one core with SHA-NI: SHA-256 streams at 1-1.8 GB/s (blake2b ~0.9, zlib crc32 ~3.2), so
~2 ms for the tiny test models and ~0.7 s for 600 MB (50M fp32 parameters + AdamW state, whose
save takes ~2.2 s without it): 0.5-1 s per GB of checkpoint, once per save and once per resume.

A sharded checkpoint (`train.checkpoint_format`, written by `hybridlm.train.distributed.dcp` with
torch.distributed.checkpoint: every rank writes its own shards) lives under the same names: a
`step_*` directory with DCP's `.metadata` and `__<rank>_0.distcp` files and a meta.json whose
`format` is `SHARDED_FORMAT`. `read_meta`, `verify_checkpoint` and `resume_checkpoint` handle both
formats; `hybridlm.io.sharded` reads a sharded one offline.

This module knows files only: `hybridlm.io.load` builds models from it, `train.checkpoint` holds
what a run does around it (its run directory, merging).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import random
import shutil
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from ..config import ModelConfig
from ..presets import get_preset

FORMAT = "hybridlm-train-checkpoint"
FORMAT_VERSION = 1
SHARDED_FORMAT = "hybridlm-train-checkpoint-sharded"  # DCP shards, `hybridlm.train.distributed.dcp`
SHARDED_FORMAT_VERSION = 1
_VERSIONS = {FORMAT: FORMAT_VERSION, SHARDED_FORMAT: SHARDED_FORMAT_VERSION}
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of every tensor's chunks
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = "damaged-"
_CHUNK = 1 << 20  # checksum reads


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable meta.json, a missing or truncated file, a
    checksum mismatch, a corrupt safetensors header or optimizer archive."""


# ---------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU + every CUDA device) RNG states, JSON-able."""
    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [
            base64.b64encode(s.cpu().numpy().tobytes()).decode()
            for s in torch.cuda.get_rng_state_all()
        ]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state()` captured."""
    v, inner, gauss = state["python"]
    random.setstate((v, tuple(inner), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in state["cuda"]])


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


# ---------------------------------------------------------------------- save / discover / load
def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def fsync_dir(path: Path) -> None:
    """Make a rename or new file in `path` durable (best effort: not every filesystem can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    out_dir: str | Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    meta: Mapping[str, Any],
    keep_last_n: int = 0,
) -> Path:
    """Write `<out>/checkpoints/step_<step>` atomically; keep the newest `keep_last_n` (0: all).

    `meta` (JSON-able) is stored with the format version, step, time and RNG states added."""
    tmp = new_checkpoint_tmp(out_dir, step)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))  # drops tied duplicates
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    files = {file.name: file_record(file) for file in sorted(tmp.iterdir())}
    full = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **dict(meta),
        "step": step,
        "saved_at": time.time(),
        "rng": rng_state(),
        "files": files,  # written last: the checksums of the files as they are on disk
    }
    return publish_checkpoint(tmp, out_dir, step, full, keep_last_n)


def new_checkpoint_tmp(out_dir: str | Path, step: int) -> Path:
    """The temporary directory a save of `step` writes into (not created), after removing the
    leftovers of a crashed save; only this directory's final rename publishes a checkpoint."""
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    return root / f"{TMP_PREFIX}{PREFIX}{step:08d}-{os.getpid()}"


def file_record(file: Path) -> dict[str, Any]:
    """A written file flushed to disk, and its size and SHA-256 for meta.json's `files`."""
    with open(file, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": file.stat().st_size, "sha256": file_sha256(file)}


def publish_checkpoint(
    tmp: Path, out_dir: str | Path, step: int, meta: Mapping[str, Any], keep_last_n: int
) -> Path:
    """Write `meta` as tmp/meta.json (last, fsynced), rename `tmp` into place as the step's
    checkpoint (replacing an earlier save of the same step), keep the newest `keep_last_n`."""
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    root = checkpoint_dir(out_dir)
    final = root / f"{PREFIX}{step:08d}"
    if final.exists():  # re-saving a step (e.g. a resumed run reaching it again)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    prune_checkpoints(out_dir, keep_last_n)
    return final


def prune_checkpoints(out_dir: str | Path, keep_last_n: int) -> None:
    """Remove all but the newest `keep_last_n` checkpoints of a run (0: keep all)."""
    if keep_last_n:
        for old in list_checkpoints(out_dir)[:-keep_last_n]:
            shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (`.tmp-*` directories are ignored)."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        suffix = path.name[len(PREFIX) :]
        if path.name.startswith(PREFIX) and suffix.isdigit() and (path / "meta.json").is_file():
            found.append((int(suffix), path))
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def read_meta(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a checkpoint directory (no meta.json)")
    try:
        meta = json.loads(meta_file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{meta_file} is not valid JSON ({err})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file} is not a JSON object")
    fmt = meta.get("format")
    if fmt not in _VERSIONS or meta.get("format_version") != _VERSIONS[fmt]:
        raise CheckpointError(
            f"{meta_file}: format {meta.get('format')!r} v{meta.get('format_version')} is not "
            f"{FORMAT} v{FORMAT_VERSION} or {SHARDED_FORMAT} v{SHARDED_FORMAT_VERSION}"
        )
    return meta


def is_sharded_checkpoint(meta: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's meta.json (`read_meta`) is of a sharded (DCP) checkpoint."""
    return meta.get("format") == SHARDED_FORMAT


def checkpoint_model_config(path: str | Path) -> ModelConfig:
    """The model config of a checkpoint's run (`run_config.model` in its meta.json: a preset
    name or a ModelConfig mapping)."""
    run_config = read_meta(path).get("run_config") or {}
    if "model" not in run_config:
        raise ValueError(
            f"{Path(path) / 'meta.json'} has no run_config.model to build the model from"
        )
    spec = run_config["model"]
    return get_preset(spec) if isinstance(spec, str) else ModelConfig.from_dict(spec)


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load weights (and optimizer state, RNG states) from a checkpoint; returns its meta."""
    path = Path(path)
    meta = read_meta(path)
    if is_sharded_checkpoint(meta):
        raise ValueError(
            f"{path} is a sharded checkpoint: hybridlm.io.load_model reads its weights, "
            "the Trainer (hybridlm.train.distributed.dcp.load_sharded) resumes it"
        )
    weights = path / "model.safetensors"
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{weights} cannot be read ({err})") from None
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]} (a different model config?)"
        )
    if optimizer is not None:
        opt_file = path / "optimizer.pt"
        if not opt_file.is_file():
            raise ValueError(f"checkpoint {path} has no optimizer.pt; cannot resume training")
        device = next(model.parameters()).device
        try:
            state = torch.load(opt_file, map_location=device, weights_only=True)
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(f"{opt_file} cannot be read ({reason})") from None
        optimizer.load_state_dict(state)
    if restore_rng:
        set_rng_state(meta["rng"])
    return meta


def resolve_checkpoint(path: str | Path) -> Path:
    """A training checkpoint directory, or a run directory (its newest checkpoint)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(f"{path} is neither a checkpoint directory nor a run with checkpoints")
    return latest


# ---------------------------------------------------------------------- verify / resume
def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file, streamed in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_checkpoint(path: str | Path, *, checksums: bool = True) -> dict[str, Any]:
    """Check that a checkpoint can be loaded; returns its meta, raises `CheckpointError` naming
    the first problem. Checked: meta.json (JSON, format), every file meta.json records (present,
    size, SHA-256 unless `checksums=False`), model.safetensors present with a header that parses
    and covers the file, optimizer.pt (when present) a complete zip archive. A checkpoint saved
    before sizes and checksums were recorded gets the last two checks only. A sharded checkpoint
    records every file it has (DCP's `.metadata` and each rank's shards), so the recorded ones
    are all checked, and `.metadata` must be among them."""
    path = Path(path)
    meta = read_meta(path)
    files = meta.get("files") or {}
    if is_sharded_checkpoint(meta) and DCP_METADATA not in files:
        raise CheckpointError(f"meta.json of a sharded checkpoint records no {DCP_METADATA}")
    for name, rec in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{name} is missing")
        size = file.stat().st_size
        if size != rec.get("bytes", size):
            raise CheckpointError(f"{name} has {size} bytes, {rec['bytes']} were saved")
        if checksums and "sha256" in rec and file_sha256(file) != rec["sha256"]:
            raise CheckpointError(f"{name} does not match its SHA-256 in meta.json")
    if is_sharded_checkpoint(meta):
        return meta
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError("model.safetensors is missing")
    try:
        with safe_open(str(weights), "pt") as f:
            f.keys()
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"model.safetensors: {err}") from None
    opt = path / "optimizer.pt"
    if opt.exists() and "optimizer.pt" not in files and not zipfile.is_zipfile(opt):
        raise CheckpointError("optimizer.pt is not a complete archive")
    return meta


def resume_checkpoint(
    out_dir: str | Path,
    *,
    checksums: bool = True,
    move_aside: bool = True,
    log: Callable[[str], None] = print,
) -> Path | None:
    """The newest intact checkpoint of a run (`verify_checkpoint`), or None when it has none.

    Each damaged newer checkpoint is skipped with one line to `log` saying why and (`move_aside`)
    renamed to `checkpoints/damaged-step_*`: kept for inspection, but out of the run's sequence
    (keep-last-N, merging, the next resume). When every checkpoint is damaged nothing is moved
    and a `CheckpointError` names each problem."""
    found = list_checkpoints(out_dir)
    damaged: list[tuple[Path, str]] = []
    for path in reversed(found):
        try:
            verify_checkpoint(path, checksums=checksums)
        except (CheckpointError, OSError) as err:
            damaged.append((path, str(err)))
            continue
        for bad, reason in damaged:
            where = ""
            if move_aside:
                aside = bad.with_name(DAMAGED_PREFIX + bad.name)
                n = 1
                while aside.exists():
                    n += 1
                    aside = bad.with_name(f"{DAMAGED_PREFIX}{bad.name}.{n}")
                bad.rename(aside)
                where = f"; moved to {aside}"
            log(f"resume: skipped damaged checkpoint {bad} ({reason}){where}")
        return path
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint under {checkpoint_dir(out_dir)} to resume from ("
            + "; ".join(f"{p.name}: {reason}" for p, reason in damaged)
            + "); start again with --overwrite"
        )
    return None
