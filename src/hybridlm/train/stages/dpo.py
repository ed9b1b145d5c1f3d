"""Direct preference optimisation: `run_dpo(cfg)` and `hybridlm dpo`.

Shape legend: B pairs per micro-batch, L padded length, V vocabulary.

Data: preference pairs (`train.pairs`: read from a file or built by delta learning, tokenised,
length-gap filtered, batched; the `data` section is a `PairDataConfig`), trained on by the
`PairwiseModule` this stage extends.

Loss (`train.objectives.dpo_loss`): `dpo` (beta 0.1 by default) or length-normalised
`dpo_norm` (beta 5, Olmo 3 Instruct). The log-probs are the sum (or mean) over the completion's
assistant tokens; the reference model's log-probs are computed once before training and cached
on disk under `<ref_cache_dir>/ref_logps-<key>.pt`, the key hashing the tokenised pairs and the
reference weights, so a second run (an LR sweep) skips the reference forwards. The loss of an
optimizer step is the mean over its pairs (all micro-batches), so accumulation gives the
big-batch gradient.

Each batch stacks chosen and rejected sequences, right-padded, in one forward: the model is
causal, so padding after a sequence does not change its log-probs (no mask needed).

Metrics (`metrics.jsonl`, kind "train" / "eval"): loss, reward accuracy, reward margin, chosen
and rejected rewards (beta * (log pi - log ref)) and the chosen / rejected policy log-probs.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ...data.sft import Conversation, ReadReport
from ...files import atomic_write
from ...model.model import HybridLM, ModelOutput
from ..config import TrainConfig
from ..distributed.parallel import is_main
from ..objectives import dpo_loss, sequence_logps
from ..pairs import PairDataConfig, PairwiseModule, TokenizedPair, collate_pairs
from ..post_training import (
    ChatSource,
    PostTrainingRunConfig,
    answer_matches,
    generate_replies,
    load_source,
    moe_balancing,
    progress_bar,
    prompt_and_answer,
    prompt_key,
)
from ..trainer import Loss, Runtime, Step, Trainer

DEFAULT_BETA = {"dpo": 0.1, "dpo_norm": 5.0}


# ---------------------------------------------------------------------------- log-probs
def policy_logps(
    model: HybridLM, batch: Mapping[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion log-probs [2B], completion token counts [2B])."""
    logits = model(batch["input_ids"].to(device)).logits
    return sequence_logps(logits, batch["labels"].to(device))


def _state_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def pairs_hash(pairs: Sequence[TokenizedPair]) -> str:
    h = hashlib.sha256()
    for p in pairs:
        for s in (p.chosen, p.rejected):
            h.update(np.asarray(s.input_ids, dtype=np.int64).tobytes())
            h.update(np.asarray(s.loss_mask, dtype=np.bool_).tobytes())
            h.update(b"|")
    return h.hexdigest()


