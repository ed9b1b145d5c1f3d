"""What the distillation stages share (`distill`, `qad`; SPEC §3 "Distillation"): the
`distill` config section and run config, the offline loss and `OfflineDistiller`, training on
chats toward a frozen teacher or its cached top-k.

Shape legend: B rows, L sequence, V vocabulary, K teacher top-k, T selected token positions.

Offline distillation (`distill.mode: offline`, and QAD) is the SFT stage's chat training
(`post_training.ChatModule`: chat data, assistant-only masks, best-fit packing, optimizer,
schedule, checkpoints with exact resume, metrics.jsonl, held-out NLL and greedy exact match)
with the loss of each packed micro-batch replaced by a distillation loss against a frozen
teacher whose logits are computed on the fly under no_grad:

* `objective: topk_forward_kl` — `kl_weight * KL(p_T^top-k || q_S) + ce_weight * CE` with the
  teacher's top-`top_k` logits (Nemotron 3.5 Lightning: top-128 logits, forward KL + CE with
  weights 0.9 / 0.1; `train.objectives.distill_loss`);
* `objective: skew_reverse_kl` — `kl_weight * KL(q_S || a p_T + (1 - a) q_S) + ce_weight * CE`
  (the skew reverse KL used for Nemotron 3 Super, alpha = `skew_alpha`, default 0.1).

Both are summed over the step's assistant tokens and divided by their global count, so gradient
accumulation gives the gradient of the step mean. The student may be smaller than the teacher
(another config) but must share its vocabulary. With `distill.teacher_cache` the cached top-k
(`train.teacher_cache`) stands in for the teacher (the top-k forward KL only; the skew reverse
KL needs the full distribution).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..model.model import HybridLM
from .callbacks import Callback, StartRows
from .config import TeacherConfig, TrainConfig
from .objectives import (
    IGNORE_INDEX,
    distill_loss,
    hidden_mse,
    shift_targets,
    skew_reverse_kl,
    topk_forward_kl,
)
from .post_training import (
    ChatModule,
    PostTrainingRunConfig,
    SFTDataConfig,
    moe_balancing,
)
from .teacher import TeacherOut, check_vocab, load_teacher, teacher_topk_at
from .teacher_cache import TeacherTopK
from .trainer import Loss, Runtime, Step

Mode = Literal["offline", "on_policy"]
PROXIMAL = "proximal"  # the route of MOPD stage 2's proximal teacher (DistillConfig)
Objective = Literal["topk_forward_kl", "skew_reverse_kl"]


# ---------------------------------------------------------------------------- configs
@dataclass(kw_only=True)
class PromptSource:
    """Prompts of one domain for on-policy distillation. `kind`: `arithmetic` (generated
    "What is a ± b?" chats), `gsm8k` (GSM8K JSONL at `path`), `file` (chat JSONL / Parquet at
    `path`; the last assistant turn, if any, is the reference answer) or `humaneval`
    (HumanEval JSONL(.gz) at `path`; the function stub is the user turn, no reference). gsm8k
    and humaneval read the packaged copies (GSM8K train) when `path` is empty."""

    domain: str
    kind: Literal["arithmetic", "gsm8k", "file", "humaneval"] = "arithmetic"
    path: str = ""
    max_rows: int = 0
    digits: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.domain:
            raise ValueError("every distill.prompts entry needs a domain (a key of distill.routes)")
        if self.kind == "file" and not self.path:
            raise ValueError(f"a prompt source of kind {self.kind!r} needs a path")
        if self.kind == "arithmetic" and self.max_rows <= 0:
            raise ValueError("an arithmetic prompt source needs max_rows > 0")


@dataclass(kw_only=True)
class DistillConfig(TeacherConfig):
    """The distillation objective, teacher(s) and evaluation (module docstring); the teacher,
    top-k, weights, temperature and cache settings are `TeacherConfig`'s."""

    mode: Mode = "offline"
    # offline
    objective: Objective = "topk_forward_kl"
    skew_alpha: float = 0.1  # skew reverse KL mixing weight of the teacher
    # + hidden_weight * MSE of the final hidden states vs the teacher's (same d_model; offline,
    # with a loaded teacher)
    hidden_weight: float = 0.0
    # on-policy (MOPD)
    teachers: dict[str, str] = field(default_factory=dict)  # name -> checkpoint
    routes: dict[str, str] = field(default_factory=dict)  # prompt domain -> teacher name
    prompts: list[PromptSource] = field(default_factory=list)
    prompts_per_step: int = 8
    samples_per_prompt: int = 1
    max_new_tokens: int = 64  # sampled completion length
    on_policy_loss: Literal["full", "sampled"] = "full"
    # MOPD stage 2 (Nemotron 3.5 §3.6: the agentic and reasoning teachers retired, a proximal
    # teacher for stability). The report leaves the proximal teacher open; here it is a slowly
    # moving copy of the student: an exponential moving average of its weights, updated after
    # every step with this decay (0: stage 1, no proximal teacher). Prompts routed to
    # `proximal` (the retired teachers' domains) are distilled toward it alone, so what stage 1
    # taught them moves only as fast as the average; the others toward the normalised geometric
    # mixture p_T^w p_prox^(1 - w), w = `proximal_teacher_weight`, a target that never lies far
    # from where the student was.
    proximal_decay: float = 0.0
    proximal_teacher_weight: float = 0.5
    executor: Literal["inline", "ray"] = "inline"
    num_workers: int = 1
    # eval
    eval_generate: int = 32  # held-out prompts answered greedily for exact match (0: none)
    eval_max_new_tokens: int = 96

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in ("offline", "on_policy"):
            raise ValueError(f"distill.mode must be offline or on_policy, got {self.mode!r}")
        if self.objective not in ("topk_forward_kl", "skew_reverse_kl"):
            raise ValueError(
                "distill.objective must be topk_forward_kl or skew_reverse_kl, "
                f"got {self.objective!r}"
            )
        if self.hidden_weight < 0:
            raise ValueError(f"distill.hidden_weight must be >= 0, got {self.hidden_weight}")
        if not 0 < self.skew_alpha <= 1:
            raise ValueError(f"distill.skew_alpha must be in (0, 1], got {self.skew_alpha}")
        if self.prompts_per_step < 1 or self.samples_per_prompt < 1 or self.max_new_tokens < 1:
            raise ValueError("distill.prompts_per_step, samples_per_prompt, max_new_tokens >= 1")
        if self.on_policy_loss not in ("full", "sampled"):
            raise ValueError(
                f"distill.on_policy_loss must be full or sampled: {self.on_policy_loss}"
            )
        if not 0 <= self.proximal_decay < 1 or not 0 <= self.proximal_teacher_weight <= 1:
            raise ValueError(
                "distill.proximal_decay must be in [0, 1) and proximal_teacher_weight in [0, 1]"
            )
        if self.eval_generate < 0 or self.eval_max_new_tokens < 1 or self.num_workers < 1:
            raise ValueError("distill.eval_generate >= 0, eval_max_new_tokens, num_workers >= 1")

    def check(self) -> None:
        """The settings the chosen mode needs (checked when a run starts)."""
        if self.mode == "offline" and not (self.teacher or self.teacher_cache):
            raise ValueError(
                "distill.mode offline needs distill.teacher (a checkpoint path) or "
                "distill.teacher_cache (a cache `hybridlm distill-cache` wrote)"
            )
        if self.mode == "offline" and self.teacher_cache and self.objective != "topk_forward_kl":
            raise ValueError(
                f"distill.objective {self.objective} needs the teacher's full distribution; a "
                "teacher cache holds its top-k: use topk_forward_kl or drop distill.teacher_cache"
            )
        if self.mode == "offline" and self.teacher_cache and self.hidden_weight:
            raise ValueError(
                "distill.hidden_weight needs the teacher's hidden states; a teacher cache holds "
                "its top-k logits: set hidden_weight 0 or drop distill.teacher_cache"
            )
        if self.mode == "on_policy":
            self._check_routing()

    def _check_routing(self) -> None:
        if PROXIMAL in self.teachers:
            raise ValueError(f"{PROXIMAL!r} is the proximal teacher's route, not a teacher name")
        if PROXIMAL in self.routes.values() and not self.proximal_decay:
            raise ValueError(
                f"distill.routes sends prompts to {PROXIMAL!r}: set distill.proximal_decay > 0 "
                "(MOPD stage 2's proximal teacher)"
            )
        if not self.teachers and not self.proximal_decay:
            raise ValueError("distill.mode on_policy needs distill.teachers: {name: checkpoint}")
        if not self.prompts:
            raise ValueError("distill.mode on_policy needs distill.prompts (a list of sources)")
        domains = {p.domain for p in self.prompts}
        unrouted = sorted(domains - set(self.routes))
        if unrouted:
            raise ValueError(
                f"prompt domain(s) {unrouted} have no teacher: add them to distill.routes "
                f"(domain -> one of {sorted(self.teachers)})"
            )
        unknown = sorted(
            {t for t in self.routes.values() if t not in self.teachers and t != PROXIMAL}
        )
        if unknown:
            raise ValueError(
                f"distill.routes names teacher(s) {unknown} that are not in distill.teachers "
                f"{sorted(self.teachers)}"
            )


