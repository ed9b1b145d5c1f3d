"""Training-health metrics of low-precision training (Nemotron 3 Super §2.3).

The paper tracks the fraction of exactly-zero weight-gradient elements per tensor (7% of the
parameters at the end of pretraining; NVFP4 produced ~3x more zero wgrads than BF16 on Nano) and
traces them to FP4 underflow: nonzero values quantised to zero in dgrad / fprop operands. This
module measures both on a converted model:

    zero_wgrad[name]       fraction of exactly-zero elements of each weight matrix's .grad
                           (>= 2-D parameters; the embedding is skipped: rows of tokens absent
                           from the batch are zero by construction)
    underflow[name]        (nonzero inputs quantised to 0) / (nonzero inputs) over the GEMM
                           operands of each quantised module (FP4 elements for NVFP4 layers,
                           E4M3 for MXFP8 ones), summed over the armed step's micro-batches;
                           summaries nvfp4_underflow_frac (and per operand: fprop_x, fprop_w,
                           dgrad_dy, wgrad_dy, wgrad_x) and mxfp8_underflow_frac

`LowPrecisionMonitor.arm()` before a step's forward/backward turns the (cheap, device-side)
underflow counters on; `collect()` after the backward reads everything and turns them off.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .qlinear import UnderflowStats


def zero_fraction(t: torch.Tensor) -> float:
    """Fraction of exactly-zero elements."""
    return float((t == 0).sum()) / max(1, t.numel())


class LowPrecisionMonitor:
    """Zero-wgrad fractions and FP4 underflow counts of a model converted by
    `convert_for_low_precision` (unconverted weight matrices are reported for comparison)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.controls = {}  # parameter name -> the GEMM control that quantises it
        for name, module in model.named_modules():
            if hasattr(module, "controls") and callable(module.controls):
                for pname, ctl in module.controls().items():
                    self.controls[f"{name}.{pname}" if name else pname] = ctl
        self.armed = False

    def arm(self) -> None:
        for ctl in self.controls.values():
            ctl.stats = UnderflowStats()
        self.armed = True

    def disarm(self) -> None:
        for ctl in self.controls.values():
            ctl.stats = None
        self.armed = False

    def collect(self) -> dict[str, Any]:
        """Metrics for metrics.jsonl: summaries as scalars, per-tensor values as dicts."""
        zero: dict[str, float] = {}
        zq = nq = zh = nh = 0
        for name, p in self.model.named_parameters():
            if p.grad is None or p.ndim < 2 or name.startswith("embeddings"):
                continue
            z = int((p.grad == 0).sum())
            zero[name] = z / p.numel()
            if name in self.controls:
                zq, nq = zq + z, nq + p.numel()
            else:
                zh, nh = zh + z, nh + p.numel()
        out: dict[str, Any] = {
            "zero_wgrad_frac": zq / nq if nq else 0.0,  # quantised weights, element-weighted
            "zero_wgrad_frac_hp": zh / nh if nh else 0.0,  # weight matrices left unquantised
            "zero_wgrad_frac_max": max((zero[n] for n in self.controls if n in zero), default=0.0),
            "zero_wgrad": zero,
        }
        if self.armed:
            per_tensor: dict[str, float] = {}
            by_operand: dict[str, list[int]] = {}
            by_format: dict[str, list[int]] = {"nvfp4": [0, 0], "mxfp8": [0, 0]}
            for name, ctl in self.controls.items():
                if ctl.stats is None:
                    continue
                u_t = n_t = 0
                for op, (u, n) in ctl.stats.totals().items():
                    if ctl.recipe.format == "nvfp4":
                        acc = by_operand.setdefault(op, [0, 0])
                        acc[0], acc[1] = acc[0] + u, acc[1] + n
                    u_t, n_t = u_t + u, n_t + n
                if n_t:
                    per_tensor[name] = u_t / n_t
                fmt = by_format[ctl.recipe.format]
                fmt[0], fmt[1] = fmt[0] + u_t, fmt[1] + n_t
            for fmt, (u, n) in by_format.items():
                out[f"{fmt}_underflow_frac"] = u / n if n else 0.0
            for op, (u, n) in by_operand.items():
                out[f"nvfp4_underflow_{op}"] = u / n if n else 0.0
            out["underflow"] = per_tensor
            self.disarm()
        return out
