"""Environments named by config, and the greedy evaluation of a policy on them: what the RL
learner (`rl.learner`), the speedrun's eval stage and MTP healing on RL prompts share.

    env = build_mixture([EnvConfig(kind="gsm8k"), EnvConfig(kind="calculator", weight=0.5)])
    held = build_mixture(eval_specs(envs))        # the same environments, held-out problems
    evaluate_policy(model, tokenizer, held.sample(64, seed=0), held, max_new_tokens=256)
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..config import Config
from ..data import builtin
from ..data.chat import STOP
from ..data.sft import arithmetic_conversations
from ..infer.engine import Engine
from ..infer.sampling import SamplingParams
from ..io import load
from ..model.model import HybridLM
from ..report.stats import pass_at_k
from .environments import (
    ArithmeticEnvironment,
    CalculatorEnvironment,
    CodeEnvironment,
    CodeToolEnvironment,
    DatasetEnvironment,
    Environment,
    FilterReport,
    GSM8KEnvironment,
    InstructionFollowingEnvironment,
    LowEffortEnvironment,
    MathEnvironment,
    MixtureEnvironment,
    Problem,
    SearchQAEnvironment,
    reward_metrics,
)
from .episodes import run_episodes
from .verifiers import GSM8KVerifier, Reward

EnvKind = Literal[
    "arithmetic",
    "sft_arithmetic",
    "gsm8k",
    "math",
    "code",
    "code_gen",
    "ifeval",
    "calculator",
    "search_qa",
    "code_tool",
    "http",
]


@dataclass(kw_only=True)
class EnvConfig(Config):
    """One environment of the mixture. `path` is the dataset for gsm8k (JSONL; empty: the
    packaged train split, evaluated on the packaged test split), math (JSONL), code (HumanEval
    JSONL[.gz]; empty: the packaged copy) and ifeval (IFEval JSONL; empty: the generated set)."""

    WHAT = "environment"

    kind: EnvKind = "arithmetic"
    weight: float = 1.0
    path: str = ""
    limit: int = 0  # first N problems of a dataset (0: all)
    num_problems: int = 2000  # generated environments
    difficulty: list[int] = field(default_factory=lambda: [1, 2])  # arithmetic
    digits: int = 2  # sft_arithmetic: operands below 10**digits; calculator: factor digits
    terms: int = 2  # sft_arithmetic: numbers per question (> 2: chained steps, data.tasks)
    ops: str = "+-"  # sft_arithmetic: operators drawn from ("*": by one digit)
    seed: int = 0  # generated environments
    low_effort_fraction: float = 0.0  # prompts switched to low-effort mode (length penalty)
    max_turns: int = 4  # tool-use environments (calculator, search_qa, code_tool): replies
    url: str = ""  # http: an environment server (rl.remote; `hybridlm env-serve`)
    # a chat model that grades the replies instead of the verifier (GenRM, rl.judge; the
    # judge runs on the learner: single-turn environments only)
    judge: str = ""

    def validate(self) -> EnvConfig:
        if self.max_turns < 1:
            raise ValueError(f"envs[].max_turns must be >= 1, got {self.max_turns}")
        if self.weight < 0:
            raise ValueError(f"envs[].weight must be >= 0, got {self.weight}")
        if self.judge and self.kind in ("calculator", "search_qa", "code_tool", "http"):
            raise ValueError(f"envs[].judge grades single-turn replies; {self.kind!r} has episodes")
        if self.low_effort_fraction > 0 and self.kind in ("calculator", "search_qa", "code_tool"):
            raise ValueError("envs[].low_effort_fraction applies to single-turn environments")
        if self.kind == "http" and not self.url:
            raise ValueError("an http environment needs its server's url (envs[].url)")
        return self


def build_environment(spec: EnvConfig, *, tokenizer: Any = None) -> Environment:
    """The environment an `EnvConfig` names (wrapped in low-effort mode when asked)."""
    kind = spec.kind
    limit = spec.limit or None
    if kind == "arithmetic":
        env: Environment = ArithmeticEnvironment(
            num_problems=spec.num_problems, difficulty=spec.difficulty, seed=spec.seed
        )
    elif kind == "sft_arithmetic":  # the questions `hybridlm sft` trains on (data/sft.py)
        env = sft_arithmetic_environment(
            spec.num_problems, digits=spec.digits, seed=spec.seed, terms=spec.terms, ops=spec.ops
        )
    elif kind == "gsm8k":
        env = GSM8KEnvironment(spec.path or builtin.path(builtin.GSM8K_TRAIN), limit=limit)
    elif kind == "math":
        env = MathEnvironment.from_jsonl(_need(spec))
    elif kind == "code":
        env = CodeEnvironment.from_humaneval(spec.path or builtin.path(builtin.HUMANEVAL))
    elif kind == "code_gen":  # small generated functions (data.tasks), sandboxed tests
        env = CodeEnvironment.generated(num_problems=spec.num_problems, seed=spec.seed)
    elif kind == "calculator":  # multi-turn: 5-digit products with the calculator tool
        env = CalculatorEnvironment(
            num_problems=spec.num_problems,
            digits=spec.digits,
            seed=spec.seed,
            max_turns=spec.max_turns,
        )
    elif kind == "search_qa":  # multi-turn: questions answered by BM25 search of a corpus
        env = SearchQAEnvironment(
            num_problems=spec.num_problems, seed=spec.seed, max_turns=spec.max_turns
        )
    elif kind == "code_tool":  # multi-turn: code tested with the sandboxed python tool
        env = CodeToolEnvironment.from_humaneval(
            spec.path or builtin.path(builtin.HUMANEVAL), max_turns=spec.max_turns
        )
    elif kind == "http":  # served by another process (rl.remote); held-out: another server
        from .remote import HTTPEnvironment

        env = HTTPEnvironment(spec.url)
        env.max_turns = spec.max_turns  # the turns a rollout allows (the server caps its own)
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
    if spec.judge:  # GenRM: the judge's rating replaces the verifier's reward
        from .judge import GenerativeJudge, JudgedEnvironment

        judge = load(spec.judge)
        engine = Engine(judge.model.float().eval(), judge.tokenizer, max_batch_size=32)
        env = JudgedEnvironment(env, GenerativeJudge(engine))
    if spec.low_effort_fraction > 0:
        count = _TokenCount(tokenizer) if tokenizer else None
        env = LowEffortEnvironment(env, fraction=spec.low_effort_fraction, count_tokens=count)
    return env


@dataclass(frozen=True)
class _TokenCount:
    """The tokens of a text (low-effort length): a class, not a lambda, so the environment
    pickles for the scoring workers (`rl.scoring`) and Ray."""

    tokenizer: Any

    def __call__(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_bos=False))


class _FinalNumberEnvironment(DatasetEnvironment):
    def score(self, problem: Problem, completion: str) -> Reward:
        return self.verifier(completion, problem.answer)


def sft_arithmetic_environment(
    n: int, *, digits: int, seed: int, terms: int = 2, ops: str = "+-"
) -> DatasetEnvironment:
    """ "What is a + b?" / "What is a - b?" with `digits`-digit operands (chains of `terms`
    numbers; `ops` "*": by one digit), as in the arithmetic chats of `hybridlm sft`
    (`data.sft.arithmetic_conversations`), scored on the final number."""

    tag = f"{digits}" if terms == 2 else f"{digits}x{terms}"
    tag += "" if ops == "+-" else f"/{ops}"
    problems = [
        Problem(
            id=f"sft_arithmetic/{tag}/{seed}/{i}",
            messages=(conv[0],),
            answer=conv[1]["content"],
            metadata={"digits": digits, "terms": terms, "ops": ops},
        )
        for i, conv in enumerate(
            arithmetic_conversations(n, seed=seed, digits=digits, terms=terms, ops=ops)
        )
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


def environment_prompts(
    kind: str, tokenizer: Any, *, n_train: int, n_eval: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Chat prompts of an RL environment (`EnvConfig(kind=...)`), e.g. for MTP healing after RL
    (Nemotron 3 Super §4.7): training prompts from one seed, held-out ones from another."""

    def prompts(env_seed: int, n: int) -> list[list[int]]:
        env = build_environment(EnvConfig(kind=kind, seed=env_seed), tokenizer=tokenizer)
        return [tokenizer.encode(p.prompt) for p in env.sample(n, seed=env_seed)]

    return prompts(seed, n_train), prompts(seed + 1, n_eval)


