"""Quantised linear layers for low-precision training (Nemotron 3 Super §2.2), emulated with
fake quantisation in fp32 on any device, or run by Transformer Engine when it is importable.

NVFP4 recipe, all three GEMMs of y = x W^T in FP4 (x [M, K] tokens x in-features, W [N, K]):

    fprop  y  = Q(x)_1d,K      @ Q(W)_2d^T          round-to-nearest-even
    dgrad  dx = Q_sr(dy)_1d,N  @ Q(W)_2d            the *same* quantised weight as fprop
    wgrad  dW = Q_sr(H dy)^T   @ Q(H x)             1-D blocks along M (the reduction axis)

`Q(.)_1d,K`: NVFP4 with 16-element blocks along K; `Q(W)_2d`: 16x16 tiles, so W and W^T share
one quantisation; `_sr`: stochastic rounding (gradients); H: random Hadamard transform (16x16,
random signs, `hadamard.py`) applied along the token axis M of both wgrad inputs.

MXFP8 recipe (the Mamba output projection, §2.2): E4M3 elements with E8M0 scales per 32
elements along each GEMM's reduction axis, round-to-nearest-even, cuBLAS-style "rceil" scales.
W is quantised along K for fprop and along N for dgrad (row- and column-wise copies, as in TE).

The emulated GEMMs run in fp32 on dequantised operands (element x block scale x global scale).
A Blackwell tensor core multiplies the same FP4 elements and block scales and accumulates in
fp32, applying the global scales once to the output, so the two differ only by fp32 rounding
(accumulation order, where the global scale is applied). Outputs are in the input's dtype.

Shape legend: M tokens, K in-features, N out-features, A expert assignments, E experts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..model.mlp import relu2
from .formats import mxfp8_fake_quant, nvfp4_fake_quant
from .hadamard import blockwise_transform, random_hadamard

Tensor = torch.Tensor
GemmFormat = Literal["nvfp4", "mxfp8"]


@dataclass(kw_only=True)
class QuantRecipe:
    """How one linear layer's three GEMMs are quantised."""

    format: GemmFormat = "nvfp4"
    hadamard: bool = True  # random Hadamard transform on the wgrad inputs (NVFP4 only)
    hadamard_size: int = 16
    stochastic_grad: bool = True  # stochastic rounding when quantising gradients (NVFP4 only)
    backend: Literal["emulate", "te", "auto"] = "emulate"  # auto: TE when importable on CUDA

    def __post_init__(self) -> None:
        if self.format not in ("nvfp4", "mxfp8"):
            raise ValueError(f"recipe format must be 'nvfp4' or 'mxfp8', got {self.format!r}")
        if self.backend not in ("emulate", "te", "auto"):
            raise ValueError(f"backend must be 'emulate', 'te' or 'auto', got {self.backend!r}")
        if self.hadamard_size < 1 or self.hadamard_size & (self.hadamard_size - 1):
            raise ValueError(f"hadamard_size must be a power of two, got {self.hadamard_size}")


MXFP8_RECIPE = QuantRecipe(format="mxfp8", hadamard=False, stochastic_grad=False)


class UnderflowStats:
    """Per-GEMM-operand counters: nonzero inputs and those quantised to exactly zero (FP4 or
    E4M3 underflow), kept as device tensors until read (no host sync per step)."""

    OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "wgrad_dy", "wgrad_x")

    def __init__(self) -> None:
        self.nonzero: dict[str, Tensor] = {}
        self.underflow: dict[str, Tensor] = {}

    def add(self, key: str, x: Tensor, q: Tensor) -> None:
        nz = x != 0
        self.nonzero[key] = self.nonzero.get(key, 0) + nz.sum()
        self.underflow[key] = self.underflow.get(key, 0) + (nz & (q == 0)).sum()

    def totals(self) -> dict[str, tuple[int, int]]:
        """operand -> (underflowed, nonzero) as ints."""
        return {k: (int(self.underflow[k]), int(self.nonzero[k])) for k in self.nonzero}


