"""Environments: problems with ground truth, and a `score(problem, completion) -> Reward`.

One interface serves RL (rollout workers draw problems, the learner gets rewards) and evaluation
(the harness generates for every problem and averages rewards). An environment is a dataset plus
a verifier, as in NeMo Gym's resource servers (Nemotron 3 Super §3.2.5) and OlmoRL's per-domain
verifiers (Olmo 3 §4.4.1):

- `GSM8KEnvironment` (final number), `ArithmeticEnvironment` (generated, seeded, difficulty
  levels; always available), `MathEnvironment` (boxed answers, Math-Verify / SymPy),
  `CodeEnvironment` (HumanEval-style function completion, tests in the sandbox),
  `InstructionFollowingEnvironment` (IFEval-format constraints; also a seeded generator).
- `LowEffortEnvironment`: a fraction of prompts switched to low-effort mode whose reward also
  penalises generated length (Nemotron 3 Super §3.2.1 "low-effort RL"; the paper gives no formula,
  the one used here is documented on the class).
- `MixtureEnvironment`: weighted, deterministic sampling over environments and per-environment
  metrics (multi-environment RLVR: Olmo 3 §4.4.2, Nemotron 3 Super §3.2.1).
- `filter_by_pass_rate`: the offline difficulty filter (Olmo 3 §4.4.2: 8 samples per prompt, drop
  the prompts the starting model always or never solves).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import re
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hybridlm.data.builtin import read_jsonl
from hybridlm.data.chat import offer_tools, render
from hybridlm.data.tasks import (
    CALCULATOR_SYSTEM,
    CODE_INSTRUCTION,
    calculator_question,
    code_records,
    ifeval_records,
    products,
)
from hybridlm.rl.sandbox import humaneval_test
from hybridlm.rl.verifiers import (
    CodeVerifier,
    GSM8KVerifier,
    InstructionVerifier,
    MathVerifier,
    Reward,
    answer_text,
    extract_code,
    gsm8k_reference,
)

from .episodes import Episode, SingleTurnEpisode, Step, ToolEpisode
from .tools import Calculator, PythonTool, Search, Tool
from .verifiers import INSTRUCTIONS, extract_boxed


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One prompt: chat `messages`, the ground truth `answer` its verifier needs, `metadata`, and
    the name of the environment that scores it (`env`)."""

    id: str
    messages: tuple[Mapping[str, Any], ...]
    answer: Any
    metadata: Mapping[str, Any] = field(default_factory=dict)
    env: str = ""

    @property
    def prompt(self) -> str:
        """The rendered chat prompt, ending with the assistant header."""
        return render(list(self.messages), add_generation_prompt=True)

    @property
    def user_text(self) -> str:
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "user")


def _user(text: str, system: str | None = None) -> tuple[dict[str, str], ...]:
    msgs = [{"role": "system", "content": system}] if system else []
    return tuple(msgs + [{"role": "user", "content": text}])


class Environment(ABC):
    """Problems plus a reward. Subclasses set `name` and implement `__len__`, `__getitem__` and
    `score`; `score_many` may batch (the code environment runs its sandbox pool)."""

    name: str = "env"
    multi_turn: bool = False  # episodes take several replies (tools): rolled out by the workers
    # scoring bounds its own time (code in the sandbox, a server, a judge model): not run in a
    # `rl.scoring` worker under the verification deadline
    own_deadline: bool = False

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __getitem__(self, index: int) -> Problem: ...

    @abstractmethod
    def score(self, problem: Problem, completion: str) -> Reward: ...

    def __iter__(self) -> Iterator[Problem]:
        for i in range(len(self)):
            yield self[i]

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[Reward]:
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        return [self.score(p, c) for p, c in zip(problems, completions, strict=True)]

    def episode(self, scorer: Environment | None = None) -> Episode:
        """A fresh episode state for one rollout (`rl.episodes`): single-turn by default, the
        reply scored by `scorer.score` (default: this environment's; `rl.scoring` passes the
        environment seen through its pool, so episodes score under the deadline too)."""
        return SingleTurnEpisode(scorer or self)

    def sample(self, n: int, *, seed: int = 0) -> list[Problem]:
        """`n` problems drawn uniformly with replacement, deterministic in `seed`."""
        if len(self) == 0:
            raise ValueError(f"environment {self.name!r} has no problems")
        rng = random.Random(seed)
        return [self[rng.randrange(len(self))] for _ in range(n)]