def eval_specs(envs: list[EnvConfig], eval_envs: list[EnvConfig] | None = None) -> list[EnvConfig]:
    """Held-out problems: `eval_envs` when given, else the training `envs` with the generated
    ones reseeded (GSM8K: its test file next to the train file, when there is one; the packaged
    test split for the packaged train split)."""
    if eval_envs:
        return eval_envs
    out = []
    for s in envs:
        s = dataclasses.replace(s, seed=s.seed + 1, low_effort_fraction=0.0)
        if s.kind == "gsm8k" and not s.path:
            s = dataclasses.replace(s, path=str(builtin.path(builtin.GSM8K_TEST)))
        elif s.kind == "gsm8k" and Path(s.path).name in ("train.jsonl", "train.jsonl.gz"):
            test = Path(s.path).with_name(Path(s.path).name.replace("train", "test"))
            if test.is_file():
                s = dataclasses.replace(s, path=str(test))
        out.append(s)
    return out


def episode_reward(reward: float, info: dict[str, Any], turns: int, truncated: bool) -> Reward:
    """A multi-turn episode's reward as a `Reward`, with its turns, tool calls and whether a
    budget cut it as metrics."""
    metrics = {"turns": float(turns), "tool_calls": float(info.get("tool_calls", 0))}
    metrics["truncated"] = float(truncated)
    return Reward(reward, str(info.get("reason", "")), metrics)


