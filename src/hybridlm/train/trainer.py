"""The one training loop: `Trainer` runs a `TrainModule` (a stage: its model, data and loss).

Every stage — pretraining, SFT, DPO, distillation, MTP boosting, the GRPO learner — is a small
object that supplies data and `loss(micro, step) -> Loss` (OLMo-core's TrainModule, torchtitan's
`loss_fn` split). The Trainer owns the rest, once for all of them:

- the run directory (an earlier run needs `resume` or `overwrite`), device, seeds, torchrun
  process group;
- low precision (a converter over the built model), DDP / FSDP2 wrapping, AdamW param groups;
- one optimizer step: the module's micro-batches, each backward on its share of the step's loss,
  then `optim.optimizer_step` (clip, schedule, finiteness check, MoE bias step). A step whose loss
  or gradient norm is not finite is skipped and logged; `max_consecutive_skips` in a row stop
  the run;
- `metrics.jsonl` (and TensorBoard), the progress bar, and the callbacks (`train.callbacks`):
  periodic evaluation and checkpoints with exact resume (weights, optimizer, RNG, the module's
  data position) are the Trainer's own; the stage's (data rows, throughput, export, plot,
  result fields) come from `TrainModule.callbacks()`.

Loss scaling under data parallelism (DESIGN habit 13): a micro-batch's `Loss.value` is this
rank's share of a term normalised by *global* counts (over micro-batches and ranks), so the
shares sum to the step's loss. DDP and FSDP average gradients over the N ranks, so the backward
runs on N * value: the synced gradient equals the single-process gradient of the global batch.
`Loss.mean` is a term that is already a mean over one call's sequences (the MoE balancing loss):
it is divided by the number of micro-batches and not scaled, so averaging over ranks is right.
"""

from __future__ import annotations

import copy
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ..config import ModelConfig
from ..data.bpe import load_tokenizer, tokenizer_sha256
from ..io import load_model, tokenizer_spec_for
from ..io.checkpoint import (
    is_sharded_checkpoint,
    load_checkpoint,
    read_meta,
    resume_checkpoint,
    save_checkpoint,
    set_rng_state,
)
from ..model.model import HybridLM, build_model
from ..precision.fp8 import convert_for_fp8_training
from ..precision.monitor import LowPrecisionMonitor
from ..precision.policy import PrecisionPolicy, convert_for_low_precision
from ..presets import get_preset
from .activation_checkpointing import apply_activation_checkpointing
from .callbacks import Callback, Checkpoint, Evaluate, Throughput
from .checkpoint import prepare_run_dir, truncate_metrics
from .compile import apply_compile
from .config import TrainConfig
from .distributed.dcp import load_sharded, save_sharded
from .distributed.parallel import (
    Layout,
    all_reduce_sum,
    apply_ddp,
    apply_layout,
    barrier,
    build_mesh,
    data_parallel_coordinates,
    full_model_state,
    full_state_dicts,
    init_distributed,
    is_main,
    is_sharded,
    load_full_state_dicts,
    materialize_sharded,
    on_main,
    resolve_layout,
)
from .optim import StepOutcome, build_optimizer, clip_gradients, optimizer_step


