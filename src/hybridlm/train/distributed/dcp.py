"""Sharded training checkpoints with torch.distributed.checkpoint (DCP): every rank writes its
own shards of the model and optimizer state (no gather onto rank 0), and a checkpoint loads back
at any world size and layout (DCP reshards on read).

    <out>/checkpoints/step_00000500/
        .metadata        DCP: every tensor's global shape and dtype, and where its chunks lie
        __0_0.distcp     rank 0's chunks (model + optimizer); `__<r>_0.distcp` rank r's
        meta.json        format `io.checkpoint.SHARDED_FORMAT` v1, run config, step, the
                         module's data state, `world_size`, `rng` (one entry per rank), and
                         the size and SHA-256 of every other file (`files`)

The state is `{"model": ..., "optim": ...}` from `get_state_dict(model, optimizer)`
(torch.distributed.checkpoint.state_dict, sharded: not `full_state_dict`): the parameters and
persistent buffers under their FQNs and the optimizer state keyed by FQN, each tensor with the
placements the run gives it: DTensors on any DeviceMesh (FSDP2's Shard(0) over the data-parallel
mesh, expert-parallel Shard(0) experts on another submesh), plain tensors under DDP or in one
process. DCP writes each rank's local chunks with their global offsets (a replicated tensor
once), and `load_sharded` asks for the chunks the current layout holds, so world 2 -> world 1
(no process group at all), world 1 -> world 2 and FSDP2 -> DDP all load (torchtitan's
checkpointing; the PyTorch DCP recipe "Getting started with distributed checkpoint").

Atomic as `io.checkpoint`: every rank writes into `checkpoints/.tmp-step_*` (rank 0 names it and
first removes leftovers of a crashed save), DCP's own barrier ends with `.metadata` written,
each rank hashes its own shard files (in parallel, no rank reads another's), rank 0 writes
meta.json last and renames the directory into place; a crash before the rename leaves only a
`.tmp-*` directory, which is never a checkpoint. The directory must be on a filesystem every rank
sees (as DCP's FileSystemWriter needs). `io.checkpoint.verify_checkpoint` / `resume_checkpoint`
check it like a full checkpoint (files present, sizes, SHA-256), and `hybridlm.io.load_model` /
`export-hf` read it offline (`io.sharded`).

RNG: meta.json keeps each rank's Python / NumPy / torch (and CUDA) generator states. Resumed at
the same world size, rank r restores rank r's; at another world size every rank restores rank
0's (the states of a different number of ranks have no one-to-one match; every rank is seeded
alike at the start, and the full format restores rank 0's everywhere too).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...io.checkpoint import (
    DCP_METADATA,
    PREFIX,
    SHARDED_FORMAT,
    SHARDED_FORMAT_VERSION,
    checkpoint_dir,
    file_record,
    is_sharded_checkpoint,
    new_checkpoint_tmp,
    publish_checkpoint,
    read_meta,
    rng_state,
    set_rng_state,
)
from .parallel import get_rank, get_world_size, is_initialized, on_main


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    # without a process group DCP warns that it "assumes the intent is to save/load in a single
    # process", which is exactly the intent here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        yield


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The sharded state DCP saves and loads in place: `{"model": ..., "optim": ...}`."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def _as_saved(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """`state` as DCP writes and reads it: the tensors tensor parallelism keeps in rank order
    (`tensor_parallel.row_orders`) appear in canonical order, so checkpoints do not depend on
    the layout (the same tensors, viewed; loading fills them in place)."""
    from .tensor_parallel import canonical_chunks, row_orders

    orders = row_orders(model)
    if not orders:
        return state
    out = {"model": dict(state["model"])}
    for fqn, rows in orders.items():
        out["model"][fqn] = canonical_chunks(state["model"][fqn], rows)
    if "optim" in state:
        optim = dict(state["optim"], state=dict(state["optim"]["state"]))
        for fqn, rows in orders.items():
            if fqn in optim["state"]:
                optim["state"][fqn] = {
                    k: canonical_chunks(v, rows) if isinstance(v, DTensor) and v.dim() else v
                    for k, v in optim["state"][fqn].items()
                }
        out["optim"] = optim
    return out


def _all_gather(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order ([obj] in one process)."""
    if not is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def save_sharded(
    out_dir: str | Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    meta: Mapping[str, Any],
    keep_last_n: int = 0,
) -> Path:
    """Write `<out>/checkpoints/step_<step>` as a sharded checkpoint (module docstring); keep the
    newest `keep_last_n` (0: all). Collective: every rank calls it (one process without a
    process group writes one shard file). `meta` (JSON-able, rank 0's is written) gets the
    format, step, time, world size, every rank's RNG states and the files' checksums added.
    Returns the checkpoint's path on every rank."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    # once rank 0 has cleaned up (a failure there, e.g. a full disk, stops every rank here)
    tmp = checkpoint_dir(out_dir) / on_main(lambda: new_checkpoint_tmp(out_dir, step).name)
    writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
    with _single_process_quiet():
        dcp_save(_as_saved(_state(model, optimizer), model), storage_writer=writer)
    # DCP returns once the coordinator has written .metadata; each rank hashes its own shards
    rank = get_rank()
    mine = {f.name: file_record(f) for f in sorted(tmp.glob(f"__{rank}_*"))}
    gathered = _all_gather((mine, rng_state()))
    final = checkpoint_dir(out_dir) / f"{PREFIX}{step:08d}"

    def publish() -> None:  # rank 0
        files: dict[str, Any] = {}
        for records, _ in gathered:
            files.update(records)
        for file in sorted(tmp.iterdir()):  # .metadata, and anything DCP named otherwise
            if file.name not in files:
                files[file.name] = file_record(file)
        assert DCP_METADATA in files, f"DCP wrote no {DCP_METADATA} in {tmp}"
        full = {
            "format": SHARDED_FORMAT,
            "format_version": SHARDED_FORMAT_VERSION,
            **dict(meta),
            "step": step,
            "saved_at": time.time(),
            "world_size": get_world_size(),
            "has_optimizer": optimizer is not None,
            "rng": [r for _, r in gathered],  # rank r's at index r
            "files": dict(sorted(files.items())),  # written last: the files as they are on disk
        }
        publish_checkpoint(tmp, out_dir, step, full, keep_last_n)

    on_main(publish, share=False)  # the checkpoint is in place for every rank (or none is)
    return final


def load_sharded(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a sharded checkpoint into `model` (and `optimizer`) as they are laid out in this run
    (any world size, FSDP2 / expert-parallel DTensors or plain tensors; DCP reads the chunks
    each rank holds), restore the RNG states (module docstring); returns its meta. Collective
    under a process group; one process needs none."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = Path(path)
    meta = read_meta(path)
    if not is_sharded_checkpoint(meta):
        raise ValueError(f"{path} is a full checkpoint, not a sharded one; use load_checkpoint")
    if optimizer is not None and not meta.get("has_optimizer", True):
        raise ValueError(f"checkpoint {path} has no optimizer state; cannot resume training")
    state = _state(model, optimizer)
    try:
        with _single_process_quiet():
            dcp_load(_as_saved(state, model), storage_reader=FileSystemReader(path))
    except CheckpointException as err:
        lines = str(err).strip().splitlines()
        raise ValueError(
            f"checkpoint {path} does not match the model and optimizer "
            f"({lines[-1] if lines else err}; a different model config?)"
        ) from None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    if restore_rng:
        states = meta["rng"]
        same_world = len(states) == get_world_size()
        set_rng_state(states[get_rank()] if same_world else states[0])
    return meta
