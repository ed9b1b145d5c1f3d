"""A reward model: a `HybridLM` with a scalar `score` head; its scores.

The head (`ModelConfig.num_labels = 1`) is read at a sequence's last token: r(x, y) =
score(h_final[last]) (InstructGPT §3.5; the Nemotron 3 Super RLHF stage rewards with such a
model). `with_score_head` adds a new head to a model (N(0, 1/sqrt(d_model + 1)), as TRL
initialises it); `train.stages.rm` trains it. transformers has no sequence classifier for
NemotronH, so
a trained reward model is its run directory (`hybridlm.io.load_model` loads its newest
checkpoint with the head); `RewardModelScorer` scores token sequences with it (the RL learner's
`reward: rm`), each read as `reward_input` writes it.

Shape legend: B rows, L padded length.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..data.chat import STOP
from ..io import load
from ..model.model import HybridLM, ModelOutput


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


__all__ = ["RewardModelScorer", "reward_input", "sequence_rewards", "with_score_head"]
