"""Generated tasks with checkable answers and reference solutions: the problems of the embedded
RL environments (`rl.environments`) and the SFT conversations that teach their formats
(`ChatSource` kinds `arithmetic`, `calculator`, `ifeval`, `code_gen`), from one generator per
family so that the SFT stage teaches exactly what the environments ask (Olmo 3 §4.4: RLVR over
math, code and instruction following; Nemotron 3 Super §3.2: many environments at once).

- **arithmetic** (`data.sft.arithmetic_conversations`): chains of `terms - 1` additions and
  subtractions of `digits`-digit numbers with a column-wise trace per step. Two terms is what a
  tiny model learns in minutes; three and more leave it room to improve (each step can go wrong).
- **calculator**: `digits`-digit products the model cannot do in its head, solved by one call of
  the calculator tool (its schema lives here, `CALCULATOR_TOOL`, and `rl.tools.Calculator`
  serves it), then "The answer is N."
- **ifeval**: a short note on a topic under 1-2 IFEval constraints (lowercase, no commas, a
  keyword, bullet count, title, end phrase, quotation marks, word limit), records in IFEval's
  format; the reference reply is written to satisfy them.
- **code_gen**: small Python functions from templates (a constant, a list, a string), records in
  HumanEval's format (`prompt`, `entry_point`, `test` with `check(candidate)`,
  `canonical_solution`); the reference reply is the whole function in one code block.

Everything is a pure function of (family settings, seed): a held-out set is the same family from
another seed.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

from .chat import offer_tools

Conversation = list[dict[str, Any]]

# -- calculator --------------------------------------------------------------------------------

CALCULATOR_TOOL: dict[str, Any] = {
    "name": "calculator",
    "description": (
        "Evaluate an arithmetic expression exactly: + - * / // % ** (or ^) and parentheses "
        "over integers and decimals, e.g. 48213 * 90317."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "the expression, e.g. (12 + 7) * 3"}
        },
        "required": ["expression"],
        "additionalProperties": False,
    },
}
CALCULATOR_SYSTEM = (
    "You can call the calculator tool. Use it for any multiplication, then give the result "
    "as 'The answer is N.'"
)


def products(n: int, *, digits: int, seed: int) -> list[tuple[int, int]]:
    """`n` pairs of `digits`-digit factors (the calculator family's questions)."""
    if not 1 <= digits <= 12:
        raise ValueError(f"digits must be in 1..12, got {digits}")
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    return [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n)]


def calculator_question(a: int, b: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": CALCULATOR_SYSTEM},
        {"role": "user", "content": f"What is {a} * {b}?"},
    ]


def calculator_conversations(n: int, *, digits: int, seed: int) -> list[Conversation]:
    """Solved calculator episodes: the tools offered in the system message (as the rollouts
    render them), one call, the tool's result, the answer."""
    spec = {"type": "function", "function": CALCULATOR_TOOL}
    out = []
    for a, b in products(n, digits=digits, seed=seed):
        msgs = offer_tools(calculator_question(a, b), [spec])
        args = json.dumps({"expression": f"{a} * {b}"})
        call = {"id": "call_0", "type": "function",
                "function": {"name": "calculator", "arguments": args}}  # fmt: skip
        msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": "call_0", "content": str(a * b)})
        msgs.append({"role": "assistant", "content": f"The answer is {a * b}."})
        out.append(msgs)
    return out


# -- instruction following ---------------------------------------------------------------------

