"""Training checkpoints: boring, versioned, atomic (DESIGN habit 14), plus checkpoint merging.

    <out>/checkpoints/step_00000500/
        model.safetensors    weights and persistent buffers (MoE correction bias), tied once
        optimizer.pt         torch.optim state_dict
        meta.json            format version, run config, step, tokens seen, loader state,
                             python / numpy / torch RNG states

A checkpoint is written into `<out>/checkpoints/.tmp-step_...` and renamed into place with
`os.replace`, so a directory named `step_*` is always complete; a crash leaves at most a `.tmp-*`
directory, which `latest_checkpoint` ignores and the next save removes.

Merging (Nemotron 3 Super §2.5; WSM, Tian et al. 2025): `merge_checkpoints(paths, "minus_sqrt")`
averages a window of checkpoints with weights that emulate a minus-sqrt LR decay over it.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_model
from torch import nn

FORMAT = "hybridlm-train-checkpoint"
FORMAT_VERSION = 1
PREFIX = "step_"
TMP_PREFIX = ".tmp-"


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


def _fsync_dir(path: Path) -> None:
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
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(TMP_PREFIX + "*"):  # leftovers of a crashed save
        shutil.rmtree(stale, ignore_errors=True)
    name = f"{PREFIX}{step:08d}"
    tmp = root / f"{TMP_PREFIX}{name}-{os.getpid()}"
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))  # drops tied duplicates
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    full = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **dict(meta),
        "step": step,
        "saved_at": time.time(),
        "rng": rng_state(),
    }
    with open(tmp / "meta.json", "w") as f:
        json.dump(full, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for file in tmp.iterdir():
        if file.name != "meta.json":
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    final = root / name
    if final.exists():  # re-saving a step (e.g. a resumed run reaching it again)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    if keep_last_n:
        for old in list_checkpoints(out_dir)[:-keep_last_n]:
            shutil.rmtree(old, ignore_errors=True)
    return final


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
        raise ValueError(f"{path} is not a checkpoint directory (no meta.json)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{meta_file}: format {meta.get('format')!r} v{meta.get('format_version')} is not "
            f"{FORMAT} v{FORMAT_VERSION}"
        )
    return meta


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
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
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
        optimizer.load_state_dict(torch.load(opt_file, map_location=device, weights_only=True))
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


def model_from_checkpoint(path: str | Path, *, dtype: torch.dtype | None = None):
    """The model of a training checkpoint (or of a run's newest one), built from the run config
    stored in its meta.json, weights loaded, in eval mode."""
    from ..config import ModelConfig
    from ..model.model import HybridLM

    path = resolve_checkpoint(path)
    meta = read_meta(path)
    cfg = ModelConfig.from_dict(meta["run_config"]["model"])
    with torch.device("meta"):
        model = HybridLM(cfg)
    model.to_empty(device="cpu")
    model.init_buffers()
    load_checkpoint(path, model, restore_rng=False)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def tokenizer_for(path: str | Path) -> Any:
    """The tokenizer a checkpoint was trained with: a training checkpoint or run directory reads
    `data.tokenizer` from its run config; a transformers directory uses its `tokenizer.json`,
    else the byte tokenizer (the embedded default)."""
    from ..data.bpe import load_tokenizer

    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return load_tokenizer(path)
    if (path / "meta.json").is_file() or (path / "checkpoints").is_dir():
        data = read_meta(resolve_checkpoint(path))["run_config"].get("data") or {}
        spec = data.get("tokenizer", "byte")
        if spec != "byte" and not Path(spec).exists():
            raise ValueError(
                f"{path} was trained with the tokenizer at {spec}, which does not exist here"
            )
        return load_tokenizer(spec)
    return load_tokenizer("byte")


# ---------------------------------------------------------------------- merging
def merge_weights(n: int, kind: str = "uniform") -> list[float]:
    """Weights for averaging `n` checkpoints, oldest first; they sum to 1.

    `uniform`: 1/n each. `minus_sqrt` (WSM-style emulation of a minus-sqrt decay over the
    window, Nemotron 3 Super §2.5): with theta_j = theta_1 + sum_{i<=j} g_i, the average
    sum_j c_j theta_j scales update g_i by sum_{j>=i} c_j; setting that to the decay
    multiplier w_i = 1 - sqrt((i - 1) / n) (w_1 = 1, w_{n+1} = 0) gives
    c_j = (sqrt(j) - sqrt(j - 1)) / sqrt(n): the oldest checkpoint weighs most.
    """
    if n < 1:
        raise ValueError(f"need at least one checkpoint to merge, got {n}")
    if kind == "uniform":
        return [1.0 / n] * n
    if kind == "minus_sqrt":
        return [(j**0.5 - (j - 1) ** 0.5) / n**0.5 for j in range(1, n + 1)]
    raise ValueError(f"unknown merge weighting {kind!r}; use uniform or minus_sqrt")


def merge_state_dicts(
    states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> dict[str, torch.Tensor]:
    """sum_k weights[k] * states[k], in fp32, cast back to each tensor's dtype."""
    if not states or len(states) != len(weights):
        raise ValueError(f"need one weight per state dict, got {len(states)} and {len(weights)}")
    keys = set(states[0])
    for k, s in enumerate(states[1:], 1):
        if set(s) != keys:
            raise ValueError(f"state dict {k} has different keys: {sorted(keys ^ set(s))[:5]}")
    out = {}
    for key in states[0]:
        ref = states[0][key]
        if not ref.is_floating_point():  # counters etc.: take the newest
            out[key] = states[-1][key].clone()
            continue
        acc = torch.zeros_like(ref, dtype=torch.float32)
        for s, w in zip(states, weights, strict=True):
            acc += w * s[key].float()
        out[key] = acc.to(ref.dtype)
    return out


def merge_checkpoints(
    paths: Sequence[str | Path], weights: str | Sequence[float] = "minus_sqrt"
) -> dict[str, torch.Tensor]:
    """Weighted average of the weights of checkpoints `paths` (oldest first). `weights`:
    "uniform", "minus_sqrt" or explicit numbers. Load the result with
    `model.load_state_dict(merged, strict=False)` (tied weights are stored once)."""
    paths = [Path(p) for p in paths]
    w = merge_weights(len(paths), weights) if isinstance(weights, str) else list(weights)
    states = [load_file(str(p / "model.safetensors")) for p in paths]
    return merge_state_dicts(states, w)
