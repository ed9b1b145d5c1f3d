"""Bradley-Terry reward models: `run_rm(cfg)` and `hybridlm rm`.

The reward model (`train.reward_model`: a `HybridLM` with a scalar `score` head read at a
sequence's last token) starts from `train.init_from` (the SFT model; the head is new) and is
trained on preference pairs with the Bradley-Terry loss (`train.objectives.bradley_terry_loss`)

    L = -log sigmoid(r(x, y_chosen) - r(x, y_rejected))   [+ center_coef * (r_c + r_r)^2]

(the optional term keeps rewards centred, TRL's `center_rewards_coefficient`). The pairs are
DPO's (`data`: a file, delta learning, or verifier-labelled samples of a model, `verified`),
with the same filtering, held-out split and data order (`train.pairs.PairwiseModule`).

Metrics: loss, accuracy (the fraction of pairs with r_c > r_r), margin (mean r_c - r_r) and the
mean chosen / rejected rewards, on training and held-out pairs. The artifact is the run
directory: `train.reward_model.RewardModelScorer` scores token sequences with it (the RL
learner's `reward: rm`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...model.model import HybridLM, ModelOutput
from ..callbacks import Callback, Summary
from ..config import TrainConfig
from ..distributed.parallel import is_main
from ..objectives import bradley_terry_loss
from ..pairs import PairDataConfig, PairwiseModule, TokenizedPair, collate_pairs
from ..post_training import PostTrainingRunConfig, moe_balancing
from ..reward_model import sequence_rewards, with_score_head
from ..trainer import Loss, Runtime, Step, Trainer, initial_model


@dataclass(kw_only=True)
class RMConfig:
    center_coef: float = 0.0  # weight of (r_c + r_r)^2 (TRL suggests 0.01); 0: off

    def __post_init__(self) -> None:
        if self.center_coef < 0:
            raise ValueError(f"rm.center_coef must be >= 0, got {self.center_coef}")


@dataclass(kw_only=True)
class RMRunConfig(PostTrainingRunConfig):
    """`data` (preference pairs, as DPO's), `train` (init_from: the SFT model) and `rm`."""

    REQUIRED = ("data",)
    WHAT = "reward model run config"

    data: PairDataConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    rm: RMConfig = field(default_factory=RMConfig)


class RewardModelTraining(PairwiseModule):
    """A Bradley-Terry reward model trained on pairs (module docstring)."""

    stage = "rm"
    plot_train = ("loss", "accuracy", "margin")
    plot_eval = ("eval_loss", "eval_accuracy", "eval_margin")

    def __init__(self, run: RMRunConfig, rt: Runtime) -> None:
        self.rc = run.rm
        super().__init__(run, rt, run.data)

    def initial_model(self) -> HybridLM:
        return with_score_head(initial_model(self.tc, None, self.device), seed=self.tc.seed)

    progress_keys = ("loss", "accuracy")

    def _loss(
        self, idx: Sequence[int], pairs: Sequence[TokenizedPair], denom: int
    ) -> tuple[torch.Tensor, dict[str, float], ModelOutput]:
        chosen = [pairs[i] for i in idx]
        batch = collate_pairs(chosen, self.pad_id)
        lengths = torch.tensor([len(p.chosen) for p in chosen] + [len(p.rejected) for p in chosen])
        model = self.forward_model if self.model.training else self.model
        with self.rt.autocast():
            r, out = sequence_rewards(
                self.model, batch["input_ids"].to(self.device), lengths, forward=model
            )
        B = len(idx)
        losses, m = bradley_terry_loss(r[:B], r[B:], center_coef=self.rc.center_coef)
        parts = {k: float(v.sum()) / denom for k, v in m.items()}
        return losses.sum() / denom, parts, out

    def loss(self, micro: list[int], step: Step) -> Loss:
        value, metrics, out = self._loss(micro, self.train_pairs, self.pairs_per_step)
        return moe_balancing(value, metrics, out, self.tc.grad_accum)

    def held_out_loss(self, idx: list[int], denom: int) -> tuple[torch.Tensor, dict[str, float]]:
        loss, parts, _ = self._loss(idx, self.held_pairs, denom)
        return loss, parts

    def callbacks(self) -> list[Callback]:
        return [*super().callbacks(), Summary(lambda: {"model": str(self.out)})]


def rm_trainer(cfg: RMRunConfig, *, resume: bool = False, overwrite: bool = False) -> Trainer:
    """The Trainer of a reward-model run, ready to `train()`."""
    return Trainer(
        cfg.train, lambda rt: RewardModelTraining(cfg, rt), resume=resume, overwrite=overwrite
    )


def run_rm(
    cfg: RMRunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    until_step: int | None = None,
) -> dict[str, Any]:
    """Train a reward model from a config; returns final metrics, checkpoint and plot paths.
    `resume` / `overwrite`: continue or replace an earlier run in `train.out_dir`."""
    trainer = rm_trainer(cfg, resume=resume, overwrite=overwrite)
    if is_main():
        cfg.save(Path(cfg.train.out_dir) / "run.yaml")
    return trainer.train(until_step=until_step)


__all__ = ["RMConfig", "RMRunConfig", "run_rm"]
