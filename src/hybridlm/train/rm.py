"""Bradley-Terry reward models: `run_rm(cfg)` and `hybridlm rm`.

The reward model is the same `HybridLM` with a scalar `score` head (`ModelConfig.num_labels =
1`) read at a sequence's last token: r(x, y) = score(h_final[last]) (InstructGPT §3.5; the
Nemotron 3 Super RLHF stage rewards with such a model). It starts from `train.init_from` (the
SFT model; the head is new, N(0, 1/sqrt(d_model + 1)) as TRL initialises it) and is trained on
preference pairs with the Bradley-Terry loss

    L = -log sigmoid(r(x, y_chosen) - r(x, y_rejected))   [+ center_coef * (r_c + r_r)^2]

(the optional term keeps rewards centred, TRL's `center_rewards_coefficient`). The pairs are
DPO's (`data`: a file, delta learning, or verifier-labelled samples of a model, `verified`),
with the same filtering, held-out split and data order (`train.dpo.PairwiseStage`).

Metrics: loss, accuracy (the fraction of pairs with r_c > r_r), margin (mean r_c - r_r) and the
mean chosen / rejected rewards, on training and held-out pairs. transformers has no sequence
classifier for NemotronH, so the artifact is the run directory (`hybridlm.io.load_model` loads
its newest checkpoint with the head); `RewardModelScorer` scores token sequences with it (the
RL learner's `reward: rm`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..data.chat import STOP
from ..io import load
from ..model.model import HybridLM, ModelOutput
from .config import TrainConfig
from .dpo import DPODataConfig, PairwiseStage, TokenizedPair, collate_pairs
from .parallel import is_main
from .post_training import PostTrainingRunConfig, moe_balancing
from .trainer import Loss, Runtime, Step, Trainer, initial_model


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

    data: DPODataConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    rm: RMConfig = field(default_factory=RMConfig)


def with_score_head(model: HybridLM, *, seed: int = 0) -> HybridLM:
    """`model` with a new scalar `score` head (a model that has one is returned as is)."""
    if model.config.num_labels:
        if model.config.num_labels != 1:
            raise ValueError(f"a reward model has 1 label, this model {model.config.num_labels}")
        return model
    cfg = dataclasses.replace(model.config, num_labels=1)
    device = model.embeddings.weight.device
    rm = HybridLM.empty(cfg, device)  # the weights copied: `model` keeps its own
    missing, unexpected = rm.load_state_dict(model.state_dict(), strict=False)
    if set(missing) != {"score.weight"} or unexpected:
        raise RuntimeError(f"unexpected keys adding the score head: {missing} {unexpected}")
    g = torch.Generator().manual_seed(seed)
    d = cfg.d_model
    w = torch.randn(rm.score.weight.shape, generator=g) / math.sqrt(d + 1)
    with torch.no_grad():
        rm.score.weight.copy_(w)
    return rm.train(model.training)


def sequence_rewards(
    model: HybridLM,
    ids_BL: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    forward: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, ModelOutput]:
    """r [B] (fp32): the score head at each row's last token (rows right-padded: a causal model
    never sees the padding), and the forward's output (its MoE balancing loss)."""
    if model.score is None:
        raise ValueError("not a reward model: the model has no score head (num_labels 0)")
    rows = torch.arange(ids_BL.shape[0], device=ids_BL.device)
    last_B = lengths_B.to(ids_BL.device) - 1

    def score(out: ModelOutput) -> torch.Tensor:  # inside the forward: data parallelism sees it
        return model.score(out.hidden[rows, last_B]).float()[:, 0]

    out = (forward or model)(ids_BL, return_logits=False, head=score)
    return out.head, out


def bradley_terry_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, *, center_coef: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair -log sigmoid(r_c - r_r) (+ center_coef (r_c + r_r)^2) and per-pair metrics."""
    diff = r_chosen - r_rejected
    loss = -F.logsigmoid(diff)
    if center_coef:
        loss = loss + center_coef * (r_chosen + r_rejected) ** 2
    metrics = {
        "accuracy": (diff > 0).float(),
        "margin": diff.detach(),
        "reward_chosen": r_chosen.detach(),
        "reward_rejected": r_rejected.detach(),
    }
    return loss, metrics


class RewardModelTraining(PairwiseStage):
    """A Bradley-Terry reward model trained on pairs (module docstring)."""

    stage = "rm"
    plot_train = ("loss", "accuracy", "margin")
    plot_eval = ("eval_loss", "eval_accuracy", "eval_margin")

    def __init__(self, run: RMRunConfig, rt: Runtime) -> None:
        self.rc = run.rm
        super().__init__(run, rt, run.data)

    def initial_model(self) -> HybridLM:
        return with_score_head(initial_model(self.tc, None, self.device), seed=self.tc.seed)

    def progress_info(self, row: dict[str, Any]) -> str:
        return f"loss {row['loss']:.4f} acc {row['accuracy']:.2f}"

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

    def summary(self) -> dict[str, Any]:
        return {"data": self.data_summary(), "model": str(self.out)}


def reward_input(ids: Sequence[int], tokenizer: Any) -> list[int]:
    """A conversation's token ids as the reward model reads them: as `encode_chat` renders a
    finished turn, with the newline after its end-of-turn string (a sampled reply ends at the
    string itself; the score head was trained at the newline)."""
    out = list(ids)
    stop = tokenizer.encode(STOP, add_bos=False)
    if stop and out[-len(stop) :] == stop:
        out += tokenizer.encode("\n", add_bos=False)
    return out


class RewardModelScorer:
    """Scores token sequences with a trained reward model (a run directory, a checkpoint):
    `score(sequences)` -> one float per sequence, batched, in eval mode. The sequences are token
    ids of the model's tokenizer (`tokenizer`), e.g. a rollout's prompt + completion exactly as
    sampled."""

    def __init__(
        self, path: str | Path, *, device: str | torch.device = "cpu", batch_size: int = 16
    ) -> None:
        loaded = load(path)
        self.model = loaded.model.float().to(device).eval()
        if self.model.score is None:
            raise ValueError(
                f"{path} is not a reward model (no score head); train one: hybridlm rm"
            )
        self.tokenizer = loaded.tokenizer
        self.device, self.batch_size = torch.device(device), batch_size

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        out: list[float] = []
        for i in range(0, len(sequences), self.batch_size):
            rows = [list(s) for s in sequences[i : i + self.batch_size]]
            if any(not r for r in rows):
                raise ValueError("cannot score an empty sequence")
            L = max(len(r) for r in rows)
            ids = torch.zeros(len(rows), L, dtype=torch.long)
            for b, r in enumerate(rows):
                ids[b, : len(r)] = torch.tensor(r)
            lengths = torch.tensor([len(r) for r in rows])
            r, _ = sequence_rewards(self.model, ids.to(self.device), lengths)
            out += [float(x) for x in r]
        return out


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


__all__ = [
    "RMConfig",
    "RMRunConfig",
    "RewardModelScorer",
    "bradley_terry_loss",
    "reward_input",
    "run_rm",
    "sequence_rewards",
    "with_score_head",
]
