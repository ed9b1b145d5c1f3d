"""Tensor parallelism over the `tp` dimension of the job's DeviceMesh (Megatron-LM §3), applied
from outside the model with DTensor plans, as torchtitan does.

What each rank of a tensor-parallel group holds:

- attention: q / k / v projections split column-wise by heads (num_heads / tp query heads and
  num_kv_heads / tp KV heads per rank, so GQA groups stay whole), o_proj row-wise (one
  all-reduce of the block's output). Olmo 3's QK-norm normalises the whole projection, not each
  head, so its sum of squares is all-reduced over the group (`ShardedRMSNorm`).
- Mamba-2: each rank its num_heads / tp heads and n_groups / tp groups of B and C (Mamba-2's
  tensor-parallel layout, Dao & Gu 2024 §8): its rows of every part of the packed in_proj
  [z | x | B | C | dt] and of the conv [x | B | C], its dt_bias / A_log / D, its gated-norm
  groups and out_proj columns (row-wise: one all-reduce of the block's output). Conv, SSD and
  norm run on the local heads unchanged. Such a parameter is stored in rank order (its rows
  permuted so that each rank's are one `Shard(0)` block, `row_order`); whole tensors (full
  checkpoints, export, init) and sharded checkpoints (DCP chunks) keep the canonical order.
- dense MLP (SwiGLU or ReLU^2) and the MoE shared expert: up / gate column-wise, down row-wise.
- embeddings: vocabulary rows split (a masked lookup and an all-reduce). LM head: vocabulary
  rows split; the training loss is `vocab_parallel_cross_entropy` (each rank its columns of the
  logits; the max, the sum of exponentials and the target logit are all-reduced), so no rank
  holds the [tokens, vocab] logits; the logits of evaluation and generation are gathered.
- routed experts, without expert parallelism: E / tp experts per rank (`Shard(0)` of the
  expert dimension). The MoE input is replicated, so every rank already holds every sorted
  (token, expert) row: it computes those of its experts and the outputs are all-gathered
  (`ExpertsOverGroup`; the tp ranks act as expert-parallel ranks without an all-to-all,
  torchtitan's "EP borrows TP"). With `ep > 1` the experts are split by EP and replicated over tp.
- replicated (each rank computes them on the same input, so their gradients are equal on every
  rank of the group and need no reduction): norms, the router, the latent projections and the
  MTP projection.

No sequence parallelism: activations between blocks are replicated over the group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from ...model.attention import Attention
from ...model.mamba2 import Mamba2Mixer
from ...model.mlp import MLP
from ...model.moe import MoE, grouped_mm_available
from ...model.norm import RMSNorm
from ...ops.cross_entropy import VocabShard, linear_cross_entropy


class _SumReplicatedOut(torch.autograd.Function):
    """All-reduce (sum) over the group whose result feeds replicated computation: every rank
    gets the whole gradient of the result, so the backward passes it through (Megatron's
    "reduce from the model-parallel region")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _CopyToGroup(torch.autograd.Function):
    """Identity whose gradient is summed over the group: a replicated input of split
    computation (Megatron's "copy to the model-parallel region")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _GatherRows(torch.autograd.Function):
    """All-gather of row blocks of different sizes (rank order) whose result feeds replicated
    computation: the backward keeps this rank's block of the (whole) gradient."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, sizes: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.lo, ctx.n = sum(sizes[:rank]), sizes[rank]
        buf = y.new_zeros((max(sizes), *y.shape[1:]))
        buf[: ctx.n] = y
        parts = [torch.empty_like(buf) for _ in sizes]
        dist.all_gather(parts, buf, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return g[ctx.lo : ctx.lo + ctx.n], None, None, None


class ExpertsOverGroup:
    """`Experts.dispatch` for routed experts split over the tensor-parallel group (module
    docstring): this rank's experts' rows of the (replicated) sorted rows, computed on the local
    expert weights, then all-gathered; the rows' input gradient is summed over the group."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group, self.rank, self.size = mesh.get_group(), mesh.get_local_rank(), mesh.size()

    def __call__(
        self,
        fn: Any,
        z_AW: torch.Tensor,
        counts: list[int],
        up_EFW: torch.Tensor,
        down_EWF: torch.Tensor,
    ) -> torch.Tensor:
        S, r = self.size, self.rank
        El = len(counts) // S
        sizes = [sum(counts[s * El : (s + 1) * El]) for s in range(S)]
        lo = sum(sizes[:r])
        z_RW = _CopyToGroup.apply(z_AW, self.group)[lo : lo + sizes[r]]
        up, down = (w.to_local() if isinstance(w, DTensor) else w for w in (up_EFW, down_EWF))
        y_RW = fn(z_RW, counts[r * El : (r + 1) * El], up, down)
        return _GatherRows.apply(y_RW, sizes, r, self.group)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a dimension split across the tensor-parallel group (Olmo 2/3 QK-norm over the
    whole q / k projection): the weight is a `Shard(0)` DTensor, the input this rank's columns;
    the sum of squares is all-reduced, the rest is local. Same parameter name as `RMSNorm`."""

    def __init__(self, norm: RMSNorm, mesh: DeviceMesh) -> None:
        super().__init__()
        w = distribute_tensor(norm.weight.detach(), mesh, [Shard(0)], src_data_rank=None)
        self.weight = nn.Parameter(w, requires_grad=norm.weight.requires_grad)
        self.eps, self.dim, self.group = norm.eps, norm.weight.shape[0], mesh.get_group()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(ct)
        # the sum feeds split computation: each rank's gradient of it is a part, summed too
        ss = _SumReplicatedOut.apply(xf.square().sum(-1, keepdim=True), self.group)
        ss = _CopyToGroup.apply(ss, self.group)
        y = xf * torch.rsqrt(ss / self.dim + self.eps) * self.weight.to_local().to(ct)
        return y.to(x.dtype)


def _mamba_rows(m: Any, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank-order permutations of a Mamba-2 mixer's in_proj rows [z | x | B | C | dt] and
    conv channels [x | B | C]: rank r's rows of every part, then rank r + 1's."""
    I, GN, H = m.d_inner, m.n_groups * m.state_size, m.num_heads

    def order(parts: list[tuple[int, int]]) -> torch.Tensor:  # (start, size) of each part
        return torch.cat(
            [
                torch.arange(start + r * (size // tp), start + (r + 1) * (size // tp))
                for r in range(tp)
                for start, size in parts
            ]
        )

    in_rows = order([(0, I), (I, I), (2 * I, GN), (2 * I + GN, GN), (2 * I + 2 * GN, H)])
    conv_rows = order([(0, I), (I, GN), (I + GN, GN)])
    return in_rows, conv_rows


def _shard_rows(
    module: nn.Module, name: str, mesh: DeviceMesh, rows: torch.Tensor | None, dim: int = 0
) -> None:
    """Replace `module.<name>` by a `Shard(dim)` DTensor over `mesh`, its rows first put in rank
    order `rows` (recorded in `module.row_order`)."""
    p = getattr(module, name)
    full = p.detach() if rows is None else p.detach()[rows.to(p.device)]
    d = distribute_tensor(full, mesh, [Shard(dim)], src_data_rank=None)
    setattr(module, name, nn.Parameter(d, requires_grad=p.requires_grad))
    if rows is not None:
        if not hasattr(module, "row_order"):
            module.row_order = {}
        module.row_order[name] = rows


class _LocalMamba:
    """The forward of a tensor-parallel Mamba-2 mixer: its DTensor parameters are swapped for
    their local shards for the call (`to_local`, so their gradients reach the shards), the
    input's gradient is summed over the group, the out_proj partial sums are all-reduced."""

    def __init__(self, mixer: Mamba2Mixer, group: Any) -> None:
        self.mixer, self.group = mixer, group

    def __call__(self, x_BLD: torch.Tensor, **kw: Any) -> torch.Tensor:
        mixer = self.mixer
        swapped = []
        for module in mixer.modules():
            for name, p in list(module._parameters.items()):
                if isinstance(p, DTensor):
                    swapped.append((module, name, p))
                    module._parameters[name] = p.to_local()
        try:
            y = type(mixer).forward(mixer, _CopyToGroup.apply(x_BLD, self.group), **kw)
        finally:
            for module, name, p in swapped:
                module._parameters[name] = p
        return _SumReplicatedOut.apply(y, self.group)


def _mamba_tp(mixer: Mamba2Mixer, mesh: DeviceMesh) -> None:
    tp, m = mesh.size(), mixer.m
    _divides(tp, m.num_heads, "Mamba-2 heads", "mamba.num_heads")
    _divides(tp, m.n_groups, "Mamba-2 groups (B / C are split with their heads)", "mamba.n_groups")
    in_rows, conv_rows = _mamba_rows(m, tp)
    _shard_rows(mixer.in_proj, "weight", mesh, in_rows)
    _shard_rows(mixer.conv1d, "weight", mesh, conv_rows)
    if mixer.conv1d.bias is not None:
        _shard_rows(mixer.conv1d, "bias", mesh, conv_rows)
    for name in ("dt_bias", "A_log", "D"):
        _shard_rows(mixer, name, mesh, None)
    _shard_rows(mixer.norm, "weight", mesh, None)
    _shard_rows(mixer.out_proj, "weight", mesh, None, dim=1)
    # the mixer's own sizes are its local heads and groups (the forward splits by them)
    mixer.m = dataclasses.replace(m, num_heads=m.num_heads // tp, n_groups=m.n_groups // tp)
    mixer.forward = _LocalMamba(mixer, mesh.get_group())


def row_orders(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: rows} of the parameters tensor parallelism keeps in rank order (`_shard_rows`):
    the stored tensor is `canonical[rows]`."""
    out = {}
    for prefix, module in model.named_modules():
        for name, rows in getattr(module, "row_order", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = rows
    return out


def to_canonical(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A whole tensor stored in rank order (`row_orders`) back in its canonical row order."""
    out = torch.empty_like(t)
    out[rows.to(t.device)] = t
    return out


def canonical_chunks(dt: DTensor, rows: torch.Tensor) -> DTensor:
    """`dt` (stored in rank order `rows`) as DCP sees a tensor in canonical order: this rank's
    rows as runs of consecutive canonical rows, each a chunk at its canonical offset (views of
    the local shard, so a DCP load fills the shard in place). Sharded checkpoints therefore
    hold the canonical tensor and load at any other layout."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = dt.to_local()
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    start, n = offset[0], shape[0]
    if n == 0:
        return dt
    canon = rows[start : start + n]
    cuts = (torch.nonzero(canon[1:] - canon[:-1] != 1).flatten() + 1).tolist()
    bounds = [0, *cuts, n]
    pieces = [local.narrow(0, a, b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    offsets = [(int(canon[a]), *offset[1:]) for a in bounds[:-1]]
    spec = DTensorSpec(
        dt.device_mesh, dt.placements, tensor_meta=TensorMeta(dt.shape, dt.stride(), dt.dtype)
    )
    return DTensor(LocalShardsWrapper(pieces, offsets), spec, requires_grad=False)


def _divides(tp: int, n: int, what: str, setting: str) -> None:
    """Refuse a split of `n` units over `tp` ranks that is not even, naming the model setting
    (`setting` in the model config) that sizes them and the values that would do."""
    if n % tp:
        raise ValueError(
            f"train.parallel.tp={tp} must divide the model's {n} {what}: set model.{setting} to "
            f"a multiple of {tp} (--set model.{setting}={_multiple(n, tp)}; a model trained from "
            f"scratch), or a train.parallel.tp that divides {n}"
        )


def _multiple(n: int, tp: int) -> int:
    """The smallest multiple of `tp` not below `n`."""
    return -(-n // tp) * tp


def _mlp_plan(mlp: MLP) -> dict[str, Any]:
    plan: dict[str, Any] = {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    if hasattr(mlp, "gate_proj"):
        plan["gate_proj"] = ColwiseParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, experts: bool = True) -> None:
    """Split `model` (a HybridLM, unsharded, on its device or the meta device) over `tp_mesh` in
    place (module docstring); `experts=False` (expert parallelism splits them instead) keeps the
    routed experts whole. Apply before FSDP2, which then shards the DTensors further."""
    tp = tp_mesh.size()
    cfg = model.config
    if cfg.tie_embeddings:
        raise ValueError(
            f"train.parallel.tp={tp}: tied embeddings are not split by tensor parallelism yet"
        )
    _divides(tp, cfg.vocab_size, "vocabulary entries", "vocab_size")
    blocks = list(model.layers) + [b for h in model.mtp_heads() for b in h.layers]
    for block in blocks:
        mixer = block.mixer
        if isinstance(mixer, Attention):
            a = mixer.a
            _divides(tp, a.num_heads, "attention heads", "attention.num_heads")
            _divides(tp, a.num_kv_heads, "KV heads", "attention.num_kv_heads")
            plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel()}
            plan |= {"v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()}
            parallelize_module(mixer, tp_mesh, plan)
            if a.qk_norm:
                mixer.q_norm = ShardedRMSNorm(mixer.q_norm, tp_mesh)
                mixer.k_norm = ShardedRMSNorm(mixer.k_norm, tp_mesh)
        elif isinstance(mixer, Mamba2Mixer):
            _mamba_tp(mixer, tp_mesh)
        elif isinstance(mixer, MLP):
            _divides(tp, mixer.down_proj.in_features, "MLP hidden units", "mlp.hidden")
            parallelize_module(mixer, tp_mesh, _mlp_plan(mixer))
        elif isinstance(mixer, MoE):
            if mixer.cfg.shared_expert_hidden:
                shared = mixer.shared_experts
                hidden = shared.down_proj.in_features
                _divides(tp, hidden, "shared-expert hidden units", "moe.shared_expert_hidden")
                parallelize_module(shared, tp_mesh, _mlp_plan(shared))
            if experts:
                ex = mixer.experts
                _divides(tp, mixer.cfg.num_experts, "routed experts", "moe.num_experts")
                _shard_rows(ex, "up_proj", tp_mesh, None)
                _shard_rows(ex, "down_proj", tp_mesh, None)
                ex.dispatch = ExpertsOverGroup(tp_mesh)
                # the sorted-row paths only (the decode paths read every expert on one device)
                # (the mesh's device: the weights may still be on the meta device)
                dev = torch.device(tp_mesh.device_type)
                ex.impl = "grouped" if grouped_mm_available(dev) else "padded"
    plan = {
        "embeddings": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, tp_mesh, plan)


def vocab_parallel_cross_entropy(
    h_ND: torch.Tensor,
    targets_N: torch.Tensor,
    denom: torch.Tensor | int,
    W_VD: DTensor,
    chunk: int | None = None,
) -> torch.Tensor:
    """Sum of the cross-entropy of hidden states `h_ND` (replicated over the group) through a
    vocabulary-split LM head `W_VD` (a `Shard(0)` DTensor) against `targets_N` (IGNORE_INDEX
    skipped), divided by `denom`; equal on every rank. The fused, chunked LM-head CE of
    `ops.cross_entropy` on this rank's rows, its row max / sum of exponentials / target logit
    all-reduced over the group (Megatron-LM's vocabulary-parallel cross-entropy), so neither
    the [N, V] logits nor this rank's [N, V / tp] columns are ever held whole."""
    mesh = W_VD.device_mesh
    group = mesh.get_group()
    W = W_VD.to_local()

    def reduce_max(x: torch.Tensor) -> None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)

    def reduce_sum(x: torch.Tensor) -> None:
        dist.all_reduce(x, group=group)

    shard = VocabShard(mesh.get_local_rank() * W.shape[0], reduce_max, reduce_sum)
    return linear_cross_entropy(h_ND, W, targets_N, denom, chunk, shard=shard)