class DatasetEnvironment(Environment):
    """An environment over a fixed list of problems."""

    def __init__(self, problems: Sequence[Problem], *, name: str) -> None:
        self.name = name
        self.problems = [replace(p, env=name) for p in problems]
        ids = [p.id for p in self.problems]
        if len(set(ids)) != len(ids):
            raise ValueError(f"environment {name!r}: problem ids are not unique")

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, index: int) -> Problem:
        return self.problems[index]

    def subset(self, keep: Callable[[Problem], bool]) -> DatasetEnvironment:
        """The same environment restricted to the problems `keep` accepts."""
        out = copy.copy(self)
        out.problems = [p for p in self.problems if keep(p)]
        return out


# -- math word problems ------------------------------------------------------------------------

GSM8K_INSTRUCTION = "Solve the problem step by step. End with 'The answer is N.' for a number N."


class GSM8KEnvironment(DatasetEnvironment):
    """Grade-school math (GSM8K JSONL: `question`, `answer` ending in `#### N`); reward 1 when the
    completion's final number equals N."""

    def __init__(self, path: str | Path, *, limit: int | None = None, name: str = "gsm8k") -> None:
        rows = read_jsonl(path)[:limit]
        problems = []
        for i, row in enumerate(rows):
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{path}: row {i} needs 'question' and 'answer'")
            problems.append(
                Problem(
                    id=f"{name}/{i}",
                    messages=_user(f"{row['question']}\n\n{GSM8K_INSTRUCTION}"),
                    answer=gsm8k_reference(row["answer"]),
                    metadata={"solution": row["answer"]},
                )
            )
        super().__init__(problems, name=name)
        self.verifier = GSM8KVerifier()

    def score(self, problem: Problem, completion: str) -> Reward:
        return self.verifier(completion, problem.answer)


class ArithmeticEnvironment(DatasetEnvironment):
    """Generated integer arithmetic, seeded, always available. Difficulty d in 1..5: d + 1
    operands below 10^min(d, 3), operators + - (and × from d = 2), parentheses from d = 3."""

    def __init__(
        self,
        *,
        num_problems: int = 1000,
        difficulty: int | Sequence[int] = (1, 2, 3),
        seed: int = 0,
        name: str = "arithmetic",
    ) -> None:
        levels = [difficulty] if isinstance(difficulty, int) else list(difficulty)
        if not levels or any(not 1 <= d <= 5 for d in levels):
            raise ValueError(f"difficulty levels must be in 1..5, got {difficulty}")
        if num_problems < 1:
            raise ValueError(f"num_problems must be >= 1, got {num_problems}")
        rng = random.Random(seed)
        problems = []
        for i in range(num_problems):
            d = levels[i % len(levels)]
            expr = self._expression(rng, d)
            value = eval(expr, {"__builtins__": {}})  # noqa: S307 - our own digits and operators
            problems.append(
                Problem(
                    id=f"{name}/{seed}/{i}",
                    messages=_user(f"Compute {expr}. {GSM8K_INSTRUCTION}"),
                    answer=str(value),
                    metadata={"difficulty": d, "expression": expr},
                )
            )
        super().__init__(problems, name=name)
        self.verifier = GSM8KVerifier()

    @staticmethod
    def _expression(rng: random.Random, d: int) -> str:
        hi = 10 ** min(d, 3) - 1
        ops = ["+", "-"] + (["*"] if d >= 2 else [])
        terms = [str(rng.randint(1, hi)) for _ in range(d + 1)]
        expr = terms[0]
        for t in terms[1:]:
            op = rng.choice(ops)
            if op == "*":
                t = str(rng.randint(2, 12))  # keep products readable
            expr = f"{expr} {op} {t}"
            if d >= 3 and rng.random() < 0.4:
                expr = f"({expr})"
        return expr

    def score(self, problem: Problem, completion: str) -> Reward:
        return self.verifier(completion, problem.answer)


MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class ToolUseEnvironment(DatasetEnvironment):
    """Problems solved with tools: episodes are `ToolEpisode`s over `tools()`, and the final
    reply (the one without tool calls) is scored on its final number."""

    multi_turn = True

    def __init__(self, problems: Sequence[Problem], *, name: str, max_turns: int) -> None:
        super().__init__(problems, name=name)
        self.verifier = GSM8KVerifier()
        self.max_turns = max_turns

    def tools(self) -> list[Tool]:
        raise NotImplementedError

    def episode(self, scorer: Environment | None = None) -> Episode:
        return ToolEpisode(scorer or self, self.tools(), max_turns=self.max_turns)

    def calls(self, problem: Problem) -> list[tuple[str, dict[str, Any]]]:
        """The tool calls (name, arguments) that solve `problem`, for demonstrations."""
        raise NotImplementedError

    def final_reply(self, problem: Problem) -> str:
        """The answer a demonstration ends with, once the tools have spoken."""
        return f"The answer is {problem.answer}."

    def demonstrations(self, n: int, *, seed: int = 0) -> list[list[dict[str, Any]]]:
        """`n` solved episodes as chat conversations (tool-use SFT data): each calls the tools
        of `calls(problem)` one per turn, gets their real results, then answers
        (`final_reply`: "The answer is N."). The tools section is written into the system
        message (`data.chat.offer_tools`), so a conversation renders as the rollouts of this
        environment do."""
        tools = {t.name: t for t in self.tools()}
        specs = [t.spec() for t in tools.values()]
        out = []
        for k, problem in enumerate(self.sample(n, seed=seed)):
            msgs = offer_tools(problem.messages, specs)
            for j, (name, args) in enumerate(self.calls(problem)):
                call = {"id": f"call_{j}", "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)}}  # fmt: skip
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
                msgs.append({"role": "tool", "tool_call_id": f"call_{j}",
                             "content": tools[name](args)})  # fmt: skip
            msgs.append({"role": "assistant", "content": self.final_reply(problem)})
            if self.score(problem, msgs[-1]["content"]).value != 1.0:
                raise AssertionError(f"demonstration {k} of {self.name} does not solve it")
            out.append(msgs)
        return out

    def score(self, problem: Problem, completion: str) -> Reward:
        return self.verifier(completion, problem.answer)


class CalculatorEnvironment(ToolUseEnvironment):
    """Multiplication the model cannot do in its head, which it can solve by calling the
    calculator (issue: agentic RL, environment (a)): `digits`-digit x `digits`-digit products,
    seeded. Episodes are `ToolEpisode`s with a `Calculator`; the final reply (the one without
    tool calls) is scored on its final number."""

    SYSTEM = CALCULATOR_SYSTEM

    def __init__(
        self,
        *,
        num_problems: int = 1000,
        digits: int = 5,
        seed: int = 0,
        max_turns: int = 4,
        name: str = "calculator",
    ) -> None:
        if num_problems < 1:
            raise ValueError(f"num_problems must be >= 1, got {num_problems}")
        problems = [
            Problem(
                id=f"{name}/{seed}/{i}",
                messages=tuple(calculator_question(a, b)),
                answer=str(a * b),
                metadata={"a": a, "b": b},
            )
            for i, (a, b) in enumerate(products(num_problems, digits=digits, seed=seed))
        ]
        super().__init__(problems, name=name, max_turns=max_turns)

    def tools(self) -> list[Tool]:
        return [Calculator()]

    def calls(self, problem: Problem) -> list[tuple[str, dict[str, Any]]]:
        a, b = problem.metadata["a"], problem.metadata["b"]
        return [("calculator", {"expression": f"{a} * {b}"})]


class SearchQAEnvironment(ToolUseEnvironment):
    """Questions a model cannot answer from memory, answerable by searching a local corpus
    (issue: agentic RL, environment (b)): a seeded corpus of made-up towns, one document each
    (founding year, population, elevation), and questions on one fact of one town. Episodes
    are `ToolEpisode`s with a BM25 `Search` over the corpus (built once, shared); the final
    reply is scored on its final number."""

    SYSTEM = (
        "You can call the search tool to look things up in the reference documents. Search "
        "before answering, then give the answer as 'The answer is N.'"
    )
    QUESTIONS = {
        "year": "In which year was {town} founded?",
        "population": "How many thousand people live in {town}?",
        "elevation": "How many meters above sea level is {town}?",
    }

    def __init__(
        self,
        *,
        num_problems: int = 500,
        num_towns: int = 200,
        seed: int = 0,
        max_turns: int = 4,
        name: str = "search_qa",
    ) -> None:
        if num_problems < 1 or num_towns < 1:
            raise ValueError("num_problems and num_towns must be >= 1")
        rng = random.Random(seed)
        towns: dict[str, dict[str, int]] = {}
        regions = [self._name(rng, 3) for _ in range(max(2, num_towns // 20))]
        while len(towns) < num_towns:
            town = self._name(rng, rng.choice((2, 3)))
            if town in towns or town in regions:
                continue
            towns[town] = {
                "year": rng.randint(1000, 1999),
                "population": rng.randint(5, 900),
                "elevation": rng.randint(10, 3000),
                "region": rng.randrange(len(regions)),
            }
        self.corpus = [
            f"{town} is a town in {regions[f['region']]}. It was founded in {f['year']}. About "
            f"{f['population']} thousand people live there. It lies {f['elevation']} meters "
            "above sea level."
            for town, f in towns.items()
        ]
        names = list(towns)
        problems = []
        for i in range(num_problems):
            town = names[rng.randrange(len(names))]
            fact = rng.choice(list(self.QUESTIONS))
            problems.append(
                Problem(
                    id=f"{name}/{seed}/{i}",
                    messages=_user(self.QUESTIONS[fact].format(town=town), system=self.SYSTEM),
                    answer=str(towns[town][fact]),
                    metadata={"town": town, "fact": fact},
                )
            )
        self._search: Search | None = None
        super().__init__(problems, name=name, max_turns=max_turns)

    @staticmethod
    def _name(rng: random.Random, syllables: int) -> str:
        onsets, vowels = "bdfgklmnprstvz", "aeiou"
        parts = [rng.choice(onsets) + rng.choice(vowels) for _ in range(syllables)]
        return ("".join(parts) + rng.choice(("n", "r", "s", "l", ""))).capitalize()

    @property
    def search(self) -> Search:
        if self._search is None:  # built on first use: one index for every episode
            self._search = Search(self.corpus)
        return self._search

    def tools(self) -> list[Tool]:
        return [self.search]

    def calls(self, problem: Problem) -> list[tuple[str, dict[str, Any]]]:
        return [("search", {"query": problem.metadata["town"]})]


class MathEnvironment(DatasetEnvironment):
    """Competition-style math (MATH, DAPO-Math...): records with a problem and a reference
    answer (or a solution whose last `\\boxed{}` is the answer); reward by `MathVerifier`."""

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        *,
        problem_key: str = "problem",
        answer_key: str = "answer",
        name: str = "math",
        use_math_verify: bool = True,
    ) -> None:

        problems = []
        for i, rec in enumerate(records):
            if problem_key not in rec:
                raise ValueError(f"math record {i} has no {problem_key!r}")
            answer = rec.get(answer_key)
            if answer is None and "solution" in rec:
                answer = extract_boxed(rec["solution"])
            if answer is None:
                raise ValueError(f"math record {i} has no {answer_key!r} (nor a boxed solution)")
            problems.append(
                Problem(
                    id=str(rec.get("id", f"{name}/{i}")),
                    messages=_user(f"{rec[problem_key]}\n\n{MATH_INSTRUCTION}"),
                    answer=str(answer),
                    metadata={k: v for k, v in rec.items() if k not in (problem_key, answer_key)},
                )
            )
        super().__init__(problems, name=name)
        self.verifier = MathVerifier(use_math_verify=use_math_verify)

    @classmethod
    def from_jsonl(cls, path: str | Path, **kwargs: Any) -> MathEnvironment:
        return cls(read_jsonl(path), **kwargs)

    def score(self, problem: Problem, completion: str) -> Reward:
        return self.verifier(completion, problem.answer)


# -- code --------------------------------------------------------------------------------------


class CodeEnvironment(DatasetEnvironment):
    """HumanEval-style function completion (`task_id`, `prompt`, `entry_point`, `test` with a
    `check(candidate)` function). The program is the prompt's preamble (imports, helpers) plus the
    completion's code when it defines `entry_point`, else prompt + code as a continuation; the
    reward is `CodeVerifier`'s (all tests pass, or the pass rate with `partial_credit`)."""

    own_deadline = True  # the sandbox has its own wall-clock limit per program

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        *,
        sandbox: Any = None,
        partial_credit: bool = False,
        name: str = "code",
    ) -> None:
        problems = []
        for i, rec in enumerate(records):
            missing = {"prompt", "entry_point", "test"} - set(rec)
            if missing:
                raise ValueError(f"code record {i} misses {sorted(missing)}")
            problems.append(
                Problem(
                    id=str(rec.get("task_id", f"{name}/{i}")),
                    messages=_user(CODE_INSTRUCTION.format(prompt=rec["prompt"])),
                    answer={
                        "tests": [humaneval_test(rec)],
                        "prompt": rec["prompt"],
                        "entry_point": rec["entry_point"],
                    },
                    metadata={"canonical_solution": rec.get("canonical_solution")},
                )
            )
        super().__init__(problems, name=name)
        self.verifier = CodeVerifier(sandbox, partial_credit=partial_credit)

    @classmethod
    def from_humaneval(cls, path: str | Path, **kwargs: Any) -> CodeEnvironment:
        """From `HumanEval.jsonl(.gz)`."""
        return cls(read_jsonl(path), **kwargs)

    @classmethod
    def generated(
        cls, *, num_problems: int = 1000, seed: int = 0, name: str = "code_gen", **kwargs: Any
    ) -> CodeEnvironment:
        """Small generated functions (`data.tasks.code_records`: a constant, a list or a string
        to work on), in HumanEval's format; the SFT source `code_gen` teaches their format."""
        if num_problems < 1:
            raise ValueError(f"num_problems must be >= 1, got {num_problems}")
        return cls(code_records(num_problems, seed=seed), name=name, **kwargs)

    @staticmethod
    def program(problem: Problem, completion: str) -> str:
        """The program to run for a completion (see the class docstring)."""
        prompt, entry = problem.answer["prompt"], problem.answer["entry_point"]
        code = extract_code(answer_text(completion))
        m = re.search(rf"^def\s+{re.escape(entry)}\s*\(", prompt, flags=re.M)
        if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, flags=re.M):
            return (prompt[: m.start()] if m else "") + code
        return prompt + code

    def score(self, problem: Problem, completion: str) -> Reward:
        return self.score_many([problem], [completion])[0]

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[Reward]:
        """All completions through the sandbox's worker pool at once."""
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        jobs = [
            (self.program(p, c), p.answer["tests"])
            for p, c in zip(problems, completions, strict=True)
        ]
        return [self.verifier.reward(r) for r in self.verifier.sandbox.run_many(jobs)]


# -- instruction following ---------------------------------------------------------------------


class InstructionFollowingEnvironment(DatasetEnvironment):
    """Prompts with verifiable constraints (IFEval JSONL: `prompt`, `instruction_id_list`,
    `kwargs`). Reward 1 when all constraints pass (OlmoRL), or the fraction with
    `partial_credit`. `generated()` builds a seeded synthetic set from a few topics and templates,
    so the environment is usable without data."""

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        *,
        partial_credit: bool = False,
        name: str = "ifeval",
    ) -> None:

        problems = []
        for i, rec in enumerate(records):
            ids = list(rec.get("instruction_id_list", []))
            kwargs = list(rec.get("kwargs") or [{} for _ in ids])
            if not ids or len(kwargs) != len(ids) or "prompt" not in rec:
                raise ValueError(
                    f"IF record {i} needs 'prompt', a non-empty 'instruction_id_list' and one "
                    "'kwargs' entry per instruction"
                )
            unknown = [x for x in ids if x not in INSTRUCTIONS]
            if unknown:
                raise ValueError(f"IF record {i}: unknown instructions {unknown}")
            problems.append(
                Problem(
                    id=str(rec.get("key", f"{name}/{i}")),
                    messages=_user(rec["prompt"]),
                    answer={"instruction_id_list": ids, "kwargs": kwargs},
                )
            )
        super().__init__(problems, name=name)
        self.verifier = InstructionVerifier(partial_credit=partial_credit)

    @classmethod
    def from_jsonl(cls, path: str | Path, **kwargs: Any) -> InstructionFollowingEnvironment:
        return cls(read_jsonl(path), **kwargs)

    @classmethod
    def generated(
        cls, *, num_problems: int = 200, max_constraints: int = 2, seed: int = 0, **kwargs: Any
    ) -> InstructionFollowingEnvironment:
        """A seeded synthetic set: a short writing task plus 1..`max_constraints` compatible
        constraints."""
        records = ifeval_records(num_problems, seed=seed, max_constraints=max_constraints)
        return cls(records, **kwargs)

    def score(self, problem: Problem, completion: str) -> Reward:
        a = problem.answer
        return self.verifier(completion, a["instruction_id_list"], a["kwargs"])


