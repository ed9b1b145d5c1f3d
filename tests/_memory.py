"""Bytes of the tensors a forward leaves alive (what the backward keeps), measured by tracking
every storage the ops create under a TorchDispatchMode: parameters and inputs existed before, so
they are not counted; storages freed during the forward are not either."""

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


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
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
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