# two or three short sentences per topic; some with commas, so "no commas" has work to do
_IF_TOPICS: dict[str, tuple[str, ...]] = {
    "the ocean": ("The ocean covers most of the planet.", "Its waves never stop moving.",
                  "At night the water looks dark, cold and deep.",
                  "Fish, whales and coral live below the surface."),
    "a bicycle trip": ("We rode along the river for a whole day.",
                       "The road was flat, quiet and green.", "My legs were tired by noon.",
                       "We stopped for bread, cheese and water."),
    "learning to cook": ("Cooking starts with a sharp knife and patience.",
                         "My first soup was far too salty.",
                         "Now I taste, wait and taste again.", "Every meal teaches something."),
    "the history of tea": ("Tea was first drunk in China long ago.",
                           "Traders carried it west by land and by sea.",
                           "Today it is the most popular drink after water.",
                           "Green, black and white teas come from one plant."),
    "a rainy city": ("The streets shine under the rain.", "People hurry past with umbrellas.",
                     "Cafes fill up, and windows fog over.", "The gutters sing all evening."),
    "a chess match": ("The match began with a quiet opening.",
                      "Both players thought for a long time.",
                      "A bishop, a knight and a pawn decided the game.",
                      "It ended in a draw after five hours."),
    "planting a garden": ("We dug the beds in early spring.",
                          "Beans, carrots and peas went in first.",
                          "The seeds need water every morning.",
                          "By summer the garden was full of green."),
    "a night train": ("The night train left at ten.", "Towns slid past in the dark.",
                      "I slept, woke and slept again.", "We reached the coast at dawn."),
    "a lighthouse": ("The lighthouse stands on a rock by the sea.",
                     "Its lamp turns all night long.",
                     "Ships, boats and birds follow its light.",
                     "The keeper climbs its stairs each evening."),
    "a first job": ("My first job was in a small bakery.", "I started work before sunrise.",
                    "I learned to knead, shape and bake bread.",
                    "The pay was low but the bread was warm."),
}  # fmt: skip
_IF_CONFLICTS = {  # pairs no response can satisfy together
    frozenset({"startend:quotation", "startend:end_checker"}),
    frozenset({"startend:quotation", "detectable_format:number_bullet_lists"}),
    frozenset({"startend:quotation", "detectable_format:title"}),
}


def _if_templates(rng: random.Random) -> list[tuple[str, str, dict[str, Any]]]:
    """(instruction text, instruction id, kwargs) choices for the generator."""
    n_words = rng.choice([30, 50, 80])
    n_bullets = rng.choice([2, 3, 4])
    kw = rng.choice(["light", "quiet", "journey", "simple"])
    end = rng.choice(["Is there anything else?", "That is all."])
    return [
        (f"Answer in fewer than {n_words} words.", "length_constraints:number_words",
         {"num_words": n_words, "relation": "less than"}),
        ("Write everything in lowercase letters.", "change_case:english_lowercase", {}),
        ("Do not use any commas.", "punctuation:no_comma", {}),
        (f"Include the word '{kw}'.", "keywords:existence", {"keywords": [kw]}),
        (f"Use exactly {n_bullets} markdown bullet points.",
         "detectable_format:number_bullet_lists", {"num_bullets": n_bullets}),
        ("Give it a title wrapped in double angular brackets, like <<title>>.",
         "detectable_format:title", {}),
        (f"End your response with this exact phrase: {end}", "startend:end_checker",
         {"end_phrase": end}),
        ("Wrap your entire response in double quotation marks.", "startend:quotation", {}),
    ]  # fmt: skip


def ifeval_records(n: int, *, seed: int, max_constraints: int = 2) -> list[dict[str, Any]]:
    """`n` IFEval-format records (`key`, `prompt`, `instruction_id_list`, `kwargs`, plus `topic`):
    a short note on a topic and 1..`max_constraints` compatible constraints."""
    if not 1 <= max_constraints <= 4:
        raise ValueError(f"max_constraints must be in 1..4, got {max_constraints}")
    rng = random.Random(seed)
    records = []
    for i in range(n):
        k = rng.randint(1, max_constraints)
        chosen: list[tuple[str, str, dict]] = []
        for cand in rng.sample(_if_templates(rng), 8):
            if len(chosen) == k:
                break
            if all(frozenset({cand[1], c[1]}) not in _IF_CONFLICTS for c in chosen):
                chosen.append(cand)
        topic = rng.choice(list(_IF_TOPICS))
        record = {
            "key": f"ifgen/{seed}/{i}",
            "instruction_id_list": [c[1] for c in chosen],
            "kwargs": [c[2] for c in chosen],
            "topic": topic,
        }
        limit = record["kwargs"][j] if (j := _index(chosen, _WORDS)) is not None else None
        if limit is not None:  # a limit the reference reply keeps (it takes the shortest lines)
            words = _count_words(ifeval_response(record))
            if words >= limit["num_words"]:
                limit["num_words"] = next(n for n in (50, 80, 120) if n > words)
                chosen[j] = (f"Answer in fewer than {limit['num_words']} words.", *chosen[j][1:])
        record["prompt"] = f"Write a short note about {topic}. " + " ".join(c[0] for c in chosen)
        records.append(record)
    return records