def seed_all(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def initial_model(
    tc: TrainConfig, model: ModelConfig | str | None, device: torch.device, *, meta: bool = False
) -> HybridLM:
    """The model a run starts from: `tc.init_from` loaded (warm start; the optimizer and
    schedule are the run's own, fresh), else a fresh `model` (a config or preset name)
    initialised from `tc.seed`; with `meta` (`Runtime.meta_init`) a fresh model stays on the
    meta device, and the Trainer gives each rank its shards once the layout is applied."""
    if tc.init_from:
        return load_model(tc.init_from, setting="train.init_from").float().to(device).train()
    if model is None:
        raise ValueError("give train.init_from (a model to start from) or a model config")
    cfg = get_preset(model) if isinstance(model, str) else copy.deepcopy(model)
    if meta:
        with torch.device("meta"):
            return HybridLM(cfg).train()
    return build_model(cfg, seed=tc.seed, device=device)


def resolve_tokenizer(data: Any, tc: TrainConfig) -> str:
    """The tokenizer spec of a run whose data section is `data`: the one `data.tokenizer` names,
    else the one the model in `train.init_from` was trained with, else "byte" (a model trained
    from scratch). `data.tokenizer` is set to it, so run.yaml and the checkpoints record it and
    the next stage finds it."""
    if not data.tokenizer:
        data.tokenizer = (
            tokenizer_spec_for(tc.init_from, setting="train.init_from") if tc.init_from else "byte"
        )
    return data.tokenizer


def run_tokenizer(data: Any, tc: TrainConfig) -> Any:
    """The tokenizer of a run (`resolve_tokenizer`), loaded. A named tokenizer other than the
    starting model's is used as asked, with a warning."""
    named = bool(data.tokenizer)
    tokenizer = load_tokenizer(resolve_tokenizer(data, tc))
    if named and tc.init_from:
        own = foreign_tokenizer(tokenizer, tc.init_from, "train.init_from")
        if own:
            warn_main(
                f"warning: data.tokenizer={data.tokenizer} is not the tokenizer {tc.init_from} "
                f"was trained with ({own}); leave data.tokenizer unset to use the model's own"
            )
    return tokenizer


def foreign_tokenizer(tokenizer: Any, path: str, setting: str) -> str:
    """The spec of the tokenizer the model at `path` was trained with when it is not
    `tokenizer` (compared by content), else ""."""
    own = tokenizer_spec_for(path, setting=setting)
    return "" if tokenizer_sha256(load_tokenizer(own)) == tokenizer_sha256(tokenizer) else own


def check_tokenizer(tokenizer: Any, model: HybridLM, setting: str, path: str = "") -> None:
    """Refuse a tokenizer whose ids do not fit `model`'s vocabulary, naming the setting that
    chose the model; with `path` (a model path), also one that is not the tokenizer that model
    was trained with (a teacher, reference or generator must read the run's token ids)."""
    where = f"{setting}={path}" if path else setting
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model of {where} has "
            f"vocab_size {model.config.vocab_size}: use the model's own tokenizer (leave "
            "data.tokenizer unset)"
        )
    if path:
        own = foreign_tokenizer(tokenizer, path, setting)
        if own:
            raise ValueError(
                f"{where} was trained with another tokenizer ({own}) than the run's: its "
                "token ids mean other text"
            )


def warn_main(message: str) -> None:
    """Print a warning line once, from the main process."""
    if is_main():
        print(message, file=sys.stderr, flush=True)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class Runtime:
    """What a stage needs from the run around it: the run directory, device, data-parallel rank
    and world size (the ranks that read different rows), and the loop settings."""

    tc: TrainConfig
    out: Path
    device: torch.device
    rank: int = 0
    world_size: int = 1
    cp: int = 1  # context-parallel ranks sharing each row (the model takes this rank's shard)
    tp: int = 1  # tensor-parallel ranks computing the same rows (and the same losses)
    # a fresh model may be built on the meta device (a sharded layout initialises it per shard)
    meta_init: bool = False

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"

    def autocast(self) -> AbstractContextManager:
        """bf16 autocast when `train.precision` is bf16 (fp32 master weights), else nothing."""
        if self.tc.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's rows of a global batch: every entry whose first dimension is the batch's
        row count is cut into `world_size` equal consecutive parts (rank r takes part r), the
        rest (counts) is kept. Every rank builds the same global batch from the same seeded
        loader, so world N with B rows per rank trains on the rows of one process with N*B."""
        if self.world_size == 1:
            return batch
        rows = batch["input_ids"].shape[0]
        if rows % self.world_size:
            raise ValueError(f"a global batch of {rows} rows does not split over {self.world_size}")
        b = rows // self.world_size
        sl = slice(self.rank * b, (self.rank + 1) * b)
        return {
            k: v[sl] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows else v
            for k, v in batch.items()
        }

    def share(self, items: list[Any]) -> list[Any]:
        """This rank's consecutive share of a global list (all of it in one process); shares
        differ by at most one item when the ranks do not divide the length."""
        n, W, r = len(items), self.world_size, self.rank
        return items[r * n // W : (r + 1) * n // W]

    def reduce_sum(self, x: float) -> float:
        """The sum of `x` over every rank (x itself in one process); the ranks of a
        context-parallel group (`cp`) each contribute, a tensor-parallel group (`tp`, whose
        ranks hold the same values) once."""
        if self.world_size * self.cp * self.tp == 1:
            return x
        return float(all_reduce_sum(float(x))) / self.tp


@dataclass
class Step:
    """One optimizer step's data: its micro-batches, what their losses need (`ctx`, e.g. the
    global target count) and what the step's metrics row shows of it (`info`)."""

    micro: list[Any]
    ctx: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Loss:
    """One micro-batch's part of the step's loss (module docstring: `value` sums over
    micro-batches and ranks, `mean` is averaged). `metrics` are summed over micro-batches and
    ranks, except the keys in `mean_keys`, averaged over ranks (the module already divides
    them by the number of micro-batches)."""

    value: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    mean: torch.Tensor | None = None

    mean_keys: ClassVar[frozenset[str]] = frozenset({"moe_aux"})


