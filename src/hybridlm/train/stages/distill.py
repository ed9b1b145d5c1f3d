"""Knowledge distillation: `run_distill(cfg)` and `hybridlm distill` (SPEC §3 "Distillation").

Shape legend: B rows, L sequence, V vocabulary, K teacher top-k, T selected token positions.

A run is one YAML file with four sections (`configs/distill.yaml`):

    model: tiny-super          # the student's architecture when train.init_from is empty
    data: {...}                # SFTDataConfig: chat sources, tokenizer, packing, held-out split
    train: {...}               # hybridlm.train.config.TrainConfig (optimizer, schedule, loop)
    distill: {...}             # DistillConfig: mode, teacher(s), objective, routing

`distill.mode: offline` — SFT's chat training with the loss of each packed micro-batch replaced
by a distillation loss against a frozen teacher (`train.distillation.OfflineDistiller`: the
top-k forward KL + CE of Nemotron 3.5 Lightning, or the skew reverse KL of Nemotron 3 Super).

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
from typing import Any

import numpy as np
import torch

from ...data import builtin
from ...data.chat import STOP, render
from ...data.sft import Conversation, ReadReport
from ...infer.rollout import RolloutPool, RolloutRequest
from ...model.model import HybridLM
from ..callbacks import (
    AfterUpdate,
    Callback,
    Close,
    DataRow,
    Export,
    Progress,
    StartRows,
    Throughput,
    curves,
)
from ..distillation import (
    PROXIMAL,
    DistillRunConfig,
    OfflineDistiller,
    PromptSource,
)
from ..distributed.parallel import broadcast_object, full_model_state, is_main
from ..objectives import (
    on_policy_distill_loss,
    reverse_kl,
)
from ..post_training import (
    ChatSource,
    answer_matches,
    export_hf,
    generate_replies,
    load_source,
    moe_balancing,
    prepare_chat_data,
    prompt_and_answer,
    prompt_key,
)
from ..teacher import (
    cache_pass_teacher,
    check_vocab,
    load_teacher,
)
from ..teacher_cache import build_teacher_cache
from ..trainer import (
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

    def callbacks(self) -> list[Callback]:
        kl = tuple(f"kl/{n}" for n in self.targets())
        return [
            DataRow(lambda: self.data_info),
            StartRows(self.teacher_rows),
            AfterUpdate(self.after_update),
            Throughput(),
            Progress(keys=kl),
            Close(self.close),
            Export(lambda: export_hf(self.model, self.out, self.tokenizer, self.stage)),
            curves(self.out, self.stage, kl, None),
        ]

    def teacher_rows(self) -> list[dict[str, Any]]:
        """Each routed teacher's exact match on the held-out prompts, before the first step."""
        if not (self.held and self.cfg.eval_generate):
            return []
        return [{"kind": "teacher", "step": 0, **self.teacher_reference()}]

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