@dataclass(kw_only=True)
class DistillRunConfig(PostTrainingRunConfig):
    REQUIRED = ("distill",)
    WHAT = "distillation run config"

    model: ModelConfig | str = "tiny-super"
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


# ---------------------------------------------------------------------------- offline
def offline_distill_loss(
    student_logits_BLV: torch.Tensor,
    teacher: TeacherOut,
    labels_BL: torch.Tensor,
    dc: DistillConfig,
    *,
    denom: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The offline loss of one micro-batch over its assistant positions (logits at t predict
    labels[t + 1]), summed and divided by the step's global token count `denom`. `teacher`: the
    teacher's logits [B, L, V], or a function from the selected positions [B, L] to the
    teacher's top-k (log-probs [T, k], ids [T, k]), e.g. a cache lookup (`TeacherTopK`)."""
    targets_BL = shift_targets(labels_BL, 1)
    mask_BL = targets_BL != IGNORE_INDEX
    s_TV = student_logits_BLV[mask_BL]
    tgt_T = targets_BL[mask_BL]
    if dc.objective == "topk_forward_kl":
        top_TK, ids_TK = teacher_topk_at(teacher, mask_BL, dc.top_k, s_TV.device)
        loss, parts = distill_loss(
            s_TV,
            tgt_T,
            top_TK,
            ids_TK,
            kl_weight=dc.kl_weight,
            ce_weight=dc.ce_weight,
            temperature=dc.temperature,
            denom=denom,
        )
        kl, ce = parts["kl"], parts["ce"]
    else:
        if callable(teacher):
            raise ValueError(f"distill.objective {dc.objective} needs the teacher's logits")
        t_TV = teacher[mask_BL].float()
        kl_t = skew_reverse_kl(s_TV, t_TV, alpha=dc.skew_alpha, denom=denom)
        ce_t = F.cross_entropy(s_TV.float(), tgt_T, reduction="sum") / denom
        loss = dc.kl_weight * kl_t + dc.ce_weight * ce_t
        kl, ce = kl_t.detach(), ce_t.detach()
    return loss, {"kl": float(kl), "ce": float(ce), "nll_token": float(ce)}


class OfflineDistiller(ChatModule):
    """Training on chats toward a teacher (SFT's data, loop, checkpoints and eval, `ChatModule`):
    the micro-batch loss is `offline_distill_loss` over the global token count, and evals add
    the held-out top-k forward KL. `distill.mode: offline` runs it; QAD builds on it."""

    stage = "distill"
    plot_train = ("loss", "kl", "ce")
    plot_eval = ("eval_loss", "eval_accuracy", "eval_kl")
    progress_keys = ("loss", "kl", "ce")

    def __init__(self, run: DistillRunConfig, rt: Runtime) -> None:
        dc = self.dcfg = run.distill
        super().__init__(
            run, rt, eval_generate=dc.eval_generate, max_new_tokens=dc.eval_max_new_tokens
        )
        self.teacher: HybridLM | None = None
        self.cache: dict[str, TeacherTopK] = {}
        if dc.teacher_cache:  # the cached top-k stands in for the teacher
            self.cache["train"] = TeacherTopK(dc.teacher_cache, "train", self.loader.examples)
            if self.held_examples:
                self.cache["held"] = TeacherTopK(dc.teacher_cache, "held", self.held_examples)
            check_vocab(self.model, self.cache["train"].vocab_size, f"cache {dc.teacher_cache}")
        else:
            self.teacher = load_teacher(dc.teacher, device=self.device, tokenizer=self.tokenizer)
            check_vocab(self.model, self.teacher.config.vocab_size, dc.teacher)

    def teacher_out(
        self,
        ids_BL: torch.Tensor,
        doc_BL: torch.Tensor,
        batch: dict[str, torch.Tensor],
        split: str,
        *,
        hidden: bool = False,
    ) -> tuple[TeacherOut, torch.Tensor | None]:
        """What `offline_distill_loss` takes as the teacher: the cache's lookup for this batch's
        positions, or the teacher's logits (computed here, without gradients); and with
        `hidden` the teacher's final hidden states [B, L, D]."""
        if self.cache:
            cache, k = self.cache[split], self.dcfg.top_k
            conv_BL, pos_BL = batch["conv_ids"], batch["position_ids"]
            return (lambda mask_BL: cache.lookup(conv_BL, pos_BL, mask_BL.cpu(), k)), None
        assert self.teacher is not None
        with torch.no_grad():
            out = self.teacher(ids_BL, doc_ids=doc_BL, mtp_depth=0, return_hidden=hidden)
        return out.logits, out.hidden

    def objective(self, micro: dict[str, torch.Tensor]) -> DistillConfig:
        """The loss settings of this micro-batch (`distill`: every batch here)."""
        return self.dcfg

    def loss(self, micro: dict[str, torch.Tensor], step: Step) -> Loss:
        objective = self.objective(micro)
        dev, hw = self.device, objective.hidden_weight
        ids_BL, labels_BL = micro["input_ids"].to(dev), micro["labels"].to(dev)
        doc_BL = micro["doc_ids"].to(dev)
        denom = max(1, step.ctx["num_tokens"])
        with self.rt.autocast():
            out = self.forward_model(
                ids_BL, doc_ids=doc_BL, mtp_depth=0, return_logits=True, return_hidden=hw > 0
            )
            teacher, t_hidden_BLD = self.teacher_out(ids_BL, doc_BL, micro, "train", hidden=hw > 0)
        value, metrics = offline_distill_loss(
            out.logits, teacher, labels_BL, objective, denom=denom
        )
        if hw:  # the positions the logits are distilled at
            mask_BL = shift_targets(labels_BL, 1) != IGNORE_INDEX
            mse = hidden_mse(out.hidden[mask_BL], t_hidden_BLD[mask_BL], denom=denom)
            value = value + hw * mse
            metrics["hidden_mse"] = float(mse.detach())
        return moe_balancing(value, metrics, out, self.tc.grad_accum)

    @torch.no_grad()
    def held_out_kl(self) -> float:
        """Token mean of the top-k forward KL(teacher || student) on the held-out assistant
        tokens (the distance the distillation closes)."""
        kl_sum, n = 0.0, 0
        for batch in self.held_batches():
            ids_BL, doc_BL = batch["input_ids"].to(self.device), batch["doc_ids"].to(self.device)
            targets_BL = shift_targets(batch["labels"].to(self.device), 1)
            mask_BL = targets_BL != IGNORE_INDEX
            s_TV = self.model(ids_BL, doc_ids=doc_BL, mtp_depth=0).logits[mask_BL]
            teacher, _ = self.teacher_out(ids_BL, doc_BL, batch, "held")
            top_TK, ids_TK = teacher_topk_at(teacher, mask_BL, self.dcfg.top_k, self.device)
            kl_sum += float(topk_forward_kl(s_TV, top_TK, ids_TK, denom=1))
            n += int(mask_BL.sum())
        return kl_sum / max(1, n)

    def evaluate(self) -> dict[str, float]:
        row = super().evaluate()
        if self.held_examples:
            self.model.eval()
            try:
                row["eval_kl"] = self.held_out_kl()
            finally:
                self.model.train()
        return row

    @torch.no_grad()
    def teacher_reference(self) -> dict[str, float]:
        """The teacher's held-out NLL and exact match: what the student moves toward."""
        assert self.teacher is not None
        student, self.model = self.model, self.teacher
        try:
            row = ChatModule.evaluate(self)
        finally:
            self.model = student
            self.model.train()
            self.teacher.eval()
        return {f"teacher_{k.removeprefix('eval_')}": v for k, v in row.items()}

    def teacher_rows(self) -> list[dict[str, Any]]:
        """The teacher's own held-out NLL and exact match, the reference the student moves to."""
        return (
            [{"kind": "teacher", "step": 0, **self.teacher_reference()}]
            if self.held_examples and self.teacher is not None  # not with a cache
            else []
        )

    def callbacks(self) -> list[Callback]:
        return [*super().callbacks(), StartRows(self.teacher_rows)]
