"""AutoQuantize: per-operator format choice among {NVFP4, FP8, BF16} under an effective-bits
budget (Nemotron 3 Super §4.2 and Appendix B.2; ModelOpt AutoQuantize; notes §5.2).

Sensitivity of decision unit i under format f (second-order Taylor expansion of the loss in the
operator's output with the diagonal empirical Fisher as the Hessian, as LLM-MQ):

    S_i(f) = sum over calibration tokens and output features of  Δy_i(f)^2 * g_i^2,
    Δy_i(f) = y_i(quantised weights and inputs in f) - y_i(unquantised),  g_i = dL/dy_i,

measured at the operator's output; BF16 (unquantised) has S = 0. Decision units:
  * Q, K and V of an attention layer (and SwiGLU gate / up) are fused by inference engines:
    one decision, S = S_q + S_k + S_v (second-order terms stay additive across branches).
  * all routed experts of a MoE layer (up and down projections): one decision (the quantised
    MoE kernels of vLLM / TRT-LLM need one format per layer), with Δy and g at the MoE module's
    output, cost summed over the experts.

Cost model: effective bits per weight including the scale overhead, BITS = {nvfp4: 4.5
(4 + 8/16: one E4M3 scale per 16 weights), fp8: 8, bf16: 16}; the average over the quantisable
operators is weighted by parameter count ("params", the memory footprint; default) or by
multiply-accumulates per token ("flops", active experts only). The budget bounds that average
(default 4.75 bits).

Solve: minimise sum_i S_i(f_i) s.t. sum_i w_i * bits(f_i) <= budget * sum_i w_i, a multiple-choice
knapsack, exactly, by dynamic programming over the integer cost slack (costs in half-bits are
integers; the slack is divided by the gcd of all cost increments, which keeps the table small
for real layer shapes). Optimality is tested against brute force on random instances.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..model.moe import MoE
from ..ops.cross_entropy import lm_cross_entropy
from .ptq import (
    BITS,
    DEFAULT_EXCLUDE,
    FORMATS,
    NVFP4_GROUP,
    CalibStats,
    Op,
    check_format,
    find_ops,
    groups_of,
    quantized_group,
)

CostMode = Literal["params", "flops"]
MAX_DP_STATES = 50_000_000  # groups x slack cells of the DP table


# ============================================================================ knapsack
@dataclass(kw_only=True)
class KnapsackSolution:
    choice: list[int]  # index of the chosen option per group
    value: float  # sum of the chosen values
    cost: int  # sum of the chosen costs
    exact: bool  # False only when the slack had to be coarsened (see solve_mckp)


def solve_mckp(
    costs: Sequence[Sequence[int]],
    values: Sequence[Sequence[float]],
    budget: int,
    *,
    max_states: int = MAX_DP_STATES,
) -> KnapsackSolution:
    """Exact multiple-choice knapsack: pick one option j per group g minimising
    sum values[g][j] subject to sum costs[g][j] <= budget (non-negative integer costs).

    DP over the slack above the all-cheapest cost, in units of the gcd of the cost increments.
    If that table would exceed `max_states` cells, increments are rounded up to a coarser unit
    (every returned plan still fits the budget; `exact` is then False)."""
    if len(costs) != len(values) or any(
        len(c) != len(v) or not c for c, v in zip(costs, values, strict=True)
    ):
        raise ValueError("costs and values need the same non-empty option lists per group")
    if any(int(c) != c or c < 0 for cs in costs for c in cs):
        raise ValueError("costs must be non-negative integers")
    G = len(costs)
    base = [min(cs) for cs in costs]
    slack = budget - sum(base)
    if slack < 0:
        raise ValueError(
            f"infeasible budget: the cheapest choice everywhere costs {sum(base)} > {budget}"
        )
    extra = [[int(c) - b for c in cs] for cs, b in zip(costs, base, strict=True)]
    unit = math.gcd(*[e for es in extra for e in es if e]) if any(any(es) for es in extra) else 1
    cap = min(slack // unit, sum(max(es) for es in extra) // unit)
    exact = True
    if G * (cap + 1) > max_states:
        coarse = math.ceil(G * (cap + 1) / max_states)
        unit *= coarse
        cap = slack // unit
        exact = False
    steps = [[-(-e // unit) for e in es] for es in extra]  # ceil: never under-counts a cost
    # dp[c] = least value of the groups so far with total steps <= c ("at most" formulation)
    dp = np.zeros(cap + 1, dtype=np.float64)
    pick = np.zeros((G, cap + 1), dtype=np.int8)
    for g in range(G):
        new = np.full(cap + 1, np.inf)
        for j, (s, v) in enumerate(zip(steps[g], values[g], strict=True)):
            if s > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[s:] = dp[: cap + 1 - s] + float(v)
            better = cand < new
            new = np.where(better, cand, new)
            pick[g] = np.where(better, j, pick[g])
        dp = new
    choice = [0] * G
    c = cap
    for g in range(G - 1, -1, -1):
        j = int(pick[g, c])
        choice[g] = j
        c -= steps[g][j]
    total_cost = sum(int(costs[g][j]) for g, j in enumerate(choice))
    total_value = sum(float(values[g][j]) for g, j in enumerate(choice))
    assert total_cost <= budget and c >= 0
    return KnapsackSolution(choice=choice, value=total_value, cost=total_cost, exact=exact)


# ============================================================================ sensitivities
def _op_weight(op: Op, mode: CostMode) -> int:
    if mode == "params":
        return op.params
    if mode == "flops":
        return op.macs_per_token
    raise ValueError(f"cost mode must be 'params' or 'flops', got {mode!r}")


def _candidates(members: list[Op], formats: Sequence[str]) -> list[str]:
    # NVFP4 needs reduction widths that 16-element blocks tile
    ok_fp4 = all(op.k % NVFP4_GROUP == 0 for op in members)
    return [f for f in formats if f != "nvfp4" or ok_fp4]


def _moe_of(model: nn.Module, experts_name: str) -> MoE:
    mod = model.get_submodule(experts_name.rpartition(".")[0])
    assert isinstance(mod, MoE)
    return mod


def _quant_modules(
    model: nn.Module,
    groups: dict[str, list[Op]],
    formats: Sequence[str],
    stats: CalibStats,
    weight_scale: str,
) -> dict[tuple[str, str], nn.Module]:
    """(op name, format) -> the module the converter would build (fused groups' shared scales
    included), for every candidate format but BF16."""
    out: dict[tuple[str, str], nn.Module] = {}
    for members in groups.values():
        for fmt in _candidates(members, formats):
            if fmt != "bf16":
                built = quantized_group(model, members, fmt, stats, weight_scale)
                out.update({(name, fmt): mod for name, mod in built.items()})
    return out


def _lm_loss(model: nn.Module, out, labels_BL: torch.Tensor) -> torch.Tensor:
    """The pretraining objective whose gradients weigh the sensitivities: next-token CE plus
    `mtp.loss_weight` x the mean CE of the MTP depths (Nemotron 3 Super §2.1.2), fused with the
    LM head (eval mode: no MoE balancing term)."""
    W_VD = model.lm_head.weight
    loss = lm_cross_entropy(out.hidden, labels_BL, lm_head_VD=W_VD)
    if out.mtp_hidden:
        mtp = torch.stack(
            [
                lm_cross_entropy(h_k, labels_BL, lm_head_VD=W_VD, shift=k + 1)
                for k, h_k in enumerate(out.mtp_hidden, start=1)
            ]
        ).mean()
        loss = loss + model.config.mtp.loss_weight * mtp
    return loss


def measure_sensitivities(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    stats: CalibStats,
    *,
    formats: Sequence[str] = FORMATS,
    exclude: Iterable[str] = DEFAULT_EXCLUDE,
    weight_scale: str = "mse",
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict[str, float]]:
    """{decision group: {format: S}} from calibration forward + backward passes (the model is
    not modified; its parameter gradients are cleared afterwards)."""
    for f in formats:
        check_format(f)
    ops = find_ops(model, exclude)
    groups = groups_of(ops)
    qmods = _quant_modules(model, groups, formats, stats, weight_scale)
    sens = {g: dict.fromkeys(_candidates(m, formats), 0.0) for g, m in groups.items()}
    # where Δy and g are taken: the linear itself, or the MoE module for a layer's experts
    sites = {
        op.name: (_moe_of(model, op.name) if op.kind == "experts" else model.get_submodule(op.name))
        for op in ops
    }
    with_mtp = any(op.name.startswith(("mtp.", "mtp_depths.")) for op in ops)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for i, batch in enumerate(batches):
            captured: dict[str, list] = {}
            handles = []
            for name, site in sites.items():

                def hook(m, args, kwargs, y, name=name, captured=captured):
                    rec = [args[0].detach(), kwargs, None]
                    captured[name] = rec
                    if y.requires_grad:
                        y.register_hook(lambda g, rec=rec: rec.__setitem__(2, g.detach()))

                handles.append(site.register_forward_hook(hook, with_kwargs=True))
            try:
                with torch.enable_grad():
                    ids = batch["input_ids"].to(device)
                    labels = batch["labels"].to(device)
                    depth = model.train_mtp_depth if with_mtp else 0
                    out = model(ids, mtp_depth=depth, return_logits=False)
                    _lm_loss(model, out, labels).backward()
            finally:
                for h in handles:
                    h.remove()
                model.zero_grad(set_to_none=True)
            with torch.no_grad():
                for group, members in groups.items():
                    for fmt in sens[group]:
                        if fmt == "bf16":
                            continue
                        for op in members:
                            sens[group][fmt] += _sensitivity(
                                op, fmt, sites[op.name], captured.get(op.name), qmods
                            )
            if progress is not None:
                progress(i + 1)
    finally:
        model.train(was_training)
    return sens


def _sensitivity(op: Op, fmt: str, site: nn.Module, rec, qmods) -> float:
    """sum (Δy^2 g^2) of one operator and format on the captured batch."""
    if rec is None or rec[2] is None:  # not on the loss path of this batch
        return 0.0
    x, kwargs, g = rec
    if op.kind == "linear":
        y_ref = F.linear(x, site.weight)
        y_q = qmods[(op.name, fmt)](x)
    else:
        moe: MoE = site
        kept, decode = moe.experts, moe.decode_fn
        moe.decode_fn = None  # the generic path, whatever the batch size
        try:
            y_ref = moe(x, **kwargs)
            moe.experts = qmods[(op.name, fmt)]
            y_q = moe(x, **kwargs)
        finally:
            moe.experts, moe.decode_fn = kept, decode
    return float(((y_q - y_ref).double().square() * g.double().square()).sum())


# ============================================================================ AutoQuantize
@dataclass(kw_only=True)
class GroupChoice:
    group: str
    ops: list[str]
    params: int
    weight: int  # cost weight (params or MACs per token)
    format: str
    sensitivity: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class AutoQuantResult:
    plan: dict[str, str]  # op name -> format, for ptq.quantize_model
    groups: list[GroupChoice]
    budget: float
    cost_mode: str
    effective_bits: float  # weighted by the cost mode
    param_bits: float  # parameter-weighted, whatever the cost mode
    total_sensitivity: float
    exact: bool


def autoquantize(
    sens: dict[str, dict[str, float]],
    ops: list[Op],
    *,
    budget: float = 4.75,
    cost: CostMode = "params",
) -> AutoQuantResult:
    """Choose one format per decision group minimising sum S under the effective-bits budget."""
    if budget <= 0:
        raise ValueError(f"budget must be positive (bits per weight), got {budget}")
    groups = groups_of(ops)
    names = [g for g in groups if g in sens]
    if not names:
        raise ValueError("no quantisable operators to choose formats for")
    options = [list(sens[g]) for g in names]
    weights = [sum(_op_weight(op, cost) for op in groups[g]) for g in names]
    # costs in half-bits: integers (4.5 -> 9)
    costs = [[w * int(2 * BITS[f]) for f in opts] for w, opts in zip(weights, options, strict=True)]
    values = [[sens[g][f] for f in opts] for g, opts in zip(names, options, strict=True)]
    limit = Fraction(str(budget)) * 2 * sum(weights)
    sol = solve_mckp(costs, values, math.floor(limit))
    chosen = [opts[j] for opts, j in zip(options, sol.choice, strict=True)]
    plan = {op.name: f for g, f in zip(names, chosen, strict=True) for op in groups[g]}
    rows = [
        GroupChoice(
            group=g,
            ops=[op.name for op in groups[g]],
            params=sum(op.params for op in groups[g]),
            weight=w,
            format=f,
            sensitivity=dict(sens[g]),
        )
        for g, w, f in zip(names, weights, chosen, strict=True)
    ]
    n_params = sum(r.params for r in rows)
    return AutoQuantResult(
        plan=plan,
        groups=rows,
        budget=budget,
        cost_mode=cost,
        effective_bits=sol.cost / (2 * sum(weights)),
        param_bits=sum(r.params * BITS[r.format] for r in rows) / n_params,
        total_sensitivity=sol.value,
        exact=sol.exact,
    )


def print_table(result: AutoQuantResult, console=None) -> None:
    """The chosen formats with sensitivities per candidate (rich table)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    fmts = [f for f in FORMATS if any(f in r.sensitivity for r in result.groups)]
    table = Table(
        title=f"AutoQuantize: budget {result.budget} bits ({result.cost_mode}-weighted) -> "
        f"{result.effective_bits:.3f} bits, sum S = {result.total_sensitivity:.3e}"
    )
    table.add_column("decision group", overflow="fold")
    table.add_column("ops", justify="right")
    table.add_column("params", justify="right")
    table.add_column("format")
    for f in fmts:
        table.add_column(f"S {f}", justify="right")
    for r in result.groups:
        table.add_row(
            r.group,
            str(len(r.ops)),
            f"{r.params:,}",
            r.format,
            *(f"{r.sensitivity[f]:.3e}" if f in r.sensitivity else "-" for f in fmts),
        )
    console.print(table)
