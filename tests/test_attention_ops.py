"""Attention fast path (SDPA) == explicit softmax reference, incl. GQA, windows and offsets."""

import pytest
import torch

from hybridlm.ops.attention import attention, attention_ref


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