class TrainModule:
    """What a step of a training stage does, on the `Trainer`. A subclass is built with the
    run's `Runtime`, sets `model` and `total_steps`, and implements `prepare_step` and `loss`;
    `evaluate`, `state_dict` / `load_state_dict` (its part of a checkpoint) and `run_config`
    have defaults. Everything around the steps — data and reference rows, throughput, progress
    text, export, plot, result fields — comes from its `callbacks()` (`train.callbacks`).
    Forward training batches through `forward_model` (the DDP wrapper under DDP)."""

    stage: ClassVar[str] = "train"
    # post-training evaluates before the first step (`callbacks.Evaluate`)
    eval_at_start: ClassVar[bool] = True
    # the stage's forwards take context-parallel shards of their rows (train.parallel.cp)
    context_parallel: ClassVar[bool] = False

    model: HybridLM
    total_steps: int
    forward_model: nn.Module  # the trained module as training runs it; set by the Trainer

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def prepare_step(self, step: int) -> Step:
        """The micro-batches of optimizer step `step` (0-based)."""
        raise NotImplementedError

    def loss(self, micro: Any, step: Step) -> Loss:
        """One micro-batch's loss (forward through `forward_model`)."""
        raise NotImplementedError

    def trained_module(self) -> nn.Module:
        """The module whose parameters the optimizer trains and whose MoE routers take the bias
        step (default: the whole model). A part of the model trains in training mode and the
        frozen rest in eval mode (e.g. the MTP head on a frozen backbone)."""
        return self.model

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (empty: nothing to evaluate)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The module's part of a checkpoint's meta (data position, counters)."""
        return {}

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        """Restore what `state_dict` saved, from a checkpoint's meta."""

    def run_config(self) -> dict[str, Any]:
        """The run's configuration, stored in checkpoints."""
        return {}

    def callbacks(self) -> list[Callback]:
        """What the loop does around the steps for this stage (`train.callbacks`); the
        Trainer appends its `Evaluate` and `Checkpoint`."""
        return [Throughput()]