_WORDS = "length_constraints:number_words"


def _index(chosen: list[tuple[str, str, dict]], instruction: str) -> int | None:
    return next((j for j, c in enumerate(chosen) if c[1] == instruction), None)


def _count_words(text: str) -> int:
    """Words as IFEval counts them (`\\w+` runs)."""
    return len(re.findall(r"\w+", text))


def ifeval_response(record: dict[str, Any], *, seed: int = 0) -> str:
    """A reply to a generated record (`ifeval_records`) that follows all its constraints."""
    rng = random.Random(f"{seed}/{record['key']}")
    c = dict(zip(record["instruction_id_list"], record["kwargs"], strict=True))
    bullets = c.get("detectable_format:number_bullet_lists", {}).get("num_bullets")
    bank = list(_IF_TOPICS[record["topic"]])
    if _WORDS in c:  # under a word limit: the shortest lines, two unless bullets ask for more
        sentences = sorted(bank, key=lambda x: (_count_words(x), x))[: bullets or 2]
    else:
        sentences = rng.sample(bank, bullets or rng.choice([2, 3]))
    if "keywords:existence" in c:
        sentences.append(f"It felt {c['keywords:existence']['keywords'][0]}.")
    if "punctuation:no_comma" in c:
        sentences = [re.sub(r",( and)?", lambda m: " and" if m.group(1) else "", s)
                     for s in sentences]  # fmt: skip
    body = "\n".join(f"* {s}" for s in sentences) if bullets else " ".join(sentences)
    if bullets and "keywords:existence" in c:  # the keyword line is a bullet too: merge it
        *first, last, kw_line = sentences
        body = "\n".join([*(f"* {s}" for s in first), f"* {last} {kw_line}"])
    if "detectable_format:title" in c:
        body = f"<<{record['topic'].capitalize()}>>\n\n{body}"
    if "startend:end_checker" in c:
        body = f"{body}\n{c['startend:end_checker']['end_phrase']}"
    if "change_case:english_lowercase" in c:
        body = body.lower()
    if "startend:quotation" in c:
        body = f'"{body}"'
    return body


def ifeval_conversations(n: int, *, seed: int) -> list[Conversation]:
    return [
        [{"role": "user", "content": r["prompt"]},
         {"role": "assistant", "content": ifeval_response(r, seed=seed)}]
        for r in ifeval_records(n, seed=seed)
    ]  # fmt: skip


# -- code --------------------------------------------------------------------------------------

CODE_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one "
    "```python code block.\n\n```python\n{prompt}```"
)

# (entry point, signature's arguments and return type, docstring, body, reference, argument):
# `{k}` and `{m}` are the record's constants (k in 2..9, m in 10..999), `{c}` its letter;
# `draw(rng, k, m)` draws one test argument, around the constants, so that the tests tell the
# function from a shortcut (identity, a constant, a missing slice); a record's results are never
# all equal. About 57,000 distinct functions: held-out problems of another seed are mostly new
# (87% of 300 against 4,000 of another seed).
_Ref = Callable[[Any, int, int, str], Any]


def _int(r: random.Random, k: int, m: int) -> int:
    return r.randint(min(-50, m - 60), max(120, m + 60))


def _around(r: random.Random, k: int, m: int) -> int:
    return r.randint(m - 40, m + 40)


def _list(r: random.Random, k: int, m: int) -> list[int]:
    return [r.randint(m - 40, m + 40) for _ in range(r.randint(0, k + 4))]


def _long_list(r: random.Random, k: int, m: int) -> list[int]:
    return [r.randint(m - 40, m + 40) for _ in range(r.randint(k - 1, k + 4))]


def _str(r: random.Random, k: int, m: int) -> str:
    return "".join(r.choice("abcde") for _ in range(r.randint(0, 9)))


