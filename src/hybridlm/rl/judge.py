"""Generative reward models (GenRM): a chat model prompted to grade or compare replies, its
verdict parsed robustly, usable as an environment's reward (Nemotron 3 Super §3.2.5: chat
environments rewarded by a generative reward model; the LLM-as-a-judge prompts of MT-Bench,
Zheng et al. 2023, with their `[[rating]]` / `[[A]]` verdict formats).

    judge = GenerativeJudge(Engine(model, tokenizer))
    judge.grade(questions, replies, references=None)   # -> Rewards in [0, 1]
    judge.compare(questions, replies_a, replies_b)     # -> "A" / "B" / "tie" / None
    env = JudgedEnvironment(env, judge)                # the env's problems, the judge's reward

Parsing (`parse_rating`, `parse_preference`): the judge's reasoning block is dropped; the last
verdict in the text wins (judges discuss first, then conclude), in the order of precedence
`[[N]]`, then "rating/score/grade: N" (optionally "/10" or "out of 10"), then a bare "N/10";
numbers outside the scale are no verdict. A reply without a verdict gets reward 0 with reason
"no verdict" and is counted: a judge that stops answering in format shows in the metrics
(`judge_unparsed`), not as silent zeros.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..data.chat import STOP, THINK_CLOSE, THINK_OPEN, render
from .environments import Environment, Problem
from .verifiers import Reward, answer_text

if TYPE_CHECKING:
    from ..infer.engine import Engine
    from ..infer.sampling import SamplingParams

GRADE_SYSTEM = (
    "You are a strict and fair judge. Rate how well the assistant's reply answers the user's "
    "question: correctness first, then helpfulness and clarity. Explain briefly, then give the "
    "rating on the last line in the form [[N]], N from {lo} to {hi}."
)
GRADE_USER = "[Question]\n{question}\n\n{reference}[Reply]\n{reply}\n\nRate the reply."
REFERENCE = "[Reference answer]\n{reference}\n\n"
COMPARE_SYSTEM = (
    "You are a strict and fair judge. Compare two assistant replies to the user's question: "
    "correctness first, then helpfulness and clarity; ignore their order and length. Explain "
    "briefly, then give the verdict on the last line: [[A]] if A is better, [[B]] if B is "
    "better, [[C]] for a tie."
)
COMPARE_USER = "[Question]\n{question}\n\n[Reply A]\n{a}\n\n[Reply B]\n{b}\n\nWhich is better?"

# Judge output quotes the policy's reply, so these run on text the policy wrote: whitespace runs
# are possessive (`\s*+`: what follows each run is not whitespace, so no other split matches)
# and a number starts where a run of digits does (`(?<!\d)`: a match from inside a run ends
# where the one from its start does), which keeps every search linear in the text.
_NUM = r"(?<!\d)(-?\d+(?:\.\d+)?)"
_RATING_PATTERNS = (
    re.compile(r"\[\[\s*+" + _NUM + r"\s*+(?:/\s*+\d+)?\s*+\]\]"),
    re.compile(
        r"(?:rating|score|grade)\s*+(?:is|of)?\s*+[:=]?\s*+\**+\s*+" + _NUM + r"\s*+\**+"
        r"(?:\s*+(?:/|out of)\s*+\d+)?",
        re.I,
    ),
    re.compile(_NUM + r"\s*+(?:/|out of)\s*+10\b", re.I),
)
_PREFERENCE = re.compile(r"\[\[\s*([ABC])\s*\]\]")


def _strip_reasoning(text: str) -> str:
    text = text.split(STOP, 1)[0]
    if THINK_CLOSE in text:
        return text.rsplit(THINK_CLOSE, 1)[1]
    if text.lstrip().startswith(THINK_OPEN):  # reasoning never closed: no verdict given
        return ""
    return text


def parse_rating(text: str, lo: float = 1, hi: float = 10) -> float | None:
    """The judge's rating in [lo, hi] (module docstring), or None."""
    body = _strip_reasoning(text)
    for pattern in _RATING_PATTERNS:
        found = [float(m.group(1)) for m in pattern.finditer(body)]
        if found:
            value = found[-1]
            return value if lo <= value <= hi else None
    return None


def parse_preference(text: str) -> str | None:
    """ "A", "B" or "tie" from the last `[[A]]` / `[[B]]` / `[[C]]` verdict, or None."""
    found = _PREFERENCE.findall(_strip_reasoning(text))
    if not found:
        return None
    return {"A": "A", "B": "B", "C": "tie"}[found[-1]]