class _Control:
    """What the autograd functions need from their module: recipe, RNG, armed stats.

    seed None: stochastic rounding and Hadamard signs draw from torch's global RNG, which the
    trainer checkpoints, so a resumed run is exact. An int seed gives the module its own stream
    (reproducible in isolation; its position is not checkpointed)."""

    def __init__(self, recipe: QuantRecipe, seed: int | None) -> None:
        self.recipe = recipe
        self.seed = seed
        self.stats: UnderflowStats | None = None
        self._gen: torch.Generator | None = None

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if self._gen is None or self._gen.device != device:
            self._gen = torch.Generator(device=device).manual_seed(self.seed)
        return self._gen


# ----------------------------------------------------------------------------- GEMM numerics


def _record(ctl: _Control, key: str, x: Tensor, q: Tensor) -> Tensor:
    if ctl.stats is not None:
        ctl.stats.add(key, x, q)
    return q


def _pad_rows(x_MK: Tensor, multiple: int) -> Tensor:
    pad = (-x_MK.shape[0]) % multiple
    return torch.nn.functional.pad(x_MK, (0, 0, 0, pad)) if pad else x_MK


def quantize_weight(w_NK: Tensor, recipe: QuantRecipe) -> tuple[Tensor, Tensor]:
    """(W as used by fprop, W as used by dgrad), fake-quantised. NVFP4: one 2-D quantisation
    serves both; MXFP8: blocks along K for fprop, along N for dgrad."""
    if recipe.format == "nvfp4":
        wq = nvfp4_fake_quant(w_NK, block="2d")
        return wq, wq
    w_f = mxfp8_fake_quant(w_NK, scale_mode="rceil")
    w_d = mxfp8_fake_quant(w_NK.T.contiguous(), scale_mode="rceil").T
    return w_f, w_d


def qgemm_fprop(x_MK: Tensor, w_NK: Tensor, ctl: _Control) -> tuple[Tensor, Tensor]:
    """y = Q(x) Q(W)^T in fp32; returns (y_MN, the dgrad copy of Q(W))."""
    r = ctl.recipe
    w_f, w_d = quantize_weight(w_NK, r)
    if r.format == "nvfp4":
        xq = nvfp4_fake_quant(x_MK, block="1d")
    else:
        xq = mxfp8_fake_quant(x_MK, scale_mode="rceil")
    _record(ctl, "fprop_x", x_MK, xq)
    _record(ctl, "fprop_w", w_NK, w_f)
    return xq @ w_f.T, w_d


def qgemm_bprop(
    dy_MN: Tensor, x_MK: Tensor, w_d_NK: Tensor, ctl: _Control, need_dx: bool = True
) -> tuple[Tensor | None, Tensor]:
    """(dx_MK, dW_NK) with quantised operands (module docstring). Random draws, in order:
    Hadamard signs, dgrad SR uniforms, wgrad SR uniforms, all from the module's generator."""
    r = ctl.recipe
    if r.format == "mxfp8":
        dx = None
        if need_dx:
            dyq = _record(ctl, "dgrad_dy", dy_MN, mxfp8_fake_quant(dy_MN, scale_mode="rceil"))
            dx = dyq @ w_d_NK
        dyT = dy_MN.T.contiguous()
        xT = x_MK.T.contiguous()
        dyTq = _record(ctl, "wgrad_dy", dyT, mxfp8_fake_quant(dyT, scale_mode="rceil"))
        xTq = _record(ctl, "wgrad_x", xT, mxfp8_fake_quant(xT, scale_mode="rceil"))
        return dx, dyTq @ xTq.T
    gen = ctl.generator(dy_MN.device)
    rnd = "sr" if r.stochastic_grad else "rne"
    h = random_hadamard(r.hadamard_size, generator=gen, device=dy_MN.device) if r.hadamard else None
    dx = None
    if need_dx:
        dyq = nvfp4_fake_quant(dy_MN, block="1d", rounding=rnd, generator=gen)
        dx = _record(ctl, "dgrad_dy", dy_MN, dyq) @ w_d_NK
    # wgrad: reduction over tokens, so 1-D blocks (and H) run along M; zero rows pad M.
    mult = r.hadamard_size if h is not None else 1
    dyT = _pad_rows(dy_MN, mult).T.contiguous()
    xT = _pad_rows(x_MK, mult).T.contiguous()
    if h is not None:
        dyT, xT = blockwise_transform(dyT, h), blockwise_transform(xT, h)
    dyTq = nvfp4_fake_quant(dyT, block="1d", rounding=rnd, generator=gen)
    xTq = nvfp4_fake_quant(xT, block="1d")
    _record(ctl, "wgrad_dy", dyT, dyTq)
    _record(ctl, "wgrad_x", xT, xTq)
    return dx, dyTq @ xTq.T


