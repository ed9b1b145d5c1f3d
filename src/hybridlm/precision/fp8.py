"""FP8 training of the linear layers the Nemotron 3 Super recipe quantises (Hopper and later),
through torchao's `Float8Linear` (dynamic scaling: e4m3 inputs and weights, e5m2 gradients).

Which layers: `policy.assign_formats` with the Super policy (§2.2), the same table as NVFP4
training. Every plain linear that the recipe puts in NVFP4 or MXFP8 trains in FP8; what the
recipe keeps in BF16 stays in the trainer's precision (the last 15% of the layers, attention
QKV/output, latent projections, MTP, embeddings and LM head; the router, norms, conv and SSM
parameters are not GEMMs of the recipe). Routed experts are 3-D grouped GEMMs, which
torchao's stable float8 API does not cover: they stay in BF16 and the report says so.
FP8 GEMMs also need both dimensions divisible by 16 (`torch._scaled_mm`); a layer that is not
stays in BF16 with that reason.

On a CPU torch emulates `torch._scaled_mm`, so the conversion and its training numerics are
tested there (`tests/test_precision_fp8.py`); the speed is a Hopper property
(`benchmarks/gpu_check.py --only train`).

DESIGN habit 12: a converter applied to a built model; parameters are reused, so state-dict
keys, shapes and optimizer references do not change.
"""

from __future__ import annotations

from torch import nn

from ..model.moe import Experts
from .policy import ConversionReport, ConversionRow, PrecisionPolicy, assign_formats


def fp8_plan(model: nn.Module, policy: PrecisionPolicy | None = None) -> list[ConversionRow]:
    """One row per GEMM module with "fp8" or "bf16" and the rule that decided (no change)."""
    rows = []
    for _name, module, row in assign_formats(model, policy or PrecisionPolicy()):
        if row.format == "bf16":
            rows.append(row)
            continue
        if isinstance(module, Experts):
            row.format, row.reason = "bf16", "routed experts (grouped GEMM: no float8 path)"
        elif module.in_features % 16 or module.out_features % 16:
            row.format, row.reason = "bf16", "dimensions not divisible by 16"
        else:
            row.format = "fp8"
        rows.append(row)
    return rows


def convert_for_fp8_training(
    model: nn.Module, policy: PrecisionPolicy | None = None
) -> ConversionReport:
    """Swap the recipe's quantised linears for torchao `Float8Linear` in place (module
    docstring); returns the table of which module got which format."""
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as err:  # torchao is in the [gpu] and [test] extras
        raise ImportError(
            "train.low_precision=fp8 needs torchao: pip install 'hybridlm[gpu]'"
        ) from err
    config = Float8LinearConfig()
    rows = fp8_plan(model, policy)
    for row in rows:
        if row.format != "fp8":
            continue
        module = model.get_submodule(row.name)
        if isinstance(module, Float8Linear):
            continue
        parent_name, _, leaf = row.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, Float8Linear.from_float(module, config=config))
    return ConversionReport(rows)
