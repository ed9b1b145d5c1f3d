"""IFEval (Zhou et al. 2023): instruction following with verifiable constraints.

The task generates one greedy answer per prompt and scores it with the shared RL checkers
(`rl.ifeval`, which follow IFEval's reference code), reporting the benchmark's four numbers:
prompt-level and instruction-level accuracy, strict and loose. The reasoning block of a chat
answer (`<think>...</think>`) is dropped first, as the RL verifier does.

Prompts, in order of precedence:

- `ifeval_data` a JSON Lines file in the official format (`key`, `prompt`,
  `instruction_id_list`, `kwargs`; google-research `instruction_following_eval/data/
  input_data.jsonl`, `.gz` too), or a Hugging Face dataset id such as `google/IFEval`, read with
  `datasets.load_dataset(id, split="train")` (from its cache when offline; naming it is the
  opt-in to a download);
- `<data_dir>/ifeval/input_data.jsonl` when `--data-dir` has one;
- otherwise the seeded synthetic prompts of `InstructionFollowingEnvironment.generated` (IFEval's
  format and checkers, a few templates; no download). Numbers on them are not comparable with
  published IFEval numbers.

The reference generates up to 1280 tokens (lm-eval `ifeval.yaml`); here `--max-new-tokens`
sets the budget. `prompt_format="base"` feeds the raw prompt (lm-eval's default), `"chat"` the
chat template, stopping at the end of the assistant turn.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data import builtin
from ..data.chat import STOP
from ..infer.sampling import SamplingParams
from ..rl.environments import InstructionFollowingEnvironment
from ..rl.ifeval import ifeval_metrics, score_prompt
from ..rl.ifeval_text import language_backend, sentence_backend
from ..rl.verifiers import answer_text
from .tasks import (
    EvalRunner,
    Task,
    TaskResult,
    _check_format,
    _check_limit,
    mean_stderr,
    register_task,
)

IFEVAL_FILE = "ifeval/input_data.jsonl"  # under --data-dir
_FILE_SUFFIXES = (".jsonl", ".json", ".gz")
NUM_GENERATED = 541  # as many synthetic prompts as IFEval has


def load_ifeval_records(source: str | Path) -> list[dict[str, Any]]:
    """IFEval rows from a JSON Lines file or a Hugging Face dataset id (`owner/name`)."""
    path = Path(source)
    if path.is_file():
        rows = builtin.read_jsonl(path)
    elif path.exists():
        raise ValueError(f"IFEval data {source}: not a file")
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", str(source)) and path.suffix not in _FILE_SUFFIXES:
        try:
            from datasets import load_dataset
        except ImportError as err:
            raise ValueError(
                f"IFEval data {source!r} is not a file; as a Hugging Face dataset id it needs the "
                "`datasets` package (pip install 'hybridlm[data]')"
            ) from err
        try:
            rows = [dict(r) for r in load_dataset(str(source), split="train")]
        except Exception as err:  # noqa: BLE001 - offline / unknown id: datasets raises many types
            raise ValueError(
                f"IFEval data {source!r} is not a file, nor a loadable Hugging Face dataset: {err}"
            ) from None
    else:
        raise ValueError(f"IFEval data not found: {source}")
    for i, r in enumerate(rows):
        missing = {"prompt", "instruction_id_list", "kwargs"} - set(r)
        if missing:
            raise ValueError(f"IFEval data {source}: row {i} misses {sorted(missing)}")
    return rows


def _records(source: str, data_dir: Path | None, seed: int) -> tuple[Any, str]:
    """The `InstructionFollowingEnvironment` of the task and where its prompts came from."""
    if source:
        return InstructionFollowingEnvironment(load_ifeval_records(source)), str(source)
    if data_dir is not None and (data_dir / IFEVAL_FILE).is_file():
        path = data_dir / IFEVAL_FILE
        return InstructionFollowingEnvironment(load_ifeval_records(path)), str(path)
    env = InstructionFollowingEnvironment.generated(
        num_problems=NUM_GENERATED, max_constraints=3, seed=seed
    )
    return env, f"generated (InstructionFollowingEnvironment.generated, seed {seed})"


def score_responses(
    responses: Sequence[str],
    instruction_ids: Sequence[Sequence[str]],
    kwargs: Sequence[Sequence[Mapping[str, Any] | None]],
) -> tuple[dict[str, float], dict[str, float], list[Any]]:
    """Metrics, their standard errors and the per-prompt results of answers (reasoning already
    removed) to IFEval prompts."""
    results = [
        score_prompt(r, ids, kw)
        for r, ids, kw in zip(responses, instruction_ids, kwargs, strict=True)
    ]
    metrics = ifeval_metrics(results)
    stderr = {}
    for mode in ("strict", "loose"):
        per_prompt = [float(all(getattr(r, mode))) for r in results]
        per_inst = [float(ok) for r in results for ok in getattr(r, mode)]
        stderr[f"prompt_level_{mode}_acc"] = mean_stderr(per_prompt)[1]
        stderr[f"inst_level_{mode}_acc"] = mean_stderr(per_inst)[1]
    return metrics, stderr, results


@dataclass(kw_only=True)
class IFEvalTask(Task):
    """IFEval over the shared `rl.environments.InstructionFollowingEnvironment` (see the module
    docstring for the data and the prompt formats)."""

    name: str = "ifeval"
    data: str = ""  # a JSONL file or a Hugging Face dataset id; "": data_dir, else generated
    data_dir: Path | None = None
    max_tokens: int = 256
    prompt_format: str = "base"
    seed: int = 0
    kind: str = "generative"

    def __post_init__(self) -> None:
        _check_format(self.prompt_format)

    def run(self, runner: EvalRunner, limit: int | None = None) -> TaskResult:
        _check_limit(limit)
        env, source = _records(self.data, self.data_dir, self.seed)
        problems = list(env)[:limit]
        if self.prompt_format == "chat":
            prompts, stop = [p.prompt for p in problems], [STOP]
        else:
            prompts, stop = [p.user_text for p in problems], []
        sp = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, stop=stop)
        outs = runner.generate(prompts, [sp] * len(problems))
        responses = [answer_text(o) for o in outs]
        ids = [p.answer["instruction_id_list"] for p in problems]
        kwargs = [p.answer["kwargs"] for p in problems]
        metrics, stderr, results = score_responses(responses, ids, kwargs)
        checkers = f"sentences: {sentence_backend()}, language: {language_backend()}"
        samples = [
            {
                "key": p.id,
                "prompt": p.user_text,
                "completion": o,
                "instruction_id_list": i,
                "follow_strict": r.strict,
                "follow_loose": r.loose,
                "source": source,
                "checkers": checkers,
            }
            for p, o, i, r in zip(problems, outs, ids, results, strict=True)
        ]
        return TaskResult(
            metrics=metrics,
            stderr=stderr,
            num_items=len(problems),
            samples=samples,
            stderr_method="sample std of per-prompt (or per-instruction) 0/1 / sqrt(n)",
        )


@register_task("ifeval")
def _ifeval(data_dir: Path | None, **kw: Any) -> Task:
    return IFEvalTask(
        data=str(kw.get("ifeval_data") or ""),
        data_dir=data_dir,
        max_tokens=int(kw.get("max_tokens", 256)),
        prompt_format=kw.get("prompt_format", "base"),
        seed=int(kw.get("seed", 0)),
    )
