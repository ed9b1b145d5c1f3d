"""Per-layer inference state of a hybrid model: KV for attention, conv + SSM state for Mamba.

Shape legend: B batch, K kv heads, S cached length (KV) or conv taps - 1 (conv), E head dim,
X conv channels, H heads, P head dim, N state size.
A `HybridCache` holds one state per block (None for stateless MLP / MoE blocks) and the number
of tokens already seen, which is the position offset of the next forward call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVState:
    k_BKSE: torch.Tensor | None = None
    v_BKSE: torch.Tensor | None = None

    def update(
        self, k_BKLE: torch.Tensor, v_BKLE: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k_BKSE is None:
            self.k_BKSE, self.v_BKSE = k_BKLE, v_BKLE
        else:
            self.k_BKSE = torch.cat([self.k_BKSE, k_BKLE], dim=2)
            self.v_BKSE = torch.cat([self.v_BKSE, v_BKLE], dim=2)
        return self.k_BKSE, self.v_BKSE


@dataclass
class MambaState:
    conv_BSX: torch.Tensor | None = None
    ssm_BHPN: torch.Tensor | None = None


@dataclass
class HybridCache:
    layers: list[KVState | MambaState | None] = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def for_pattern(cls, pattern: str) -> HybridCache:
        make = {"*": KVState, "M": MambaState}
        return cls(layers=[make[c]() if c in make else None for c in pattern])
