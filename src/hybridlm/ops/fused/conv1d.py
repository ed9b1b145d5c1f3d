"""Causal depthwise conv1d + SiLU (Mamba-2's short convolution over x, B and C) in Triton,
forward and backward.

Shape legend as in `ops.conv1d`: B batch, L sequence, D channels, K taps, S = K - 1 carried
inputs, T = S + L padded rows (the carried state, or zeros, then the inputs).

Forward: one program per (row, block of positions, block of channels) sums the K taps in fp32
and applies SiLU; only the inputs are saved. Backward recomputes the pre-activation where it
needs it: d(xp) at padded row t' gathers the SiLU gradient of the K outputs t' - k that read it,
and d(w), d(b) are summed per program into a [programs, D, K] buffer that the caller reduces
(deterministic; no atomics). With `doc_ids` (packed documents, no carried state) a tap reads
only inputs of its output's document, as `ops.conv1d.causal_conv1d_docs` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import next_pow2

Tensor = torch.Tensor


@triton.jit
def _pre(xp_ptr, w_ptr, b_ptr, doc_ptr, t, mt, d, md, L, D, K: tl.constexpr, HAS_B: tl.constexpr,
         HAS_DOCS: tl.constexpr):  # fmt: skip
    """Pre-activation at output rows t (x coordinates) for channels d, fp32 [BT, BD]."""
    acc = tl.zeros((t.shape[0], d.shape[0]), dtype=tl.float32)
    if HAS_DOCS:
        dt_ = tl.load(doc_ptr + t, mask=mt, other=-1)
    for k in tl.static_range(K):
        src = t + k - (K - 1)  # x index the tap reads; < 0 reads the carried rows
        m = mt[:, None] & md[None, :]
        if HAS_DOCS:
            ds = tl.load(doc_ptr + src, mask=mt & (src >= 0), other=-2)
            m = m & ((ds == dt_) | (src < 0))[:, None]
        xv = tl.load(xp_ptr + (t + k)[:, None] * D + d[None, :], mask=m, other=0.0)
        wv = tl.load(w_ptr + d * K + k, mask=md, other=0.0)
        acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
    if HAS_B:
        acc += tl.load(b_ptr + d, mask=md, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _conv_silu_fwd_kernel(xp_ptr, w_ptr, b_ptr, doc_ptr, y_ptr, L, D, K: tl.constexpr,
                          BT: tl.constexpr, BD: tl.constexpr, HAS_B: tl.constexpr,
                          HAS_DOCS: tl.constexpr):  # fmt: skip
    bi = tl.program_id(0)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    d = tl.program_id(2) * BD + tl.arange(0, BD)
    mt, md = t < L, d < D
    xp_ptr += bi * (L + K - 1) * D
    doc_ptr += bi * L
    pre = _pre(xp_ptr, w_ptr, b_ptr, doc_ptr, t, mt, d, md, L, D, K, HAS_B, HAS_DOCS)
    y = pre * tl.sigmoid(pre)
    tl.store(y_ptr + (bi * L + t)[:, None] * D + d[None, :], y, mask=mt[:, None] & md[None, :])


@triton.jit
def _conv_silu_bwd_kernel(xp_ptr, w_ptr, b_ptr, doc_ptr, g_ptr, dxp_ptr, dw_ptr, db_ptr, L, D,
                          K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                          HAS_B: tl.constexpr, HAS_DOCS: tl.constexpr):  # fmt: skip
    bi = tl.program_id(0)
    tb = tl.program_id(1)
    d = tl.program_id(2) * BD + tl.arange(0, BD)
    md = d < D
    T = L + K - 1
    xp_ptr += bi * T * D
    g_ptr += bi * L * D
    doc_ptr += bi * L
    # d(xp) at padded rows r: sum_k dpre[r - k] w[k] over the outputs r - k that read row r
    r = tb * BT + tl.arange(0, BT)
    mr = r < T
    dxp = tl.zeros((BT, BD), dtype=tl.float32)
    for k in tl.static_range(K):
        t = r - k
        mt = mr & (t >= 0) & (t < L)
        pre = _pre(xp_ptr, w_ptr, b_ptr, doc_ptr, t, mt, d, md, L, D, K, HAS_B, HAS_DOCS)
        gv = tl.load(g_ptr + t[:, None] * D + d[None, :], mask=mt[:, None] & md[None, :], other=0.0)
        sig = tl.sigmoid(pre)
        dpre = gv.to(tl.float32) * sig * (1.0 + pre * (1.0 - sig))
        if HAS_DOCS:  # the tap read row r only within the output's document
            src = r - (K - 1)
            dt_ = tl.load(doc_ptr + t, mask=mt, other=-1)
            ds = tl.load(doc_ptr + src, mask=mt & (src >= 0), other=-2)
            dpre = tl.where(((ds == dt_) | (src < 0))[:, None], dpre, 0.0)
        wv = tl.load(w_ptr + d * K + k, mask=md, other=0.0).to(tl.float32)  # row r = t + k
        dxp += dpre * wv[None, :]
    tl.store(dxp_ptr + (bi * T + r)[:, None] * D + d[None, :], dxp, mask=mr[:, None] & md[None, :])
    # d(w), d(b) over this program's outputs t in [tb * BT, tb * BT + BT)
    t = tb * BT + tl.arange(0, BT)
    mt = t < L
    pre = _pre(xp_ptr, w_ptr, b_ptr, doc_ptr, t, mt, d, md, L, D, K, HAS_B, HAS_DOCS)
    gv = tl.load(g_ptr + t[:, None] * D + d[None, :], mask=mt[:, None] & md[None, :], other=0.0)
    sig = tl.sigmoid(pre)
    dpre = gv.to(tl.float32) * sig * (1.0 + pre * (1.0 - sig))
    prog = bi * tl.num_programs(1) + tb
    if HAS_DOCS:
        dt_ = tl.load(doc_ptr + t, mask=mt, other=-1)
    for k in tl.static_range(K):
        src = t + k - (K - 1)
        m = mt[:, None] & md[None, :]
        if HAS_DOCS:
            ds = tl.load(doc_ptr + src, mask=mt & (src >= 0), other=-2)
            m = m & ((ds == dt_) | (src < 0))[:, None]
        xv = tl.load(xp_ptr + (t + k)[:, None] * D + d[None, :], mask=m, other=0.0)
        tl.store(dw_ptr + (prog * D + d) * K + k, tl.sum(dpre * xv.to(tl.float32), axis=0), mask=md)
    if HAS_B:
        tl.store(db_ptr + prog * D + d, tl.sum(dpre, axis=0), mask=md)


def _blocks(L: int, D: int) -> tuple[int, int]:
    return min(64, next_pow2(L, 16)), min(128, next_pow2(D, 16))


class _ConvSiLUFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xp, w_DK, b_D, docs, L: int, out_dtype: torch.dtype):
        Bsz, T, D = xp.shape
        K = w_DK.shape[1]
        BT, BD = _blocks(L, D)
        y = torch.empty(Bsz, L, D, device=xp.device, dtype=out_dtype)
        grid = (Bsz, triton.cdiv(L, BT), triton.cdiv(D, BD))
        _conv_silu_fwd_kernel[grid](
            xp, w_DK, b_D if b_D is not None else w_DK, docs if docs is not None else w_DK, y,
            L, D, K=K, BT=BT, BD=BD, HAS_B=b_D is not None, HAS_DOCS=docs is not None,
        )  # fmt: skip
        ctx.save_for_backward(xp, w_DK, b_D, docs)
        ctx.L = L
        return y

    @staticmethod
    def backward(ctx, g):
        xp, w_DK, b_D, docs = ctx.saved_tensors
        L = ctx.L
        Bsz, T, D = xp.shape
        K = w_DK.shape[1]
        BT, BD = _blocks(L, D)
        nT = triton.cdiv(T, BT)
        f32 = dict(device=xp.device, dtype=torch.float32)
        dxp = torch.empty(Bsz, T, D, **f32)
        dw = torch.zeros(Bsz * nT, D, K, **f32)
        db = torch.zeros(Bsz * nT, D, **f32)
        _conv_silu_bwd_kernel[(Bsz, nT, triton.cdiv(D, BD))](
            xp, w_DK, b_D if b_D is not None else w_DK, docs if docs is not None else w_DK,
            g.contiguous(), dxp, dw, db, L, D,
            K=K, BT=BT, BD=BD, HAS_B=b_D is not None, HAS_DOCS=docs is not None,
        )  # fmt: skip
        return (
            dxp.to(xp.dtype),
            dw.sum(0).to(w_DK.dtype),
            None if b_D is None else db.sum(0).to(b_D.dtype),
            None,
            None,
            None,
        )


@torch.compiler.disable  # opaque to torch.compile: a graph break (train.compile)
def causal_conv1d_silu_fused(
    x_BLD: Tensor,
    weight_DK: Tensor,
    bias_D: Tensor | None,
    state_BSD: Tensor | None = None,
    doc_ids_BL: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(silu(conv), new state) as `ops.conv1d.causal_conv1d_silu`; with `doc_ids_BL` as
    `silu(causal_conv1d_docs(...))` (no carried state then). Output dtype: x's promoted with
    the weight's, as the references."""
    K = weight_DK.shape[-1]
    if doc_ids_BL is not None and state_BSD is not None:
        raise ValueError("packed documents (doc_ids) do not combine with a carried conv state")
    if state_BSD is None:
        xp = torch.nn.functional.pad(x_BLD, (0, 0, K - 1, 0))
    else:
        xp = torch.cat([state_BSD.to(x_BLD.dtype), x_BLD], dim=1)
    xp = xp.contiguous()
    docs = None if doc_ids_BL is None else doc_ids_BL.to(torch.int32).contiguous()
    out_dtype = torch.promote_types(x_BLD.dtype, weight_DK.dtype)
    b = None if bias_D is None else bias_D.contiguous()
    y = _ConvSiLUFused.apply(xp, weight_DK.contiguous(), b, docs, x_BLD.shape[1], out_dtype)
    return y, xp[:, xp.shape[1] - (K - 1) :]
