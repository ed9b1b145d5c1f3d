"""RULER-style synthetic long-context tasks (Hsieh et al. 2024, "RULER: What's the Real Context
Size of Your Long-Context Language Models?", §3), generated locally and deterministically.

Six of RULER's task families, each fitted to a target length in the model's own tokens:

- `niah_single`: one "special magic number" needle in a noise haystack (RULER niah_single_1);
- `niah_multikey`: four needles with different keys, one asked for (niah_multikey_1);
- `niah_multivalue`: four values for the same key, all asked for (niah_multivalue);
- `vt`: variable tracking, one chain of assignments `VAR A = 12345`, `VAR B = A`, ... hidden in
  noise; the answer is every variable that holds the value (RULER vt, 1 chain, 4 hops);
- `cwe`: common-word extraction from a numbered list in which a few words repeat often and the
  rest appear once (RULER cwe, scaled down so it also fits short contexts);
- `fwe`: frequent-word extraction from coded text whose word counts follow Zipf's law (alpha 2);
  the answer is the three most frequent coded words (RULER fwe).

Sample `i` of (task, length, seed) is drawn from `random.Random(f"{task}/{length}/{seed}/{i}")`,
so it is the same on every run and machine. The prompt is `context + question + answer prefix`;
the model continues greedily until a newline. Scoring follows RULER's `string_match_all`: the
fraction of the reference strings found (case-insensitively) in the prediction; `exact_match` is
1 when all of them are found.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe", "fwe")

# RULER's "noise" haystack (repeated filler sentences)
_NOISE = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
_ADJ = (
    "ancient brave calm dark eager fancy gentle happy icy jolly kind lucky misty noble odd "
    "proud quiet rapid shiny tidy urban vivid witty young zesty"
).split()
_NOUN = (
    "apple bridge castle dragon engine forest garden harbor island jungle kettle lantern meadow "
    "needle orchard palace quartz river saddle tower umbrella valley window yacht zebra"
).split()
_WORDS = (
    "amber basil cedar daisy ember flint grove hazel iris jade koala lemon maple nutmeg olive "
    "pepper quill raven sage thyme umber violet willow xenon yarrow zinnia acorn birch clover "
    "dune fern glade heron indigo juniper kelp lilac moss nectar oak pine quince reed slate "
    "tulip urchin vine wheat yew zest alder brook coral delta egret fjord gorse"
).split()


@dataclass(frozen=True, kw_only=True)
class RulerSample:
    task: str
    length: int  # target prompt length in tokens
    index: int
    context: str  # the haystack with the needles (what the answer must be read from)
    prompt: str  # context + question + answer prefix
    answers: tuple[str, ...]
    max_new_tokens: int
    num_tokens: int  # actual prompt tokens (<= length)


def score_prediction(prediction: str, answers: tuple[str, ...]) -> dict[str, float]:
    """RULER `string_match_all` (fraction of references in the prediction) and all-found."""
    pred = prediction.lower()
    found = sum(a.lower() in pred for a in answers)
    recall = found / len(answers)
    return {"string_match": recall, "exact_match": float(found == len(answers))}


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _insert(haystack_units: int, rng: random.Random, needles: list[str]) -> str:
    """Noise sentences with each needle at a random depth (sentence boundary)."""
    units = [_NOISE] * haystack_units
    depths = sorted(rng.randint(0, haystack_units) for _ in needles)
    for offset, (depth, needle) in enumerate(zip(depths, needles, strict=True)):
        units.insert(depth + offset, needle + " ")
    return "".join(units)


def _niah(rng: random.Random, units: int, kind: str) -> tuple[str, str, tuple[str, ...], int]:
    """(context, question + answer prefix, answers, max new tokens) of one needle task."""
    if kind == "niah_single":
        key, value = _key(rng), _number(rng)
        needles, answers = [f"One of the special magic numbers for {key} is: {value}."], (value,)
    elif kind == "niah_multikey":
        keys: list[str] = []
        while len(keys) < 4:
            k = _key(rng)
            if k not in keys:
                keys.append(k)
        values = [_number(rng) for _ in keys]
        needles = [
            f"One of the special magic numbers for {k} is: {v}."
            for k, v in zip(keys, values, strict=True)
        ]
        pick = rng.randrange(4)
        key, answers = keys[pick], (values[pick],)
    else:  # niah_multivalue
        key = _key(rng)
        vals: list[str] = []
        while len(vals) < 4:
            v = _number(rng)
            if v not in vals:
                vals.append(v)
        needles = [f"One of the special magic numbers for {key} is: {v}." for v in vals]
        answers = tuple(vals)
    context = _insert(units, rng, needles)
    if kind == "niah_multivalue":
        q = (
            f"What are all the special magic numbers for {key} mentioned in the provided text? "
            f"The special magic numbers for {key} mentioned in the provided text are"
        )
        return context, q, answers, 8 * len(answers) + 8
    q = (
        f"What is the special magic number for {key} mentioned in the provided text? "
        f"The special magic number for {key} mentioned in the provided text is"
    )
    return context, q, answers, 16


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _vt(rng: random.Random, units: int) -> tuple[str, str, tuple[str, ...], int]:
    value = str(rng.randint(10_000, 99_999))
    names: list[str] = []
    while len(names) < 5:  # 1 chain, 4 hops
        n = _var_name(rng)
        if n not in names:
            names.append(n)
    stmts = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i]} = {names[i - 1]}." for i in range(1, len(names))
    ]
    # statements keep their order along the haystack (a later hop never precedes its source)
    context = _insert(units, rng, stmts)
    q = (
        f"Question: Find all variables that are assigned the value {value} in the text above. "
        f"Answer: According to the chain(s) of variable assignment in the text above, "
        f"{len(names)} variables are assigned the value {value}, they are:"
    )
    return context, q, tuple(names), 8 * len(names) + 8


def _cwe(rng: random.Random, units: int) -> tuple[str, str, tuple[str, ...], int]:
    """`units` here is the number of words that appear once; 5 common words appear
    `freq` times each, freq = 2 + units // 10 capped at 30 (RULER uses 30 at 4K+)."""
    num_cw, freq = 5, min(30, 2 + units // 10)
    pool = list(_WORDS)
    rng.shuffle(pool)
    common = pool[:num_cw]
    rare: list[str] = []  # distinct words, each appearing once
    used = set(common)
    while len(rare) < units:
        w = f"{rng.choice(pool[num_cw:])}{len(rare)}"
        if w not in used:
            used.add(w)
            rare.append(w)
    words = [w for w in common for _ in range(freq)] + rare
    rng.shuffle(words)
    context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    q = (
        f"Question: What are the {num_cw} most common words in the above list? "
        f"Answer: The top {num_cw} words that appear most often in the list are:"
    )
    return context, q, tuple(common), 6 * num_cw + 8


def _coded_word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 6)))


