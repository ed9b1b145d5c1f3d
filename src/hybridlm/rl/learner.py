"""GRPO with verifiable rewards and asynchronous rollouts: `hybridlm rl` / `run_rl(RLConfig)`.

    hybridlm rl --checkpoint runs/sft --set steps=60 --set executor=ray
    hybridlm rl --config configs/rl.yaml --set reward=random      # the negative control

The loop (OlmoRL, Olmo 3 §4.4; Nemotron 3 Super §3.2):

1. **Rollouts** come from `RolloutPool` workers (Ray actors, or inline) running the inference
   engine over a copy of the policy: `group_size` completions per prompt, prompts drawn from a
   weighted mixture of environments (`rl.environments`), each completion with the engine's
   log-probs and the weight version of every token. Generation ends at the chat template's
   end-of-turn string, which stays in the completion (the policy must learn to stop).
2. **Rewards** from the environments' verifiers (or, for the negative control `reward: random`,
   a fair coin per completion: no information, so no gain may follow).
3. **Active sampling**: groups whose rewards are all equal carry no gradient and are dropped;
   more are drawn until `groups_per_step` groups are kept or `max_draws` groups were drawn.
4. **Asynchrony with bounded lag**: while the learner trains step s, the workers already generate
   the groups of step s+1 with the weights they have (`max_policy_lag` batches ahead). New
   weights are handed over after every step (in-flight: requests running finish with them), with
   a timeout that stops the run loudly. Groups with any token older than `max_policy_lag`
   versions are dropped and counted.
5. **Update**: one optimizer step per batch on the GRPO loss (`rl.grpo.grpo_loss`): advantages
   centred per group without std, clip-higher, token-level aggregation over the whole batch,
   truncated importance sampling between the engine's and the trainer's log-probs (covers both
   the numerical mismatch and the staleness), optional k3 KL to the initial policy.

Every step appends a row to `<out>/metrics.jsonl` (rewards per environment, kept/drawn groups,
staleness histogram, engine−trainer log-prob difference, TIS truncation and clip fractions,
lengths, times); every `eval_interval` steps the learner's policy is evaluated greedily on
held-out problems (`kind: "eval"`). `<out>/rl.png` is rendered from the metrics at the end and
the final policy is written to `<out>/model` (a transformers directory).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..config import from_dict, read_mapping, write_mapping
from ..data import builtin
from ..data.chat import STOP
from ..infer.engine import Engine
from ..infer.sampling import SamplingParams
from ..model.model import HybridLM
from .environments import (
    ArithmeticEnvironment,
    CodeEnvironment,
    DatasetEnvironment,
    Environment,
    GSM8KEnvironment,
    InstructionFollowingEnvironment,
    LowEffortEnvironment,
    MathEnvironment,
    MixtureEnvironment,
    Problem,
    reward_metrics,
)
from .grpo import ActiveSampler, Group, GRPOConfig, group_advantages, grpo_loss
from .rollout import Completion, RolloutPool, RolloutRequest
from .verifiers import GSM8KVerifier, Reward

EnvKind = Literal["arithmetic", "sft_arithmetic", "gsm8k", "math", "code", "ifeval"]


@dataclass(kw_only=True)
class EnvConfig:
    """One environment of the mixture. `path` is the dataset for gsm8k (JSONL; empty: the
    packaged train split, evaluated on the packaged test split), math (JSONL), code (HumanEval
    JSONL[.gz]; empty: the packaged copy) and ifeval (IFEval JSONL; empty: the generated set)."""

    kind: EnvKind = "arithmetic"
    weight: float = 1.0
    path: str = ""
    limit: int = 0  # first N problems of a dataset (0: all)
    num_problems: int = 2000  # generated environments
    difficulty: list[int] = field(default_factory=lambda: [1, 2])  # arithmetic
    digits: int = 2  # sft_arithmetic: operands below 10**digits
    seed: int = 0  # generated environments
    low_effort_fraction: float = 0.0  # prompts switched to low-effort mode (length penalty)


@dataclass(kw_only=True)
class RLConfig:
    checkpoint: str = ""  # the initial policy: run, training checkpoint or transformers dir
    out_dir: str = "runs/rl"
    envs: list[EnvConfig] = field(default_factory=lambda: [EnvConfig()])
    eval_envs: list[EnvConfig] = field(default_factory=list)  # default: envs with seed + 1
    eval_problems: int = 64
    eval_interval: int = 10
    eval_max_new_tokens: int = 0  # 0: max_new_tokens
    reward: Literal["verifier", "random"] = "verifier"
    steps: int = 50
    groups_per_step: int = 8
    group_size: int = 8
    max_draws: int = 32  # active sampling: most groups drawn for one step
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 1e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 16  # completions per forward/backward
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    executor: Literal["ray", "inline"] = "ray"
    num_workers: int = 1
    ray_address: str = ""
    threads_per_worker: int = 1
    max_policy_lag: int = 1
    sync_timeout_s: float = 300.0
    seed: int = 0

    def validate(self) -> RLConfig:
        if not self.checkpoint:
            raise ValueError("rl needs a starting policy: set checkpoint (or --checkpoint)")
        for name in ("steps", "groups_per_step", "micro_batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2 (advantages are within groups)")
        if self.max_draws < self.groups_per_step:
            raise ValueError("max_draws must be >= groups_per_step")
        if self.max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0, got {self.max_policy_lag}")
        if self.temperature <= 0:
            raise ValueError("RL samples: temperature must be > 0")
        if not self.envs:
            raise ValueError("envs: at least one environment")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RLConfig:
        return from_dict(cls, data)

    @classmethod
    def load(cls, path: str | Path) -> RLConfig:
        return cls.from_dict(read_mapping(path, "rl config"))

    def save(self, path: str | Path) -> None:
        write_mapping(path, self.to_dict())


# ---------------------------------------------------------------------- environments
def build_environment(spec: EnvConfig, *, tokenizer: Any = None) -> Environment:
    """The environment an `EnvConfig` names (wrapped in low-effort mode when asked)."""
    kind = spec.kind
    limit = spec.limit or None
    if kind == "arithmetic":
        env: Environment = ArithmeticEnvironment(
            num_problems=spec.num_problems, difficulty=spec.difficulty, seed=spec.seed
        )
    elif kind == "sft_arithmetic":  # the questions `hybridlm sft` trains on (data/sft.py)
        env = sft_arithmetic_environment(spec.num_problems, digits=spec.digits, seed=spec.seed)
    elif kind == "gsm8k":
        env = GSM8KEnvironment(spec.path or builtin.path(builtin.GSM8K_TRAIN), limit=limit)
    elif kind == "math":
        env = MathEnvironment.from_jsonl(_need(spec))
    elif kind == "code":
        env = CodeEnvironment.from_humaneval(spec.path or builtin.path(builtin.HUMANEVAL))
    elif kind == "ifeval":
        env = (
            InstructionFollowingEnvironment.from_jsonl(spec.path)
            if spec.path
            else InstructionFollowingEnvironment.generated(
                num_problems=spec.num_problems, seed=spec.seed
            )
        )
    else:
        raise ValueError(f"unknown environment kind {kind!r}")
    if spec.low_effort_fraction > 0:
        count = (lambda s: len(tokenizer.encode(s, add_bos=False))) if tokenizer else None
        env = LowEffortEnvironment(env, fraction=spec.low_effort_fraction, count_tokens=count)
    return env


class _FinalNumberEnvironment(DatasetEnvironment):
    def score(self, problem: Problem, completion: str) -> Reward:
        return self.verifier(completion, problem.answer)


def sft_arithmetic_environment(n: int, *, digits: int, seed: int) -> DatasetEnvironment:
    """ "What is a + b?" / "What is a - b?" with `digits`-digit operands, as in the arithmetic
    chats of `hybridlm sft` (`data.sft.arithmetic_conversations`), scored on the final number."""
    from ..data.sft import arithmetic_conversations

    problems = [
        Problem(
            id=f"sft_arithmetic/{digits}/{seed}/{i}",
            messages=(conv[0],),
            answer=conv[1]["content"],
            metadata={"digits": digits},
        )
        for i, conv in enumerate(arithmetic_conversations(n, seed=seed, digits=digits))
    ]
    env = _FinalNumberEnvironment(problems, name="sft_arithmetic")
    env.verifier = GSM8KVerifier()
    return env


def _need(spec: EnvConfig) -> str:
    if not spec.path:
        raise ValueError(f"environment {spec.kind!r} needs a dataset path (envs[].path)")
    return spec.path


def build_mixture(specs: list[EnvConfig], *, tokenizer: Any = None) -> MixtureEnvironment:
    envs = [build_environment(s, tokenizer=tokenizer) for s in specs]
    return MixtureEnvironment(envs, [s.weight for s in specs])


def eval_specs(cfg: RLConfig) -> list[EnvConfig]:
    """Held-out problems: the configured eval envs, else the training envs with the generated
    ones reseeded (GSM8K: its test file next to the train file, when there is one; the packaged
    test split for the packaged train split)."""
    if cfg.eval_envs:
        return cfg.eval_envs
    out = []
    for s in cfg.envs:
        s = dataclasses.replace(s, seed=s.seed + 1, low_effort_fraction=0.0)
        if s.kind == "gsm8k" and not s.path:
            s = dataclasses.replace(s, path=str(builtin.path(builtin.GSM8K_TEST)))
        elif s.kind == "gsm8k" and Path(s.path).name in ("train.jsonl", "train.jsonl.gz"):
            test = Path(s.path).with_name(Path(s.path).name.replace("train", "test"))
            if test.is_file():
                s = dataclasses.replace(s, path=str(test))
        out.append(s)
    return out


# ---------------------------------------------------------------------- batches
def completion_logprobs(
    model: HybridLM, comps: list[Completion], *, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's log-probs of every completion token under softmax(logits / T), teacher-forced
    on prompt + completion (right-padded rows: causal layers never see the padding). Returns
    (logp_BT, mask_BT) over completion positions."""
    device = model.embeddings.weight.device
    lengths = [len(c.prompt_ids) + len(c.token_ids) for c in comps]
    T = max(len(c.token_ids) for c in comps)
    ids_BL = torch.zeros(len(comps), max(lengths), dtype=torch.long, device=device)
    for i, c in enumerate(comps):
        ids_BL[i, : lengths[i]] = torch.tensor(c.prompt_ids + c.token_ids, device=device)
    logits_BLV = model(ids_BL).logits
    for m in model.moe_layers():  # the balancing loss is not part of the RL objective
        m.aux_losses.clear()
    logp_BT = torch.zeros(len(comps), T, dtype=torch.float32, device=device)
    mask_BT = torch.zeros(len(comps), T, dtype=torch.bool, device=device)
    for i, c in enumerate(comps):
        p, n = len(c.prompt_ids), len(c.token_ids)
        lp_NV = torch.log_softmax(logits_BLV[i, p - 1 : p - 1 + n].float() / temperature, -1)
        logp_BT[i, :n] = lp_NV.gather(-1, ids_BL[i, p : p + n, None])[:, 0]
        mask_BT[i, :n] = True
    return logp_BT, mask_BT


