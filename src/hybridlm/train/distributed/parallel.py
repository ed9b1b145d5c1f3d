"""Data parallelism applied over a built model (DESIGN habit 4: model code never imports
`torch.distributed`; everything distributed lives here).

`init_distributed()` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK) and starts a
process group (nccl on CUDA, gloo on CPU); without it (one process) every helper is a no-op.
`apply_ddp(model)` wraps the model in DistributedDataParallel; `apply_fsdp2(model)` applies
FSDP2 `fully_shard` to every block of `model.layers`, to the MTP blocks, then to the root.
`resolve_layout` turns `train.parallel` (a `ParallelConfig`) into the sizes of the job's
DeviceMesh and `apply_layout` shards a model over it (expert parallelism, FSDP2 / HSDP).

When a run must stop, rank 0's message is the one the user sees. `on_main` runs a step rank 0
takes for all (a checkpoint's integrity, the output directory) and agrees on its outcome, so a
failure stops every rank at the same point, raised as it is on rank 0 and as `MainFailed` on the
others. `lost_peer`, `announce_failure`, `main_failure`, `record_failure` and `leave_quietly`
are what the CLI needs to end each rank of a failed job (`hybridlm.cli` says what each prints).
"""

from __future__ import annotations

import json
import os
import pickle
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import ParallelConfig
from .expert_parallel import moe_layers
from .tensor_parallel import row_orders, to_canonical

T = TypeVar("T")


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


class MainFailed(Exception):
    """Raised on every rank but 0 when a step rank 0 took for all (`on_main`) failed there: rank
    0 raises the failure itself and reports it, so these ranks exit without a word (the CLI).
    `cause` is rank 0's exception (a RuntimeError naming it when it does not pickle)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(cause)  # pickles back into the same
        self.cause = cause

    def __str__(self) -> str:
        return f"rank 0 failed: {self.cause}"


def on_main(fn: Callable[[], T], *, share: bool = True) -> T | None:
    """Run `fn` on rank 0 while the other ranks wait, then agree on its outcome (collective):
    its value on every rank (`share=False`: None on the others, which then read what rank 0
    wrote), or its failure, raised as it is on rank 0 and as `MainFailed` on the others. A check
    only rank 0 makes (checkpoint integrity, the output directory) so stops every rank at the
    same point, reported once, instead of leaving the others in a collective with a rank that
    has gone. One process: `fn()`."""
    if not is_initialized():
        return fn()
    if not is_main():
        ok, value = broadcast_object(None)
        if not ok:
            raise MainFailed(value)
        return value
    try:
        value = fn()
    except Exception as err:
        # the others gone already: rank 0's own failure still stands
        with suppress(Exception):
            broadcast_object((False, _portable(err)))
        raise
    broadcast_object((True, value if share else None))
    return value


def _portable(err: Exception) -> Exception:
    """`err` if it survives pickling (to reach the other ranks), else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err


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


