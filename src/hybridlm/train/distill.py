"""Knowledge distillation: `run_distill(cfg)` and `hybridlm distill` (SPEC §3 "Distillation").

Shape legend: B rows, L sequence, V vocabulary, K teacher top-k, T selected token positions.

A run is one YAML file with four sections (`configs/distill.yaml`):

    model: tiny-super          # the student's architecture when train.init_from is empty
    data: {...}                # SFTDataConfig: chat sources, tokenizer, packing, held-out split
    train: {...}               # hybridlm.train.config.TrainConfig (optimizer, schedule, loop)
    distill: {...}             # DistillConfig: mode, teacher(s), objective, routing

`distill.mode: offline` — the SFT stage (`train.sft.SFT`: chat data, assistant-only
masks, best-fit packing, optimizer, schedule, checkpoints with exact resume, metrics.jsonl,
held-out NLL and greedy exact match) with the loss of each packed micro-batch replaced by a
distillation loss against a frozen teacher whose logits are computed on the fly under no_grad:

* `objective: topk_forward_kl` — `kl_weight * KL(p_T^top-k || q_S) + ce_weight * CE` with the
  teacher's top-`top_k` logits (Nemotron 3.5 Lightning: top-128 logits, forward KL + CE with
  weights 0.9 / 0.1; `train.objectives.distill_loss`);
* `objective: skew_reverse_kl` — `kl_weight * KL(q_S || a p_T + (1 - a) q_S) + ce_weight * CE`
  (the skew reverse KL used for Nemotron 3 Super, alpha = `skew_alpha`, default 0.1).

Both are summed over the step's assistant tokens and divided by their global count, so gradient
accumulation gives the gradient of the step mean. The student may be smaller than the teacher
(another config) but must share its vocabulary.

`distill.mode: on_policy` — multi-teacher on-policy distillation (MOPD, Nemotron 3.5: token-local
reverse-KL updates on student-generated responses from domain-specialised teachers). Each step,
`prompts_per_step` prompts are drawn evenly over the domains of `distill.prompts`; the student
samples completions through the rollout engine (`infer.rollout.RolloutPool`, inline by default or
Ray actors) at temperature 1; each completion is scored by the teacher its prompt's domain is
routed to (`distill.routes`); the student minimises the token-level reverse KL against that
teacher on its own samples: `on_policy_loss: full` uses the exact per-position
KL(q_S,t || p_T,t) over the vocabulary (`objectives.reverse_kl`), `sampled` the single-sample
score-function estimator on the sampled tokens (`objectives.on_policy_distill_loss`). Logged per
step: the exact reverse KL per teacher, the gap between the engine's and the learner's
log-probs of the sampled tokens (an on-policy check: ~0), and at each eval the greedy exact
match of the student (and, at step 0, of each routed teacher) on held-out prompts.

MOPD stage 2 (`distill.proximal_decay` > 0; Nemotron 3.5 §3.6 retires the agentic and reasoning
teachers and uses a proximal-teacher target for stability): the proximal teacher is a moving
average of the student's weights (it starts as the student and moves 1 - decay of the way to it
after each step). Domains routed to `proximal` (those of the retired teachers) are distilled
toward it alone; the others toward the normalised geometric mixture of their teacher and the
proximal teacher (`proximal_teacher_weight` on the teacher). Run stage 2 as a second on-policy
run from stage 1's checkpoint (`train.init_from`) with the new routes.

Resume: offline runs resume exactly (the SFT checkpoint: weights, optimizer, loader position,
RNG). On-policy runs restore weights, optimizer and RNG, and prompt draws are a function of the
step, but the rollout engine's sampling streams restart, so the samples after a resume differ;
stage 2's proximal teacher restarts from the resumed student.
Cached teacher (`distill.teacher_cache`): `hybridlm distill-cache` runs the teacher once over the
run's training and held-out conversations and writes each token's top-`top_k` (ids, log-probs)
to memory-mapped shards (`train.teacher_cache`, resumable); offline distillation then reads
them instead of loading the teacher (the top-k forward KL only; the skew reverse KL needs the
full distribution). Without a cache the teacher's logits are computed every step.
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..data import builtin
from ..data.chat import STOP, render
from ..data.sft import Conversation, ReadReport, SFTLoader
from ..infer.rollout import RolloutPool, RolloutRequest
from ..model.model import HybridLM
from .config import TeacherConfig, TrainConfig
from .objectives import (
    IGNORE_INDEX,
    distill_loss,
    hidden_mse,
    on_policy_distill_loss,
    reverse_kl,
    shift_targets,
    skew_reverse_kl,
    topk_forward_kl,
)
from .parallel import broadcast_object, full_model_state, is_main
from .post_training import (
    ChatSource,
    PostTrainingRunConfig,
    SFTDataConfig,
    answer_matches,
    export_hf,
    generate_replies,
    load_source,
    moe_balancing,
    prepare_chat_data,
    prompt_and_answer,
    prompt_key,
)
from .sft import SFT, SFTConfig, SFTRunConfig
from .teacher import (
    TeacherOut,
    cache_pass_teacher,
    check_vocab,
    load_teacher,
    teacher_topk_at,
)
from .teacher_cache import TeacherTopK, build_teacher_cache
from .trainer import (
    Loss,
    Runtime,
    Step,
    Trainer,
    TrainModule,
    check_tokenizer,
    initial_model,
    resolve_device,
    run_tokenizer,
)

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


class OfflineDistiller(SFT):
    """The SFT stage with a teacher: same data, loop, checkpoints and eval; the micro-batch
    loss is `offline_distill_loss`, and evals add the held-out top-k forward KL."""

    stage = "distill"
    plot_train = ("loss", "kl", "ce")
    plot_eval = ("eval_loss", "eval_accuracy", "eval_kl")

    def progress_info(self, row: dict[str, Any]) -> str:
        return " ".join(f"{k} {row[k]:.4f}" for k in ("loss", "kl", "ce") if k in row)

    def __init__(self, run: DistillRunConfig, rt: Runtime) -> None:
        dc = run.distill
        sft_run = SFTRunConfig(
            model=run.model,
            data=run.data,
            train=run.train,
            sft=SFTConfig(
                loss_norm="token",  # global token mean (DESIGN habit 13)
                mtp_weight=0.0,
                mtp_depth=0,
                eval_generate=dc.eval_generate,
                max_new_tokens=dc.eval_max_new_tokens,
            ),
        )
        self.distill_run, self.dcfg = run, dc
        super().__init__(sft_run, rt)
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
        loader = SFTLoader(
            self.held_examples,
            seq_len=self.dc.seq_len,
            batch_size=self.dc.batch_size,
            sequential=True,
        )
        kl_sum, n = 0.0, 0
        for batch in loader:
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
            row = SFT.evaluate(self)
        finally:
            self.model = student
            self.model.train()
            self.teacher.eval()
        return {f"teacher_{k.removeprefix('eval_')}": v for k, v in row.items()}

    def run_config(self) -> dict[str, Any]:
        return {**self.distill_run.to_dict(), "model": self.model_cfg.to_dict()}

    def start_rows(self) -> list[dict[str, Any]]:
        """The teacher's own held-out NLL and exact match, the reference the student moves to."""
        return (
            [{"kind": "teacher", "step": 0, **self.teacher_reference()}]
            if self.held_examples and self.teacher is not None  # not with a cache
            else []
        )


