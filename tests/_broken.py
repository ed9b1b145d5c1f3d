"""Deliberately broken collectives, to show that the parallel parity tests catch them (tests only;
nothing in src/ knows about them). The torchrun-style workers of test_train_parallel.py and
test_train_mesh.py call `install_from_env`, which installs the break that the environment
variable `BREAK` names (test_train_mesh.py's `test_a_broken_collective_fails_its_parity_test`
sets it). Every break keeps the collectives themselves (the same calls in the same order on
every rank, so no rank waits forever) and corrupts what is made of their result.

`BREAKS`: name -> (what is broken, installer). A trailing `:R` names the rank whose gradient
reduction is broken (DDP, FSDP2; default 0)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

BREAK = "HYBRIDLM_TEST_BREAK_COLLECTIVE"


def _ddp_grad(rank: int) -> None:
    """DDP: rank `rank` joins the gradient all-reduce but keeps its own (unreduced) gradient."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import hybridlm.train.trainer as trainer

    apply_ddp = trainer.apply_ddp

    def hook(state, bucket):
        local = bucket.buffer().clone()
        fut = default_hooks.allreduce_hook(None, bucket)
        if dist.get_rank() != rank:
            return fut
        return fut.then(lambda _: local.div_(dist.get_world_size()))

    def broken(model):
        ddp = apply_ddp(model)
        ddp.register_comm_hook(None, hook)
        return ddp

    trainer.apply_ddp = broken


def _fsdp_grad(rank: int) -> None:
    """FSDP2: rank `rank` joins the gradient reduce-scatter but keeps its own chunk of its own
    (unreduced) gradient, divided by the group size as the AVG reduction would."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    call = DefaultReduceScatter.__call__

    def broken(self, output_tensor, input_tensor, group, op, async_op=False):
        work = call(self, output_tensor, input_tensor, group, op, async_op=False)
        if dist.get_rank() == rank:
            n = group.size()
            output_tensor.copy_(input_tensor.view(n, -1)[group.rank()] / n)
        return work

    DefaultReduceScatter.__call__ = broken


def _hsdp_grad(rank: int) -> None:
    """HSDP: rank `rank` joins the gradient all-reduce over the replicas (after the
    reduce-scatter within its shard group) but keeps its own shard group's gradient."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_mod

    reduce, all_reduce = group_mod.foreach_reduce, dist.all_reduce
    inside = [False]

    def reducing(*args, **kwargs):
        inside[0] = True
        try:
            return reduce(*args, **kwargs)
        finally:
            inside[0] = False

    def broken(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not inside[0] or dist.get_rank() != rank:
            return all_reduce(tensor, op=op, group=group, async_op=async_op)
        local = tensor.clone()
        all_reduce(tensor, op=op, group=group)
        avg = op == dist.ReduceOp.AVG
        tensor.copy_(local if avg else local * dist.get_world_size(group))  # "reduced" alone
        return None

    group_mod.foreach_reduce = reducing
    dist.all_reduce = broken


def _cp_state(_: int) -> None:
    """CP: the SSD state entering each shard (the cross-rank scan) replaced by zeros."""
    from hybridlm.train.distributed.context_parallel import ContextParallel

    scan = ContextParallel.scan_states

    def broken(self, decay_BH, final_BHPN, carry_B):
        return scan(self, decay_BH, final_BHPN, carry_B) * 0

    ContextParallel.scan_states = broken


def _ep_swap(_: int) -> None:
    """EP: every all-to-all (dispatch and combine) delivers the chunks of ranks 0 and 1 in
    swapped order."""
    import hybridlm.train.distributed.expert_parallel as ep

    exchange = ep.all_to_all

    def broken(x, out_splits, in_splits, group):
        y = exchange(x, out_splits, in_splits, group)
        a, b = out_splits[0], out_splits[1]
        return torch.cat([y[a : a + b], y[:a], y[a + b :]])

    ep.all_to_all = broken


def _ep_scale(_: int) -> None:
    """EP: the 1/ep scale of the local experts' gradient dropped (expert gradients ep times
    too large; AdamW is nearly invariant to it)."""
    import hybridlm.train.distributed.expert_parallel as ep

    ep._ScaleGrad.backward = staticmethod(lambda ctx, grad: (grad, None))


def _tp_forward(_: int) -> None:
    """TP: the forward all-reduce of the split Mamba-2 out_proj (and QK-norm) partial sums
    averages them instead of summing (the same wrong value on every rank: dropping it outright
    makes the ranks route differently and the job dies in a collective of mismatched sizes)."""
    from hybridlm.train.distributed.tensor_parallel import _SumReplicatedOut

    forward = _SumReplicatedOut.forward

    def broken(ctx, x, group):
        return forward(ctx, x, group) / dist.get_world_size(group)

    _SumReplicatedOut.forward = staticmethod(broken)


def _tp_backward(_: int) -> None:
    """TP: the backward all-reduce of a split region's input gradient dropped (Megatron's
    "copy to the model-parallel region": Mamba-2 input, QK-norm)."""
    from hybridlm.train.distributed.tensor_parallel import _CopyToGroup

    _CopyToGroup.backward = staticmethod(lambda ctx, g: (g, None))


BREAKS: dict[str, tuple[str, Callable[[int], None]]] = {
    "ddp_grad": (_ddp_grad.__doc__ or "", _ddp_grad),
    "fsdp_grad": (_fsdp_grad.__doc__ or "", _fsdp_grad),
    "hsdp_grad": (_hsdp_grad.__doc__ or "", _hsdp_grad),
    "cp_state": (_cp_state.__doc__ or "", _cp_state),
    "ep_swap": (_ep_swap.__doc__ or "", _ep_swap),
    "ep_scale": (_ep_scale.__doc__ or "", _ep_scale),
    "tp_forward": (_tp_forward.__doc__ or "", _tp_forward),
    "tp_backward": (_tp_backward.__doc__ or "", _tp_backward),
}


def install(spec: str) -> None:
    """Install the break `spec` ("name" or "name:rank")."""
    name, _, rank = spec.partition(":")
    BREAKS[name][1](int(rank or 0))


def install_from_env() -> None:
    if os.environ.get(BREAK):
        install(os.environ[BREAK])
