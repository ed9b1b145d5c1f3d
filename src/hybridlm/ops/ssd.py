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
import torch.nn.functional as F

from . import fused

Tensor = torch.Tensor


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def ssd_chunked(
    x_BLHP: Tensor,
    dt_BLH: Tensor,
    A_H: Tensor,
    B_BLGN: Tensor,
    C_BLGN: Tensor,
    D_H: Tensor | None,
    chunk_size: int,
    initial_state_BHPN: Tensor | None = None,
    doc_ids_BL: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked SSD scan. Returns (y_BLHP, final_state_BHPN) in the compute dtype.

    `doc_ids_BL` (packed documents, non-decreasing per row) resets the state at every document
    start: no term crosses a boundary, so each document's outputs are those of the document run
    alone (the intra-document masking of packed pretraining, Olmo 3 §3.4 / Nemotron-H).
    Inside a chunk the decay matrix is masked to same-document pairs; a chunk's own final state
    keeps only its last document's inputs; the state entering a chunk reaches only positions of
    the document that was running at the chunk start, and is carried past the chunk only if no
    document starts inside it.

    Every contraction is one batched matmul over leading (B, C, G) dims; the per-group C.B^T is
    computed once and shared by the R heads of the group (transformers' reference repeats B and C
    to all heads first). The decay inside a chunk is exp(cumsum_q - cumsum_s), masked to s <= q,
    as in the Mamba-2 Triton kernels.
    """
    Bsz, L, H, P = x_BLHP.shape
    G, N = B_BLGN.shape[-2:]
    R = H // G
    ct = _compute_dtype(x_BLHP)
    Q = chunk_size
    pad = (-L) % Q
    Cn = (L + pad) // Q
    x, dt = x_BLHP.to(ct), dt_BLH.to(ct)
    Bm, Cm = B_BLGN.to(ct), C_BLGN.to(ct)
    if pad:  # zero dt on padding: no decay and no input, so the final state is exact
        x, dt = F.pad(x, (0, 0, 0, 0, 0, pad)), F.pad(dt, (0, 0, 0, pad))
        Bm, Cm = F.pad(Bm, (0, 0, 0, 0, 0, pad)), F.pad(Cm, (0, 0, 0, 0, 0, pad))

    xdt_BCGQRP = (x * dt[..., None]).view(Bsz, Cn, Q, G, R, P).permute(0, 1, 3, 2, 4, 5)
    B_BCGQN = Bm.view(Bsz, Cn, Q, G, N).permute(0, 1, 3, 2, 4)
    C_BCGQN = Cm.view(Bsz, Cn, Q, G, N).permute(0, 1, 3, 2, 4)
    acum_BCGRQ = (dt * A_H.to(ct)).view(Bsz, Cn, Q, G, R).permute(0, 1, 3, 4, 2).cumsum(-1)

    docs = None
    if doc_ids_BL is not None:
        d_BL = doc_ids_BL.to(x.device)
        if pad:
            d_BL = torch.cat([d_BL, d_BL[:, -1:].expand(-1, pad)], dim=1)
        d_BCQ = d_BL.view(Bsz, Cn, Q)
        # the document running just before each chunk (chunk 0: the first token's)
        prev_BC = torch.cat([d_BCQ[:, :1, 0], d_BCQ[:, :-1, -1]], dim=1)
        docs = (
            (d_BCQ[:, :, :, None] == d_BCQ[:, :, None, :])[:, :, None, None],  # same_QS
            (d_BCQ == d_BCQ[:, :, -1:])[:, :, None, :, None],  # with the chunk's last doc
            (d_BCQ[:, :, -1] == prev_BC)[:, :, None, None],  # no boundary inside the chunk
            (d_BCQ == prev_BC[..., None])[:, :, None, :, None, None],  # still the entering doc
        )

    # 1) intra-chunk: y_q = sum_{s<=q} (C_q . B_s) exp(acum_q - acum_s) dt_s x_s
    causal_QS = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    seg_BCGRQS = acum_BCGRQ[..., :, None] - acum_BCGRQ[..., None, :]
    keep_QS = causal_QS if docs is None else causal_QS & docs[0]
    decay_BCGRQS = torch.exp(seg_BCGRQS.masked_fill(~keep_QS, float("-inf")))
    cb_BCGQS = C_BCGQN @ B_BCGQN.transpose(-1, -2)  # once per group, shared by its R heads
    y_diag_BCGRQP = (cb_BCGQS[:, :, :, None] * decay_BCGRQS) @ xdt_BCGQRP.transpose(3, 4)

    # 2) each chunk's own final state, its inputs decayed to the chunk end
    to_end_BCGQR = torch.exp(acum_BCGRQ[..., -1:] - acum_BCGRQ).transpose(3, 4)
    if docs is not None:
        to_end_BCGQR = to_end_BCGQR * docs[1]
    xs_BCGQX = (xdt_BCGQRP * to_end_BCGQR[..., None]).reshape(Bsz, Cn, G, Q, R * P)
    chunk_state_BCGNRP = (B_BCGQN.transpose(-1, -2) @ xs_BCGQX).view(Bsz, Cn, G, N, R, P)

    # 3) recurrence across chunks; state_in[c] is the state entering chunk c
    chunk_decay_BCGR = torch.exp(acum_BCGRQ[..., -1])
    if docs is not None:
        chunk_decay_BCGR = chunk_decay_BCGR * docs[2]
    if initial_state_BHPN is None:
        state_BGNRP = x.new_zeros(Bsz, G, N, R, P)
    else:
        state_BGNRP = initial_state_BHPN.to(ct).view(Bsz, G, R, P, N).permute(0, 1, 4, 2, 3)
    states_in = []
    for c in range(Cn):
        states_in.append(state_BGNRP)
        state_BGNRP = (
            chunk_decay_BCGR[:, c, :, None, :, None] * state_BGNRP + chunk_state_BCGNRP[:, c]
        )
    state_in_BCGNX = torch.stack(states_in, 1).reshape(Bsz, Cn, G, N, R * P)

    # 4) the entering state's contribution, decayed from the chunk start
    y_off_BCGQRP = (C_BCGQN @ state_in_BCGNX).view(Bsz, Cn, G, Q, R, P)
    y_off_BCGQRP = y_off_BCGQRP * torch.exp(acum_BCGRQ).transpose(3, 4)[..., None]
    if docs is not None:
        y_off_BCGQRP = y_off_BCGQRP * docs[3]

    y_BCGQRP = y_diag_BCGRQP.transpose(3, 4) + y_off_BCGQRP
    y_BLHP = y_BCGQRP.permute(0, 1, 3, 2, 4, 5).reshape(Bsz, Cn * Q, H, P)[:, :L]
    if D_H is not None:
        y_BLHP = y_BLHP + D_H.to(ct)[:, None] * x[:, :L]
    return y_BLHP, state_BGNRP.permute(0, 1, 3, 4, 2).reshape(Bsz, H, P, N)


def ssd_scan(
    x_BLHP: Tensor,
    dt_BLH: Tensor,
    A_H: Tensor,
    B_BLGN: Tensor,
    C_BLGN: Tensor,
    D_H: Tensor | None,
    chunk_size: int,
    initial_state_BHPN: Tensor | None = None,
    doc_ids_BL: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The scan a Mamba-2 mixer runs over whole rows: `ssd_chunked`, through the fused Triton
    kernels (`ops.fused.ssd`, one pass per (row, head), no [Q, Q] decays in memory) where
    `fused.usable` says so (CUDA tensors)."""
    args = (x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, D_H, chunk_size, initial_state_BHPN, doc_ids_BL)
    if fused.usable(x_BLHP, dt_BLH, B_BLGN, C_BLGN, initial_state_BHPN):
        from .fused.ssd import ssd_chunked_fused

        return ssd_chunked_fused(*args)
    return ssd_chunked(*args)


def ssd_step(
    state_BHPN: Tensor,
    x_BHP: Tensor,
    dt_BH: Tensor,
    A_H: Tensor,
    B_BGN: Tensor,
    C_BGN: Tensor,
    D_H: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """One recurrence step. Returns (y_BHP, new_state_BHPN) in the compute dtype. Heads are
    viewed as [G, R] so each group's B and C broadcast to its R heads without copies."""
    ct = _compute_dtype(state_BHPN if state_BHPN.dtype == torch.float64 else x_BHP)
    Bsz, H, P = x_BHP.shape
    G, N = B_BGN.shape[1:]
    R = H // G
    x, dt = x_BHP.to(ct), dt_BH.to(ct)
    decay_BH = torch.exp(dt * A_H.to(ct))
    xdt_BGRP1 = (x * dt[..., None]).view(Bsz, G, R, P, 1)
    state_BGRPN = state_BHPN.to(ct).view(Bsz, G, R, P, N) * decay_BH.view(Bsz, G, R, 1, 1)
    state_BGRPN = state_BGRPN + xdt_BGRP1 * B_BGN.to(ct)[:, :, None, None, :]
    y_BGRP = (state_BGRPN * C_BGN.to(ct)[:, :, None, None, :]).sum(-1)
    y = y_BGRP.reshape(Bsz, H, P)
    if D_H is not None:
        y = y + D_H.to(ct)[:, None] * x
    return y, state_BGRPN.reshape(Bsz, H, P, N)


def ssd_states(
    x_BLHP: Tensor,
    dt_BLH: Tensor,
    A_H: Tensor,
    B_BLGN: Tensor,
    C_BLGN: Tensor,
    D_H: Tensor | None,
    initial_state_BHPN: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The state after *every* position of a short segment in closed form (speculative
    verification of a few drafts): state_t = exp(acum_t) state_0 + sum_{s<=t} exp(acum_t -
    acum_s) dt_s x_s (outer) B_s, all positions in a handful of batched contractions instead of
    one step per token. Returns (y_BLHP, states_BLHPN); equals `ssd_recurrent(...,
    return_states=True)` (tested). Memory is L^2 decays + L states, so keep L small."""
    Bsz, L, H, P = x_BLHP.shape
    G, N = B_BLGN.shape[-2:]
    R = H // G
    ct = _compute_dtype(x_BLHP)
    x, dt = x_BLHP.to(ct), dt_BLH.to(ct)
    acum_BLH = torch.cumsum(dt * A_H.to(ct), dim=1)
    seg_BTSH = acum_BLH[:, :, None, :] - acum_BLH[:, None, :, :]
    causal_TS = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    w_BTSGR = torch.exp(seg_BTSH.masked_fill(~causal_TS[..., None], float("-inf"))).view(
        Bsz, L, L, G, R
    )
    xdt_BSGRP = (x * dt[..., None]).view(Bsz, L, G, R, P)
    states = torch.einsum("btsgr,bsgrp,bsgn->btgrpn", w_BTSGR, xdt_BSGRP, B_BLGN.to(ct))
    if initial_state_BHPN is not None:
        carry_BLGR = torch.exp(acum_BLH).view(Bsz, L, G, R)
        s0_BGRPN = initial_state_BHPN.to(ct).view(Bsz, G, R, P, N)
        states = states + carry_BLGR[..., None, None] * s0_BGRPN[:, None]
    y_BLGRP = (states * C_BLGN.to(ct)[:, :, :, None, None, :]).sum(-1)
    y = y_BLGRP.reshape(Bsz, L, H, P)
    if D_H is not None:
        y = y + D_H.to(ct)[:, None] * x
    return y, states.reshape(Bsz, L, H, P, N)


def ssd_recurrent(
    x_BLHP: Tensor,
    dt_BLH: Tensor,
    A_H: Tensor,
    B_BLGN: Tensor,
    C_BLGN: Tensor,
    D_H: Tensor | None,
    initial_state_BHPN: Tensor | None = None,
    *,
    return_states: bool = False,
    doc_ids_BL: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-by-token reference for `ssd_chunked` (same signature minus the chunk size). With
    `return_states` the second output is the state after every token, [B, L, H, P, N]; decoding
    uses this to keep a state per draft position (speculative verification). `doc_ids_BL`
    zeroes the state where a new document starts."""
    Bsz, L, H, P = x_BLHP.shape
    N = B_BLGN.shape[-1]
    ct = _compute_dtype(x_BLHP)
    state = (
        x_BLHP.new_zeros(Bsz, H, P, N, dtype=ct)
        if initial_state_BHPN is None
        else initial_state_BHPN.to(ct)
    )
    ys, states = [], []
    for t in range(L):
        if doc_ids_BL is not None and t > 0:  # a document starts: forget the state
            same_B = (doc_ids_BL[:, t] == doc_ids_BL[:, t - 1]).to(state.dtype)
            state = state * same_B[:, None, None, None]
        y, state = ssd_step(state, x_BLHP[:, t], dt_BLH[:, t], A_H, B_BLGN[:, t], C_BLGN[:, t], D_H)
        ys.append(y)
        states.append(state)
    if return_states:
        return torch.stack(ys, dim=1), torch.stack(states, dim=1)
    return torch.stack(ys, dim=1), state
