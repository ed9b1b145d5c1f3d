"""Triton kernels for the Mamba-2 mixer's training chains on CUDA: the chunked SSD scan
(`fused.ssd`), the causal conv1d + SiLU (`fused.conv1d`) and the gated RMSNorm
(`fused.gated_norm`), each forward and backward.

Each kernel is the fast path of a pure-torch function that stays the reference and the CPU
path (`ops.ssd.ssd_chunked`, `ops.conv1d.causal_conv1d_silu` / `causal_conv1d_docs`,
`model.norm.gated_rms_norm`); `tests/test_fused_kernels.py` checks every one against autograd
of its reference, in fp32 and bf16, with ragged lengths, packed documents and initial states.
The kernels are plain Triton (no autotuning, no vendor libraries), so the same tests run on a
CPU under `TRITON_INTERPRET=1`, where Triton's interpreter executes them with NumPy.

`usable(*tensors)` says whether a call takes the fused path: Triton importable, no fp64
tensor (reference runs stay fp64), every tensor on a CUDA device, and not turned off with
`HYBRIDLM_FUSED=0` (or `enabled(False)`, e.g. to measure the references as a benchmark's
peer). `HYBRIDLM_FUSED=1` together with `TRITON_INTERPRET=1` also sends CPU tensors through
the kernels (interpreted): how the CPU tests run a whole model on them. The kernel modules are
imported on first use only, so importing the model never imports Triton.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_enabled = True
_triton: bool | None = None


def triton_available() -> bool:
    global _triton
    if _triton is None:
        _triton = importlib.util.find_spec("triton") is not None
    return _triton


def usable(*tensors: torch.Tensor | None) -> bool:
    """True when the fused kernels take this call (module docstring)."""
    mode = os.environ.get("HYBRIDLM_FUSED")
    if not _enabled or mode == "0":
        return False
    present = [t for t in tensors if t is not None]
    if not present or any(t.dtype == torch.float64 for t in present):
        return False
    if not all(t.is_cuda for t in present):
        interpreted = mode == "1" and os.environ.get("TRITON_INTERPRET") == "1"
        if not (interpreted and all(t.device.type == "cpu" for t in present)):
            return False
    return triton_available()


@contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Turn the fused paths on or off inside a block (benchmarks measure both)."""
    global _enabled
    before, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = before


def next_pow2(n: int, least: int = 16) -> int:
    """Block sizes: Triton tiles are powers of two, and `tl.dot` needs at least 16."""
    return max(least, 1 << max(0, (n - 1).bit_length()))


def dot_precision(*tensors: torch.Tensor) -> str:
    """The precision of the kernels' `tl.dot` products, as torch decides its own fp32 matmuls:
    TF32 for half-precision inputs (whose own rounding is coarser), inside CUDA autocast, or
    when `torch.set_float32_matmul_precision` allows it ("high"/"medium"); IEEE fp32 otherwise
    (the default "highest", which the parity tests use)."""
    if any(t.dtype in (torch.bfloat16, torch.float16) for t in tensors):
        return "tf32"
    if torch.is_autocast_enabled("cuda") or torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"
