"""AdamW with decay / no-decay parameter groups (Nemotron 3 Super §2.4: beta 0.9/0.95, wd 0.1),
and `optimizer_step`, the one update every training stage takes.

No weight decay on parameters whose name has a dotted component matching one of the
`no_decay` globs (default: norms, biases, Mamba's A_log / D / dt_bias, the embedding table) and,
with `no_decay_1d`, on every parameter with fewer than 2 dimensions. Tied weights appear once.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..model.moe import MoE
from .config import TrainConfig
from .schedule import lr_for


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
    """AdamW over `param_groups`; the trainer sets each group's `lr` every step. On CUDA the
    fused implementation (one kernel for the whole update of a parameter list); elsewhere
    `foreach` (multi-tensor ops, the CPU runs' arithmetic of record)."""
    groups = param_groups(
        model, weight_decay=cfg.weight_decay, no_decay=cfg.no_decay, no_decay_1d=cfg.no_decay_1d
    )
    cuda = all(p.is_cuda for g in groups for p in g["params"]) and bool(groups)
    impl = {"fused": True} if cuda else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)


def clip_gradients(params: Iterable[torch.Tensor], grad_clip: float) -> float:
    """Clip the global gradient norm to `grad_clip` (0: no clipping) and return the norm before
    clipping (inf / nan when a gradient is not finite; FSDP2's DTensor norm made whole).

    Sharded gradients live on different device meshes under expert parallelism (FSDP2's
    data-parallel mesh, the experts' (data, expert) mesh): each mesh's norm is taken on its own
    and made whole, then they are combined (torchtitan's EP-aware clipping)."""
    params = list(params)
    max_norm = grad_clip if grad_clip > 0 else math.inf
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            mesh = getattr(p.grad, "device_mesh", None)
            groups.setdefault((mesh, getattr(p.grad, "placements", None)), []).append(p.grad)
    if len(groups) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        return float(norm)
    norms = []
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    total = float(torch.linalg.vector_norm(torch.stack(norms)))
    coef = max_norm / (total + 1e-6)  # clip_grad_norm_'s coefficient
    if coef < 1 and math.isfinite(total):
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


@dataclass(frozen=True)
class StepOutcome:
    """What `optimizer_step` did: `finite` (False: skipped, nothing changed), the gradient norm
    before clipping and the learning rate of the step."""

    finite: bool
    grad_norm: float
    lr: float


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    params: Iterable[torch.Tensor],
    *,
    loss: float,
    tc: TrainConfig,
    step: int,
    total_steps: int,
    grad_norm: float | None = None,
    reduce_load: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> StepOutcome:
    """One update after the backward passes of a step, the same for every training stage:

    1. clip the gradients to `tc.grad_clip` (`grad_norm` given: the caller clipped already);
    2. the schedule's learning rate for `step` (`lr_for`);
    3. if the step's `loss` and gradient norm are finite: set the rate, `optimizer.step()`, and
       the MoE aux-loss-free bias update of the MoE layers in `model` (the trained module) from
       this step's expert load (Nemotron 3 Super §2.1.1; `reduce_load` sums the [layers,
       experts] load over data-parallel ranks); otherwise nothing changes and the step's routing
       counts are dropped, so that they do not reach the next bias update;
    4. zero the gradients."""
    if grad_norm is None:
        grad_norm = clip_gradients(params, tc.grad_clip)
    lr = lr_for(tc, step, total_steps)
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    if finite:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        load = None
        if reduce_load is not None and moe:
            load = reduce_load(torch.stack([m.load_E for m in moe]))
        for i, m in enumerate(moe):
            m.update_bias(None if load is None else load[i])
    else:
        for m in moe:  # this step's routing counts are not applied
            m.load_E.zero_()
    optimizer.zero_grad(set_to_none=True)
    return StepOutcome(finite, grad_norm, lr)
