"""Shared-weight multi-token prediction module (Nemotron 3 Super §2.1.2; DeepSeek-V3 §2.2 wiring).

Shape legend: B batch, L sequence, D model width.

One module, applied recursively at depth k = 1..D. At position t and depth k it takes the hidden
state h^{k-1}_t (h^0 = the backbone's final-normed output, as vLLM feeds its MTP drafter) and
the embedding of token t+k, and predicts token t+k+1 through the shared LM head:

    h^k_t = final_layernorm( blocks( eh_proj([enorm(emb(x_{t+k})); hnorm(h^{k-1}_t)]) ) )

Weight names map 1:1 onto vLLM's NemotronH MTP checkpoint keys (see interop/hf.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .block import build_blocks
from .norm import RMSNorm
from .stock import project


class MTP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.enorm = RMSNorm(d, eps=cfg.norm_eps)
        self.hnorm = RMSNorm(d, eps=cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.layers = build_blocks(cfg, cfg.mtp.pattern, first_index=len(cfg.pattern))
        self.final_layernorm = RMSNorm(d, eps=cfg.norm_eps)

    def forward(
        self,
        h_BLD: torch.Tensor,
        emb_BLD: torch.Tensor,
        *,
        states: list | None = None,
        **ctx: object,
    ) -> torch.Tensor:
        x = project(self.eh_proj, torch.cat([self.enorm(emb_BLD), self.hnorm(h_BLD)], dim=-1))
        for i, block in enumerate(self.layers):
            x = block(x, state=None if states is None else states[i], **ctx)
        return self.final_layernorm(x)
