"""Evaluation tasks: data + prompt format + metric, one registry.

Kinds (OLMES, Gu et al. 2024; Olmo 3 §6.1):

- **bpb** ("Base Easy"): bits per byte of a gold answer given its question,
  sum NLL(answer tokens) / (ln 2 * UTF-8 bytes of those tokens), aggregated over the task as a
  ratio of sums; standard error by bootstrap over items (1000 resamples, seeded).
- **rolling bpb**: bits per byte of whole documents (rolling windows, `loglik.rolling_windows`).
- **multiple choice** in two formats: *cloze* (`:rc`, "Question: q\\nAnswer:" scored with each
  answer text as the continuation) and *MC* (`:mc`, the options listed as " A. ...", the
  continuation is the letter " A"). Cloze is reported under every normalisation: none (sum
  log-prob), per-token, per-char (characters of the answer text without the space delimiter,
  as lm-eval's `acc_norm`) and PMI
  (log p(answer | question) - log p(answer | "Answer:"), the unconditional context OLMES uses);
  `acc` is the task's chosen one. Standard errors: sample std of the per-item 0/1 scores over
  sqrt(n) (the binomial standard error with n - 1).
- **generative exact match** (GSM8K): greedy decoding with stop sequences, scored by the shared
  RL verifier (`rl.verifiers`), so an evaluation and an RL reward agree by construction.
- **code pass@k** (HumanEval): n samples per problem, run against the tests in `rl.sandbox`,
  unbiased pass@k (`report.stats`).
- **RULER** (`ruler.py`): synthetic long-context tasks at several lengths.
- **IFEval** (`ifeval.py`): instruction following, prompt- and instruction-level accuracy, strict
  and loose, by the shared RL checkers (`rl.ifeval`, which follow IFEval's reference code).

GSM8K, HumanEval and tinyshakespeare are the copies packaged in `hybridlm.data.builtin`, or read
from `data_dir` when one is given (`gsm8k/test.jsonl`, `humaneval/HumanEval.jsonl.gz`,
`tinyshakespeare/input.txt`, each also as `.gz`); copycolors and RULER are generated.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data import builtin
from ..data.bpb import token_byte_lengths
from ..data.chat import STOP
from ..infer.engine import Engine
from ..infer.sampling import SamplingParams
from ..model.model import HybridLM
from ..report.stats import mean_pass_at_k, pass_at_k
from ..rl.environments import GSM8K_INSTRUCTION, CodeEnvironment, GSM8KEnvironment
from ..rl.sandbox import Sandbox, SandboxConfig
from .loglik import LN2, LoglikResult, encode_pair, loglikelihood, loglikelihood_rolling
from .ruler import RULER_TASKS, RulerSample, make_samples, score_prediction

NORMALISATIONS = ("none", "token", "char", "pmi")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


# ---------------------------------------------------------------------- statistics
def mean_stderr(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample std (n - 1) / sqrt(n)); the standard error is NaN for n < 2."""
    n = len(values)
    if n == 0:
        raise ValueError("no values to average")
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def bootstrap_ratio_stderr(
    num: Sequence[float], den: Sequence[float], *, iters: int = 1000, seed: int = 0
) -> float:
    """Bootstrap standard error of sum(num) / sum(den) over items (resampled with
    replacement, `iters` times, seeded)."""
    n = len(num)
    if n < 2:
        return float("nan")
    g = torch.Generator().manual_seed(seed)
    idx_IN = torch.randint(0, n, (iters, n), generator=g)
    num_N = torch.tensor(num, dtype=torch.float64)
    den_N = torch.tensor(den, dtype=torch.float64)
    ratios_I = num_N[idx_IN].sum(1) / den_N[idx_IN].sum(1)
    return float(ratios_I.std(unbiased=True))


