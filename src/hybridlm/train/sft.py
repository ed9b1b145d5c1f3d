"""Supervised fine-tuning: `run_sft(cfg)` and `hybridlm sft`.

Shape legend: B rows, L `data.seq_len`, V vocabulary.

A run is one YAML file with four sections (`configs/sft.yaml`):

    model: tiny-super          # used only when train.init_from is empty (a fresh model)
    data: {...}                # SFTDataConfig: chat sources, tokenizer, packing, reasoning modes
    train: {...}               # hybridlm.train.config.TrainConfig (optimizer, schedule, loop)
    sft: {...}                 # SFTConfig: init checkpoint, loss normalisation, MTP weight, eval

Per optimizer step: `train.grad_accum` packed micro-batches (`hybridlm.data.sft.SFTLoader`);
the loss is assistant-only CE with `token` or `sample` normalisation over the whole step
(`train.objectives`), switched from token to sample at `sft.stage2_start` of the steps with
`loss_norm: two_stage` (Nemotron 3 Super §4.2), plus the MTP loss (weight 0.3, the mean of the
depths, each depth's targets weighted like the next-token ones and never crossing a packed
conversation) and the MoE balancing loss. Optimizer, LR schedule, checkpoints (exact resume:
weights, optimizer, loader position, RNG) and `metrics.jsonl` are the pretraining ones
(`train.optim`, `train.schedule`, `train.checkpoint`). The final weights are also written as a
transformers directory `<out>/hf` with the tokenizer, chat template and generation config (the
SFT, DPO and distillation runs alike: `PostTrainingLoop.export_hf`).

Evaluation (`eval_interval`, at step 0 and at the end): held-out assistant-token NLL, and exact
match of the final answers that the model generates greedily for `sft.eval_generate` held-out
prompts (the content of the last assistant turn, compared after stripping whitespace). The
held-out conversations are drawn before the reasoning-mode transforms, and every training
conversation with the same prompt as a held-out one is removed (generated sets repeat
questions). `train.precision: bf16` runs the forwards under autocast (fp32 master weights).
Runs are single-process; the loss is already normalised by global counts, so data parallelism
only needs the counts all-reduced over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..config import ModelConfig
from ..data.sft import SFTLoader
from .config import TrainConfig
from .objectives import sft_token_weights, shift_targets_float, token_nll
from .parallel import is_main
from .post_training import (
    PostTrainingRunConfig,
    SFTDataConfig,
    answer_matches,
    export_hf,
    generate_replies,
    moe_balancing,
    pad_id_of,
    prepare_chat_data,
    prompt_and_answer,
)
from .trainer import (
    Loss,
    Runtime,
    Step,
    Trainer,
    TrainModule,
    check_tokenizer,
    initial_model,
    run_tokenizer,
)

LossNorm = Literal["token", "sample", "two_stage"]


# ---------------------------------------------------------------------------- configs
@dataclass(kw_only=True)
class SFTConfig:
    """The SFT objective and its evaluation."""

    loss_norm: LossNorm = "two_stage"
    stage2_start: float = 0.7  # two_stage: fraction of the steps run with token normalisation
    mtp_weight: float = 0.3  # Nemotron 3 Super §4.2: MTP continues in SFT with weight 0.3
    mtp_depth: int = -1  # -1: the model's mtp.depth
    eval_generate: int = 32  # held-out prompts answered greedily for exact match (0: none)
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if self.loss_norm not in ("token", "sample", "two_stage"):
            raise ValueError(f"sft.loss_norm must be token, sample or two_stage: {self.loss_norm}")
        if not 0 <= self.stage2_start <= 1:
            raise ValueError(f"sft.stage2_start must be in [0, 1], got {self.stage2_start}")
        if self.mtp_weight < 0 or self.eval_generate < 0 or self.max_new_tokens < 1:
            raise ValueError("sft.mtp_weight, eval_generate >= 0 and max_new_tokens >= 1")

    def norm_at(self, step: int, total_steps: int) -> str:
        """The loss normalisation of optimizer step `step` (0-based)."""
        if self.loss_norm != "two_stage":
            return self.loss_norm
        return "token" if step < round(self.stage2_start * total_steps) else "sample"


@dataclass(kw_only=True)
class SFTRunConfig(PostTrainingRunConfig):
    WHAT = "SFT run config"

    model: ModelConfig | str = "tiny-super"
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


# ---------------------------------------------------------------------------- the trainer
class SFT(TrainModule):
    """Chat data, assistant-only CE (+ MTP, MoE balancing), held-out NLL and exact match."""

    stage = "sft"
    plot_train = ("loss", "nll_token", "mtp")
    plot_eval = ("eval_loss", "eval_accuracy")
    rate_key = "tokens_per_s"

    @property
    def units_per_step(self) -> int:
        return self.tokens_per_step

    def progress_info(self, row: dict[str, Any]) -> str:
        return f"{row['norm']} loss {row['loss']:.3f} nll/tok {row['nll_token']:.3f}"

    def __init__(self, run: SFTRunConfig, rt: Runtime) -> None:

        super().__init__(rt)
        self.run = run
        tc, dc, sc = run.train, run.data, run.sft
        self.tc, self.dc, self.sc = tc, dc, sc
        self.device = rt.device
        self.tokenizer = run_tokenizer(dc, tc)

        # data: read, hold out, transform, tokenise
        data = prepare_chat_data(dc, self.tokenizer)
        self.read_report, self.held_convs = data.read_report, data.held_convs
        self.train_convs = data.train_convs
        self.mode_counts, self.dropped = data.mode_counts, data.dropped
        self.held_examples = data.held_examples
        # data parallelism: every rank packs the global batch of world * batch_size rows, each
        # trains on its own rows (Runtime.shard), the loss normalised by the global counts
        self.loader = SFTLoader(
            data.examples,
            seq_len=dc.seq_len,
            batch_size=dc.batch_size * rt.world_size,
            seed=dc.seed,
            pad_id=pad_id_of(self.tokenizer),
        )
        self.tokens_per_step = dc.batch_size * rt.world_size * dc.seq_len * tc.grad_accum
        self.total_steps = tc.num_steps(self.tokens_per_step)

        # model
        self.model = initial_model(tc, run.model, self.device)
        self.model_cfg = self.model.config
        check_tokenizer(self.tokenizer, self.model, "train.init_from" if tc.init_from else "model")
        self.mtp_depth = self.model_cfg.mtp.depth if sc.mtp_depth < 0 else sc.mtp_depth
        if self.model.mtp is None:
            self.mtp_depth = 0
        self.step = 0  # steps whose data was read

    # ------------------------------------------------------------------ one step
    def prepare_step(self, step: int) -> Step:
        norm = self.sc.norm_at(step, self.total_steps)
        batches = [next(self.loader) for _ in range(self.tc.grad_accum)]
        self.step = step + 1
        n_tok = sum(int(b["num_loss_tokens"]) for b in batches)
        n_conv = sum(int(b["num_conversations"]) for b in batches)
        return Step(
            [self.rt.shard(b) for b in batches],
            ctx={"norm": norm, "num_tokens": n_tok, "num_convs": n_conv},
            info={"norm": norm, "loss_tokens": n_tok, "conversations": n_conv},
        )

    def loss(self, micro: dict[str, torch.Tensor], step: Step) -> Loss:
        """This micro-batch's share of the step's loss and its parts (module docstring)."""
        dev = self.device
        norm, num_tokens = step.ctx["norm"], step.ctx["num_tokens"]
        ids_BL, labels_BL = micro["input_ids"].to(dev), micro["labels"].to(dev)
        doc_BL = micro["doc_ids"].to(dev)
        with self.rt.autocast():
            out = self.forward_model(
                ids_BL, doc_ids=doc_BL, mtp_depth=self.mtp_depth, return_logits=True
            )
        w_BL = sft_token_weights(
            labels_BL,
            micro["conv_ids"].to(dev),
            mode=norm,
            num_tokens=num_tokens,
            num_conversations=step.ctx["num_convs"],
        )
        mask_BL = (labels_BL != -100).float()
        nll_BL = token_nll(out.logits, labels_BL, 1)
        ce = (nll_BL * shift_targets_float(w_BL, 1)).sum()
        metrics = {
            "ce": float(ce.detach()),
            # the token-mean NLL of the step whatever the normalisation: comparable across stages
            "nll_token": float((nll_BL.detach() * shift_targets_float(mask_BL, 1)).sum())
            / max(1, num_tokens),
        }
        value = ce
        if self.mtp_depth > 0:
            mtp_terms = []
            for k, logits_k in enumerate(out.mtp_logits, start=1):
                nll_k = token_nll(logits_k, labels_BL, k + 1)
                w_k = shift_targets_float(w_BL, k + 1)
                same = torch.zeros_like(w_k, dtype=torch.bool)
                same[:, : -(k + 1)] = doc_BL[:, : -(k + 1)] == doc_BL[:, k + 1 :]
                mtp_terms.append((nll_k * w_k * same).sum())
            mtp = torch.stack(mtp_terms).mean()
            value = value + self.sc.mtp_weight * mtp
            metrics["mtp"] = float(mtp.detach())
        return moe_balancing(value, metrics, out, self.tc.grad_accum)

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out assistant-token NLL and greedy exact match."""
        if not self.held_examples:
            return {}
        self.model.eval()
        try:
            loader = SFTLoader(
                self.held_examples,
                seq_len=self.dc.seq_len,
                batch_size=self.dc.batch_size,
                sequential=True,
            )
            nats, n = 0.0, 0
            for batch in loader:
                labels_BL = batch["labels"].to(self.device)
                out = self.model(
                    batch["input_ids"].to(self.device),
                    doc_ids=batch["doc_ids"].to(self.device),
                )
                nats += float(token_nll(out.logits, labels_BL, 1).sum())
                n += int(batch["num_loss_tokens"])
            row: dict[str, float] = {"eval_loss": nats / max(1, n)}
            k = min(self.sc.eval_generate, len(self.held_convs))
            if k:
                pairs = [prompt_and_answer(c) for c in self.held_convs[:k]]
                replies = generate_replies(
                    self.model,
                    self.tokenizer,
                    [p for p, _ in pairs],
                    max_new_tokens=self.sc.max_new_tokens,
                )
                hits = sum(answer_matches(r, a) for r, (_, a) in zip(replies, pairs, strict=True))
                row["eval_accuracy"] = hits / k
                self.last_replies = replies
        finally:
            self.model.train()
        return row

    # ------------------------------------------------------------------ checkpoints + log
    def run_config(self) -> dict[str, Any]:
        return {**self.run.to_dict(), "model": self.model_cfg.to_dict()}

    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": self.step * self.tokens_per_step, "loader": self.loader.state_dict()}

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        self.step = meta["step"]
        self.loader.load_state_dict(meta["loader"])

    def data_summary(self) -> dict[str, Any]:
        return {
            "read": self.read_report.summary(),
            "modes": dict(self.mode_counts),
            "dropped": dict(self.dropped),
            "train_conversations": len(self.loader.examples),
            "held_out": len(self.held_examples),
            "rows_per_epoch": self.loader.rows_per_epoch,
        }

    def export(self) -> Path | None:
        return export_hf(self.model, self.rt.out, self.tokenizer, self.stage)

    def summary(self) -> dict[str, Any]:
        return {"data": self.data_summary()}


def sft_trainer(cfg: SFTRunConfig, *, resume: bool = False, overwrite: bool = False) -> Trainer:
    """The Trainer of an SFT run, ready to `train()`."""
    return Trainer(cfg.train, lambda rt: SFT(cfg, rt), resume=resume, overwrite=overwrite)


def run_sft(
    cfg: SFTRunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    until_step: int | None = None,
) -> dict[str, Any]:
    """Run SFT from a config; returns the final metrics, checkpoint and plot paths.
    `resume=True` continues exactly from the newest intact checkpoint under `train.out_dir`;
    `overwrite=True` replaces an earlier run there (without either, one is an error)."""
    trainer = sft_trainer(cfg, resume=resume, overwrite=overwrite)
    if is_main():
        cfg.save(Path(cfg.train.out_dir) / "run.yaml")
    return trainer.train(until_step=until_step)