# -- low-effort mode ---------------------------------------------------------------------------

LOW_EFFORT_SYSTEM = "Reasoning effort: low. Think briefly and answer concisely."


def _utf8_length(text: str) -> int:
    """Tokens of the byte tokenizer (a function, not a lambda: the environment pickles for the
    scoring workers, `rl.scoring`, and Ray)."""
    return len(text.encode("utf-8"))


class LowEffortEnvironment(Environment):
    """Switches a deterministic `fraction` of the base environment's prompts to low-effort mode
    (a system message; Nemotron 3 Super §3.2.1 starts at 2% of RL prompts) and scores them with a
    length penalty:

        value = base · (1 − penalty · clip((L − free_tokens) / (max_tokens − free_tokens), 0, 1))

    with L = `count_tokens(completion)` (reasoning included). Wrong answers stay at 0, so
    shortness alone earns nothing; a correct answer of at most `free_tokens` keeps its full
    reward, one of `max_tokens` or more keeps 1 − penalty. Other prompts score as in the base."""

    def __init__(
        self,
        base: Environment,
        *,
        fraction: float = 0.02,
        penalty: float = 0.5,
        free_tokens: int = 64,
        max_tokens: int = 1024,
        count_tokens: Callable[[str], int] | None = None,
        seed: int = 0,
        system_prompt: str = LOW_EFFORT_SYSTEM,
    ) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        if not 0.0 <= penalty <= 1.0:
            raise ValueError(f"penalty must be in [0, 1], got {penalty}")
        if not 0 <= free_tokens < max_tokens:
            raise ValueError(f"need 0 <= free_tokens < max_tokens, got {free_tokens}, {max_tokens}")
        self.base, self.name = base, base.name
        self.fraction, self.penalty = fraction, penalty
        self.free_tokens, self.max_tokens = free_tokens, max_tokens
        self.count_tokens = count_tokens or _utf8_length  # the byte tokenizer's count
        self.seed, self.system_prompt = seed, system_prompt

    @property
    def own_deadline(self) -> bool:  # type: ignore[override]
        return self.base.own_deadline

    def is_low_effort(self, problem_id: str) -> bool:
        """A stable per-id coin: the same prompts are low-effort in every run with this seed."""
        h = hashlib.sha256(f"{self.seed}:{problem_id}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64 < self.fraction

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Problem:
        p = self.base[index]
        if not self.is_low_effort(p.id):
            return p
        msgs = [m for m in p.messages if m["role"] != "system"]
        return replace(
            p,
            messages=({"role": "system", "content": self.system_prompt}, *msgs),
            metadata={**p.metadata, "low_effort": True},
        )

    def length_factor(self, completion: str) -> tuple[float, int]:
        n = self.count_tokens(completion)
        over = (n - self.free_tokens) / (self.max_tokens - self.free_tokens)
        return 1.0 - self.penalty * min(max(over, 0.0), 1.0), n

    def _wrap(self, problem: Problem, completion: str, base: Reward) -> Reward:
        if not problem.metadata.get("low_effort"):
            return base
        factor, n = self.length_factor(completion)
        metrics = {**base.metrics, "low_effort_tokens": float(n), "length_factor": factor}
        reason = f"{base.reason}; low effort: {n} tokens, x{factor:.3f}"
        return Reward(base.value * factor, reason, metrics)

    def score(self, problem: Problem, completion: str) -> Reward:
        return self._wrap(problem, completion, self.base.score(problem, completion))

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[Reward]:
        rewards = self.base.score_many(problems, completions)
        return [self._wrap(p, c, r) for p, c, r in zip(problems, completions, rewards, strict=True)]


# -- mixtures ----------------------------------------------------------------------------------


class MixtureEnvironment(Environment):
    """Several environments sampled by weight. `sample(n, seed)` is deterministic; every problem
    carries its environment's name, so `score` routes it and `metrics` aggregates per
    environment."""

    name = "mixture"

    def __init__(self, envs: Sequence[Environment], weights: Sequence[float] | None = None):
        if not envs:
            raise ValueError("a mixture needs at least one environment")
        names = [e.name for e in envs]
        if len(set(names)) != len(names):
            raise ValueError(f"environment names must be unique, got {names}")
        if any(n == "all" or "/" in n or not n for n in names):  # metric keys are `<env>/<name>`
            raise ValueError(f"environment names must be non-empty, not 'all', no '/': {names}")
        weights = list(weights) if weights is not None else [1.0] * len(envs)
        if len(weights) != len(envs) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError("weights must be one non-negative number per environment, sum > 0")
        if any(len(e) == 0 for e, w in zip(envs, weights, strict=True) if w > 0):
            raise ValueError("every environment with a positive weight needs problems")
        self.envs = {e.name: e for e in envs}
        total = sum(weights)
        self.weights = {e.name: w / total for e, w in zip(envs, weights, strict=True)}
        self._offsets = []
        start = 0
        for e in envs:
            self._offsets.append((start, e))
            start += len(e)
        self._len = start

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Problem:
        if not 0 <= index < self._len:
            raise IndexError(index)
        for start, env in reversed(self._offsets):
            if index >= start:
                return env[index - start]
        raise IndexError(index)

    @property
    def multi_turn(self) -> bool:  # type: ignore[override]
        return any(e.multi_turn for e in self.envs.values())

    def episodic(self) -> MixtureEnvironment | None:
        """The multi-turn environments alone (what a rollout worker steps), or None."""
        multi = [e for e in self.envs.values() if e.multi_turn]
        return MixtureEnvironment(multi) if multi else None

    def episode(self, scorer: Environment | None = None) -> Episode:
        """An episode of the environment its problem comes from (chosen at `reset`)."""
        return _RoutedEpisode(self, scorer)

    def sample(self, n: int, *, seed: int = 0) -> list[Problem]:
        """Environment by weight, then a problem uniformly within it; deterministic in seed."""
        rng = random.Random(seed)
        names = list(self.weights)
        probs = [self.weights[k] for k in names]
        out = []
        for _ in range(n):
            env = self.envs[rng.choices(names, weights=probs)[0]]
            out.append(env[rng.randrange(len(env))])
        return out

    def env_of(self, problem: Problem) -> Environment:
        if problem.env not in self.envs:
            raise ValueError(f"problem {problem.id!r} is from unknown environment {problem.env!r}")
        return self.envs[problem.env]

    def score(self, problem: Problem, completion: str) -> Reward:
        return self.env_of(problem).score(problem, completion)

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[Reward]:
        """Batched per environment (so code runs in one sandbox pool), results in input order."""
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        by_env: dict[str, list[int]] = defaultdict(list)
        for i, p in enumerate(problems):
            by_env[self.env_of(p).name].append(i)
        out: list[Reward | None] = [None] * len(problems)
        for name, idx in by_env.items():
            got = self.envs[name].score_many(
                [problems[i] for i in idx], [completions[i] for i in idx]
            )
            for i, r in zip(idx, got, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]


class _RoutedEpisode(Episode):
    """A mixture's episode: at `reset` it becomes an episode of the problem's environment."""

    def __init__(self, mixture: MixtureEnvironment, scorer: Environment | None = None) -> None:
        self.mixture, self.scorer = mixture, scorer
        self.inner: Episode | None = None

    def reset(self, problem: Problem) -> list[dict[str, Any]]:
        self.inner = self.mixture.env_of(problem).episode(self.scorer)
        return self.inner.reset(problem)

    def step(self, reply: Mapping[str, Any]) -> Step:
        if self.inner is None:
            raise RuntimeError("step() before reset()")
        return self.inner.step(reply)

    def tool_specs(self) -> list[dict[str, Any]]:
        return [] if self.inner is None else self.inner.tool_specs()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def reward_metrics(problems: Sequence[Problem], rewards: Sequence[Reward]) -> dict[str, float]:
    """Per-environment and overall `reward_mean`, `solved` (fraction with reward 1) and `count`,
    plus the mean of every numeric reward metric, keyed `env/name`."""
    if len(problems) != len(rewards):
        raise ValueError(f"{len(problems)} problems but {len(rewards)} rewards")
    groups: dict[str, list[Reward]] = defaultdict(list)
    for p, r in zip(problems, rewards, strict=True):
        groups[p.env or "env"].append(r)
        groups["all"].append(r)
    out: dict[str, float] = {}
    for env, rs in groups.items():
        out[f"{env}/count"] = float(len(rs))
        out[f"{env}/reward_mean"] = sum(r.value for r in rs) / len(rs)
        out[f"{env}/solved"] = sum(r.value >= 1.0 for r in rs) / len(rs)
        keys = {k for r in rs for k in r.metrics}
        for k in sorted(keys):
            vals = [r.metrics[k] for r in rs if k in r.metrics and math.isfinite(r.metrics[k])]
            if vals:
                out[f"{env}/{k}"] = sum(vals) / len(vals)
    return out


# -- offline difficulty filter -----------------------------------------------------------------


@dataclass(frozen=True)
class FilterReport:
    kept: list[Problem]
    pass_rates: dict[str, float]
    dropped_solved: int  # pass rate >= max_rate (too easy)
    dropped_unsolved: int  # pass rate <= min_rate (too hard)

    @classmethod
    def split(
        cls, problems: Sequence[Problem], rates: Sequence[float], min_rate: float, max_rate: float
    ) -> FilterReport:
        """Keep the problems whose pass rate lies strictly between the bounds."""
        kept = [p for p, r in zip(problems, rates, strict=True) if min_rate < r < max_rate]
        return cls(
            kept,
            {p.id: r for p, r in zip(problems, rates, strict=True)},
            sum(r >= max_rate for r in rates),
            sum(r <= min_rate for r in rates),
        )


def filter_by_pass_rate(
    env: Environment,
    sample_fn: Callable[[Problem, int], Sequence[str]],
    *,
    num_samples: int = 8,
    min_rate: float = 0.0,
    max_rate: float = 1.0,
    problems: Sequence[Problem] | None = None,
    progress: bool = False,
) -> FilterReport:
    """Keep the problems whose pass rate (mean reward of `num_samples` completions from
    `sample_fn(problem, n)`) lies strictly between `min_rate` and `max_rate`. The defaults drop
    problems always or never solved; Olmo 3 §4.4.2 drops pass rates above 62.5% of 8 samples
    (`max_rate=0.7`)."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not 0.0 <= min_rate < max_rate <= 1.0:
        raise ValueError(f"need 0 <= min_rate < max_rate <= 1, got {min_rate}, {max_rate}")
    todo = list(problems) if problems is not None else list(env)
    iterator: Any = todo
    if progress:
        from rich.progress import track

        iterator = track(todo, description=f"difficulty filter ({env.name})")
    rates = []
    for p in iterator:
        completions = list(sample_fn(p, num_samples))
        if len(completions) != num_samples:
            raise ValueError(
                f"sample_fn returned {len(completions)} completions, not {num_samples}"
            )
        rewards = env.score_many([p] * num_samples, completions)
        rates.append(sum(r.value for r in rewards) / num_samples)
    return FilterReport.split(todo, rates, min_rate, max_rate)


class CodeToolEnvironment(ToolUseEnvironment):
    """Code that must pass hidden tests, after the model tests it itself (issue: agentic RL,
    environment (c)): HumanEval-style problems (`CodeEnvironment`'s, its hidden tests and
    program assembly); the model may run programs with the sandboxed `PythonTool` (its own
    asserts, prints) before it replies without a tool call, and that reply's code is scored on
    the hidden tests in the same sandbox. Demonstrations run the canonical solution once (it
    defines the function) and answer with it; the hidden tests are never shown."""

    SYSTEM = (
        "You can call the python tool to run code and test it. When your function is ready, "
        "reply with the complete function in a ```python block and no tool call."
    )
    own_deadline = True  # scored in the sandbox, which has its own wall-clock limit

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        *,
        sandbox: Any = None,
        max_turns: int = 4,
        name: str = "code_tool",
    ) -> None:
        self.code = CodeEnvironment(records, sandbox=sandbox, name=name)
        problems = [
            replace(p, messages=({"role": "system", "content": self.SYSTEM}, *p.messages))
            for p in self.code
        ]
        super().__init__(problems, name=name, max_turns=max_turns)

    @classmethod
    def from_humaneval(cls, path: str | Path, **kwargs: Any) -> CodeToolEnvironment:
        return cls(read_jsonl(path), **kwargs)

    def tools(self) -> list[Tool]:
        return [PythonTool(self.code.verifier.sandbox)]

    def score(self, problem: Problem, completion: str) -> Reward:
        return self.code.score(problem, completion)

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[Reward]:
        return self.code.score_many(problems, completions)

    def _solution(self, problem: Problem) -> str:
        sol = problem.metadata.get("canonical_solution")
        if not sol:
            raise ValueError(f"{problem.id} has no canonical solution to demonstrate")
        return problem.answer["prompt"] + sol

    def calls(self, problem: Problem) -> list[tuple[str, dict[str, Any]]]:
        entry = problem.answer["entry_point"]
        program = f"{self._solution(problem)}\nprint({entry!r}, 'defined:', callable({entry}))\n"
        return [("python", {"code": program})]

    def final_reply(self, problem: Problem) -> str:
        return f"```python\n{self._solution(problem)}```"
