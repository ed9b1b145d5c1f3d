"""GRPO with verifiable rewards and asynchronous rollouts: `hybridlm rl` / `run_rl(RLRunConfig)`.

    hybridlm rl --checkpoint runs/sft --set train.max_steps=60 --set rl.executor=ray
    hybridlm rl --config configs/rl.yaml --set rl.reward=random      # the negative control

The run config has the sections of every stage: `train` (the loop, `RLTrainConfig`; its
`init_from` is the starting policy), `data` (the environments) and `rl` (`RLConfig`).

The loop (OlmoRL, Olmo 3 §4.4; Nemotron 3 Super §3.2):

1. **Rollouts** come from `RolloutPool` workers (Ray actors, or inline) running the inference
   engine over a copy of the policy: `group_size` completions per prompt, prompts drawn from a
   weighted mixture of environments (`rl.environments`), each completion with the engine's
   log-probs and the weight version of every token. Generation ends at the chat template's
   end-of-turn string, which stays in the completion (the policy must learn to stop).
   Problems of multi-turn environments (`calculator`, `search_qa`) are rolled out as episodes
   on the workers (`infer.rollout.roll_out`): each reply's tool calls are executed and their
   results appended as tool turns until the model answers, within `max_turns` replies,
   `max_new_tokens` per reply and `max_episode_tokens` per episode. The completion is
   everything after the opening prompt; the loss covers only the generated tokens.
2. **Rewards** from the environments' verifiers (an episode's when it ends; or, for the negative
   control `reward: random`, a fair coin per completion: no information, so no gain may follow;
   the verifier's rewards are logged for the control too, as `batch/...`).
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
   the numerical mismatch and the staleness), optional k3 KL to the initial policy. Options:
   `grpo.baseline: leave_one_out` (RLOO), `overlong_filter` (truncated samples carry no loss,
   DAPO), `freeze_router` (MoE router weights and balancing bias fixed).

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

from ..config import Config
from ..data.chat import STOP
from ..infer.rollout import Completion, RolloutPool, RolloutRequest
from ..interop.hf import save_pretrained
from ..io import load, load_model, resolve, tokenizer_spec_for
from ..model.model import HybridLM
from ..model.moe import TopKRouter
from ..report.plot import pyplot, save_figure
from ..report.stats import change_text, env_changes, reward_ends, window_text
from ..stage import Flow, Report, Stage
from ..train.callbacks import (
    AfterUpdate,
    Callback,
    Close,
    Export,
    Plot,
    Progress,
    Summary,
    Throughput,
)
from ..train.config import ScheduleKind, TrainConfig
from ..train.distributed.parallel import broadcast_object, full_model_state, is_main
from ..train.reward_model import RewardModelScorer, reward_input
from ..train.trainer import Loss, Runtime, Step, Trainer, TrainModule
from .env_config import (
    DifficultyFilterConfig,
    EnvConfig,
    build_environment,
    build_mixture,
    difficulty_filter,
    episode_reward,
    eval_specs,
    evaluate_policy,
    sample_policy,
)
from .environments import (
    MixtureEnvironment,
    Problem,
    reward_metrics,
)
from .grpo import (
    ActiveSampler,
    ActiveSamplingStats,
    Group,
    GRPOConfig,
    group_advantages,
    grpo_loss,
)
from .scoring import with_deadline
from .verifiers import Reward


@dataclass(kw_only=True)
class RLTrainConfig(TrainConfig):
    """The loop settings of a GRPO run (`train`): `TrainConfig` with the RL defaults (AdamW
    without weight decay, a constant learning rate after an optional linear warm-up, one row
    per step). `init_from` is the starting policy: a run, training checkpoint or transformers
    directory. Under torchrun rank 0 runs the rollouts and every rank trains on its share of
    each batch (`parallel`: ddp or fsdp)."""

    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    schedule: ScheduleKind = "constant"
    warmup_steps: int = 0
    max_steps: int = 50
    eval_interval: int = 10
    log_interval: int = 1
    checkpoint_interval: int = 0  # 0: only the final checkpoint
    out_dir: str = "runs/rl"
    peak_flops: float = 1.0  # no matmul probe: an RL step is mostly generation, no MFU is shown

    def validate(self) -> None:
        super().validate()
        self.check_own_loop("RL")  # rl.micro_batch_size splits a batch; no text data


@dataclass(kw_only=True)
class RLDataConfig:
    """The environments the policy trains on and is evaluated on (`data`)."""

    envs: list[EnvConfig] = field(default_factory=lambda: [EnvConfig()])
    eval_envs: list[EnvConfig] = field(default_factory=list)  # default: envs with seed + 1
    eval_problems: int = 64  # held-out problems of each greedy evaluation
    # Olmo 3's offline difficulty filter, run with the starting policy before the first step
    difficulty_filter: DifficultyFilterConfig = field(default_factory=DifficultyFilterConfig)

    def validate(self) -> None:
        if not self.envs:
            raise ValueError("data.envs: at least one environment")
        for e in [*self.envs, *self.eval_envs]:
            e.validate()
        self.difficulty_filter.validate()


@dataclass(kw_only=True)
class RLConfig:
    """Rollouts, rewards and the GRPO objective (`rl`; module docstring)."""

    # verifier: the environments'; random: a fair coin (the negative control); rm: a reward
    # model's score of prompt + completion (RLHF; `reward_model`, trained by `hybridlm rm`)
    reward: Literal["verifier", "random", "rm"] = "verifier"
    reward_model: str = ""
    length_penalty: float = 0.0  # reward -= length_penalty * generated tokens / max_new_tokens
    groups_per_step: int = 8
    group_size: int = 8
    max_draws: int = 32  # active sampling: most groups drawn for one step
    max_new_tokens: int = 64  # per reply (per turn of a multi-turn episode)
    max_episode_tokens: int = 0  # generated tokens per multi-turn episode (0: no bound)
    eval_max_new_tokens: int = 0  # 0: max_new_tokens
    # completions per held-out problem sampled at `temperature` at each eval, beside the greedy
    # one: the sampled solve rate `<env>/sampled` (what GRPO trains; 0: greedy only)
    eval_samples: int = 0
    overlong_filter: bool = False  # truncated samples carry no loss (DAPO overlong filtering)
    freeze_router: bool = False  # MoE routers (weights and balancing bias) fixed during RL
    temperature: float = 1.0
    top_p: float = 1.0
    micro_batch_size: int = 16  # completions per forward/backward
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    executor: Literal["ray", "inline"] = "ray"
    num_workers: int = 1
    ray_address: str = ""
    threads_per_worker: int = 1
    gpus_per_worker: float = -1.0  # Ray rollout actors; -1: one each when the cluster has GPUs
    max_policy_lag: int = 1
    sync_timeout_s: float = 300.0
    # seconds one completion may take to verify, in a worker process (rl.scoring): past it the
    # reward is 0 and the learner goes on; 0 verifies in this process with no deadline
    verify_timeout_s: float = 10.0

    def validate(self) -> None:
        for name in ("groups_per_step", "micro_batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"rl.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError("rl.group_size must be >= 2 (advantages are within groups)")
        if self.max_draws < self.groups_per_step:
            raise ValueError("rl.max_draws must be >= rl.groups_per_step")
        if self.max_policy_lag < 0:
            raise ValueError(f"rl.max_policy_lag must be >= 0, got {self.max_policy_lag}")
        if self.temperature <= 0:
            raise ValueError("RL samples: rl.temperature must be > 0")
        if self.reward == "rm" and not self.reward_model:
            raise ValueError("rl.reward: rm needs rl.reward_model (a run of hybridlm rm)")
        if self.length_penalty < 0:
            raise ValueError(f"rl.length_penalty must be >= 0, got {self.length_penalty}")
        if self.max_episode_tokens < 0:
            raise ValueError(f"rl.max_episode_tokens must be >= 0, got {self.max_episode_tokens}")
        if self.verify_timeout_s < 0:
            raise ValueError(f"rl.verify_timeout_s must be >= 0, got {self.verify_timeout_s}")
        if self.eval_samples < 0:
            raise ValueError(f"rl.eval_samples must be >= 0, got {self.eval_samples}")


# where the keys of the flat RL config (before the sections) went
_TRAIN_KEYS = {"lr", "warmup_steps", "weight_decay", "grad_clip", "eval_interval", "seed"}
_TRAIN_KEYS |= {"checkpoint_interval", "keep_last_n", "out_dir", "device", "parallel"}
_MOVED_RL = {
    "checkpoint": "train.init_from",
    "steps": "train.max_steps",
    **{k: f"train.{k}" for k in _TRAIN_KEYS},
    **{k: f"data.{k}" for k in ("envs", "eval_envs", "eval_problems")},
    **{f.name: f"rl.{f.name}" for f in dataclasses.fields(RLConfig)},
}


@dataclass(kw_only=True)
class RLRunConfig(Config):
    """A GRPO run: `train` (the loop; `train.init_from` is the starting policy), `data` (the
    environments) and `rl` (rollouts, rewards, the objective), the sections of every stage."""

    WHAT = "rl config"
    MOVED = _MOVED_RL

    train: RLTrainConfig = field(default_factory=RLTrainConfig)
    data: RLDataConfig = field(default_factory=RLDataConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def validate(self) -> RLRunConfig:
        """The settings' ranges; the starting policy (`train.init_from`, often given on the
        command line) is checked when a run starts (`rl_trainer`)."""
        self.train.validate()
        self.data.validate()
        self.rl.validate()
        return self


# ---------------------------------------------------------------------- batches
def completion_logprobs(
    model: HybridLM,
    comps: list[Completion],
    *,
    temperature: float,
    forward: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's log-probs of every completion token under softmax(logits / T), teacher-forced
    on prompt + completion (right-padded rows: causal layers never see the padding). Returns
    (logp_BT, mask_BT) over completion positions; the mask is the completion's loss mask (0 on
    an episode's environment tokens). `forward`: what runs the batch (a data-parallel
    wrapper of `model`; default the model itself)."""
    device = model.embeddings.weight.device
    lengths = [len(c.prompt_ids) + len(c.token_ids) for c in comps]
    T = max(len(c.token_ids) for c in comps)
    ids_BL = torch.zeros(len(comps), max(lengths), dtype=torch.long, device=device)
    for i, c in enumerate(comps):
        ids_BL[i, : lengths[i]] = torch.tensor(c.prompt_ids + c.token_ids, device=device)
    # the balancing loss (`.aux`) is left out: it is not part of the RL objective
    logits_BLV = (forward or model)(ids_BL).logits
    logp_BT = torch.zeros(len(comps), T, dtype=torch.float32, device=device)
    mask_BT = torch.zeros(len(comps), T, dtype=torch.bool, device=device)
    for i, c in enumerate(comps):
        p, n = len(c.prompt_ids), len(c.token_ids)
        lp_NV = torch.log_softmax(logits_BLV[i, p - 1 : p - 1 + n].float() / temperature, -1)
        logp_BT[i, :n] = lp_NV.gather(-1, ids_BL[i, p : p + n, None])[:, 0]
        mask_BT[i, :n] = torch.tensor(c.loss_mask, dtype=torch.bool)
    return logp_BT, mask_BT


