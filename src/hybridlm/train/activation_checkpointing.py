"""Activation checkpointing per block (`train.activation_checkpointing`), applied from outside
over a built model like the parallelisms (DESIGN habit 4; torchtitan's `apply_ac`).

- "full": a block keeps only its input; its forward runs again in the backward (memory per
  block ~ B*L*D, compute ~ +1 forward).
- "selective": op-level selective checkpointing: the outputs of the compute-heavy ops (matrix
  products, attention, the grouped expert GEMMs) are kept, the cheap elementwise work (norms,
  activations, gates, the SSD scan's elementwise steps) is recomputed.
- "none": everything the backward needs is kept.

The recomputed forward has no side effects: a MoE layer does not count its routing again
(`MoE.count_routing`; `load_E` is the input of the aux-loss-free bias step), and its
balancing-loss terms go to a throwaway sink, so the bias step and the loss equal those of a
run without checkpointing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ..model.moe import AuxSink, MoE

MODES = ("none", "selective", "full")

# ops whose outputs selective checkpointing keeps (the rest is recomputed)
_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _SAVE.add(torch.ops.aten._grouped_mm.default)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_policy)


class _Checkpointed:
    """A block's forward run under `torch.utils.checkpoint` (non-reentrant)."""

    def __init__(self, block: nn.Module, selective: bool) -> None:
        self.forward = block.forward
        self.moe = [m for m in block.modules() if isinstance(m, MoE)]
        self.selective = selective

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls = [0]

        def run(*a: Any, **k: Any) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 1:  # the forward
                return self.forward(*a, **k)
            # the recomputation in the backward: no second count, no second loss term
            for m in self.moe:
                m.count_routing = False
            try:
                return self.forward(*a, **{**k, "aux_sink": AuxSink()} if "aux_sink" in k else k)
            finally:  # also when the recomputation stops early
                for m in self.moe:
                    m.count_routing = True

        extra = {"context_fn": _selective_contexts} if self.selective else {}
        return checkpoint(
            run, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs
        )


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Checkpoint every block of `model.layers` and of the MTP module in `mode` ("none",
    "selective", "full"); returns the number of blocks wrapped. The parameters and their names
    are unchanged (the block's forward is wrapped, not the module), so checkpoints and state
    dicts are the same; apply before FSDP2 (which then gathers each block's weights for the
    recomputation too)."""
    if mode not in MODES:
        raise ValueError(
            f"train.activation_checkpointing must be one of {list(MODES)}, got {mode!r}"
        )
    if mode == "none":
        return 0
    blocks = list(model.layers) + [b for h in model.mtp_heads() for b in h.layers]
    for block in blocks:
        block.forward = _Checkpointed(block, selective=mode == "selective")
    return len(blocks)
