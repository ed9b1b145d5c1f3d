"""Data parallelism applied over a built model (DESIGN habit 4: model code never imports
`torch.distributed`; everything distributed lives here).

`init_distributed()` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK) and starts a
process group (nccl on CUDA, gloo on CPU); without it (one process) every helper is a no-op.
`apply_ddp(model)` wraps the model in DistributedDataParallel; `apply_fsdp2(model)` applies
FSDP2 `fully_shard` to every block of `model.layers`, to the MTP blocks, then to the root.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    """Rank 0 (or a single process): the one that writes logs, plots and checkpoints."""
    return get_rank() == 0


def init_distributed(device: str = "auto") -> tuple[int, int, torch.device | None]:
    """Start the process group from the torchrun environment; returns (rank, world, device).

    Single process (no WORLD_SIZE or WORLD_SIZE=1): nothing is started and device is None (the
    caller picks). With CUDA the process uses `cuda:LOCAL_RANK` and nccl, else cpu and gloo."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, None
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    if use_cuda:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            rank=rank,
            world_size=world,
            timeout=timedelta(minutes=10),
        )
    return rank, world, dev


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def destroy() -> None:
    """Tear down together: a rank leaving while its peer is still in gloo's teardown can abort
    the peer at exit ("terminate called without an active exception")."""
    if is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` of rank `src` on every rank (pickled; identity in one process): what one rank
    produced for all, e.g. the rollouts every rank trains a share of."""
    if not is_initialized():
        return obj
    box = [obj if get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum(x: torch.Tensor | float) -> torch.Tensor | float:
    """Sum over ranks (identity in one process). Floats come back as floats (summed in
    float64 so metric sums are exact to the last printed digit)."""
    if not is_initialized():
        return x
    if isinstance(x, torch.Tensor):
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x
    t = torch.tensor(float(x), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t)


def apply_ddp(model: nn.Module) -> nn.Module:
    """DistributedDataParallel wrapper (forward through it; keep `.module` for everything else).

    `find_unused_parameters`: routed experts and MTP blocks may get no gradient on a rank.
    `broadcast_buffers=False`: MoE expert-load counters (`load_E`) are per-rank buffers summed by
    the trainer before the bias step; broadcasting rank 0's would overwrite the others."""
    device_ids = [model_device(model)] if model_device(model).type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, find_unused_parameters=True, broadcast_buffers=False
    )


def apply_fsdp2(model: nn.Module) -> nn.Module:
    """FSDP2: `fully_shard` each block of `model.layers` and of `model.mtp.layers`, then the
    root (embeddings, final norm, LM head). Shards in place; returns the same module."""
    from torch.distributed.fsdp import fully_shard

    blocks = list(model.layers)
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        blocks += list(mtp.layers)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def full_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict]:
    """Gathered (unsharded, CPU) model and optimizer state of an FSDP2 model; collective (call
    on every rank; with cpu_offload only rank 0 gets the dicts, the others get empty ones).
    The optimizer state is returned in the plain `optimizer.state_dict()` layout
    (integer parameter ids in param-group order), so a single process can load it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    if "param_groups" not in osd:  # cpu_offload: only rank 0 receives the full state
        return msd, osd
    ids: dict[str, int] = {}
    groups = []
    for g in osd["param_groups"]:
        g = dict(g)
        g["params"] = [ids.setdefault(fqn, len(ids)) for fqn in g["params"]]
        groups.append(g)
    state = {ids[fqn]: v for fqn, v in osd["state"].items()}
    return msd, {"state": state, "param_groups": groups}


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole, unsharded weights on the CPU, e.g. for rollout workers: under FSDP2
    a gather (collective: call on every rank; only rank 0 receives them, the others get an
    empty dict), else the plain state dict."""
    if not any(hasattr(p, "full_tensor") for p in model.parameters()):  # not sharded
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def load_full_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer, msd: dict, osd: dict | None
) -> None:
    """Inverse of `full_state_dicts` on an FSDP2 model (every rank passes the full dicts)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, msd, options=opts)
    if osd is None:
        return
    names = {id(p): n for n, p in model.named_parameters()}
    fqns = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    groups = [dict(g, params=[fqns[i] for i in g["params"]]) for g in osd["param_groups"]]
    state = {fqns[int(i)]: v for i, v in osd["state"].items()}
    set_optimizer_state_dict(
        model, optimizer, {"state": state, "param_groups": groups}, options=opts
    )
