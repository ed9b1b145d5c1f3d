"""Per-layer precision policy for low-precision training and the converter that applies it.

Nemotron 3 Super §2.2 (Table 3; official recipe): every linear layer in NVFP4 except

    the final ~15% of the layers        BF16  (Megatron `--num-layers-at-end-in-bf16 14` of 88)
    LatentMoE latent projections        BF16  (fc1_latent_proj / fc2_latent_proj)
    MTP layers                          BF16
    attention QKV and output proj       BF16
    embeddings and LM head              BF16
    Mamba output projection             MXFP8 (mitigates underflow seen at smaller scale)

"bf16" here means "left as it is": the layer runs in the trainer's precision (fp32 or bf16
autocast). The router (fp32 by design), norms, convolutions and SSM parameters are not GEMMs of
the recipe and are never converted. Routed experts (3-D `experts.up_proj/down_proj`) are
quantised per expert with the same three-GEMM recipe (`QExperts`).

DESIGN habit 12: a converter applied to a built model; model code has no precision flags.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from ..model.attention import Attention
from ..model.mamba2 import Mamba2Mixer
from ..model.moe import Experts, MoE
from .qlinear import MXFP8_RECIPE, QExperts, QLinear, QuantRecipe

LayerFormat = Literal["nvfp4", "mxfp8", "bf16"]
_FORMATS = ("nvfp4", "mxfp8", "bf16")


@dataclass(kw_only=True)
class PrecisionPolicy:
    """Which format each GEMM of a HybridLM trains in (defaults: Nemotron 3 Super §2.2)."""

    default: LayerFormat = "nvfp4"  # every linear not named below
    high_precision_tail: float = 0.15  # last ceil(fraction * n_layers) backbone layers -> bf16
    latent_projections: LayerFormat = "bf16"
    attention: LayerFormat = "bf16"  # q/k/v/o projections
    mtp: LayerFormat = "bf16"  # the whole MTP module
    mamba_out_proj: LayerFormat = "mxfp8"
    experts: LayerFormat = "nvfp4"  # routed experts (grouped, per-expert scales)
    hadamard: bool = True  # RHT on wgrad inputs of NVFP4 GEMMs
    stochastic_grad: bool = True  # SR on NVFP4 gradient quantisation
    backend: Literal["emulate", "te", "auto"] = "emulate"
    # None: stochastic rounding / Hadamard signs draw from torch's global RNG (checkpointed by
    # the trainer: exact resume); an int: one seeded stream per converted module
    seed: int | None = None
    exclude: list[str] = field(default_factory=list)  # module-name prefixes left unconverted

    def __post_init__(self) -> None:
        for name in ("default", "latent_projections", "attention", "mtp", "mamba_out_proj"):
            if getattr(self, name) not in _FORMATS:
                raise ValueError(
                    f"policy.{name} must be one of {_FORMATS}, got {getattr(self, name)!r}"
                )
        if self.experts not in ("nvfp4", "bf16"):
            raise ValueError(f"policy.experts must be 'nvfp4' or 'bf16', got {self.experts!r}")
        if not 0 <= self.high_precision_tail <= 1:
            raise ValueError(
                f"policy.high_precision_tail must be in [0, 1], got {self.high_precision_tail}"
            )

    def recipe(self, fmt: LayerFormat) -> QuantRecipe:
        if fmt == "mxfp8":
            return QuantRecipe(**{**MXFP8_RECIPE.__dict__, "backend": self.backend})
        return QuantRecipe(
            format="nvfp4",
            hadamard=self.hadamard,
            stochastic_grad=self.stochastic_grad,
            backend=self.backend,
        )


@dataclass
class ConversionRow:
    name: str  # module name in the model
    kind: str  # what the GEMM is (e.g. "mamba.out_proj", "moe.experts")
    format: str  # nvfp4 | mxfp8 | bf16
    reason: str  # which policy rule decided
    params: int


@dataclass
class ConversionReport:
    """One row per GEMM module of the model with the format it trains in."""

    rows: list[ConversionRow]

    def formats(self) -> tuple[str, ...]:
        """The policy's formats, then any other a converter used (FP8 training's "fp8")."""
        return _FORMATS + tuple(sorted({r.format for r in self.rows} - set(_FORMATS)))

    def by_format(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {f: [] for f in self.formats()}
        for r in self.rows:
            out[r.format].append(r.name)
        return out

    def param_fraction(self) -> dict[str, float]:
        """Share of the GEMM parameters in each format."""
        total = sum(r.params for r in self.rows) or 1
        counts: Counter[str] = Counter()
        for r in self.rows:
            counts[r.format] += r.params
        return {f: counts[f] / total for f in self.formats()}

    def table(self) -> str:
        width = max((len(r.name) for r in self.rows), default=4)
        lines = [f"{'module':<{width}}  {'kind':<28} {'format':<6} {'params':>12}  rule"]
        for r in self.rows:
            lines.append(
                f"{r.name:<{width}}  {r.kind:<28} {r.format:<6} {r.params:>12,}  {r.reason}"
            )
        frac = ", ".join(f"{f} {100 * v:.1f}%" for f, v in self.param_fraction().items())
        lines.append(f"GEMM parameters: {frac}")
        return "\n".join(lines)


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1])
    return None


def _classify(name: str, module: nn.Module, parent: nn.Module | None) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, Experts | QExperts):
        return "moe.experts"
    if name in ("lm_head",):
        return "lm_head"
    if isinstance(parent, Attention):
        return "attention." + leaf
    if isinstance(parent, Mamba2Mixer):
        return "mamba." + leaf
    if isinstance(parent, MoE):
        return "moe." + leaf
    if ".shared_experts." in f".{name}.":
        return "moe.shared_expert." + leaf
    if name.startswith(("mtp.", "mtp_depths.")):
        return "mtp." + leaf
    return "linear." + leaf


def assign_formats(
    model: nn.Module, policy: PrecisionPolicy
) -> list[tuple[str, nn.Module, ConversionRow]]:
    """Decide each GEMM module's format without changing the model (works on meta)."""
    n_layers = len(model.config.pattern) if hasattr(model, "config") else 0
    tail = math.ceil(policy.high_precision_tail * n_layers - 1e-9)
    first_tail = n_layers - tail
    modules = dict(model.named_modules())
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear | Experts | QExperts):
            continue
        parent = modules.get(name.rsplit(".", 1)[0]) if "." in name else None
        kind = _classify(name, module, parent)
        params = sum(p.numel() for p in module.parameters(recurse=False))
        idx = _layer_index(name)
        if kind == "lm_head" or name == "lm_head":
            fmt, why = "bf16", "embeddings and LM head"
        elif any(name == p or name.startswith(p + ".") for p in policy.exclude):
            fmt, why = "bf16", "policy.exclude"
        elif name.startswith(("mtp.", "mtp_depths.")):
            fmt, why = policy.mtp, "MTP layers"
        elif idx is not None and idx >= first_tail:
            fmt, why = "bf16", f"last {tail} of {n_layers} layers"
        elif kind.startswith("attention."):
            fmt, why = policy.attention, "attention QKV/output"
        elif kind in ("moe.fc1_latent_proj", "moe.fc2_latent_proj"):
            fmt, why = policy.latent_projections, "latent projections"
        elif kind == "mamba.out_proj":
            fmt, why = policy.mamba_out_proj, "Mamba output projection"
        elif kind == "moe.experts":
            fmt, why = policy.experts, "routed experts (grouped)"
        else:
            fmt, why = policy.default, "default"
        out.append((name, module, ConversionRow(name, kind, fmt, why, params)))
    return out


def convert_for_low_precision(
    model: nn.Module,
    policy: PrecisionPolicy | None = None,
    *,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
) -> ConversionReport:
    """Swap the model's linears / experts for quantised ones per `policy` (in place; parameters
    are reused, so state-dict keys, shapes and optimizer references do not change). A module is
    converted only if `module_filter(name, module)` is true (default: all). Returns the table of
    which module got which format."""
    policy = policy or PrecisionPolicy()
    plan = assign_formats(model, policy)
    rows = []
    for k, (name, module, row) in enumerate(plan):
        if module_filter is not None and not module_filter(name, module):
            row.format, row.reason = "bf16", "module_filter"
        rows.append(row)
        if row.format == "bf16" or isinstance(module, QLinear | QExperts):
            continue
        recipe = policy.recipe(row.format)
        seed = None if policy.seed is None else policy.seed * 1_000_003 + k
        if isinstance(module, Experts):
            new: nn.Module = QExperts(module, recipe, seed=seed)
        else:
            new = QLinear.from_linear(module, recipe, seed=seed)
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, new)
    return ConversionReport(rows)


def quantised_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> QLinear / QExperts module of a converted model."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QLinear | QExperts)}
