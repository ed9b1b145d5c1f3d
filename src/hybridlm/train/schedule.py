"""Learning-rate schedules as pure functions of the optimizer step.

`step` is the 0-based index of the optimizer step about to run; `total_steps` the run length.

- warmup (every kind): lr = peak * (step + 1) / warmup_steps for step < warmup_steps (the first
  step already moves the weights).
- `wsd` (warmup-stable-decay, MiniCPM; Nemotron 3 Super §2.4): peak until `t_decay = total -
  round(decay_fraction * total)`, then over `T_decay = total - t_decay` steps
  `minus_sqrt`: lr = min + (peak - min) * (1 - sqrt((step - t_decay) / T_decay))
  (with min = 0 this is the paper's peak * (1 - sqrt((t - t_decay) / T_decay))),
  or `linear` / `cosine` decay shapes over the same window.
- `cosine`: after warmup, min + (peak - min) * (1 + cos(pi * p)) / 2 with
  p = (step - warmup) / (total - warmup); `linear`: min + (peak - min) * (1 - p) (Olmo 3).
- `constant`: peak after warmup (long-context continued pretraining).
"""

from __future__ import annotations

import math

from .config import TrainConfig


def _decay(shape: str, p: float) -> float:
    """Multiplier in [0, 1] at decay progress p in [0, 1]."""
    p = min(max(p, 0.0), 1.0)
    if shape == "minus_sqrt":
        return 1.0 - math.sqrt(p)
    if shape == "linear":
        return 1.0 - p
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown decay shape {shape!r}; use minus_sqrt, linear or cosine")


def lr_at(
    step: int,
    *,
    kind: str,
    peak_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr: float = 0.0,
    decay_fraction: float = 0.2,
    decay_shape: str = "minus_sqrt",
) -> float:
    """The learning rate of optimizer step `step` (0-based) of a `total_steps` run."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    span = peak_lr - min_lr
    if kind == "constant":
        return peak_lr
    if kind == "wsd":
        t_decay_len = round(decay_fraction * total_steps)
        t_decay = total_steps - t_decay_len
        if step < t_decay or t_decay_len == 0:
            return peak_lr
        return min_lr + span * _decay(decay_shape, (step - t_decay) / t_decay_len)
    if kind in ("cosine", "linear"):
        length = max(1, total_steps - warmup_steps)
        return min_lr + span * _decay(kind, (step - warmup_steps) / length)
    raise ValueError(f"unknown schedule {kind!r}; use wsd, cosine, linear or constant")


def lr_for(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """`lr_at` with the settings of a `TrainConfig`."""
    return lr_at(
        step,
        kind=cfg.schedule,
        peak_lr=cfg.lr,
        total_steps=total_steps,
        warmup_steps=cfg.warmup_steps,
        min_lr=cfg.min_lr,
        decay_fraction=cfg.decay_fraction,
        decay_shape=cfg.decay_shape,
    )
