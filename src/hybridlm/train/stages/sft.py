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
SFT, DPO and distillation runs alike: `post_training.export_hf`).

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

from ...config import ModelConfig
from ...stage import Flow, Report, Stage, scalars
from ..config import TrainConfig
from ..distributed.parallel import is_main
from ..objectives import sft_token_weights, shift_targets_float, token_nll
from ..post_training import ChatModule, PostTrainingRunConfig, SFTDataConfig, moe_balancing
from ..trainer import Loss, Runtime, Step, Trainer

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
class SFT(ChatModule):
    """Assistant-only CE (+ MTP, MoE balancing) on the run's chats; the data, evaluation and
    checkpoints are `ChatModule`'s."""

    stage = "sft"
    plot_train = ("loss", "nll_token", "mtp")
    progress_keys = ("norm", "loss", "nll_token")

    def __init__(self, run: SFTRunConfig, rt: Runtime) -> None:
        sc = self.sc = run.sft
        super().__init__(run, rt, eval_generate=sc.eval_generate, max_new_tokens=sc.max_new_tokens)
        self.mtp_depth = self.model_cfg.mtp.depth if sc.mtp_depth < 0 else sc.mtp_depth
        if self.model.mtp is None:
            self.mtp_depth = 0

    def norm_at(self, step: int) -> str:
        return self.sc.norm_at(step, self.total_steps)

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


# ---------------------------------------------------------------------------- the flow's stage
def _stage_settings(flow: Flow) -> dict[str, Any]:
    data = flow.format_paths(flow.cfg.sft.to_dict())
    data["train"]["out_dir"] = str(flow.stage_dir("sft"))
    data["data"]["tokenizer"] = flow.tokenizer_spec()
    data["train"]["init_from"] = flow.model_path("sft")
    return data


def _stage_run(flow: Flow) -> dict[str, Any]:
    cfg = SFTRunConfig.from_dict(flow.settings("sft"))
    result = flow.continue_or_start("sft", lambda **kw: run_sft(cfg, **kw))
    return {"model": str(flow.stage_dir("sft")), **scalars(result)}


def _headline(s: dict[str, Any], report: Report) -> str:
    ev = s.get("eval") or {}
    acc = ev.get("eval_accuracy")
    text = f"steps: {s.get('step')}"
    if ev.get("eval_loss") is not None:
        text += f"; held-out NLL: {ev['eval_loss']:.3f} nats/token"
    if acc is not None:
        n = min(report.get("sft.sft.eval_generate", 0), report.get("sft.data.held_out", 0))
        text += f"; SFT exact match: {acc:.2f}" + (f" (n={n})" if n else "")
    return text


# chat SFT (assistant-only loss, packing, MTP loss) from the newest model
STAGE = Stage(
    "sft",
    inputs=("tokenizer",),
    config=SFTRunConfig,
    settings=_stage_settings,
    run=_stage_run,
    model="model",
    headline=_headline,
)
