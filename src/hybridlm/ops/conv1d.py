"""Causal depthwise conv1d (the short convolution of Mamba-2 over x, B and C).

Shape legend: B batch, L sequence, D channels, K kernel taps, S = K - 1 carried inputs, T = S + L.
Channels-last, the layout in_proj produces, so no transposes. `causal_conv1d` is the fast path:
K fused multiply-adds with a hand-written backward that accumulates in place (no per-tap
allocations); `causal_conv1d_ref` is `F.conv1d` with groups=D, which it must equal. Both take the
last S inputs of a previous segment as `state_BSD` (zeros when absent) and return
(y_BLD, new_state_BSD), so prefill and decode share one code path. `causal_conv1d_silu` is
the conv followed by SiLU (Mamba-2's activation on x, B and C), also over packed documents: the
Triton kernels (`ops.fused.conv1d`) on CUDA tensors, one pass forward and one backward through
the native training kernels (`ops.native.conv_silu_*`) on fp32 CPU tensors, else
`silu(causal_conv1d(...))` / `silu(causal_conv1d_docs(...))`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fused, native

Tensor = torch.Tensor


def _padded(x_BLD: Tensor, state_BSD: Tensor | None, S: int) -> Tensor:
    if state_BSD is None:
        return F.pad(x_BLD, (0, 0, S, 0))
    return torch.cat([state_BSD.to(x_BLD.dtype), x_BLD], dim=1)


class _ShiftConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xp_BTD: Tensor, w_DK: Tensor, b_D: Tensor | None, L: int) -> Tensor:
        K = w_DK.shape[1]
        y_BLD = xp_BTD[:, 0:L] * w_DK[:, 0]
        for k in range(1, K):
            y_BLD.addcmul_(xp_BTD[:, k : k + L], w_DK[:, k])
        if b_D is not None:
            y_BLD += b_D
        ctx.save_for_backward(xp_BTD, w_DK)
        ctx.has_bias = b_D is not None
        return y_BLD

    @staticmethod
    def backward(ctx, g_BLD: Tensor):
        xp_BTD, w_DK = ctx.saved_tensors
        K, L = w_DK.shape[1], g_BLD.shape[1]
        g_xp = torch.zeros_like(xp_BTD)
        g_w = torch.empty_like(w_DK)
        for k in range(K):
            g_xp[:, k : k + L].addcmul_(g_BLD, w_DK[:, k])
            g_w[:, k] = (g_BLD * xp_BTD[:, k : k + L]).sum((0, 1))
        g_b = g_BLD.sum((0, 1)) if ctx.has_bias else None
        return g_xp, g_w, g_b, None


def causal_conv1d(
    x_BLD: Tensor, weight_DK: Tensor, bias_D: Tensor | None, state_BSD: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    K = weight_DK.shape[-1]
    xp = _padded(x_BLD, state_BSD, K - 1)
    dtype = torch.promote_types(xp.dtype, weight_DK.dtype)
    L = x_BLD.shape[1]
    if not torch.is_grad_enabled():  # inference: the same tap sum without autograd bookkeeping
        xp_d, w_d = xp.to(dtype), weight_DK.to(dtype)
        if L == 1:  # decode step: one weighted sum over the taps
            y = (xp_d * w_d.t()).sum(1, keepdim=True)
        else:
            y = xp_d[:, 0:L] * w_d[:, 0]
            for k in range(1, K):
                y.addcmul_(xp_d[:, k : k + L], w_d[:, k])
        if bias_D is not None:
            y = y + bias_D.to(dtype)
        return y, xp[:, xp.shape[1] - (K - 1) :]
    y = _ShiftConv.apply(
        xp.to(dtype),
        weight_DK.to(dtype),
        None if bias_D is None else bias_D.to(dtype),
        x_BLD.shape[1],
    )
    return y, xp[:, xp.shape[1] - (K - 1) :]


class _ConvSiLUNative(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xp_BTD: Tensor, w_KD: Tensor, b_D: Tensor | None, L: int) -> Tensor:
        ctx.save_for_backward(xp_BTD, w_KD, b_D)
        return native.conv_silu_fwd(xp_BTD, w_KD, b_D, L)

    @staticmethod
    def backward(ctx, g_BLD: Tensor):
        xp_BTD, w_KD, b_D = ctx.saved_tensors
        g_xp, g_w, g_b = native.conv_silu_bwd(xp_BTD, w_KD, b_D, g_BLD.contiguous())
        return g_xp, g_w, g_b, None


def causal_conv1d_silu(
    x_BLD: Tensor,
    weight_DK: Tensor,
    bias_D: Tensor | None,
    state_BSD: Tensor | None = None,
    doc_ids_BL: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(silu(causal_conv1d(x, weight, bias, state)), new state); with `doc_ids_BL` (packed
    documents, no state) silu(causal_conv1d_docs(...)) and the zero state. The Triton kernels
    on CUDA tensors (`fused.usable`), the native fused kernels on fp32 CPU tensors
    (`native.trainable`), the torch path otherwise."""
    K = weight_DK.shape[-1]
    if fused.usable(x_BLD, weight_DK, bias_D, state_BSD):
        from .fused.conv1d import causal_conv1d_silu_fused

        return causal_conv1d_silu_fused(x_BLD, weight_DK, bias_D, state_BSD, doc_ids_BL)
    if doc_ids_BL is not None:
        if state_BSD is not None:
            raise ValueError("packed documents (doc_ids) do not combine with a carried conv state")
        y = F.silu(causal_conv1d_docs(x_BLD, weight_DK, bias_D, doc_ids_BL))
        return y, _padded(x_BLD, None, K - 1)[:, x_BLD.shape[1] :]
    if not native.trainable(x_BLD, weight_DK, bias_D, state_BSD):
        y, state = causal_conv1d(x_BLD, weight_DK, bias_D, state_BSD)
        return F.silu(y), state
    xp = _padded(x_BLD, state_BSD, K - 1).contiguous()
    b = None if bias_D is None else bias_D.contiguous()
    y = _ConvSiLUNative.apply(xp, weight_DK.t().contiguous(), b, x_BLD.shape[1])
    return y, xp[:, xp.shape[1] - (K - 1) :]


