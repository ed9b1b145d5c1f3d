"""The pretraining loop: `run_pretrain(run_cfg, resume=False)`.

One optimizer step = `grad_accum` micro-batches from the packed loader. The loss of every
micro-batch is normalised by the *global* count of valid targets of the step (the sum of the
loader's `num_valid_tokens` over the micro-batches; DESIGN habit 13), so accumulation gives the
gradient of the global mean. The MoE sequence-level balancing loss is a mean over sequences of
one call and is divided by `grad_accum`. Then: clip the global grad norm, set the LR from the
schedule, `optimizer.step()`, `model.update_moe_bias()` (aux-loss-free balancing, Nemotron 3
Super §2.1.1). A step whose loss or grad norm is not finite is skipped (no update, no bias step,
expert-load counters cleared) and reported in `metrics.jsonl` and on the console.

Data parallelism (`torchrun --nproc_per_node=N`, train.parallel "ddp" or "fsdp"): each rank reads
its B rows of the global batch of N*B rows; `num_valid_tokens` is already the global count, so the
local loss is (sum of this rank's CE) / (global targets) and the losses of the ranks *sum* to the
global mean. DDP and FSDP average gradients over ranks (divide by N), so the backward runs on
N * loss: the synced gradient then equals the single-process gradient of the global batch. The
MoE balancing loss is a per-rank mean over sequences (equal B on each rank), so it is *not*
scaled: the averaged gradient is that of the mean over all sequences. Expert-load counters are
summed over ranks before the bias step, so every rank applies the same step. Metrics, progress,
plots and checkpoints are written by rank 0 only; under FSDP the full (unsharded) model and
optimizer state are gathered first, so checkpoints have the single-process layout and resume at
any world size with the same global batch.

Every `log_interval` steps a row goes to `<out>/metrics.jsonl` (kind "train": step, loss, ce,
mtp, mtp_k, moe_aux, z_loss, lr, grad_norm, tokens/s, MFU, tokens, skipped_steps); every
`eval_interval` steps one of kind "eval" (held-out CE and bits per byte). MFU is
`flops_per_token(seq_len, training=True) * tokens/s / peak`, the peak measured once with a matmul
(or `train.peak_flops`). Checkpoints (train.checkpoint) are written every `checkpoint_interval`
steps and at the end; `resume=True` continues from the newest intact one exactly (weights,
optimizer, loader position, RNG; a damaged newer one is skipped with a line saying why). A new run
in a directory that holds an earlier run's metrics.jsonl or checkpoints needs `resume=True` or
`overwrite=True` (checkpoint.prepare_run_dir). The loss curve `<out>/loss.png` is rendered from
metrics.jsonl at the end.

Bits per byte (held-out): sum of CE nats / (ln 2 * bytes of the target text). Byte tokenizer:
a target's bytes are 1 for ids < 256, 0 for BOS/EOS. Byte-level BPE: the bytes of each token's
byte-level string (exact); special tokens count 0 and added text tokens their UTF-8 length.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.tokenizer import byte_level_chars
from ..model.model import IGNORE_INDEX, HybridLM
from .checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    prepare_run_dir,
    resume_checkpoint,
    save_checkpoint,
    truncate_metrics,
)
from .config import RunConfig
from .optim import build_optimizer, clip_gradients, optimizer_step
from .parallel import (
    all_reduce_sum,
    apply_ddp,
    apply_fsdp2,
    barrier,
    full_state_dicts,
    init_distributed,
    is_main,
    load_full_state_dicts,
)


# ---------------------------------------------------------------------- helpers
def measure_peak_flops(
    device: torch.device | str, dtype: torch.dtype = torch.float32, n: int = 1024
) -> float:
    """Achieved matmul FLOP/s of an n x n GEMM on `device` (best of 8), the MFU baseline.
    Measured on a busy machine it is low and MFU reads high; pin `train.peak_flops` to compare
    runs."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)  # leaves the global RNG untouched
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    best = math.inf
    for _ in range(8):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def token_byte_lengths(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """Bytes of text each token id stands for (0 for special tokens), for bits per byte."""
    out = torch.zeros(vocab_size, dtype=torch.float64)
    if not hasattr(tokenizer, "id_to_token"):  # ByteTokenizer: ids 0-255 are the bytes
        out[: min(256, vocab_size)] = 1
        return out
    inverse = set(byte_level_chars())
    added = {i: t for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items()}
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        if i in added:
            out[i] = 0 if added[i].special else len(added[i].content.encode("utf-8"))
            continue
        tok = tokenizer.id_to_token(i) or ""
        if all(c in inverse for c in tok):
            out[i] = len(tok)  # one byte per byte-level character
        else:  # not a byte-level token: decode it
            out[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return out


def eval_sums(
    forward: Any, batches: Any, token_bytes: torch.Tensor, *, max_batches: int = 0
) -> tuple[float, int, float]:
    """(nats, label tokens, bytes they stand for) over held-out batches, the sums behind eval
    CE and bits per byte. `forward(batch)` runs the model with `num_valid_tokens=1` (so the CE
    is the sum of nats) and `mtp_depth=0`; `max_batches` 0 reads them all."""
    nats, n_tok, n_bytes = 0.0, 0, 0.0
    for k, batch in enumerate(batches):
        if max_batches and k >= max_batches:
            break
        nats += float(forward(batch).losses["ce"])
        tgt = batch["labels"][:, 1:]
        tgt = tgt[tgt != IGNORE_INDEX]
        n_tok += tgt.numel()
        n_bytes += float(token_bytes[tgt.cpu()].sum())
    return nats, n_tok, n_bytes


def build_model(cfg, *, seed: int, device: torch.device) -> HybridLM:
    """Build on the meta device, materialise on `device`, initialise once (model.init_weights)."""
    with torch.device("meta"):
        model = HybridLM(cfg)
    model.to_empty(device=device)
    model.init_buffers()
    model.init_weights(seed=seed)
    return model


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------- trainer
class Trainer:
    """Holds model, optimizer, loaders and counters; `train()` runs the loop to the end (or to
    `until_step`). Construct with `resume=True` to continue from the newest intact checkpoint,
    `overwrite=True` to replace an earlier run in `train.out_dir`."""

    def __init__(self, run: RunConfig, *, resume: bool = False, overwrite: bool = False) -> None:
        from ..data.pipeline import build_loaders, build_tokenizer, prepare_shards

        self.run = run.resolved()
        tc, dc = self.run.train, self.run.data
        self.cfg = tc
        self.model_cfg = self.run.model
        self.rank, self.world_size, dist_device = init_distributed(tc.device)
        # before any work: refuse to start over an earlier run unless resumed or overwritten
        self.out = prepare_run_dir(
            tc.out_dir, resume=resume, overwrite=overwrite, remove=is_main(), log=self._print
        )
        self.metrics_path = self.out / "metrics.jsonl"
        self.parallel = tc.parallel if self.world_size > 1 else "none"
        if self.world_size > 1 and self.parallel == "none":
            raise ValueError(
                "train.parallel='none' under torchrun with >1 process; use ddp or fsdp"
            )
        if dist_device is not None:
            self.device = dist_device
        elif tc.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(tc.device)
        _seed_all(tc.seed)

        # data
        # rank 0 tokenises and writes the shards; the others wait, then open the same files
        if self.rank == 0:
            sets = prepare_shards(dc)
        barrier()
        if self.rank != 0:
            sets = prepare_shards(dc)  # finds the manifest and reuses every shard
        vocab = max(s.vocab_size for s in sets.values())
        if vocab > self.model_cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} ids but model.vocab_size is "
                f"{self.model_cfg.vocab_size}; set model.vocab_size >= {vocab}"
            )
        self.train_loader, self.held_loader = build_loaders(
            dc, sets, rank=self.rank, world_size=self.world_size
        )
        self._held_start = self.held_loader.state_dict() if self.held_loader else None
        self.token_bytes = token_byte_lengths(build_tokenizer(dc), self.model_cfg.vocab_size)
        self.tokens_per_step = self.train_loader.tokens_per_step * tc.grad_accum
        self.total_steps = tc.num_steps(self.tokens_per_step)

        # model + optimizer
        self.model = build_model(self.model_cfg, seed=tc.seed, device=self.device)
        self.lp_monitor = None
        if tc.low_precision != "none":
            # Low precision is a converter over the built model (DESIGN habit 12), applied
            # before DDP/FSDP wrap it; parameters are reused, so checkpoints are unchanged.
            from ..precision.policy import PrecisionPolicy, convert_for_low_precision

            # stochastic rounding draws from the global RNG, which checkpoints restore
            report = convert_for_low_precision(self.model, PrecisionPolicy())
            if is_main():
                frac = report.param_fraction()
                print(
                    f"low precision {tc.low_precision}: GEMM parameters "
                    + ", ".join(f"{k} {100 * v:.1f}%" for k, v in frac.items())
                )
        if tc.low_precision != "none" or tc.monitor_zero_grads:
            from ..precision.monitor import LowPrecisionMonitor

            self.lp_monitor = LowPrecisionMonitor(self.model)
        # `self.model` stays the HybridLM (FSDP2 shards it in place); `self.forward_model` is
        # what training forwards go through (the DDP wrapper under DDP).
        self.forward_model: torch.nn.Module = self.model
        if self.parallel == "ddp":
            self.forward_model = apply_ddp(self.model)
        elif self.parallel == "fsdp":
            apply_fsdp2(self.model)
        self.optimizer = build_optimizer(self.model, tc)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.accepts_doc_ids = "doc_ids" in inspect.signature(self.model.forward).parameters
        if tc.intra_doc_masking and not self.accepts_doc_ids:
            print("warning: train.intra_doc_masking is on but HybridLM.forward takes no doc_ids")

        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0
        self._consecutive_skips = 0
        self.resumed_from: Path | None = None
        if resume:
            self._resume()
        barrier()
        self._peak_flops = tc.peak_flops or None
        self.flops_per_token = self.model_cfg.flops_per_token(dc.seq_len, training=True)

    # ------------------------------------------------------------------ resume
    @staticmethod
    def _print(text: str) -> None:
        if is_main():
            print(text)

    def _resume(self) -> None:
        # rank 0 verifies and moves damaged checkpoints aside; the others then take the newest
        if is_main():
            path = resume_checkpoint(self.out, log=self._print)
        barrier()
        if not is_main():
            path = latest_checkpoint(self.out)
        if path is None:
            self._print(f"resume: no checkpoint under {self.out}; starting from scratch")
            if is_main():
                truncate_metrics(self.metrics_path, None)
            return
        if self.parallel == "fsdp":
            from safetensors.torch import load_file

            from .checkpoint import read_meta, set_rng_state

            meta = read_meta(path)
            msd = load_file(str(path / "model.safetensors"))
            if self.model_cfg.tie_embeddings:  # save_model stores a tied matrix once
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
        self.step, self.tokens_seen = meta["step"], meta["tokens_seen"]
        self.skipped_steps = meta.get("skipped_steps", 0)
        self.train_loader.load_state_dict(meta["loader"])
        self.resumed_from = path
        # Rows logged after the checkpoint (by the killed run) are replayed: drop them.
        if is_main():
            truncate_metrics(self.metrics_path, self.step)
        barrier()
        if is_main():
            print(f"resumed from {path} at step {self.step} ({self.tokens_seen} tokens)")

    # ------------------------------------------------------------------ one step
    def _autocast(self):
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _forward(self, batch: dict[str, torch.Tensor], denom: int, **kw: Any):
        extra = {}
        if self.cfg.intra_doc_masking and self.accepts_doc_ids:
            extra["doc_ids"] = batch["doc_ids"].to(self.device)
        model = self.forward_model if self.model.training else self.model
        with self._autocast():
            return model(
                batch["input_ids"].to(self.device),
                batch["labels"].to(self.device),
                num_valid_tokens=denom,
                **extra,
                **kw,
            )

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `grad_accum` micro-batches; returns its metrics."""
        tc = self.cfg
        self.model.train()
        batches = [next(self.train_loader) for _ in range(tc.grad_accum)]
        # low-precision health metrics on the steps that get logged (Nemotron 3 Super §2.3)
        monitor_now = self.lp_monitor is not None and (
            (self.step + 1) % tc.log_interval == 0 or self.step + 1 == self.total_steps
        )
        if monitor_now:
            self.lp_monitor.arm()
        denom = max(1, sum(int(b["num_valid_tokens"]) for b in batches))
        parts: dict[str, float] = defaultdict(float)
        total = 0.0
        W = self.world_size
        for batch in batches:
            out = self._forward(batch, denom, return_logits=tc.z_loss > 0)
            loss = out.loss
            aux = out.losses.get("moe_aux")
            if aux is not None and tc.grad_accum > 1:
                # sequence-mean per call: average it over the micro-batches
                loss = loss + (1.0 / tc.grad_accum - 1.0) * aux
            if tc.z_loss > 0:
                z = _z_loss(out.logits, batch["labels"].to(self.device), denom)
                loss = loss + tc.z_loss * z
                parts["z_loss"] += float(z.detach())
            if W > 1:
                # DDP/FSDP average gradients over ranks; the token-normalised terms sum over
                # ranks to the global mean, so they are scaled by W. The per-rank MoE mean
                # (weight 1/grad_accum in `loss`) is already a mean: averaging is right for it.
                aux_part = aux / tc.grad_accum if aux is not None else 0.0
                (W * (loss - aux_part) + aux_part).backward()
            else:
                loss.backward()
            # reported loss: the global one (token terms summed over ranks, aux averaged)
            total += float(loss.detach())
            for k, v in out.losses.items():
                parts[k] += float(v.detach()) / (tc.grad_accum if k == "moe_aux" else 1)
        if W > 1:
            aux_total = parts.get("moe_aux", 0.0)
            total = all_reduce_sum(total - aux_total) + all_reduce_sum(aux_total) / W
            for k in list(parts):
                parts[k] = all_reduce_sum(parts[k]) / (W if k == "moe_aux" else 1)
        grad_norm = clip_gradients(self.params, tc.grad_clip)
        lp_metrics = self.lp_monitor.collect() if monitor_now else {}  # of the clipped grads
        done = optimizer_step(
            self.model,
            self.optimizer,
            self.params,
            loss=total,
            tc=tc,
            step=self.step,
            total_steps=self.total_steps,
            grad_norm=grad_norm,
            reduce_load=all_reduce_sum if W > 1 else None,
        )
        finite, lr = done.finite, done.lr
        if finite:
            self._consecutive_skips = 0
        else:
            self.skipped_steps += 1
            self._consecutive_skips += 1
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return {
            "step": self.step,
            "loss": total,
            **dict(parts),
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped": not finite,
            "valid_tokens": denom,
            **lp_metrics,
        }

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out CE (nats/token) and bits per byte over `eval_batches` batches (0: all)."""
        if self.held_loader is None:
            return {}
        self.held_loader.load_state_dict(self._held_start)
        self.model.eval()
        try:
            nats, n_tok, n_bytes = eval_sums(
                lambda b: self._forward(b, 1, mtp_depth=0, return_logits=False),
                self.held_loader,
                self.token_bytes,
                max_batches=self.cfg.eval_batches,
            )
        finally:
            self.model.train()
        if self.world_size > 1:
            nats, n_tok, n_bytes = (all_reduce_sum(float(v)) for v in (nats, n_tok, n_bytes))
            n_tok = int(round(n_tok))
        if n_tok == 0:
            return {}
        return {
            "eval_loss": nats / n_tok,
            "eval_bpb": nats / (math.log(2) * n_bytes) if n_bytes else math.nan,
            "eval_tokens": n_tok,
        }

    # ------------------------------------------------------------------ checkpoint
    def save(self) -> Path | None:
        """Write a checkpoint (rank 0; under FSDP every rank joins the gather first)."""
        model, optimizer = self.model, self.optimizer
        if self.parallel == "fsdp":
            msd, osd = full_state_dicts(self.model, self.optimizer)
            if is_main():
                model, optimizer = _plain_copy(self.model_cfg, msd), _FixedState(osd)
        if not is_main():
            barrier()
            return None
        meta = {
            "run_config": self.run.to_dict(),
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "total_steps": self.total_steps,
            "loader": self.train_loader.state_dict(),
        }
        path = save_checkpoint(
            self.out,
            step=self.step,
            model=model,
            optimizer=optimizer,
            meta=meta,
            keep_last_n=self.cfg.keep_last_n,
        )
        barrier()
        return path

    def _log(self, row: dict[str, Any]) -> None:
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
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "train.tensorboard needs the tensorboard package: pip install tensorboard"
                ) from None
            self._tb_writer = SummaryWriter(str(self.out / "tensorboard"))
        return self._tb_writer

    # ------------------------------------------------------------------ loop
    def train(self, *, until_step: int | None = None) -> dict[str, Any]:
        """Run to `total_steps` (or stop after `until_step`, e.g. to simulate a crash)."""
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        tc = self.cfg
        end = self.total_steps if until_step is None else min(until_step, self.total_steps)
        if self._peak_flops is None:
            self._peak_flops = measure_peak_flops(self.device)
        last_ckpt: Path | None = self.resumed_from
        last_eval: dict[str, float] = {}
        window_t, window_tok = time.perf_counter(), 0
        row: dict[str, Any] = {}
        progress = Progress(
            TextColumn("[bold]pretrain"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            disable=not tc.progress or not is_main(),
        )
        with progress:
            task = progress.add_task("", total=self.total_steps, completed=self.step, info="")
            while self.step < end:
                m = self.train_step()
                window_tok += self.tokens_per_step
                if m["skipped"] and is_main():
                    progress.console.print(
                        f"[yellow]step {m['step']}: non-finite loss/grad "
                        f"(loss {m['loss']}, grad norm {m['grad_norm']}); step skipped"
                    )
                    self._log(
                        {
                            "kind": "skip",
                            "step": m["step"],
                            "loss": m["loss"],
                            "grad_norm": m["grad_norm"],
                            "skipped_steps": self.skipped_steps,
                        }
                    )
                if m["skipped"]:
                    if self._consecutive_skips >= tc.max_consecutive_skips:
                        raise RuntimeError(
                            f"{self._consecutive_skips} consecutive non-finite steps; lower "
                            "train.lr, raise train.warmup_steps or use precision fp32"
                        )
                if self.step % tc.log_interval == 0 or self.step == end:
                    now = time.perf_counter()
                    tok_s = window_tok / max(now - window_t, 1e-9)
                    window_t, window_tok = now, 0
                    mfu = self.flops_per_token * tok_s / self._peak_flops
                    row = {
                        "kind": "train",
                        **{k: v for k, v in m.items() if k != "skipped"},
                        "tokens": self.tokens_seen,
                        "tokens_per_s": tok_s,
                        "mfu": mfu,
                        "skipped_steps": self.skipped_steps,
                    }
                    self._log(row)
                    progress.update(
                        task,
                        info=f"loss {m['loss']:.3f}  {tok_s:,.0f} tok/s  MFU {100 * mfu:.1f}%",
                    )
                progress.update(task, completed=self.step)
                final = self.step == self.total_steps
                if tc.eval_interval and self.step % tc.eval_interval == 0 or final:
                    last_eval = self.evaluate()
                    if last_eval and is_main():
                        self._log(
                            {
                                "kind": "eval",
                                "step": self.step,
                                "tokens": self.tokens_seen,
                                **last_eval,
                            }
                        )
                        progress.console.print(
                            f"step {self.step}: eval loss {last_eval['eval_loss']:.4f}, "
                            f"bpb {last_eval['eval_bpb']:.4f}"
                        )
                    window_t = time.perf_counter()  # eval time is not training throughput
                if (tc.checkpoint_interval and self.step % tc.checkpoint_interval == 0) or final:
                    last_ckpt = self.save()
                    window_t = time.perf_counter()
        if self.parallel == "fsdp" and self.step == self.total_steps:
            # The run is over: hand callers (the CLI's sample and export) a plain, unsharded
            # model on every rank, as in a single process.
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            self.model = self.forward_model = _plain_copy(self.model_cfg, full).to(self.device)
        plot = None
        if tc.plot and is_main() and self.metrics_path.exists() and self.step == self.total_steps:
            from .plot import plot_loss_curves

            plot = plot_loss_curves(self.metrics_path, self.out / "loss.png")
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "last_train": row,
            "eval": last_eval,
            "checkpoint": str(last_ckpt) if last_ckpt else None,
            "metrics": str(self.metrics_path),
            "plot": str(plot) if plot else None,
        }


