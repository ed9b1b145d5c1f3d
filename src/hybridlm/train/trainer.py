"""The pretraining loop: `run_pretrain(run_cfg, resume=False)`.

One optimizer step = `grad_accum` micro-batches from the packed loader. The loss of every
micro-batch is normalised by the *global* count of valid targets of the step (the sum of the
loader's `num_valid_tokens` over the micro-batches; DESIGN habit 13), so accumulation gives the
gradient of the global mean. The MoE sequence-level balancing loss is a mean over sequences of
one call and is divided by `grad_accum`. Then: clip the global grad norm, set the LR from the
schedule, `optimizer.step()`, `model.update_moe_bias()` (aux-loss-free balancing, Nemotron 3
Super §2.1.1). A step whose loss or grad norm is not finite is skipped (no update, no bias step,
expert-load counters cleared) and reported in `metrics.jsonl` and on the console.

Every `log_interval` steps a row goes to `<out>/metrics.jsonl` (kind "train": step, loss, ce,
mtp, mtp_k, moe_aux, z_loss, lr, grad_norm, tokens/s, MFU, tokens, skipped_steps); every
`eval_interval` steps one of kind "eval" (held-out CE and bits per byte). MFU is
`flops_per_token(seq_len, training=True) * tokens/s / peak`, the peak measured once with a matmul
(or `train.peak_flops`). Checkpoints (train.checkpoint) are written every `checkpoint_interval`
steps and at the end; `resume=True` continues from the newest one exactly (weights, optimizer,
loader position, RNG). The loss curve `<out>/loss.png` is rendered from metrics.jsonl at the end.

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

from ..model.model import IGNORE_INDEX, HybridLM
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import RunConfig
from .optim import build_optimizer
from .schedule import lr_for


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


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_byte_lengths(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """Bytes of text each token id stands for (0 for special tokens), for bits per byte."""
    out = torch.zeros(vocab_size, dtype=torch.float64)
    if not hasattr(tokenizer, "id_to_token"):  # ByteTokenizer: ids 0-255 are the bytes
        out[: min(256, vocab_size)] = 1
        return out
    inverse = _bytes_to_unicode()
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
    `until_step`). Construct with `resume=True` to continue from the newest checkpoint."""

    def __init__(self, run: RunConfig, *, resume: bool = False) -> None:
        from ..data.pipeline import build_loaders, build_tokenizer, prepare_shards

        self.run = run.resolved()
        tc, dc = self.run.train, self.run.data
        self.cfg = tc
        self.model_cfg = self.run.model
        self.out = Path(tc.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out / "metrics.jsonl"
        if tc.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(tc.device)
        _seed_all(tc.seed)

        # data
        sets = prepare_shards(dc)
        vocab = max(s.vocab_size for s in sets.values())
        if vocab > self.model_cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} ids but model.vocab_size is "
                f"{self.model_cfg.vocab_size}; set model.vocab_size >= {vocab}"
            )
        self.train_loader, self.held_loader = build_loaders(dc, sets)
        self._held_start = self.held_loader.state_dict() if self.held_loader else None
        self.token_bytes = token_byte_lengths(build_tokenizer(dc), self.model_cfg.vocab_size)
        self.tokens_per_step = self.train_loader.tokens_per_step * tc.grad_accum
        self.total_steps = tc.num_steps(self.tokens_per_step)

        # model + optimizer
        self.model = build_model(self.model_cfg, seed=tc.seed, device=self.device)
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
        elif self.metrics_path.exists():
            self.metrics_path.unlink()  # a fresh run starts a fresh log
        self._peak_flops = tc.peak_flops or None
        self.flops_per_token = self.model_cfg.flops_per_token(dc.seq_len, training=True)

    # ------------------------------------------------------------------ resume
    def _resume(self) -> None:
        path = latest_checkpoint(self.out)
        if path is None:
            print(f"resume: no checkpoint under {self.out}; starting from scratch")
            if self.metrics_path.exists():
                self.metrics_path.unlink()
            return
        meta = load_checkpoint(path, self.model, self.optimizer, restore_rng=True)
        self.step, self.tokens_seen = meta["step"], meta["tokens_seen"]
        self.skipped_steps = meta.get("skipped_steps", 0)
        self.train_loader.load_state_dict(meta["loader"])
        self.resumed_from = path
        # Rows logged after the checkpoint (by the killed run) are replayed: drop them.
        if self.metrics_path.exists():
            from .plot import read_metrics

            keep = [r for r in read_metrics(self.metrics_path) if r.get("step", 0) <= self.step]
            tmp = self.metrics_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            tmp.replace(self.metrics_path)
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
        with self._autocast():
            return self.model(
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
        denom = max(1, sum(int(b["num_valid_tokens"]) for b in batches))
        parts: dict[str, float] = defaultdict(float)
        total = 0.0
        for batch in batches:
            out = self._forward(batch, denom, return_logits=tc.z_loss > 0)
            loss = out.loss
            if "moe_aux" in out.losses and tc.grad_accum > 1:
                # sequence-mean per call: average it over the micro-batches
                loss = loss + (1.0 / tc.grad_accum - 1.0) * out.losses["moe_aux"]
            if tc.z_loss > 0:
                z = _z_loss(out.logits, batch["labels"].to(self.device), denom)
                loss = loss + tc.z_loss * z
                parts["z_loss"] += float(z.detach())
            loss.backward()
            total += float(loss.detach())
            for k, v in out.losses.items():
                parts[k] += float(v.detach()) / (tc.grad_accum if k == "moe_aux" else 1)
        max_norm = tc.grad_clip if tc.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        lr = lr_for(tc, self.step, self.total_steps)
        finite = math.isfinite(total) and math.isfinite(grad_norm)
        if finite:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.model.update_moe_bias()
            self._consecutive_skips = 0
        else:
            self.skipped_steps += 1
            self._consecutive_skips += 1
            for m in self.model.moe_layers():  # this step's routing counts are not applied
                m.load_E.zero_()
        self.optimizer.zero_grad(set_to_none=True)
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
        }

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out CE (nats/token) and bits per byte over `eval_batches` batches (0: all)."""
        if self.held_loader is None:
            return {}
        self.held_loader.load_state_dict(self._held_start)
        self.model.eval()
        nats, n_tok, n_bytes = 0.0, 0, 0.0
        try:
            for k, batch in enumerate(self.held_loader):
                if self.cfg.eval_batches and k >= self.cfg.eval_batches:
                    break
                # num_valid_tokens=1 turns the mean into the sum of nats
                out = self._forward(batch, 1, mtp_depth=0, return_logits=False)
                nats += float(out.losses["ce"])
                tgt = batch["labels"][:, 1:]
                tgt = tgt[tgt != IGNORE_INDEX]
                n_tok += tgt.numel()
                n_bytes += float(self.token_bytes[tgt].sum())
        finally:
            self.model.train()
        if n_tok == 0:
            return {}
        return {
            "eval_loss": nats / n_tok,
            "eval_bpb": nats / (math.log(2) * n_bytes) if n_bytes else math.nan,
            "eval_tokens": n_tok,
        }

    # ------------------------------------------------------------------ checkpoint
    def save(self) -> Path:
        meta = {
            "run_config": self.run.to_dict(),
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "total_steps": self.total_steps,
            "loader": self.train_loader.state_dict(),
        }
        return save_checkpoint(
            self.out,
            step=self.step,
            model=self.model,
            optimizer=self.optimizer,
            meta=meta,
            keep_last_n=self.cfg.keep_last_n,
        )

    def _log(self, row: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

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
            disable=not tc.progress,
        )
        with progress:
            task = progress.add_task("", total=self.total_steps, completed=self.step, info="")
            while self.step < end:
                m = self.train_step()
                window_tok += self.tokens_per_step
                if m["skipped"]:
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
                    if last_eval:
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
        plot = None
        if tc.plot and self.metrics_path.exists() and self.step == self.total_steps:
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


def _z_loss(logits_BLV: torch.Tensor, labels_BL: torch.Tensor, denom: int) -> torch.Tensor:
    """sum over CE targets of logsumexp(logits)^2 / denom (Olmo 3 z-loss, PaLM §5)."""
    mask = labels_BL[:, 1:] != IGNORE_INDEX  # target of position t is labels[t + 1]
    lse = torch.logsumexp(logits_BLV[:, :-1].float(), dim=-1)
    return (lse.square() * mask).sum() / denom


def run_pretrain(
    run_cfg: RunConfig, *, resume: bool = False, until_step: int | None = None
) -> dict[str, Any]:
    """Pretrain from a `RunConfig`; returns final metrics and the last checkpoint's path.

    `resume=True` continues from the newest checkpoint under `train.out_dir` (exactly: the loss
    sequence equals that of an uninterrupted run). `until_step` stops early (the schedule still
    spans the whole run), e.g. to test resumption."""
    trainer = Trainer(run_cfg, resume=resume)
    run_cfg_path = Path(run_cfg.train.out_dir) / "run.yaml"
    trainer.run.save(run_cfg_path)
    return trainer.train(until_step=until_step)
