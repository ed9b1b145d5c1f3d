"""Causal (optionally sliding-window) grouped-query attention.

Shape legend: B batch, H query heads, K kv heads, L query length, S key length, E head dim.
`attention` is the fast path (`F.scaled_dot_product_attention`); `attention_ref` is the explicit
softmax(QK^T)V it must equal. Query i sits at absolute position `q_offset + i` and key j at j, so
the same mask serves training (offset 0) and decode against a cache. With `window=W` a query sees
the W most recent positions including itself (i - j < W), as transformers' sliding window does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def causal_mask(
    L: int,
    S: int,
    *,
    q_offset: int = 0,
    window: int | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Boolean [L, S] mask, True where query i may attend to key j."""
    i = torch.arange(L, device=device)[:, None] + q_offset
    j = torch.arange(S, device=device)[None, :]
    mask = j <= i
    if window is not None:
        mask = mask & (i - j < window)
    return mask


def _full_mask(
    q: Tensor, k: Tensor, q_offset: int, window: int | None, extra_mask: Tensor | None
) -> Tensor:
    mask = causal_mask(q.shape[-2], k.shape[-2], q_offset=q_offset, window=window, device=q.device)
    if extra_mask is not None:
        mask = mask & extra_mask
    return mask


def attention(
    q_BHLE: Tensor,
    k_BKSE: Tensor,
    v_BKSE: Tensor,
    *,
    q_offset: int = 0,
    window: int | None = None,
    extra_mask: Tensor | None = None,
) -> Tensor:
    """Returns o_BHLE. `extra_mask` (bool, broadcastable to [B, 1, L, S]) is AND-ed in."""
    H, K = q_BHLE.shape[1], k_BKSE.shape[1]
    L, S = q_BHLE.shape[-2], k_BKSE.shape[-2]
    if H != K:
        k_BKSE = k_BKSE.repeat_interleave(H // K, dim=1)
        v_BKSE = v_BKSE.repeat_interleave(H // K, dim=1)
    if window is not None and window >= q_offset + L:  # i - j < window everywhere: causal only
        window = None  # (a sliding layer on rows no longer than its window keeps the fast kernels)
    if window is None and extra_mask is None and q_offset == 0 and L == S:
        return F.scaled_dot_product_attention(q_BHLE, k_BKSE, v_BKSE, is_causal=True)
    if window is None and extra_mask is None and q_offset + L == S and L == 1:
        return F.scaled_dot_product_attention(q_BHLE, k_BKSE, v_BKSE)
    mask = _full_mask(q_BHLE, k_BKSE, q_offset, window, extra_mask)
    return F.scaled_dot_product_attention(q_BHLE, k_BKSE, v_BKSE, attn_mask=mask)


def attention_masked(q_BHLE: Tensor, k_BKSE: Tensor, v_BKSE: Tensor, mask_B1LS: Tensor) -> Tensor:
    """Attention under an explicit boolean mask alone (no causal mask added; every query row
    must allow a key), for decode steps over static cache buffers. Grouped heads are folded
    into the query axis ([B, K, H/K * L, E] against [B, K, S, E]), so the keys and values are
    read once per KV head, not copied per query head. Equals `attention_ref` with the same
    mask as `extra_mask` where the causal mask is implied by it."""
    B, H, L, E = q_BHLE.shape
    K = k_BKSE.shape[1]
    G = H // K
    q = q_BHLE.reshape(B, K, G * L, E)
    mask = mask_B1LS.expand(B, 1, L, k_BKSE.shape[2]).repeat(1, 1, G, 1)
    o = F.scaled_dot_product_attention(q, k_BKSE, v_BKSE, attn_mask=mask)
    return o.reshape(B, H, L, E)


def attention_ref(
    q_BHLE: Tensor,
    k_BKSE: Tensor,
    v_BKSE: Tensor,
    *,
    q_offset: int = 0,
    window: int | None = None,
    extra_mask: Tensor | None = None,
) -> Tensor:
    H, K = q_BHLE.shape[1], k_BKSE.shape[1]
    k = k_BKSE.repeat_interleave(H // K, dim=1)
    v = v_BKSE.repeat_interleave(H // K, dim=1)
    scores_BHLS = torch.einsum("bhle,bhse->bhls", q_BHLE, k) / math.sqrt(q_BHLE.shape[-1])
    mask = _full_mask(q_BHLE, k, q_offset, window, extra_mask)
    scores_BHLS = scores_BHLS.masked_fill(~mask, float("-inf"))
    ct = torch.float64 if q_BHLE.dtype == torch.float64 else torch.float32
    probs = torch.softmax(scores_BHLS.to(ct), dim=-1).to(q_BHLE.dtype)
    return torch.einsum("bhls,bhse->bhle", probs, v)