def _pad(rows: list[list[float]], T: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(rows), T, dtype=torch.float32, device=device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


# ---------------------------------------------------------------------- the loop
class _Rollouts:
    """Problem draws, submission to the pool, scoring into groups."""

    def __init__(self, cfg: RLConfig, env: MixtureEnvironment, tok: Any, pool: RolloutPool):
        self.cfg, self.env, self.tok, self.pool = cfg, env, tok, pool
        self.params = {
            "max_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "stop": [STOP],
            "include_stop_str_in_output": True,
        }
        self.pending: dict[int, list[Problem]] = {}
        self.draws = 0

    def submit(self, n_groups: int) -> None:
        self.draws += 1
        problems = self.env.sample(n_groups, seed=self.cfg.seed * 1_000_003 + self.draws)
        reqs = [
            RolloutRequest(p.id, self.tok.encode(p.prompt), self.cfg.group_size) for p in problems
        ]
        handle = self.pool.submit(reqs, self.params)
        self.pending[id(handle)] = problems

    def groups(self, handle: Any, comps: list[Completion], step: int) -> list[Group]:
        problems = self.pending.pop(id(handle))
        G = self.cfg.group_size
        texts = [c.text.removesuffix(STOP) for c in comps]
        expanded = [problems[i // G] for i in range(len(comps))]
        if self.cfg.reward == "random":  # negative control: a fair coin, blind to the text
            rewards = [float(_coin(f"{self.cfg.seed}/{step}/{c.key}/{c.index}")) for c in comps]
            scored = None
        else:
            scored = self.env.score_many(expanded, texts)
            rewards = [r.value for r in scored]
        out = []
        for g, problem in enumerate(problems):
            sl = slice(g * G, (g + 1) * G)
            data = {"problem": problem, "completions": comps[sl], "scored": scored and scored[sl]}
            out.append(Group(prompt_id=problem.id, rewards=rewards[sl], data=data))
        return out


def _coin(key: str) -> bool:
    """A fair coin that depends only on `key`."""
    return random.Random(zlib.crc32(key.encode())).random() < 0.5


@torch.no_grad()
def evaluate_policy(
    model: HybridLM,
    tok: Any,
    problems: list[Problem],
    env: MixtureEnvironment,
    *,
    max_new_tokens: int,
) -> dict[str, float]:
    """Greedy completions of held-out problems, scored: `all/solved`, per-environment metrics."""
    was_training = model.training
    model.eval()
    engine = Engine(model, tok, max_batch_size=32)
    params = SamplingParams(max_tokens=max_new_tokens, stop=[STOP])
    outs = engine.generate([tok.encode(p.prompt) for p in problems], params)
    rewards = env.score_many(problems, [o.text for o in outs])
    model.train(was_training)
    m = reward_metrics(problems, rewards)
    m["mean_length"] = sum(len(o.token_ids) for o in outs) / len(outs)
    return m


def _lr(step: int, cfg: RLConfig) -> float:
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr


def run_rl(
    cfg: RLConfig,
    *,
    env: MixtureEnvironment | None = None,
    eval_env: MixtureEnvironment | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train the policy of `cfg.checkpoint` with GRPO; returns a summary (metrics path, plot,
    per-step rows, eval results). `env` / `eval_env` replace the configured environments (any
    `Environment`s, e.g. a custom verifier, wrapped in a `MixtureEnvironment`). An earlier run's
    metrics in `cfg.out_dir` are an error unless `overwrite=True` (then they are removed)."""
    from ..train.checkpoint import METRICS, prepare_run_dir, tokenizer_for

    cfg.validate()
    torch.manual_seed(cfg.seed)
    out = prepare_run_dir(cfg.out_dir, overwrite=overwrite, outputs=(METRICS,))
    cfg.save(out / "rl.yaml")
    metrics_path = out / METRICS
    metrics_path.touch()

    def log(row: dict) -> None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    model = HybridLM.from_pretrained(cfg.checkpoint).float().train()
    tok = tokenizer_for(cfg.checkpoint)
    env = env or build_mixture(cfg.envs, tokenizer=tok)
    eval_env = eval_env or build_mixture(eval_specs(cfg), tokenizer=tok)
    eval_set = eval_env.sample(cfg.eval_problems, seed=cfg.seed + 12345)
    eval_tokens = cfg.eval_max_new_tokens or cfg.max_new_tokens
    ref = None
    if cfg.grpo.kl_coef > 0:  # the initial policy, frozen
        ref = HybridLM.from_pretrained(cfg.checkpoint).float().eval().requires_grad_(False)
    pool = RolloutPool(
        model.config,
        tok,
        model.state_dict(),
        executor=cfg.executor,
        num_workers=cfg.num_workers,
        ray_address=cfg.ray_address or None,
        threads_per_worker=cfg.threads_per_worker,
        sync_timeout_s=cfg.sync_timeout_s,
        seed=cfg.seed,
        engine_kwargs={"max_batch_size": cfg.groups_per_step * cfg.group_size},
    )
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    sampler = ActiveSampler(batch_groups=cfg.groups_per_step, max_draws=cfg.max_draws)
    rollouts = _Rollouts(cfg, env, tok, pool)
    evals: list[dict] = []

    def run_eval(step: int) -> None:
        m = evaluate_policy(model, tok, eval_set, eval_env, max_new_tokens=eval_tokens)
        row = {"kind": "eval", "step": step, **m}
        evals.append(row)
        log(row)

    run_eval(0)
    from rich.progress import Progress

    rows: list[dict] = []
    try:
        for _ in range(1 + cfg.max_policy_lag):  # the pipeline: this step's and the next ones'
            rollouts.submit(cfg.groups_per_step)
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("GRPO", total=cfg.steps)
            for step in range(cfg.steps):
                t0 = time.perf_counter()
                drawn, stale, draw_rewards, stale_hist = 0, 0, [], Counter()
                while not sampler.ready and drawn < cfg.max_draws:
                    if pool.num_inflight == 0:  # active sampling: draw more, current weights
                        rollouts.submit(cfg.groups_per_step)
                    done = pool.wait(num=1, timeout=cfg.sync_timeout_s)
                    if not done:
                        raise TimeoutError(
                            f"no rollouts arrived within {cfg.sync_timeout_s:.0f} s "
                            f"({pool.num_inflight} generation calls in flight)"
                        )
                    for handle, comps in done:
                        for group in rollouts.groups(handle, comps, step):
                            drawn += 1
                            draw_rewards += list(group.rewards)
                            comps_g = group.data["completions"]
                            lags = [step - v for c in comps_g for v in c.versions]
                            if lags and max(lags) > cfg.max_policy_lag:
                                stale += 1
                                continue
                            stale_hist.update(lags)
                            sampler.add(group)
                batch = sampler.pop_batch()
                while pool.num_inflight < cfg.max_policy_lag:  # keep the workers busy
                    rollouts.submit(cfg.groups_per_step)
                t_gen = time.perf_counter() - t0
                row: dict[str, Any] = {
                    "kind": "train",
                    "step": step,
                    "groups_drawn": drawn,
                    "groups_kept": len(batch),
                    "groups_stale": stale,
                    "reward_mean": sum(draw_rewards) / max(len(draw_rewards), 1),
                    "staleness": {str(k): v for k, v in sorted(stale_hist.items())},
                    "wait_s": t_gen,
                }
                if batch:
                    row |= _update(model, ref, opt, batch, cfg, step)
                    problems = [g.data["problem"] for g in batch for _ in g.rewards]
                    if batch[0].data["scored"] is not None:
                        scored = [r for g in batch for r in g.data["scored"]]
                        metrics = reward_metrics(problems, scored)
                        row |= {f"batch/{k}": v for k, v in metrics.items()}
                t1 = time.perf_counter()
                row["sync_s"] = pool.set_weights(model.state_dict(), version=step + 1)
                row["train_s"] = t1 - t0 - t_gen
                row["active_sampling"] = sampler.stats.as_dict()
                rows.append(row)
                log(row)
                if (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps:
                    run_eval(step + 1)
                bar.update(
                    task,
                    advance=1,
                    description=f"GRPO reward {row['reward_mean']:.2f} | "
                    f"eval {evals[-1]['all/solved']:.2f}",
                )
    finally:
        pool.shutdown()
    model.eval().save_pretrained(out / "model", tokenizer=tok)
    plot_rl(metrics_path, out / "rl.png")
    return {
        "metrics": str(metrics_path),
        "plot": str(out / "rl.png"),
        "model": str(out / "model"),
        "train": rows,
        "eval": evals,
    }


def _update(
    model: HybridLM,
    ref: HybridLM | None,
    opt: torch.optim.Optimizer,
    batch: list[Group],
    cfg: RLConfig,
    step: int,
) -> dict[str, Any]:
    """One GRPO optimizer step over the batch, in micro-batches normalised by the batch's token
    count (DESIGN habit 13)."""
    rewards_NG = torch.tensor([list(g.rewards) for g in batch], dtype=torch.float32)
    adv = group_advantages(rewards_NG, std_normalize=cfg.grpo.std_normalize).reshape(-1)
    comps = [c for g in batch for c in g.data["completions"]]
    num_tokens = sum(len(c.token_ids) for c in comps)
    for group in opt.param_groups:
        group["lr"] = _lr(step, cfg)
    opt.zero_grad(set_to_none=True)
    sums: Counter = Counter()
    for s in range(0, len(comps), cfg.micro_batch_size):
        mb = comps[s : s + cfg.micro_batch_size]
        logp_BT, mask_BT = completion_logprobs(model, mb, temperature=cfg.temperature)
        T = logp_BT.shape[1]
        rollout_BT = _pad([c.logprobs for c in mb], T, logp_BT.device)
        ref_BT = None
        if ref is not None:
            with torch.no_grad():
                ref_BT, _ = completion_logprobs(ref, mb, temperature=cfg.temperature)
        loss, stats = grpo_loss(
            logp_BT,
            None,  # one update per batch: the trainer's old policy is the current one
            adv[s : s + len(mb)].to(logp_BT.device),
            mask_BT,
            rollout_logp_BT=rollout_BT,
            ref_logp_BT=ref_BT,
            config=cfg.grpo,
            num_tokens=num_tokens,
            num_sequences=len(comps),
        )
        loss.backward()
        n = int(mask_BT.sum())
        sums["loss"] += float(loss.detach())
        for k, v in stats.items():  # token-weighted means over the batch
            sums[k] += float(v) * n
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    out = {k: v / num_tokens for k, v in sums.items() if k != "loss"}
    lengths = [len(c.token_ids) for c in comps]
    out |= {
        "loss": sums["loss"],
        "grad_norm": float(grad_norm),
        "lr": _lr(step, cfg),
        "tokens": num_tokens,
        "mean_length": sum(lengths) / len(lengths),
        "truncated_frac": sum(c.finish_reason == "length" for c in comps) / len(comps),
        "adv_abs_mean": float(adv.abs().mean()),
    }
    return out


# ---------------------------------------------------------------------- plot
def plot_rl(metrics_path: str | Path, png: str | Path) -> None:
    """Training reward and held-out solve rate by step, and the engine–trainer log-prob gap."""
    from ..train.plot import pyplot, save_figure

    plt = pyplot()

    rows = [json.loads(x) for x in Path(metrics_path).read_text().splitlines() if x]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    if train:
        a1.plot([r["step"] for r in train], [r["reward_mean"] for r in train], label="train reward")
    if evals:
        a1.plot(
            [r["step"] for r in evals],
            [r["all/solved"] for r in evals],
            marker="o",
            label="held-out solved (greedy)",
        )
    a1.set(xlabel="step", title="GRPO", ylim=(-0.02, 1.02))
    a1.legend()
    diffs = [(r["step"], r["logprob_diff_mean"]) for r in train if "logprob_diff_mean" in r]
    if diffs:
        a2.plot(*zip(*diffs, strict=True), label="|logp trainer − engine|")
    tis = [(r["step"], r["tis_truncated_frac"]) for r in train if "tis_truncated_frac" in r]
    if tis:
        a2.plot(*zip(*tis, strict=True), label="TIS truncated fraction")
    a2.set(xlabel="step", title="off-policy diagnostics")
    if diffs or tis:  # steps without an update (every group filtered) have no diagnostics
        a2.legend()
    save_figure(fig, png)


__all__ = [
    "EnvConfig",
    "RLConfig",
    "build_environment",
    "build_mixture",
    "completion_logprobs",
    "evaluate_policy",
    "run_rl",
]