@torch.no_grad()
def sample_policy(
    model: HybridLM,
    tok: Any,
    problems: list[Problem],
    env: MixtureEnvironment,
    *,
    max_new_tokens: int,
    max_episode_tokens: int | None = None,
    samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> tuple[list[list[Reward]], list[list[int]]]:
    """`samples` completions of every problem (greedy at temperature 0; multi-turn
    environments: episodes with their turns and tool calls as reward metrics), scored: the
    rewards [problem][sample] and generated tokens. `max_new_tokens` bounds each reply; sample j
    of problem i is seeded `seed + samples * i + j`."""
    was_training = model.training
    model.eval()
    engine = Engine(model, tok, max_batch_size=32)
    flat = [(i, j) for i in range(len(problems)) for j in range(samples)]

    def params(i: int, j: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_new_tokens,
            stop=[STOP],
            temperature=temperature,
            top_p=top_p,
            seed=None if temperature == 0 else seed + samples * i + j,
        )

    multi = [k for k, (i, _) in enumerate(flat) if env.env_of(problems[i]).multi_turn]
    plain = [k for k, (i, _) in enumerate(flat) if not env.env_of(problems[i]).multi_turn]
    rewards: list[Reward | None] = [None] * len(flat)
    lengths = [0] * len(flat)
    if plain:
        outs = engine.generate(
            [tok.encode(problems[flat[k][0]].prompt) for k in plain],
            [params(*flat[k]) for k in plain],
        )
        got = env.score_many([problems[flat[k][0]] for k in plain], [o.text for o in outs])
        for k, o, r in zip(plain, outs, got, strict=True):
            rewards[k], lengths[k] = r, len(o.token_ids)
    if multi:
        todo = [problems[flat[k][0]] for k in multi]
        results = run_episodes(
            engine,
            env,
            todo,
            params(0, 0),
            max_turns=max(getattr(env.env_of(p), "max_turns", 1) for p in todo),
            max_episode_tokens=max_episode_tokens,
            seeds=None if temperature == 0 else [1000 * (seed + k) for k in multi],
        )
        for k, res in zip(multi, results, strict=True):
            rewards[k] = episode_reward(res.reward, res.info, res.turns, res.truncated)
            lengths[k] = res.generated
    model.train(was_training)
    out_r = [rewards[i * samples : (i + 1) * samples] for i in range(len(problems))]
    out_l = [lengths[i * samples : (i + 1) * samples] for i in range(len(problems))]
    return out_r, out_l  # type: ignore[return-value]


def evaluate_policy(
    model: HybridLM,
    tok: Any,
    problems: list[Problem],
    env: MixtureEnvironment,
    *,
    max_new_tokens: int,
    max_episode_tokens: int | None = None,
) -> dict[str, float]:
    """Greedy completions of held-out problems, scored: `all/solved`, per-environment metrics
    (for multi-turn environments, greedy episodes with their mean turns and tool calls).
    `max_new_tokens` bounds each reply."""
    rewards, lengths = sample_policy(
        model,
        tok,
        problems,
        env,
        max_new_tokens=max_new_tokens,
        max_episode_tokens=max_episode_tokens,
    )
    m = reward_metrics(problems, [r[0] for r in rewards])
    m["mean_length"] = sum(n[0] for n in lengths) / len(lengths)
    return m


@dataclass(kw_only=True)
class DifficultyFilterConfig(Config):
    """Offline difficulty filtering (Olmo 3 §4.4.2): before RL, the starting policy samples
    `samples` completions of the first `problems` training problems of every environment (at
    the RL temperature); those it solves at a rate >= `max_rate` (nothing left to learn) or <=
    `min_rate` (no signal) are dropped, the problems it did not sample stay (`problems` at
    least the dataset's size filters all of it, as Olmo 3 does: 8 samples, rates above 62.5%
    dropped). `problems: 0` turns it off. The same samples give the starting policy's pass@1
    and pass@`samples` per environment."""

    WHAT = "difficulty filter"

    problems: int = 0  # per environment; 0: no filter
    samples: int = 8
    min_rate: float = 0.0
    max_rate: float = 1.0

    def validate(self) -> DifficultyFilterConfig:
        if self.problems < 0 or self.samples < 1:
            raise ValueError("data.difficulty_filter: problems must be >= 0 and samples >= 1")
        if not 0.0 <= self.min_rate < self.max_rate <= 1.0:
            raise ValueError(
                "data.difficulty_filter: need 0 <= min_rate < max_rate <= 1, got "
                f"{self.min_rate}, {self.max_rate}"
            )
        return self


def difficulty_filter(
    model: HybridLM,
    tok: Any,
    mixture: MixtureEnvironment,
    cfg: DifficultyFilterConfig,
    *,
    scorer: MixtureEnvironment | None = None,
    temperature: float,
    top_p: float = 1.0,
    max_new_tokens: int,
    max_episode_tokens: int | None = None,
    seed: int = 0,
) -> tuple[MixtureEnvironment, dict[str, dict[str, float]]]:
    """The mixture without the problems among each environment's first `cfg.problems` (its
    pool) whose pass rate under `model` is outside (`cfg.min_rate`, `cfg.max_rate`)
    (`DifficultyFilterConfig`), and per environment: pool, kept (of the pool), dropped as
    solved / unsolved, pass@1 and pass@k of the pool (k = `cfg.samples`). `scorer` scores the
    samples (the mixture under a verification deadline; default `mixture`). An environment left
    with no problems gets weight 0 (all of them: the mixture is returned unfiltered, with a
    warning); one that is not a fixed dataset (a server) is not filtered."""
    if cfg.problems < 1:
        return mixture, {}
    scorer = scorer or mixture
    envs, weights, stats = [], [], {}
    for name, env in mixture.envs.items():
        weight = mixture.weights[name]
        if not isinstance(env, DatasetEnvironment) or weight == 0:
            envs.append(env)
            weights.append(weight)
            continue
        pool = [env[i] for i in range(min(cfg.problems, len(env)))]
        rewards, _ = sample_policy(
            model,
            tok,
            pool,
            scorer,
            max_new_tokens=max_new_tokens,
            max_episode_tokens=max_episode_tokens,
            samples=cfg.samples,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
        )
        n = cfg.samples
        report = FilterReport.split(
            pool, [sum(r.value for r in rs) / n for rs in rewards], cfg.min_rate, cfg.max_rate
        )
        solved = [sum(r.value >= 1.0 for r in rs) for rs in rewards]
        stats[name] = {
            "pool": float(len(pool)),
            "kept": float(len(report.kept)),
            "dropped_solved": float(report.dropped_solved),
            "dropped_unsolved": float(report.dropped_unsolved),
            "pass@1": sum(pass_at_k(n, c, 1) for c in solved) / len(pool),
            f"pass@{n}": sum(pass_at_k(n, c, n) for c in solved) / len(pool),
        }
        drop = {p.id for p in pool} - {p.id for p in report.kept}
        kept = env.subset(lambda p, drop=drop: p.id not in drop)
        envs.append(kept if len(kept) else env)
        weights.append(weight if len(kept) else 0.0)
    if not any(weights):  # nothing in range anywhere: train on the unfiltered problems
        warnings.warn(
            "the difficulty filter kept no problem of any environment (the starting policy "
            "solves each always or never): RL trains on the unfiltered problems",
            stacklevel=2,
        )
        return mixture, stats
    return MixtureEnvironment(envs, weights), stats
