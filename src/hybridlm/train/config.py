"""`TrainConfig` (optimizer, schedule, loop, checkpoints) and `RunConfig` (model + data + train).

A run is one YAML file with three sections:

    model: tiny-super            # a preset name, or a full ModelConfig mapping
    data: {...}                  # hybridlm.data.config.DataConfig
    train: {...}                 # TrainConfig below

`RunConfig.load(path)`, `run.save(path)` round-trip it; `run.override(["train.lr=1e-3",
"model.d_model=128", "data.sources.0.max_files=50"])` applies dotted overrides (values parsed as
YAML; integer path parts index lists; `model.*` on a preset name starts from the preset).
Defaults follow the Nemotron 3 Super pretraining recipe (§2.4: AdamW beta 0.9/0.95, weight decay
0.1, WSD with minus-sqrt decay over the last 20%); Olmo 3's alternatives (cosine / linear
schedules, z-loss 1e-5) are options.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ..config import Config, ModelConfig, YarnConfig
from ..data.config import DataConfig
from ..presets import PRESETS, get_preset

ScheduleKind = Literal["wsd", "cosine", "linear", "constant"]
DecayShape = Literal["minus_sqrt", "linear", "cosine"]


def _default_no_decay() -> list[str]:
    # Globs matched against each dotted component of a parameter name (see optim.param_groups).
    return ["*norm*", "*bias", "A_log", "D", "embeddings"]


ParallelStyle = Literal["none", "ddp", "fsdp"]


@dataclass(kw_only=True)
class ParallelConfig:
    """The device-mesh layout of a torchrun job (`train.parallel`), torchtitan's ParallelDims.

    The product `dp_replicate * dp_shard * cp` is the world size; one of the first two may be
    -1 (what the world leaves). `dp_replicate` ranks hold whole replicas (DDP, or HSDP's
    replicas when `dp_shard > 1`); `dp_shard` ranks shard parameters, gradients and optimizer
    state (FSDP2). Expert parallelism borrows its ranks from `dp_shard` (torchtitan's layout):
    `ep` ranks of a shard group split the routed experts (Nemotron 3 Super trains with EP 64),
    tokens reach them by all-to-all, and the experts' remaining data-parallel ranks
    (`dp_shard / ep`) shard them with FSDP2. Context parallelism splits every sequence over `cp`
    ranks (the parameters are sharded over dp_shard * cp ranks, as in torchtitan). Tensor
    parallelism splits attention and Mamba-2 heads, MLP / shared-expert hidden units and the
    vocabulary over `tp` ranks (innermost; they read the same rows,
    `train/distributed/tensor_parallel.py`).
    The string shorthands: "ddp" = {dp_replicate: -1}, "fsdp" = {dp_shard: -1}, "none" = one
    process only. A single process ignores the layout, so one YAML runs on a laptop and on a
    cluster."""

    dp_replicate: int = 1
    dp_shard: int = -1
    ep: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        sizes = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard}
        sizes |= {"ep": self.ep, "cp": self.cp, "tp": self.tp}
        for name, size in sizes.items():
            fixed = name in ("ep", "cp", "tp")
            if size == 0 or size < -1 or (fixed and size < 1):
                raise ValueError(
                    f"train.parallel.{name} must be a positive number of ranks"
                    + ("" if fixed else " (or -1: what the world leaves)")
                    + f", got {size}"
                )
        if self.dp_replicate == -1 and self.dp_shard == -1:
            raise ValueError("only one of train.parallel.dp_replicate / dp_shard may be -1")

    @staticmethod
    def from_style(style: str) -> ParallelConfig:
        """The layout a shorthand names ("ddp", "fsdp"; "none": one rank)."""
        if style not in typing.get_args(ParallelStyle):
            raise ValueError(
                f"train.parallel must be one of {list(typing.get_args(ParallelStyle))} or a "
                f"layout mapping {{dp_replicate, dp_shard, ep, cp, tp}}, got {style!r}"
            )
        if style == "ddp":
            return ParallelConfig(dp_replicate=-1, dp_shard=1)
        if style == "fsdp":
            return ParallelConfig(dp_replicate=1, dp_shard=-1)
        return ParallelConfig(dp_replicate=1, dp_shard=1)


@dataclass(kw_only=True)
class TrainConfig:
    """Optimizer, LR schedule, precision, loop cadence and checkpointing of one pretraining run.

    Length: `max_steps` optimizer steps, or (when 0) enough steps to see `total_tokens` tokens
    (each step sees `data.batch_size * grad_accum * data.seq_len` input tokens).

    z-loss (Olmo 3; PaLM): `z_loss * sum_t logsumexp(logits_t)^2 / num_valid_tokens` over the
    CE targets. The fused LM-head + CE path never materialises logits, so with `z_loss > 0` the
    forward runs with `return_logits=True` and the z-term is computed from those logits (memory
    O(B*L*V) per micro-batch; fine at the sizes z-loss is tried here).
    """

    # ---- optimizer (AdamW); Nemotron 3 Super §2.4 defaults
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-5  # floor of the decay
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    no_decay: list[str] = field(default_factory=_default_no_decay)
    no_decay_1d: bool = True  # every parameter with ndim < 2 also skips weight decay
    # ---- schedule (train.schedule)
    schedule: ScheduleKind = "wsd"
    decay_shape: DecayShape = "minus_sqrt"  # shape of the WSD decay (Nemotron 3 Super §2.4)
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # WSD: decay over the final fraction of the steps
    # ---- loop
    max_steps: int = 0
    total_tokens: int = 0
    grad_accum: int = 1
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    # bf16: torch.autocast with fp32 master weights; under FSDP2 the parameters are also
    # gathered in bf16 (MixedPrecisionPolicy, routers kept fp32, gradients reduced in fp32)
    precision: Literal["fp32", "bf16"] = "fp32"
    # "nvfp4": convert the model with hybridlm.precision.convert_for_low_precision (Nemotron 3
    # Super §2.2 policy: NVFP4 GEMMs, MXFP8 Mamba out_proj, the rest in `precision`) before
    # training, and log zero-wgrad / underflow metrics every log_interval steps; "fp8": the
    # same policy's quantised linears in FP8 through torchao Float8Linear (Hopper;
    # hybridlm.precision.fp8), the layers it keeps in BF16 as they are
    low_precision: Literal["none", "nvfp4", "fp8"] = "none"
    monitor_zero_grads: bool = False  # log zero-wgrad fractions without low precision too
    z_loss: float = 0.0
    intra_doc_masking: bool = False  # pass doc_ids to the model when it accepts them
    max_consecutive_skips: int = 10  # non-finite steps in a row before the run stops
    # ---- eval, logging, checkpoints
    eval_interval: int = 100  # 0: no periodic eval (one at the end if a held-out split exists)
    eval_batches: int = 10  # 0: the whole held-out split
    log_interval: int = 10
    checkpoint_interval: int = 500  # 0: only the final checkpoint
    keep_last_n: int = 3  # 0: keep all
    # "full": one model.safetensors + optimizer.pt written by rank 0 (a sharded model gathered
    # first); "sharded": every rank writes its own shards (torch.distributed.checkpoint,
    # train.distributed.dcp), loadable at any world size; "auto": sharded when the model is
    # (FSDP2 / EP)
    checkpoint_format: Literal["auto", "full", "sharded"] = "auto"
    out_dir: str = "runs/default"
    # warm start: the model the run starts from, any path `hybridlm.io` loads (a run directory,
    # a training checkpoint, a transformers or ModelOpt directory), with a fresh optimizer and
    # schedule (Olmo 3 §4 midtraining, long-context extension, post-training); "" = a freshly
    # initialised model of the run's model config
    init_from: str = ""
    # long-context extension of the warm-started model (Olmo 3 §5): YaRN on its full-attention
    # RoPE layers, e.g. {factor: 4, original_max_position_embeddings: 256}; NoPE attention and
    # Mamba-2 layers need nothing (HybridLM.extend_context)
    yarn: YarnConfig | None = None
    seed: int = 0
    device: str = "auto"  # auto: cuda when available, else cpu
    # the layout under torchrun: "ddp", "fsdp", "none" or a ParallelConfig mapping
    # ({dp_replicate, dp_shard, ep, cp}); ignored in a single process
    parallel: ParallelStyle | ParallelConfig = "ddp"
    # keep fewer activations for the backward (train/activation_checkpointing.py): "full"
    # recomputes each block's forward, "selective" recomputes all but the matrix products
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    # regional torch.compile of the blocks' norms and mixers, the routed experts' dispatch left
    # eager (train/compile.py); pays on GPUs, where launches and elementwise passes dominate
    compile: bool = False
    peak_flops: float = 0.0  # FLOP/s for MFU; 0: measure once with a matmul
    progress: bool = True  # rich progress bar
    plot: bool = True  # render <out>/loss.png from metrics.jsonl at the end
    tensorboard: bool = False  # also write <out>/tensorboard (needs the tensorboard package)

    # `train.parallel.ep=2` on a shorthand starts from the layout it names
    EXPAND: ClassVar[dict[str, Callable[[str], Any]]] = {"parallel": ParallelConfig.from_style}

    def __post_init__(self) -> None:
        self.validate()

    def check_own_loop(self, stage: str, also_unused: tuple[str, ...] = ()) -> None:
        """For a stage whose step is not a text-training step (RL, the MTP boost): the
        text-training settings (and `also_unused`) keep this class's defaults, the run has a
        step count, and the layout is data parallel (ddp or fsdp)."""
        unused = ("grad_accum", "total_tokens", "z_loss", "yarn", "intra_doc_masking")
        unused += also_unused
        if self.max_steps < 1:
            raise ValueError(f"train.max_steps must be >= 1 for {stage}, got {self.max_steps}")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in unused:
            if getattr(self, name) != defaults[name]:
                raise ValueError(
                    f"train.{name} has no effect in {stage}; leave it at {defaults[name]!r}"
                )
        layout = self.layout()
        if max(layout.tp, layout.cp, layout.ep) > 1:
            raise ValueError(f"{stage} trains data parallel only: train.parallel ddp or fsdp")

    def validate(self) -> None:
        for name in ("lr", "eps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"train.min_lr must be in [0, train.lr={self.lr}], got {self.min_lr}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        for name in (
            "weight_decay",
            "grad_clip",
            "z_loss",
            "warmup_steps",
            "max_steps",
            "total_tokens",
            "eval_interval",
            "eval_batches",
            "checkpoint_interval",
            "keep_last_n",
            "peak_flops",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("grad_accum", "log_interval", "max_consecutive_skips"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"train.decay_fraction must be in [0, 1], got {self.decay_fraction}")
        if self.schedule not in typing.get_args(ScheduleKind):
            raise ValueError(
                f"train.schedule must be one of {list(typing.get_args(ScheduleKind))}, "
                f"got {self.schedule!r}"
            )
        if self.decay_shape not in typing.get_args(DecayShape):
            raise ValueError(
                f"train.decay_shape must be one of {list(typing.get_args(DecayShape))}, "
                f"got {self.decay_shape!r}"
            )
        self.layout()  # a clear error for an unknown style or a bad layout
        if self.activation_checkpointing not in ("none", "selective", "full"):
            raise ValueError(
                "train.activation_checkpointing must be 'none', 'selective' or 'full', "
                f"got {self.activation_checkpointing!r}"
            )
        if self.checkpoint_format not in ("auto", "full", "sharded"):
            raise ValueError(
                "train.checkpoint_format must be 'auto', 'full' or 'sharded', "
                f"got {self.checkpoint_format!r}"
            )
        if self.yarn is not None:
            try:
                self.yarn.validate()
            except ValueError as err:
                raise ValueError(f"train.yarn: {err}") from None
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"train.precision must be 'fp32' or 'bf16', got {self.precision!r}")
        if self.low_precision not in ("none", "nvfp4", "fp8"):
            raise ValueError(
                f"train.low_precision must be 'none', 'nvfp4' or 'fp8', got {self.low_precision!r}"
            )

    def layout(self) -> ParallelConfig:
        """`parallel` as a ParallelConfig (a shorthand expanded)."""
        if isinstance(self.parallel, ParallelConfig):
            self.parallel.validate()
            return self.parallel
        return ParallelConfig.from_style(self.parallel)

    def num_steps(self, tokens_per_step: int) -> int:
        """Optimizer steps of the run: `max_steps`, else ceil(total_tokens / tokens_per_step)."""
        if self.max_steps:
            return self.max_steps
        if self.total_tokens:
            return -(-self.total_tokens // tokens_per_step)
        raise ValueError("set train.max_steps or train.total_tokens to give the run a length")


@dataclass(kw_only=True)
class TeacherConfig:
    """Distillation from a teacher's top-k logits (Nemotron 3.5 §2.2: Lightning is pretrained on
    the top-128 logits of a larger base, forward KL and CE at weights 0.9 / 0.1). The loss at a
    target position is `kl_weight * KL(p_T^top-k || q_S) + ce_weight * CE`. The teacher is a
    loadable model run on every batch (`teacher`), or its cached top-k (`teacher_cache`, written
    once by `hybridlm distill-cache`), which stands in for it. Pretraining runs distil when
    either is set; `distill.DistillConfig` adds the SFT-data and on-policy settings."""

    teacher: str = ""
    # top-k teacher entries (clamped to the vocabulary); 0 = the whole vocabulary (full KL)
    top_k: int = 128
    kl_weight: float = 0.9
    ce_weight: float = 0.1
    temperature: float = 1.0  # softmax temperature of the top-k forward KL
    teacher_cache: str = ""
    teacher_cache_dtype: Literal["float32", "float16", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        if self.top_k < 0 or self.temperature <= 0:
            raise ValueError("distill.top_k must be >= 0 (0: all) and distill.temperature > 0")
        if self.kl_weight < 0 or self.ce_weight < 0 or self.kl_weight + self.ce_weight == 0:
            raise ValueError("distill.kl_weight and ce_weight must be >= 0, not both 0")

    @property
    def enabled(self) -> bool:
        return bool(self.teacher or self.teacher_cache)


@dataclass(kw_only=True)
class RunConfig(Config):
    """One pretraining run: `model` (a preset name or a ModelConfig), `data`, `train`, and
    optionally a teacher to distil from (`distill`)."""

    WHAT = "run config"
    EXPAND = {"model": get_preset}

    model: ModelConfig | str = "tiny-super"
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distill: TeacherConfig = field(default_factory=TeacherConfig)

    def __post_init__(self) -> None:
        if isinstance(self.model, str) and self.model not in PRESETS:
            raise ValueError(
                f"model {self.model!r} is not a preset; use one of {sorted(PRESETS)} "
                "or give the model config as a mapping"
            )

    def model_config(self) -> ModelConfig:
        """The resolved `ModelConfig` (a fresh copy)."""
        if isinstance(self.model, str):
            return get_preset(self.model)
        return copy.deepcopy(self.model)

    def resolved(self) -> RunConfig:
        """A copy with the preset name replaced by its full config (what checkpoints store)."""
        return dataclasses.replace(
            self,
            model=self.model_config(),
            data=copy.deepcopy(self.data),
            train=copy.deepcopy(self.train),
            distill=copy.deepcopy(self.distill),
        )
