"""The chunked SSD scan of Mamba-2 in Triton, forward and backward (Dao & Gu 2024, §6-7).

Shape legend as in `ops.ssd`: B batch, L sequence, H heads, P head dim, G groups, N state
size, Q chunk length, S the state [N, P] a program carries.

One program per (batch row, head) walks the sequence in chunks of Q tokens and keeps the state
in registers (the forward also splits the head dim P over programs: every column's scan is
independent). Per chunk, with acum the within-chunk cumsum of dt*A and X = dt*x:

    y      = (C B^T o Lq) X + diag(e) C S_in         Lq[q,s] = exp(acum_q - acum_s), s <= q
    S_out  = ea S_in + (B o w)^T X                   w_s = exp(a_last - acum_s), ea = exp(a_last)

(e_q = exp(acum_q)), i.e. the four steps of `ops.ssd.ssd_chunked` (intra-chunk, chunk state,
state passing, entering state) fused into one pass that writes y and the final state and
nothing else: the [Q, Q] decays never reach memory, which is what `ssd_chunked` spends most of
its activation bytes on. Packed documents (`doc_ids`) mask Lq to same-document pairs, w to the
chunk's last document, e to the document running at the chunk start, and drop ea when a
document starts inside the chunk, exactly as the reference does.

The backward saves nothing from the forward but its inputs: it first reruns the forward pass
storing the state entering each chunk ([B, H, C, N, P] fp32, freed after the call), then walks
the chunks in reverse carrying dS, the gradient of the state leaving the chunk:

    dX  = (C B^T o Lq)^T dY + (B o w) dS             dS_in = ea dS + (C o e)^T dY
    dC  = (dY X^T o Lq) B + diag(e) dY S_in^T        dB    = (dY X^T o Lq)^T C + diag(w) X dS^T

and the gradient of acum from Lq, e, w and ea, turned into d(dt*A) by a reverse cumsum inside
the chunk. dB and dC come out per head and are summed over the heads of a group by the caller;
dA comes out per (row, head) and is summed over rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import dot_precision, next_pow2

Tensor = torch.Tensor


@triton.jit
def _chunk_inputs(
    c,
    x_ptr,
    dt_ptr,
    b_ptr,
    c_ptr,
    doc_ptr,
    A,
    L,
    sx_l,
    sx_p,
    sdt_l,
    sb_l,
    sb_n,
    sc_l,
    sc_n,
    sd_l,
    P,
    N,
    Q: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """Loads chunk c of one (row, head): x, dt, B, C, the within-chunk cumsum of dt*A and the
    document masks (all True without documents)."""
    q = c * Q + tl.arange(0, Q)
    mq = q < L
    p = tl.arange(0, BP)
    n = tl.arange(0, BN)
    x = tl.load(
        x_ptr + q[:, None] * sx_l + p[None, :] * sx_p,
        mask=mq[:, None] & (p[None, :] < P),
        other=0.0,
    ).to(tl.float32)
    dt = tl.load(dt_ptr + q * sdt_l, mask=mq, other=0.0).to(tl.float32)
    Bq = tl.load(
        b_ptr + q[:, None] * sb_l + n[None, :] * sb_n,
        mask=mq[:, None] & (n[None, :] < N),
        other=0.0,
    ).to(tl.float32)
    Cq = tl.load(
        c_ptr + q[:, None] * sc_l + n[None, :] * sc_n,
        mask=mq[:, None] & (n[None, :] < N),
        other=0.0,
    ).to(tl.float32)
    acum = tl.cumsum(dt * A, axis=0)
    a_last = tl.sum(dt * A, axis=0)
    if HAS_DOCS:
        d = tl.load(doc_ptr + q * sd_l, mask=mq, other=-1)
        last = tl.minimum(c * Q + Q - 1, L - 1)
        d_last = tl.load(doc_ptr + last * sd_l)
        d_prev = tl.load(doc_ptr + tl.maximum(c * Q - 1, 0) * sd_l)
        same = d[:, None] == d[None, :]
        in_last = d == d_last  # inputs that reach the chunk's own final state
        entering = d == d_prev  # positions the entering state reaches
        carried = d_last == d_prev  # no document starts inside the chunk
    else:  # one document: every mask is all True (shaped to broadcast where it is used)
        same = q[:, None] >= 0
        in_last = q >= 0
        entering = q >= 0
        carried = True
    return q, mq, x, dt, Bq, Cq, acum, a_last, same, in_last, entering, carried


@triton.jit
def _program(pid, p0, x_ptr, dt_ptr, b_ptr, c_ptr, doc_ptr, A_ptr, H, R, P, N,
             sx_b, sx_h, sx_p, sdt_b, sdt_h, sb_b, sb_g, sc_b, sc_g, sd_b,
             BP: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """What a (row, head) program works on: its row and head, the head's A, the input
    pointers moved to them (x also to head-dim column p0), and the offsets of its state tile
    S[n, p] in a [B, H, P, N] state (initial and final states, their gradients) with its mask."""
    bi = pid // H
    h = pid % H
    g = h // R
    A = tl.load(A_ptr + h).to(tl.float32)
    p = tl.arange(0, BP)
    n = tl.arange(0, BN)
    sp_mask = (n[:, None] < N) & (p0 + p[None, :] < P)
    s_off = (bi * H + h) * P * N + (p0 + p[None, :]) * N + n[:, None]
    return (
        bi, h, A, x_ptr + bi * sx_b + h * sx_h + p0 * sx_p, dt_ptr + bi * sdt_b + h * sdt_h,
        b_ptr + bi * sb_b + g * sb_g, c_ptr + bi * sc_b + g * sc_g, doc_ptr + bi * sd_b,
        p, n, sp_mask, s_off,
    )  # fmt: skip


@triton.jit
def _ssd_fwd_kernel(
    x_ptr,
    dt_ptr,
    A_ptr,
    b_ptr,
    c_ptr,
    doc_ptr,
    s0_ptr,
    y_ptr,
    sf_ptr,
    st_ptr,
    L,
    H,
    R,
    P,
    N,
    NC,
    sx_b,
    sx_l,
    sx_h,
    sx_p,
    sdt_b,
    sdt_l,
    sdt_h,
    sb_b,
    sb_l,
    sb_g,
    sb_n,
    sc_b,
    sc_l,
    sc_g,
    sc_n,
    sd_b,
    sd_l,
    Q: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_S0: tl.constexpr,
    WRITE_Y: tl.constexpr,
    WRITE_STATES: tl.constexpr,
    PREC: tl.constexpr,
    PS: tl.constexpr,
):
    p0 = tl.program_id(1) * BP  # this program's block of head-dim columns
    bi, h, A, x_ptr, dt_ptr, b_ptr, c_ptr, doc_ptr, p, n, sp_mask, s_off = _program(
        tl.program_id(0), p0, x_ptr, dt_ptr, b_ptr, c_ptr, doc_ptr, A_ptr, H, R, P, N,
        sx_b, sx_h, sx_p, sdt_b, sdt_h, sb_b, sb_g, sc_b, sc_g, sd_b, BP, BN,
    )  # fmt: skip
    if HAS_S0:
        S = tl.load(s0_ptr + s_off, mask=sp_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BN, BP), dtype=tl.float32)
    qi = tl.arange(0, Q)
    causal = qi[:, None] >= qi[None, :]
    for c in range(0, NC):
        q, mq, x, dt, Bq, Cq, acum, a_last, same, in_last, entering, carried = _chunk_inputs(
            c, x_ptr, dt_ptr, b_ptr, c_ptr, doc_ptr, A, L, sx_l, sx_p, sdt_l, sb_l, sb_n,
            sc_l, sc_n, sd_l, P - p0, N, Q, BP, BN, HAS_DOCS,
        )  # fmt: skip
        if WRITE_STATES:  # [B, H, C, BN, P_padded]
            st = st_ptr + ((bi * H + h) * NC + c) * BN * PS + n[:, None] * PS + p0 + p[None, :]
            tl.store(st, S)
        X = x * dt[:, None]
        if WRITE_Y:
            keep = causal & same
            seg = tl.where(keep, acum[:, None] - acum[None, :], float("-inf"))
            cb = tl.dot(Cq, tl.trans(Bq), input_precision=PREC)
            y = tl.dot(cb * tl.exp(seg), X, input_precision=PREC)
            e = tl.where(entering, tl.exp(acum), 0.0)
            y += e[:, None] * tl.dot(Cq, S, input_precision=PREC)
            tl.store(
                y_ptr + ((bi * L + q[:, None]) * H + h) * P + p0 + p[None, :],
                y,
                mask=mq[:, None] & (p0 + p[None, :] < P),
            )
        w = tl.where(in_last, tl.exp(a_last - acum), 0.0)
        ea = tl.where(carried, tl.exp(a_last), 0.0)
        S = ea * S + tl.dot(tl.trans(Bq * w[:, None]), X, input_precision=PREC)
    tl.store(sf_ptr + s_off, S, mask=sp_mask)


@triton.jit
def _ssd_bwd_kernel(
    x_ptr,
    dt_ptr,
    A_ptr,
    b_ptr,
    c_ptr,
    doc_ptr,
    st_ptr,
    dy_ptr,
    dsf_ptr,
    dx_ptr,
    ddt_ptr,
    dA_ptr,
    db_ptr,
    dc_ptr,
    ds0_ptr,
    L,
    H,
    R,
    P,
    N,
    NC,
    sx_b,
    sx_l,
    sx_h,
    sx_p,
    sdt_b,
    sdt_l,
    sdt_h,
    sb_b,
    sb_l,
    sb_g,
    sb_n,
    sc_b,
    sc_l,
    sc_g,
    sc_n,
    sd_b,
    sd_l,
    Q: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_DSF: tl.constexpr,
    PREC: tl.constexpr,
):
    bi, h, A, x_ptr, dt_ptr, b_ptr, c_ptr, doc_ptr, p, n, sp_mask, s_off = _program(
        tl.program_id(0), 0, x_ptr, dt_ptr, b_ptr, c_ptr, doc_ptr, A_ptr, H, R, P, N,
        sx_b, sx_h, sx_p, sdt_b, sdt_h, sb_b, sb_g, sc_b, sc_g, sd_b, BP, BN,
    )  # fmt: skip
    if HAS_DSF:
        dS = tl.load(dsf_ptr + s_off, mask=sp_mask, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros((BN, BP), dtype=tl.float32)
    qi = tl.arange(0, Q)
    causal = qi[:, None] >= qi[None, :]
    dA_acc = tl.zeros((Q,), dtype=tl.float32)
    for k in range(0, NC):
        c = NC - 1 - k
        q, mq, x, dt, Bq, Cq, acum, a_last, same, in_last, entering, carried = _chunk_inputs(
            c, x_ptr, dt_ptr, b_ptr, c_ptr, doc_ptr, A, L, sx_l, sx_p, sdt_l, sb_l, sb_n,
            sc_l, sc_n, sd_l, P, N, Q, BP, BN, HAS_DOCS,
        )  # fmt: skip
        S = tl.load(st_ptr + ((bi * H + h) * NC + c) * BN * BP + n[:, None] * BP + p[None, :])
        qp_mask = mq[:, None] & (p[None, :] < P)
        dY = tl.load(
            dy_ptr + ((bi * L + q[:, None]) * H + h) * P + p[None, :], mask=qp_mask, other=0.0
        )
        X = x * dt[:, None]
        keep = causal & same
        seg = tl.where(keep, acum[:, None] - acum[None, :], float("-inf"))
        decay = tl.exp(seg)  # Lq, zero off the kept pairs
        cb = tl.dot(Cq, tl.trans(Bq), input_precision=PREC)
        M = cb * decay
        e = tl.where(entering, tl.exp(acum), 0.0)
        w = tl.where(in_last, tl.exp(a_last - acum), 0.0)
        ea = tl.where(carried, tl.exp(a_last), 0.0)

        dYX = tl.dot(dY, tl.trans(X), input_precision=PREC)  # d(M) [Q, Q]
        dML = dYX * decay  # d(C B^T) through Lq
        Bw = Bq * w[:, None]
        dX = tl.dot(tl.trans(M), dY, input_precision=PREC) + tl.dot(Bw, dS, input_precision=PREC)
        CS = tl.dot(Cq, S, input_precision=PREC)  # [Q, P]
        dC = tl.dot(dML, Bq, input_precision=PREC)
        dC += e[:, None] * tl.dot(dY, tl.trans(S), input_precision=PREC)
        XdS = tl.dot(X, tl.trans(dS), input_precision=PREC)  # [Q, N]
        dB = tl.dot(tl.trans(dML), Cq, input_precision=PREC) + w[:, None] * XdS

        # d(acum): through Lq (rows +, columns -), e, w; a_last through w and ea
        Gm = dYX * M
        dacum = tl.sum(Gm, axis=1) - tl.sum(Gm, axis=0)
        dacum += e * tl.sum(dY * CS, axis=1)
        t_w = w * tl.sum(Bq * XdS, axis=1)
        dacum -= t_w
        da_last = tl.sum(t_w, axis=0) + ea * tl.sum(tl.sum(dS * S, axis=1), axis=0)
        # acum_q = sum_{j<=q} dA_j and a_last = sum_j dA_j: d(dA_j) = sum_{q>=j} dacum_q + da_last
        ddA = tl.sum(dacum, axis=0) - tl.cumsum(dacum, axis=0) + dacum + da_last
        ddA = tl.where(mq, ddA, 0.0)

        dS = ea * dS + tl.dot(tl.trans(Cq * e[:, None]), dY, input_precision=PREC)

        dx = dX * dt[:, None]
        ddt = tl.sum(dX * x, axis=1) + A * ddA
        dA_acc += dt * ddA
        row = (bi * L + q) * H + h
        tl.store(dx_ptr + row[:, None] * P + p[None, :], dx, mask=qp_mask)
        tl.store(ddt_ptr + row, ddt, mask=mq)
        qn_mask = mq[:, None] & (n[None, :] < N)
        tl.store(db_ptr + row[:, None] * N + n[None, :], dB, mask=qn_mask)
        tl.store(dc_ptr + row[:, None] * N + n[None, :], dC, mask=qn_mask)
    tl.store(ds0_ptr + s_off, dS, mask=sp_mask)
    tl.store(dA_ptr + bi * H + h, tl.sum(dA_acc, axis=0))


def _strides(t: Tensor | None, n: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


def _launch_fwd(x, dt, A, Bm, Cm, docs, s0, Q, prec: str, write_y: bool, write_states: bool):
    """The forward kernel over a (row x head, head-dim block) grid: the scan is independent
    per head-dim column, so splitting P multiplies the programs that run at once (B x H alone
    can leave a GPU's multiprocessors idle) at the price of recomputing C B^T per block."""
    Bsz, L, H, P = x.shape
    G, N = Bm.shape[-2:]
    NC = triton.cdiv(L, Q)
    PS, BN = next_pow2(P), next_pow2(N)
    BP = min(PS, 32)
    f32 = dict(device=x.device, dtype=torch.float32)
    y = torch.empty(Bsz, L, H, P, **f32) if write_y else x.new_empty(0, dtype=torch.float32)
    final = torch.empty(Bsz, H, P, N, **f32)
    states = torch.empty(Bsz, H, NC, BN, PS, **f32) if write_states else final
    dummy = final
    _ssd_fwd_kernel[(Bsz * H, triton.cdiv(P, BP))](
        x, dt, A, Bm, Cm,
        docs if docs is not None else dummy,
        s0 if s0 is not None else dummy,
        y, final, states,
        L, H, H // G, P, N, NC,
        *x.stride(), *dt.stride(), *Bm.stride(), *Cm.stride(), *_strides(docs, 2),
        Q=Q, BP=BP, BN=BN, HAS_DOCS=docs is not None, HAS_S0=s0 is not None,
        WRITE_Y=write_y, WRITE_STATES=write_states, PREC=prec, PS=PS,
        num_warps=_warps(BN * BP),
    )  # fmt: skip
    return y, final, states


def _warps(tile: int) -> int:
    """Warps per program: the [N, P] state and the [Q, Q] tiles live in registers."""
    return 4 if tile <= 2048 else 8


class _SSDFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, Bm, Cm, s0, docs, Q: int):
        prec = dot_precision(x, Bm, Cm)  # decided here: the backward runs outside autocast
        y, final, _ = _launch_fwd(x, dt, A, Bm, Cm, docs, s0, Q, prec, True, False)
        ctx.save_for_backward(x, dt, A, Bm, Cm, s0, docs)
        ctx.Q, ctx.prec = Q, prec
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, Bm, Cm, s0, docs = ctx.saved_tensors
        Q = ctx.Q
        Bsz, L, H, P = x.shape
        G, N = Bm.shape[-2:]
        NC = triton.cdiv(L, Q)
        _, _, states = _launch_fwd(x, dt, A, Bm, Cm, docs, s0, Q, ctx.prec, False, True)
        f32 = dict(device=x.device, dtype=torch.float32)
        dy = torch.zeros(Bsz, L, H, P, **f32) if dy is None else dy.float().contiguous()
        dx = torch.empty(Bsz, L, H, P, **f32)
        ddt = torch.empty(Bsz, L, H, **f32)
        dA = torch.empty(Bsz, H, **f32)
        dB_h = torch.empty(Bsz, L, H, N, **f32)
        dC_h = torch.empty(Bsz, L, H, N, **f32)
        ds0 = torch.empty(Bsz, H, P, N, **f32)
        dsf = None if dfinal is None else dfinal.float().contiguous()
        _ssd_bwd_kernel[(Bsz * H,)](
            x, dt, A, Bm, Cm,
            docs if docs is not None else ds0,
            states, dy,
            dsf if dsf is not None else ds0,
            dx, ddt, dA, dB_h, dC_h, ds0,
            L, H, H // G, P, N, NC,
            *x.stride(), *dt.stride(), *Bm.stride(), *Cm.stride(), *_strides(docs, 2),
            Q=Q, BP=next_pow2(P), BN=next_pow2(N), HAS_DOCS=docs is not None,
            HAS_DSF=dsf is not None, PREC=ctx.prec, num_warps=_warps(next_pow2(N) * next_pow2(P)),
        )  # fmt: skip
        R = H // G
        dB = dB_h.view(Bsz, L, G, R, N).sum(3)
        dC = dC_h.view(Bsz, L, G, R, N).sum(3)
        return (
            dx.to(x.dtype),
            ddt.to(dt.dtype),
            dA.sum(0).to(A.dtype),
            dB.to(Bm.dtype),
            dC.to(Cm.dtype),
            None if s0 is None else ds0.to(s0.dtype),
            None,
            None,
        )


@torch.compiler.disable  # opaque to torch.compile: a graph break (train.compile)
def ssd_chunked_fused(
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
    """`ops.ssd.ssd_chunked` (same arguments and results, fp32 outputs) through the kernels
    above. The kernels' chunk is `chunk_size` rounded to a power of two in [16, 64] (the scan is
    exact for any chunk length; the register tile is what bounds it)."""
    Q = min(64, next_pow2(min(chunk_size, x_BLHP.shape[1])))
    docs = None if doc_ids_BL is None else doc_ids_BL.to(torch.int32).contiguous()
    s0 = None if initial_state_BHPN is None else initial_state_BHPN.float().contiguous()
    y, final = _SSDFused.apply(
        x_BLHP, dt_BLH.float(), A_H.float().contiguous(), B_BLGN, C_BLGN, s0, docs, Q
    )
    if D_H is not None:
        y = y + D_H.float()[:, None] * x_BLHP.float()
    return y, final