class QLinearFunction(torch.autograd.Function):
    """Quantised y = x W^T with custom dgrad/wgrad (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, ctl: _Control) -> Tensor:
        x_MK = x.reshape(-1, x.shape[-1]).float()
        y_MN, w_d = qgemm_fprop(x_MK, weight.float(), ctl)
        ctx.save_for_backward(x_MK, w_d)
        ctx.ctl, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = ctl, x.shape, x.dtype, weight.dtype
        return y_MN.reshape(*x.shape[:-1], -1).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x_MK, w_d = ctx.saved_tensors
        dy_MN = dy.reshape(-1, dy.shape[-1]).float()
        dx, dw = qgemm_bprop(dy_MN, x_MK, w_d, ctx.ctl, need_dx=ctx.needs_input_grad[0])
        dx = dx.reshape(ctx.x_shape).to(ctx.x_dtype) if dx is not None else None
        return dx, dw.to(ctx.w_dtype), None


class QGroupedFunction(torch.autograd.Function):
    """Per-expert quantised GEMMs over tokens sorted by expert: y[a] = x[a] W[e(a)]^T, each
    expert's slice one GEMM with its own per-tensor scales (a grouped GEMM in TE)."""

    @staticmethod
    def forward(ctx, x_AK: Tensor, w_ENK: Tensor, counts: tuple[int, ...], ctl: _Control):
        x32 = x_AK.float()
        ys, wds = [], []
        for e, chunk in enumerate(x32.split(list(counts))):
            if chunk.shape[0] == 0:
                wds.append(None)
                continue
            y, w_d = qgemm_fprop(chunk, w_ENK[e].float(), ctl)
            ys.append(y)
            wds.append(w_d)
        ctx.save_for_backward(x32)
        ctx.wds, ctx.counts, ctx.ctl = wds, counts, ctl
        ctx.x_dtype, ctx.w_dtype, ctx.w_shape = x_AK.dtype, w_ENK.dtype, w_ENK.shape
        out = torch.cat(ys) if ys else x32.new_zeros(0, w_ENK.shape[1])
        return out.to(x_AK.dtype)

    @staticmethod
    def backward(ctx, dy_AN: Tensor):
        (x32,) = ctx.saved_tensors
        dy32 = dy_AN.float()
        dx_parts, dw = [], dy32.new_zeros(ctx.w_shape)
        offs = 0
        for e, c in enumerate(ctx.counts):
            if c == 0:
                continue
            sl = slice(offs, offs + c)
            offs += c
            dx, dw[e] = qgemm_bprop(dy32[sl], x32[sl], ctx.wds[e], ctx.ctl)
            dx_parts.append(dx)
        dx = torch.cat(dx_parts) if dx_parts else x32.new_zeros(x32.shape)
        return dx.to(ctx.x_dtype), dw.to(ctx.w_dtype), None, None


# ----------------------------------------------------------------------------- modules


