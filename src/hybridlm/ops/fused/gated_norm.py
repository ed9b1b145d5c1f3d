"""Mamba-2's gated RMSNorm, y = w * rmsnorm_per_group(x * silu(z)), in Triton, forward and
backward (`model.norm.gated_rms_norm` is the reference).

Shape legend: R rows (all leading dims), I channels, G groups of E = I / G channels.

One program per (block of rows, group) reads x and z once, keeps the product in fp32 and
writes y and the per-(row, group) 1/rms; the backward reads x, z, dy and 1/rms once and
writes dx, dz and per-program partial sums of dw that the caller reduces (deterministic; no
atomics). With u = x silu(z), n = u / rms, dn = dy w:

    du = (dn - n mean_E(dn n)) / rms,   dx = du silu(z),   dz = du x silu'(z)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import next_pow2

Tensor = torch.Tensor


@triton.jit
def _tile(x_ptr, z_ptr, w_ptr, R, I, E, BR: tl.constexpr, BE: tl.constexpr):
    """The (block of rows, group) tile of a program: its rows and group, channels, masks and
    offsets, and x, z (fp32) and the norm weight there."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    g = tl.program_id(1)
    c = g * E + tl.arange(0, BE)
    mr, mc = rows < R, tl.arange(0, BE) < E
    m = mr[:, None] & mc[None, :]
    off = rows[:, None] * I + c[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + off, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=mc, other=0.0).to(tl.float32)
    return rows, g, c, mr, mc, m, off, x, z, w


@triton.jit
def _gated_norm_fwd_kernel(x_ptr, z_ptr, w_ptr, y_ptr, rs_ptr, R, I, G, E, eps,
                           BR: tl.constexpr, BE: tl.constexpr):  # fmt: skip
    rows, g, c, mr, mc, m, off, x, z, w = _tile(x_ptr, z_ptr, w_ptr, R, I, E, BR, BE)
    u = x * z * tl.sigmoid(z)
    rs = 1.0 / tl.sqrt(tl.sum(u * u, axis=1) / E + eps)
    tl.store(y_ptr + off, u * rs[:, None] * w[None, :], mask=m)
    tl.store(rs_ptr + rows * G + g, rs, mask=mr)


@triton.jit
def _gated_norm_bwd_kernel(x_ptr, z_ptr, w_ptr, rs_ptr, dy_ptr, dx_ptr, dz_ptr, dw_ptr, R, I, G, E,
                           BR: tl.constexpr, BE: tl.constexpr):  # fmt: skip
    rows, g, c, mr, mc, m, off, x, z, w = _tile(x_ptr, z_ptr, w_ptr, R, I, E, BR, BE)
    dy = tl.load(dy_ptr + off, mask=m, other=0.0).to(tl.float32)
    rs = tl.load(rs_ptr + rows * G + g, mask=mr, other=0.0)
    sig = tl.sigmoid(z)
    u = x * z * sig
    n = u * rs[:, None]
    dn = dy * w[None, :]
    du = (dn - n * (tl.sum(dn * n, axis=1) / E)[:, None]) * rs[:, None]
    tl.store(dx_ptr + off, du * z * sig, mask=m)
    tl.store(dz_ptr + off, du * x * sig * (1.0 + z * (1.0 - sig)), mask=m)
    tl.store(dw_ptr + tl.program_id(0) * I + c, tl.sum(dy * n, axis=0), mask=mc)


def _blocks(R: int, E: int) -> tuple[int, int]:
    BE = next_pow2(E, 1)
    return max(1, min(64, 4096 // BE, next_pow2(R, 1))), BE


class _GatedNormFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, weight, group_size: int, eps: float, out_dtype: torch.dtype):
        I = x.shape[-1]
        x2, z2 = x.reshape(-1, I), z.reshape(-1, I)
        R, G = x2.shape[0], I // group_size
        BR, BE = _blocks(R, group_size)
        y = torch.empty(x2.shape, device=x.device, dtype=out_dtype)
        rs = torch.empty(R, G, device=x.device, dtype=torch.float32)
        _gated_norm_fwd_kernel[(triton.cdiv(R, BR), G)](
            x2, z2, weight, y, rs, R, I, G, group_size, eps, BR=BR, BE=BE
        )
        ctx.save_for_backward(x2, z2, weight, rs)
        ctx.group_size, ctx.shape = group_size, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, z2, weight, rs = ctx.saved_tensors
        R, I = x2.shape
        E = ctx.group_size
        BR, BE = _blocks(R, E)
        nR = triton.cdiv(R, BR)
        dx = torch.empty(x2.shape, device=x2.device, dtype=x2.dtype)
        dz = torch.empty(z2.shape, device=z2.device, dtype=z2.dtype)
        dw = torch.empty(nR, I, device=x2.device, dtype=torch.float32)
        _gated_norm_bwd_kernel[(nR, I // E)](
            x2, z2, weight, rs, dy.reshape(R, I).contiguous(), dx, dz, dw, R, I, I // E, E,
            BR=BR, BE=BE,
        )  # fmt: skip
        return dx.view(ctx.shape), dz.view(ctx.shape), dw.sum(0).to(weight.dtype), None, None, None


@torch.compiler.disable  # opaque to torch.compile: a graph break (train.compile)
def gated_rms_norm_fused(
    x: Tensor, z: Tensor, weight: Tensor, group_size: int, eps: float
) -> Tensor:
    """`model.norm.gated_rms_norm` (same arguments; output dtype x's promoted with w's)."""
    if x.shape[-1] % group_size:
        raise ValueError(f"{x.shape[-1]} channels do not split into groups of {group_size}")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    return _GatedNormFused.apply(
        x.contiguous(), z.contiguous(), weight.contiguous(), group_size, float(eps), out_dtype
    )