# ---------------------------------------------------------------------- runner
@dataclass(kw_only=True)
class EvalRunner:
    """What tasks need from a model: batched log-likelihoods and greedy/sampled generation."""

    model: HybridLM
    tokenizer: Any
    max_batch_tokens: int = 16_384
    max_batch_rows: int = 64
    gen_batch_size: int = 8
    max_len: int | None = None
    progress: bool = False
    _byte_lengths: torch.Tensor | None = field(default=None, repr=False)

    @property
    def byte_lengths(self) -> torch.Tensor:
        """UTF-8 bytes per token id (`data.bpb.token_byte_lengths`)."""
        if self._byte_lengths is None:
            self._byte_lengths = token_byte_lengths(self.tokenizer, self.model.config.vocab_size)
        return self._byte_lengths

    def num_bytes(self, ids: Sequence[int]) -> int:
        return int(self.byte_lengths[torch.tensor(list(ids), dtype=torch.long)].sum())

    def loglik_tokens(self, reqs: Sequence[tuple[list[int], list[int]]]) -> list[LoglikResult]:
        return loglikelihood(
            self.model,
            reqs,
            max_len=self.max_len,
            max_batch_tokens=self.max_batch_tokens,
            max_batch_rows=self.max_batch_rows,
            progress=self.progress,
        )

    def loglik(
        self, pairs: Sequence[tuple[str, str]]
    ) -> tuple[list[LoglikResult], list[tuple[list[int], list[int]]]]:
        """Score `(context, continuation)` strings; also returns their token ids."""
        reqs = [encode_pair(self.tokenizer, c, x) for c, x in pairs]
        return self.loglik_tokens(reqs), reqs

    def rolling(self, texts: Sequence[str], *, stride: int | None = None) -> list[float]:
        docs = [self.tokenizer.encode(t, add_bos=False) for t in texts]
        return loglikelihood_rolling(
            self.model,
            docs,
            prefix_id=self.tokenizer.bos_id,
            max_len=self.max_len,
            stride=stride,
            max_batch_tokens=self.max_batch_tokens,
            max_batch_rows=self.max_batch_rows,
            progress=self.progress,
        )

    def generate(self, prompts: Sequence[str], params: Sequence[SamplingParams]) -> list[str]:
        """Continuations of `prompts` (BOS + prompt, the prompt's oldest tokens dropped when it
        does not leave room for `max_tokens`); continuous batching in the `Engine`."""
        limit = self.max_len or self.model.config.max_seq_len
        engine = Engine(
            self.model, self.tokenizer, max_batch_size=self.gen_batch_size, max_model_len=limit
        )
        ids = []
        for p, sp in zip(prompts, params, strict=True):
            toks = self.tokenizer.encode(p, add_bos=True)
            keep = max(1, limit - sp.max_tokens - 1)
            ids.append(toks if len(toks) <= keep else [toks[0], *toks[-(keep - 1) :]])
        if not self.progress:
            return [o.text for o in engine.generate(ids, list(params))]
        from rich.progress import Progress

        rids = [engine.add_request(t, sp) for t, sp in zip(ids, params, strict=True)]
        final: dict[str, str] = {}
        with Progress(transient=True) as bar:
            job = bar.add_task(f"generate ({len(rids)} requests)", total=len(rids))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out.text
                        bar.advance(job)
        return [final[r] for r in rids]


@dataclass(kw_only=True)
class TaskResult:
    metrics: dict[str, float]
    stderr: dict[str, float]
    num_items: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    stderr_method: str = ""
    notes: list[str] = field(default_factory=list)


class Task:
    """A named evaluation: `run(runner, limit)` scores at most `limit` items (all when None)."""

    name: str = ""
    kind: str = ""

    def run(self, runner: EvalRunner, limit: int | None = None) -> TaskResult:
        raise NotImplementedError


def _check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")


def _take(items: list, limit: int | None) -> list:
    _check_limit(limit)
    return items if limit is None else items[:limit]


# ---------------------------------------------------------------------- bpb on gold answers
@dataclass(kw_only=True)
class BpbTask(Task):
    """Bits per byte of gold continuations given their contexts (OLMES Base Easy)."""

    name: str
    load: Callable[[], list[tuple[str, str]]]
    kind: str = "bpb"

    def run(self, runner: EvalRunner, limit: int | None = None) -> TaskResult:
        items = _take(self.load(), limit)
        res, reqs = runner.loglik(items)
        nll = [-r.logprob for r in res]
        nbytes = [runner.num_bytes(cont) for _, cont in reqs]
        bpb = sum(nll) / (LN2 * sum(nbytes))
        se = bootstrap_ratio_stderr(nll, nbytes) / LN2
        samples = [
            {"index": i, "nll": n, "bytes": b, "bpb": n / (LN2 * b) if b else None}
            for i, (n, b) in enumerate(zip(nll, nbytes, strict=True))
        ]
        return TaskResult(
            metrics={"bpb": bpb},
            stderr={"bpb": se},
            num_items=len(items),
            samples=samples,
            stderr_method="bootstrap over items (1000 resamples) of the ratio of sums",
        )