def transformer_engine():
    """transformer_engine.pytorch, or None when it is not importable."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError:
        return None


def resolve_backend(recipe: QuantRecipe, device: torch.device) -> str:
    if recipe.backend == "emulate":
        return "emulate"
    te_ok = transformer_engine() is not None and device.type == "cuda"
    if recipe.backend == "te" and not te_ok:
        raise ValueError("backend 'te' needs transformer_engine and a CUDA device")
    return "te" if te_ok else "emulate"


class QLinear(nn.Linear):
    """nn.Linear whose three GEMMs are quantised by `recipe`. Same parameter names (`weight`,
    `bias`) and shapes as the layer it replaces, so checkpoints are unchanged."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        recipe: QuantRecipe,
        bias: bool = False,
        seed: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.ctl = _Control(recipe, seed)
        self.backend = "emulate"
        self._te_module: list[nn.Module] = []  # a list: not a registered submodule

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: QuantRecipe, *, seed: int | None = None
    ) -> QLinear:
        """Wrap `linear`'s own Parameter objects (no copy; an optimizer built before or after
        the conversion sees the same tensors)."""
        with torch.device("meta"):
            q = cls(
                linear.in_features,
                linear.out_features,
                recipe=recipe,
                bias=linear.bias is not None,
                seed=seed,
            )
        q.weight = linear.weight
        q.bias = linear.bias
        q.backend = resolve_backend(recipe, linear.weight.device)
        return q

    def controls(self) -> dict[str, _Control]:
        """parameter name -> its GEMM control (for monitoring)."""
        return {"weight": self.ctl}

    def forward(self, x: Tensor) -> Tensor:
        if self.backend == "te":
            return self._te_forward(x)
        y = QLinearFunction.apply(x, self.weight, self.ctl)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def _te_forward(self, x: Tensor) -> Tensor:
        # Transformer Engine's NVFP4BlockScaling recipe implements the same GEMMs (2-D weight
        # blocks, RHT on wgrad inputs, SR on gradients; TE PR #2177). Not exercised by the CPU
        # test suite: it needs a Blackwell GPU and transformer_engine.
        te = transformer_engine()
        recipes = importlib.import_module("transformer_engine.common.recipe")
        if not self._te_module:
            lin = te.Linear(
                self.in_features,
                self.out_features,
                bias=self.bias is not None,
                params_dtype=self.weight.dtype,
                device=self.weight.device,
            )
            lin.weight = self.weight  # share the Parameter
            if self.bias is not None:
                lin.bias = self.bias
            self._te_module.append(lin)
        if self.recipe.format == "nvfp4":
            te_recipe = recipes.NVFP4BlockScaling()
        else:
            te_recipe = recipes.MXFP8BlockScaling()
        if hasattr(te, "autocast"):  # newer TE releases name fp8_autocast `autocast`
            ctx = te.autocast(enabled=True, recipe=te_recipe)
        else:
            ctx = te.fp8_autocast(enabled=True, fp8_recipe=te_recipe)
        with ctx:
            return self._te_module[0](x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.recipe.format}, backend={self.backend}"


class QExperts(nn.Module):
    """Routed experts (3-D `up_proj` [E, F, W], `down_proj` [E, W, F]) with every expert GEMM
    quantised by `recipe`, dispatched like `Experts` with impl "loop" (tokens sorted by expert).
    Same parameter names and shapes as `hybridlm.model.moe.Experts`."""

    def __init__(self, experts: nn.Module, recipe: QuantRecipe, *, seed: int | None = None) -> None:
        super().__init__()
        self.up_proj = experts.up_proj
        self.down_proj = experts.down_proj
        self.recipe = recipe
        self.impl = "loop"  # MoE reads it; the quantised dispatch is always the sorted loop
        self.ctl_up = _Control(recipe, seed)
        self.ctl_down = _Control(recipe, None if seed is None else seed + 1_000_003)
        if recipe.backend == "te":
            raise ValueError("grouped expert GEMMs run emulated; use backend 'emulate' or 'auto'")

    def controls(self) -> dict[str, _Control]:
        return {"up_proj": self.ctl_up, "down_proj": self.ctl_down}

    def forward(self, z_TW: Tensor, idx_TK: Tensor, w_TK: Tensor) -> Tensor:
        T, K = idx_TK.shape
        E = self.up_proj.shape[0]
        flat_A = idx_TK.reshape(-1)
        order_A = flat_A.argsort(stable=True)  # sort assignments by expert
        token_A = order_A // K
        counts = tuple(torch.bincount(flat_A, minlength=E).tolist())
        z_AW = z_TW[token_A]
        h_AF = relu2(QGroupedFunction.apply(z_AW, self.up_proj, counts, self.ctl_up))
        y_AW = QGroupedFunction.apply(h_AF, self.down_proj, counts, self.ctl_down)
        y_AW = y_AW * w_TK.reshape(-1)[order_A, None].to(y_AW.dtype)
        return torch.zeros_like(z_TW, dtype=y_AW.dtype).index_add_(0, token_A, y_AW).to(z_TW.dtype)