def _fwe(rng: random.Random, units: int) -> tuple[str, str, tuple[str, ...], int]:
    """`units` sets the vocabulary (units // 2 + 4 coded words); word k (1-based) appears
    ~c / k^2 times (Zipf, alpha 2, as RULER fwe), with the top three given a strict margin over
    every other word so the answer is unambiguous."""
    top, alpha = 3, 2.0
    vocab: list[str] = []
    while len(vocab) < units // 2 + top + 1:
        w = _coded_word(rng)
        if w not in vocab:
            vocab.append(w)
    c = 8 + units / 4
    counts = [max(1, round(c / k**alpha)) for k in range(1, len(vocab) + 1)]
    for k in range(top - 1, -1, -1):  # counts[0] > counts[1] > counts[2] > every other count
        counts[k] = max(counts[k], counts[k + 1] + 1)
    words = [w for w, n in zip(vocab, counts, strict=True) for _ in range(n)]
    rng.shuffle(words)
    q = (
        "Question: Do not provide any explanation. What are the three most frequently appeared "
        "words in the above coded text? Answer: According to the coded text above, the three "
        "most frequently appeared words are:"
    )
    return " ".join(words), q, tuple(vocab[:top]), 6 * top + 8


_BUILDERS: dict[str, Callable[[random.Random, int], tuple[str, str, tuple[str, ...], int]]] = {
    "niah_single": lambda r, u: _niah(r, u, "niah_single"),
    "niah_multikey": lambda r, u: _niah(r, u, "niah_multikey"),
    "niah_multivalue": lambda r, u: _niah(r, u, "niah_multivalue"),
    "vt": _vt,
    "cwe": _cwe,
    "fwe": _fwe,
}

_HEADER = {
    "niah_single": "Some special magic numbers are hidden within the following text. Make sure "
    "to memorize it. I will quiz you about the numbers afterwards.\n",
    "niah_multikey": "Some special magic numbers are hidden within the following text. Make sure "
    "to memorize it. I will quiz you about the numbers afterwards.\n",
    "niah_multivalue": "Some special magic numbers are hidden within the following text. Make "
    "sure to memorize it. I will quiz you about the numbers afterwards.\n",
    "vt": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n",
    "cwe": "Below is a numbered list of words. In these words, some appear more often than "
    "others. Memorize the ones that appear most often.\n",
    "fwe": "Read the following coded text and track the frequency of each coded word. Find the "
    "three most frequently appeared coded words.\n",
}


def make_sample(task: str, length: int, index: int, *, tokenizer: Any, seed: int = 0):
    """Sample `index` of `task` with the longest haystack whose prompt plus the answer budget
    fits in `length` tokens of `tokenizer` (binary search over haystack units)."""
    if task not in _BUILDERS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(RULER_TASKS)}")

    def build(units: int) -> tuple[str, str, tuple[str, ...], int, int]:
        rng = random.Random(f"{task}/{length}/{seed}/{index}")
        context, q, answers, max_new = _BUILDERS[task](rng, units)
        prompt = f"{_HEADER[task]}{context}\n{q}"
        n = len(tokenizer.encode(prompt, add_bos=True))
        return context, prompt, answers, max_new, n

    def fits(units: int) -> bool:
        _, _, _, max_new, n = build(units)
        return n + max_new <= length

    if not fits(0):
        raise ValueError(f"RULER {task}: length {length} is too short for even an empty haystack")
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    context, prompt, answers, max_new, n = build(lo)
    return RulerSample(
        task=task,
        length=length,
        index=index,
        context=context,
        prompt=prompt,
        answers=answers,
        max_new_tokens=max_new,
        num_tokens=n,
    )


def make_samples(
    task: str, length: int, num_samples: int, *, tokenizer: Any, seed: int = 0
) -> list[RulerSample]:
    return [
        make_sample(task, length, i, tokenizer=tokenizer, seed=seed) for i in range(num_samples)
    ]