@torch.no_grad()
def reference_logps(
    ref_model: HybridLM,
    pairs: Sequence[TokenizedPair],
    *,
    cache_dir: str | Path | None,
    batch_size: int = 8,
    pad_id: int = 0,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Reference log-probs of every pair: (chosen [N], rejected [N], loaded from cache?).

    Cached at `<cache_dir>/ref_logps-<sha256(pairs, weights)[:24]>.pt`; `cache_dir=None`
    computes without caching."""
    key = hashlib.sha256((pairs_hash(pairs) + _state_hash(ref_model)).encode()).hexdigest()[:24]
    file = Path(cache_dir) / f"ref_logps-{key}.pt" if cache_dir is not None else None
    if file is not None and file.is_file():
        try:
            data = torch.load(file, weights_only=True)
            return data["chosen"], data["rejected"], True
        except (RuntimeError, OSError, EOFError, KeyError, pickle.UnpicklingError) as err:
            # a cache is only a shortcut: a damaged one is computed again and replaced
            print(f"reference cache {file} is unreadable ({type(err).__name__}); recomputing")
    device = next(ref_model.parameters()).device
    was_training = ref_model.training
    ref_model.eval()
    chosen, rejected = [], []
    try:
        with progress_bar("reference log-probs", progress) as bar:
            task = bar.add_task("", total=len(pairs), info="")
            for i in range(0, len(pairs), batch_size):
                chunk = pairs[i : i + batch_size]
                lp, _ = policy_logps(ref_model, collate_pairs(chunk, pad_id), device)
                chosen.append(lp[: len(chunk)].double().cpu())
                rejected.append(lp[len(chunk) :].double().cpu())
                bar.update(task, advance=len(chunk))
    finally:
        ref_model.train(was_training)
    c, r = torch.cat(chosen), torch.cat(rejected)
    if file is not None:
        # every rank of a job computes the same cache; each writes through its own temporary
        atomic_write(file, lambda fh: torch.save({"chosen": c, "rejected": r}, fh))
    return c, r, False


# ---------------------------------------------------------------------------- configs
@dataclass(kw_only=True)
class DPOConfig:
    """The DPO objective, reference and evaluation; the policy starts from `train.init_from`
    (usually the SFT model)."""

    ref_from: str = ""  # the reference model; "" = train.init_from
    loss: Literal["dpo", "dpo_norm"] = "dpo_norm"
    beta: float = 0.0  # 0: the default of the loss (dpo 0.1, dpo_norm 5)
    ref_cache_dir: str = ""  # "" = <out_dir>/ref_cache
    # held-out conversations with reference answers: exact match of greedy replies (the first
    # `eval_generate`; prompts that also occur in the pairs are removed)
    eval_source: ChatSource | None = None
    eval_generate: int = 64
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if self.loss not in DEFAULT_BETA:
            raise ValueError(f"dpo.loss must be 'dpo' or 'dpo_norm', got {self.loss!r}")
        if self.beta < 0:
            raise ValueError(f"dpo.beta must be >= 0 (0 = default), got {self.beta}")

    @property
    def effective_beta(self) -> float:
        return self.beta or DEFAULT_BETA[self.loss]


@dataclass(kw_only=True)
class DPORunConfig(PostTrainingRunConfig):
    """`data`, `train`, `dpo` sections; the model comes from `train.init_from`."""

    REQUIRED = ("data", "dpo")
    WHAT = "DPO run config"

    data: PairDataConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    dpo: DPOConfig


# ---------------------------------------------------------------------------- the trainer
class DPO(PairwiseModule):
    """Policy, reference log-probs and pairs of one DPO run."""

    stage = "dpo"
    plot_train = ("loss", "reward_accuracy", "reward_margin")
    plot_eval = ("eval_loss", "eval_reward_accuracy", "eval_reward_margin", "eval_accuracy")

    progress_keys = ("loss", "reward_accuracy")

    def __init__(self, run: DPORunConfig, rt: Runtime) -> None:
        super().__init__(run, rt, run.data)
        tc, dc, pc = run.train, run.data, run.dpo
        self.pc = pc
        self.beta = pc.effective_beta
        self.eval_convs: list[Conversation] = []
        if pc.eval_source is not None:
            seen = {prompt_key(p.prompt + p.chosen) for p in self.pairs}
            convs = load_source(pc.eval_source, ReadReport())
            clean = [c for c in convs if prompt_key(c) not in seen]
            self.dropped["eval prompts also in the pairs"] = len(convs) - len(clean)
            self.eval_convs = clean[: pc.eval_generate]

        # reference log-probs, once (cached on disk)
        ref = (
            self.model
            if not pc.ref_from or pc.ref_from == tc.init_from
            else self.generator_model(pc.ref_from, "dpo.ref_from").float()
        )
        cache = pc.ref_cache_dir or str(self.out / "ref_cache")
        all_pairs = self.train_pairs + self.held_pairs
        c, r, self.ref_cached = reference_logps(
            ref,
            all_pairs,
            cache_dir=cache,
            batch_size=dc.batch_size,
            pad_id=self.pad_id,
            progress=tc.progress,
        )
        n = len(self.train_pairs)
        self.ref_train = (c[:n], r[:n])
        self.ref_held = (c[n:], r[n:])
        del ref

    # ------------------------------------------------------------------ steps
    def _loss(
        self, idx: Sequence[int], pairs: Sequence[TokenizedPair], ref: tuple, denom: int
    ) -> tuple[torch.Tensor, dict[str, float], ModelOutput]:
        batch = collate_pairs([pairs[i] for i in idx], self.pad_id)
        model = self.forward_model if self.model.training else self.model
        with self.rt.autocast():
            out = model(batch["input_ids"].to(self.device))
            lp, n = sequence_logps(out.logits, batch["labels"].to(self.device))
        B = len(idx)
        sel = torch.tensor(idx)
        ref_c = ref[0][sel].to(self.device, lp.dtype)
        ref_r = ref[1][sel].to(self.device, lp.dtype)
        losses, m = dpo_loss(
            lp[:B],
            lp[B:],
            ref_c,
            ref_r,
            beta=self.beta,
            kind=self.pc.loss,
            chosen_tokens_B=n[:B],
            rejected_tokens_B=n[B:],
        )
        parts = {k: float(v.sum()) / denom for k, v in m.items()}
        parts["logp_chosen"] = float(lp[:B].detach().sum()) / denom
        parts["logp_rejected"] = float(lp[B:].detach().sum()) / denom
        return losses.sum() / denom, parts, out

    def loss(self, micro: list[int], step: Step) -> Loss:
        value, metrics, out = self._loss(
            micro, self.train_pairs, self.ref_train, self.pairs_per_step
        )
        # the routers keep their balancing loss in every stage that trains them (§2.1.1)
        return moe_balancing(value, metrics, out, self.tc.grad_accum)

    def held_out_loss(self, idx: list[int], denom: int) -> tuple[torch.Tensor, dict[str, float]]:
        loss, parts, _ = self._loss(idx, self.held_pairs, self.ref_held, denom)
        return loss, parts

    def generation_eval(self) -> dict[str, float]:
        """Exact match of greedy replies on `dpo.eval_source`'s held-out questions."""
        if not self.eval_convs:
            return {}
        pa = [prompt_and_answer(c) for c in self.eval_convs]
        replies = generate_replies(
            self.model,
            self.tokenizer,
            [p for p, _ in pa],
            max_new_tokens=self.pc.max_new_tokens,
        )
        hits = sum(answer_matches(r, a) for r, (_, a) in zip(replies, pa, strict=True))
        return {"eval_accuracy": hits / len(pa)}

    def data_summary(self) -> dict[str, Any]:
        return {
            **super().data_summary(),
            "ref_logps_from_cache": self.ref_cached,
            "beta": self.beta,
            "loss": self.pc.loss,
        }


def dpo_trainer(cfg: DPORunConfig, *, resume: bool = False, overwrite: bool = False) -> Trainer:
    """The Trainer of a DPO run, ready to `train()`."""
    return Trainer(cfg.train, lambda rt: DPO(cfg, rt), resume=resume, overwrite=overwrite)


def run_dpo(
    cfg: DPORunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    until_step: int | None = None,
) -> dict[str, Any]:
    """Run DPO from a config; returns final metrics, checkpoint and plot paths. `resume` /
    `overwrite`: continue or replace an earlier run in `train.out_dir` (as `run_sft`)."""
    trainer = dpo_trainer(cfg, resume=resume, overwrite=overwrite)
    if is_main():
        cfg.save(Path(cfg.train.out_dir) / "run.yaml")
    return trainer.train(until_step=until_step)
