"""RMSNorm and the group-wise gated RMSNorm of Mamba-2 (computed in fp32)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import fused, native


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics and scaling (as transformers' NemotronH/Olmo3), then back to x's dtype;
        # fp64 inputs stay fp64 (reference runs)
        if native.usable(x, self.weight):  # a few rows at inference
            return native.rms_norm(x, self.weight, self.eps)
        ct = torch.promote_types(x.dtype, torch.float32)
        y = nn.functional.rms_norm(x.to(ct), (x.shape[-1],), self.weight.to(ct), self.eps)
        return y.to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """w * rmsnorm_per_group(x * silu(z)) in at least fp32, returned in x's dtype promoted with
    w's (the functional form of `GatedRMSNorm`, also used by the fused Mamba decode step)."""
    dtype = x.dtype
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct) * nn.functional.silu(z.to(ct))
    g = xf.view(*xf.shape[:-1], -1, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view_as(xf).to(dtype)


class _GatedNormNative(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, weight, group_size: int, eps: float):
        y, rs = native.gated_norm_fwd(x, z, weight, group_size, eps)
        ctx.save_for_backward(x, z, weight, rs)
        ctx.group_size = group_size
        return y

    @staticmethod
    def backward(ctx, g):
        x, z, weight, rs = ctx.saved_tensors
        gx, gz, gw = native.gated_norm_bwd(x, z, weight, rs, g.contiguous(), ctx.group_size)
        return gx, gz, gw, None, None


class GatedRMSNorm(nn.Module):
    """y = w * rmsnorm_per_group(x * silu(z)): the gate is applied before the norm, as in
    Mamba-2's `norm_before_gate=False`, normalising each of the n_groups slices separately.
    One fused pass forward and one backward: the Triton kernels on CUDA tensors
    (`ops.fused.gated_norm`), the native ones on fp32 CPU tensors (`ops.native.gated_norm_*`);
    otherwise `gated_rms_norm`, the reference both are tested against."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if fused.usable(x, z, self.weight):
            from ..ops.fused.gated_norm import gated_rms_norm_fused

            return gated_rms_norm_fused(x, z, self.weight, self.group_size, self.eps)
        if native.trainable(x, z, self.weight):
            x, z = x.contiguous(), z.contiguous()
            return _GatedNormNative.apply(x, z, self.weight, self.group_size, self.eps)
        return gated_rms_norm(x, z, self.weight, self.group_size, self.eps)