@dataclass(kw_only=True)
class RollingBpbTask(Task):
    """Bits per byte of whole documents (rolling log-likelihood)."""

    name: str
    load: Callable[[], list[str]]
    stride: int | None = None
    kind: str = "rolling_bpb"

    def run(self, runner: EvalRunner, limit: int | None = None) -> TaskResult:
        docs = _take(self.load(), limit)
        lls = runner.rolling(docs, stride=self.stride)
        nll = [-x for x in lls]
        nbytes = [len(d.encode("utf-8")) for d in docs]
        return TaskResult(
            metrics={"bpb": sum(nll) / (LN2 * sum(nbytes))},
            stderr={"bpb": bootstrap_ratio_stderr(nll, nbytes) / LN2},
            num_items=len(docs),
            samples=[
                {"index": i, "nll": n, "bytes": b}
                for i, (n, b) in enumerate(zip(nll, nbytes, strict=True))
            ],
            stderr_method="bootstrap over documents (1000 resamples) of the ratio of sums",
        )


# ---------------------------------------------------------------------- multiple choice
@dataclass(frozen=True, kw_only=True)
class MCItem:
    question: str
    choices: tuple[str, ...]
    answer: int  # index of the gold choice


def cloze_prompt(item: MCItem) -> str:
    return f"Question: {item.question}\nAnswer:"


def mc_prompt(item: MCItem) -> str:
    """OLMES MCF: the options listed with a leading space before each label."""
    if len(item.choices) > len(LETTERS):
        raise ValueError(f"at most {len(LETTERS)} choices in MC format")
    opts = "".join(f"\n {LETTERS[i]}. {c}" for i, c in enumerate(item.choices))
    return f"Question: {item.question}{opts}\nAnswer:"


def normalised_scores(
    logprobs: Sequence[float],
    *,
    num_tokens: Sequence[int],
    num_chars: Sequence[int],
    uncond_logprobs: Sequence[float] | None,
    norm: str,
) -> list[float]:
    """Per-choice scores under one normalisation (higher is better)."""
    if norm == "none":
        return list(logprobs)
    if norm == "token":
        return [lp / n for lp, n in zip(logprobs, num_tokens, strict=True)]
    if norm == "char":
        return [lp / n for lp, n in zip(logprobs, num_chars, strict=True)]
    if norm == "pmi":
        if uncond_logprobs is None:
            raise ValueError("PMI normalisation needs the unconditional log-probs")
        return [lp - u for lp, u in zip(logprobs, uncond_logprobs, strict=True)]
    raise ValueError(f"unknown normalisation {norm!r}; choose from {', '.join(NORMALISATIONS)}")


def _argmax(xs: Sequence[float]) -> int:
    return max(range(len(xs)), key=lambda i: (xs[i], -i))  # ties: the first