class _FixedState:
    """Stands in for an optimizer whose (gathered) state dict is already at hand."""

    def __init__(self, state: dict) -> None:
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def _plain_copy(cfg, state: dict[str, torch.Tensor]) -> HybridLM:
    """An unsharded CPU HybridLM holding `state` (what a gathered FSDP checkpoint saves)."""
    with torch.device("meta"):
        model = HybridLM(cfg)
    model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()  # assign replaced the shared tensor: share it again
    model.init_buffers()
    return model


def _z_loss(logits_BLV: torch.Tensor, labels_BL: torch.Tensor, denom: int) -> torch.Tensor:
    """sum over CE targets of logsumexp(logits)^2 / denom (Olmo 3 z-loss, PaLM §5)."""
    mask = labels_BL[:, 1:] != IGNORE_INDEX  # target of position t is labels[t + 1]
    lse = torch.logsumexp(logits_BLV[:, :-1].float(), dim=-1)
    return (lse.square() * mask).sum() / denom


def run_pretrain(
    run_cfg: RunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    until_step: int | None = None,
) -> dict[str, Any]:
    """Pretrain from a `RunConfig`; returns final metrics and the last checkpoint's path.

    `resume=True` continues from the newest intact checkpoint under `train.out_dir` (exactly: the
    loss sequence equals that of an uninterrupted run); `overwrite=True` replaces an earlier run
    there (without either, one is an error). `until_step` stops early (the schedule still spans
    the whole run), e.g. to test resumption."""
    trainer = Trainer(run_cfg, resume=resume, overwrite=overwrite)
    if is_main():
        trainer.run.save(Path(run_cfg.train.out_dir) / "run.yaml")
    return trainer.train(until_step=until_step)