class GenerativeJudge:
    """A chat model as a judge (module docstring), on an `infer.engine.Engine`. Greedy by
    default (`params`); `lo`..`hi` is the rating scale. The replies judged are their answers
    (`verifiers.answer_text`: the reasoning block removed), so a judge never grades the policy's
    thinking."""

    def __init__(
        self,
        engine: Engine,
        *,
        params: SamplingParams | None = None,
        lo: int = 1,
        hi: int = 10,
        max_tokens: int = 256,
    ) -> None:
        from ..infer.sampling import SamplingParams

        if not lo < hi:
            raise ValueError(f"the rating scale needs lo < hi, got {lo}..{hi}")
        self.engine, self.lo, self.hi = engine, lo, hi
        self.params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0)
        self.unparsed = 0  # verdicts that could not be read, over the judge's life

    def _ask(self, conversations: list[list[dict[str, Any]]]) -> list[str]:
        tok = self.engine.tokenizer
        prompts = [tok.encode(render(c)) for c in conversations]
        outs = self.engine.generate(prompts, self.params)
        return [o.text for o in outs]

    def grade(
        self,
        questions: Sequence[str],
        replies: Sequence[str],
        references: Sequence[str | None] | None = None,
    ) -> list[Reward]:
        """Each reply's rating as a reward in [0, 1]: (N - lo) / (hi - lo); 0 without one."""
        if len(questions) != len(replies):
            raise ValueError(f"{len(questions)} questions but {len(replies)} replies")
        refs = list(references) if references is not None else [None] * len(questions)
        system = GRADE_SYSTEM.format(lo=self.lo, hi=self.hi)
        convs = [
            [
                {"role": "system", "content": system},
                {
                    "role": "user",
                    "content": GRADE_USER.format(
                        question=q,
                        reference=REFERENCE.format(reference=ref) if ref else "",
                        reply=answer_text(r),
                    ),
                },
            ]
            for q, r, ref in zip(questions, replies, refs, strict=True)
        ]
        out = []
        for verdict in self._ask(convs):
            rating = parse_rating(verdict, self.lo, self.hi)
            if rating is None:
                self.unparsed += 1
                out.append(Reward(0.0, "no verdict", {"judge_unparsed": 1.0}))
                continue
            value = (rating - self.lo) / (self.hi - self.lo)
            out.append(
                Reward(value, f"rated {rating:g}", {"judge_rating": rating, "judge_unparsed": 0.0})
            )
        return out

    def compare(
        self, questions: Sequence[str], replies_a: Sequence[str], replies_b: Sequence[str]
    ) -> list[str | None]:
        """ "A", "B", "tie" or None (no verdict) per pair. Ask twice with the order swapped to
        cancel position bias (MT-Bench): call with (a, b) and (b, a) and agree."""
        if not len(questions) == len(replies_a) == len(replies_b):
            raise ValueError("compare needs one question per pair of replies")
        convs = [
            [
                {"role": "system", "content": COMPARE_SYSTEM},
                {
                    "role": "user",
                    "content": COMPARE_USER.format(question=q, a=answer_text(a), b=answer_text(b)),
                },
            ]
            for q, a, b in zip(questions, replies_a, replies_b, strict=True)
        ]
        out = [parse_preference(v) for v in self._ask(convs)]
        self.unparsed += sum(v is None for v in out)
        return out


class JudgedEnvironment(Environment):
    """`env`'s problems rewarded by a generative judge (its reference answer shown to the judge
    when the problem has a string one); one batched judge call per `score_many`."""

    own_deadline = True  # the judge is a model on this process: bounded by its max_tokens

    def __init__(self, env: Environment, judge: GenerativeJudge, *, name: str = "") -> None:
        self.env, self.judge = env, judge
        self.name = name or f"{env.name}_judged"

    def __len__(self) -> int:
        return len(self.env)

    def __getitem__(self, index: int) -> Problem:
        return dataclasses.replace(self.env[index], env=self.name)

    def score(self, problem: Problem, completion: str) -> Reward:
        return self.score_many([problem], [completion])[0]

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[Reward]:
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        refs = [p.answer if isinstance(p.answer, str) else None for p in problems]
        return self.judge.grade([p.user_text for p in problems], list(completions), refs)


__all__ = [
    "GenerativeJudge",
    "JudgedEnvironment",
    "parse_preference",
    "parse_rating",
]