@dataclass(kw_only=True)
class MCTask(Task):
    """Multiple choice, cloze (`fmt="rc"`) or MC-letter (`fmt="mc"`) format."""

    name: str
    load: Callable[[], list[MCItem]]
    fmt: str = "rc"
    norm: str = "char"  # the cloze normalisation reported as `acc`
    unconditional_context: str = "Answer:"  # PMI denominator context (OLMES)
    kind: str = "multiple_choice"

    def __post_init__(self) -> None:
        if self.fmt not in ("rc", "mc"):
            raise ValueError(f"MC format must be 'rc' (cloze) or 'mc' (letters), got {self.fmt}")
        if self.norm not in NORMALISATIONS:
            raise ValueError(f"unknown normalisation {self.norm!r}")

    def run(self, runner: EvalRunner, limit: int | None = None) -> TaskResult:
        items = _take(self.load(), limit)
        pairs: list[tuple[str, str]] = []
        for it in items:
            if not 0 <= it.answer < len(it.choices):
                raise ValueError(f"{self.name}: answer index {it.answer} out of range")
            if self.fmt == "rc":
                pairs += [(cloze_prompt(it), f" {c}") for c in it.choices]
            else:
                pairs += [(mc_prompt(it), f" {LETTERS[j]}") for j in range(len(it.choices))]
        n_cond = len(pairs)
        if self.fmt == "rc":  # unconditional scores for PMI, one per distinct answer text
            uncond = sorted({x for _, x in pairs})
            pairs += [(self.unconditional_context, x) for x in uncond]
        res, reqs = runner.loglik(pairs)
        uncond_lp = {pairs[i][1]: res[i].logprob for i in range(n_cond, len(pairs))}
        norms = NORMALISATIONS if self.fmt == "rc" else ("none",)
        correct: dict[str, list[float]] = {n: [] for n in norms}
        gold_nll, gold_bytes, samples = [], [], []
        pos = 0
        for i, it in enumerate(items):
            k = len(it.choices)
            r = res[pos : pos + k]
            conts = [pairs[pos + j][1] for j in range(k)]
            lps = [x.logprob for x in r]
            kw = {
                "num_tokens": [x.num_tokens for x in r],
                "num_chars": [len(c) for c in it.choices],  # the answer text, no delimiter
                "uncond_logprobs": [uncond_lp[c] for c in conts] if self.fmt == "rc" else None,
            }
            preds = {n: _argmax(normalised_scores(lps, norm=n, **kw)) for n in norms}
            for n in norms:
                correct[n].append(float(preds[n] == it.answer))
            gold_nll.append(-lps[it.answer])
            gold_bytes.append(runner.num_bytes(reqs[pos + it.answer][1]))
            samples.append({"index": i, "logprobs": lps, "answer": it.answer, "pred": preds})
            pos += k
        metrics, stderr = {}, {}
        for n in norms:
            metrics[f"acc_{n}"], stderr[f"acc_{n}"] = mean_stderr(correct[n])
        main = self.norm if self.fmt == "rc" else "none"
        metrics["acc"], stderr["acc"] = metrics[f"acc_{main}"], stderr[f"acc_{main}"]
        if self.fmt == "rc":  # gold-answer bpb (Base Easy) comes for free
            metrics["bpb_gold"] = sum(gold_nll) / (LN2 * sum(gold_bytes))
            stderr["bpb_gold"] = bootstrap_ratio_stderr(gold_nll, gold_bytes) / LN2
        return TaskResult(
            metrics=metrics,
            stderr=stderr,
            num_items=len(items),
            samples=samples,
            stderr_method="acc: sample std of per-item 0/1 / sqrt(n); bpb: bootstrap",
        )


# ---------------------------------------------------------------------- generative
def _data_file(name: str, data_dir: Path | None, what: str) -> Path:
    """The packaged copy of `name` (a `hybridlm.data.builtin` name), or the file under an
    explicit `data_dir`, which must exist."""
    path = builtin.path(name, data_dir)
    if not path.is_file():
        raise ValueError(f"{what} not found at {path} (omit --data-dir for the packaged copy)")
    return path


def _gsm8k_rows(data_dir: Path | None) -> list[dict[str, str]]:
    return builtin.read_jsonl(_data_file(builtin.GSM8K_TEST, data_dir, "GSM8K"))


