"""One decode step of the Mamba-2 mixer between its two projections as one Triton kernel per
layer: conv-state shift + conv + SiLU, dt, the SSM state update and readout, the D skip, the
gate and the group RMSNorm (what mamba-ssm's `selective_state_update` and its gated norm do
in a few launches; the pure-torch step is ~40 small kernels).

Shape legend: B batch, X conv channels (x, B, C), S = K - 1 carried conv inputs, H heads,
P head dim, G groups, R = H / G heads per group, N state size, I = H * P.

One program per (row, group): it convolves the group's B and C channels once, then walks its
R heads, each with its [P, N] state tile: state = exp(dt A) state + dt x B^T, y = state C +
D x, gated by silu(z); the group's RMS comes from the gated outputs, normalised in a second
pass over the heads. The conv and SSM states are read whole before they are written, so the
outputs may alias the inputs (updated in place: what a CUDA graph's static buffers need).
The SSM state is kept in its own dtype (fp32, or fp16 with `ssm_state_precision`), computed in
fp32. `model.mamba2.mamba2_decode_step_torch` is the reference (`tests/test_fused_kernels.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import next_pow2

Tensor = torch.Tensor


@triton.jit
def _conv_silu(zx_ptr, conv_ptr, w_ptr, b_ptr, c, m, s_cs, I, K: tl.constexpr,
               HAS_B: tl.constexpr):  # fmt: skip
    """silu(conv) of channels `c` for one row, and the shifted taps to store (new last row)."""
    new = tl.load(zx_ptr + I + c, mask=m, other=0.0).to(tl.float32)
    acc = new * tl.load(w_ptr + c * K + (K - 1), mask=m, other=0.0).to(tl.float32)
    for k in tl.static_range(K - 1):
        tap = tl.load(conv_ptr + k * s_cs + c, mask=m, other=0.0).to(tl.float32)
        acc += tap * tl.load(w_ptr + c * K + k, mask=m, other=0.0).to(tl.float32)
    if HAS_B:
        acc += tl.load(b_ptr + c, mask=m, other=0.0).to(tl.float32)
    return acc * tl.sigmoid(acc), new


@triton.jit
def _shift_conv_state(conv_ptr, out_ptr, new, c, m, s_cs, K: tl.constexpr):
    """out rows 0..S-2 = old rows 1..S-1, out row S-1 = new (read before written: may alias)."""
    for k in tl.static_range(K - 2):
        tap = tl.load(conv_ptr + (k + 1) * s_cs + c, mask=m, other=0.0)
        tl.store(out_ptr + k * s_cs + c, tap, mask=m)
    tl.store(out_ptr + (K - 2) * s_cs + c, new, mask=m)


@triton.jit
def _mamba_step_kernel(
    zx_ptr, conv_ptr, ssm_ptr, convw_ptr, convb_ptr, dtb_ptr, alog_ptr, d_ptr, normw_ptr,
    y_ptr, conv_out_ptr, ssm_out_ptr,
    s_zb, s_cb, s_cs, s_sb, I, GN, H, R, P, N, dt_min, dt_max, eps,
    K: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_CB: tl.constexpr,
    HAS_DTMAX: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    g = tl.program_id(1)
    zx_ptr += b * s_zb
    conv_in = conv_ptr + b * s_cb
    conv_out = conv_out_ptr + b * s_cb
    y_ptr += b * I
    n = tl.arange(0, BN)
    mn = n < N
    p = tl.arange(0, BP)
    mp = p < P
    # the group's B and C (conv + SiLU once for its R heads), conv state shifted
    cB = I + g * N + n
    cC = I + GN + g * N + n
    Bv, newB = _conv_silu(zx_ptr, conv_in, convw_ptr, convb_ptr, cB, mn, s_cs, I, K, HAS_CB)
    Cv, newC = _conv_silu(zx_ptr, conv_in, convw_ptr, convb_ptr, cC, mn, s_cs, I, K, HAS_CB)
    _shift_conv_state(conv_in, conv_out, newB, cB, mn, s_cs, K)
    _shift_conv_state(conv_in, conv_out, newC, cC, mn, s_cs, K)
    ss = tl.sum(tl.zeros((BP,), dtype=tl.float32), axis=0)  # the group's sum of squares
    for r in range(0, R):
        h = g * R + r
        c = h * P + p  # x channels of head h (also its z and y channels)
        xv, newx = _conv_silu(zx_ptr, conv_in, convw_ptr, convb_ptr, c, mp, s_cs, I, K, HAS_CB)
        _shift_conv_state(conv_in, conv_out, newx, c, mp, s_cs, K)
        raw = tl.load(zx_ptr + I + I + 2 * GN + h).to(tl.float32) + tl.load(dtb_ptr + h).to(
            tl.float32
        )
        dt = tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(tl.minimum(raw, 20.0))))  # softplus
        dt = tl.maximum(dt, dt_min)
        if HAS_DTMAX:
            dt = tl.minimum(dt, dt_max)
        A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        s_off = ssm_ptr + b * s_sb + h * P * N + p[:, None] * N + n[None, :]
        pn = mp[:, None] & mn[None, :]
        state = tl.load(s_off, mask=pn, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * A) + (dt * xv)[:, None] * Bv[None, :]
        o_off = ssm_out_ptr + b * s_sb + h * P * N + p[:, None] * N + n[None, :]
        tl.store(o_off, state, mask=pn)
        y = tl.sum(state * Cv[None, :], axis=1) + tl.load(d_ptr + h).to(tl.float32) * xv
        z = tl.load(zx_ptr + c, mask=mp, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
        ss += tl.sum(tl.where(mp, y * y, 0.0), axis=0)
        tl.store(y_ptr + c, y, mask=mp)
    rstd = 1.0 / tl.sqrt(ss / (R * P) + eps)
    tl.debug_barrier()  # the gated outputs stored above, read back by any thread below
    for r in range(0, R):
        c = (g * R + r) * P + p
        y = tl.load(y_ptr + c, mask=mp, other=0.0)
        w = tl.load(normw_ptr + c, mask=mp, other=0.0).to(tl.float32)
        tl.store(y_ptr + c, y * rstd * w, mask=mp)


def mamba_step_core(
    zxbcdt_BZ: Tensor,
    conv_BSX: Tensor,
    ssm_BHPN: Tensor,
    conv_w_XK: Tensor,
    conv_b_X: Tensor | None,
    dt_bias_H: Tensor,
    A_log_H: Tensor,
    D_H: Tensor,
    norm_w_I: Tensor,
    *,
    heads: int,
    head_dim: int,
    groups: int,
    state_size: int,
    dt_clamp_min: float,
    dt_clamp_max: float | None,
    eps: float,
    out_conv: Tensor | None = None,
    out_ssm: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """From in_proj's output to the gated-normed y [B, I] (fp32) and the new conv and SSM
    states: new tensors, or `out_conv` / `out_ssm` (which may be the inputs themselves)."""
    Bsz = zxbcdt_BZ.shape[0]
    I, GN = heads * head_dim, groups * state_size
    K = conv_w_XK.shape[1]
    if K < 2:
        raise ValueError("the fused decode step needs a conv of at least 2 taps")
    zx = zxbcdt_BZ.contiguous()
    conv_in = conv_BSX.contiguous()  # (a cache's conv state may be a view of a wider buffer)
    ssm_in = ssm_BHPN.contiguous()
    conv_out = torch.empty_like(conv_in) if out_conv is None else out_conv
    ssm_out = torch.empty_like(ssm_in) if out_ssm is None else out_ssm
    if conv_out.stride() != conv_in.stride() or ssm_out.stride() != ssm_in.stride():
        raise ValueError("the output states must have the input states' layout")
    y = torch.empty(Bsz, I, device=zx.device, dtype=torch.float32)
    _mamba_step_kernel[(Bsz, groups)](
        zx, conv_in, ssm_in, conv_w_XK.contiguous(),
        conv_b_X if conv_b_X is not None else dt_bias_H, dt_bias_H, A_log_H, D_H, norm_w_I,
        y, conv_out, ssm_out,
        zx.stride(0), conv_in.stride(0), conv_in.stride(1), ssm_in.stride(0),
        I, GN, heads, heads // groups, head_dim, state_size,
        float(dt_clamp_min), float(dt_clamp_max or 0.0), float(eps),
        K=K, BP=next_pow2(head_dim), BN=next_pow2(state_size), HAS_CB=conv_b_X is not None,
        HAS_DTMAX=dt_clamp_max is not None,
    )  # fmt: skip
    return y, conv_out, ssm_out


def mamba2_decode_step_fused(
    x_BD: Tensor,
    conv_BSX: Tensor,
    ssm_BHPN: Tensor,
    in_w: Tensor,
    conv_w_XK: Tensor,
    conv_b_X: Tensor | None,
    dt_bias_H: Tensor,
    A_log_H: Tensor,
    D_H: Tensor,
    norm_w_I: Tensor,
    out_w: Tensor,
    **shape: object,
) -> tuple[Tensor, Tensor, Tensor]:
    """`model.mamba2.mamba2_decode_step_torch` (same arguments and results) with the step
    between the projections in the kernel above: in_proj GEMM, one kernel, out_proj GEMM."""
    y_BI, conv, ssm = mamba_step_core(
        F.linear(x_BD, in_w), conv_BSX, ssm_BHPN, conv_w_XK, conv_b_X, dt_bias_H, A_log_H, D_H,
        norm_w_I, **shape,  # type: ignore[arg-type]
    )  # fmt: skip
    return F.linear(y_BI.to(x_BD.dtype), out_w), conv, ssm
