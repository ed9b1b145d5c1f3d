"""Rotary position embedding (Su et al. 2021) with optional YaRN (Peng et al. 2023).

Shape legend: B batch, H heads, L sequence, E head dim, F = E/2 frequencies.
Uses the rotate-half convention of transformers' Llama/Olmo3 so weights convert without permuting.
"""

from __future__ import annotations

import math

import torch

from ..config import YarnConfig

Tensor = torch.Tensor


def rope_frequencies(
    head_dim: int, theta: float, yarn: YarnConfig | None = None
) -> tuple[Tensor, float]:
    """(inv_freq_F, attention_scaling). YaRN blends interpolated and original frequencies by a
    linear ramp between the correction dims of beta_fast / beta_slow rotations (YaRN §3.2)."""
    # fp32 as in transformers, so converted checkpoints see bit-identical frequencies
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    factor = yarn.factor
    attn_factor = yarn.attention_factor
    if attn_factor is None:
        attn_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (
            head_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
        ) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn_factor)


def rope_cos_sin(
    inv_freq_F: Tensor, positions_L: Tensor, scaling: float = 1.0
) -> tuple[Tensor, Tensor]:
    freqs_LF = positions_L.float()[..., None] * inv_freq_F.float()
    emb_LE = torch.cat([freqs_LF, freqs_LF], dim=-1)
    return emb_LE.cos() * scaling, emb_LE.sin() * scaling


def apply_rope(x_BHLE: Tensor, cos_LE: Tensor, sin_LE: Tensor) -> Tensor:
    half = x_BHLE.shape[-1] // 2
    rotated = torch.cat([-x_BHLE[..., half:], x_BHLE[..., :half]], dim=-1)
    return (x_BHLE * cos_LE + rotated * sin_LE).to(x_BHLE.dtype)
