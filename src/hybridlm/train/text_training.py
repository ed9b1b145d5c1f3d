"""Language-model training on packed text, the `TrainModule` of the pretrain, midtrain and
long-context stages: `run_pretrain(run_cfg)` (`hybridlm pretrain`), `pretrain_trainer(run_cfg)`
its `Trainer`; `HeldOutEvaluator` scores other weights on a run's held-out split (merged
checkpoints, `train.stages.merge`; extended models, `eval.long_context`).

One optimizer step = `grad_accum` micro-batches from the packed loader. The loss of every
micro-batch is normalised by the *global* count of valid targets of the step (the sum of the
loader's `num_valid_tokens` over the micro-batches and ranks; DESIGN habit 13), so accumulation
and data parallelism give the gradient of the global mean: CE, MTP (Nemotron 3 Super §2.1.3) and
the Olmo 3 z-loss are such shares; the MoE sequence-level balancing loss is a mean over the
sequences of one call (`Loss.mean`). The update, the MoE bias step and skipped non-finite steps
are the Trainer's (`train.loop`).

Data parallelism (`torchrun --nproc_per_node=N`, train.parallel "ddp" or "fsdp"): each rank reads
its B rows of the global batch of N*B rows; `num_valid_tokens` is already the global count.
Metrics, progress, plots and checkpoints are written by rank 0 only; under FSDP the full model
and optimizer state are gathered first, so checkpoints have the single-process layout and resume
at any world size with the same global batch.

Every `log_interval` steps a row goes to `<out>/metrics.jsonl` (kind "train": step, loss, ce,
mtp, mtp_k, moe_aux, z_loss, lr, grad_norm, tokens/s, MFU, tokens, skipped_steps); every
`eval_interval` steps one of kind "eval" (held-out CE and bits per byte). MFU is
`flops_per_token(seq_len, training=True) * tokens/s / peak`, the peak measured once with a matmul
(or `train.peak_flops`). The loss curve `<out>/loss.png` is rendered from metrics.jsonl at the
end.

Bits per byte (held-out): sum of CE nats / (ln 2 * bytes of the target text). Byte tokenizer:
a target's bytes are 1 for ids < 256, 0 for BOS/EOS. Byte-level BPE: the bytes of each token's
byte-level string (exact); special tokens count 0 and added text tokens their UTF-8 length.

Pretraining by distillation (`distill`, `TeacherConfig`; Nemotron 3.5 §2.2, Lightning from
the top-128 logits of a larger base): the CE term becomes `kl_weight * KL(p_T^top-k || q_S) +
ce_weight * CE` over the same targets and global count (MTP, MoE and z-loss terms unchanged),
with `kl` in the train rows and the held-out `eval_kl`. The teacher runs on every batch under
no_grad (`distill.teacher`, seeing the rows as the student does), or its top-k is read from a
cache aligned with the data shards (`distill.teacher_cache`, `hybridlm distill-cache
--pretraining`; `train.teacher_cache`), built once for this `seq_len`: each document piece is
seen alone, so it needs `train.intra_doc_masking` and best-fit packing.

Warm start (`train.init_from`, e.g. Olmo 3 midtraining §4 or a long-context extension): the
model is loaded from any loadable path instead of initialised; optimizer and schedule are fresh.
`train.yarn` rescales its full-attention RoPE for a longer context (`HybridLM.extend_context`),
and `data.alternate` mixes long and short sequences in turn (`AlternatingLoader`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from pathlib import Path
from typing import Any

import torch

from ..data.bpb import eval_sums, token_byte_lengths
from ..data.pipeline import build_loaders, build_tokenizer, prepare_shards
from ..model.model import IGNORE_INDEX
from ..model.stock import project
from ..report.plot import plot_loss_curves
from .callbacks import Callback, Plot, Summary
from .config import RunConfig
from .distributed.context_parallel import context_parallel_of
from .distributed.parallel import is_main, on_main
from .objectives import causal_lm_loss, shift_targets, topk_forward_kl, z_loss
from .teacher import check_vocab, load_teacher, teacher_topk_at
from .teacher_cache import TextTeacherTopK
from .trainer import (
    Loss,
    Runtime,
    Step,
    Trainer,
    TrainModule,
    initial_model,
    resolve_tokenizer,
)


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


class Pretrain(TrainModule):
    """Packed documents, next-token CE + MTP + MoE balancing (+ z-loss), held-out CE and bits
    per byte."""

    stage = "pretrain"
    eval_at_start = False
    context_parallel = True

    def __init__(self, run: RunConfig, rt: Runtime) -> None:

        super().__init__(rt)
        tc, dc = run.train, run.data
        # warm start (train.init_from): the loaded model's config is the run's (checkpoints
        # record what was trained)
        self.model = initial_model(tc, run.model, rt.device, meta=rt.meta_init)
        longest = max(dc.seq_len, dc.alternate.seq_len if dc.alternate else 0)
        rescaled = self.model.extend_context(longest, tc.yarn)
        if tc.yarn is not None and is_main():
            print(
                f"YaRN x{tc.yarn.factor:g} from {tc.yarn.original_max_position_embeddings} "
                f"tokens on {len(rescaled)} full-attention RoPE layer(s)"
                + ("" if rescaled else " (none: NoPE / Mamba layers need nothing)")
            )
        run = dataclasses.replace(run, model=self.model.config)
        self.run, model_cfg = run, run.model
        if rt.cp > 1 and tc.z_loss > 0:
            raise ValueError("train.z_loss needs the logits of whole rows; it does not take cp > 1")
        # rank 0 tokenises and writes the shards; the others wait, then open the same files
        sets = on_main(lambda: prepare_shards(dc), share=False)
        if not is_main():
            sets = prepare_shards(dc)  # finds the manifest and reuses every shard
        vocab = max(s.vocab_size for s in sets.values())
        if vocab > model_cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} ids but model.vocab_size is "
                f"{model_cfg.vocab_size}; set model.vocab_size >= {vocab}"
            )
        self.train_loader, self.held_loader = build_loaders(
            dc, sets, rank=rt.rank, world_size=rt.world_size
        )
        self._held_start = self.held_loader.state_dict() if self.held_loader else None
        self.token_bytes = token_byte_lengths(build_tokenizer(dc), model_cfg.vocab_size)
        self.tokens_per_step = self.train_loader.tokens_per_step * tc.grad_accum
        self.total_steps = tc.num_steps(self.tokens_per_step)
        self.accepts_doc_ids = "doc_ids" in inspect.signature(self.model.forward).parameters
        if tc.intra_doc_masking and not self.accepts_doc_ids:
            print("warning: train.intra_doc_masking is on but HybridLM.forward takes no doc_ids")
        self.flops_per_token = model_cfg.flops_per_token(dc.seq_len, training=True)
        self.step = 0  # steps whose data was read (the loader position's step)
        self.teacher, self.cache = self._teacher(run, rt, sets)

    def _teacher(
        self, run: RunConfig, rt: Runtime, sets: dict[str, Any]
    ) -> tuple[Any, TextTeacherTopK | None]:
        """Pretraining by distillation (`run.distill`, Nemotron 3.5 §2.2): the teacher model,
        or the cached top-k of every source that stands in for it."""
        dd = run.distill
        if not dd.enabled:
            return None, None
        if rt.cp > 1 or rt.tp > 1:
            raise ValueError(
                "distill needs whole rows and a whole LM head: it does not take "
                "train.parallel.cp > 1 or tp > 1"
            )
        if dd.teacher_cache:
            if (
                not run.train.intra_doc_masking
                or run.data.packing != "best_fit"
                or run.data.alternate is not None
            ):
                raise ValueError(
                    "distill.teacher_cache needs train.intra_doc_masking, data.packing best_fit "
                    "and no data.alternate: the cache holds the teacher's view of each document "
                    "piece alone, cut at data.seq_len"
                )
            cache = TextTeacherTopK(dd.teacher_cache, sets, seq_len=run.data.seq_len)
            check_vocab(self.model, cache.vocab_size, f"cache {dd.teacher_cache}")
            return None, cache
        teacher = load_teacher(dd.teacher, device=rt.device, tokenizer=build_tokenizer(run.data))
        check_vocab(self.model, teacher.config.vocab_size, dd.teacher)
        return teacher, None

    def _teacher_topk(
        self, batch: dict[str, torch.Tensor], mask_BL: torch.Tensor, names: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k (log-probs or logits [T, k], ids [T, k]) at the positions
        `mask_BL` selects: read from the cache (`names`: the loader's sources, which its
        `source_ids` index), or computed now without gradients."""
        dd, dev = self.run.distill, self.rt.device
        if self.cache is not None:
            top, ids = self.cache.lookup(
                names,
                batch["source_ids"],
                batch["token_index"],
                mask_BL,
                dd.top_k,
            )
            return top.to(dev), ids.to(dev)
        with torch.no_grad(), self.rt.autocast():  # the student's view of the rows
            doc_BL = batch["doc_ids"].to(dev) if self.rt.tc.intra_doc_masking else None
            logits = self.teacher(batch["input_ids"].to(dev), doc_ids=doc_BL).logits
        return teacher_topk_at(logits, mask_BL.to(dev), dd.top_k, dev)

    # ------------------------------------------------------------------ steps
    def _loss(
        self,
        batch: dict[str, torch.Tensor],
        denom: int,
        names: list[str] | None = None,
        **kw: Any,
    ) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
        """(forward output, loss without the MoE term, its parts) of one batch (`names`: the
        sources its loader's `source_ids` index)."""
        tc, dev = self.rt.tc, self.rt.device
        doc_ids = None
        if tc.intra_doc_masking and self.accepts_doc_ids:
            doc_ids = batch["doc_ids"].to(dev)
        model = self.forward_model if self.model.training else self.model
        labels = batch["labels"].to(dev)
        input_ids, model_doc_ids, own = batch["input_ids"].to(dev), doc_ids, None
        cp = context_parallel_of(self.model)
        if cp is not None:  # this rank's shard of every row; targets shift on the whole rows
            input_ids = cp.shard(input_ids)
            model_doc_ids = None if doc_ids is None else cp.shard(doc_ids)
            start = cp.offset(input_ids.shape[1])
            own = slice(start, start + input_ids.shape[1])

        distill = self.run.distill if self.run.distill.enabled else None
        if distill is not None:  # the positions with a target, as the CE's
            mask_BL = shift_targets(labels, 1) != IGNORE_INDEX
            teacher_topk = self._teacher_topk(batch, mask_BL.cpu(), names or [])

        def head(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            value, parts = causal_lm_loss(
                self.model,
                out,
                labels,
                doc_ids=doc_ids,
                num_valid_tokens=denom,
                include_aux=False,
                seq_slice=own,
            )
            if distill is not None:
                # kl_weight * KL + ce_weight * CE in place of the CE (MTP, MoE terms unchanged)
                # the student's logits at those positions only (the CE stays fused)
                s_TV = (
                    out.logits[mask_BL]
                    if out.logits is not None
                    else project(self.model.lm_head, out.hidden[mask_BL])
                )
                kl = topk_forward_kl(
                    s_TV, *teacher_topk, temperature=distill.temperature, denom=denom
                )
                value = value + distill.kl_weight * kl - (1 - distill.ce_weight) * parts["ce"]
                parts["kl"] = kl
            return value, parts

        with self.rt.autocast():
            # the loss runs inside the forward (`head`): under DDP / FSDP2 the LM-head weight
            # of the fused cross-entropy is used where the wrappers expect it
            out = model(input_ids, doc_ids=model_doc_ids, head=head, **kw)
        value, parts = out.head
        return out, value, parts

    def prepare_step(self, step: int) -> Step:
        batches = [next(self.train_loader) for _ in range(self.rt.tc.grad_accum)]
        self.step = step + 1
        denom = max(1, sum(int(b["num_valid_tokens"]) for b in batches))
        return Step(batches, ctx={"denom": denom}, info={"valid_tokens": denom})

    def loss(self, micro: dict[str, torch.Tensor], step: Step) -> Loss:
        tc = self.rt.tc
        denom = step.ctx["denom"]
        out, value, parts = self._loss(
            micro,
            denom,
            getattr(self.train_loader, "names", None),
            mtp_depth=self.model.train_mtp_depth,
            return_logits=tc.z_loss > 0,
        )
        # the balancing loss is a mean over the step's micro-batches (Loss.mean), not a sum;
        # under context parallelism each rank holds its shard's part of its rows' loss: the
        # cp parts add up, so their average over ranks is scaled back by cp
        aux = parts.get("moe_aux")
        if aux is not None and self.rt.cp > 1:
            aux = aux * self.rt.cp
        metrics = {k: float(v.detach()) for k, v in parts.items() if k != "moe_aux"}
        if aux is not None:
            metrics["moe_aux"] = float(aux.detach()) / tc.grad_accum
        if tc.z_loss > 0:
            z = z_loss(out.logits, micro["labels"].to(self.rt.device), denom)
            value = value + tc.z_loss * z
            metrics["z_loss"] = float(z.detach())
        return Loss(value, metrics, mean=aux)

    def callbacks(self) -> list[Callback]:
        return [
            TokensAndMFU(self),
            Plot(lambda metrics: plot_loss_curves(metrics, self.rt.out / "loss.png")),
            Summary(lambda: {"tokens_seen": self.step * self.tokens_per_step}),
        ]

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out CE (nats/token) and bits per byte over `eval_batches` batches (0: all)."""
        if self.held_loader is None:
            return {}
        self.held_loader.load_state_dict(self._held_start)
        self.model.eval()
        kl_sums: list[float] = []  # distilling: the held-out KL to the teacher too

        def ce_sum(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            parts = self._loss(
                batch, 1, getattr(self.held_loader, "names", None), return_logits=False
            )[2]
            if "kl" in parts:
                kl_sums.append(float(parts["kl"]))
            return parts["ce"]

        try:
            nats, n_tok, n_bytes = eval_sums(
                ce_sum, self.held_loader, self.token_bytes, max_batches=self.rt.tc.eval_batches
            )
        finally:
            self.model.train()
        # every rank of a context-parallel group scores its shard of the same rows: the nats
        # add up, the rows' tokens and bytes are counted by each of the `cp` ranks
        nats, n_bytes = self.rt.reduce_sum(nats), self.rt.reduce_sum(n_bytes) / self.rt.cp
        n_tok = int(round(self.rt.reduce_sum(n_tok) / self.rt.cp))
        if n_tok == 0:
            return {}
        row = {
            "tokens": self.step * self.tokens_per_step,
            "eval_loss": nats / n_tok,
            "eval_bpb": nats / (math.log(2) * n_bytes) if n_bytes else math.nan,
            "eval_tokens": n_tok,
        }
        if kl_sums:  # KL(p_T^top-k || q_S) per target token
            row["eval_kl"] = self.rt.reduce_sum(sum(kl_sums)) / n_tok
        return row

    # ------------------------------------------------------------------ checkpoint + end
    def run_config(self) -> dict[str, Any]:
        return self.run.to_dict()

    def state_dict(self) -> dict[str, Any]:
        return {
            "tokens_seen": self.step * self.tokens_per_step,
            "loader": self.train_loader.state_dict(),
        }

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        self.step = meta["step"]
        self.train_loader.load_state_dict(meta["loader"])


class TokensAndMFU(Callback):
    """Tokens seen, tokens/s and MFU in every train row (`flops_per_token` x tokens/s over the
    matmul peak, measured once on the device unless `train.peak_flops` pins it), shown in the
    progress bar."""

    def __init__(self, module: Pretrain) -> None:
        self.m, self.peak = module, module.rt.tc.peak_flops or None

    def log_fields(self, trainer: Trainer, steps: int, seconds: float) -> dict[str, float]:
        m = self.m
        if self.peak is None:
            self.peak = measure_peak_flops(m.rt.device)
        tok_s = steps * m.tokens_per_step / max(seconds, 1e-9)
        return {
            "tokens": m.step * m.tokens_per_step,
            "tokens_per_s": tok_s,
            "mfu": m.flops_per_token * tok_s / self.peak,
        }

    def progress(self, row: dict[str, Any]) -> str:
        return (
            f"loss {row['loss']:.3f}  {row['tokens_per_s']:,.0f} tok/s  MFU {100 * row['mfu']:.1f}%"
        )


def pretrain_trainer(
    run_cfg: RunConfig, *, resume: bool = False, overwrite: bool = False
) -> Trainer:
    """The Trainer of a pretraining run (`run_cfg.resolved()`), ready to `train()`."""
    run = run_cfg.resolved()
    resolve_tokenizer(run.data, run.train)
    return Trainer(run.train, lambda rt: Pretrain(run, rt), resume=resume, overwrite=overwrite)


def load_merged(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a (merged) checkpoint state dict; tied weights are stored once, so a missing tied
    partner is fine, anything else is an error."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight", "embeddings.weight"} if model.config.tie_embeddings else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(
            f"merged weights do not match the run's model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )


class HeldOutEvaluator:
    """The trainer's eval path for a run, without training: a `Trainer` built from the run's
    config (shards reused) whose weights are swapped in before each call (`load_merged`):
    what merged checkpoints (`train.stages.merge`) and extended models (`eval.long_context`) are
    scored with."""

    def __init__(self, run: RunConfig, scratch: str | Path) -> None:
        # A Trainer claims its out_dir for a new run (and refuses one holding a run): point it at
        # an empty scratch dir so the run's own directory is only read.
        run = dataclasses.replace(
            run, train=dataclasses.replace(run.train, out_dir=str(scratch), progress=False)
        )
        self.trainer = pretrain_trainer(run)
        if self.trainer.module.held_loader is None:
            raise ValueError(
                "the run has no held-out split (data.eval_fraction is 0); nothing to compare "
                "merges on"
            )

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    def __call__(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        load_merged(self.trainer.model, state)
        return self.trainer.module.evaluate()


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
    trainer = pretrain_trainer(run_cfg, resume=resume, overwrite=overwrite)
    if is_main():
        trainer.module.run.save(Path(run_cfg.train.out_dir) / "run.yaml")
    return trainer.train(until_step=until_step)
