"""Regional `torch.compile` for training (`train.compile`), applied from outside over a built
model like activation checkpointing and the parallelisms (DESIGN habit 4; torchtitan compiles
per block too).

What is compiled, each module in place (`nn.Module.compile`):
- every block's norm and every Mamba-2, attention and dense-MLP mixer: the elementwise chains
  around the GEMMs (in_proj's split, softplus and clamp of dt, the D skip, RoPE, QK-norm,
  SwiGLU) become a few fused kernels instead of dozens of launches;
- in a MoE mixer, the router, the latent projections and the shared expert, but not the routed
  experts' dispatch: its per-expert token counts are data (`bincount(...).tolist()`), where a
  compiled frame breaks its graph and then recompiles with dynamic shapes, and around the
  grouped GEMMs only relu^2 is left to fuse.

The Triton kernels of `ops.fused` (SSD scan, conv + SiLU, gated norm) are opaque to the
compiler (`torch.compiler.disable` on their entry points): the graph breaks around them and
they run as they do eagerly. Block shapes do not change between training steps, so after the
first step nothing recompiles (`tests/test_compile.py` counts the graphs).
"""

from __future__ import annotations

from torch import nn

from ..model.attention import Attention
from ..model.mamba2 import Mamba2Mixer
from ..model.mlp import MLP
from ..model.moe import MoE

_MOE_PARTS = ("gate", "fc1_latent_proj", "fc2_latent_proj", "shared_experts")


def apply_compile(model: nn.Module, backend: str = "inductor") -> list[str]:
    """Compile the regions above in place with `backend` (torch.compile's; the tests also use
    "aot_eager", which captures the same graphs without generating kernels); returns the
    compiled modules' names."""
    names = {id(m): n for n, m in model.named_modules()}
    blocks = list(model.layers) + [b for h in model.mtp_heads() for b in h.layers]
    compiled = []
    for block in blocks:
        regions = [block.norm]
        mixer = block.mixer
        if isinstance(mixer, MoE):
            regions += [
                getattr(mixer, p)
                for p in _MOE_PARTS
                if isinstance(getattr(mixer, p, None), nn.Module)
            ]
        elif isinstance(mixer, Mamba2Mixer | Attention | MLP):
            regions.append(mixer)
        for module in regions:
            module.compile(backend=backend)
            compiled.append(names[id(module)])
    return compiled
