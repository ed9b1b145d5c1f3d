"""Random Hadamard transform (RHT) for the wgrad GEMM of NVFP4 training.

Nemotron 3 Super §2.2 (after "Pretraining LLMs with NVFP4", NVIDIA 2025): the two inputs of the
weight-gradient GEMM dW = dy^T x are multiplied by the same random orthogonal matrix along the
reduction (token) axis before quantisation, dW = (H dy)^T (H x) = dy^T H^T H x = dy^T x in exact
arithmetic. H is block diagonal with 16x16 blocks H16 * diag(s) / 4 (Sylvester Hadamard, random
signs s), which spreads outliers over each 16-token block so the FP4 block scale fits the bulk.

Shape legend: M tokens (the transformed axis, last), n the Hadamard size, N/K any leading dims.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def hadamard_matrix(n: int, *, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """Orthonormal Sylvester Hadamard matrix of size n (a power of two): H @ H.T = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype)


def random_hadamard(
    n: int = 16,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> Tensor:
    """H_n diag(s) with i.i.d. random signs s (orthonormal; entries +-1/sqrt(n), exact in fp32
    for n = 16)."""
    signs = torch.randint(0, 2, (n,), generator=generator, device=device) * 2 - 1
    return hadamard_matrix(n, dtype=dtype, device=device) * signs.to(dtype)


def blockwise_transform(x_NM: Tensor, h_nn: Tensor) -> Tensor:
    """Apply h to every consecutive group of n along the last dim: y[..., g*n:(g+1)*n] =
    h @ x[..., g*n:(g+1)*n]. The last dim must be a multiple of n (pad with zeros first)."""
    n = h_nn.shape[0]
    if x_NM.shape[-1] % n:
        raise ValueError(
            f"blockwise Hadamard needs the last dim to be a multiple of {n}, got {x_NM.shape[-1]}"
        )
    groups = x_NM.reshape(*x_NM.shape[:-1], -1, n)
    return (groups @ h_nn.T.to(x_NM.dtype)).reshape(x_NM.shape)
