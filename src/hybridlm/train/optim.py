"""AdamW with decay / no-decay parameter groups (Nemotron 3 Super §2.4: beta 0.9/0.95, wd 0.1).

No weight decay on parameters whose name has a dotted component matching one of the
`no_decay` globs (default: norms, biases, Mamba's A_log / D / dt_bias, the embedding table) and,
with `no_decay_1d`, on every parameter with fewer than 2 dimensions. Tied weights appear once.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import torch
from torch import nn

from .config import TrainConfig


def is_no_decay(name: str, param: torch.Tensor, patterns: Sequence[str], no_decay_1d: bool) -> bool:
    """Does parameter `name` skip weight decay?"""
    if no_decay_1d and param.ndim < 2:
        return True
    return any(fnmatch.fnmatchcase(part, pat) for part in name.split(".") for pat in patterns)


def param_groups(
    model: nn.Module,
    *,
    weight_decay: float,
    no_decay: Sequence[str],
    no_decay_1d: bool = True,
) -> list[dict]:
    """Two AdamW groups, `decay` and `no_decay` (each with a `names` list for inspection)."""
    groups = {
        "decay": {"name": "decay", "params": [], "names": [], "weight_decay": weight_decay},
        "no_decay": {"name": "no_decay", "params": [], "names": [], "weight_decay": 0.0},
    }
    for name, p in model.named_parameters():  # shared (tied) parameters are yielded once
        if not p.requires_grad:
            continue
        key = "no_decay" if is_no_decay(name, p, no_decay, no_decay_1d) else "decay"
        groups[key]["params"].append(p)
        groups[key]["names"].append(name)
    return [g for g in groups.values() if g["params"]]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups`; the trainer sets each group's `lr` every step."""
    groups = param_groups(
        model, weight_decay=cfg.weight_decay, no_decay=cfg.no_decay, no_decay_1d=cfg.no_decay_1d
    )
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True
    )
