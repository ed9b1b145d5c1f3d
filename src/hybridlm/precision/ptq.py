"""Post-training quantisation for deployment: FP8 W8A8 and NVFP4 W4A4 fake-quant inference
modules, calibration, and the held-out evaluation (Nemotron 3 Super §4; notes §5).

Shape legend: N out features, K in features (the GEMM reduction axis), G = K/16 NVFP4 blocks,
B = 16 elements of a block, T tokens, A = T*top_k expert assignments, E experts, F expert hidden
width, W routed width (latent size).

Recipes (what vLLM executes for ModelOpt checkpoints, emulated in fp32 on any device):

    fp8    weight: E4M3, one fp32 scale amax/448 per tensor (ModelOpt `weight_scale`);
           input: E4M3 with a static per-tensor scale calib_amax/448 (`input_scale`).
    nvfp4  weight: E2M1 in 1-D blocks of 16 along K, E4M3 block scales (`weight_scale`) and a
           per-tensor fp32 scale amax/(6*448) (`weight_scale_2`); block scales chosen by a
           per-block MSE search over E4M3 candidates (Nemotron 3 Super §4.2 "hybrid FP4": weight
           scales by MSE offline, activation scales dynamic and max-based);
           input: 1-D blocks of 16 along K with dynamic max-based block scales under a static
           per-tensor scale calib_amax/(6*448) (`input_scale`, as vLLM's `scaled_fp4_quant`).
    bf16   the operator is left unquantised (the model's own precision; bf16 when deployed).

Operators: every `nn.Linear` except the exclusions (LM head, and the MTP drafter by default),
plus the routed experts of each MoE layer (`experts.up_proj` / `experts.down_proj`, 3-D).
Embeddings, the router (`gate`), norms, the Mamba conv and `A_log` / `D` / `dt_bias` are not
linears and stay as they are. Linears that vLLM fuses into one GEMM (attention Q/K/V, SwiGLU
gate/up) share one format, one input scale and one per-tensor weight scale, as ModelOpt's export
does before fusing (`preprocess_linear_fusion`); routed experts share one input scale per
projection (vLLM's fused-MoE kernels take the max over experts), weight scales are per expert.

The quantised modules store exactly the tensors the checkpoint holds, under ModelOpt's names
(`weight`, `weight_scale`, `weight_scale_2`, `input_scale`), and a dequantised fp32 copy of the
weight for the forward: output = F.linear(Q_act(x), dequant(W)), i.e. what the low-precision
GEMM computes up to fp32 summation order.
"""

from __future__ import annotations

import copy
import fnmatch
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..choices import PTQ_DEFAULT_EXCLUDE
from ..data.bpb import eval_sums
from ..model.mlp import relu2
from ..model.moe import Experts, MoE
from ..ops.cross_entropy import lm_cross_entropy
from .formats import (
    E2M1_MAX,
    E4M3_MAX,
    NVFP4Tensor,
    e4m3_round,
    fp4_e2m1_decode,
    fp4_e2m1_encode,
    fp8_scale_from_amax,
    nvfp4_dequantize,
    nvfp4_encode_domain,
    nvfp4_fake_quant,
    nvfp4_scale_from_amax,
    pack_fp4,
)

FORMATS: tuple[str, ...] = ("nvfp4", "fp8", "bf16")
NVFP4_GROUP = 16
# Effective storage bits per weight, scale overhead included: NVFP4 4 + 8/16 (one E4M3 scale per
# 16 elements; the per-tensor fp32 scale is negligible), FP8 8 (one fp32 scale per tensor),
# BF16 16. AutoQuantize's cost model and the reports use these.
BITS: dict[str, float] = {"nvfp4": 4.5, "fp8": 8.0, "bf16": 16.0}
# Not quantised by default: the LM head and the MTP drafter (see choices.PTQ_DEFAULT_EXCLUDE).
DEFAULT_EXCLUDE: tuple[str, ...] = PTQ_DEFAULT_EXCLUDE
# The Nemotron 3 Super FP8 checkpoint's table (notes §5.1): attention and latent projections stay
# BF16; add these to `exclude` to reproduce it.
NEMOTRON_FP8_EXCLUDE: tuple[str, ...] = (
    "*.q_proj",
    "*.k_proj",
    "*.v_proj",
    "*.o_proj",
    "*latent_proj",
)
# Linears that inference engines fuse into one GEMM: one format, shared scales.
_FUSED = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj"}


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {list(FORMATS)}")
    return fmt


# ============================================================================ weight quantisers
def nvfp4_weight_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """ModelOpt `weight_scale_2` = amax / (6 * 448); 1 for an all-zero tensor."""
    return nvfp4_scale_from_amax(torch.as_tensor(amax, dtype=torch.float32))


def _mse_multipliers() -> list[float]:
    # 2^(k/16) for k in [-16, 5]: ratio steps of 4.4%, finer than E4M3's smallest relative
    # spacing (6.25%), so every E4M3 value in [0.5, 1.25] x the amax scale is a candidate.
    return [2.0 ** (k / 16) for k in range(-16, 6)]


