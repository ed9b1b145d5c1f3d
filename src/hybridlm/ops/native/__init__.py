"""Native CPU kernels for inference on few rows: GEMV-class linears, routed experts, the Mamba-2
decode step (`kernels.c`).

Batch-1 decoding is bound by memory bandwidth: every active weight is read once per token.
torch's BLAS path for a [1..8, I] x [O, I]^T product reaches about half of the machine's read
bandwidth with one row and a fifth with four (`benchmarks/README.md`, `decode_profile.py`),
and the Mamba-2 step is ~40 tiny elementwise ops. `kernels.c` streams every weight row once for
all rows of a call (register-blocked, OpenMP over output rows) and fuses the Mamba-2 step.

The C file is compiled on first use with the system C compiler (`$CC`, else `cc` / `gcc` /
`clang`) into `$HYBRIDLM_CACHE/native` (default `~/.cache/hybridlm/native`), keyed by a hash of
the source, flags and compiler, and loaded with ctypes; the OpenMP runtime is the one torch
already loaded (same soname), so the two share threads. Without a compiler, or with
`HYBRIDLM_NATIVE=0`, `available()` is False and callers use the pure-torch references
(`F.linear`, `model.moe.experts_gathered`, `model.mamba2.mamba2_decode_step_torch`), which
the kernels are tested against (`tests/test_native_kernels.py`).

Every function here takes contiguous fp32 CPU tensors and returns new tensors; `usable` says
whether an inference call qualifies (no autograd, few rows).

Training kernels (`conv_silu_*`, `gated_norm_*`, any number of rows, forward and backward)
fuse the Mamba-2 mixer's elementwise chains over whole sequences; `trainable` says whether a
call qualifies, and their autograd wrappers (`ops.conv1d.causal_conv1d_silu`,
`model.norm.GatedRMSNorm`) are tested against autograd of the references.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

Tensor = torch.Tensor
MAX_ROWS = 16  # calls with more rows go to BLAS, which is efficient there
SOURCE = Path(__file__).with_name("kernels.c")
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3"],  # no OpenMP (e.g. Apple clang): single-threaded kernels
)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_status: str | None = None  # None: not tried yet
_enabled = True  # `enabled(False)`: the references, e.g. as a benchmark's peer


def _cache_dir() -> Path:
    root = os.environ.get("HYBRIDLM_CACHE") or Path.home() / ".cache" / "hybridlm"
    return Path(root) / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("HYBRIDLM_NATIVE", "1") == "0":
        return None, "disabled by HYBRIDLM_NATIVE=0"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found ($CC, cc, gcc, clang)"
    source = SOURCE.read_bytes()
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(
            source + " ".join([cc, *flags, platform.machine(), platform.node()]).encode()
        ).hexdigest()[:16]
        lib_path = _cache_dir() / f"kernels-{key}.so"
        if not lib_path.is_file():
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
                out = Path(tmp) / lib_path.name
                cmd = [cc, *flags, "-shared", "-fPIC", str(SOURCE), "-o", str(out), "-lm"]
                run = subprocess.run(cmd, capture_output=True, text=True)
                if run.returncode != 0:
                    errors.append(f"{' '.join(flags)}: {run.stderr.strip()[-200:]}")
                    continue
                os.replace(out, lib_path)  # atomic: concurrent processes see a whole library
        try:
            lib = ctypes.CDLL(str(lib_path))
        except OSError as err:
            errors.append(f"{' '.join(flags)}: {err}")
            continue
        _declare(lib)
        return lib, f"{lib_path} ({cc} {' '.join(flags)})"
    return None, "compilation failed: " + " | ".join(errors)


def _declare(lib: ctypes.CDLL) -> None:
    p, L, i, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.hl_linear.argtypes = [p, p, p, p, L, L, L, i]
    lib.hl_experts.argtypes = [p] * 8 + [L] * 5 + [i]
    lib.hl_mamba_step.argtypes = [p] * 13 + [L] * 6 + [f, f, f, i]
    lib.hl_rms_norm.argtypes = [p, p, p, L, L, f]
    lib.hl_attention.argtypes = [p] * 5 + [L] * 9 + [f, i]
    lib.hl_route.argtypes = [p, p, p, p, L, L, L, i, f]
    lib.hl_conv_silu_fwd.argtypes = [p] * 4 + [L] * 4 + [i]
    lib.hl_conv_silu_bwd.argtypes = [p] * 7 + [L] * 4 + [i]
    lib.hl_gated_norm_fwd.argtypes = [p] * 5 + [L] * 3 + [f, i]
    lib.hl_gated_norm_bwd.argtypes = [p] * 8 + [L] * 3 + [i]
    for fn in (
        lib.hl_linear,
        lib.hl_mamba_step,
        lib.hl_rms_norm,
        lib.hl_attention,
        lib.hl_route,
        lib.hl_conv_silu_fwd,
        lib.hl_conv_silu_bwd,
        lib.hl_gated_norm_fwd,
        lib.hl_gated_norm_bwd,
    ):
        fn.restype = None
    lib.hl_experts.restype = L  # assignments with a valid expert index


def library() -> ctypes.CDLL | None:
    """The loaded kernels, compiled on the first call (None when unavailable; see `status`)."""
    global _lib, _status
    if _status is None:
        with _lock:
            if _status is None:
                _lib, _status = _build()
    return _lib


def available() -> bool:
    return _enabled and library() is not None


@contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Within the block, use (True) or bypass (False) the native kernels, e.g. to time or test
    the pure-torch references in the same process."""
    global _enabled
    before, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = before


