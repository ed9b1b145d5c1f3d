"""Attention fast path (SDPA) == explicit softmax reference, incl. GQA, windows and offsets."""

import pytest
import torch

from hybridlm.ops.attention import attention, attention_masked, attention_ref


@pytest.mark.parametrize("H,K", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 1, 3, 8])
@pytest.mark.parametrize("L,S", [(9, 9), (1, 9), (3, 12)])
def test_sdpa_equals_reference(H, K, window, L, S):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, H, L, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, K, S, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, K, S, 8, generator=g, dtype=torch.float64)
    off = S - L
    out = attention(q, k, v, q_offset=off, window=window)
    ref = attention_ref(q, k, v, q_offset=off, window=window)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("H,K", [(4, 4), (8, 2)])
def test_masked_attention_equals_reference(H, K):
    """`attention_masked` (grouped heads folded into the query axis) against the explicit
    softmax under the same per-row mask: rows of different lengths, a window, L > 1."""
    g = torch.Generator().manual_seed(0)
    B, L, S, E = 3, 4, 11, 8
    q = torch.randn(B, H, L, E, generator=g, dtype=torch.float64)
    k = torch.randn(B, K, S, E, generator=g, dtype=torch.float64)
    v = torch.randn(B, K, S, E, generator=g, dtype=torch.float64)
    pos_BL = torch.tensor([0, 3, 7])[:, None] + torch.arange(L)
    cols = torch.arange(S)
    mask = (cols <= pos_BL[..., None]) & (pos_BL[..., None] - cols < 5)
    got = attention_masked(q, k, v, mask[:, None])
    want = attention_ref(q, k, v, q_offset=S, extra_mask=mask[:, None])  # causal: all columns
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
