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
from dataclasses import dataclass, field
from typing import Literal

from ..config import Config, ModelConfig
from ..data.config import DataConfig
from ..presets import PRESETS, get_preset

ScheduleKind = Literal["wsd", "cosine", "linear", "constant"]
DecayShape = Literal["minus_sqrt", "linear", "cosine"]


def _default_no_decay() -> list[str]:
    # Globs matched against each dotted component of a parameter name (see optim.param_groups).
    return ["*norm*", "*bias", "A_log", "D", "embeddings"]


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
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: torch.autocast, fp32 master weights
    # "nvfp4": convert the model with hybridlm.precision.convert_for_low_precision (Nemotron 3
    # Super §2.2 policy: NVFP4 GEMMs, MXFP8 Mamba out_proj, the rest in `precision`) before
    # training, and log zero-wgrad / underflow metrics every log_interval steps
    low_precision: Literal["none", "nvfp4"] = "none"
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
    out_dir: str = "runs/default"
    # warm start: the model the run starts from, any path `hybridlm.io` loads (a run directory,
    # a training checkpoint, a transformers or ModelOpt directory), with a fresh optimizer and
    # schedule (Olmo 3 §4 midtraining, long-context extension, post-training); "" = a freshly
    # initialised model of the run's model config
    init_from: str = ""
    seed: int = 0
    device: str = "auto"  # auto: cuda when available, else cpu
    # data parallelism under torchrun (train.parallel); ignored in a single process
    parallel: Literal["none", "ddp", "fsdp"] = "ddp"
    peak_flops: float = 0.0  # FLOP/s for MFU; 0: measure once with a matmul
    progress: bool = True  # rich progress bar
    plot: bool = True  # render <out>/loss.png from metrics.jsonl at the end
    tensorboard: bool = False  # also write <out>/tensorboard (needs the tensorboard package)

    def __post_init__(self) -> None:
        self.validate()

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
        if self.parallel not in ("none", "ddp", "fsdp"):
            raise ValueError(
                f"train.parallel must be 'none', 'ddp' or 'fsdp', got {self.parallel!r}"
            )
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"train.precision must be 'fp32' or 'bf16', got {self.precision!r}")
        if self.low_precision not in ("none", "nvfp4"):
            raise ValueError(
                f"train.low_precision must be 'none' or 'nvfp4', got {self.low_precision!r}"
            )

    def num_steps(self, tokens_per_step: int) -> int:
        """Optimizer steps of the run: `max_steps`, else ceil(total_tokens / tokens_per_step)."""
        if self.max_steps:
            return self.max_steps
        if self.total_tokens:
            return -(-self.total_tokens // tokens_per_step)
        raise ValueError("set train.max_steps or train.total_tokens to give the run a length")


@dataclass(kw_only=True)
class RunConfig(Config):
    """One pretraining run: `model` (a preset name or a ModelConfig), `data`, `train`."""

    WHAT = "run config"
    EXPAND = {"model": get_preset}

    model: ModelConfig | str = "tiny-super"
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

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
        )
