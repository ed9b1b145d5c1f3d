"""Dense MLPs: relu^2 (non-gated, Nemotron-H) and SwiGLU (Olmo 3).

Shape legend: B batch, L sequence, D width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LayerSpec, ModelConfig
from .stock import project


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU (So et al. 2021, Primer), the Nemotron-H MLP and expert activation."""
    return F.relu(x).square()


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, activation: str = "relu2") -> None:
        super().__init__()
        self.activation = activation
        if activation == "swiglu":
            self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig, spec: LayerSpec | None = None) -> MLP:
        return cls(cfg.d_model, cfg.mlp.hidden, cfg.mlp.activation)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.up_proj.weight, std=std)
        if self.activation == "swiglu":
            nn.init.normal_(self.gate_proj.weight, std=std)
        nn.init.normal_(self.down_proj.weight, std=out_std)

    def forward(self, x_BLD: torch.Tensor, **_: object) -> torch.Tensor:
        if self.activation == "swiglu":
            gate = F.silu(project(self.gate_proj, x_BLD))
            return project(self.down_proj, gate * project(self.up_proj, x_BLD))
        return project(self.down_proj, relu2(project(self.up_proj, x_BLD)))
