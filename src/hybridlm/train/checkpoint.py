"""What a training run does around its checkpoints: the run directory it claims, the metrics
it replays after a resume, and checkpoint merging. The checkpoint format itself (save, load,
verify, resume) is `hybridlm.io.checkpoint`.

A run directory holds one run: `prepare_run_dir` refuses to start a new run where an earlier
one left `metrics.jsonl` or checkpoints unless it is resumed or explicitly overwritten.

Merging (Nemotron 3 Super §2.5; WSM, Tian et al. 2025): `merge_checkpoints(paths, "minus_sqrt")`
averages a window of checkpoints with weights that emulate a minus-sqrt LR decay over it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..io.checkpoint import DCP_METADATA, TMP_PREFIX, CheckpointError
from ..io.sharded import iter_model_tensors
from ..report.plot import read_metrics

METRICS = "metrics.jsonl"
RUN_OUTPUTS = (METRICS, "checkpoints")  # what a training run writes that a new run must not lose


# ---------------------------------------------------------------------- run directories
def _holds_output(path: Path) -> bool:
    if path.is_dir():  # a checkpoints/ with more than leftovers of a crashed save
        return any(not p.name.startswith(TMP_PREFIX) for p in path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def prepare_run_dir(
    out_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    outputs: Sequence[str] = RUN_OUTPUTS,
    remove: bool = True,
    log: Callable[[str], None] = print,
) -> Path:
    """Create the output directory of a run that writes `outputs` (names in it) there, without
    losing an earlier run's.

    When an earlier run left any of `outputs` (a non-empty file, a non-empty directory): with
    `resume` they are kept (the caller continues the run); with `overwrite` they are removed,
    with one line to `log` (`remove=False`, e.g. on non-main ranks, only checks); with neither,
    a `ValueError` asks for one of them. `resume` is only offered when the run writes
    checkpoints."""
    out = Path(out_dir)
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other: continue the run or replace it")
    if out.exists() and not out.is_dir():
        raise ValueError(f"output directory {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    found = [out / name for name in outputs if _holds_output(out / name)]
    if resume or not found:
        return out
    names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in found)
    if not overwrite:
        how = "replace it with --overwrite"
        if "checkpoints" in outputs:
            how = "continue it with --resume, " + how
        raise ValueError(
            f"{out} already holds a run ({names}); {how}, or choose another output directory"
        )
    if remove:
        for p in found:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
        log(f"overwrite: removed {names} of the earlier run in {out}")
    return out


def truncate_metrics(path: str | Path, step: int | None) -> None:
    """On resume from the checkpoint at `step`: drop the rows the interrupted run logged after it
    (they are logged again); `step=None` (resuming found no checkpoint) drops every row. Written
    to a temporary file and renamed, so a crash leaves the old log or the new one."""
    path = Path(path)
    if not path.exists():
        return
    if step is None:
        path.unlink()
        return
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    tmp.replace(path)


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
    states = []
    for p in paths:
        if (p / DCP_METADATA).exists():  # a sharded checkpoint (distributed.dcp), read offline
            states.append(dict(iter_model_tensors(p)))
            continue
        try:
            states.append(load_file(str(p / "model.safetensors")))
        except (OSError, SafetensorError) as err:
            raise CheckpointError(f"{p / 'model.safetensors'} cannot be read ({err})") from None
    return merge_state_dicts(states, w)
