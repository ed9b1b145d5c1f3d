"""The routed experts of a (Latent)MoE in Triton: grouped GEMMs over tokens sorted by expert,
with relu^2 fused into them, forward and backward (Nemotron 3 Super §2.1.1: relu^2 experts).

Shape legend: A assignments (tokens x top-k, sorted by expert), E experts, W the experts'
width (latent size or d_model), F the expert hidden size.

    r = relu(z @ up_e^T)        one grouped GEMM, relu in its epilogue           [A, F]
    y = r^2 @ down_e^T          one grouped GEMM, the square in its prologue     [A, W]

Only r is kept for the backward (the reference keeps both the pre-activation and relu^2's
output: twice the bytes), and relu^2's elementwise passes disappear. The backward:

    du = 2 r o (dy @ down_e)    (d relu^2(u) / du = 2 relu(u) = 2 r)
    dz = du @ up_e,   d up_e = du_e^T z_e,   d down_e = dy_e^T r_e^2

Row GEMMs run one program per (tile of one expert's rows, tile of output columns): the tiles
never cross an expert boundary, so each loads a single expert's weights. Weight gradients run
one program per (expert, output tile), reducing over that expert's rows. `model.moe._experts_loop`
(one matmul pair per expert) is the reference; `tests/test_fused_kernels.py` checks both
directions against it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import dot_precision

Tensor = torch.Tensor

_EPI_NONE, _EPI_RELU, _EPI_TIMES_2R = 0, 1, 2


@triton.jit
def _rows_kernel(a_ptr, w_ptr, out_ptr, r_ptr, tile_e, tile_r0, tile_r1, N, K,
                 s_am, s_ak, s_we, s_wn, s_wk, s_om, s_rm,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SQUARE_A: tl.constexpr, EPI: tl.constexpr, PREC: tl.constexpr,
                 F32: tl.constexpr):  # fmt: skip
    """out[rows, cols] = epi(prologue(A[rows]) @ W[e][cols]^T) for one expert's row tile."""
    t = tl.program_id(0)
    e = tl.load(tile_e + t)
    r0 = tl.load(tile_r0 + t)
    r1 = tl.load(tile_r1 + t)
    rows = r0 + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mr, mc = rows < r1, cols < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        mk = ks < K
        a = tl.load(a_ptr + rows[:, None] * s_am + ks[None, :] * s_ak,
                    mask=mr[:, None] & mk[None, :], other=0.0)  # fmt: skip
        if SQUARE_A:
            af = a.to(tl.float32)
            a = (af * af).to(a.dtype)
        w = tl.load(w_ptr + e * s_we + cols[None, :] * s_wn + ks[:, None] * s_wk,
                    mask=mk[:, None] & mc[None, :], other=0.0)  # fmt: skip
        if F32:  # Triton's interpreter: its bf16 x bf16 dot is wrong (see `_f32_dots`)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision=PREC)
        else:
            acc += tl.dot(a, w.to(a.dtype), input_precision=PREC)
    m = mr[:, None] & mc[None, :]
    if EPI == 1:
        acc = tl.maximum(acc, 0.0)
    if EPI == 2:
        r = tl.load(r_ptr + rows[:, None] * s_rm + cols[None, :], mask=m, other=0.0)
        acc = acc * 2.0 * r.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * s_om + cols[None, :], acc, mask=m)


@triton.jit
def _weights_kernel(x_ptr, y_ptr, out_ptr, starts, N, M, s_xa, s_xn, s_ya, s_ym, s_oe, s_on,
                    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                    SQUARE_Y: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr):  # fmt: skip
    """out[e] = X[rows of e]^T @ prologue(Y[rows of e]), [N, M] per expert."""
    e = tl.program_id(0)
    r0 = tl.load(starts + e)
    r1 = tl.load(starts + e + 1)
    ns = tl.program_id(1) * BN + tl.arange(0, BN)
    ms = tl.program_id(2) * BM + tl.arange(0, BM)
    mn, mm = ns < N, ms < M
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(r0, r1, BK):
        ks = k0 + tl.arange(0, BK)
        mk = ks < r1
        xt = tl.load(x_ptr + ks[None, :] * s_xa + ns[:, None] * s_xn,
                     mask=mn[:, None] & mk[None, :], other=0.0)  # fmt: skip
        y = tl.load(y_ptr + ks[:, None] * s_ya + ms[None, :] * s_ym,
                    mask=mk[:, None] & mm[None, :], other=0.0)  # fmt: skip
        if SQUARE_Y:
            yf = y.to(tl.float32)
            y = (yf * yf).to(y.dtype)
        if F32:
            acc += tl.dot(xt.to(tl.float32), y.to(tl.float32), input_precision=PREC)
        else:
            acc += tl.dot(xt, y.to(xt.dtype), input_precision=PREC)
    tl.store(out_ptr + e * s_oe + ns[:, None] * s_on + ms[None, :], acc,
             mask=mn[:, None] & mm[None, :])  # fmt: skip


_BM, _BN, _BK = 64, 64, 32