def gsm8k_final(answer: str) -> str:
    """The number after '####' in a GSM8K reference solution, without thousands commas."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


PROMPT_FORMATS = ("base", "chat")


def _check_format(fmt: str) -> None:
    if fmt not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be 'base' or 'chat', got {fmt!r}")


@dataclass(kw_only=True)
class GSM8KTask(Task):
    """GSM8K generative exact match over the shared `rl.environments.GSM8KEnvironment`: its
    problems and its reward (the RL verifier: final number, numeric equality), so an evaluation
    and an RL reward agree by construction. Greedy decoding with stop sequences.

    `prompt_format="base"`: `num_fewshot` solved examples from the train split (the first ones,
    fixed; OLMES uses 8) then "Question: <question>\\nAnswer:", stopping at a blank line or the
    next "Question:" (the reference solutions end with "#### N", which the verifier reads first);
    `"chat"`: the environment's chat prompt (question + its answer-format instruction), stopping
    at the end-of-turn marker."""

    name: str
    data_dir: Path | None = None  # None: the packaged GSM8K
    max_tokens: int = 256
    prompt_format: str = "base"
    num_fewshot: int = 0
    kind: str = "generative"

    def __post_init__(self) -> None:
        _check_format(self.prompt_format)
        if self.num_fewshot < 0:
            raise ValueError(f"num_fewshot must be >= 0, got {self.num_fewshot}")

    def fewshot_block(self) -> str:
        if self.num_fewshot == 0:
            return ""
        path = _data_file(builtin.GSM8K_TRAIN, self.data_dir, "GSM8K few-shot examples (train)")
        rows = builtin.read_jsonl(path, limit=self.num_fewshot)
        return "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows)

    def run(self, runner: EvalRunner, limit: int | None = None) -> TaskResult:
        path = _data_file(builtin.GSM8K_TEST, self.data_dir, "GSM8K")
        _check_limit(limit)
        env = GSM8KEnvironment(path, limit=limit)
        problems = list(env)
        if self.prompt_format == "base":
            shots = self.fewshot_block()
            suffix = f"\n\n{GSM8K_INSTRUCTION}"  # the environment's chat instruction
            prompts = [
                f"{shots}Question: {p.user_text.removesuffix(suffix)}\nAnswer:" for p in problems
            ]
            stop = ["\n\n", "\nQuestion:"]
        else:
            prompts, stop = [p.prompt for p in problems], [STOP]
        sp = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, stop=stop)
        outs = runner.generate(prompts, [sp] * len(problems))
        rewards = env.score_many(problems, outs)
        samples = [
            {"id": p.id, "completion": o, "gold": p.answer, "reward": r.value, "reason": r.reason}
            for p, o, r in zip(problems, outs, rewards, strict=True)
        ]
        acc, se = mean_stderr([r.value for r in rewards])
        return TaskResult(
            metrics={"exact_match": acc},
            stderr={"exact_match": se},
            num_items=len(problems),
            samples=samples,
            stderr_method="sample std of per-item 0/1 / sqrt(n)",
        )


# ---------------------------------------------------------------------- code pass@k
def _humaneval_rows(data_dir: Path | None) -> list[dict[str, str]]:
    return builtin.read_jsonl(_data_file(builtin.HUMANEVAL, data_dir, "HumanEval"))


# Codex stop sequences (Chen et al. 2021 §3.2): a new top-level statement ends the function
HUMANEVAL_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


def humaneval_environment(data_dir: Path | None = None, *, timeout_s: float = 10.0) -> Any:
    """The shared `rl.environments.CodeEnvironment` over HumanEval (the packaged copy when
    `data_dir` is None), its sandbox limited to `timeout_s` per program."""
    path = _data_file(builtin.HUMANEVAL, data_dir, "HumanEval")
    return CodeEnvironment.from_humaneval(path, sandbox=Sandbox(SandboxConfig(timeout_s=timeout_s)))


def score_humaneval(
    env: Any, problems: Sequence[Any], completions: Sequence[str], num_samples: int
) -> tuple[list[Any], list[int]]:
    """Score `num_samples` completions per problem (problem-major order) with the code
    environment (program = prompt + completion, or the completion's own definition of the
    entry point; the problem's `check` runs in the sandbox). Returns the rewards and the number
    of fully passing samples per problem."""
    n = num_samples
    if len(completions) != n * len(problems):
        raise ValueError(f"expected {n * len(problems)} completions, got {len(completions)}")
    rewards = env.score_many([problems[j // n] for j in range(len(completions))], completions)
    passed = [r.value >= 1.0 for r in rewards]
    return rewards, [sum(passed[p * n : (p + 1) * n]) for p in range(len(problems))]


@dataclass(kw_only=True)
class HumanEvalTask(Task):
    """HumanEval pass@k over the shared `rl.environments.CodeEnvironment`: `num_samples`
    completions per problem (greedy when 1, else temperature / top-p sampling, seeded), scored in
    the sandbox; unbiased pass@k for every k in `ks`. `prompt_format="base"` continues the
    function signature + docstring (Codex stop sequences); `"chat"` uses the environment's chat
    prompt (the whole function in a code block)."""

    name: str
    data_dir: Path | None = None  # None: the packaged HumanEval
    num_samples: int = 1
    ks: tuple[int, ...] = (1,)
    temperature: float = 0.8
    top_p: float = 0.95
    max_tokens: int = 256
    timeout_s: float = 10.0
    seed: int = 0
    prompt_format: str = "base"
    kind: str = "code"

    def __post_init__(self) -> None:
        _check_format(self.prompt_format)
        if any(k > self.num_samples for k in self.ks):
            raise ValueError(f"pass@k needs k <= num_samples ({self.num_samples}), got {self.ks}")

    def run(self, runner: EvalRunner, limit: int | None = None) -> TaskResult:
        env = humaneval_environment(self.data_dir, timeout_s=self.timeout_s)
        problems = _take(list(env), limit)
        n = self.num_samples
        greedy = n == 1
        base = self.prompt_format == "base"
        stop = list(HUMANEVAL_STOP) if base else [STOP]
        prompts, params = [], []
        for p, prob in enumerate(problems):
            for s in range(n):
                prompts.append(prob.answer["prompt"] if base else prob.prompt)
                params.append(
                    SamplingParams(
                        max_tokens=self.max_tokens,
                        temperature=0.0 if greedy else self.temperature,
                        top_p=1.0 if greedy else self.top_p,
                        seed=None if greedy else self.seed * 1_000_003 + p * n + s,
                        stop=stop,
                    )
                )
        outs = runner.generate(prompts, params)
        rewards, correct = score_humaneval(env, problems, outs, n)
        metrics, stderr = {}, {}
        for k in self.ks:
            metrics[f"pass@{k}"], stderr[f"pass@{k}"] = mean_pass_at_k(
                [n] * len(problems), correct, k
            )
        samples = [
            {
                "task_id": prob.id,
                "num_correct": correct[p],
                "pass@1": pass_at_k(n, correct[p], 1),
                "completions": outs[p * n : (p + 1) * n],
                "reasons": [rewards[p * n + s].reason for s in range(n)],
            }
            for p, prob in enumerate(problems)
        ]
        return TaskResult(
            metrics=metrics,
            stderr=stderr,
            num_items=len(problems),
            samples=samples,
            stderr_method="sample std of per-problem pass@k estimates / sqrt(#problems)",
        )


# ---------------------------------------------------------------------- RULER
def ruler_generate(
    runner: EvalRunner, tasks: Sequence[str], lengths: Sequence[int], num_samples: int, *, seed: int
) -> tuple[list[RulerSample], list[str], list[str]]:
    """`num_samples` RULER samples of every (task, length) that fits, in that order, with their
    greedy continuations up to a newline; plus one note per (task, length) left out (longer
    than the runner's context, or a fixed prompt that alone does not fit)."""
    max_len = runner.max_len or runner.model.config.max_seq_len
    samples: list[RulerSample] = []
    notes = [f"length {L} exceeds the model's {max_len}" for L in lengths if L > max_len]
    for task in tasks:
        for L in (L for L in lengths if L <= max_len):
            try:
                samples += make_samples(task, L, num_samples, tokenizer=runner.tokenizer, seed=seed)
            except ValueError as err:  # the fixed prompt parts alone do not fit
                notes.append(str(err))
    params = [
        SamplingParams(max_tokens=s.max_new_tokens, temperature=0.0, stop=["\n"]) for s in samples
    ]
    return samples, runner.generate([s.prompt for s in samples], params), notes


# ---------------------------------------------------------------------- RULER
@dataclass(kw_only=True)
class RulerTask(Task):
    """One RULER task at several context lengths; metrics per length and their mean."""

    name: str
    task: str
    lengths: tuple[int, ...] = (1024, 2048, 4096)
    num_samples: int = 20
    seed: int = 0
    kind: str = "ruler"

    def run(self, runner: EvalRunner, limit: int | None = None) -> TaskResult:
        n = self.num_samples if limit is None else min(limit, self.num_samples)
        samples, outs, notes = ruler_generate(runner, [self.task], self.lengths, n, seed=self.seed)
        lengths = [L for L in self.lengths if any(s.length == L for s in samples)]
        if not lengths:
            raise ValueError(f"{self.name}: no usable length in {self.lengths}: {'; '.join(notes)}")
        metrics: dict[str, float] = {}
        stderr: dict[str, float] = {}
        per_len: dict[int, list[float]] = {L: [] for L in lengths}
        rows = []
        for s, out in zip(samples, outs, strict=True):
            sc = score_prediction(out, s.answers)
            per_len[s.length].append(sc["string_match"])
            rows.append(
                {"length": s.length, "index": s.index, "prediction": out, "answers": s.answers} | sc
            )
        for L, vals in per_len.items():
            metrics[f"string_match@{L}"], stderr[f"string_match@{L}"] = mean_stderr(vals)
        allv = [v for vals in per_len.values() for v in vals]
        metrics["string_match"], stderr["string_match"] = mean_stderr(allv)
        return TaskResult(
            metrics=metrics,
            stderr=stderr,
            num_items=len(samples),
            samples=rows,
            stderr_method="sample std of per-sample scores / sqrt(n)",
            notes=notes,
        )


# ---------------------------------------------------------------------- data of the tasks
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown")
OBJECTS = ("ball", "car", "house", "cup", "hat", "book", "chair", "kite", "shoe", "door")


def copycolors_items(num: int = 100, *, num_choices: int = 4, seed: int = 0) -> list[MCItem]:
    """A sanity MCQA (Olmo 3 §6.1 `copycolors`): the answer is copied from the question."""
    rng = random.Random(f"copycolors/{seed}")
    items = []
    for _ in range(num):
        colors = rng.sample(COLORS, num_choices)
        gold = rng.randrange(num_choices)
        obj = rng.choice(OBJECTS)
        q = f"The {obj} is {colors[gold]}. What color is the {obj}?"
        items.append(MCItem(question=q, choices=tuple(colors), answer=gold))
    return items


def gsm8k_mc_items(data_dir: Path | None = None, *, seed: int = 0) -> list[MCItem]:
    """GSM8K as 4-way multiple choice over final numbers (a Gen2MC-style conversion, Olmo 3
    §6.1): the gold number and three distractors from arithmetic slips (+-1, x2, /2, +-10)."""
    items = []
    for i, r in enumerate(_gsm8k_rows(data_dir)):
        gold = gsm8k_final(r["answer"])
        rng = random.Random(f"gsm8k_mc/{seed}/{i}")
        try:
            g = int(gold)
        except ValueError:
            continue
        cands = [g + 1, g - 1, 2 * g, g // 2, g + 10, g - 10, g * 10, g + 2]
        cands = [c for c in dict.fromkeys(cands) if c != g and c >= 0]
        rng.shuffle(cands)
        choices = [str(c) for c in cands[:3]] + [str(g)]
        rng.shuffle(choices)
        items.append(
            MCItem(question=r["question"], choices=tuple(choices), answer=choices.index(gold))
        )
    return items


def mc_items_from_jsonl(path: str | Path) -> list[MCItem]:
    """Rows `{"question": str, "choices": [str, ...], "answer": int}`."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    try:
        return [
            MCItem(question=r["question"], choices=tuple(r["choices"]), answer=int(r["answer"]))
            for r in rows
        ]
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path}: rows need question, choices, answer ({err})") from None


def _shakespeare_docs(data_dir: Path | None, chunk_chars: int = 2000) -> list[str]:
    """The last 10% of tinyshakespeare (the usual validation split), in fixed-size chunks."""
    text = builtin.read_text(_data_file(builtin.TINYSHAKESPEARE, data_dir, "tinyshakespeare"))
    val = text[int(len(text) * 0.9) :]
    return [val[i : i + chunk_chars] for i in range(0, len(val), chunk_chars)]


# ---------------------------------------------------------------------- registry
TaskFactory = Callable[..., Task]
# name -> factory; the other task modules (ifeval, speculative) register theirs on import, and
# `hybridlm.eval` imports them all
TASKS: dict[str, TaskFactory] = {}


def register_task(name: str) -> Callable[[TaskFactory], TaskFactory]:
    def deco(fn: TaskFactory) -> TaskFactory:
        if name in TASKS:
            raise ValueError(f"task {name!r} is registered twice")
        TASKS[name] = fn
        return fn

    return deco


@register_task("humaneval_bpb")
def _humaneval_bpb(data_dir: Path | None, **kw: Any) -> Task:
    """BPB of the canonical solution given the HumanEval prompt (Base Easy code)."""
    return BpbTask(
        name="humaneval_bpb",
        load=lambda: [(r["prompt"], r["canonical_solution"]) for r in _humaneval_rows(data_dir)],
    )


@register_task("gsm8k_bpb")
def _gsm8k_bpb(data_dir: Path | None, **kw: Any) -> Task:
    """BPB of the reference solution given the question (Base Easy math)."""
    return BpbTask(
        name="gsm8k_bpb",
        load=lambda: [
            (f"Question: {r['question']}\nAnswer:", f" {r['answer']}")
            for r in _gsm8k_rows(data_dir)
        ],
    )


@register_task("shakespeare_bpb")
def _shakespeare_bpb(data_dir: Path | None, **kw: Any) -> Task:
    return RollingBpbTask(name="shakespeare_bpb", load=lambda: _shakespeare_docs(data_dir))


for _fmt in ("rc", "mc"):

    def _copy(data_dir: Path | None, _f: str = _fmt, **kw: Any) -> Task:
        return MCTask(name=f"copycolors:{_f}", load=lambda: copycolors_items(), fmt=_f)

    def _gmc(data_dir: Path | None, _f: str = _fmt, **kw: Any) -> Task:
        return MCTask(name=f"gsm8k_mc:{_f}", load=lambda: gsm8k_mc_items(data_dir), fmt=_f)

    register_task(f"copycolors:{_fmt}")(_copy)
    register_task(f"gsm8k_mc:{_fmt}")(_gmc)


@register_task("gsm8k")
def _gsm8k(data_dir: Path | None, **kw: Any) -> Task:
    return GSM8KTask(
        name="gsm8k",
        data_dir=data_dir,
        max_tokens=kw.get("max_tokens", 256),
        prompt_format=kw.get("prompt_format", "base"),
        num_fewshot=int(kw.get("gsm8k_fewshot", 0)),
    )


@register_task("humaneval")
def _humaneval(data_dir: Path | None, **kw: Any) -> Task:
    n = int(kw.get("num_samples", 1))
    ks = tuple(k for k in (1, 10, 100) if k <= n)
    return HumanEvalTask(
        name="humaneval",
        data_dir=data_dir,
        num_samples=n,
        ks=ks,
        seed=kw.get("seed", 0),
        max_tokens=kw.get("max_tokens", 256),
        prompt_format=kw.get("prompt_format", "base"),
    )


for _t in RULER_TASKS:

    def _ruler(data_dir: Path | None, _t: str = _t, **kw: Any) -> Task:
        return RulerTask(
            name=f"ruler_{_t}",
            task=_t,
            lengths=tuple(kw.get("ruler_lengths", (1024, 2048, 4096))),
            num_samples=int(kw.get("ruler_samples", 20)),
            seed=int(kw.get("seed", 0)),
        )

    register_task(f"ruler_{_t}")(_ruler)

# names that expand to several tasks
GROUPS: dict[str, tuple[str, ...]] = {
    "ruler": tuple(f"ruler_{t}" for t in RULER_TASKS),
    "base_easy": ("humaneval_bpb", "gsm8k_bpb", "shakespeare_bpb"),
    "mc": ("copycolors:rc", "copycolors:mc", "gsm8k_mc:rc", "gsm8k_mc:mc"),
    "speculative": ("spec_bench",),
}


def resolve_tasks(spec: str | Sequence[str]) -> list[str]:
    """Comma-separated task names / group names -> task names (unknown names are an error)."""
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for n in names:
        if not n:
            continue
        expanded = GROUPS.get(n, (n,))
        for t in expanded:
            if t not in TASKS:
                known = ", ".join(sorted([*TASKS, *GROUPS]))
                raise ValueError(f"unknown task {t!r}; known tasks and groups: {known}")
            if t not in out:
                out.append(t)
    if not out:
        raise ValueError("no tasks given")
    return out


def get_task(name: str, *, data_dir: str | Path | None = None, **options: Any) -> Task:
    """Task `name` over the packaged data sets, or those under `data_dir` when one is given."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    return TASKS[name](Path(data_dir) if data_dir else None, **options)
