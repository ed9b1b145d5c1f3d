"""Whether a module is one the model was built with, or a replacement from a converter.

The fused decode steps (`mamba2_decode_step`, `moe_decode_step`) read weights straight from the
modules. A converter (low-precision training, PTQ fake-quant) swaps `nn.Linear`s and experts for
its own modules, whose forward is not a plain GEMM on `.weight`; the fused steps then must not
run, and the layers fall back to calling their submodules.
"""

from __future__ import annotations

from torch import nn


def is_stock(*modules: nn.Module | None) -> bool:
    """True when every module and all its submodules are classes of torch.nn or of
    hybridlm.model (none is a converter's)."""
    return all(
        type(sub).__module__.startswith(("torch.nn.", "hybridlm.model."))
        for m in modules
        if m is not None
        for sub in m.modules()
    )
