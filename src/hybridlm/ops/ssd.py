"""Mamba-2 state-space duality (SSD): chunked scan, token recurrence and the single decode step.

Shape legend: B batch, L sequence, H heads, P head dim, G groups (B/C shared by H/G heads),
R = H/G heads per group, N state size, C chunks, Q chunk length (q: target, s: source position).

The recurrence (Dao & Gu 2024, eq. for SSD with scalar-times-identity A) per head h:

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t (outer) B_t        (P x N)
    y_t     = state_t @ C_t + D_h * x_t

`ssd_chunked` computes the same thing in O(L * Q) with matmuls: inside each chunk the quadratic
"attention-like" form, across chunks a short recurrence on the chunk-final states. Inputs are
upcast to at least fp32 (fp64 stays fp64) and outputs are returned in that compute dtype.
`ssd_recurrent` is the token-by-token reference; `ssd_step` is one decode step. All three take
`dt` *after* softplus and clamping, and `A_H` negative.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def segsum(a_LQ: Tensor) -> Tensor:
    """Stable segment sums: out[..., q, s] = sum_{s < k <= q} a[..., k] for q >= s, else -inf."""
    Q = a_LQ.shape[-1]
    x = a_LQ[..., None].expand(*a_LQ.shape, Q)  # [..., k, s] = a[k]
    strict = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a_LQ.device), diagonal=-1)
    x = x.masked_fill(~strict, 0.0).cumsum(dim=-2)
    lower = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a_LQ.device))
    return x.masked_fill(~lower, float("-inf"))


def ssd_chunked(
    x_BLHP: Tensor,
    dt_BLH: Tensor,
    A_H: Tensor,
    B_BLGN: Tensor,
    C_BLGN: Tensor,
    D_H: Tensor | None,
    chunk_size: int,
    initial_state_BHPN: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked SSD scan. Returns (y_BLHP, final_state_BHPN) in the compute dtype."""
    Bsz, L, H, P = x_BLHP.shape
    G, N = B_BLGN.shape[-2:]
    R = H // G
    ct = _compute_dtype(x_BLHP)
    Q = chunk_size
    pad = (-L) % Q
    Lp = L + pad
    Cn = Lp // Q

    x = x_BLHP.to(ct)
    dt = dt_BLH.to(ct)
    if pad:  # zero dt on padding: no decay and no input, so the final state is exact
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        dt = torch.nn.functional.pad(dt, (0, 0, 0, pad))
        B_BLGN = torch.nn.functional.pad(B_BLGN, (0, 0, 0, 0, 0, pad))
        C_BLGN = torch.nn.functional.pad(C_BLGN, (0, 0, 0, 0, 0, pad))

    xdt_BCQGRP = (x * dt[..., None]).view(Bsz, Cn, Q, G, R, P)
    B_BCQGN = B_BLGN.to(ct).view(Bsz, Cn, Q, G, N)
    C_BCQGN = C_BLGN.to(ct).view(Bsz, Cn, Q, G, N)
    a_BGRCQ = (dt * A_H.to(ct)).view(Bsz, Cn, Q, G, R).permute(0, 3, 4, 1, 2)
    acum_BGRCQ = a_BGRCQ.cumsum(dim=-1)

    # 1) intra-chunk (diagonal blocks): y_q = sum_{s<=q} C_q.B_s * exp(sum_{s<k<=q} a_k) * dt_s x_s
    decay_BGRCQS = torch.exp(segsum(a_BGRCQ))
    cb_BCGQS = torch.einsum("bcqgn,bcsgn->bcgqs", C_BCQGN, B_BCQGN)
    y_diag = torch.einsum("bcgqs,bgrcqs,bcsgrp->bcqgrp", cb_BCGQS, decay_BGRCQS, xdt_BCQGRP)

    # 2) each chunk's own final state, decayed to the chunk end
    to_end_BGRCQ = torch.exp(acum_BGRCQ[..., -1:] - acum_BGRCQ)
    chunk_state_BCGRPN = torch.einsum("bcqgn,bgrcq,bcqgrp->bcgrpn", B_BCQGN, to_end_BGRCQ, xdt_BCQGRP)

    # 3) inter-chunk recurrence on states (C steps); state_in[c] is the state entering chunk c
    chunk_decay_BGRC = torch.exp(acum_BGRCQ[..., -1])
    if initial_state_BHPN is None:
        state = x.new_zeros(Bsz, G, R, P, N)
    else:
        state = initial_state_BHPN.to(ct).reshape(Bsz, G, R, P, N)
    states_in = []
    for c in range(Cn):
        states_in.append(state)
        state = chunk_decay_BGRC[..., c, None, None] * state + chunk_state_BCGRPN[:, c]
    state_in_BCGRPN = torch.stack(states_in, dim=1)

    # 4) contribution of the entering state to every position of the chunk
    from_start_BGRCQ = torch.exp(acum_BGRCQ)
    y_off = torch.einsum("bcqgn,bcgrpn,bgrcq->bcqgrp", C_BCQGN, state_in_BCGRPN, from_start_BGRCQ)

    y_BLHP = (y_diag + y_off).reshape(Bsz, Lp, H, P)[:, :L]
    if D_H is not None:
        y_BLHP = y_BLHP + D_H.to(ct)[:, None] * x[:, :L]
    return y_BLHP, state.reshape(Bsz, H, P, N)


def ssd_step(
    state_BHPN: Tensor,
    x_BHP: Tensor,
    dt_BH: Tensor,
    A_H: Tensor,
    B_BGN: Tensor,
    C_BGN: Tensor,
    D_H: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """One recurrence step. Returns (y_BHP, new_state_BHPN) in the compute dtype."""
    ct = _compute_dtype(state_BHPN if state_BHPN.dtype == torch.float64 else x_BHP)
    H = x_BHP.shape[1]
    R = H // B_BGN.shape[1]
    x, dt = x_BHP.to(ct), dt_BH.to(ct)
    B_BHN = B_BGN.to(ct).repeat_interleave(R, dim=1)
    C_BHN = C_BGN.to(ct).repeat_interleave(R, dim=1)
    decay_BH = torch.exp(dt * A_H.to(ct))
    state = state_BHPN.to(ct) * decay_BH[..., None, None] + torch.einsum(
        "bh,bhp,bhn->bhpn", dt, x, B_BHN
    )
    y = torch.einsum("bhpn,bhn->bhp", state, C_BHN)
    if D_H is not None:
        y = y + D_H.to(ct)[:, None] * x
    return y, state


def ssd_recurrent(
    x_BLHP: Tensor,
    dt_BLH: Tensor,
    A_H: Tensor,
    B_BLGN: Tensor,
    C_BLGN: Tensor,
    D_H: Tensor | None,
    initial_state_BHPN: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-by-token reference for `ssd_chunked` (same signature minus the chunk size)."""
    Bsz, L, H, P = x_BLHP.shape
    N = B_BLGN.shape[-1]
    ct = _compute_dtype(x_BLHP)
    state = (
        x_BLHP.new_zeros(Bsz, H, P, N, dtype=ct)
        if initial_state_BHPN is None
        else initial_state_BHPN.to(ct)
    )
    ys = []
    for t in range(L):
        y, state = ssd_step(state, x_BLHP[:, t], dt_BLH[:, t], A_H, B_BLGN[:, t], C_BLGN[:, t], D_H)
        ys.append(y)
    return torch.stack(ys, dim=1), state