_CODE_TEMPLATES: tuple[tuple[str, str, str, str, _Ref, Callable[..., Any]], ...] = (
    ("add_number", "x: int) -> int", "Return x plus {m}.", "return x + {m}",
     lambda x, k, m, c: x + m, _int),
    ("minus_number", "x: int) -> int", "Return x minus {m}.", "return x - {m}",
     lambda x, k, m, c: x - m, _int),
    ("times_plus", "x: int) -> int", "Return x times {k} plus {m}.", "return x * {k} + {m}",
     lambda x, k, m, c: x * k + m, _int),
    ("at_most", "x: int) -> int", "Return x, or {m} if x is larger than {m}.",
     "return min(x, {m})", lambda x, k, m, c: min(x, m), _around),
    ("is_multiple", "x: int) -> bool",
     "Return True if x minus {m} is divisible by {k}, else False.",
     "return (x - {m}) % {k} == 0", lambda x, k, m, c: (x - m) % k == 0, _int),
    ("count_above", "xs: list) -> int", "Return how many numbers in xs are greater than {m}.",
     "return sum(1 for x in xs if x > {m})", lambda xs, k, m, c: sum(x > m for x in xs), _list),
    ("sum_above", "xs: list) -> int",
     "Return the sum of the numbers in xs that are greater than {m}.",
     "return sum(x for x in xs if x > {m})", lambda xs, k, m, c: sum(x for x in xs if x > m),
     _list),
    ("scale_all", "xs: list) -> list", "Return xs with every number times {k} plus {m}.",
     "return [x * {k} + {m} for x in xs]", lambda xs, k, m, c: [x * k + m for x in xs], _list),
    ("first_items", "xs: list) -> list", "Return the first {k} items of xs, each plus {m}.",
     "return [x + {m} for x in xs[:{k}]]", lambda xs, k, m, c: [x + m for x in xs[:k]],
     _long_list),
    ("repeat_text", "s: str) -> str", "Return s repeated {k} times, then '{m}'.",
     "return s * {k} + '{m}'", lambda s, k, m, c: s * k + str(m), _str),
    ("count_letter", "s: str) -> int",
     "Return how many times the letter '{c}' appears in s, plus {m}.",
     "return s.count('{c}') + {m}", lambda s, k, m, c: s.count(c) + m, _str),
    ("length_times", "s: str) -> int", "Return the length of s times {k} plus {m}.",
     "return len(s) * {k} + {m}", lambda s, k, m, c: len(s) * k + m, _str),
)  # fmt: skip


def code_records(n: int, *, seed: int, num_tests: int = 5) -> list[dict[str, Any]]:
    """`n` HumanEval-format records of small generated functions (`task_id`, `prompt`,
    `entry_point`, `canonical_solution`, `test` with `check(candidate)` on `num_tests` drawn
    arguments)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name, sig, doc, body, ref, draw = rng.choice(_CODE_TEMPLATES)
        k, m, c = rng.randint(2, 9), rng.randint(10, 999), rng.choice("abcde")
        prompt = f'def {name}({sig}:\n    """{doc.format(k=k, m=m, c=c)}"""\n'
        args = [draw(rng, k, m) for _ in range(num_tests)]
        for _ in range(100):  # a constant and the identity must fail
            got = [repr(ref(a, k, m, c)) for a in args]
            if len(set(got)) > 1 and any(g != repr(a) for g, a in zip(got, args, strict=True)):
                break
            args[rng.randrange(num_tests)] = draw(rng, k, m)
        cases = [f"    assert candidate({a!r}) == {ref(a, k, m, c)!r}" for a in args]
        out.append(
            {
                "task_id": f"code_gen/{seed}/{i}",
                "prompt": prompt,
                "entry_point": name,
                "canonical_solution": f"    {body.format(k=k, m=m, c=c)}\n",
                "test": "def check(candidate):\n" + "\n".join(cases) + "\n",
            }
        )
    return out


def code_conversations(n: int, *, seed: int) -> list[Conversation]:
    """The code family's SFT chats: the instruction with the function's stub, the whole function
    in one code block."""
    return [
        [{"role": "user", "content": CODE_INSTRUCTION.format(prompt=r["prompt"])},
         {"role": "assistant",
          "content": f"```python\n{r['prompt']}{r['canonical_solution']}```"}]
        for r in code_records(n, seed=seed)
    ]  # fmt: skip
