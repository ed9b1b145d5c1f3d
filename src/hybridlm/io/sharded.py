"""Sharded training checkpoints read offline: one process, no process group, whatever world size
and layout wrote them.

A sharded checkpoint (`hybridlm.train.distributed.dcp` writes it with
torch.distributed.checkpoint, DCP) holds
`{"model": ..., "optim": ...}` flattened to keys `model.<fqn>` / `optim.state.<fqn>.<name>`; its
`.metadata` records every tensor's global shape and dtype and where each rank's chunks of it lie
in the `__<rank>_0.distcp` files. DCP loads into any target tensor by chunk overlap, so a plain
tensor of the global shape receives every rank's chunks: that is the consolidation here.

    load_sharded_model(path, model)          every model tensor, in place (memory: the model)
    model_tensor_specs(path)                 name -> (dtype, shape), from `.metadata` alone
    iter_model_tensors(path)                 (name, tensor), one tensor in memory at a time
    export_pretrained(path, out)             a transformers directory, streamed tensor by
                                             tensor (memory: about one tensor, not the model)

torch.distributed.checkpoint is imported where it is used (DESIGN habit 4 keeps
torch.distributed out of the layers below `train/`; this reads files only).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..interop.hf import TensorStream, to_hf_config, to_hf_tensors, write_model_dir
from ..model.model import HybridLM
from .checkpoint import (
    DCP_METADATA,
    CheckpointError,
    checkpoint_model_config,
    is_sharded_checkpoint,
    read_meta,
)

MODEL = "model."  # key prefix of the model's tensors in the DCP state


def _reader(path: Path) -> Any:
    """DCP's FileSystemReader over `path`, reading `.metadata` once (DCP re-reads it on every
    load; streaming loads one tensor per call)."""
    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):
        _metadata: Any = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self._metadata is None:
                self._metadata = super().read_metadata(*args, **kwargs)
            return self._metadata

    if not (path / DCP_METADATA).is_file():
        raise CheckpointError(f"{path} has no {DCP_METADATA}: not a sharded checkpoint")
    return _Reader(path)


def _check(path: Path) -> Path:
    path = Path(path)
    if not is_sharded_checkpoint(read_meta(path)):
        raise ValueError(f"{path} is not a sharded checkpoint (its meta.json format is full)")
    return path


def _load(reader: Any, state: dict[str, torch.Tensor], path: Path) -> None:
    """DCP load of `state` (flat keys) in one process, in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=reader, no_dist=True)
        except (CheckpointException, RuntimeError) as err:
            first = str(err).strip().splitlines()
            raise ValueError(
                f"checkpoint {path} does not match the model ({first[-1] if first else err}; "
                "a different model config?)"
            ) from None


def model_tensor_specs(path: str | Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The model tensors of a sharded checkpoint: FQN -> (dtype, global shape), read from DCP's
    `.metadata` (no tensor data)."""
    return _specs(_reader(_check(path)))


def _specs(reader: Any) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = reader.read_metadata()
    return {
        key[len(MODEL) :]: (md.properties.dtype, tuple(md.size))
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(MODEL) and isinstance(md, TensorStorageMetadata)
    }


def load_sharded_model(path: str | Path, model: nn.Module) -> None:
    """Load a sharded checkpoint's weights into a plain (unsharded) `model` in place: each
    tensor of `model.state_dict()` receives its chunks from every rank's shard file."""
    path = _check(path)
    state = {MODEL + k: v for k, v in model.state_dict().items()}
    _load(_reader(path), state, path)


def iter_model_tensors(
    path: str | Path, names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` for each model tensor (`names`, default all, in `.metadata` order), each
    loaded on its own from every rank's chunks; drop one before taking the next to keep memory
    at one tensor."""
    path = _check(path)
    reader = _reader(path)
    specs = _specs(reader)
    for name in specs if names is None else names:
        if name not in specs:
            raise ValueError(f"checkpoint {path} has no model tensor {name!r}")
        dtype, shape = specs[name]
        t = torch.empty(shape, dtype=dtype)
        _load(reader, {MODEL + name: t}, path)
        yield name, t
        del t


def export_pretrained(
    path: str | Path,
    out: str | Path,
    *,
    tokenizer: Any = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """A sharded checkpoint as a transformers directory (what `interop.hf.save_pretrained` writes
    for the consolidated model), streamed: each tensor is read from the shards, renamed / split
    (`to_hf_tensors`), written into its safetensors file and dropped, so memory holds about one
    tensor (plus DCP's read buffer of one chunk), never the model."""
    path = _check(path)
    cfg = checkpoint_model_config(path)
    specs = model_tensor_specs(path)
    with torch.device("meta"):  # names and order only; no memory
        names = list(HybridLM(cfg).state_dict())
    if cfg.tie_embeddings:
        names.remove("lm_head.weight")
    missing = [n for n in names if n not in specs]
    if missing:
        raise ValueError(f"checkpoint {path} does not match its run config: missing {missing[:5]}")
    hf_specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name in names:
        dtype, shape = specs[name]
        for hf_name, t in to_hf_tensors(cfg, name, torch.empty(shape, dtype=dtype, device="meta")):
            hf_specs[hf_name] = (t.dtype, tuple(t.shape))

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in iter_model_tensors(path, names):
            parts = to_hf_tensors(cfg, name, t)
            del t
            while parts:
                yield parts.pop(0)

    hf_cfg = to_hf_config(cfg, specs["embeddings.weight"][0])  # raises before writing
    return write_model_dir(
        out,
        TensorStream(hf_specs, read),
        hf_cfg,
        tokenizer=tokenizer,
        max_shard_bytes=max_shard_bytes,
    )