def apply_fsdp2(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    expert_mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """FSDP2: `fully_shard` each block of `model.layers` and of the MTP heads, then the
    root (embeddings, final norm, LM head), over `mesh` (default: every rank; a 2-D
    (dp_replicate, dp_shard) mesh is HSDP). Under expert parallelism the routed experts are
    sharded first over `expert_mesh` (the data-parallel ranks the expert-parallel group
    leaves; their gradient is scaled for it by the dispatch, `expert_parallel`). Shards in
    place; returns the same module.

    `param_dtype` (bf16 training): FSDP2's `MixedPrecisionPolicy` all-gathers the parameters
    in that dtype for the forward and backward (one cast per gather instead of one per use
    under autocast, and half the gather bytes) and reduces gradients in fp32 into the fp32
    shards the optimizer updates. Each router is a unit of its own kept in fp32 (routing is
    computed in fp32, Nemotron 3 Super §2.1.1)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ...model.moe import TopKRouter

    kw: dict[str, Any] = {}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    blocks = list(model.layers) + [b for h in model.mtp_heads() for b in h.layers]
    for block in blocks:
        if expert_mesh is not None:
            for moe in moe_layers(block):
                fully_shard(moe.experts, mesh=expert_mesh, **kw)
        if param_dtype is not None:
            for router in (m for m in block.modules() if isinstance(m, TopKRouter)):
                fully_shard(router, mesh=mesh, mp_policy=fp32)
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


@dataclass(frozen=True)
class Layout:
    """A `ParallelConfig` resolved for a world size: every size known. The device mesh has the
    dimensions (dp_replicate, dp_shard_mod_ep, cp, ep, tp) (tp innermost: a tensor-parallel
    group is neighbouring ranks, one node's fast links; then ep); flattened: `dp_shard_cp` (what
    FSDP2 shards the parameters over besides replicas) and `expert_dp` (the ranks an expert
    shard is replicated over)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those that read different rows."""
        return self.dp_replicate * self.dp_shard

    @property
    def style(self) -> str:
        """ "none" (one rank), "ddp" (whole replicas, DistributedDataParallel) or "fsdp" (FSDP2
        over the mesh, with expert parallelism when ep > 1)."""
        if self.world == 1:
            return "none"
        return "ddp" if self.dp_shard == 1 and self.cp == 1 and self.tp == 1 else "fsdp"


def resolve_layout(pc: ParallelConfig, world: int) -> Layout:
    """Fill the -1 size from `world` and check the layout covers exactly the world, with clear
    errors (torchtitan's ParallelDims)."""
    pc.validate()
    rep, shard, cp, tp = pc.dp_replicate, pc.dp_shard, pc.cp, pc.tp
    if rep == -1 or shard == -1:
        known = (shard if rep == -1 else rep) * cp * tp
        if world % known:
            raise ValueError(
                f"train.parallel: {world} ranks do not split into groups of {known} "
                f"(dp_replicate={pc.dp_replicate}, dp_shard={pc.dp_shard}, cp={cp}, tp={tp})"
            )
        rep, shard = (world // known, shard) if rep == -1 else (rep, world // known)
    if rep * shard * cp * tp != world:
        raise ValueError(
            f"train.parallel: dp_replicate {rep} x dp_shard {shard} x cp {cp} x tp {tp} = "
            f"{rep * shard * cp * tp} ranks, but this job has {world}; make the product the "
            "world size (or set dp_replicate or dp_shard to -1)"
        )
    if shard % pc.ep:
        raise ValueError(
            f"train.parallel.ep={pc.ep} must divide dp_shard={shard}: expert parallelism borrows "
            "its ranks from the data-parallel shard group (train.parallel=fsdp, or set "
            "train.parallel.dp_shard)"
        )
    return Layout(dp_replicate=rep, dp_shard=shard, ep=pc.ep, cp=cp, tp=tp)


def build_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    """The job's DeviceMesh (dp_replicate, dp_shard_mod_ep, cp, ep, tp) with the flattened
    dimensions `dp_shard_cp` (dp_shard_mod_ep, cp, ep: FSDP2's shard group) and `expert_dp`
    (dp_shard_mod_ep, cp: the ranks an expert's shard is replicated over before FSDP2)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.dp_replicate, layout.dp_shard // layout.ep, layout.cp, layout.ep, layout.tp)
    names = ("dp_replicate", "dp_shard_mod_ep", "cp", "ep", "tp")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    mesh["dp_shard_mod_ep", "cp", "ep"]._flatten("dp_shard_cp")
    mesh["dp_shard_mod_ep", "cp"]._flatten("expert_dp")
    return mesh


def data_parallel_coordinates(layout: Layout, mesh: DeviceMesh | None) -> tuple[int, int]:
    """(rank, size) among the ranks that read different rows: every mesh dimension but `cp`
    and `tp` (the ranks of a context-parallel group read the same rows and take a part of each;
    those of a tensor-parallel group read the same rows and take a part of each layer)."""
    if mesh is None:
        return get_rank(), get_world_size()
    rep, mod, _, ep, _ = mesh.get_coordinate()
    return (rep * (layout.dp_shard // layout.ep) + mod) * layout.ep + ep, layout.dp


def apply_layout(
    model: nn.Module, layout: Layout, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None
) -> None:
    """Shard `model` in place for a "fsdp"-style layout over `mesh` (`build_mesh`): tensor
    parallelism over `tp`, context parallelism over `cp`, expert parallelism over `ep`, then
    FSDP2 over (dp_replicate, dp_shard_cp) (HSDP when both > 1), the experts over
    (dp_replicate, expert_dp), gathering parameters in `param_dtype` (`apply_fsdp2`). Every
    rank starts from the same full weights, or from a meta-device build
    (`materialize_sharded`)."""
    from .context_parallel import apply_context_parallel
    from .expert_parallel import apply_expert_parallel
    from .tensor_parallel import apply_tensor_parallel

    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], experts=layout.ep == 1)
    if layout.cp > 1:
        apply_context_parallel(model, mesh["cp"])
    dp_mesh = (
        mesh["dp_replicate", "dp_shard_cp"] if layout.dp_replicate > 1 else mesh["dp_shard_cp"]
    )
    if layout.ep == 1:
        apply_fsdp2(model, dp_mesh, param_dtype=param_dtype)
        return
    apply_expert_parallel(model, mesh["ep"])
    expert_mesh = mesh["dp_replicate", "expert_dp"]
    apply_fsdp2(model, dp_mesh, expert_mesh=expert_mesh, param_dtype=param_dtype)


@torch.no_grad()
def materialize_sharded(
    model: nn.Module, template: nn.Module, *, seed: int, device: torch.device
) -> None:
    """Initialise a model built on the meta device and sharded by `apply_layout`, each rank
    allocating only its shards (issue: a 120B model does not fit one device, nor its host).

    `template` is a meta-device copy of the model taken before sharding. Its init units
    (`HybridLM.init_units`, in `init_weights`' RNG order) are initialised one at a time on the
    CPU from `seed`, and every rank copies its own slice out of each unit, so the weights equal
    a single-process `build_model(cfg, seed=seed, device="cpu")` bit for bit and no rank holds
    more than one unit (one block) in full."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    model.to_empty(device=device)
    model.init_buffers()
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    orders = row_orders(model)
    prefix = {id(m): name for name, m in template.named_modules()}
    rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for unit, init in template.init_units():
            unit.to_empty(device="cpu")
            init(unit)
            for key, full in unit.state_dict(prefix=prefix[id(unit)] + ".").items():
                target = targets[key]
                if key in orders:  # stored in tensor-parallel rank order
                    full = full[orders[key]]
                if isinstance(target, DTensor):
                    mine = distribute_tensor(
                        full.to(device), target.device_mesh, target.placements, src_data_rank=None
                    )
                    target.to_local().copy_(mine.to_local())
                else:
                    target.copy_(full)
            unit.to(device="meta")
    finally:
        torch.random.set_rng_state(rng)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def is_sharded(model: nn.Module) -> bool:
    """Whether `model`'s parameters are sharded: DTensors (FSDP2, expert parallelism) on some
    DeviceMesh, whatever their placements (DDP replicas and one process: plain tensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


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
    orders = row_orders(model)
    msd = _canonical(get_model_state_dict(model, options=opts), orders)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    if "param_groups" not in osd:  # cpu_offload: only rank 0 receives the full state
        return msd, osd
    for fqn, rows in orders.items():
        state = osd["state"].get(fqn, {})
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0:
                state[k] = to_canonical(v, rows)
    ids: dict[str, int] = {}
    groups = []
    for g in osd["param_groups"]:
        g = dict(g)
        g["params"] = [ids.setdefault(fqn, len(ids)) for fqn in g["params"]]
        groups.append(g)
    state = {ids[fqn]: v for fqn, v in osd["state"].items()}
    return msd, {"state": state, "param_groups": groups}


def full_model_state(model: nn.Module, *, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The model's whole, unsharded weights in canonical row order, e.g. for rollout workers:
    for a sharded model a gather (collective: call on every rank); on the CPU and only on rank 0
    (the others get an empty dict), or with `every_rank` on every rank, on the model's device.
    An unsharded model: its plain state dict."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
    return _canonical(get_model_state_dict(model, options=opts), row_orders(model))


def _canonical(msd: dict, orders: dict[str, torch.Tensor]) -> dict:
    """A gathered model state with the tensors tensor parallelism keeps in rank order put back
    in canonical order (`tensor_parallel.row_orders`)."""
    for fqn, rows in orders.items():
        if fqn in msd:
            msd[fqn] = to_canonical(msd[fqn], rows)
    return msd


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
    orders = row_orders(model)  # whole tensors arrive in canonical order
    msd = {k: v[orders[k]] if k in orders else v for k, v in msd.items()}
    set_model_state_dict(model, msd, options=opts)
    if osd is None:
        return
    names = {id(p): n for n, p in model.named_parameters()}
    fqns = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    groups = [dict(g, params=[fqns[i] for i in g["params"]]) for g in osd["param_groups"]]
    state = {fqns[int(i)]: v for i, v in osd["state"].items()}
    for fqn, rows in orders.items():
        if fqn in state:
            state[fqn] = {
                k: v[rows] if torch.is_tensor(v) and v.dim() > 0 else v
                for k, v in state[fqn].items()
            }
    set_optimizer_state_dict(
        model, optimizer, {"state": state, "param_groups": groups}, options=opts
    )


# ---------------------------------------------------------------- when a run must stop
# What the CLI does on each rank of a torchrun job that fails (hybridlm.cli's docstring says what
# the user sees). torchrun stops the other ranks once one exits non-zero and prints a summary
# whose "Root Cause" is the failure with the earliest time in whole seconds (ties: the rank it
# saw exit first), read from the rank's error file (TORCHELASTIC_ERROR_FILE) when it wrote one.

# gloo's words when the rank at the other end of a connection exited (NCCL raises DistError)
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
)
# how long a rank waits for rank 0's verdict: ranks that all find the same failure find it
# within moments of one another; a failure of this rank alone is reported after it
REPORT_WAIT_S = 10.0
_RANK0_FAILED = "rank0_failed"


def launch_rank() -> int:
    """This process's rank in the torchrun job (RANK), also before the process group starts."""
    return int(os.environ.get("RANK", "0"))


def lost_peer(err: BaseException) -> bool:
    """Whether `err`, or an exception it was raised from or during, is this rank's side of
    another rank leaving: a collective or store operation whose connection closed (gloo's
    RuntimeError), or torch.distributed's DistError (NCCL, the store, the network). The rank
    that left says why; this one has nothing to add."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, dist.DistError):
            return True
        if isinstance(e, RuntimeError) and any(words in str(e) for words in _PEER_GONE):
            return True
        e = e.__cause__ or e.__context__
    return False


def _stop_store() -> Any:
    """The job's key-value store, to tell the other ranks that rank 0 failed: torchrun's agent
    store (served by the agent, so up before the process group starts and after any rank has
    exited) or the process group's; None without either or when it does not answer."""
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(seconds=REPORT_WAIT_S),
                wait_for_workers=False,
            )
        elif is_initialized():
            store = dist.distributed_c10d._get_default_store()
        else:
            return None
        return dist.PrefixStore("hybridlm/stop/", store)
    except Exception:
        return None


def announce_failure(text: str) -> None:
    """On rank 0, once it has reported its failure: tell the other ranks, with its text
    (`main_failure`). Nothing on the others: a failure of theirs is theirs to report."""
    if launch_rank() != 0:
        return
    store = _stop_store()
    if store is not None:
        with suppress(Exception):
            store.set(_RANK0_FAILED, text)


def main_failure() -> str | None:
    """The text of rank 0's failure once rank 0 has reported one (`announce_failure`), waiting
    up to `REPORT_WAIT_S`; None when it has not (it is still running, so a failure of this rank
    is its own) or cannot be asked."""
    store = _stop_store()
    if store is None:
        return None
    # polled: a timed-out `store.wait` logs a socket warning on stderr
    deadline = time.monotonic() + REPORT_WAIT_S
    try:
        while not store.check([_RANK0_FAILED]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return store.get(_RANK0_FAILED).decode()
    except Exception:
        return None


def record_failure(message: str, traceback: str | None = None) -> None:
    """Write this rank's failure to torchrun's error file, in the format of
    `torch.distributed.elastic.multiprocessing.errors.record`: torchrun's summary then shows
    `message` (or `traceback`) for this rank instead of "To enable traceback see: ...". Without
    torchrun (no TORCHELASTIC_ERROR_FILE), nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"timestamp": str(int(time.time()))}
    if traceback:
        extra["py_callstack"] = traceback
    with suppress(OSError):
        Path(path).write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))


def leave_quietly(why: str) -> None:
    """Before a rank exits without a word because another rank failed: under torchrun, wait for
    the next whole second, then record `why` (torchrun's summary lists it among the other
    failures). The wait keeps this rank's time after the reporting rank's, so torchrun names
    that one the root cause; torchrun usually stops this rank during it."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return
    time.sleep(1.0 - time.time() % 1.0 + 0.01)
    record_failure(why)