class Trainer:
    """The loop. `Trainer(tc, build)` prepares the run (directory, device, seeds, process group)
    and calls `build(runtime)` for the stage's `TrainModule`, then wraps its model and builds the
    optimizer; `resume=True` continues from the newest intact checkpoint, `overwrite=True`
    replaces an earlier run in `tc.out_dir`. `train()` runs to the end (or to `until_step`)."""

    def __init__(
        self,
        tc: TrainConfig,
        build: Callable[[Runtime], TrainModule],
        *,
        resume: bool = False,
        overwrite: bool = False,
    ) -> None:
        self.cfg = tc
        rank, world, dist_device = init_distributed(tc.device)
        self.rank, self.world_size = rank, world
        # before any work: refuse to start over an earlier run unless resumed or overwritten
        # (rank 0 checks and removes for every rank: one verdict, reported once)
        out = on_main(
            lambda: prepare_run_dir(tc.out_dir, resume=resume, overwrite=overwrite, log=self._print)
        )
        # the mesh layout of a torchrun job (a single process ignores train.parallel); a layout
        # that does not fit the world is rank 0's error, the same on every rank
        self.layout = on_main(lambda: resolve_layout(tc.layout(), world)) if world > 1 else Layout()
        self.parallel = self.layout.style
        device = dist_device if dist_device is not None else resolve_device(tc.device)
        self.mesh = build_mesh(self.layout, device) if self.parallel == "fsdp" else None
        # stages read data by data-parallel coordinates (a context-parallel group shares rows)
        dp_rank, dp_size = data_parallel_coordinates(self.layout, self.mesh)
        seed_all(tc.seed)
        self.rt = Runtime(
            tc=tc,
            out=out,
            device=device,
            rank=dp_rank,
            world_size=dp_size,
            cp=self.layout.cp,
            tp=self.layout.tp,
            meta_init=self.parallel == "fsdp" and tc.low_precision == "none",
        )
        self.out, self.device, self.metrics_path = out, device, self.rt.metrics_path

        self.module = build(self.rt)
        m = self.module
        self.callbacks: list[Callback] = [*m.callbacks(), Evaluate(), Checkpoint()]
        self.console: Any = None  # the progress bar's console while the loop runs
        self.last_eval: dict[str, float] = {}
        self.last_checkpoint: Path | None = None
        self.finished = False  # the last `train()` reached total_steps
        # a meta-device build: its unsharded structure, for the per-unit init after sharding
        template = copy.deepcopy(m.model) if m.model.embeddings.weight.is_meta else None
        if self.layout.cp > 1 and not m.context_parallel:
            raise ValueError(
                f"train.parallel.cp={self.layout.cp}: context parallelism is supported by "
                f"pretraining; the {m.stage} stage reads whole rows"
            )
        self.total_steps = m.total_steps
        self.lp_monitor = None
        if tc.low_precision != "none":
            # a converter over the built model (DESIGN habit 12), before DDP/FSDP wrap it;
            # parameters are reused, so checkpoints are unchanged

            if tc.low_precision == "fp8":
                report = convert_for_fp8_training(m.model, PrecisionPolicy())
            else:
                report = convert_for_low_precision(m.model, PrecisionPolicy())
            frac = report.param_fraction()
            self._print(
                f"low precision {tc.low_precision}: GEMM parameters "
                + ", ".join(f"{k} {100 * v:.1f}%" for k, v in frac.items())
            )
        if tc.low_precision != "none" or tc.monitor_zero_grads:
            self.lp_monitor = LowPrecisionMonitor(m.model)
        apply_activation_checkpointing(m.model, tc.activation_checkpointing)
        if tc.compile:  # after checkpointing and before sharding, as torchtitan orders them
            apply_compile(m.model)
        # `m.model` stays the HybridLM (FSDP2 shards it in place); `m.forward_model` is what
        # training forwards of the trained module go through (its DDP wrapper under DDP)
        m.forward_model = m.trained_module()
        if self.parallel == "ddp":
            m.forward_model = apply_ddp(m.forward_model)
        elif self.parallel == "fsdp":
            # bf16: parameters gathered in bf16 (FSDP2 mixed precision), fp32 shards and grads
            bf16 = torch.bfloat16 if tc.precision == "bf16" else None
            apply_layout(m.model, self.layout, self.mesh, param_dtype=bf16)
            if template is not None:
                materialize_sharded(m.model, template, seed=tc.seed, device=device)
                del template
        self.optimizer = build_optimizer(m.trained_module(), tc)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]

        self.step = 0
        self.skipped_steps = 0
        self._consecutive_skips = 0
        self.resumed_from: Path | None = None
        if resume:
            self._resume()
        barrier()

    @property
    def model(self) -> HybridLM:
        return self.module.model

    @staticmethod
    def _print(text: str) -> None:
        if is_main():
            print(text)

    # ------------------------------------------------------------------ resume + save
    def _resume(self) -> None:
        stage = self.module.stage
        # rank 0 verifies and moves damaged checkpoints aside, and every rank takes its verdict:
        # the newest intact checkpoint, or its error (none intact) on every rank at once
        path = on_main(lambda: resume_checkpoint(self.out, log=self._print))
        if path is None:
            self._print(f"{stage}: no checkpoint under {self.out} to resume; starting from scratch")
            on_main(lambda: truncate_metrics(self.metrics_path, None), share=False)
            return
        if is_sharded_checkpoint(read_meta(path)):
            # any world size and layout: each rank reads the chunks it holds (train.distributed.dcp)
            meta = load_sharded(path, self.model, self.optimizer, restore_rng=True)
        elif is_sharded(self.model):
            from safetensors.torch import load_file

            meta = read_meta(path)
            msd = load_file(str(path / "model.safetensors"))
            if self.model.config.tie_embeddings:  # a tied matrix is stored once
                for a, b in (("lm_head.weight", "embeddings.weight"),) * 2:
                    if a not in msd and b in msd:
                        msd[a] = msd[b]
                    if b not in msd and a in msd:
                        msd[b] = msd[a]
            osd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
            load_full_state_dicts(self.model, self.optimizer, msd, osd)
            set_rng_state(meta["rng"])
        else:
            meta = load_checkpoint(path, self.model, self.optimizer, restore_rng=True)
        self.step = meta["step"]
        self.skipped_steps = meta.get("skipped_steps", 0)
        self.module.load_state_dict(meta)
        self.resumed_from = path
        # rows logged after the checkpoint (by the killed run) are replayed: drop them
        on_main(lambda: truncate_metrics(self.metrics_path, self.step), share=False)
        self._print(f"{stage}: resumed from {path} at step {self.step}")

    def checkpoint_format(self) -> str:
        """The format `save` writes, "sharded" or "full": `train.checkpoint_format`, where
        "auto" is sharded when the model is (its parameters are DTensors: FSDP2, EP)."""
        fmt = self.cfg.checkpoint_format
        if fmt == "auto":
            return "sharded" if is_sharded(self.model) else "full"
        return fmt

    def _checkpoint_meta(self) -> dict[str, Any]:
        return {
            "run_config": self.module.run_config(),
            "stage": self.module.stage,
            "skipped_steps": self.skipped_steps,
            "total_steps": self.total_steps,
            **self.module.state_dict(),
        }

    def save(self) -> Path | None:
        """Write a checkpoint (returns its path on rank 0). Sharded (`train.distributed.dcp`):
        every rank writes its own shards. Full: rank 0 writes it; a sharded model is gathered
        first (every rank joins)."""
        if self.checkpoint_format() == "sharded":
            path = save_sharded(
                self.out,
                step=self.step,
                model=self.model,
                optimizer=self.optimizer,
                meta=self._checkpoint_meta() if is_main() else {},  # rank 0's is written
                keep_last_n=self.cfg.keep_last_n,
            )
            return path if is_main() else None
        model, optimizer = self.model, self.optimizer
        if is_sharded(self.model):
            msd, osd = full_state_dicts(self.model, self.optimizer)
            if is_main():
                model, optimizer = _plain_copy(self.model.config, msd), _FixedState(osd)
        return on_main(
            lambda: save_checkpoint(
                self.out,
                step=self.step,
                model=model,
                optimizer=optimizer,
                meta=self._checkpoint_meta(),
                keep_last_n=self.cfg.keep_last_n,
            ),
            share=False,
        )

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, Any]:
        """One optimizer step over the module's micro-batches; returns its metrics."""
        tc, m, T = self.cfg, self.module, self.layout.tp
        # the ranks FSDP2 averages gradients over; a tensor-parallel group computes one loss
        W = self.world_size // T
        trained = m.trained_module()
        if trained is not m.model:  # a part trains; the frozen rest stays in eval mode
            m.model.eval()
        trained.train()
        step = m.prepare_step(self.step)
        # low-precision health metrics on the steps that get logged (Nemotron 3 Super §2.3)
        monitor_now = self.lp_monitor is not None and (
            (self.step + 1) % tc.log_interval == 0 or self.step + 1 == self.total_steps
        )
        if not step.micro:  # nothing to train on (e.g. every RL group filtered): no update
            self.step += 1
            fields = self._after_update(step, None)
            return {"step": self.step, **step.info, "skipped": False, **fields}
        if monitor_now:
            self.lp_monitor.arm()
        n = len(step.micro)
        total, mean_total = 0.0, 0.0
        metrics: dict[str, float] = {}
        for micro in step.micro:
            out = m.loss(micro, step)
            mean = out.mean / n if out.mean is not None else None
            loss = out.value if mean is None else out.value + mean
            if W > 1:
                (W * out.value + (mean if mean is not None else 0.0)).backward()
                total += float(out.value.detach())
                mean_total += float(mean.detach()) if mean is not None else 0.0
            else:
                loss.backward()
                total += float(loss.detach())
            for k, v in out.metrics.items():
                metrics[k] = metrics.get(k, 0) + v
        if W > 1 or T > 1:
            reduce = self.rt.reduce_sum  # over ranks, a tensor-parallel group counted once
            total = reduce(total) + reduce(mean_total) / W
            for k in list(metrics):
                metrics[k] = reduce(metrics[k]) / (W if k in Loss.mean_keys else 1)
        grad_norm = clip_gradients(self.params, tc.grad_clip)
        lp_metrics = self.lp_monitor.collect() if monitor_now else {}  # of the clipped grads
        done = optimizer_step(
            m.trained_module(),
            self.optimizer,
            self.params,
            loss=total,
            tc=tc,
            step=self.step,
            total_steps=self.total_steps,
            grad_norm=grad_norm,
            reduce_load=all_reduce_sum if W * T > 1 else None,
        )
        if done.finite:
            self._consecutive_skips = 0
        else:
            self.skipped_steps += 1
            self._consecutive_skips += 1
        self.step += 1
        return {
            "step": self.step,
            "loss": total,
            **dict(metrics),
            **step.info,
            "lr": done.lr,
            "grad_norm": grad_norm,
            "skipped": not done.finite,
            **lp_metrics,
            **self._after_update(step, done),
        }

    def _after_update(self, step: Step, outcome: StepOutcome | None) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for cb in self.callbacks:
            fields |= cb.after_update(self, step, outcome)
        return fields

    # ------------------------------------------------------------------ logging
    def log(self, row: dict[str, Any]) -> None:
        """Append `row` to metrics.jsonl (rank 0; mirrored to TensorBoard)."""
        if not is_main():
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.cfg.tensorboard:  # a mirror of metrics.jsonl, which stays the source of truth
            writer = self._tensorboard()
            kind = row.get("kind", "train")
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    writer.add_scalar(f"{kind}/{key}", value, row.get("step", self.step))
            writer.flush()

    def _tensorboard(self):
        if getattr(self, "_tb_writer", None) is None:
            try:
                # optional dependency, only for train.tensorboard
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "train.tensorboard needs the tensorboard package: pip install tensorboard"
                ) from None
            self._tb_writer = SummaryWriter(str(self.out / "tensorboard"))
        return self._tb_writer

    def evaluate_and_log(self) -> dict[str, float]:
        """The module's evaluation, logged as an "eval" row (and shown while the loop runs)."""
        result = self.module.evaluate()
        if result:
            self.log({"kind": "eval", "step": self.step, **result})
            if self.console is not None and is_main():
                text = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float))
                self.console.print(f"step {self.step}: {text}")
            self.last_eval = result
        return result

    def _skip(self, row: dict[str, Any]) -> None:
        if is_main():
            self.console.print(
                f"[yellow]step {row['step']}: non-finite loss/grad (loss {row['loss']}, grad "
                f"norm {row['grad_norm']}); step skipped"
            )
        self.log(
            {
                "kind": "skip",
                "step": row["step"],
                "loss": row["loss"],
                "grad_norm": row["grad_norm"],
                "skipped_steps": self.skipped_steps,
            }
        )
        if self._consecutive_skips >= self.cfg.max_consecutive_skips:
            raise RuntimeError(
                f"{self._consecutive_skips} consecutive non-finite steps; lower train.lr, raise "
                "train.warmup_steps or use precision fp32"
            )

    # ------------------------------------------------------------------ the loop
    def train(self, *, until_step: int | None = None) -> dict[str, Any]:
        """Run to `total_steps` (or stop after `until_step`, e.g. to simulate a crash)."""
        tc, m = self.cfg, self.module
        end = self.total_steps if until_step is None else min(until_step, self.total_steps)
        cbs = self.callbacks
        self.last_eval, self.last_checkpoint = {}, self.resumed_from
        if self.step == 0:
            for cb in cbs:
                cb.on_start(self)
        row: dict[str, Any] = {}
        window_s, window_steps = 0.0, 0  # training time since the last train row
        try:
            with _progress(m.stage, tc.progress and is_main()) as bar:
                self.console = bar.console
                task = bar.add_task("", total=self.total_steps, completed=self.step, info="")
                while self.step < end:
                    t0 = time.perf_counter()
                    r = self.train_step()
                    window_s += time.perf_counter() - t0
                    window_steps += 1
                    if r["skipped"]:
                        self._skip(r)
                    if self.step % tc.log_interval == 0 or self.step == end:
                        row = {"kind": "train", **{k: v for k, v in r.items() if k != "skipped"}}
                        for cb in cbs:
                            row |= cb.log_fields(self, window_steps, window_s)
                        row["skipped_steps"] = self.skipped_steps
                        window_s, window_steps = 0.0, 0
                        self.log(row)
                        bar.update(task, info=self._progress_text(row))
                    bar.update(task, completed=self.step)
                    for cb in cbs:
                        cb.on_step(self)
        finally:
            self.console = None
            for cb in cbs:
                cb.close(self)
        result: dict[str, Any] = {
            "step": self.step,
            "total_steps": self.total_steps,
            "skipped_steps": self.skipped_steps,
            "last_train": row,
            "eval": self.last_eval,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "metrics": str(self.metrics_path),
            "plot": None,
            "hf": None,
        }
        self.finished = self.step == self.total_steps
        if self.finished and is_sharded(self.model):
            # the run is over: hand callers (sampling, export) a plain, unsharded model on
            # every rank, as in a single process (tensor-parallel rows in canonical order)
            full = full_model_state(self.model, every_rank=True)
            m.model = m.forward_model = _plain_copy(self.model.config, full).to(self.device)
        for cb in cbs:
            cb.on_end(self, result)
        return result

    def _progress_text(self, row: dict[str, Any]) -> str:
        for cb in self.callbacks:
            text = cb.progress(row)
            if text is not None:
                return text
        return f"loss {row['loss']:.4f}"


@dataclass
class _FixedState:
    """Stands in for an optimizer whose (gathered) state dict is already at hand."""

    state: dict

    def state_dict(self) -> dict:
        return self.state


def _plain_copy(cfg: Any, state: dict[str, torch.Tensor]) -> HybridLM:
    """An unsharded CPU HybridLM holding `state` (what a gathered FSDP checkpoint saves)."""
    return HybridLM.from_state_dict(cfg, state, strict=False)


def _progress(label: str, enabled: bool) -> Iterator[Any]:
    # rich is imported where a loop runs: `import hybridlm.train` stays light
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        disable=not enabled,
    )