def status() -> str:
    """Where the kernels were loaded from, or why they are not used."""
    library()
    return _status or ""


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_PLAIN_TYPES = (Tensor, torch.nn.Parameter)


def _fp32_cpu(t: Tensor) -> bool:
    """A plain (not a tensor subclass) fp32 CPU tensor."""
    return type(t) in _PLAIN_TYPES and t.dtype == torch.float32 and t.is_cpu


def usable(x: Tensor, *weights: Tensor | None) -> bool:
    """True when the native kernels may compute this inference call: no autograd, contiguous
    fp32 CPU tensors (plain, not tensor subclasses), at most MAX_ROWS rows of `x`. Called on
    every projection of a decode step, so the cheap checks come first."""
    if not _enabled or x.numel() == 0 or x.numel() > MAX_ROWS * x.shape[-1]:
        return False
    grad = torch.is_grad_enabled()
    for t in (x, *weights):
        if t is None:
            continue
        if not _fp32_cpu(t) or not t.is_contiguous() or (grad and t.requires_grad):
            return False
    return not torch.compiler.is_compiling() and library() is not None


def trainable(*tensors: Tensor | None) -> bool:
    """True when the training kernels may compute a call on these tensors: plain fp32 CPU
    tensors (any number of rows, autograd allowed: the caller's Function does the backward),
    kernels available, not inside torch.compile."""
    if not _enabled:
        return False
    if not all(t is None or _fp32_cpu(t) for t in tensors):
        return False
    return not torch.compiler.is_compiling() and library() is not None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` for a few rows of x [..., I], weight [O, I]."""
    lib = library()
    I = x.shape[-1]
    O = weight.shape[0]
    if weight.shape[1] != I:
        raise ValueError(f"linear: x has {I} features, weight expects {weight.shape[1]}")
    M = x.numel() // I
    y = x.new_empty(*x.shape[:-1], O)
    lib.hl_linear(_ptr(x), _ptr(weight), _ptr(bias), _ptr(y), M, O, I, torch.get_num_threads())
    return y


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`F.rms_norm(x, (D,), weight, eps)` for a few rows of x [..., D] (one call instead of
    torch's composite of six ops; statistics in double)."""
    lib = library()
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for {D} features")
    y = x.new_empty(x.shape)
    lib.hl_rms_norm(_ptr(x), _ptr(weight), _ptr(y), x.numel() // max(D, 1), D, eps)
    return y


def experts(z_TW: Tensor, idx_TK: Tensor, w_TK: Tensor, up_EFW: Tensor, down_EWF: Tensor) -> Tensor:
    """Gate-weighted sum of the chosen relu^2 experts [T, W] (`model.moe.experts_gathered`):
    each chosen expert's weights are read once for all tokens that chose it."""
    lib = library()
    z_TW = z_TW.contiguous()
    T, K = idx_TK.shape
    E, F, W = up_EFW.shape
    idx = idx_TK.to(torch.int64).contiguous()
    gate = w_TK.to(torch.float32).contiguous()
    y = z_TW.new_empty(T, W)
    h = z_TW.new_empty(T * K, F)
    zs = z_TW.new_empty(T * K, W)
    matched = lib.hl_experts(
        _ptr(z_TW), _ptr(idx), _ptr(gate), _ptr(up_EFW), _ptr(down_EWF), _ptr(y), _ptr(h),
        _ptr(zs), T, K, E, W, F, torch.get_num_threads(),
    )  # fmt: skip
    if matched != T * K:
        raise ValueError(f"expert index out of range [0, {E})")
    return y


def mamba_step(
    zxbcdt_BR: Tensor,
    conv_BSX: Tensor,
    ssm_BHPN: Tensor,
    conv_w_XK: Tensor,
    conv_b_X: Tensor | None,
    dt_bias_H: Tensor,
    A_log_H: Tensor,
    D_H: Tensor,
    norm_w_I: Tensor,
    *,
    groups: int,
    dt_clamp_min: float,
    dt_clamp_max: float | None,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The Mamba-2 decode step between in_proj and out_proj, fused: causal conv tap, SiLU,
    softplus dt, `ssd_step`, D skip and the group-gated RMSNorm. Returns (y_BI, new conv_BSX,
    new ssm_BHPN); the inputs are not modified (cache snapshots keep references)."""
    lib = library()
    Bsz, S, X = conv_BSX.shape
    _, H, P, N = ssm_BHPN.shape
    I = H * P
    if zxbcdt_BR.shape != (Bsz, I + X + H) or X != I + 2 * groups * N:
        raise ValueError("mamba_step: in_proj output and cache shapes do not match")
    conv_out = conv_BSX.new_empty(Bsz, S, X)
    ssm_out = ssm_BHPN.new_empty(Bsz, H, P, N)
    y = zxbcdt_BR.new_empty(Bsz, I)
    scratch = zxbcdt_BR.new_empty(Bsz, X)
    lib.hl_mamba_step(
        _ptr(zxbcdt_BR), _ptr(conv_BSX), _ptr(conv_w_XK), _ptr(conv_b_X), _ptr(dt_bias_H),
        _ptr(A_log_H), _ptr(D_H), _ptr(norm_w_I), _ptr(ssm_BHPN), _ptr(conv_out),
        _ptr(ssm_out), _ptr(y), _ptr(scratch), Bsz, H, P, groups, N, S,
        dt_clamp_min, float("inf") if dt_clamp_max is None else dt_clamp_max, eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return y, conv_out, ssm_out


def attention_usable(q_BHLE: Tensor, k_BKSE: Tensor, v_BKSE: Tensor) -> bool:
    """Whether `attention` can read these tensors in place: fp32 CPU, queries contiguous, keys
    and values laid out as the valid prefix of a [B, K, capacity, E] buffer (`KVState`)."""
    Bsz, _, L, _ = q_BHLE.shape
    if Bsz * L > MAX_ROWS or not q_BHLE.is_contiguous():
        return False
    if not usable(q_BHLE.view(Bsz * L, -1)):  # fp32 CPU inference; rows: B * L
        return False
    for t in (k_BKSE, v_BKSE):
        if (
            not _fp32_cpu(t)
            or t.stride(3) != 1
            or t.stride(2) != t.shape[3]
            or t.stride(0) != t.shape[1] * t.stride(1)
        ):
            return False
    return True


def attention(
    q_BHLE: Tensor, k_BKSE: Tensor, v_BKSE: Tensor, *, window: int | None = None
) -> Tensor:
    """Causal grouped-query attention of a few query rows that are the last L positions of the
    S keys (a decode step or a verification against a cache; `ops.attention.attention` with
    q_offset = S - L); `window`: the sliding window. Check `attention_usable` first."""
    lib = library()
    Bsz, H, L, E = q_BHLE.shape
    Kh, S = k_BKSE.shape[1], k_BKSE.shape[2]
    if H % Kh or S < L or v_BKSE.shape != k_BKSE.shape:
        raise ValueError("attention: query / key / value shapes do not match")
    o = q_BHLE.new_empty(Bsz, H, L, E)
    scores = q_BHLE.new_empty(Bsz * H * max(S, 1))
    lib.hl_attention(
        _ptr(q_BHLE), _ptr(k_BKSE), _ptr(v_BKSE), _ptr(o), _ptr(scores), Bsz, H, Kh, L, S, E,
        k_BKSE.stride(1), v_BKSE.stride(1), window or 0, E**-0.5, torch.get_num_threads(),
    )  # fmt: skip
    return o


def route(
    logits_TE: Tensor, bias_E: Tensor, *, top_k: int, norm_topk_prob: bool, scaling: float
) -> tuple[Tensor, Tensor]:
    """Sigmoid top-k routing of router logits (`model.moe.sigmoid_topk_route` without group
    limits): (expert ids [T, K] int64, gates [T, K])."""
    lib = library()
    T, E = logits_TE.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k {top_k} for {E} experts")
    # bound to names: a temporary copy would be freed before the kernel reads it
    logits, bias = logits_TE.contiguous(), bias_E.contiguous()
    idx = torch.empty(T, top_k, dtype=torch.int64)
    gate = logits_TE.new_empty(T, top_k)
    lib.hl_route(
        _ptr(logits), _ptr(bias), _ptr(idx), _ptr(gate), T, E, top_k, int(norm_topk_prob), scaling
    )
    return idx, gate


# ---------------------------------------------------------------------- training kernels
def conv_silu_fwd(xp_BTD: Tensor, w_KD: Tensor, b_D: Tensor | None, L: int) -> Tensor:
    """silu(causal depthwise conv) [B, L, D] of the padded inputs xp [B, L + K - 1, D] with taps
    w [K, D] (tap k multiplies xp[:, l + k]) and bias [D]."""
    lib = library()
    B, T, D = xp_BTD.shape
    K = w_KD.shape[0]
    if T != L + K - 1 or w_KD.shape != (K, D) or (b_D is not None and b_D.shape != (D,)):
        raise ValueError("conv_silu_fwd: shapes do not match [B, L + K - 1, D], [K, D], [D]")
    y = xp_BTD.new_empty(B, L, D)
    lib.hl_conv_silu_fwd(
        _ptr(xp_BTD), _ptr(w_KD), _ptr(b_D), _ptr(y), B, L, D, K, torch.get_num_threads()
    )
    return y


def conv_silu_bwd(
    xp_BTD: Tensor, w_KD: Tensor, b_D: Tensor | None, g_BLD: Tensor
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Gradients (xp [B, T, D], w [K, D], bias [D] or None) of `conv_silu_fwd` given the
    output's gradient g [B, L, D]."""
    lib = library()
    B, T, D = xp_BTD.shape
    K, L = w_KD.shape[0], g_BLD.shape[1]
    n = torch.get_num_threads()
    g_xp, da = torch.empty_like(xp_BTD), g_BLD.new_empty(B, L, D)
    part = g_BLD.new_zeros(n, K + 1, D)
    lib.hl_conv_silu_bwd(
        _ptr(xp_BTD), _ptr(w_KD), _ptr(b_D), _ptr(g_BLD), _ptr(g_xp), _ptr(da), _ptr(part),
        B, L, D, K, n,
    )  # fmt: skip
    sums = part.sum(0)
    return g_xp, sums[:K], (sums[K] if b_D is not None else None)


def gated_norm_fwd(
    x: Tensor, z: Tensor, w: Tensor, group_size: int, eps: float
) -> tuple[Tensor, Tensor]:
    """(w * rmsnorm_per_group(x * silu(z)) [..., I], the inverse RMS per row and group)."""
    lib = library()
    I = x.shape[-1]
    if z.shape != x.shape or w.shape != (I,) or I % group_size:
        raise ValueError("gated_norm_fwd: x, z [..., I], w [I], I a multiple of group_size")
    M = x.numel() // max(I, 1)
    y, rs = x.new_empty(x.shape), x.new_empty(M, I // group_size)
    lib.hl_gated_norm_fwd(
        _ptr(x), _ptr(z), _ptr(w), _ptr(y), _ptr(rs), M, I, group_size, eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return y, rs


def gated_norm_bwd(
    x: Tensor, z: Tensor, w: Tensor, rs: Tensor, g: Tensor, group_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (x, z, w) of `gated_norm_fwd` given the output's gradient g."""
    lib = library()
    I = x.shape[-1]
    M = x.numel() // max(I, 1)
    n = torch.get_num_threads()
    gx, gz, part = torch.empty_like(x), torch.empty_like(z), x.new_zeros(n, I)
    lib.hl_gated_norm_bwd(
        _ptr(x), _ptr(z), _ptr(w), _ptr(rs), _ptr(g), _ptr(gx), _ptr(gz), _ptr(part),
        M, I, group_size, n,
    )  # fmt: skip
    return gx, gz, part.sum(0)