def _pad(rows: list[list[float]], T: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(rows), T, dtype=torch.float32, device=device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


# ---------------------------------------------------------------------- rollouts
class _Rollouts:
    """Problem draws, submission to the pool, scoring into groups. Draw k samples its problems
    from the mixture with seed `train.seed * 1_000_003 + k`, so a draw is rebuilt from its
    number (a resumed run re-creates the problems of the groups it had in hand)."""

    def __init__(self, run: RLRunConfig, env: MixtureEnvironment, tok: Any) -> None:
        cfg = run.rl
        self.cfg, self.seed, self.env, self.tok = cfg, run.train.seed, env, tok
        self.pool: RolloutPool | None = None
        self.params = {
            "max_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "stop": [STOP],
            "include_stop_str_in_output": True,
        }
        self.budgets = {  # of the multi-turn episodes (each environment caps its own turns)
            "max_turns": max(s.max_turns for s in run.data.envs),
            "max_episode_tokens": cfg.max_episode_tokens or None,
        }
        self.pending: dict[int, tuple[int, int]] = {}  # id(handle) -> (draw, groups)
        self.ready: list[tuple[int, int, list[Completion]]] = []  # restored finished calls
        self.draws = 0
        self._rm: RewardModelScorer | None = None

    def problems(self, draw: int, n_groups: int) -> list[Problem]:
        return self.env.sample(n_groups, seed=self.seed * 1_000_003 + draw)

    def submit(self, n_groups: int) -> None:
        assert self.pool is not None
        self.draws += 1
        problems = self.problems(self.draws, n_groups)
        reqs = [
            RolloutRequest(p.id, [], self.cfg.group_size, problem=p)
            if self.env.env_of(p).multi_turn
            else RolloutRequest(p.id, self.tok.encode(p.prompt), self.cfg.group_size)
            for p in problems
        ]
        handle = self.pool.submit(reqs, self.params, **self.budgets)
        self.pending[id(handle)] = (self.draws, n_groups)

    @property
    def num_inflight(self) -> int:
        return len(self.ready) + (self.pool.num_inflight if self.pool is not None else 0)

    def wait(self, timeout: float) -> list[tuple[int, int, list[Completion]]]:
        """Finished calls: restored ones first, then the pool's (at least one)."""
        if self.ready:
            done, self.ready = self.ready, []
            return done
        assert self.pool is not None
        out = []
        for handle, comps in self.pool.wait(num=1, timeout=timeout):
            draw, n = self.pending.pop(id(handle))
            out.append((draw, n, comps))
        return out

    def drain(self) -> None:
        """Wait for every call in flight and keep its completions in hand (`ready`), so the
        rollout state at a checkpoint is data, not futures."""
        assert self.pool is not None
        while self.pool.num_inflight:
            for handle, comps in self.pool.wait(num=self.pool.num_inflight):
                draw, n = self.pending.pop(id(handle))
                self.ready.append((draw, n, comps))

    def groups(self, draw: int, n_groups: int, comps: list[Completion], step: int) -> list[Group]:
        problems = self.problems(draw, n_groups)
        G = self.cfg.group_size
        expanded = [problems[i // G] for i in range(len(comps))]
        # the verifier's rewards are logged whatever trains: what the control or an RLHF run
        # really earns (reward hacking shows as RM reward up, verifier reward flat or down)
        scored = self.score(expanded, comps)
        if self.cfg.reward == "random":  # negative control: a fair coin, blind to the text
            rewards = [float(_coin(f"{self.seed}/{step}/{c.key}/{c.index}")) for c in comps]
        elif self.cfg.reward == "rm":
            rm = self.reward_model()
            rewards = rm.score([reward_input(c.prompt_ids + c.token_ids, self.tok) for c in comps])
        else:
            rewards = [r.value for r in scored]
        if self.cfg.length_penalty:
            k = self.cfg.length_penalty / self.cfg.max_new_tokens
            rewards = [r - k * c.num_generated for r, c in zip(rewards, comps, strict=True)]
        out = []
        for g, problem in enumerate(problems):
            sl = slice(g * G, (g + 1) * G)
            data = {
                "problem": problem,
                "completions": comps[sl],
                "scored": scored[sl],
                "draw": (draw, n_groups, g),
            }
            out.append(Group(prompt_id=problem.id, rewards=rewards[sl], data=data))
        return out

    def reward_model(self) -> RewardModelScorer:
        """The RLHF reward model, loaded on first use; its tokenizer must be the policy's (it
        scores the sampled token ids as they are)."""
        if self._rm is None:
            rm = RewardModelScorer(self.cfg.reward_model)
            probe = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>"
            if rm.tokenizer.encode(probe) != self.tok.encode(probe):
                raise ValueError(
                    f"the reward model {self.cfg.reward_model} uses another tokenizer than the "
                    "policy; it must score the policy's token ids"
                )
            self._rm = rm
        return self._rm

    def score(self, problems: list[Problem], comps: list[Completion]) -> list[Reward]:
        """The verifier's rewards: an episode's comes with it (scored by its environment as it
        ended), a plain completion's text is scored here (batched per environment)."""
        out: list[Reward | None] = [
            None
            if c.reward is None  # a plain completion: scored below
            else episode_reward(c.reward, c.info, c.turns, c.finish_reason == "length")
            for c in comps
        ]
        plain = [i for i, r in enumerate(out) if r is None]
        if plain:
            got = self.env.score_many(
                [problems[i] for i in plain], [comps[i].text.removesuffix(STOP) for i in plain]
            )
            for i, r in zip(plain, got, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]

    def regroup(self, state: dict[str, Any]) -> Group:
        """A group kept in the active sampler, rebuilt from its checkpointed form."""
        draw, n_groups, g = state["draw"]
        problem = self.problems(draw, n_groups)[g]
        comps = [Completion(**c) for c in state["completions"]]
        scored = self.score([problem] * len(comps), comps)
        data = {
            "problem": problem,
            "completions": comps,
            "scored": scored,
            "draw": (draw, n_groups, g),
        }
        return Group(prompt_id=problem.id, rewards=state["rewards"], data=data)


def _counts(m: dict[str, float]) -> dict[str, float]:
    """The held-out problems per environment (`<env>/count`) of an eval row."""
    return {k.removesuffix("/count"): v for k, v in m.items() if k.endswith("/count")}


def _coin(key: str) -> bool:
    """A fair coin that depends only on `key`."""
    return random.Random(zlib.crc32(key.encode())).random() < 0.5


# ---------------------------------------------------------------------- the learner
class GRPOLearner(TrainModule):
    """The GRPO learner as a stage of the one `Trainer` (module docstring): each step waits for
    a batch of kept groups, its micro-batches are completions with their advantages, the loss is
    `grpo_loss` normalised by the batch's token count (DESIGN habit 13), and after the update
    the new weights go to the rollout workers. Checkpoints hold the rollout state (draw counter,
    the workers' sampling-stream positions, finished calls and kept groups not yet trained on),
    so that a resumed inline run repeats the uninterrupted one exactly."""

    stage = "rl"

    def __init__(
        self,
        run: RLRunConfig,
        rt: Runtime,
        *,
        env: MixtureEnvironment | None,
        eval_env: MixtureEnvironment | None,
    ) -> None:
        super().__init__(rt)
        self.run, self.cfg = run, run.rl
        cfg, data, policy = run.rl, run.data, run.train.init_from
        loaded = load(policy, setting="train.init_from")
        self.model = loaded.model.float().to(rt.device)
        if cfg.freeze_router:  # MoE routing fixed: weights and the balancing bias
            for m in self.model.modules():
                if isinstance(m, TopKRouter):
                    m.requires_grad_(False)
        self.tok = loaded.tokenizer
        # what the run's checkpoints load with (`hybridlm.io.load` reads data.tokenizer)
        self.tokenizer_spec = tokenizer_spec_for(policy, setting="train.init_from")
        raw = env or build_mixture(data.envs, tokenizer=self.tok)  # before any deadline
        self.env = raw
        self.eval_env = eval_env or build_mixture(
            eval_specs(data.envs, data.eval_envs), tokenizer=self.tok
        )
        if cfg.verify_timeout_s > 0:  # a verifier never stalls the learner (rl.scoring)
            self.env = with_deadline(self.env, timeout_s=cfg.verify_timeout_s)
            self.eval_env = with_deadline(self.eval_env, timeout_s=cfg.verify_timeout_s)
        self.filter_stats: dict[str, dict[str, float]] = {}
        if rt.rank == 0:  # an earlier attempt's figures never stand for this run's
            (rt.out / "difficulty_filter.json").unlink(missing_ok=True)
        if data.difficulty_filter.problems > 0:
            self._filter(raw)
        self.eval_set = self.eval_env.sample(data.eval_problems, seed=run.train.seed + 12345)
        self.eval_tokens = cfg.eval_max_new_tokens or cfg.max_new_tokens
        self.ref = None
        if cfg.grpo.kl_coef > 0:  # the initial policy, frozen
            ref = load_model(policy, setting="train.init_from").float().to(rt.device)
            self.ref = ref.eval().requires_grad_(False)
        self.total_steps = run.train.max_steps
        self.sampler = ActiveSampler(batch_groups=cfg.groups_per_step, max_draws=cfg.max_draws)
        self.rollouts = _Rollouts(run, self.env, self.tok)
        self.last_eval: dict[str, float] = {}
        self._restored: dict[str, Any] | None = None
        self._started = False

    def _filter(self, raw: MixtureEnvironment) -> None:
        """Olmo 3's offline difficulty filter of the training mixture `raw` (before any
        verification deadline) with the starting policy (rank 0; the kept problems go to every
        rank), its pass rates logged and kept in `difficulty_filter.json`."""
        cfg, data = self.cfg, self.run.data
        got = None
        if self.rt.rank == 0:
            t0 = time.perf_counter()
            filtered, stats = difficulty_filter(
                self.model,
                self.tok,
                raw,
                data.difficulty_filter,
                scorer=self.env,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens,
                max_episode_tokens=cfg.max_episode_tokens or None,
                seed=self.run.train.seed,
            )
            kept = {n: {p.id for p in e} for n, e in filtered.envs.items() if n in stats}
            got = (kept, filtered.weights, stats, time.perf_counter() - t0)
        kept, weights, self.filter_stats, seconds = broadcast_object(got)
        envs = [
            e.subset(lambda p, ids=kept[n]: p.id in ids) if n in kept else e  # type: ignore[attr-defined]
            for n, e in raw.envs.items()
        ]
        mixture = MixtureEnvironment(envs, [weights[e.name] for e in envs])
        mixture.weights = dict(weights)
        self.env = mixture
        if cfg.verify_timeout_s > 0:
            self.env = with_deadline(mixture, timeout_s=cfg.verify_timeout_s)
        if self.rt.rank == 0:
            (self.rt.out / "difficulty_filter.json").write_text(
                json.dumps({"seconds": seconds, "envs": self.filter_stats}, indent=1) + "\n"
            )
            for name, st in self.filter_stats.items():
                k = self.run.data.difficulty_filter.samples
                print(
                    f"[rl] difficulty filter {name}: kept {st['kept']:.0f} of {st['pool']:.0f} "
                    f"(dropped {st['dropped_solved']:.0f} solved, {st['dropped_unsolved']:.0f} "
                    f"unsolved); starting policy pass@1 {st['pass@1']:.2f}, "
                    f"pass@{k} {st[f'pass@{k}']:.2f}"
                )

    # ------------------------------------------------------------------ rollouts
    def _start(self, step: int, weights: dict[str, torch.Tensor]) -> None:
        """Start the workers with the current `weights` (version `step`) and fill the pipeline:
        this step's call and the next `max_policy_lag` ones (or restore a checkpoint's)."""
        cfg = self.cfg
        self.rollouts.pool = RolloutPool(
            self.model.config,
            self.tok,
            weights,
            executor=cfg.executor,
            num_workers=cfg.num_workers,
            ray_address=cfg.ray_address or None,
            threads_per_worker=cfg.threads_per_worker,
            sync_timeout_s=cfg.sync_timeout_s,
            seed=self.run.train.seed,
            version=step,
            engine_kwargs={"max_batch_size": cfg.groups_per_step * cfg.group_size},
            env=self.env.episodic(),  # the environments whose episodes the workers step
            gpus_per_worker=None if cfg.gpus_per_worker < 0 else cfg.gpus_per_worker,
        )
        state = self._restored
        if state is None:
            for _ in range(1 + cfg.max_policy_lag):
                self.rollouts.submit(cfg.groups_per_step)
            return
        self.rollouts.pool.load_state_dict(state["pool"])
        self.rollouts.draws = state["draws"]
        self.rollouts.ready = [
            (d, n, [Completion(**c) for c in comps]) for d, n, comps in state["ready"]
        ]
        for g in state["kept"]:
            self.sampler._buffer.append(self.rollouts.regroup(g))
        self.sampler.stats = ActiveSamplingStats(**state["sampler_stats"])

    def _collect(self, step: int) -> tuple[list[Completion], torch.Tensor | None, dict[str, Any]]:
        """Wait for a batch of kept groups: its completions, their advantages and the step's
        row fields (rank 0, which runs the rollout workers)."""
        cfg, rollouts, sampler = self.cfg, self.rollouts, self.sampler
        t0 = time.perf_counter()
        drawn, stale, draw_rewards, draw_solved, stale_hist = 0, 0, [], [], Counter()
        env_solved: dict[str, list[bool]] = {}
        while not sampler.ready and drawn < cfg.max_draws:
            if rollouts.num_inflight == 0:  # active sampling: draw more, current weights
                rollouts.submit(cfg.groups_per_step)
            done = rollouts.wait(timeout=cfg.sync_timeout_s)
            if not done:
                raise TimeoutError(
                    f"no rollouts arrived within {cfg.sync_timeout_s:.0f} s "
                    f"({rollouts.num_inflight} generation calls in flight)"
                )
            for draw, n, comps in done:
                for group in rollouts.groups(draw, n, comps, step):
                    drawn += 1
                    draw_rewards += list(group.rewards)
                    solved = [r.value >= 1.0 for r in group.data["scored"]]
                    draw_solved += solved
                    env_solved.setdefault(group.data["problem"].env, []).extend(solved)
                    comps_g = group.data["completions"]
                    lags = [step - v for c in comps_g for v in c.versions if v >= 0]
                    if lags and max(lags) > cfg.max_policy_lag:
                        stale += 1
                        continue
                    stale_hist.update(lags)
                    sampler.add(group)
        batch = sampler.pop_batch()
        while rollouts.num_inflight < cfg.max_policy_lag:  # keep the workers busy
            rollouts.submit(cfg.groups_per_step)
        self._t_gen = time.perf_counter() - t0
        self._t0 = t0
        info: dict[str, Any] = {
            "groups_drawn": drawn,
            "groups_kept": len(batch),
            "groups_stale": stale,
            "reward_mean": sum(draw_rewards) / max(len(draw_rewards), 1),
            # the verifier's verdicts on every drawn sample (before filtering; for any reward):
            # the training draw's sampled pass@1
            "draw_solved": sum(draw_solved) / max(len(draw_solved), 1),
            # per environment: the sampled (T) solve rate of this step's draws, and their count
            **{f"draw/{e}/solved": sum(v) / len(v) for e, v in sorted(env_solved.items())},
            **{f"draw/{e}/count": len(v) for e, v in sorted(env_solved.items())},
            "staleness": {str(k): v for k, v in sorted(stale_hist.items())},
            "wait_s": self._t_gen,
        }
        if not batch:  # every group filtered: no update this step
            return [], None, info
        rewards_NG = torch.tensor([list(g.rewards) for g in batch], dtype=torch.float32)
        adv = group_advantages(
            rewards_NG, std_normalize=cfg.grpo.std_normalize, baseline=cfg.grpo.baseline
        ).reshape(-1)
        comps = [c for g in batch for c in g.data["completions"]]
        lengths = [c.num_generated for c in comps]
        truncated = [c.finish_reason == "length" for c in comps]
        if cfg.overlong_filter:  # DAPO: a cut-off sample is no evidence either way
            comps = [
                dataclasses.replace(c, mask=[0] * len(c.token_ids)) if t else c
                for c, t in zip(comps, truncated, strict=True)
            ]
        info |= {
            "tokens": sum(c.num_generated for c in comps),
            "mean_length": sum(lengths) / len(lengths),
            "truncated_frac": sum(truncated) / len(comps),
            "adv_abs_mean": float(adv.abs().mean()),
        }
        problems = [g.data["problem"] for g in batch for _ in g.rewards]
        scored = [r for g in batch for r in g.data["scored"]]
        info |= {f"batch/{k}": v for k, v in reward_metrics(problems, scored).items()}
        return comps, adv, info

    def prepare_step(self, step: int) -> Step:
        """Rank 0 collects the batch (`_collect`) and sends it to every rank; each trains on
        its consecutive share of the completions, the loss normalised by the batch's token
        count (so the shares sum to the single-process loss)."""
        self._step = step
        rt = self.rt
        if not self._started:  # the workers start with the weights of this step
            weights = full_model_state(self.model)  # collective under FSDP
            if rt.rank == 0:
                self._start(step, weights)
            self._started = True
        got = self._collect(step) if rt.rank == 0 else None
        comps, adv, info = broadcast_object(got)
        if not comps or not info["tokens"]:  # nothing kept, or every token filtered out
            return Step([], info=info)
        ctx = {"num_tokens": info["tokens"], "num_sequences": len(comps)}
        mine, adv_mine = rt.share(comps), rt.share(list(adv))
        M = self.cfg.micro_batch_size
        micro = [
            (mine[s : s + M], torch.stack(adv_mine[s : s + M])) for s in range(0, len(mine), M)
        ]
        return Step(micro, ctx=ctx, info=info)

    def loss(self, micro: tuple[list[Completion], torch.Tensor], step: Step) -> Loss:
        cfg = self.cfg
        mb, adv = micro
        num_tokens = step.ctx["num_tokens"]
        logp_BT, mask_BT = completion_logprobs(
            self.model, mb, temperature=cfg.temperature, forward=self.forward_model
        )
        T = logp_BT.shape[1]
        rollout_BT = _pad([c.logprobs for c in mb], T, logp_BT.device)
        ref_BT = None
        if self.ref is not None:
            with torch.no_grad():
                ref_BT, _ = completion_logprobs(self.ref, mb, temperature=cfg.temperature)
        loss, stats = grpo_loss(
            logp_BT,
            None,  # one update per batch: the trainer's old policy is the current one
            adv.to(logp_BT.device),
            mask_BT,
            rollout_logp_BT=rollout_BT,
            ref_logp_BT=ref_BT,
            config=cfg.grpo,
            num_tokens=num_tokens,
            num_sequences=step.ctx["num_sequences"],
        )
        n = int(mask_BT.sum())
        # token-weighted means over the batch
        return Loss(loss, {k: float(v) * n / num_tokens for k, v in stats.items()})

    def after_update(self, step: Step, outcome: Any) -> dict[str, Any]:
        """Hand the new weights to the workers (version = steps done; rank 0)."""
        weights = full_model_state(self.model)  # collective under FSDP
        if self.rt.rank != 0:
            return {}
        version = self._step + 1
        t1 = time.perf_counter()
        assert self.rollouts.pool is not None
        out = {
            "sync_s": self.rollouts.pool.set_weights(weights, version=version),
            "train_s": t1 - self._t0 - self._t_gen,
            "active_sampling": self.sampler.stats.as_dict(),
        }
        return out

    # ------------------------------------------------------------------ eval + state
    def evaluate(self) -> dict[str, float]:
        cfg = self.cfg
        budget = {"max_new_tokens": self.eval_tokens,
                  "max_episode_tokens": cfg.max_episode_tokens or None}  # fmt: skip
        m = evaluate_policy(self.model, self.tok, self.eval_set, self.eval_env, **budget)
        if cfg.eval_samples:  # the same problems sampled, seeded alike at every eval
            rewards, _ = sample_policy(
                self.model, self.tok, self.eval_set, self.eval_env, **budget,
                samples=cfg.eval_samples, temperature=cfg.temperature, top_p=cfg.top_p,
                seed=self.run.train.seed,
            )  # fmt: skip
            flat = [r for rs in rewards for r in rs]
            probs = [p for p in self.eval_set for _ in range(cfg.eval_samples)]
            m |= {
                k.replace("/solved", "/sampled"): v
                for k, v in reward_metrics(probs, flat).items()
                if k.endswith("/solved")
            }
            m |= {f"{e}/sampled_count": n * cfg.eval_samples for e, n in _counts(m).items()}
        self.last_eval = m
        return m

    def state_dict(self) -> dict[str, Any]:
        """The rollout state at a step boundary (class docstring); in-flight calls are waited
        for first."""
        r = self.rollouts
        if r.pool is None:
            return {}
        r.drain()
        return {
            "rl": {
                "draws": r.draws,
                "pool": r.pool.state_dict(),
                "ready": [
                    [d, n, [dataclasses.asdict(c) for c in comps]] for d, n, comps in r.ready
                ],
                "kept": [
                    {
                        "draw": list(g.data["draw"]),
                        "rewards": list(g.rewards),
                        "completions": [dataclasses.asdict(c) for c in g.data["completions"]],
                    }
                    for g in self.sampler._buffer
                ],
                "sampler_stats": dataclasses.asdict(self.sampler.stats),
            }
        }

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        self._restored = meta.get("rl")

    def run_config(self) -> dict[str, Any]:
        run = self.run.to_dict()
        data = {**run["data"], "tokenizer": self.tokenizer_spec}
        return {**run, "model": self.model.config.to_dict(), "data": data}

    def callbacks(self) -> list[Callback]:
        return [
            AfterUpdate(self.after_update),
            Throughput(),
            Progress(self.progress_text),
            Close(self.close),
            Export(self.export),
            Plot(self.plot),
            Summary(self.summary),
        ]

    def progress_text(self, row: dict[str, Any]) -> str:
        solved = self.last_eval.get("all/solved", float("nan"))
        return f"reward {row['reward_mean']:.2f} | eval {solved:.2f}"

    def export(self) -> Path:
        """The final policy as a transformers directory `<out>/model`."""
        return save_pretrained(self.model.eval(), self.rt.out / "model", tokenizer=self.tok)

    def plot(self, metrics_path: Path) -> Path:
        plot_rl(metrics_path, self.rt.out / "rl.png")
        return self.rt.out / "rl.png"

    def summary(self) -> dict[str, Any]:
        """The run's train and eval rows (of its whole metrics log, resumed parts included)."""
        rows = [json.loads(x) for x in self.rt.metrics_path.read_text().splitlines() if x]
        return {
            "model": str(self.rt.out / "model"),
            "train": [r for r in rows if r["kind"] == "train"],
            "eval": [r for r in rows if r["kind"] == "eval"],
        }

    def close(self) -> None:
        if self.rollouts.pool is not None:
            self.rollouts.pool.shutdown()


def rl_trainer(
    cfg: RLRunConfig,
    *,
    env: MixtureEnvironment | None = None,
    eval_env: MixtureEnvironment | None = None,
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
) -> Trainer:
    """The Trainer of a GRPO run, ready to `train()`."""
    cfg.validate()
    policy = cfg.train.init_from
    if not policy:
        raise ValueError("rl needs a starting policy: set train.init_from (or --checkpoint)")
    resolve(policy, setting="train.init_from")  # a missing policy fails before any work
    return Trainer(
        dataclasses.replace(cfg.train, progress=cfg.train.progress and progress),
        lambda rt: GRPOLearner(cfg, rt, env=env, eval_env=eval_env),
        resume=resume,
        overwrite=overwrite,
    )


def run_rl(
    cfg: RLRunConfig,
    *,
    env: MixtureEnvironment | None = None,
    eval_env: MixtureEnvironment | None = None,
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
    until_step: int | None = None,
) -> dict[str, Any]:
    """Train the policy of `cfg.train.init_from` with GRPO; returns a summary (metrics path, plot,
    per-step rows, eval results). `env` / `eval_env` replace the configured environments (any
    `Environment`s, e.g. a custom verifier, wrapped in a `MixtureEnvironment`). An earlier run
    in `cfg.train.out_dir` needs `resume=True` (continue from its newest checkpoint) or
    `overwrite=True`."""
    trainer = rl_trainer(
        cfg, env=env, eval_env=eval_env, progress=progress, resume=resume, overwrite=overwrite
    )
    if is_main():
        cfg.save(trainer.out / "rl.yaml")
    return trainer.train(until_step=until_step)


# ---------------------------------------------------------------------- plot
def plot_rl(metrics_path: str | Path, png: str | Path) -> None:
    """Training reward (and the verifier's, when another reward trains), held-out solve rate,
    the engine–trainer log-prob gap, and the mean generated length by step."""

    plt = pyplot()

    rows = [json.loads(x) for x in Path(metrics_path).read_text().splitlines() if x]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    envs = sorted({k.split("/")[1] for r in train for k in r if k.startswith("draw/")})
    fig, axes = plt.subplots(1, 4 if len(envs) > 1 else 3, figsize=(18.5, 3.6))
    a1, a2, a3 = axes[:3]
    if len(envs) > 1:  # several environments: each one's sampled and held-out solve rate
        a4 = axes[3]
        for env in envs:
            pts = [(r["step"], r[f"draw/{env}/solved"]) for r in train if f"draw/{env}/solved" in r]
            line = a4.plot(*zip(*pts, strict=True), alpha=0.6, label=f"{env} (sampled draws)")
            held = [(r["step"], r[f"{env}/solved"]) for r in evals if f"{env}/solved" in r]
            if held:
                a4.plot(*zip(*held, strict=True), "o--", color=line[0].get_color(),
                        label=f"{env} (held-out greedy)")  # fmt: skip
        a4.set(xlabel="step", ylabel="fraction solved", title="per environment",
               ylim=(-0.02, 1.02))  # fmt: skip
        a4.legend(fontsize=7)
    if train:
        a1.plot([r["step"] for r in train], [r["reward_mean"] for r in train], label="train reward")
        verifier = [
            (r["step"], r["batch/all/reward_mean"]) for r in train if "batch/all/reward_mean" in r
        ]
        if verifier and any(r.get("batch/all/reward_mean") != r["reward_mean"] for r in train):
            a1.plot(*zip(*verifier, strict=True), label="verifier reward (trained batch)")
        lengths = [(r["step"], r["mean_length"]) for r in train if "mean_length" in r]
        if lengths:
            a3.plot(*zip(*lengths, strict=True))
    a3.set(xlabel="step", ylabel="generated tokens per sample", title="length drift")
    a3.set_ylim(bottom=0)
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
    "RLDataConfig",
    "RLRunConfig",
    "RLTrainConfig",
    "build_environment",
    "build_mixture",
    "completion_logprobs",
    "evaluate_policy",
    "rl_trainer",
    "run_rl",
]


# ---------------------------------------------------------------------- the flow's stage
def _stage_settings(flow: Flow) -> dict[str, Any]:
    data = flow.format_paths(flow.cfg.rl.to_dict())
    data["train"] |= {"init_from": flow.model_path("rl"), "out_dir": str(flow.stage_dir("rl"))}
    return data


def _stage_run(flow: Flow) -> dict[str, Any]:
    cfg = RLRunConfig.from_dict(flow.settings("rl"))
    # not resumable: an interrupted attempt's outputs in the stage dir are replaced
    result = run_rl(cfg, progress=flow.progress, overwrite=True)
    rewards = [r["reward_mean"] for r in result["train"]]
    k, first, last = reward_ends(rewards)
    filtered = flow.stage_dir("rl") / "difficulty_filter.json"
    return {
        "model": result["model"],
        "steps": len(rewards),
        "reward_window": k,
        "reward_first": first,
        "reward_last": last,
        "eval": [
            {"step": e.get("step"), **{k: v for k, v in e.items() if k.endswith(_EVAL_KEYS)}}
            for e in result["eval"]
        ],
        "difficulty_filter": json.loads(filtered.read_text())["envs"] if filtered.exists() else {},
    }


_EVAL_KEYS = ("/solved", "/count", "/sampled", "/sampled_count")


def _check(section: RLRunConfig, cfg: Any, stages: Any) -> None:
    # the RL settings, checked now rather than after pretraining (the flow sets init_from)
    section.validate()


def _headline(s: dict[str, Any], report: Report) -> str:
    rewards = [r["reward_mean"] for r in report.rows("rl", "train")]
    k, first, last = reward_ends(rewards)
    if first is None or last is None:
        return "train reward: no steps logged"
    text = f"train reward ({window_text(k, len(rewards))}): {first:.3f} -> {last:.3f}"
    evals = report.rows("rl", "eval")
    for metric, label in (("solved", "greedy"), ("sampled", "sampled")):
        changes = env_changes(evals, metric)
        if changes:
            text += f"; held-out {label} " + ", ".join(
                f"{env} {p:.2f} -> {q:.2f} ({change_text(q - p, se)})"
                for env, (p, q, se, _) in changes.items()
                if env != "all"
            )
    return text


# GRPO with verifiable rewards from the newest model, rollouts on Ray actors
STAGE = Stage(
    "rl",
    config=RLRunConfig,
    settings=_stage_settings,
    run=_stage_run,
    model="model",
    check=_check,
    headline=_headline,
)
