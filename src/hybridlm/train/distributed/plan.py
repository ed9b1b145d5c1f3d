"""`plan`: per-device memory and per-step communication of a training layout, before a run.

Shape legend: B micro-batch, L sequence per CP rank (seq / cp), T = B*L tokens per device,
D model width, V vocabulary, H / K query / kv heads, E head dim (attention), I = H*P Mamba inner
width, G groups, N state size, X conv channels, Q SSD chunk, W routed width (latent size or D),
F expert hidden, S shared-expert hidden, k top-k, t tensor-parallel ranks.

Layout (world = dp_replicate x dp_shard x cp x tp; torchtitan's ParallelDims):
- TP (train/distributed/tensor_parallel.py, the implemented split): attention Q/K/V/O by heads (K/V
  replicated when tp > kv heads in the plan; training asks tp to divide them), Mamba in_proj /
  conv / dt / A / D / gated norm / out_proj by heads and groups, the dense MLP, the shared
  expert, the embedding and LM head by vocabulary, the routed experts by expert when ep = 1
  (the tp ranks act as expert-parallel ranks; with ep > 1 they are split by EP and replicated
  over tp). Norms, the router, the latent projections and MTP `eh_proj` are replicated over
  the tp group, so their activations are not / tp either.
  Sequence parallelism off: activations inside a TP region are / tp, the residual stream and the
  norms' tensors are whole on every TP rank.
- CP (train/distributed/context_parallel.py; measured at world 2): each sequence split over cp ranks
  (activations / cp) and FSDP2 over dp_shard x cp; attention all-gathers the whole
  sequence's K/V (kept for the backward, repeated to the query heads) and attends with an
  explicit [L, seq] mask, Mamba passes chunk states (B*H*P*N per layer) and conv taps.
- EP: `ep` ranks borrowed from dp_shard, as `resolve_layout` (torchtitan also lets EP span
  dp_shard x cp; the plan follows the implementation). Routed experts are Shard(0) over ep, then
  FSDP2-sharded over the (dp_shard x cp) / ep ranks left, replicated over dp_replicate
  (`apply_layout`).
- FSDP2 (`apply_fsdp2`): one unit per block (+ one per block's experts under EP), the root
  (embeddings, final norm, LM head, MTP frame) last. Each parameter is chunked on dim 0 like
  `torch.chunk`: the first ranks hold ceil(rows / n); the plan reports that largest rank.

Memory (the trainer, train/trainer.py): fp32 master weights, fp32 gradients, AdamW exp_avg and
exp_avg_sq in fp32 plus a 0-d fp32 `step` per parameter tensor; parameters are counted on the
model built on the meta device (exact, tied weights once). In fp32 FSDP2 gathers and
reduce-scatters fp32; in reduced precision (`train.precision: bf16`, which the fp8 / nvfp4 rows
assume as their base) the trainer gives `apply_fsdp2` a bf16 `param_dtype`: the units are
gathered in bf16 (half the all-gather bytes and the gathered units' memory; the routers' fp32
units are neglected), gradients are still reduced in fp32, and no bf16 cast copies of the
weights outlive a GEMM (FSDP2 frees and regathers the unsharded parameters the backward reads).

Activations: the tensors the reference kernels of this repository keep for the backward (the
pure-torch SSD chunked scan, SDPA, the dropless grouped expert GEMMs with balanced routing), term
by term per mixer and calibrated against `LiveBytes` on fp32 forwards (tests/test_plan.py:
within 20%, one process and TP / CP / EP at world 2). Per-format bytes of a tensor a GEMM keeps
for its backward:
- fp32: 4; bf16 (torch.autocast): 2, one cast copy per consuming GEMM (autocast does not cache
  activation casts), the residual stream stays fp32 (fp32 embeddings + bf16 branches);
- fp8: MXFP8, 1 byte + one E8M0 scale per 32 elements = 1.03125 B (LM head in bf16);
- nvfp4: E2M1 + one E4M3 scale per 16 elements = 0.5625 B, with the Nemotron 3 Super §2.2
  policy (notes §2.2): BF16 for attention QKV / out, the latent projections, MTP layers, the LM
  head and the last ~15% of layers (14 of 88 in the released recipe); MXFP8 for Mamba out_proj.
  Other saved tensors (GEMM outputs, activations) stay bf16 under fp8 / nvfp4 (Transformer
  Engine outputs bf16). The fused LM-head + CE (ops/cross_entropy.py) never holds the [T, V]
  logits, but each call keeps its dW in fp32, [V, D] (/ t), for the backward: one per CE call
  (1 + MTP depth).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ...config import ModelConfig

PRECISIONS = ("fp32", "bf16", "fp8", "nvfp4")
AC_MODES = ("none", "selective", "full")
KERNELS = ("reference", "fused")  # the Mamba-2 mixer's chains: pure torch, or ops.fused (CUDA)
_GATHER_BYTES = {"fp32": 4, "bf16": 2}
GiB = float(2**30)

# bytes per element of a quantised GEMM input kept for the backward (module docstring)
FORMAT_BYTES = {"fp32": 4.0, "bf16": 2.0, "mxfp8": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
NVFP4_BF16_TAIL = 0.15  # the last ~15% of layers stay BF16 (Nemotron 3 Super §2.2, notes §2.2)

# Linear layers by TP style: column-parallel shard the output (dim 0), row-parallel the input
_COLUMN = {"q_proj", "k_proj", "v_proj", "in_proj", "up_proj", "gate_proj", "fc1_latent_proj"}
_COLUMN |= {"eh_proj", "lm_head"}
_ROW = {"o_proj", "out_proj", "down_proj", "fc2_latent_proj"}
# the GEMM family of a Linear (the format policy); up / gate / down: "mlp" or "shared"
_GEMM_OF = dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), "attn")
_GEMM_OF |= {"in_proj": "mamba_in", "out_proj": "mamba_out", "eh_proj": "mtp", "lm_head": "head"}
_GEMM_OF |= {"fc1_latent_proj": "latent", "fc2_latent_proj": "latent"}
# Linear layers tensor parallelism keeps whole (train/distributed/tensor_parallel.py)
_TP_REPLICATED = {"fc1_latent_proj", "fc2_latent_proj", "eh_proj"}


# ---------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class PlanLayout:
    """The resolved sizes: world = dp_replicate x dp_shard x cp x tp."""

    gpus: int
    tp: int
    cp: int
    ep: int
    dp_replicate: int
    dp_shard: int

    @property
    def fsdp(self) -> int:
        """Ranks one dense parameter is FSDP-sharded over (dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def style(self) -> str:
        """ "none" (no data parallelism), "ddp" (whole replicas) or "fsdp" (as Layout.style)."""
        if self.dp_replicate * self.fsdp == 1:
            return "none"
        return "ddp" if self.fsdp == 1 else "fsdp"

    def describe(self) -> str:
        return (
            f"tp {self.tp} x cp {self.cp} x dp_shard {self.dp_shard} x dp_replicate "
            f"{self.dp_replicate} = {self.gpus} GPUs; ep {self.ep} (from dp_shard)"
        )


def resolve_plan_layout(
    cfg: ModelConfig, *, gpus: int, tp: int, ep: int, cp: int, dp_replicate: int, seq: int
) -> PlanLayout:
    """Check a layout against the model (one-line ValueErrors naming the setting) and fill
    dp_shard = gpus / (dp_replicate x cp x tp); `dp_replicate=-1`: whole replicas on what the
    world leaves (dp_shard 1, `ParallelConfig`'s -1)."""
    sizes = {"gpus": gpus, "tp": tp, "ep": ep, "cp": cp, "dp_replicate": dp_replicate}
    for name, size in sizes.items():
        bad = isinstance(size, bool) or not isinstance(size, int)
        if bad or not (size >= 1 or (name == "dp_replicate" and size == -1)):
            raise ValueError(f"{name} must be a positive whole number, got {size!r}")
    if dp_replicate == -1:
        if gpus % (cp * tp):
            raise ValueError(f"gpus={gpus} is not a multiple of cp x tp = {cp} x {tp}")
        dp_replicate = gpus // (cp * tp)
    fixed = dp_replicate * cp * tp
    if gpus % fixed:
        raise ValueError(
            f"gpus={gpus} is not a multiple of dp_replicate x cp x tp = {dp_replicate} x {cp} x "
            f"{tp} = {fixed}; dp_shard takes what is left and must be whole"
        )
    dp_shard = gpus // fixed
    letters = set(cfg.pattern) | set(cfg.mtp.pattern)
    if ep > 1:
        if "E" not in letters:
            raise ValueError(f"ep={ep} but the model has no MoE layer to split")
        if cfg.moe.num_experts % ep:
            raise ValueError(f"ep={ep} must divide the model's {cfg.moe.num_experts} experts")
        if dp_shard % ep:
            raise ValueError(
                f"ep={ep} must divide dp_shard={dp_shard}: expert parallelism borrows its ranks "
                "from the data-parallel shard group"
            )
    if seq < 1 or seq % cp:
        raise ValueError(f"seq={seq} must be a positive multiple of cp={cp}")
    if seq > cfg.max_seq_len:
        raise ValueError(f"seq={seq} exceeds the model's max_seq_len={cfg.max_seq_len}")
    if tp > 1:
        checks = [("vocab_size", cfg.vocab_size), ("d_model", cfg.d_model)]
        if "*" in letters:
            checks.append(("attention.num_heads", cfg.attention.num_heads))
            kv = cfg.attention.num_kv_heads
            if kv % tp and tp % kv:
                raise ValueError(
                    f"tp={tp} and attention.num_kv_heads={kv}: one must divide the other "
                    "(kv heads are split, or replicated when tp exceeds them)"
                )
        if "M" in letters:
            checks += [("mamba.num_heads", cfg.mamba.num_heads)]
            checks += [("mamba.n_groups", cfg.mamba.n_groups)]
        if "-" in letters:
            checks.append(("mlp.hidden", cfg.mlp.hidden))
        if "E" in letters:
            checks.append(("moe.expert_hidden", cfg.moe.expert_hidden))
            if cfg.moe.shared_expert_hidden:
                checks.append(("moe.shared_expert_hidden", cfg.moe.shared_expert_hidden))
            if cfg.moe.latent_size:
                checks.append(("moe.latent_size", cfg.moe.latent_size))
        for name, value in checks:
            if value % tp:
                raise ValueError(
                    f"tp={tp} must divide {name}={value} (tensor parallelism splits it; pad "
                    "vocab_size to a multiple of tp, as Megatron does)"
                    if name == "vocab_size"
                    else f"tp={tp} must divide {name}={value} (tensor parallelism splits it)"
                )
    return PlanLayout(gpus, tp, cp, ep, dp_replicate, dp_shard)


# ---------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class ParamShard:
    """One parameter tensor and how it is split: `role` expert / tp (TP-shardable) /
    replicated, `full` its elements in its FSDP unit once gathered (after TP and EP), `local`
    the elements the largest FSDP rank holds; `gemm` the GEMM family that reads it ("" for
    none), `layer` its block (MTP blocks after the backbone's, -1 outside blocks)."""

    name: str
    shape: tuple[int, ...]
    role: str
    unit: str
    full: int
    local: int
    gemm: str = ""
    layer: int = -1


def _kv_tp(cfg: ModelConfig, tp: int) -> int:
    """Ranks the kv heads split over: tp, or the kv heads when tp exceeds them (replicated)."""
    return min(tp, cfg.attention.num_kv_heads)


def meta_model(cfg: ModelConfig) -> Any:
    """`HybridLM(cfg)` on the meta device: every parameter's shape, no memory (120B in ~1 s)."""
    import torch

    from ...model.model import HybridLM

    with torch.device("meta"):
        return HybridLM(cfg)


def parameter_shards(cfg: ModelConfig, lay: PlanLayout, model: Any = None) -> list[ParamShard]:
    """Every parameter of `HybridLM(cfg)` (`model`: its meta-device build, made when not
    given; tied weights once) with its per-device elements under `lay`."""
    from torch import nn

    from ...model.mamba2 import Mamba2Mixer
    from ...model.moe import Experts, TopKRouter
    from ...model.norm import GatedRMSNorm, RMSNorm

    model = meta_model(cfg) if model is None else model
    kv = _kv_tp(cfg, lay.tp)
    seen: set[int] = set()
    out = []
    for mod_name, mod in model.named_modules():
        leaf = mod_name.rsplit(".", 1)[-1]
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{pname}" if mod_name else pname
            tp_dim, factor, role, gemm = 0, lay.tp, "tp", ""
            if isinstance(mod, Experts):  # split by ep, or by expert over tp when ep = 1
                factor, role, gemm = (lay.tp if lay.ep == 1 else 1), "expert", "expert"
            elif isinstance(mod, nn.Embedding):
                gemm = "head" if cfg.tie_embeddings else ""
            elif isinstance(mod, nn.Conv1d):
                pass
            elif isinstance(mod, nn.Linear) and leaf in _COLUMN | _ROW:
                tp_dim = 0 if leaf in _COLUMN else 1
                factor = kv if leaf in ("k_proj", "v_proj") else lay.tp
                gemm = _GEMM_OF.get(leaf) or ("shared" if "shared_experts" in mod_name else "mlp")
                if leaf in _TP_REPLICATED:
                    role, factor = "replicated", 1
            elif isinstance(mod, (Mamba2Mixer, GatedRMSNorm)):  # per head / inner channel
                pass
            elif isinstance(mod, RMSNorm) and leaf in ("q_norm", "k_norm"):
                factor = kv if leaf == "k_norm" else lay.tp
            elif isinstance(mod, (RMSNorm, TopKRouter)):
                role, factor = "replicated", 1
                gemm = "router" if isinstance(mod, TopKRouter) else ""
            else:
                raise AssertionError(f"plan: no sharding rule for parameter {name}")
            shape = list(p.shape)
            assert shape[tp_dim] % factor == 0, (name, shape, factor)
            shape[tp_dim] //= factor
            parts = name.split(".")
            unit, layer = "root", -1
            if parts[0] == "layers":
                unit, layer = ".".join(parts[:2]), int(parts[1])
            elif parts[:2] == ["mtp", "layers"]:
                unit, layer = ".".join(parts[:3]), len(cfg.pattern) + int(parts[2])
            elif parts[0] == "mtp_depths" and parts[2] == "layers":  # per-depth heads
                unit, layer = ".".join(parts[:4]), len(cfg.pattern) + int(parts[3])
            n = lay.fsdp if lay.style == "fsdp" else 1
            if role == "expert" and lay.ep > 1:
                shape[0] //= lay.ep
                unit += ".experts"
                n //= lay.ep
            full = math.prod(shape)
            local = -(-shape[0] // n) * math.prod(shape[1:])  # torch.chunk's first chunk
            out.append(ParamShard(name, tuple(p.shape), role, unit, full, local, gemm, layer))
    return out


def weight_copy_bytes(
    cfg: ModelConfig, shards: list[ParamShard], precision: str, *, saved_only: bool = False
) -> int:
    """Bytes of the compute copies of the weights GEMMs read (TP / EP-local, whole): under
    bf16 autocast a cast of each weight, alive until the autocast region ends (its cache) and
    kept for the backward by the GEMM; under fp8 / nvfp4 Transformer Engine's quantised weights
    (the Nemotron 3 Super §2.2 policy as for activations); none in fp32. `saved_only`: those
    the backward keeps without checkpointing (all but the LM head's: the fused CE keeps dW)."""
    if precision == "fp32":
        return 0
    n = len(cfg.pattern)
    tail = math.ceil(NVFP4_BF16_TAIL * n) if precision == "nvfp4" else 0
    total = 0.0
    for s in shards:
        if not s.gemm or (saved_only and s.gemm == "head"):
            continue
        fmt = _gemm_format(s.gemm, precision, s.layer >= n - tail if s.layer >= 0 else False)
        total += FORMAT_BYTES[fmt] * s.full
    return int(total)


def buffer_elements(model: Any) -> int:
    """Elements of a model's buffers (router bias, expert-load counters, RoPE frequencies):
    replicated on every device, fp32."""
    return sum(b.numel() for b in model.buffers())


# ---------------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class _Term:
    """A tensor kept for the backward: `n` elements per token (`per` "token"), per sequence
    ("seq"), per layer call ("layer") or per micro-batch ("batch"); its dtype family `kind`:
    res (fp32 residual / norm), mres (the MTP residual: bf16 under autocast), f32 (computed in
    fp32), f32copy (an fp32 copy that exists only under reduced precision), mm (GEMM outputs and
    operands: the compute dtype), lin (kept by a Linear for its weight gradient; see
    `_lin_bytes`), only32 (kept in fp32 runs only: under reduced precision its readers keep
    copies instead), i64, bool; `tp`: its divisor under tensor parallelism."""

    what: str
    n: float
    kind: str
    per: str = "token"  # or "global": per token of the whole sequence (K/V gathered over CP)
    tp: int = 1
    gemm: str = ""  # lin: the GEMM family (format policy)
    producer: str = "f32"  # lin: dtype family of the tensor the GEMM reads
    alias: bool = False  # lin: in fp32 the GEMM keeps a tensor another term counts


def _lin(
    what: str, n: float, gemm: str, *, producer: str = "f32", alias: bool = False, tp: int = 1
) -> _Term:
    return _Term(what, n, "lin", tp=tp, gemm=gemm, producer=producer, alias=alias)


def _gemm_format(gemm: str, precision: str, bf16_block: bool) -> str:
    if precision in ("fp32", "bf16"):
        return precision
    if gemm in ("head", "router"):
        return "bf16"
    if precision == "fp8":
        return "mxfp8"
    if bf16_block or gemm in ("attn", "latent", "mtp"):
        return "bf16"  # Nemotron 3 Super §2.2: kept in BF16
    return "mxfp8" if gemm == "mamba_out" else "nvfp4"


def _lin_bytes(t: _Term, precision: str, bf16_block: bool) -> float:
    """Bytes per element a GEMM keeps of its input: fp32 shares the tensor (0 when another
    term counts it); bf16 keeps a cast copy of an fp32 tensor, the tensor itself when it is
    bf16 already; fp8 / nvfp4 keep their quantised copy."""
    fmt = _gemm_format(t.gemm, precision, bf16_block)
    if fmt == "fp32":
        return 0.0 if t.alias else 4.0
    if fmt == "bf16":
        if t.producer == "mm":
            return 0.0 if t.alias else 2.0
        return 2.0
    return FORMAT_BYTES[fmt]


def _bytes(t: _Term, precision: str, bf16_block: bool = False) -> float:
    """Bytes per element of a term (its `kind`, `_Term`) under `precision`."""
    if t.kind == "lin":
        return _lin_bytes(t, precision, bf16_block)
    low = precision != "fp32"
    sizes = {"res": 4.0, "f32": 4.0, "i64": 8.0, "bool": 1.0}
    sizes |= {"mres": 2.0 if low else 4.0, "mm": 2.0 if low else 4.0}
    sizes["f32copy"] = 4.0 if low else 0.0
    sizes["only32"] = 0.0 if low else 4.0
    return sizes[t.kind]


def _first_gemms(cfg: ModelConfig, letter: str) -> list[str]:
    """The GEMMs that read a block's mixer input, in order (each keeps its own copy under
    reduced precision)."""
    if letter == "M":
        return ["mamba_in"]
    if letter == "*":
        return ["attn"] * 3
    if letter == "-":
        return ["mlp"] * (2 if cfg.mlp.activation == "swiglu" else 1)
    e = cfg.moe
    gemms = ["router"] + (["latent"] if e.latent_size else [])
    return gemms + (["shared"] if e.shared_expert_hidden else [])


def _frame(cfg: ModelConfig, letter: str, mode: str, mtp: bool) -> list[_Term]:
    """The residual-block frame: its output (the next block's input), and with mode none the
    norm's tensors and the copies the mixer's first GEMMs keep of their input."""
    D, pre = cfg.d_model, cfg.norm_placement == "pre"
    # post-norm under reduced precision: the next block's GEMMs keep bf16 copies of the output
    kind = "mres" if mtp else ("res" if pre or mode != "none" else "only32")
    out = [_Term("block output", D, kind)]
    if mode != "none":
        return out
    out += [_Term("norm rstd", 1, "res"), _Term("norm x_hat", D, "res")]
    if mtp and pre:
        out.append(_Term("norm input in fp32", D, "f32copy"))  # the MTP residual is bf16
    if not pre:  # post-norm: the norm reads the mixer output
        out.append(_Term("norm input (mixer output)", D, "f32"))
    for i, gemm in enumerate(_first_gemms(cfg, letter)):
        # pre-norm: the norm output (one fp32 tensor); post-norm: the block input itself
        out.append(_lin("mixer input", D, gemm, alias=i > 0 or not pre))
    return out


def _mamba(cfg: ModelConfig, mode: str, t: int, kernels: str = "reference") -> list[_Term]:
    m = cfg.mamba
    I, G, N, H, P, X, Q = (
        m.d_inner,
        m.n_groups,
        m.state_size,
        m.num_heads,
        m.head_dim,
        m.conv_dim,
        m.chunk_size,
    )
    in_w = 2 * I + 2 * G * N + H
    if mode == "full":
        return []
    if kernels == "fused":
        return _mamba_fused(cfg, mode, t, in_w)
    if mode == "selective":  # the matrix products' outputs (activation_checkpointing._SAVE)
        return [
            _Term("in_proj output", in_w, "mm", tp=t),
            _Term("SSD C.B^T", G * Q, "mm", tp=t),
            _Term("SSD diagonal and off-diagonal outputs", 2 * I, "mm", tp=t),
            _Term("SSD chunk states", H * P * N / Q, "mm", tp=t),
            _Term("out_proj output", cfg.d_model, "mm"),
        ]
    return [
        _Term("in_proj output (z, xBC and dt are read in fp32)", in_w, "only32", tp=t),
        _Term("conv input, output, silu", 3 * X, "f32", tp=t),
        _Term("conv left padding", (m.conv_kernel - 1) * X, "f32", per="seq", tp=t),
        _Term("dt (raw + bias, softplus, clamped)", 3 * H, "f32", tp=t),
        _Term("x * dt", I, "f32", tp=t),
        _Term("SSD decay exp(segsum) [Q x Q per chunk]", H * Q, "f32", tp=t),
        _Term("SSD C.B^T", G * Q, "mm", tp=t),
        _Term("SSD (C.B^T) * decay", H * Q, "mm", tp=t),
        _Term("SSD B, C operands", 4 * G * N, "mm", tp=t),
        _Term("SSD x*dt operands", 2 * I, "mm", tp=t),
        _Term("SSD off-diagonal output", I, "mm", tp=t),
        _Term("SSD decays to / from chunk ends", 2 * H + H / Q, "f32", tp=t),
        _Term("SSD chunk states", H * P * N / Q, "f32", tp=t),
        _Term("SSD chunk states (operand)", H * P * N / Q, "mm", tp=t),
        _Term("y + D x", I, "f32", tp=t),
        _Term("gated norm: silu(z), x silu(z), normalised, rstd", 3 * I + G, "f32", tp=t),
        _Term("gated norm: z in fp32", I, "f32copy", tp=t),
        _lin("out_proj input", I, "mamba_out", tp=t),
        _Term("SSD causal mask", Q * Q, "bool", per="layer"),
    ]


def _mamba_fused(cfg: ModelConfig, mode: str, t: int, in_w: int) -> list[_Term]:
    """The mixer on the Triton kernels (`ops.fused`): each keeps its inputs only; the scan's
    [Q, Q] decays, chunk states and operands are recomputed in its backward. Selective
    checkpointing keeps the aten matrix products only, so the kernels (not aten ops) are
    recomputed there."""
    m = cfg.mamba
    I, G, H, X = m.d_inner, m.n_groups, m.num_heads, m.conv_dim
    if mode == "selective":
        return [
            _Term("in_proj output", in_w, "mm", tp=t),
            _Term("out_proj output", cfg.d_model, "mm"),
        ]
    return [
        _Term("conv input, padded (kept by the fused conv + SiLU)", X, "mm", tp=t),
        _Term("conv left padding", (m.conv_kernel - 1) * X, "mm", per="seq", tp=t),
        _Term("conv output (the scan's x, B, C)", X, "f32", tp=t),
        _Term("dt (raw + bias, softplus, clamped)", 3 * H, "f32", tp=t),
        _Term("scan output + D x (the gated norm's input)", I, "f32", tp=t),
        _Term("gated norm: z (contiguous), rstd", I, "mm", tp=t),
        _Term("gated norm: rstd", G, "f32", tp=t),
        _lin("out_proj input", I, "mamba_out", tp=t),
    ]


def _attention(
    cfg: ModelConfig, mode: str, t: int, kv: int, sliding: bool, L: int, seq: int
) -> list[_Term]:
    """`L` this rank's part of the `seq` tokens (context parallelism gathers K/V of all)."""
    a = cfg.attention
    HE, KE = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    if mode == "full":
        return []
    if mode == "selective":
        return [
            _Term("q, k, v projections", HE / t + 2 * KE / kv, "mm"),
            _Term("attention output", HE, "mm", tp=t),
            _Term("attention logsumexp", a.num_heads, "f32", tp=t),
            _Term("o_proj output", cfg.d_model, "mm"),
        ]
    terms = [
        _Term("q", HE, "mm", tp=t),
        _Term("k, v (whole sequence, repeated to the query heads)", 2 * HE, "mm", "global", t),
        _Term("attention output", HE, "mm", tp=t),
        _Term("attention logsumexp", a.num_heads, "f32", tp=t),
        _lin("o_proj input (a view of the output)", HE, "attn", producer="mm", alias=True, tp=t),
    ]
    if a.qk_norm:
        terms += [
            _Term("q_norm input, x_hat", 2 * HE, "f32", tp=t),
            _Term("k_norm input, x_hat", 2 * KE, "f32", tp=kv),
            _Term("q_norm / k_norm rstd", 2, "f32"),
        ]
    if a.rope_theta is not None:
        terms.append(_Term("RoPE cos, sin", 2 * L * a.head_dim, "f32", per="layer"))
    if sliding or L < seq:  # SDPA turns a boolean mask (window, CP offset) into an additive one
        terms.append(_Term("attention mask [L, seq]", L * seq, "mm", per="layer"))
    return terms


def _moe(
    cfg: ModelConfig, mode: str, t: int, te: int, kernels: str = "reference", quantised=False
) -> list[_Term]:
    """`t`: tensor-parallel ranks (the shared expert); `te`: the ranks the routed experts'
    rows are split over by tensor parallelism (t when ep = 1, else 1). `kernels` "fused": the
    Triton experts (`ops.fused.experts`), unless `quantised` (fp8 / nvfp4 GEMMs replace them)."""
    e, D = cfg.moe, cfg.d_model
    W, F, S, k, E = (
        e.latent_size or D,
        e.expert_hidden,
        e.shared_expert_hidden,
        e.top_k,
        (e.num_experts),
    )
    latent = bool(e.latent_size)
    if mode == "full":
        return []
    fused = kernels == "fused" and not quantised
    if mode == "selective":
        terms = [_Term("router logits", E, "mm")]
        if not fused:  # the Triton experts are not aten ops: recomputed in the backward
            terms += [
                _Term("expert up outputs", k * F, "mm", tp=te),
                _Term("expert down outputs", k * W, "mm", tp=te),
            ]
        if latent:
            terms += [_Term("fc1_latent output", W, "mm")]
            terms += [_Term("fc2_latent output", D, "mm")]
        if S:
            terms += [_Term("shared expert up output", S, "mm", tp=t)]
            terms += [_Term("shared expert down output", D, "mm")]
        return terms
    terms = [
        _Term("router scores, gates, gate sum", E + k + 1, "mm"),
        _Term("routing indices (top-k, sort order, token of each row)", 3 * k, "i64"),
    ]
    if fused:  # the kernels keep their input rows and relu's output; relu^2 is recomputed
        terms += [
            _Term("expert input rows (kept by the fused experts)", k * W, "mm" if latent else "f32",
                  tp=te),
            _Term("expert hidden relu (squared on the fly)", k * F, "mm", tp=te),
        ]  # fmt: skip
    else:
        terms += [
            _lin("expert input rows", k * W, "expert", producer="mm" if latent else "f32", tp=te),
            _Term("expert hidden relu", k * F, "mm", tp=te),
            _lin("expert hidden relu^2", k * F, "expert", producer="mm", tp=te),
        ]
    terms.append(_Term("expert output rows, gated rows, row gates", 2 * k * W + k, "mm"))
    if latent:
        terms.append(_lin("combined rows (fc2_latent input)", W, "latent", producer="mm"))
    if S:
        terms.append(_Term("shared expert relu", S, "mm", tp=t))
        terms.append(_lin("shared expert relu^2", S, "shared", producer="mm", tp=t))
    return terms


def _mlp(cfg: ModelConfig, mode: str, t: int) -> list[_Term]:
    F, swiglu = cfg.mlp.hidden, cfg.mlp.activation == "swiglu"
    if mode == "full":
        return []
    if mode == "selective":
        return [
            _Term("up (and gate) outputs", (2 if swiglu else 1) * F, "mm", tp=t),
            _Term("down output", cfg.d_model, "mm"),
        ]
    if swiglu:
        return [
            _Term("gate output, silu, up output", 3 * F, "mm", tp=t),
            _lin("silu(gate) * up", F, "mlp", producer="mm", tp=t),
        ]
    return [
        _Term("relu", F, "mm", tp=t),
        _lin("relu^2", F, "mlp", producer="mm", tp=t),
    ]


def _block_terms(
    cfg: ModelConfig,
    letter: str,
    mode: str,
    *,
    mtp: bool,
    sliding: bool,
    t: int,
    L: int,
    seq: int,
    te: int = 1,
    kernels: str = "reference",
    quantised: bool = False,
) -> list[_Term]:
    kv = _kv_tp(cfg, t)
    mixer = {
        "M": lambda: _mamba(cfg, mode, t, kernels),
        "*": lambda: _attention(cfg, mode, t, kv, sliding, L, seq),
        "E": lambda: _moe(cfg, mode, t, te, kernels, quantised),
        "-": lambda: _mlp(cfg, mode, t),
    }[letter]()
    return _frame(cfg, letter, mode, mtp) + mixer


def _bytes_of(terms: list[_Term], precision: str, bf16: bool, T: int, B: int, cp: int = 1) -> float:
    per = {"token": T, "global": T * cp, "seq": B, "layer": 1, "batch": 1}
    return sum(t.n / t.tp * per[t.per] * _bytes(t, precision, bf16) for t in terms)


@dataclass(frozen=True)
class Activations:
    """Saved-activation bytes of one micro-batch on one device: `total`, by part, and the
    transient of recomputing one block in the backward (checkpointing; the largest block)."""

    total: int
    parts: dict[str, int]
    recompute: int


def activation_bytes(
    cfg: ModelConfig,
    *,
    micro_batch: int,
    seq: int,
    mode: str,
    precision: str = "bf16",
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    mtp_depth: int | None = None,
    kernels: str = "reference",
) -> Activations:
    """Bytes the training forward (model + `causal_lm_loss` with the fused LM-head CE, MTP
    depths 1..mtp_depth, the MoE balancing term) leaves for the backward on one device.
    `kernels`: the Mamba-2 mixer's pure-torch chains ("reference", the CPU path) or the Triton
    kernels of `ops.fused` ("fused", the CUDA path)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {list(KERNELS)}, got {kernels!r}")
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing must be one of {list(AC_MODES)}, got {mode!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    depth = (cfg.mtp.depth if cfg.mtp.pattern else 0) if mtp_depth is None else mtp_depth
    L, B, D, V = seq // cp, micro_batch, cfg.d_model, cfg.vocab_size
    T = B * L
    n_layers = len(cfg.pattern)
    tail = math.ceil(NVFP4_BF16_TAIL * n_layers) if precision == "nvfp4" else 0
    sliding = iter(cfg.attention_is_sliding())
    parts: dict[str, float] = {}
    recompute = 0.0

    def add(key: str, value: float) -> None:
        parts[key] = parts.get(key, 0.0) + value

    def blocks(pattern: str, *, mtp: bool, first: int = 0) -> None:
        nonlocal recompute
        for i, letter in enumerate(pattern):
            slide = (not mtp) and letter == "*" and next(sliding)
            bf16 = mtp or first + i >= n_layers - tail
            kw = dict(
                mtp=mtp, sliding=slide, t=tp, L=L, seq=seq, te=tp if ep == 1 else 1,
                kernels=kernels, quantised=precision in ("fp8", "nvfp4") and not bf16,
            )  # fmt: skip
            kept = _bytes_of(_block_terms(cfg, letter, mode, **kw), precision, bf16, T, B, cp)
            name = ("MTP blocks" if mtp else "blocks") + f" {letter}"
            add(name, kept)
            if mode != "none":
                whole = _block_terms(cfg, letter, "none", **kw)
                whole_bytes = _bytes_of(whole, precision, bf16, T, B, cp)
                recompute = max(recompute, whole_bytes - kept)

    post = cfg.norm_placement == "post" and mode == "none"
    frame = [
        _Term("embedding output", D, "res"),
        _Term("final norm input (post-norm, reduced precision)", D if post else 0, "f32copy"),
        _Term("final norm rstd, x_hat", D + 1, "res"),
        _Term("final hidden states", D, "res"),
        _Term("fused CE: d(loss)/d(hidden)", D, "res"),
    ]
    add("embeddings, final norm, fused CE", _bytes_of(frame, precision, False, T, B))
    blocks(cfg.pattern, mtp=False)
    dw = _Term("fused CE: dW of the LM head (fp32)", V * D, "f32", per="batch", tp=tp)
    add("fused CE dW buffers (fp32, one per CE call)", _bytes_of([dw], precision, False, T, B))
    for _ in range(depth):
        mtp_frame = [
            _Term("shifted ids (whole rows under CP)", 1, "i64", "global"),
            _Term("embedding output", D, "res"),
            _Term("enorm / hnorm rstd, x_hat", 2 * D + 2, "res"),
            _lin("concat [enorm(emb); hnorm(h)]", 2 * D, "mtp"),
            _Term("eh_proj output", D, "mres"),
            _Term("final_layernorm input in fp32", D, "f32copy"),
            _Term("final_layernorm rstd, x_hat", D + 1, "res"),
            _Term("MTP hidden states", D, "mres"),
            _Term("fused CE: d(loss)/d(hidden)", D, "mres"),
        ]
        add("MTP frame (per depth)", _bytes_of(mtp_frame, precision, True, T, B))
        add("fused CE dW buffers (fp32, one per CE call)", _bytes_of([dw], precision, True, T, B))
        blocks(cfg.mtp.pattern, mtp=True, first=n_layers)
    total = sum(parts.values())
    return Activations(int(total), {k: int(v) for k, v in parts.items()}, int(recompute))


# ---------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Plan:
    """Per-device memory (bytes; the largest rank) and per-step communication (bytes one
    device sends, ring algorithms, one micro-batch per step) of a training layout. `status`
    says per line whether tests measure it or it is modelled only (module docstring)."""

    model: str
    layout: PlanLayout
    seq: int
    micro_batch: int
    precision: str
    activation_checkpointing: str
    mtp_depth: int
    params_total: int  # every parameter tensor once (MTP included)
    params_by_role: dict[str, int]  # expert / tp / replicated
    param_tensors: int
    parameters: int
    gradients: int
    optimizer: int
    buffers: int
    weight_copies: int  # compute copies of the GEMM weights (bf16 casts / TE quantised)
    fsdp_root_unit: int  # gathered root (embeddings, LM head, norms, MTP frame), gather dtype
    fsdp_block_unit: int  # the largest block (+ its local experts), fp32 (its gradients)
    ddp_buckets: int  # DDP's gradient buckets (a copy of the gradients) when style is ddp
    activations: dict[str, int]  # by checkpointing mode
    activation_parts: dict[str, int]  # of the chosen mode
    recompute: int  # the chosen mode's transient of one block's recomputation
    comm: dict[str, int]
    status: dict[str, str] = field(default_factory=dict)
    kernels: str = "reference"  # the Mamba-2 chains the activations assume (KERNELS)
    gather_dtype: str = "fp32"  # FSDP2's all-gather dtype (bf16 under reduced precision)

    @property
    def memory(self) -> dict[str, int]:
        """Per-device bytes by category; their sum (`total_memory`) is a conservative peak:
        the gathered FSDP units are the root (kept from its forward to its backward by FSDP2),
        the current and the prefetched block, and one block's unsharded gradients."""
        ac = self.activation_checkpointing
        return {
            "parameters (fp32 master)": self.parameters,
            "gradients (fp32)": self.gradients,
            "optimizer state (AdamW m, v fp32 + step)": self.optimizer,
            "buffers (router bias, expert load, RoPE)": self.buffers,
            f"weights' compute copies ({self.precision} casts)": self.weight_copies,
            f"FSDP root unit gathered ({self.gather_dtype}, whole step)": self.fsdp_root_unit,
            f"FSDP block units (2 {self.gather_dtype} + 1 fp32 grad)": (
                self.fsdp_block_unit * (2 * _GATHER_BYTES[self.gather_dtype] // 4 + 1)
            ),
            "DDP gradient buckets": self.ddp_buckets,
            f"activations (checkpointing {ac})": self.activations[ac],
            "recomputation of one block (backward)": self.recompute,
        }

    @property
    def total_memory(self) -> int:
        return sum(self.memory.values())

    @property
    def total_comm(self) -> int:
        return sum(self.comm.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layout"]["style"] = self.layout.style
        d["memory"], d["total_memory"] = self.memory, self.total_memory
        d["total_comm"] = self.total_comm
        return d

    def render(self) -> str:
        """A readable table: a line per category (human units), totals, and per line whether
        tests measure it or it is modelled only."""
        lay, T = self.layout, self.micro_batch * self.seq // self.layout.cp
        roles, w = self.params_by_role, 46

        def row(key: str, value: float, status: str = "", indent: int = 2) -> str:
            text = f"{' ' * indent}{key:<{w + 2 - indent}} {_human(value):>11}  {status}"
            return text.rstrip()

        lines = [
            f"plan: {self.model}",
            f"  layout  {lay.describe()} [{lay.style}]",
            f"  batch   micro-batch {self.micro_batch} x seq {self.seq} = {T:,} tokens per device;"
            f" {self.precision}; checkpointing {self.activation_checkpointing};"
            f" MTP depth {self.mtp_depth}; Mamba-2 kernels {self.kernels}",
            f"  params  {_count(self.params_total)} ({self.params_total:,}; {self.param_tensors}"
            f" tensors): routed experts {_count(roles['expert'])}, TP-shardable"
            f" {_count(roles['tp'])}, replicated {_count(roles['replicated'])}",
            "",
            f"  {'memory per device':<{w}} {'':>11}  status",
        ]
        for key, value in self.memory.items():
            if value or "activations" in key:
                status = self.status.get(key.split(" (")[0].split(":")[0], "")
                lines.append(row(key, value, status))
        lines.append(row("total", self.total_memory))
        others = ", ".join(
            f"{m} {_human(v)}"
            for m, v in self.activations.items()
            if m != self.activation_checkpointing
        )
        lines += [f"    (activations with {others})", "", "  activations by part"]
        lines += [row(key, value, indent=4) for key, value in self.activation_parts.items()]
        lines += ["", f"  {'communication per step per device (sent)':<{w}} {'':>11}  status"]
        lines += [row(key, value, self.status.get(key, "")) for key, value in self.comm.items()]
        lines.append(row("total", self.total_comm))
        lines += [
            "",
            "  tested: parameter / gradient / optimizer bytes (exact; FSDP2, EP, TP on gloo),",
            "    activations (LiveBytes; fp32 and CPU bf16 autocast, within 20%; TP, CP and EP",
            "    at world 2 in fp32), TP / CP / EP traffic (collectives counted, fp32, 5%);",
            "  modelled only: TP and CP activations and traffic in bf16, fp8 / nvfp4 bytes,",
            "    FSDP / DDP volumes (ring algorithms), routing balanced at scale.",
        ]
        return "\n".join(lines)


def _human(n: float) -> str:
    """Bytes in binary units (GiB for anything large)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def plan(
    model_cfg: ModelConfig,
    *,
    gpus: int,
    tp: int = 1,
    ep: int = 1,
    cp: int = 1,
    dp_replicate: int = 1,
    seq: int,
    micro_batch: int,
    precision: str = "bf16",
    activation_checkpointing: str = "none",
    mtp: bool = True,
    name: str = "",
    kernels: str = "reference",
) -> Plan:
    """Memory per device and communication per step of training `model_cfg` on `gpus` devices
    (module docstring: layout, sharding and per-format assumptions). `mtp=False` plans the model
    without its MTP module."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    if activation_checkpointing not in AC_MODES:
        raise ValueError(
            f"activation_checkpointing must be one of {list(AC_MODES)}, "
            f"got {activation_checkpointing!r}"
        )
    for key, value in (("micro_batch", micro_batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive whole number, got {value!r}")
    cfg = copy.deepcopy(model_cfg)
    if not mtp:
        cfg.mtp.pattern = ""
    cfg.validate()
    lay = resolve_plan_layout(
        cfg, gpus=gpus, tp=tp, ep=ep, cp=cp, dp_replicate=dp_replicate, seq=seq
    )
    depth = cfg.mtp.depth if cfg.mtp.pattern else 0
    model = meta_model(cfg)
    shards = parameter_shards(cfg, lay, model)
    local = sum(s.local for s in shards)
    roles = {r: 0 for r in ("expert", "tp", "replicated")}
    for s in shards:
        roles[s.role] += math.prod(s.shape)
    units: dict[str, int] = {}
    for s in shards:
        units[s.unit] = units.get(s.unit, 0) + s.full
    blocks: dict[str, int] = {}
    for unit, n in units.items():
        if unit != "root":
            key = unit.removesuffix(".experts")
            blocks[key] = blocks.get(key, 0) + n
    fsdp = lay.style == "fsdp"
    gather = "fp32" if precision == "fp32" else "bf16"
    acts = {
        mode: activation_bytes(
            cfg,
            micro_batch=micro_batch,
            seq=seq,
            mode=mode,
            precision=precision,
            tp=tp,
            cp=cp,
            ep=ep,
            kernels=kernels,
        )
        for mode in AC_MODES
    }
    chosen = acts[activation_checkpointing]
    comm, status = _communication(
        cfg,
        lay,
        shards,
        units,
        precision=precision,
        mode=activation_checkpointing,
        seq=seq,
        micro_batch=micro_batch,
        depth=depth,
    )
    status.update(_memory_status(lay, precision))
    grads = 4 * local
    return Plan(
        model=name or "model",
        layout=lay,
        seq=seq,
        micro_batch=micro_batch,
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        mtp_depth=depth,
        params_total=sum(math.prod(s.shape) for s in shards),
        params_by_role=roles,
        param_tensors=len(shards),
        parameters=4 * local,
        gradients=grads,
        optimizer=8 * local + 4 * len(shards),
        buffers=4 * buffer_elements(model),
        # bf16 gathers leave no autocast cast copies (module docstring); TE's quantised stay
        weight_copies=0
        if fsdp and precision == "bf16"
        else weight_copy_bytes(cfg, shards, precision),
        fsdp_root_unit=_GATHER_BYTES[gather] * units.get("root", 0) if fsdp else 0,
        fsdp_block_unit=4 * max(blocks.values(), default=0) if fsdp else 0,
        ddp_buckets=grads if lay.style == "ddp" else 0,
        activations={m: a.total for m, a in acts.items()},
        activation_parts=chosen.parts,
        recompute=chosen.recompute,
        comm=comm,
        status=status,
        kernels=kernels,
        gather_dtype=gather,
    )


def plan_inputs(path: str) -> tuple[ModelConfig, dict[str, Any]]:
    """The model of a config file and the `plan` arguments it implies: a run config (`model`,
    `data`, `train`) gives seq (data.seq_len), micro_batch (data.batch_size), precision
    (train.precision, or nvfp4 with train.low_precision), activation_checkpointing and the
    layout's ep / dp_replicate (train.parallel; the plan derives dp_shard from the GPUs, so a
    fixed dp_shard is not carried over); a model config alone gives none."""
    from ...config import read_mapping
    from ..config import RunConfig

    if "model" not in read_mapping(path):
        return ModelConfig.load(path), {}
    run = RunConfig.load(path)
    tc, pc = run.train, run.train.layout()
    precision = "nvfp4" if tc.low_precision == "nvfp4" else tc.precision
    defaults = {
        "seq": run.data.seq_len,
        "micro_batch": run.data.batch_size,
        "precision": precision,
        "activation_checkpointing": tc.activation_checkpointing,
        "ep": pc.ep,
        # dp_shard -1 (FSDP over what is left) is the plan's default; dp_replicate -1 is DDP
        "dp_replicate": pc.dp_replicate if pc.dp_shard in (-1, 1) else 1,
    }
    return run.model_config(), defaults


def _memory_status(lay: PlanLayout, precision: str) -> dict[str, str]:
    """Which memory lines tests measure (tests/test_plan.py) and which are modelled only."""
    copies = "tested (CPU autocast)" if precision == "bf16" else "modelled"
    shards = "tested: exact (FSDP2, EP, TP)" if lay.cp == 1 else "modelled (CP)"
    if lay.tp > 1 or lay.cp > 1:
        copies = "modelled (TP / CP)"
        alone = sum(n > 1 for n in (lay.tp, lay.cp, lay.ep)) == 1  # as tested, world 2
        acts = "tested in fp32: within 20%" if precision == "fp32" and alone else copies
    else:
        acts = {
            "fp32": "tested: within 20% of measured (fp32)",
            "bf16": "tested: within 20% (CPU autocast)",
        }.get(precision, "modelled: tested terms, format bytes")
    derived = "derived from apply_fsdp2's units"
    return {
        "parameters": shards,
        "gradients": shards,
        "optimizer state": shards,
        "buffers": "exact",
        "weights' compute copies": copies,
        "FSDP root unit gathered": derived,
        "FSDP block units": derived,
        "DDP gradient buckets": "modelled",
        "activations": acts,
        "recomputation of one block": "modelled",
    }


def _tp_all_reduces(cfg: ModelConfig, letter: str) -> int:
    """[T, D] all-reduces of one block under tensor parallelism (`tensor_parallel`): the
    forward's output (the row-parallel projection's partial sums) and, in the backward, the
    input gradient of each column-parallel projection reading the block input, one per
    projection (torch's ColwiseParallel: q, k and v each, SwiGLU's gate and up each; Mamba-2's
    packed in_proj once; the MoE shared expert's up; the routed experts: `TP experts`). A block
    recomputed by checkpointing stops before its output projection (`torch.utils.checkpoint`'s
    early stop: nothing after it is kept), so none of these runs again (counted on gloo,
    tests/test_plan.py)."""
    if letter == "*":
        return 1 + 3
    if letter == "M":
        return 1 + 1
    if letter == "-":
        return 1 + (2 if cfg.mlp.activation == "swiglu" else 1)
    return 2 if cfg.moe.shared_expert_hidden else 0  # "E"


def _communication(
    cfg: ModelConfig,
    lay: PlanLayout,
    shards: list[ParamShard],
    units: dict[str, int],
    *,
    precision: str,
    mode: str,
    seq: int,
    micro_batch: int,
    depth: int,
) -> tuple[dict[str, int], dict[str, str]]:
    """Bytes one device sends per step (ring all-gather / reduce-scatter: (n-1)/n of the
    whole; all-reduce twice that; all-to-all: the rows bound to other ranks)."""
    c = 4 if precision == "fp32" else 2  # activations on the wire: the compute dtype
    gb = c  # FSDP2 gathers parameters in the compute dtype (bf16 `param_dtype`), module docstring
    T, D = micro_batch * seq // lay.cp, cfg.d_model
    recompute = 0 if mode == "none" else 1  # forward collectives run again in the backward
    comm: dict[str, float] = {}
    status: dict[str, str] = {}
    # the TP / CP / EP lines: the collectives of a training forward + backward counted on gloo
    # (tests/test_plan.py: TP 2, CP 2 and EP 2 each alone, fp32, each checkpointing mode)
    alone = sum(n > 1 for n in (lay.tp, lay.cp, lay.ep)) == 1
    tested = "tested in fp32: counted, within 5%" if alone else "modelled (tested one at a time)"

    def ring(n: int) -> float:
        return (n - 1) / n if n > 1 else 0.0

    if lay.style == "fsdp":
        gather = scatter = replicate = 0.0
        for unit, n_el in units.items():
            n = lay.fsdp // (lay.ep if unit.endswith(".experts") else 1)
            # the root stays gathered from its forward to its backward (FSDP2 root); a block is
            # gathered in the forward and again in the backward, an MTP block once per depth
            # (per-depth heads: each once)
            recursive = unit.startswith("mtp.") and cfg.mtp.shared
            calls = 1 if unit == "root" else (depth if recursive else 1)
            gathers = 1 if unit == "root" else 2 * calls
            gather += gb * n_el * ring(n) * gathers
            scatter += 4 * n_el * ring(n) * calls
            replicate += 4 * n_el / n * 2 * ring(lay.dp_replicate) * calls
        gathered = f"FSDP all-gather ({'fp32' if gb == 4 else 'bf16'}, forward + backward)"
        comm[gathered] = gather
        comm["FSDP reduce-scatter (fp32 gradients)"] = scatter
        status[gathered] = "modelled (implemented layout)"
        status["FSDP reduce-scatter (fp32 gradients)"] = "modelled (implemented layout)"
        if lay.dp_replicate > 1:
            comm["HSDP all-reduce over replicas (fp32)"] = replicate
            status["HSDP all-reduce over replicas (fp32)"] = "modelled (implemented layout)"
    elif lay.style == "ddp":
        total = 4 * sum(s.local for s in shards)
        comm["DDP all-reduce (fp32 gradients)"] = total * 2 * ring(lay.dp_replicate)
        status["DDP all-reduce (fp32 gradients)"] = "modelled (implemented layout)"
    moe_calls = cfg.pattern.count("E") + depth * cfg.mtp.pattern.count("E")
    if lay.ep > 1:
        e = cfg.moe
        rows = T * e.top_k * (e.latent_size or D) * c
        # dispatch + combine, forward and backward (+ the forward again when recomputed)
        key = "EP all-to-all (dispatch + combine, fwd + bwd)"
        comm[key] = moe_calls * rows * ring(lay.ep) * (4 + 2 * recompute)
        status[key] = tested + "; balanced routing"
    if lay.tp > 1:
        ar = 2 * T * D * c * ring(lay.tp)  # one all-reduce of [T, D]
        # per block: its forward output and backward input gradients (`_tp_all_reduces`); the
        # embedding lookup (main and each MTP depth) forward; the vocabulary-parallel CE's input
        # gradient per CE call (its max / sum-exp / target reductions are [T], ignored)
        blocks = cfg.pattern + cfg.mtp.pattern * depth
        regions = sum(_tp_all_reduces(cfg, letter) for letter in blocks) + 2 * (1 + depth)
        comm["TP all-reduce"] = regions * ar
        status["TP all-reduce"] = tested
        if lay.ep == 1 and moe_calls:  # experts split over tp: rows all-gathered (forward, and
            # again when recomputed), their gradients all-reduced (backward)
            e = cfg.moe
            rows = T * e.top_k * (e.latent_size or D) * c * ring(lay.tp)
            key = "TP experts (row all-gather + grad all-reduce)"
            comm[key] = moe_calls * rows * ((1 + recompute) + 2)
            status[key] = tested + "; balanced routing"
    if lay.cp > 1:
        # train/distributed/context_parallel.py: all-gathers whose backward all-reduces the gathered
        # gradient (twice the forward's volume); K/V of every attention layer, the entering SSD
        # state of every Mamba layer (final states, decays; conv taps), the ids MTP reads ahead
        a, m, S = cfg.attention, cfg.mamba, lay.cp
        attn_calls = cfg.pattern.count("*") + depth * cfg.mtp.pattern.count("*")
        kv_heads = a.num_kv_heads / _kv_tp(cfg, lay.tp)
        kv = 2 * micro_batch * seq * kv_heads * a.head_dim * c * ring(S)
        cp_bytes = attn_calls * kv * (3 + recompute)
        mamba_calls = cfg.pattern.count("M") + depth * cfg.mtp.pattern.count("M")
        H, P, N, X = m.num_heads, m.head_dim, m.state_size, m.conv_dim
        state = micro_batch * (H * P * N * 4 + H * 4 + (m.conv_kernel - 1) * X * c) / lay.tp
        cp_bytes += mamba_calls * state * (S - 1) * (3 + recompute)
        cp_bytes += depth * micro_batch * seq * 8 * ring(S)
        key = "CP all-gathers (K/V, Mamba states), fwd + bwd"
        comm[key] = cp_bytes
        status[key] = tested
    return {k: int(v) for k, v in comm.items()}, status