def _f32_dots() -> bool:
    """Under TRITON_INTERPRET=1 the products are taken in fp32: the interpreter's dot of two
    bf16 tiles returns garbage (seen with Triton 3.8), while a GPU multiplies bf16 tiles on its
    tensor cores; the rounding of the inputs is the same either way."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _tiles(counts: list[int] | Tensor, A: int, device: torch.device) -> tuple[Tensor, ...]:
    """Row tiles that stay inside one expert: (expert, first row, end row) per tile, and the
    experts' first rows (E + 1 entries). Computed on the device from the counts, so a tensor
    of counts needs no host sync: the grid is the bound cdiv(A, BM) + E (each expert adds at
    most one partial tile), and the tiles past the real ones are empty (end row = first row)."""
    counts_E = torch.as_tensor(counts, device=device).to(torch.int64)
    E = counts_E.numel()
    ends = counts_E.cumsum(0)
    tiles_E = (counts_E + _BM - 1) // _BM
    last_tile_E = tiles_E.cumsum(0)  # one past each expert's last tile
    t = torch.arange(triton.cdiv(A, _BM) + E, device=device)
    e = torch.searchsorted(last_tile_E, t, right=True).clamp(max=E - 1)
    r0 = ends[e] - counts_E[e] + (t - (last_tile_E[e] - tiles_E[e])) * _BM
    r1 = torch.where(t < last_tile_E[-1], ends[e], r0)
    starts = torch.cat([ends.new_zeros(1), ends])
    return tuple(x.to(torch.int32) for x in (e, r0, r1, starts))


def _rows(a, w_ENK, n_stride, k_stride, out, tiles, N, K, *, square=False, epi=0, r=None, prec):
    if tiles[0].numel() == 0:
        return out
    _rows_kernel[(tiles[0].numel(), triton.cdiv(N, _BN))](
        a, w_ENK, out, r if r is not None else out, tiles[0], tiles[1], tiles[2], N, K,
        a.stride(0), a.stride(1), w_ENK.stride(0), n_stride, k_stride, out.stride(0),
        (r if r is not None else out).stride(0),
        BM=_BM, BN=_BN, BK=_BK, SQUARE_A=square, EPI=epi, PREC=prec, F32=_f32_dots(),
    )  # fmt: skip
    return out


def _weights(x, y, starts, E, N, M, *, square=False, prec):
    out = torch.zeros(E, N, M, device=x.device, dtype=torch.float32)
    _weights_kernel[(E, triton.cdiv(N, _BN), triton.cdiv(M, _BM))](
        x, y, out, starts, N, M, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        out.stride(0), out.stride(1), BN=_BN, BM=_BM, BK=_BK, SQUARE_Y=square, PREC=prec,
        F32=_f32_dots(),
    )  # fmt: skip
    return out


class _ExpertsFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z_AW, up_EFW, down_EWF, counts):
        A, W = z_AW.shape
        E, F, _ = up_EFW.shape
        dtype = z_AW.dtype  # the activations' dtype (bf16 under autocast), as the GEMMs' inputs
        z = z_AW.contiguous()
        up, down = up_EFW.to(dtype).contiguous(), down_EWF.to(dtype).contiguous()
        tiles = _tiles(counts, A, z.device)
        prec = dot_precision(z, up)
        new = dict(device=z.device, dtype=dtype)
        r = _rows(z, up, up.stride(1), up.stride(2), torch.empty(A, F, **new), tiles, F, W,
                  epi=_EPI_RELU, prec=prec)  # fmt: skip
        y = _rows(r, down, down.stride(1), down.stride(2), torch.empty(A, W, **new), tiles, W, F,
                  square=True, prec=prec)  # fmt: skip
        ctx.save_for_backward(z, up, down, r, *tiles)
        ctx.prec, ctx.w_dtypes = prec, (up_EFW.dtype, down_EWF.dtype)
        return y

    @staticmethod
    def backward(ctx, dy_AW):
        z, up, down, r, *tiles = ctx.saved_tensors
        A, W = z.shape
        E, F, _ = up.shape
        prec = ctx.prec
        dy = dy_AW.to(z.dtype).contiguous()
        new = dict(device=z.device, dtype=z.dtype)
        # du = 2 r o (dy @ down_e): down_e [W, F] read as its transpose [F, W]
        du = _rows(dy, down, down.stride(2), down.stride(1), torch.empty(A, F, **new), tiles, F, W,
                   epi=_EPI_TIMES_2R, r=r, prec=prec)  # fmt: skip
        # dz = du @ up_e: up_e [F, W] read as its transpose [W, F]
        dz = _rows(du, up, up.stride(2), up.stride(1), torch.empty(A, W, **new), tiles, W, F,
                   prec=prec)  # fmt: skip
        starts = tiles[3]
        d_up = _weights(du, z, starts, E, F, W, prec=prec)
        d_down = _weights(dy, r, starts, E, W, F, square=True, prec=prec)
        return dz, d_up.to(ctx.w_dtypes[0]), d_down.to(ctx.w_dtypes[1]), None


@torch.compiler.disable  # opaque to torch.compile: a graph break (train.compile)
def experts_fused(
    z_AW: Tensor, counts: list[int] | Tensor, up_EFW: Tensor, down_EWF: Tensor
) -> Tensor:
    """relu^2 experts over tokens sorted by expert (`counts` per expert: a list, or a tensor on
    the device, which spares the host sync of reading it), the signature of the expert functions
    of `model.moe` (`ExpertsFn`); output in z's dtype."""
    if isinstance(counts, Tensor):
        if counts.dim() != 1 or counts.numel() != up_EFW.shape[0]:
            raise ValueError(
                f"counts: one per expert ({up_EFW.shape[0]}), got {tuple(counts.shape)}"
            )
    elif sum(counts) != z_AW.shape[0]:
        raise ValueError(f"counts add up to {sum(counts)}, not the {z_AW.shape[0]} sorted rows")
    return _ExpertsFused.apply(z_AW, up_EFW, down_EWF, counts)