# ---------------------------------------------------------------------------- on-policy
@dataclass
class PromptItem:
    domain: str
    prompt: Conversation
    answer: str  # "" when the source has no reference answer
    ids: list[int] = field(default_factory=list)


def load_prompts(src: PromptSource, report: ReadReport) -> list[PromptItem]:
    """The prompts (and reference answers) of one `PromptSource`."""
    if src.kind == "humaneval":
        path = Path(src.path) if src.path else builtin.path(builtin.HUMANEVAL)
        if not path.is_file():
            raise ValueError(f"HumanEval file not found: {src.path}")
        rows = builtin.read_jsonl(path, limit=src.max_rows or None)
        msgs = [[{"role": "user", "content": r["prompt"]}] for r in rows]
        items = [PromptItem(src.domain, m, "") for m in msgs]
        report.rows += len(items)
        report.kept += len(items)
        return items
    chat = ChatSource(
        kind=src.kind, path=src.path, max_rows=src.max_rows, digits=src.digits, seed=src.seed
    )
    items = []
    for conv in load_source(chat, report):
        if any(m.get("role") == "assistant" for m in conv):
            prompt, answer = prompt_and_answer(conv)
        else:
            prompt, answer = conv, ""
        items.append(PromptItem(src.domain, prompt, answer))
    return items


