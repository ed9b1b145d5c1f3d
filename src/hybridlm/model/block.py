"""Residual blocks built from the pattern string through one mixer dict.

Shape legend: B batch, L sequence, D model width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config import LayerSpec, ModelConfig
from .attention import Attention
from .mamba2 import Mamba2Mixer
from .mlp import MLP
from .moe import MoE
from .norm import RMSNorm

# Adding a mixer kind adds one entry here (and one letter in config.MIXER_LETTERS).
MIXERS: dict[str, Callable[[ModelConfig, LayerSpec], nn.Module]] = {
    "M": Mamba2Mixer,
    "*": Attention,
    "E": MoE,
    "-": MLP.from_config,
}


class Block(nn.Module):
    """`x + mixer(norm(x))` (pre-norm, Nemotron-H) or `x + norm(mixer(x))` (Olmo 3 reordered)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.letter = spec.letter
        self.post_norm = cfg.norm_placement == "post"
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mixer = MIXERS[spec.letter](cfg, spec)

    def forward(self, x_BLD: torch.Tensor, **ctx: object) -> torch.Tensor:
        if self.post_norm:
            return x_BLD + self.norm(self.mixer(x_BLD, **ctx))
        return x_BLD + self.mixer(self.norm(x_BLD), **ctx)


def build_blocks(cfg: ModelConfig, pattern: str, first_index: int = 0) -> nn.ModuleList:
    sliding = iter(cfg.attention_is_sliding()) if pattern == cfg.pattern else None
    blocks = []
    for i, letter in enumerate(pattern):
        is_sliding = bool(next(sliding)) if (letter == "*" and sliding is not None) else False
        blocks.append(Block(cfg, LayerSpec(first_index + i, letter, is_sliding)))
    return nn.ModuleList(blocks)
