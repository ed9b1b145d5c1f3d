"""Grouped-query attention mixer: NoPE by default (Nemotron 3), RoPE + YaRN, QK-norm and sliding
windows for the Olmo 3 family.

Shape legend: B batch, L sequence, D model width, H query heads, K kv heads, E head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LayerSpec, ModelConfig
from ..ops import native
from ..ops.attention import attention, attention_masked
from ..ops.rope import apply_rope, rope_cos_sin, rope_frequencies
from .cache import KVState
from .norm import RMSNorm
from .slots import SlotKV
from .stock import project


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        a = self.a = cfg.attention
        d = cfg.d_model
        self.q_proj = nn.Linear(d, a.num_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(d, a.num_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(d, a.num_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, d, bias=False)
        if a.qk_norm:  # over the whole projection, not per head (Olmo 2/3)
            self.q_norm = RMSNorm(a.num_heads * a.head_dim, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(a.num_kv_heads * a.head_dim, eps=cfg.norm_eps)
        self.sliding = spec.sliding
        self.window = a.sliding_window if spec.sliding else None
        # YaRN extends the full-attention layers only; sliding layers keep plain RoPE (Olmo 3 §3.6)
        self.yarn = None if spec.sliding else a.yarn
        self.rope_scaling = 1.0
        self.register_buffer("inv_freq", torch.empty(a.head_dim // 2), persistent=False)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(proj.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=out_std)
        if self.a.qk_norm:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()
        self.init_buffers(self.q_proj.weight.device)

    @torch.no_grad()
    def init_buffers(self, device: torch.device) -> None:
        """Recompute the RoPE frequencies (a non-persistent buffer, never in checkpoints)."""
        if self.a.rope_theta is not None:
            inv_freq, self.rope_scaling = rope_frequencies(
                self.a.head_dim, self.a.rope_theta, self.yarn
            )
            self.inv_freq = inv_freq.to(device)
        else:
            self.inv_freq = torch.zeros(self.a.head_dim // 2, device=device)

    def forward(
        self,
        x_BLD: torch.Tensor,
        *,
        positions_L: torch.Tensor,
        positions_BL: torch.Tensor | None = None,
        attn_mask_B1LS: torch.Tensor | None = None,
        state: KVState | SlotKV | None = None,
        **_: object,
    ) -> torch.Tensor:
        """`positions_BL` / `attn_mask_B1LS` are given for padded batches and packed documents;
        the model builds the mask once per forward for every attention layer (see
        `HybridLM.forward`); its key axis covers the cached columns followed by this call's."""
        a = self.a
        Bsz, L, _ = x_BLD.shape
        q, k, v = (project(p, x_BLD) for p in (self.q_proj, self.k_proj, self.v_proj))
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 heads: the projections may hold this rank's heads only
        # (train.distributed.tensor_parallel)
        q_BHLE = q.view(Bsz, L, -1, a.head_dim).transpose(1, 2)
        k_BKLE = k.view(Bsz, L, -1, a.head_dim).transpose(1, 2)
        v_BKLE = v.view(Bsz, L, -1, a.head_dim).transpose(1, 2)
        if a.rope_theta is not None:
            if positions_BL is not None:
                cos, sin = rope_cos_sin(self.inv_freq, positions_BL, self.rope_scaling)
                cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
            else:
                cos, sin = rope_cos_sin(self.inv_freq, positions_L, self.rope_scaling)
            q_BHLE, k_BKLE = apply_rope(q_BHLE, cos, sin), apply_rope(k_BKLE, cos, sin)
        if isinstance(state, SlotKV):  # static buffers: the mask covers the bucket's columns
            k_BKSE, v_BKSE = state.update(k_BKLE, v_BKLE)
            mask = attn_mask_B1LS
            if self.window is not None:
                mask = mask & state.window_mask(self.window)[:, None]
            o_BHLE = attention_masked(q_BHLE, k_BKSE, v_BKSE, mask)
            return project(self.o_proj, o_BHLE.transpose(1, 2).reshape(Bsz, L, -1))
        if state is None:
            k_BKLE, v_BKLE, offset = self._keys_values(k_BKLE, v_BKLE)
        else:
            offset = state.length  # cache columns before this call
            k_BKLE, v_BKLE = state.update(k_BKLE, v_BKLE)
            if attn_mask_B1LS is None:
                q = q_BHLE.contiguous()  # a view for one token, a copy for a few
                if native.attention_usable(q, k_BKLE, v_BKLE):  # decoding, verification
                    o_BHLE = native.attention(q, k_BKLE, v_BKLE, window=self.window)
                    return project(self.o_proj, o_BHLE.transpose(1, 2).reshape(Bsz, L, -1))
        o_BHLE = attention(
            q_BHLE, k_BKLE, v_BKLE, q_offset=offset, window=self.window, extra_mask=attn_mask_B1LS
        )
        return project(self.o_proj, o_BHLE.transpose(1, 2).reshape(Bsz, L, -1))

    def _keys_values(
        self, k_BKLE: torch.Tensor, v_BKLE: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The keys and values of the whole rows these queries attend to, and the queries'
        position in them: the rows' own, from 0, on one device. Context parallelism
        (`train.distributed.context_parallel`) gathers the shards' and gives this shard's offset."""
        return k_BKLE, v_BKLE, 0
