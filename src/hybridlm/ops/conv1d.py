"""Causal depthwise conv1d (the short convolution of Mamba-2 over x, B and C).

Shape legend: B batch, D channels, L sequence, K kernel taps, S = K - 1 state (previous inputs).
`causal_conv1d` is the fast path (one grouped `F.conv1d`); `causal_conv1d_ref` is the explicit sum
over taps it must equal. Both accept the last S inputs of a previous segment as `state_BDS`
(zeros when absent) and return (y_BDL, new_state_BDS) so prefill and decode share one code path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _with_state(x_BDL: Tensor, state_BDS: Tensor | None, S: int) -> Tensor:
    if state_BDS is None:
        return F.pad(x_BDL, (S, 0))
    return torch.cat([state_BDS.to(x_BDL.dtype), x_BDL], dim=-1)


def causal_conv1d(
    x_BDL: Tensor, weight_DK: Tensor, bias_D: Tensor | None, state_BDS: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    K = weight_DK.shape[-1]
    xp = _with_state(x_BDL, state_BDS, K - 1)
    y = F.conv1d(xp, weight_DK.unsqueeze(1).to(xp.dtype), None if bias_D is None else bias_D.to(xp.dtype),
                 groups=x_BDL.shape[1])
    return y, xp[..., xp.shape[-1] - (K - 1):]


def causal_conv1d_ref(
    x_BDL: Tensor, weight_DK: Tensor, bias_D: Tensor | None, state_BDS: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    K = weight_DK.shape[-1]
    L = x_BDL.shape[-1]
    xp = _with_state(x_BDL, state_BDS, K - 1)
    y = sum(weight_DK[None, :, k, None] * xp[..., k : k + L] for k in range(K))
    if bias_D is not None:
        y = y + bias_D[None, :, None]
    return y, xp[..., xp.shape[-1] - (K - 1):]
