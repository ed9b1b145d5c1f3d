"""Whether a module is one the model was built with, or a replacement from a converter.

The fused decode steps (`mamba2_decode_step`, `moe_decode_step`) read weights straight from the
modules. A converter (low-precision training, PTQ fake-quant) swaps `nn.Linear`s and experts for
its own modules, whose forward is not a plain GEMM on `.weight`; the fused steps then must not
run, and the layers fall back to calling their submodules. `project` applies a linear layer
through the native inference kernels when the layer is a plain `nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from ..ops import native


def is_stock(*modules: nn.Module | None) -> bool:
    """True when every module and all its submodules are classes of torch.nn or of
    hybridlm.model (none is a converter's) and none has forward hooks (calibration observers
    expect their modules to be called)."""
    return not _global_hooks() and all(
        type(sub).__module__.startswith(("torch.nn.", "hybridlm.model.")) and not _hooked(sub)
        for m in modules
        if m is not None
        for sub in m.modules()
    )


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)`; a plain `nn.Linear` applied to a few rows at inference (decoding,
    speculative verification) runs the native GEMV (`ops.native.linear`), which reads the
    weight once for all rows at memory bandwidth. Converted layers, and layers with hooks
    (calibration observers), run their own forward."""
    if (
        type(linear) is nn.Linear
        and native.usable(x, linear.weight, linear.bias)
        and not (_hooked(linear) or _global_hooks())
    ):
        return native.linear(x, linear.weight, linear.bias)
    return linear(x)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _global_hooks() -> bool:
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)