def nvfp4_quantize_weight(
    w_NK: torch.Tensor,
    *,
    global_scale: torch.Tensor | float,
    search: Literal["mse", "max"] = "mse",
) -> NVFP4Tensor:
    """NVFP4 weight with 1-D blocks of 16 along K under a given per-tensor scale.

    search="max": block scale e4m3(block_amax / 6 / s_g) (equals `formats.nvfp4_quantize`).
    search="mse": per block, the E4M3 scale among the candidates (the max one included, tried
    first) whose dequantised block has the least squared error (ModelOpt's MSE calibration,
    Nemotron 3 Super §4.2); never worse than "max", block by block."""
    if w_NK.dim() != 2 or w_NK.shape[-1] % NVFP4_GROUP:
        raise ValueError(
            f"NVFP4 weights must be 2-D with K a multiple of {NVFP4_GROUP}, got {tuple(w_NK.shape)}"
        )
    if search not in ("mse", "max"):
        raise ValueError(f"search must be 'mse' or 'max', got {search!r}")
    s_g = torch.as_tensor(global_scale, dtype=torch.float32).reshape(())
    N, K = w_NK.shape
    # Tiny s_g: encode (and compare errors) on w and s_g shifted up by a power of two, as
    # formats.nvfp4_quantize does, so (1 / s_g) / s_b stays finite and errors do not underflow.
    w_NGB, s_q = nvfp4_encode_domain(w_NK.float().reshape(N, K // NVFP4_GROUP, NVFP4_GROUP), s_g)
    s_amax_NG1 = (w_NGB.abs().amax(-1, keepdim=True) / E2M1_MAX) / s_q  # exact amax scale

    def trial(s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        recip = torch.where(s_b > 0, (1.0 / s_q) / s_b, torch.zeros_like(s_b))
        codes = fp4_e2m1_encode(w_NGB * recip)
        err = ((fp4_e2m1_decode(codes) * s_b) * s_q - w_NGB).square().sum(-1, keepdim=True)
        return codes, err

    best_s = e4m3_round(s_amax_NG1)
    best_codes, best_err = trial(best_s)
    if search == "mse":
        for m in _mse_multipliers():
            s_b = e4m3_round(s_amax_NG1 * m)
            codes, err = trial(s_b)
            better = err < best_err  # strict: ties keep the max-based scale
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, s_b, best_s)
            best_codes = torch.where(better, codes, best_codes)
    return NVFP4Tensor(
        packed=pack_fp4(best_codes.reshape(N, K)),
        block_scale=best_s.squeeze(-1).to(torch.float8_e4m3fn),
        global_scale=s_g,
        shape=w_NK.shape,
        block="1d",
    )


def fp8_weight_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """ModelOpt FP8 `weight_scale` / `input_scale` = amax / 448; 1 for zero."""
    return fp8_scale_from_amax(torch.as_tensor(amax, dtype=torch.float32))


def fp8_quantize_weight(w: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 elements of w / scale (RNE, saturating at 448) as float8_e4m3fn."""
    return e4m3_round(w.float() / scale).to(torch.float8_e4m3fn)


def quantize_weight(
    fmt: str, w_NK: torch.Tensor, amax: torch.Tensor, search: str
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one 2-D weight, under ModelOpt's names."""
    if fmt == "nvfp4":
        q = nvfp4_quantize_weight(w_NK, global_scale=nvfp4_weight_global_scale(amax), search=search)
        return {"weight": q.packed, "weight_scale": q.block_scale, "weight_scale_2": q.global_scale}
    if fmt == "fp8":
        scale = fp8_weight_scale(amax)
        return {"weight": fp8_quantize_weight(w_NK, scale=scale), "weight_scale": scale}
    raise ValueError(f"no quantised weight for format {fmt!r}")


def quantize_expert_weights(
    fmt: str, w_ENK: torch.Tensor, amax_E: torch.Tensor, search: str
) -> dict[str, torch.Tensor]:
    """`quantize_weight` of every expert (its own amax), the tensors stacked [E, ...]."""
    per = [quantize_weight(fmt, w_ENK[e], amax_E[e], search) for e in range(w_ENK.shape[0])]
    return {k: torch.stack([d[k] for d in per]) for k in per[0]}


def dequantize_weight(fmt: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 weight [N, K] from the checkpoint tensors of `quantize_weight`."""
    if fmt == "nvfp4":
        N, K2 = t["weight"].shape
        q = NVFP4Tensor(
            packed=t["weight"],
            block_scale=t["weight_scale"],
            global_scale=t["weight_scale_2"].float().reshape(()),
            shape=torch.Size((N, 2 * K2)),
            block="1d",
        )
        return nvfp4_dequantize(q, torch.float32)
    if fmt == "fp8":
        return t["weight"].float() * t["weight_scale"].float()
    raise ValueError(f"no quantised weight for format {fmt!r}")


def per_tensor_scale(fmt: str, amax: torch.Tensor | float) -> torch.Tensor:
    """ModelOpt's per-tensor decode scale of an amax: NVFP4 amax / (6 * 448) (`weight_scale_2`,
    `input_scale`, a KV cache's `k_scale`), FP8 amax / 448 (`weight_scale`, `input_scale`,
    `k_scale`); 1 for a zero amax. Static activation scales come from the calibration amax."""
    if fmt == "nvfp4":
        return nvfp4_weight_global_scale(amax)
    return fp8_weight_scale(amax)


def fake_quant_input(x: torch.Tensor, fmt: str, input_scale: torch.Tensor) -> torch.Tensor:
    """Activation quantise-dequantise along the last (reduction) axis."""
    if fmt == "nvfp4":  # dynamic 1-D block scales under the static per-tensor scale
        return nvfp4_fake_quant(x, block="1d", global_scale=input_scale)
    if fmt == "fp8":  # static per-tensor scale
        s = input_scale.to(torch.float32)
        return (e4m3_round(x.float() / s) * s).to(x.dtype)
    return x


# ============================================================================ modules
class _QuantStorage(nn.Module):
    """Keeps the stored checkpoint tensors in their formats through `module.to(dtype)` /
    `.half()` (only devices change); the dequantised compute copies follow the dtype."""

    def _apply(self, fn, recurse: bool = True):
        kept = {
            n: b
            for n, b in self._buffers.items()
            if b is not None and n not in self._non_persistent_buffers_set
        }
        super()._apply(fn, recurse)
        for n, old in kept.items():
            new = self._buffers[n]
            if new.dtype != old.dtype:
                self._buffers[n] = old.to(new.device)
        return self


class QuantLinear(_QuantStorage):
    """Fake-quant inference linear (no bias; hybridlm's linears have none): holds the
    checkpoint tensors (`weight` packed uint8 [N, K/2] + `weight_scale` e4m3 [N, K/16] +
    `weight_scale_2` for NVFP4; `weight` e4m3 [N, K] + `weight_scale` for FP8; `input_scale`)."""

    def __init__(self, fmt: str, tensors: dict[str, torch.Tensor], in_features: int) -> None:
        super().__init__()
        if fmt not in ("nvfp4", "fp8"):
            raise ValueError(f"QuantLinear formats are nvfp4 and fp8, got {fmt!r}")
        self.fmt = fmt
        self.in_features = in_features
        for name in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            if name in tensors:
                self.register_buffer(name, tensors[name])
        self.register_buffer("weight_dq", dequantize_weight(fmt, tensors), persistent=False)
        self.out_features = self.weight_dq.shape[0]
        if self.weight_dq.shape[1] != in_features:
            raise ValueError(
                f"quantised weight has K={self.weight_dq.shape[1]}, the layer expects {in_features}"
            )

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, fmt: str, *, weight_amax: float, input_amax: float, search: str
    ) -> QuantLinear:
        w = linear.weight.detach()
        t = quantize_weight(fmt, w, torch.tensor(weight_amax), search)
        t["input_scale"] = per_tensor_scale(fmt, input_amax)
        return cls(fmt, t, linear.in_features)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """{ModelOpt name: tensor} as written to the checkpoint."""
        return {n: b for n, b in self._buffers.items() if n not in self._non_persistent_buffers_set}

    def forward(self, x: torch.Tensor, **_: Any) -> torch.Tensor:
        xq = fake_quant_input(x, self.fmt, self.input_scale)
        return F.linear(xq, self.weight_dq.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"


class QuantExperts(_QuantStorage):
    """Fake-quant routed experts (all experts of the layer in one format, as vLLM's and
    TRT-LLM's quantised-MoE kernels require). Per projection p in (up_proj, down_proj):
    `p` ([E, ...] like the checkpoint's per-expert `weight`), `p_weight_scale`,
    `p_weight_scale_2` ([E], NVFP4) and `p_input_scale` (one scalar for all experts)."""

    PROJS = ("up_proj", "down_proj")

    def __init__(self, fmt: str, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        super().__init__()
        if fmt not in ("nvfp4", "fp8"):
            raise ValueError(f"QuantExperts formats are nvfp4 and fp8, got {fmt!r}")
        self.fmt = fmt
        self.impl = "quant"
        for p in self.PROJS:
            t = tensors[p]
            self.register_buffer(p, t["weight"])
            for name in ("weight_scale", "weight_scale_2", "input_scale"):
                if name in t:
                    self.register_buffer(f"{p}_{name}", t[name])
            per_expert = [
                {k: v[e] for k, v in t.items() if k != "input_scale"}
                for e in range(t["weight"].shape[0])
            ]
            dq = torch.stack([dequantize_weight(fmt, d) for d in per_expert])
            self.register_buffer(f"{p}_dq", dq, persistent=False)

    @classmethod
    def from_experts(
        cls,
        experts: Experts,
        fmt: str,
        *,
        input_amax: dict[str, float],
        search: str,
    ) -> QuantExperts:
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        for p in cls.PROJS:
            w_ENK = getattr(experts, p).detach()
            t = quantize_expert_weights(fmt, w_ENK, w_ENK.abs().amax(dim=(1, 2)), search)
            t["input_scale"] = per_tensor_scale(fmt, input_amax[p])
            tensors[p] = t
        return cls(fmt, tensors)

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """{projection: {ModelOpt name: [E, ...] tensor}}; the input scale repeated per expert."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for p in self.PROJS:
            w = getattr(self, p)
            t = {"weight": w}
            for name in ("weight_scale", "weight_scale_2", "input_scale"):
                b = getattr(self, f"{p}_{name}", None)
                if b is not None:
                    t[name] = b.expand(w.shape[0]).clone() if b.dim() == 0 else b
            out[p] = t
        return out

    def forward(self, z_TW: torch.Tensor, idx_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        up, down = self.up_proj_dq.to(z_TW.dtype), self.down_proj_dq.to(z_TW.dtype)

        def q(x: torch.Tensor, p: str) -> torch.Tensor:
            return fake_quant_input(x, self.fmt, getattr(self, f"{p}_input_scale"))

        return quant_experts_forward(z_TW, idx_TK, w_TK, up, down, q)

    def extra_repr(self) -> str:
        return f"{self.fmt}, experts={self.up_proj_dq.shape[0]}"


def quant_experts_forward(
    z_TW: torch.Tensor,
    idx_TK: torch.Tensor,
    w_TK: torch.Tensor,
    up_EFW: torch.Tensor,
    down_EWF: torch.Tensor,
    quant_input: Callable[[torch.Tensor, str], torch.Tensor],
) -> torch.Tensor:
    """Routed experts with quantised GEMM inputs: sorted dispatch, one GEMM pair per expert (the
    reference loop of `moe.Experts`), `quant_input(x, projection)` applied to the input of both
    GEMMs. The 1-D activation blocks lie within a token's row, so quantising z once before the
    dispatch equals quantising each expert's slice."""
    T, K = idx_TK.shape
    E = up_EFW.shape[0]
    zq_TW = quant_input(z_TW, "up_proj")
    flat_A = idx_TK.reshape(-1)
    order_A = flat_A.argsort(stable=True)
    token_A = order_A // K
    counts = torch.bincount(flat_A, minlength=E).tolist()
    outs = []
    for e, chunk in enumerate(zq_TW[token_A].split(counts)):
        if chunk.shape[0]:
            h = quant_input(relu2(F.linear(chunk, up_EFW[e])), "down_proj")
            outs.append(F.linear(h, down_EWF[e]))
    y_AW = torch.cat(outs) if outs else z_TW.new_zeros(0, down_EWF.shape[1])
    y_AW = y_AW * w_TK.reshape(-1)[order_A, None].to(y_AW.dtype)
    return torch.zeros_like(z_TW, dtype=y_AW.dtype).index_add_(0, token_A, y_AW).to(z_TW.dtype)


# ============================================================================ QAT modules
# Quantisation-aware training (QAD's student, `train.stages.qad`): the same quantised forward as the
# inference modules above, computed from trainable high-precision master weights. As in ModelOpt's
# QAT, the per-tensor scales are those of calibration and stay fixed (a weight's `weight_amax`,
# the activations' `input_scale`); NVFP4 weight block scales are recomputed from the current
# master weight at every forward, with the same search as the export, so `to_inference` turns a
# QAT module into the inference module whose forward is bit-identical. Gradients pass straight
# through each quantiser to its input, zero where the format saturates (|x| beyond the largest
# value it represents under the fixed per-tensor scale: ModelOpt's clipped straight-through
# estimator).


def saturation_bound(fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """The largest magnitude `fmt` represents under the per-tensor scale (the amax the scale
    stands for, inverse of `per_tensor_scale`): FP8 448 * s; NVFP4 6 * 448 * s_g (the largest
    E2M1 value times the largest E4M3 block scale)."""
    if fmt == "nvfp4":
        return E2M1_MAX * E4M3_MAX * scale.float()
    return E4M3_MAX * scale.float()


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantised value `q` exactly; backward: the gradient to `x` where |x| <=
    bound (the clipped straight-through estimator)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, bound)
        return q.view_as(q)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, bound = ctx.saved_tensors
        return g * (x.abs() <= bound).to(g.dtype), None, None


def straight_through(x: torch.Tensor, q: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """`q` (the quantised `x`) in value, with the clipped straight-through gradient to `x`."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return q
    return _StraightThrough.apply(x, q, bound.to(x.device))


@torch.no_grad()
def fake_quant_weight(fmt: str, w_NK: torch.Tensor, amax: torch.Tensor, search: str):
    """dequant(quant(w)) exactly as exported: `dequantize_weight(quantize_weight(...))`."""
    return dequantize_weight(fmt, quantize_weight(fmt, w_NK.detach().float(), amax, search))


def _cached(module: nn.Module, name: str, amax: torch.Tensor, quantize: Callable) -> torch.Tensor:
    """`quantize(fmt, weight, amax, search)` of the module's Parameter `name`, recomputed only
    when the weight changed (its version counter moves with every in-place update: an optimizer
    step): decoding and gradient accumulation reuse it."""
    w = getattr(module, name)
    key = (w._version, w.data_ptr(), w.device, amax._version)
    cache = module.__dict__.setdefault("_quantized", {})
    if name not in cache or cache[name][0] != key:
        cache[name] = (key, quantize(module.fmt, w, amax, module.search))
    return cache[name][1]


class QATLinear(nn.Module):
    """Trainable fake-quant linear: `weight` is the master weight (the replaced `nn.Linear`'s
    own Parameter); forward = F.linear(Q_act(x), Q_w(weight)) with straight-through gradients.
    `weight_amax` and `input_scale` are the calibration's (fixed)."""

    def __init__(
        self,
        weight: nn.Parameter,
        fmt: str,
        *,
        weight_amax: float,
        input_scale: torch.Tensor,
        search: str,
    ) -> None:
        super().__init__()
        if fmt not in ("nvfp4", "fp8"):
            raise ValueError(f"QATLinear formats are nvfp4 and fp8, got {fmt!r}")
        self.fmt, self.search = fmt, search
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        # fixed per-tensor scales; recorded in the QAD run's checkpoints (not in model weights)
        self.register_buffer("weight_amax", torch.tensor(float(weight_amax)), persistent=False)
        self.register_buffer("input_scale", input_scale.float().clone(), persistent=False)

    def quantized_weight(self) -> torch.Tensor:
        return _cached(self, "weight", self.weight_amax, fake_quant_weight)

    def forward(self, x: torch.Tensor, **_: Any) -> torch.Tensor:
        xq = straight_through(
            x,
            fake_quant_input(x.detach(), self.fmt, self.input_scale),
            saturation_bound(self.fmt, self.input_scale),
        )
        wq = straight_through(
            self.weight,
            self.quantized_weight(),
            saturation_bound(self.fmt, per_tensor_scale(self.fmt, self.weight_amax)),
        )
        return F.linear(xq, wq.to(x.dtype))

    @torch.no_grad()
    def to_inference(self) -> QuantLinear:
        """The inference module of the current master weight (what the export holds)."""
        t = quantize_weight(self.fmt, self.weight.detach().float(), self.weight_amax, self.search)
        t["input_scale"] = self.input_scale.clone()
        return QuantLinear(self.fmt, t, self.in_features)

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"


class QATExperts(nn.Module):
    """Trainable fake-quant routed experts: `up_proj` / `down_proj` are the replaced
    `Experts`' Parameters [E, ...]; per projection p, `p_weight_amax` [E] and `p_input_scale`
    (one for all experts) are the calibration's. Forward as `QuantExperts`."""

    PROJS = QuantExperts.PROJS

    def __init__(
        self, experts: Experts, fmt: str, *, input_scale: dict[str, torch.Tensor], search: str
    ) -> None:
        super().__init__()
        if fmt not in ("nvfp4", "fp8"):
            raise ValueError(f"QATExperts formats are nvfp4 and fp8, got {fmt!r}")
        self.fmt, self.search = fmt, search
        self.impl = "quant"
        for p in self.PROJS:
            w = getattr(experts, p)
            setattr(self, p, w)
            amax_E = w.detach().abs().amax(dim=(1, 2)).float()  # per expert, as QuantExperts
            self.register_buffer(f"{p}_weight_amax", amax_E, persistent=False)
            self.register_buffer(f"{p}_input_scale", input_scale[p].float(), persistent=False)

    def _weights(self, p: str) -> torch.Tensor:
        w, amax_E = getattr(self, p), getattr(self, f"{p}_weight_amax")

        def per_expert(fmt: str, w_ENK, amax_E, search: str) -> torch.Tensor:
            return torch.stack(
                [fake_quant_weight(fmt, w_ENK[e], amax_E[e], search) for e in range(len(w_ENK))]
            )

        wq = _cached(self, p, amax_E, per_expert)
        bound = saturation_bound(self.fmt, per_tensor_scale(self.fmt, amax_E))[:, None, None]
        return straight_through(w, wq, bound)

    def forward(self, z_TW: torch.Tensor, idx_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        def q(x: torch.Tensor, p: str) -> torch.Tensor:
            s = getattr(self, f"{p}_input_scale")
            xq = fake_quant_input(x.detach(), self.fmt, s)
            return straight_through(x, xq, saturation_bound(self.fmt, s))

        up, down = (self._weights(p).to(z_TW.dtype) for p in self.PROJS)
        return quant_experts_forward(z_TW, idx_TK, w_TK, up, down, q)

    @torch.no_grad()
    def to_inference(self) -> QuantExperts:
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        for p in self.PROJS:
            w, amax_E = getattr(self, p).detach().float(), getattr(self, f"{p}_weight_amax")
            t = quantize_expert_weights(self.fmt, w, amax_E, self.search)
            t["input_scale"] = getattr(self, f"{p}_input_scale").clone()
            tensors[p] = t
        return QuantExperts(self.fmt, tensors)

    def extra_repr(self) -> str:
        return f"{self.fmt}, experts={self.up_proj.shape[0]}"


def qat_modules(model: nn.Module) -> dict[str, QATLinear | QATExperts]:
    """The model's QAT modules by module path."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (QATLinear, QATExperts))}


def qat_scales(model: nn.Module) -> dict[str, dict[str, list[float]]]:
    """{module path: {buffer: values}} of the QAT modules' fixed scales (JSON-exact floats)."""
    return {
        n: {b: buf.flatten().tolist() for b, buf in m.named_buffers(recurse=False)}
        for n, m in qat_modules(model).items()
    }


def load_qat_scales(model: nn.Module, scales: dict[str, dict[str, list[float]]]) -> None:
    """Restore what `qat_scales` recorded (a resumed QAD run keeps its calibration's scales)."""
    mods = qat_modules(model)
    if set(mods) != set(scales):
        raise ValueError(
            f"the recorded QAT scales name other operators than the model's: "
            f"{sorted(set(mods) ^ set(scales))[:4]}"
        )
    for n, m in mods.items():
        for b, buf in m.named_buffers(recurse=False):
            buf.copy_(torch.tensor(scales[n][b], dtype=buf.dtype).reshape(buf.shape))


def to_inference(model: nn.Module) -> nn.Module:
    """Replace every QAT module by its inference module (the quantised weights of the current
    master weights), in place; returns the model."""
    for name, mod in qat_modules(model).items():
        _set_submodule(model, name, mod.to_inference())
    return model


def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace every fake-quant inference module (a loaded ModelOpt checkpoint's `QuantLinear` /
    `QuantExperts`) by a plain one holding its dequantised weights, and drop the model's KV-cache
    declaration, in place: the model a new quantisation starts from. The weights are the ones
    the quantised modules compute with (cast to the activations' dtype, as their forward does);
    the activation fake-quant goes. Returns the model."""
    dtype = model.embeddings.weight.dtype
    for name, mod in list(model.named_modules()):
        if isinstance(mod, QuantLinear):
            w = mod.weight_dq.to(dtype)
            plain = nn.Linear(mod.in_features, mod.out_features, bias=False, device=w.device)
            plain.weight = nn.Parameter(w)
            _set_submodule(model, name, plain)
        elif isinstance(mod, QuantExperts):
            E, hidden, width = mod.up_proj_dq.shape
            experts = Experts(E, width, hidden).to(mod.up_proj_dq.device)
            experts.up_proj = nn.Parameter(mod.up_proj_dq.to(dtype))
            experts.down_proj = nn.Parameter(mod.down_proj_dq.to(dtype))
            _set_submodule(model, name, experts)
    model.kv_cache_quant = None
    return model


# ============================================================================ operators
@dataclass(kw_only=True)
class Op:
    """A quantisable operator: one linear, or all routed experts of a MoE layer."""

    name: str  # module path in the model
    kind: Literal["linear", "experts"]
    group: str  # decision unit: fused linears and each MoE layer's experts share one format
    params: int  # weights (all experts for "experts")
    macs_per_token: int  # multiply-accumulates per token (active experts only)
    k: int  # reduction width (NVFP4 needs a multiple of 16)


def _fused_group(model: nn.Module, name: str) -> str:
    """`<parent>.qkv_proj` / `<parent>.gate_up_proj` when the parent holds every member of a
    fused set (attention Q/K/V; SwiGLU gate/up), else the linear's own name."""
    parent, _, leaf = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    for members, fused in _FUSED.items():
        if leaf in members and all(hasattr(owner, m) for m in members):
            return f"{parent}.{fused}" if parent else fused
    return name


def _matches(name: str, patterns: Iterable[str]) -> bool:
    """`name` matches one of the globs (or is one of the names) in `patterns`."""
    return any(fnmatch.fnmatchcase(name, pat) or name == pat for pat in patterns)


def find_ops(model: nn.Module, exclude: Iterable[str] = DEFAULT_EXCLUDE) -> list[Op]:
    """The model's quantisable operators in module order (see the module docstring)."""
    exclude = tuple(exclude)
    ops: list[Op] = []
    for name, mod in model.named_modules():
        if _matches(name, exclude):
            continue
        if isinstance(mod, (nn.Linear, QuantLinear, QATLinear)):
            n_out, k = (mod.out_features, mod.in_features)
            ops.append(
                Op(
                    name=name,
                    kind="linear",
                    group=_fused_group(model, name),
                    params=n_out * k,
                    macs_per_token=n_out * k,
                    k=k,
                )
            )
        elif isinstance(mod, (Experts, QuantExperts, QATExperts)):
            up = mod.up_proj_dq if isinstance(mod, QuantExperts) else mod.up_proj
            E, Fh, W = up.shape
            moe = _parent_moe(model, name)
            top_k = moe.cfg.top_k if moe is not None else E
            ops.append(
                Op(
                    name=name,
                    kind="experts",
                    group=name,
                    params=2 * E * Fh * W,
                    macs_per_token=2 * top_k * Fh * W,
                    k=min(W, Fh),
                )
            )
    return ops


def _parent_moe(model: nn.Module, experts_name: str) -> MoE | None:
    parent = experts_name.rpartition(".")[0]
    mod = model.get_submodule(parent) if parent else model
    return mod if isinstance(mod, MoE) else None


def groups_of(ops: Iterable[Op]) -> dict[str, list[Op]]:
    out: dict[str, list[Op]] = {}
    for op in ops:
        out.setdefault(op.group, []).append(op)
    return out


# ============================================================================ calibration
@dataclass(kw_only=True)
class CalibStats:
    """Per-operator input amax from calibration: linears under their module path, experts
    under `<path>.up_proj` (the routed width input) and `<path>.down_proj` (the hidden)."""

    input_amax: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    batches: int = 0

    def update(self, key: str, value: float) -> None:
        self.input_amax[key] = max(self.input_amax.get(key, 0.0), value)

    def amax(self, key: str) -> float:
        if key not in self.input_amax:
            raise ValueError(
                f"no calibration statistics for {key}: the operator was not run during "
                "calibration (calibrate with the same exclusions as the quantisation)"
            )
        return self.input_amax[key]


@torch.no_grad()
def _expert_hidden_amax(experts: Experts, z_TW, idx_TK) -> float:
    amax = 0.0
    for e in idx_TK.unique().tolist():
        tok = (idx_TK == e).any(-1)
        h = relu2(F.linear(z_TW[tok], experts.up_proj[e]))
        amax = max(amax, float(h.abs().amax()))
    return amax


@torch.no_grad()
def calibrate(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    *,
    exclude: Iterable[str] = DEFAULT_EXCLUDE,
    progress: Callable[[int], None] | None = None,
) -> CalibStats:
    """Forward the calibration batches (input_ids) and record each operator's input amax with
    forward hooks (expert hidden activations are recomputed per routed expert)."""
    stats = CalibStats()
    handles = []
    for op in find_ops(model, exclude):
        mod = model.get_submodule(op.name)
        if op.kind == "linear":

            def hook(m, args, key=op.name):
                stats.update(key, float(args[0].detach().abs().amax()))
        else:

            def hook(m, args, key=op.name):
                z_TW, idx_TK = args[0].detach(), args[1]
                stats.update(f"{key}.up_proj", float(z_TW.abs().amax()))
                stats.update(f"{key}.down_proj", _expert_hidden_amax(m, z_TW, idx_TK))

        handles.append(mod.register_forward_pre_hook(hook))
    # the MTP module runs only when some of its operators are to be quantised
    with_mtp = any(op.name.startswith(("mtp.", "mtp_depths.")) for op in find_ops(model, exclude))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for i, batch in enumerate(batches):
            ids = batch["input_ids"].to(device)
            if with_mtp:
                model(ids, mtp_depth=model.train_mtp_depth, return_logits=False)
            else:
                model(ids)
            stats.tokens += ids.numel()
            stats.batches += 1
            if progress is not None:
                progress(i + 1)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if stats.batches == 0:
        raise ValueError("calibration needs at least one batch")
    return stats


# ============================================================================ converter
def clone_model(model: nn.Module) -> nn.Module:
    """A deep copy to quantise while keeping the original."""
    return copy.deepcopy(model)


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def quantize_model(
    model: nn.Module,
    plan: dict[str, str],
    stats: CalibStats,
    *,
    weight_scale: Literal["mse", "max"] = "mse",
    exclude: Iterable[str] = DEFAULT_EXCLUDE,
    qat: bool = False,
) -> dict[str, str]:
    """Swap the operators named in `plan` (op name -> "nvfp4" | "fp8" | "bf16") for fake-quant
    modules, in place: inference modules, or with `qat` trainable ones (`QATLinear` /
    `QATExperts`, same scales; `to_inference` converts them). Fused groups must agree on the
    format and share their scales. Returns the formats applied per operator (NVFP4 falls back to
    FP8 for a K not divisible by 16)."""
    applied: dict[str, str] = {}
    for members in plan_groups(plan, find_ops(model, exclude)).values():
        fmt = plan[members[0].name]
        if fmt == "nvfp4" and any(op.k % NVFP4_GROUP for op in members):
            fmt = "fp8"  # a reduction width NVFP4 blocks cannot tile
        for op in members:
            applied[op.name] = fmt
        if fmt == "bf16":
            continue
        modules = quantized_group(model, members, fmt, stats, weight_scale, qat=qat)
        for name, module in modules.items():
            _set_submodule(model, name, module)
    # layers with a quantised module skip the fused decode steps by themselves (model/stock.py)
    return applied


def plan_groups(plan: dict[str, str], ops: Iterable[Op]) -> dict[str, list[Op]]:
    """The fused groups of `plan`'s operators ({group: members}), checked: every operator is one
    of `ops` (quantisable, not excluded), every format known, one format per fused group (Q/K/V,
    gate/up)."""
    by_name = {op.name: op for op in ops}
    unknown = sorted(set(plan) - set(by_name))
    if unknown:
        raise ValueError(f"not quantisable operators (or excluded): {unknown[:6]}")
    groups = groups_of(by_name[n] for n in plan)
    for group, members in groups.items():
        fmts = {check_format(plan[op.name]) for op in members}
        if len(fmts) > 1:
            raise ValueError(f"fused operators of {group} need one format, got {sorted(fmts)}")
    return groups


@torch.no_grad()
def quantized_group(
    model: nn.Module,
    members: list[Op],
    fmt: str,
    stats: CalibStats,
    weight_scale: str,
    *,
    qat: bool = False,
) -> dict[str, nn.Module]:
    """{op name: fake-quant module} for one decision group in one format (NVFP4 or FP8);
    trainable QAT modules with `qat`."""
    if members[0].kind == "experts":
        name = members[0].name
        amax = {p: stats.amax(f"{name}.{p}") for p in QuantExperts.PROJS}
        experts = model.get_submodule(name)
        if qat:
            scales = {p: per_tensor_scale(fmt, a) for p, a in amax.items()}
            return {name: QATExperts(experts, fmt, input_scale=scales, search=weight_scale)}
        return {name: QuantExperts.from_experts(experts, fmt, input_amax=amax, search=weight_scale)}
    linears = [model.get_submodule(op.name) for op in members]
    # ModelOpt preprocess_linear_fusion: fused linears share the weight and the input amax
    w_amax = max(float(m.weight.detach().abs().amax()) for m in linears)
    x_amax = max(stats.amax(op.name) for op in members)
    if qat:
        return {
            op.name: QATLinear(
                lin.weight,
                fmt,
                weight_amax=w_amax,
                input_scale=per_tensor_scale(fmt, x_amax),
                search=weight_scale,
            )
            for op, lin in zip(members, linears, strict=True)
        }
    return {
        op.name: QuantLinear.from_linear(
            lin, fmt, weight_amax=w_amax, input_amax=x_amax, search=weight_scale
        )
        for op, lin in zip(members, linears, strict=True)
    }


def recipe_plan(model: nn.Module, recipe: str, exclude: Iterable[str] = DEFAULT_EXCLUDE) -> dict:
    """Every quantisable operator in one format (the fp8 / nvfp4 recipes)."""
    check_format(recipe)
    return {op.name: recipe for op in find_ops(model, exclude)}


def override_formats(plan: dict[str, str], formats: dict[str, str]) -> dict[str, str]:
    """`plan` with every operator matching a glob of `formats` in that glob's format (the first
    glob that matches), e.g. {"*.mixer.in_proj": "fp8"}; a glob that matches no operator of the
    plan is an error (`plan_groups` checks the result)."""
    for pat in formats:
        if not any(_matches(op, (pat,)) for op in plan):
            raise ValueError(f"format override {pat!r} matches no quantised operator")
    return {
        op: next((f for pat, f in formats.items() if _matches(op, (pat,))), fmt)
        for op, fmt in plan.items()
    }


# ============================================================================ evaluation
@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    token_bytes: torch.Tensor,
    *,
    max_batches: int = 0,
) -> dict[str, float]:
    """Held-out next-token CE (nats/token) and bits per byte, computed as the trainer's
    `Trainer.evaluate` does (sum of nats over the label tokens / bytes they stand for)."""
    was_training = model.training
    model.eval()
    device = next(iter(model.buffers()), next(model.parameters())).device

    def batch_nats(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        h_BLD = model(ids, return_logits=False).hidden
        return lm_cross_entropy(h_BLD, labels, 1, lm_head_VD=model.lm_head.weight)

    try:
        nats, n_tok, n_bytes = eval_sums(batch_nats, batches, token_bytes, max_batches=max_batches)
    finally:
        model.train(was_training)
    if n_tok == 0:
        raise ValueError("the evaluation batches hold no label tokens")
    return {
        "loss": nats / n_tok,
        "bpb": nats / (math.log(2) * n_bytes) if n_bytes else math.nan,
        "tokens": n_tok,
    }


def take(batches: Iterable[dict[str, torch.Tensor]], n: int) -> list[dict[str, torch.Tensor]]:
    """The first n batches of an iterable, materialised (calibration / eval sets)."""
    out = []
    it: Iterator = iter(batches)
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def model_bits(model: nn.Module, applied: dict[str, str], ops: list[Op]) -> float:
    """Parameter-weighted effective bits per weight over the quantisable operators."""
    total = sum(op.params for op in ops)
    return sum(op.params * BITS[applied.get(op.name, "bf16")] for op in ops) / max(total, 1)