def causal_conv1d_ref(
    x_BLD: Tensor, weight_DK: Tensor, bias_D: Tensor | None, state_BSD: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    K = weight_DK.shape[-1]
    xp = _padded(x_BLD, state_BSD, K - 1)
    y = F.conv1d(xp.transpose(1, 2), weight_DK.unsqueeze(1), bias_D, groups=x_BLD.shape[2])
    return y.transpose(1, 2), xp[:, xp.shape[1] - (K - 1) :]


def causal_conv1d_docs(
    x_BLD: Tensor, weight_DK: Tensor, bias_D: Tensor | None, doc_ids_BL: Tensor
) -> Tensor:
    """Causal conv over packed documents: tap k at position t reads t - (K-1-k) only when that
    position belongs to t's document, so no document sees its predecessor (as a fresh start with
    a zero conv state). Equals `causal_conv1d` run on each document alone (tested)."""
    K, L = weight_DK.shape[-1], x_BLD.shape[1]
    dtype = torch.promote_types(x_BLD.dtype, weight_DK.dtype)
    xp = F.pad(x_BLD.to(dtype), (0, 0, K - 1, 0))
    dp = F.pad(doc_ids_BL, (K - 1, 0), value=-1)
    w = weight_DK.to(dtype)
    y = None
    for k in range(K):
        same_BL1 = (dp[:, k : k + L] == doc_ids_BL)[..., None].to(dtype)
        term = xp[:, k : k + L] * same_BL1 * w[:, k]
        y = term if y is None else y + term
    if bias_D is not None:
        y = y + bias_D.to(dtype)
    return y
