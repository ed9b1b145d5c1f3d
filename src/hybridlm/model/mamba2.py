"""Mamba-2 mixer: in_proj -> causal depthwise conv -> SSD scan -> gated RMSNorm -> out_proj.

Shape legend: B batch, L sequence, D model width, I = H*P inner width, H heads, P head dim,
G groups, N state size, X = I + 2*G*N conv channels.
Parameter names and the in_proj split order [z | x B C | dt] follow transformers' NemotronH so
checkpoints convert by renaming only (Nemotron 3 Super notes §1.3).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LayerSpec, ModelConfig
from ..ops import fused, native
from ..ops.conv1d import causal_conv1d_silu
from ..ops.ssd import ssd_scan, ssd_states, ssd_step
from .cache import MambaState
from .norm import GatedRMSNorm, gated_rms_norm
from .stock import is_stock, project


def mamba2_decode_step_torch(
    x_BD: torch.Tensor,
    conv_BSX: torch.Tensor,
    ssm_BHPN: torch.Tensor,
    in_w: torch.Tensor,
    conv_w_XK: torch.Tensor,
    conv_b_X: torch.Tensor | None,
    dt_bias_H: torch.Tensor,
    A_log_H: torch.Tensor,
    D_H: torch.Tensor,
    norm_w_I: torch.Tensor,
    out_w: torch.Tensor,
    *,
    heads: int,
    head_dim: int,
    groups: int,
    state_size: int,
    dt_clamp_min: float,
    dt_clamp_max: float | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step of the mixer as a single pure function of tensors (same math as
    `Mamba2Mixer.forward` with L = 1: conv tap sum, `ssd_step`, group-gated RMSNorm), so it can
    be compiled into a few fused kernels (`HybridLM.compile_decode`). Returns
    (y_BD, new conv_BSX, new ssm_BHPN); parity with the generic path is tested. The reference
    of the native step (`mamba2_decode_step`)."""
    Bsz = x_BD.shape[0]
    I, GN = heads * head_dim, groups * state_size
    z_BI, xbc_BX, dt_BH = F.linear(x_BD, in_w).split([I, I + 2 * GN, heads], dim=-1)
    xp_BKX = torch.cat([conv_BSX.to(xbc_BX.dtype), xbc_BX[:, None]], dim=1)
    xbc_BX = (xp_BKX * conv_w_XK.t()).sum(1)
    if conv_b_X is not None:
        xbc_BX = xbc_BX + conv_b_X
    xs_BI, B_BG, C_BG = F.silu(xbc_BX).split([I, GN, GN], dim=-1)
    ct = torch.promote_types(x_BD.dtype, torch.float32)
    dt_BH = F.softplus(dt_BH.to(ct) + dt_bias_H.to(ct)).clamp(min=dt_clamp_min, max=dt_clamp_max)
    y_BHP, state_BHPN = ssd_step(
        ssm_BHPN,
        xs_BI.view(Bsz, heads, head_dim),
        dt_BH,
        -torch.exp(A_log_H.to(ct)),
        B_BG.view(Bsz, groups, state_size),
        C_BG.view(Bsz, groups, state_size),
        D_H,
    )
    y_BI = gated_rms_norm(y_BHP.reshape(Bsz, I), z_BI, norm_w_I, I // groups, eps)
    y_BD = F.linear(y_BI.to(x_BD.dtype), out_w)
    return y_BD, xp_BKX[:, 1:], state_BHPN


def mamba2_decode_step(
    x_BD: torch.Tensor, conv_BSX: torch.Tensor, ssm_BHPN: torch.Tensor, *weights: Any, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mamba2_decode_step_torch` (same arguments): on CUDA tensors the in_proj GEMM, one
    Triton kernel from the conv tap to the gated norm (`ops.fused.mamba_step`) and the out_proj
    GEMM; through the native kernels when they qualify (fp32 CPU inference, `ops.native`):
    in_proj GEMV, one fused pass, out_proj GEMV; otherwise the torch function itself."""
    if fused.usable(x_BD, conv_BSX, ssm_BHPN, *weights):
        from ..ops.fused.mamba_step import mamba2_decode_step_fused

        return mamba2_decode_step_fused(x_BD, conv_BSX, ssm_BHPN, *weights, **kw)
    if not native.usable(x_BD, conv_BSX, ssm_BHPN, *weights):
        return mamba2_decode_step_torch(x_BD, conv_BSX, ssm_BHPN, *weights, **kw)
    in_w, conv_w_XK, conv_b_X, dt_bias_H, A_log_H, D_H, norm_w_I, out_w = weights
    y_BI, conv_BSX, ssm_BHPN = native.mamba_step(
        native.linear(x_BD, in_w),
        conv_BSX,
        ssm_BHPN,
        conv_w_XK,
        conv_b_X,
        dt_bias_H,
        A_log_H,
        D_H,
        norm_w_I,
        groups=kw["groups"],
        dt_clamp_min=kw["dt_clamp_min"],
        dt_clamp_max=kw["dt_clamp_max"],
        eps=kw["eps"],
    )
    return native.linear(y_BI, out_w), conv_BSX, ssm_BHPN


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec | None = None) -> None:
        super().__init__()
        m = self.m = cfg.mamba
        d = cfg.d_model
        self.in_proj = nn.Linear(
            d, 2 * m.d_inner + 2 * m.n_groups * m.state_size + m.num_heads, bias=False
        )
        self.conv1d = nn.Conv1d(
            m.conv_dim, m.conv_dim, m.conv_kernel, groups=m.conv_dim, bias=m.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads))
        self.A_log = nn.Parameter(torch.empty(m.num_heads))
        self.D = nn.Parameter(torch.empty(m.num_heads))
        self.norm = GatedRMSNorm(m.d_inner, m.d_inner // m.n_groups, eps=cfg.norm_eps)
        self.out_proj = nn.Linear(m.d_inner, d, bias=False)
        self.decode_fn = mamba2_decode_step  # HybridLM.compile_decode swaps in a compiled one
        self.eps = cfg.norm_eps

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        m = self.m
        nn.init.normal_(self.in_proj.weight, std=std)
        nn.init.normal_(self.out_proj.weight, std=out_std)
        self.conv1d.reset_parameters()
        # A in [1, 16] as in the Mamba-2 reference (A_init_range); stored as log for positivity
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        # dt ~ logU[dt_min, dt_max]; dt_bias = softplus^{-1}(dt) (Mamba §3.6 init)
        dt = torch.exp(
            torch.rand_like(self.dt_bias) * (math.log(m.dt_max) - math.log(m.dt_min))
            + math.log(m.dt_min)
        ).clamp(min=m.dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.D.fill_(1.0)
        self.norm.reset_parameters()

    def forward(
        self,
        x_BLD: torch.Tensor,
        *,
        state: MambaState | None = None,
        token_mask_BL: torch.Tensor | None = None,
        doc_ids_BL: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        """`token_mask_BL` (False on left padding): padded positions get zero conv input and
        zero dt, i.e. no decay and no input, so the states a row carries past its padding are
        exactly those of the unpadded row. `doc_ids_BL` (packed documents): conv taps and the
        SSD state do not cross document boundaries."""
        m = self.m
        Bsz, L, _ = x_BLD.shape
        if (
            L == 1
            and state is not None
            and state.conv_BSX is not None
            and not state.record_history
            and token_mask_BL is None
            and self.decode_fn is not None
            and is_stock(self)
        ):
            return self._decode(x_BLD, state)
        if (
            state is not None
            and state.conv_BSX is not None
            and token_mask_BL is None
            and self.decode_fn is not None
            and native.usable(x_BLD, state.conv_BSX, self.in_proj.weight)
            and is_stock(self)
        ):
            return self._short_segment(x_BLD, state)
        GN = m.n_groups * m.state_size
        z_BLI, xbc_BLX, dt_BLH = project(self.in_proj, x_BLD).split(
            [m.d_inner, m.conv_dim, m.num_heads], dim=-1
        )

        if token_mask_BL is not None:
            xbc_BLX = xbc_BLX * token_mask_BL[..., None].to(xbc_BLX.dtype)
        conv_in = state.conv_BSX if state is not None else None
        xbc_pre_BLX = xbc_BLX
        if state is None:
            xbc_BLX, conv_out = self._conv_rows(xbc_BLX, doc_ids_BL), None
        elif doc_ids_BL is not None:
            raise ValueError("doc_ids (packed training documents) do not combine with a cache")
        else:  # conv and SiLU fused (`ops.conv1d.causal_conv1d_silu`)
            xbc_BLX, conv_out = causal_conv1d_silu(
                xbc_BLX, self.conv1d.weight[:, 0], self.conv1d.bias, conv_in
            )
        xs_BLI, B_BLG, C_BLG = xbc_BLX.split([m.d_inner, GN, GN], dim=-1)

        ct = torch.promote_types(x_BLD.dtype, torch.float32)  # fp32 at least, fp64 stays fp64
        dt_BLH = F.softplus(dt_BLH.to(ct) + self.dt_bias.to(ct))
        dt_BLH = dt_BLH.clamp(min=m.dt_clamp_min, max=m.dt_clamp_max)
        if token_mask_BL is not None:
            dt_BLH = dt_BLH * token_mask_BL[..., None]
        A_H = -torch.exp(self.A_log.to(ct))
        xs = xs_BLI.reshape(Bsz, L, m.num_heads, m.head_dim)
        Bm = B_BLG.reshape(Bsz, L, m.n_groups, m.state_size)
        Cm = C_BLG.reshape(Bsz, L, m.n_groups, m.state_size)
        ssm_in = state.ssm_BHPN if state is not None else None
        if state is not None and state.record_history:
            # speculative verification: the state after every position (closed form over the
            # few verified tokens), so rejected drafts roll back without recomputation
            # (`MambaState.rewind`)
            y_BLHP, ssm_BLHPN = ssd_states(xs, dt_BLH, A_H, Bm, Cm, self.D, ssm_in)
            ssm_out = ssm_BLHPN[:, -1]
            state.set_history(conv_in, xbc_pre_BLX, ssm_BLHPN)
        elif L == 1 and ssm_in is not None:
            y, ssm_out = ssd_step(ssm_in, xs[:, 0], dt_BLH[:, 0], A_H, Bm[:, 0], Cm[:, 0], self.D)
            y_BLHP = y[:, None]
        else:
            y_BLHP, ssm_out = ssd_scan(
                xs, dt_BLH, A_H, Bm, Cm, self.D, m.chunk_size, ssm_in, doc_ids_BL
            )
        if state is not None:
            state.conv_BSX, state.ssm_BHPN = conv_out, ssm_out
        else:
            y_BLHP = self._add_entering_state(y_BLHP, dt_BLH * A_H, Cm, ssm_out, doc_ids_BL)

        y_BLI = self.norm(y_BLHP.reshape(Bsz, L, m.d_inner), z_BLI)
        return project(self.out_proj, y_BLI.to(x_BLD.dtype))

    # What these rows see of the rows beyond them: nothing on one device, where they are
    # whole. Context parallelism (`train.distributed.context_parallel`) overrides both for
    # one shard.
    def _conv_rows(self, xbc_BLX: torch.Tensor, doc_ids_BL: torch.Tensor | None) -> torch.Tensor:
        """SiLU of the causal conv of training rows (from zero taps; reset at document starts
        with `doc_ids_BL`)."""
        w, b = self.conv1d.weight[:, 0], self.conv1d.bias
        return causal_conv1d_silu(xbc_BLX, w, b, None, doc_ids_BL)[0]  # conv and SiLU fused

    def _add_entering_state(
        self,
        y_BLHP: torch.Tensor,
        dA_BLH: torch.Tensor,
        C_BLGN: torch.Tensor,
        final_BHPN: torch.Tensor,
        doc_ids_BL: torch.Tensor | None,
    ) -> torch.Tensor:
        """`y_BLHP` of rows scanned from a zero state (ending in `final_BHPN`) plus the output
        of the state that enters them from before: none, the rows start the sequence."""
        return y_BLHP

    def _short_segment(self, x_BLD: torch.Tensor, state: MambaState) -> torch.Tensor:
        """A few tokens continuing a cache (speculative verification, short appends): the
        fused decode step of `ops.native` once per position, so no chunk is padded to
        `chunk_size` and every position's state is the decode step's own. With
        `record_history` the state after each position is kept for `MambaState.rewind`."""
        m = self.m
        L = x_BLD.shape[1]
        zxbcdt_BLR = project(self.in_proj, x_BLD)
        conv_in, conv, ssm = state.conv_BSX, state.conv_BSX, state.ssm_BHPN
        ys, states = [], []
        for t in range(L):
            y_BI, conv, ssm = native.mamba_step(
                zxbcdt_BLR[:, t].contiguous(),
                conv,
                ssm,
                *self._step_params(),
                groups=m.n_groups,
                dt_clamp_min=m.dt_clamp_min,
                dt_clamp_max=m.dt_clamp_max,
                eps=self.eps,
            )
            ys.append(y_BI)
            states.append(ssm)
        if state.record_history:
            xbc_BLX = zxbcdt_BLR[..., m.d_inner : m.d_inner + m.conv_dim]
            state.set_history(conv_in, xbc_BLX, torch.stack(states, dim=1))
        state.conv_BSX, state.ssm_BHPN = conv, ssm
        return project(self.out_proj, torch.stack(ys, dim=1))

    def _step_params(self) -> tuple[torch.Tensor | None, ...]:
        """The tensors of the step between in_proj and out_proj, in the decode steps' order:
        conv weight [X, K], conv bias, dt_bias, A_log, D, gated-norm weight."""
        return (
            self.conv1d.weight[:, 0],
            self.conv1d.bias,
            self.dt_bias,
            self.A_log,
            self.D,
            self.norm.weight,
        )

    def _decode(self, x_BLD: torch.Tensor, state: MambaState) -> torch.Tensor:
        m = self.m
        y_BD, state.conv_BSX, state.ssm_BHPN = self.decode_fn(
            x_BLD[:, 0],
            state.conv_BSX,
            state.ssm_BHPN,
            self.in_proj.weight,
            *self._step_params(),
            self.out_proj.weight,
            heads=m.num_heads,
            head_dim=m.head_dim,
            groups=m.n_groups,
            state_size=m.state_size,
            dt_clamp_min=m.dt_clamp_min,
            dt_clamp_max=m.dt_clamp_max,
            eps=self.eps,
        )
        return y_BD[:, None]