class OnPolicyDistiller(TrainModule):
    """Student, teachers, prompt pools, rollout pool and counters of one MOPD run."""

    stage = "distill"

    @property
    def plot_train(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(f"kl/{n}" for n in self.targets())

    def __init__(self, run: DistillRunConfig, rt: Runtime) -> None:

        super().__init__(rt)
        self.run, self.tc, self.dc, self.cfg = run, run.train, run.data, run.distill
        tc, dc, cfg = self.tc, self.dc, self.cfg
        self.device, self.out = rt.device, rt.out
        self.tokenizer = run_tokenizer(dc, tc)

        # prompts: per domain, a held-out split (prompts with reference answers) and the rest
        self.read_report = ReadReport()
        items: list[PromptItem] = []
        for src in cfg.prompts:
            items += load_prompts(src, self.read_report)
        too_long = 0
        for it in items:
            it.ids = self.tokenizer.encode(render(it.prompt, add_generation_prompt=True))
        budget = dc.seq_len - cfg.max_new_tokens
        kept = [it for it in items if len(it.ids) <= budget]
        too_long = len(items) - len(kept)
        rng = np.random.default_rng([dc.seed, 7])
        self.held: list[PromptItem] = []
        self.train_items: dict[str, list[PromptItem]] = defaultdict(list)
        for domain in dict.fromkeys(p.domain for p in cfg.prompts):
            pool = [it for it in kept if it.domain == domain]
            answered = [i for i, it in enumerate(pool) if it.answer]
            n_held = min(dc.held_out, max(0, len(answered) - 1))
            held_idx = (
                set(rng.choice(answered, n_held, replace=False).tolist()) if n_held else set()
            )
            held_keys = {prompt_key([*pool[i].prompt, {"role": "assistant"}]) for i in held_idx}
            self.held += [pool[i] for i in sorted(held_idx)]
            self.train_items[domain] = [
                it
                for i, it in enumerate(pool)
                if i not in held_idx
                and prompt_key([*it.prompt, {"role": "assistant"}]) not in held_keys
            ]
            if not self.train_items[domain]:
                raise ValueError(
                    f"prompt domain {domain!r} has no training prompts that fit data.seq_len="
                    f"{dc.seq_len} minus distill.max_new_tokens={cfg.max_new_tokens}"
                )
        self.data_info = {
            "read": self.read_report.summary(),
            "too_long": too_long,
            "train_prompts": {d: len(v) for d, v in self.train_items.items()},
            "held_out": dict(Counter(it.domain for it in self.held)),
        }

        # student, teachers, optimizer, rollouts
        self.model = initial_model(tc, run.model, self.device)
        check_tokenizer(self.tokenizer, self.model, "train.init_from" if tc.init_from else "model")
        self.teachers: dict[str, HybridLM] = {}
        for name, path in cfg.teachers.items():
            if name in cfg.routes.values():  # unused teachers are not loaded
                self.teachers[name] = load_teacher(
                    path,
                    device=self.device,
                    tokenizer=self.tokenizer,
                    setting=f"distill.teachers.{name}",
                )
                check_vocab(self.model, self.teachers[name].config.vocab_size, name)
        # MOPD stage 2: the proximal teacher starts as the student (its weights' moving average)
        self.proximal: HybridLM | None = None
        if cfg.proximal_decay:
            self.proximal = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.tokens_per_step = cfg.prompts_per_step * cfg.samples_per_prompt * dc.seq_len
        self.total_steps = tc.num_steps(self.tokens_per_step)
        self.pool: Any = None  # started by the first step, after a resume loaded the weights
        self.params_sampling = {
            "max_tokens": cfg.max_new_tokens,
            "temperature": 1.0,  # samples from q_S itself: the reverse KL is taken at T = 1
            "stop": [STOP],
            "include_stop_str_in_output": True,
        }

    # ------------------------------------------------------------------ prompts and routing
    def draw(self, step: int) -> list[PromptItem]:
        """`prompts_per_step` prompts drawn evenly over the domains (reproducible per step)."""
        rng = np.random.default_rng([self.tc.seed, 11, step])
        domains = list(self.train_items)
        out = []
        for j in range(self.cfg.prompts_per_step):
            pool = self.train_items[domains[j % len(domains)]]
            out.append(pool[int(rng.integers(len(pool)))])
        return out

    def route(self, item: PromptItem) -> str:
        """The teacher that scores samples of this prompt (distill.routes by domain)."""
        return self.cfg.routes[item.domain]

    # ------------------------------------------------------------------ one step
    def sample(
        self, items: list[PromptItem], step: int, weights: dict[str, torch.Tensor]
    ) -> list[Any]:
        """Completions of `items` sampled with the student's current `weights`."""
        if self.pool is None:
            self.pool = RolloutPool(
                self.model.config,
                self.tokenizer,
                weights,
                executor=self.cfg.executor,
                num_workers=self.cfg.num_workers,
                seed=self.tc.seed,
            )
        elif step > 0:
            self.pool.set_weights(weights, version=step)
        reqs = [
            RolloutRequest(key=f"{i}", prompt_ids=it.ids, group_size=self.cfg.samples_per_prompt)
            for i, it in enumerate(items)
        ]
        self.pool.submit(reqs, self.params_sampling)
        return [c for _, comps in self.pool.wait(num=1) for c in comps]

    def _sampled_batch(self, step: int, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Draw prompts, sample completions with the current student, batch them on the CPU
        (rank 0, which runs the rollout workers)."""
        items = self.draw(step)
        comps = [c for c in self.sample(items, step, weights) if c.token_ids]
        B = len(comps)
        width = max(len(c.prompt_ids) + len(c.token_ids) for c in comps)
        ids_BL = torch.zeros(B, width, dtype=torch.long)
        mask_BL = torch.zeros(B, width, dtype=torch.bool)  # logits at t predict a sampled token
        engine_lp_BL = torch.zeros(B, width)
        for b, c in enumerate(comps):
            seq = c.prompt_ids + c.token_ids
            ids_BL[b, : len(seq)] = torch.tensor(seq)
            P, n = len(c.prompt_ids), len(c.token_ids)
            mask_BL[b, P - 1 : P - 1 + n] = True
            engine_lp_BL[b, P - 1 : P - 1 + n] = torch.tensor(c.logprobs)
        return {
            "ids_BL": ids_BL,
            "mask_BL": mask_BL,
            "engine_lp_BL": engine_lp_BL,
            "teacher_of": [self.route(items[int(c.key)]) for c in comps],
        }

    def prepare_step(self, step: int) -> Step:
        """Rank 0 samples the step's batch and sends it to every rank; each trains on its share
        of the rows, every term normalised by global token counts."""
        weights = full_model_state(self.model)  # collective under FSDP
        batch = broadcast_object(self._sampled_batch(step, weights) if self.rt.rank == 0 else None)
        mask_BL, teacher_of = batch["mask_BL"], batch["teacher_of"]
        n_tok, B = int(mask_BL.sum()), mask_BL.shape[0]
        rows = self.rt.share(list(range(B)))
        tokens_of = {  # per target, over the whole batch: the KL metrics are global means
            name: int(mask_BL[[b for b, t in enumerate(teacher_of) if t == name]].sum())
            for name in self.targets()
        }
        mine = {k: v[rows].to(self.device) for k, v in batch.items() if k != "teacher_of"}
        mine["teacher_of"] = [teacher_of[b] for b in rows]
        info = {"sampled_tokens": n_tok, "mean_completion_len": n_tok / max(1, B)}
        return Step([mine], ctx={"num_tokens": n_tok, "tokens_of": tokens_of}, info=info)

    def targets(self) -> list[str]:
        """The routes samples can take: the loaded teachers, and `proximal` in stage 2."""
        return [*self.teachers, *([PROXIMAL] if self.proximal is not None else [])]

    def target_logits(
        self, name: str, ids_BL: torch.Tensor, prox_BLV: torch.Tensor | None
    ) -> torch.Tensor:
        """Logits (up to a constant per position) of a route's target on `ids_BL`: the
        teacher's; in stage 2 the normalised geometric mixture with the proximal teacher
        (`proximal_teacher_weight` w), or the proximal teacher alone for `proximal` rows."""
        if name == PROXIMAL:
            assert prox_BLV is not None
            return prox_BLV
        with torch.no_grad(), self.rt.autocast():
            t_BLV = self.teachers[name](ids_BL, mtp_depth=0).logits.float()
        if prox_BLV is None:
            return t_BLV
        w = self.cfg.proximal_teacher_weight
        return w * torch.log_softmax(t_BLV, -1) + (1 - w) * torch.log_softmax(prox_BLV, -1)

    def after_update(self, step: Step, outcome: Any) -> dict[str, Any]:
        """Stage 2: the proximal teacher's weights move toward the student's,
        theta_prox <- decay * theta_prox + (1 - decay) * theta."""
        if self.proximal is None or outcome is None or not outcome.finite:
            return {}
        self.update_proximal()
        return {}

    @torch.no_grad()
    def update_proximal(self) -> None:
        assert self.proximal is not None
        keep = self.cfg.proximal_decay
        student = dict(self.model.named_parameters())
        for name, p in self.proximal.named_parameters():
            s = student[name]
            s = s.full_tensor() if hasattr(s, "full_tensor") else s  # a sharded student
            p.lerp_(s.detach().to(p.dtype), 1 - keep)

    def loss(self, micro: dict[str, Any], step: Step) -> Loss:
        """Token-level reverse KL to each sample's routed target, over the step's tokens."""
        cfg, dev = self.cfg, self.device
        ids_BL, mask_BL = micro["ids_BL"], micro["mask_BL"]
        teacher_of, n_tok = micro["teacher_of"], step.ctx["num_tokens"]
        targets_BL = torch.cat([ids_BL[:, 1:], ids_BL[:, :1]], dim=1)  # right padding: causal
        with self.rt.autocast():
            out = self.forward_model(ids_BL, mtp_depth=0, return_logits=True)
        logq_BLV = torch.log_softmax(out.logits.float(), dim=-1)
        logq_BL = logq_BLV.gather(-1, targets_BL.unsqueeze(-1)).squeeze(-1)
        loss = out.logits.new_zeros((), dtype=torch.float32)
        parts: dict[str, Any] = {}
        prox_BLV = None
        if self.proximal is not None:
            with torch.no_grad(), self.rt.autocast():
                prox_BLV = self.proximal(ids_BL, mtp_depth=0).logits.float()
        for name in self.targets():
            rows = [b for b, t in enumerate(teacher_of) if t == name]
            if not rows:
                continue
            rows_t = torch.tensor(rows, device=dev)
            t_BLV = self.target_logits(
                name, ids_BL[rows_t], None if prox_BLV is None else prox_BLV[rows_t]
            )
            m_BL = mask_BL[rows_t]
            s_TV, t_TV = out.logits[rows_t][m_BL], t_BLV[m_BL]
            # exact token-level reverse KL of this teacher's samples (its token mean over the
            # whole batch, for the log: the ranks' shares sum to it)
            kl_exact = reverse_kl(s_TV.detach(), t_TV, denom=max(1, step.ctx["tokens_of"][name]))
            if cfg.on_policy_loss == "full":
                term = reverse_kl(s_TV, t_TV, denom=n_tok)
            else:
                logp_T = (
                    torch.log_softmax(t_TV, -1)
                    .gather(-1, targets_BL[rows_t][m_BL].unsqueeze(-1))
                    .squeeze(-1)
                )
                term, _ = on_policy_distill_loss(logq_BL[rows_t][m_BL], logp_T, denom=n_tok)
            loss = loss + term
            parts[f"kl/{name}"] = float(kl_exact)
            parts[f"tokens/{name}"] = int(m_BL.sum())
        with torch.no_grad():  # the engine's sampling log-probs against the trainer's
            gap = ((logq_BL - micro["engine_lp_BL"]).abs() * mask_BL).sum()
        parts["logprob_gap"] = float(gap) / max(1, n_tok)
        return moe_balancing(loss, parts, out, 1)

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def exact_match(self, model: HybridLM, items: list[PromptItem]) -> float:
        replies = generate_replies(
            model,
            self.tokenizer,
            [it.prompt for it in items],
            max_new_tokens=self.cfg.eval_max_new_tokens,
        )
        return sum(
            answer_matches(r, it.answer) for r, it in zip(replies, items, strict=True)
        ) / max(1, len(items))

    def eval_items(self) -> dict[str, list[PromptItem]]:
        by_domain: dict[str, list[PromptItem]] = defaultdict(list)
        for it in self.held:
            if len(by_domain[it.domain]) < self.cfg.eval_generate:
                by_domain[it.domain].append(it)
        return by_domain

    def evaluate(self) -> dict[str, float]:
        """Greedy exact match of the student per domain with reference answers."""
        self.model.eval()
        try:
            return {
                f"eval_accuracy/{d}": self.exact_match(self.model, its)
                for d, its in self.eval_items().items()
            }
        finally:
            self.model.train()

    def teacher_reference(self) -> dict[str, float]:
        """Greedy exact match of each domain's routed teacher (the proximal teacher: the
        student at step 0)."""
        out = {}
        for d, its in self.eval_items().items():
            name = self.cfg.routes[d]
            model = self.proximal if name == PROXIMAL else self.teachers[name]
            assert model is not None
            out[f"teacher_accuracy/{d}"] = self.exact_match(model, its)
        return out

    # ------------------------------------------------------------------ loop
    def run_config(self) -> dict[str, Any]:
        return {**self.run.to_dict(), "model": self.model.config.to_dict()}

    def export(self) -> Path | None:
        return export_hf(self.model, self.out, self.tokenizer, self.stage)

    def summary(self) -> dict[str, Any]:
        return {"data": self.data_summary()}

    def data_summary(self) -> dict[str, Any]:
        return self.data_info

    def start_rows(self) -> list[dict[str, Any]]:
        if not (self.held and self.cfg.eval_generate):
            return []
        return [{"kind": "teacher", "step": 0, **self.teacher_reference()}]

    def progress_info(self, row: dict[str, Any]) -> str:
        return " ".join(f"{k} {v:.3f}" for k, v in row.items() if k[:3] == "kl/")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


# ---------------------------------------------------------------------------- entry points
def distill_trainer(
    cfg: DistillRunConfig, *, resume: bool = False, overwrite: bool = False
) -> Trainer:
    """The Trainer of a distillation run (offline or on-policy by `distill.mode`)."""
    stage = OfflineDistiller if cfg.distill.mode == "offline" else OnPolicyDistiller
    return Trainer(cfg.train, lambda rt: stage(cfg, rt), resume=resume, overwrite=overwrite)


def cache_teacher(cfg: DistillRunConfig, *, progress: bool = True) -> dict[str, Any]:
    """Write (or finish) `distill.teacher_cache` for an offline run: the teacher's top-`top_k`
    on every training and held-out conversation the run will read (`train.teacher_cache`)."""
    dcfg = cfg.distill
    tokenizer = run_tokenizer(cfg.data, cfg.train)
    device = resolve_device(cfg.train.device)
    teacher, spec = cache_pass_teacher(dcfg, device=device, tokenizer=tokenizer)
    data = prepare_chat_data(cfg.data, tokenizer)
    sets = {"train": data.examples, "held": data.held_examples}
    return build_teacher_cache(
        dcfg.teacher_cache,
        teacher,
        {k: v for k, v in sets.items() if v},
        spec,
        seq_len=cfg.data.seq_len,
        batch_size=cfg.data.batch_size,
        device=device,
        progress=progress,
    )


def run_distill(
    cfg: DistillRunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    until_step: int | None = None,
) -> dict[str, Any]:
    """Run offline or on-policy distillation from a config; returns the final metrics,
    checkpoint and plot paths. `resume=True` continues from the newest intact checkpoint;
    `overwrite=True` replaces an earlier run in `train.out_dir`."""
    cfg = copy.deepcopy(cfg)
    cfg.distill.check()
    trainer = distill_trainer(cfg, resume=resume, overwrite=overwrite)
    if is_main():
        cfg.save(Path(cfg.train.out_dir) / "run.yaml")
    return trainer.train(until_step=until_step)
