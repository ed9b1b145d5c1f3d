"""Bytes of the tensors a forward leaves alive (what the backward keeps), measured by tracking
every storage the ops create under a TorchDispatchMode: parameters and inputs existed before, so
they are not counted; storages freed during the forward are not either. A sharded tensor
(DTensor: tensor parallelism, expert parallelism) counts its local shard.

`CommBytes` counts the bytes one rank sends in the collectives run under it, as `hybridlm plan`
models them (ring algorithms)."""

import gc
from collections import Counter

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass


def _tensors(tree) -> list[torch.Tensor]:
    """The real tensors of `tree`: a wrapper subclass (DTensor, a functional collective's
    result) by the tensors it wraps (a DTensor's local shard), meta tensors left out."""
    out = []
    for t in torch.utils._pytree.tree_leaves(tree):
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            out += _tensors([getattr(t, name) for name in t.__tensor_flatten__()[0]])
        elif t.device.type != "meta":
            out.append(t)
    return out


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes() as meter: out = model(x)`; then `meter.alive()` is the bytes of the
    storages created inside that are still referenced (call it while `out` is alive)."""

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an output sharing an input's storage (a view such as a weight's transpose, an
        # in-place op) is no new memory: a parameter's view would otherwise count the parameter
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            st = t.untyped_storage()
            key = st.data_ptr()
            if not key or key in inputs:
                continue
            # a freed storage's address is reused by later ones: track the new one
            if key not in self._refs or self._refs[key][0].expired():
                self._refs[key] = (StorageWeakRef(st), st.nbytes())
        return out

    def alive(self) -> int:
        gc.collect()
        return sum(nbytes for ref, nbytes in self._refs.values() if not ref.expired())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommBytes(TorchDispatchMode):
    """`with CommBytes(rank, size) as comm: ...`; `comm.sent` is the bytes this rank sends, by
    collective, counted as `hybridlm plan` models them: all-reduce 2 (S - 1) / S of the tensor
    (ring), all-gather (S - 1) / S of the output, reduce-scatter (S - 1) / S of the input,
    all-to-all the rows bound to other ranks. Every group is assumed to have `size` ranks with
    this process at `rank` (a world-2 job: every group is the world). Both the c10d ops
    (`torch.distributed.all_reduce`, ...) and the functional collectives DTensor uses are seen."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.rank, self.size = rank, size
        self.sent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.log: list[tuple[str, int]] = []  # (collective, bytes sent) per call, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name  # "c10d::allreduce_", "_c10d_functional::all_reduce"
        S, ring = self.size, (self.size - 1) / self.size
        sent = None
        if name in ("c10d::allreduce_", "_c10d_functional::all_reduce"):
            sent = 2 * ring * sum(_nbytes(t) for t in _tensors(args[0]))
            kind = "all-reduce"
        elif name == "c10d::_allgather_base_":  # all_gather_into_tensor(out, in)
            sent, kind = ring * _nbytes(args[0]), "all-gather"
        elif name in ("c10d::allgather_", "_c10d_functional::all_gather_into_tensor"):
            one = args[1] if name == "c10d::allgather_" else args[0]  # this rank's piece
            sent, kind = (S - 1) * sum(_nbytes(t) for t in _tensors(one)), "all-gather"
        elif name in ("c10d::_reduce_scatter_base_", "_c10d_functional::reduce_scatter_tensor"):
            x = args[1] if name == "c10d::_reduce_scatter_base_" else args[0]
            sent, kind = ring * _nbytes(x), "reduce-scatter"
        elif name in ("c10d::alltoall_base_", "_c10d_functional::all_to_all_single"):
            if name == "c10d::alltoall_base_":  # (out, in, group, out_splits, in_splits, ...)
                x, splits = args[1], list(args[4])
            else:  # (in, out_splits, in_splits, group)
                x, splits = args[0], list(args[2])
            row = _nbytes(x) // max(1, x.shape[0]) if x.dim() else _nbytes(x)
            own = splits[self.rank] if splits else x.shape[0] // S
            sent, kind = _nbytes(x) - own * row, "all-to-all"
        if sent is not None:
            self.sent[kind] += int(sent)
            self.calls[kind] += 1
            self.log.append((kind, int(sent)))
        return func(*args, **kwargs)
