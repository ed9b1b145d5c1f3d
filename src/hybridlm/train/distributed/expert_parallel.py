"""Expert parallelism: the routed experts of every MoE layer split over `ep` ranks, tokens moved to
their experts and back by all-to-all (Nemotron 3 Super §2.4 trains with EP 64; GShard, DeepSpeed-
MoE; torchtitan's ExpertParallel). Applied from outside over a built model (DESIGN habit 4).

Shape legend: A assignments (token, expert) of this rank sorted by expert, R assignments this
rank's experts receive, W routed width, F expert hidden, E experts, El = E / ep local experts,
S = ep ranks of the group.

Each MoE layer routes its own tokens (the router, the latent projections and the shared expert
stay data parallel) and sorts the assignments by expert (`Experts.forward`). The dispatch
installed here as `Experts.dispatch`:
  1. exchanges the per-expert counts (an all-to-all of E integers), so every rank knows how many
     rows it receives from each source for each of its El experts;
  2. sends each rank the rows of its experts (`all_to_all_single` with variable splits, dropless:
     no capacity factor, no token is dropped or padded);
  3. regroups the received rows (source-major) by local expert and runs the same expert math as
     one process (`_experts_padded` / `_experts_grouped` / `_experts_loop`) on the local slice
     [El, F, W] of the expert weights;
  4. sends the outputs back (the inverse all-to-all); `Experts.forward` then weights them with
     the gates and sums per token, exactly as without expert parallelism.
The backward of an all-to-all is the all-to-all with the splits swapped, so the gradient of a
local expert collects the contributions of every rank's tokens. The aux-loss-free bias step uses
the global load (each rank counts its routing decisions; the trainer sums them over ranks).

The expert weights are DTensors `Shard(0)` over the `ep` mesh dimension, so the state dict,
distributed checkpoints and `full_tensor()` see the whole [E, F, W] tensor; FSDP2 shards them
further over the data-parallel ranks left (`dp_shard / ep`, `parallel.apply_fsdp2`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ...model.moe import ExpertsFn, MoE, grouped_mm_available


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with variable splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        y = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(y, x.contiguous(), out_splits, in_splits, group=group)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        out_splits, in_splits = ctx.splits
        grad_x = grad_y.new_empty((sum(in_splits), *grad_y.shape[1:]))
        dist.all_to_all_single(grad_x, grad_y.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_x, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows `x` (split `in_splits` over the group's ranks) exchanged; returns the rows received
    (`out_splits` from each rank, in rank order). Differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllDispatch:
    """`Experts.dispatch` over an expert-parallel group: the sorted rows of this rank go to the
    ranks that hold their experts and come back computed (module docstring, steps 1-4)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group()
        self.size = mesh.size()

    def __call__(
        self,
        fn: ExpertsFn,
        z_AW: torch.Tensor,
        counts: list[int],
        up_EFW: torch.Tensor,
        down_EWF: torch.Tensor,
    ) -> torch.Tensor:
        S = self.size
        # A local expert's gradient sums the tokens of all S ranks of the group, each rank's
        # share already scaled for the data-parallel mean; FSDP2 divides by the data-parallel
        # ranks the experts are sharded over (world / S), so 1/S here makes the mean over the
        # world (torchtitan sets FSDP's gradient divide factor instead, which needs a
        # pre-multiplied sum that gloo lacks).
        up_local = _ScaleGrad.apply(_local(up_EFW), 1.0 / S)
        down_local = _ScaleGrad.apply(_local(down_EWF), 1.0 / S)
        El = up_local.shape[0]
        if len(counts) != El * S:
            raise ValueError(f"{len(counts)} experts do not split over {S} expert-parallel ranks")
        dev = z_AW.device
        send_SE = torch.tensor(counts, dtype=torch.int64, device=dev).view(S, El)
        recv_SE = torch.empty_like(send_SE)  # recv_SE[s, j]: rows from rank s for local expert j
        dist.all_to_all_single(recv_SE, send_SE, group=self.group)
        send_splits = send_SE.sum(1).tolist()
        recv_splits = recv_SE.sum(1).tolist()
        z_RW = all_to_all(z_AW, recv_splits, send_splits, self.group)
        # received rows are source-major; order them by local expert (stable: source order kept)
        expert_R = torch.arange(El, device=dev).repeat(S).repeat_interleave(recv_SE.reshape(-1))
        order_R = expert_R.argsort(stable=True)
        y_sorted = fn(z_RW[order_R], recv_SE.sum(0).tolist(), up_local, down_local)
        y_RW = torch.empty_like(y_sorted).index_copy(0, order_R, y_sorted)
        return all_to_all(y_RW, send_splits, recv_splits, self.group)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard the routed experts of every MoE layer of `model` over `ep_mesh` (`Shard(0)` DTensors
    of the expert dimension) and install the all-to-all dispatch. Every rank must hold the same
    full weights before (the same seeded build or the same loaded checkpoint), or a meta-device
    build (`materialize_sharded` then gives each rank its experts)."""
    layers = moe_layers(model)
    S = ep_mesh.size()
    if not layers:
        raise ValueError(f"train.parallel.ep={S} but the model has no MoE layer to split")
    for moe in layers:
        E = moe.cfg.num_experts
        if E % S:
            raise ValueError(f"train.parallel.ep={S} must divide the model's {E} routed experts")
        ex = moe.experts
        for name in ("up_proj", "down_proj"):
            full = getattr(ex, name)
            # every rank slices its own experts (no scatter from rank 0; meta stays meta)
            sharded = distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(ex, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        ex.dispatch = AllToAllDispatch(ep_mesh)
        # the sorted-token paths only: the gathered decode path and the fused MoE decode step
        # read every expert's weights on one device
        # (the mesh's device: the weights may still be on the meta device)
        dev = torch.device(ep_mesh.device_type)
        ex.impl = "grouped" if grouped_mm_available(dev) else "padded"
