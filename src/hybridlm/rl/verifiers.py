"""Verifiable rewards: math answer equivalence, GSM8K final numbers, code tests in the sandbox,
and IFEval-style instruction-following constraint checkers.

The reward table of OlmoRL (Olmo 3 §4.4.1, Figure 16): math is rule-based (normalise, compare
with SymPy; 1 or 0), code runs test cases (fraction passed, or 1 only when all pass; open-instruct
thresholds the pass rate at 0.99), instruction following is 1 when *all* constraints pass.
Nemotron 3 Super scores math with Math-Verify (§3.2.1, §5); this module uses `math_verify` when
it imports and a SymPy path otherwise.

Every verifier returns a `Reward` with `value` in [0, 1] and a human-readable `reason`. They score
the *answer* of a completion: the reasoning block of the chat template (`<think>...</think>`) is
dropped first, and a completion whose reasoning never closed has no answer (reward 0).
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from hybridlm.data.chat import STOP, THINK_CLOSE, THINK_OPEN, parse_assistant


@dataclass(frozen=True)
class Reward:
    """A scalar reward with its explanation and optional per-item metrics."""

    value: float
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


def answer_text(completion: str) -> str:
    """The answer part of a generated assistant turn: text up to `STOP`, without the reasoning
    block. An unclosed `<think>` (generation truncated mid-reasoning) has no answer: ''."""
    text = completion.split(STOP, 1)[0]
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN) and THINK_CLOSE not in stripped:
        return ""
    content = parse_assistant(text).get("content")
    return content or ""


# -- numbers -----------------------------------------------------------------------------------

_NUM_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def parse_number(text: str) -> Fraction | None:
    """A number written the way answers write them: `1,234`, `$5`, `3.50`, `-2`, `3/4`, `45%`
    (-> 45), `7 apples`. None when there is no single leading number."""
    s = text.strip().replace("\u2212", "-").replace("$", "").replace("\\$", "")
    s = re.sub(r"\\(?:text|mathrm|mbox)\{[^}]*\}", "", s)
    s = s.strip().rstrip(".").strip()
    m = re.match(r"^(-?\s*\d[\d,]*(?:\.\d+)?|-?\.\d+)(?:\s*/\s*(\d+))?", s)
    if not m:
        return None
    head = m.group(1).replace(" ", "")
    if "," in head and not re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", head):
        return None  # "1,2" is a list, not one thousand two hundred
    try:
        value = Fraction(head.replace(",", ""))
        if m.group(2):
            value /= int(m.group(2))
    except (ValueError, ZeroDivisionError):
        return None
    return value


def _last_number(text: str) -> str | None:
    found = _NUM_RE.findall(text.replace("\u2212", "-"))
    return found[-1] if found else None


def extract_gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8K-style solution: `#### 42`, then `\\boxed{42}`, then
    "the answer is 42" / "final answer: 42", then the last number in the text."""
    m = re.findall(r"####\s*([^\n]+)", text)
    if m:
        return m[-1].strip()
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    m = re.findall(
        r"(?:final answer|the answer|answer)\s*(?:is|:|=)?\s*:?\s*\$?\s*(-?[\d.,/]*\d)",
        text,
        flags=re.I,
    )
    if m:
        return m[-1]
    return _last_number(text)


def gsm8k_reference(answer_field: str) -> str:
    """The reference number of a GSM8K `answer` field (the text after `####`)."""
    m = re.findall(r"####\s*([^\n]+)", answer_field)
    if not m:
        raise ValueError("a GSM8K answer field must end with '#### <number>'")
    return m[-1].strip().replace(",", "")


class GSM8KVerifier:
    """1 when the completion's final number equals the reference number, else 0."""

    name = "gsm8k"

    def __call__(self, completion: str, reference: str) -> Reward:
        ref = parse_number(str(reference))
        if ref is None:
            raise ValueError(f"GSM8K reference {reference!r} is not a number")
        pred_text = extract_gsm8k_answer(answer_text(completion))
        if pred_text is None:
            return Reward(0.0, "no number in the answer")
        pred = parse_number(pred_text)
        if pred is None:
            return Reward(0.0, f"final answer {pred_text!r} is not a number")
        if pred == ref:
            return Reward(1.0, f"{pred_text} == {reference}")
        return Reward(0.0, f"{pred_text} != {reference}")


# -- math --------------------------------------------------------------------------------------


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the `{...}` group starting at `text[start] == '{'`, and the end index."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`)."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*(\{|\s+\S)", text):
        if m.group(1) == "{":
            got = _braced(text, m.end() - 1)
            if got is not None:
                best = got[0].strip()
        else:
            best = re.match(r"\s*([^\s$]+)", text[m.end() - 1 :]).group(1)
    return best


def extract_math_answer(text: str) -> str | None:
    """The final answer of a math solution: the last `\\boxed{}`, then "final answer is X",
    then the last `$...$`, then the last number."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    m = re.findall(r"final answer(?: is)?\s*:?\s*(.+)", text, flags=re.I)
    if m:
        ans = m[-1].strip().rstrip(".").strip()
        inner = re.fullmatch(r"\$+(.*?)\$+", ans)
        return (inner.group(1) if inner else ans).strip()
    m = re.findall(r"\$([^$]+)\$", text)
    if m:
        return m[-1].strip()
    return _last_number(text)


_LATEX_REPLACEMENTS = [
    (r"\\left|\\right|\\!|\\,|\\;|\\:|\\ ", ""),
    (r"\\(?:d|t)?frac\{", r"\\frac{"),
    (r"\\cdot|\\times", "*"),
    (r"\\div", "/"),
    (r"\^\{?\\circ\}?|°", ""),
    (r"\\%|%", "/100"),
    (r"\\pi", "pi"),
    (r"\\infty", "oo"),
    (r"\\(?:text|mathrm|mbox|textbf|mathbf)\{([^}]*)\}", r"\1"),
]


def _latex_to_sympy(expr: str) -> str:
    """A small LaTeX -> SymPy-syntax rewrite for the answers math datasets use: fractions, roots,
    powers, \\cdot, percents, \\pi; units words are dropped."""
    s = expr.strip().strip("$").strip()
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 3" -> "3"
    for pat, rep in _LATEX_REPLACEMENTS:
        s = re.sub(pat, rep, s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    for _ in range(50):  # rewrite \frac{a}{b} and \sqrt{a}, outermost first
        m = re.search(r"\\frac\{|\\sqrt\{", s)
        if not m:
            break
        first = _braced(s, m.end() - 1)
        if first is None:
            break
        if m.group().startswith("\\sqrt"):
            s = s[: m.start()] + f"sqrt({first[0]})" + s[first[1] :]
            continue
        second = _braced(s, first[1]) if s[first[1] : first[1] + 1] == "{" else None
        if second is None:
            break
        s = s[: m.start()] + f"(({first[0]})/({second[0]}))" + s[second[1] :]
    s = re.sub(r"\\sqrt\s*(\d+|[a-zA-Z])", r"sqrt(\1)", s)
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # thousands separators
    s = re.sub(r"\s+(?!pi$)[a-zA-Z]{2,}$", "", s.strip())  # trailing units: "5 cm" -> "5"
    return s.strip()


def _sympy_equal(pred: str, ref: str) -> bool:
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    transforms = standard_transformations + (implicit_multiplication_application, convert_xor)

    def split_top(s: str) -> list[str]:
        parts, depth, start = [], 0, 0
        for i, c in enumerate(s):
            depth += c in "([{"
            depth -= c in ")]}"
            if c == "," and depth == 0:
                parts.append(s[start:i])
                start = i + 1
        return [p for p in parts + [s[start:]] if p.strip()]

    def parse(s: str) -> tuple[str, list[Any]]:
        """(outer brackets, elements): `(1, 2)` and `[1, 2]` keep their brackets apart."""
        s, outer = s.strip(), ""
        if s[:1] in "([" and s[-1:] in ")]" and len(split_top(s)) == 1:
            inner = s[1:-1]
            if len(split_top(inner)) > 1:
                s, outer = inner, s[0] + s[-1]
        exprs = [parse_expr(p, transformations=transforms, evaluate=True) for p in split_top(s)]
        return outer, exprs

    def is_set(s: str) -> bool:
        return s.strip().strip("$").startswith("\\{")

    def strip_set(s: str) -> str:
        s = s.strip().strip("$").strip()
        return s[2:-2] if is_set(s) and s.endswith("\\}") else s

    (outer_a, a), (outer_b, b) = (parse(_latex_to_sympy(strip_set(x))) for x in (pred, ref))
    if len(a) != len(b) or not a or outer_a != outer_b:
        return False
    if is_set(pred) and is_set(ref):  # sets compare unordered, tuples and lists in order
        a, b = sorted(a, key=str), sorted(b, key=str)
    for x, y in zip(a, b, strict=True):
        diff = sympy.simplify(x - y)
        if diff == 0:
            continue
        try:
            if abs(complex(sympy.N(diff))) > 1e-6 * max(1.0, abs(complex(sympy.N(y)))):
                return False
        except (TypeError, ValueError):
            return False
    return True


def _math_verify_equal(pred: str, ref: str) -> bool | None:
    """Math-Verify's verdict, or None when it is not installed. Its timeouts use SIGALRM, which
    only works on the main thread, so worker threads run it without one."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    main = threading.current_thread() is threading.main_thread()
    timeout = 5 if main else None

    def wrap(s: str) -> str:
        return s if "$" in s or "\\boxed" in s else f"${s}$"

    gold = parse(wrap(ref), parsing_timeout=timeout)
    target = parse(wrap(pred), parsing_timeout=timeout)
    if not gold or not target:
        return None
    return bool(verify(gold, target, timeout_seconds=timeout))


_MAX_EXPONENT = 1000


def _safe_to_evaluate(sympy_text: str) -> bool:
    """False for answers whose evaluation could take unbounded time or memory (power towers,
    huge exponents or factorials, very long expressions): `9^{9^{9}}` must not stall a reward
    worker. Such answers are compared as normalised strings only."""
    s = sympy_text
    if len(s) > 400 or re.search(r"\d{3,}\s*!|factorial", s):
        return False
    for m in re.finditer(r"\*\*\s*", s):
        i = m.end()
        if s[i : i + 1] == "(":
            group = _balanced(s, i)
            if group is None or "**" in group:
                return False  # an exponent that is itself a power
            operand, after = group, i + len(group) + 2
        else:
            tok = re.match(r"[\w.]*", s[i:]).group()
            operand, after = tok, i + len(tok)
            if s[after:].lstrip().startswith("**"):
                return False  # a**b**c
        if any(int(n) > _MAX_EXPONENT for n in re.findall(r"\d+", operand)):
            return False
    return True


def _balanced(s: str, start: int) -> str | None:
    """The inside of the parenthesised group opening at `s[start] == '('`."""
    depth = 0
    for j in range(start, len(s)):
        depth += s[j] == "("
        depth -= s[j] == ")"
        if depth == 0:
            return s[start + 1 : j]
    return None


def math_equal(pred: str, ref: str, *, use_math_verify: bool = True) -> bool:
    """Whether two final answers are the same mathematical object: equal strings after
    normalisation, equal numbers (fractions, decimals, percents), Math-Verify's verdict when it is
    installed and enabled, else SymPy simplification of the difference. Answers that could not be
    evaluated in bounded time (`_safe_to_evaluate`) only match as equal strings."""

    def norm(s: str) -> str:
        return re.sub(r"\s+|\\!|\\,|\$|\\left|\\right|\.$", "", s).replace("\\dfrac", "\\frac")

    if norm(pred) == norm(ref):
        return True
    a_text, b_text = _latex_to_sympy(pred), _latex_to_sympy(ref)
    if not (_safe_to_evaluate(a_text) and _safe_to_evaluate(b_text)):
        return False
    plain = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
    if plain.fullmatch(a_text) and plain.fullmatch(b_text):
        a, b = parse_number(a_text), parse_number(b_text)
        if a is not None and b is not None:
            return a == b
    if use_math_verify:
        verdict = _math_verify_equal(pred, ref)
        if verdict is not None:
            return verdict
    try:
        return _sympy_equal(pred, ref)
    except Exception:  # noqa: BLE001 - SymPy raises many types on unparseable answers
        return False


class MathVerifier:
    """1 when the completion's final answer (boxed, or stated) is equivalent to the reference."""

    name = "math"

    def __init__(self, *, use_math_verify: bool = True) -> None:
        self.use_math_verify = use_math_verify

    def __call__(self, completion: str, reference: str) -> Reward:
        pred = extract_math_answer(answer_text(completion))
        if pred is None:
            return Reward(0.0, "no final answer")
        ref = extract_boxed(reference) or reference
        if math_equal(pred, ref, use_math_verify=self.use_math_verify):
            return Reward(1.0, f"{pred!r} == {ref!r}")
        return Reward(0.0, f"{pred!r} != {ref!r}")


# -- code --------------------------------------------------------------------------------------

_FENCE_RE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|$)", re.S)


def extract_code(text: str, language: str = "python") -> str:
    """The last fenced code block in `language` (or an untagged one); the text itself when there
    is no fence."""
    blocks = [
        (lang.lower(), body)
        for lang, body in _FENCE_RE.findall(text)
        if lang.lower() in ("", language, *{"python": ("py", "python3")}.get(language, ()))
    ]
    if blocks:
        return blocks[-1][1]
    return text


class CodeVerifier:
    """Runs the completion's code against tests in a `Sandbox`. Reward: 1 when the pass rate is
    at least `pass_threshold` (OlmoRL: all-or-nothing, open-instruct thresholds at 0.99), or the
    pass rate itself with `partial_credit`."""

    name = "code"

    def __init__(
        self, sandbox: Any = None, *, partial_credit: bool = False, pass_threshold: float = 1.0
    ) -> None:
        from hybridlm.rl.sandbox import Sandbox

        if not 0.0 < pass_threshold <= 1.0:
            raise ValueError(f"pass_threshold must be in (0, 1], got {pass_threshold}")
        self.sandbox = sandbox if sandbox is not None else Sandbox()
        self.partial_credit = partial_credit
        self.pass_threshold = pass_threshold

    def program(self, completion: str, prefix: str = "") -> str:
        return prefix + extract_code(answer_text(completion))

    def reward(self, result: Any) -> Reward:
        rate = result.pass_rate
        metrics = {"pass_rate": rate, "runtime_s": result.runtime_s}
        if self.partial_credit:
            value = rate
        else:
            value = 1.0 if result.status in ("ok", "failed") and rate >= self.pass_threshold else 0
        reason = f"{result.status}: {result.num_passed}/{result.num_tests} tests; {result.reason}"
        return Reward(float(value), reason, metrics)

    def __call__(self, completion: str, tests: Sequence[Any], prefix: str = "") -> Reward:
        return self.reward(self.sandbox.run(self.program(completion, prefix), tests))

    def score_many(
        self, completions: Sequence[str], tests: Sequence[Sequence[Any]], prefixes: Sequence[str]
    ) -> list[Reward]:
        """Many completions through the sandbox's worker pool."""
        jobs = [
            (self.program(c, p), t) for c, t, p in zip(completions, tests, prefixes, strict=True)
        ]
        return [self.reward(r) for r in self.sandbox.run_many(jobs)]


# -- instruction following (IFEval-style constraint registry) ---------------------------------

Checker = Callable[..., bool]
INSTRUCTIONS: dict[str, Checker] = {}
_RELATIONS = ("less than", "at least")


def register_instruction(name: str) -> Callable[[Checker], Checker]:
    """Add a checker `(response, **kwargs) -> bool` under an IFEval instruction id."""

    def deco(fn: Checker) -> Checker:
        if name in INSTRUCTIONS:
            raise ValueError(f"instruction {name!r} is already registered")
        INSTRUCTIONS[name] = fn
        return fn

    return deco


def _compare(count: int, relation: str, target: int) -> bool:
    if relation not in _RELATIONS:
        raise ValueError(f"relation must be one of {_RELATIONS}, got {relation!r}")
    return count < target if relation == "less than" else count >= target


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+(?:['’-]\w+)*\b", text)


def _sentences(text: str) -> list[str]:
    text = re.sub(r"\b(?:Mr|Mrs|Ms|Dr|Prof|Sr|Jr|St|vs|etc|e\.g|i\.e)\.", "<abbr>", text)
    return [s for s in re.split(r"(?<=[.!?])\s+|\n+", text) if re.search(r"\w", s)]


@register_instruction("length_constraints:number_words")
def _number_words(response: str, *, num_words: int, relation: str) -> bool:
    return _compare(len(_words(response)), relation, num_words)


@register_instruction("length_constraints:number_sentences")
def _number_sentences(response: str, *, num_sentences: int, relation: str) -> bool:
    return _compare(len(_sentences(response)), relation, num_sentences)


@register_instruction("length_constraints:number_paragraphs")
def _number_paragraphs(response: str, *, num_paragraphs: int) -> bool:
    """Paragraphs separated by the markdown divider `***` (IFEval); none may be empty."""
    parts = [p.strip() for p in re.split(r"\s?\*\*\*\s?", response.strip())]
    return all(parts) and len(parts) == num_paragraphs


@register_instruction("length_constraints:nth_paragraph_first_word")
def _nth_paragraph_first_word(
    response: str, *, num_paragraphs: int, nth_paragraph: int, first_word: str
) -> bool:
    """Paragraphs separated by blank lines; paragraph `nth_paragraph` (1-based) starts with
    `first_word` (case-insensitive, punctuation ignored)."""
    parts = [p.strip() for p in re.split(r"\n\s*\n", response.strip()) if p.strip()]
    if len(parts) != num_paragraphs or not 1 <= nth_paragraph <= len(parts):
        return False
    words = _words(parts[nth_paragraph - 1])
    return bool(words) and words[0].lower() == first_word.lower()


@register_instruction("keywords:existence")
def _keywords_existence(response: str, *, keywords: Sequence[str]) -> bool:
    return all(re.search(re.escape(k), response, flags=re.I) for k in keywords)


@register_instruction("keywords:forbidden_words")
def _forbidden_words(response: str, *, forbidden_words: Sequence[str]) -> bool:
    return not any(
        re.search(r"\b" + re.escape(w) + r"\b", response, flags=re.I) for w in forbidden_words
    )


@register_instruction("keywords:frequency")
def _keyword_frequency(response: str, *, keyword: str, frequency: int, relation: str) -> bool:
    count = len(re.findall(r"\b" + re.escape(keyword) + r"\b", response, flags=re.I))
    return _compare(count, relation, frequency)


@register_instruction("keywords:letter_frequency")
def _letter_frequency(response: str, *, letter: str, let_frequency: int, let_relation: str) -> bool:
    if len(letter) != 1:
        raise ValueError(f"letter must be a single character, got {letter!r}")
    return _compare(response.lower().count(letter.lower()), let_relation, let_frequency)


@register_instruction("language:response_language")
def _response_language(response: str, *, language: str) -> bool:
    """ISO 639-1 code of the response's language, by py3langid."""
    import py3langid

    return py3langid.classify(response)[0] == language


@register_instruction("detectable_format:json_format")
def _json_format(response: str) -> bool:
    """The whole response is JSON (a ```json fence around it is allowed)."""
    text = response.strip()
    m = re.fullmatch(r"```(?:json|JSON|Json)?\s*\n?(.*?)\n?```", text, flags=re.S)
    try:
        json.loads(m.group(1) if m else text)
    except ValueError:
        return False
    return True


@register_instruction("detectable_format:number_bullet_lists")
def _bullets(response: str, *, num_bullets: int) -> bool:
    """Exactly `num_bullets` markdown bullets (`* ` or `- ` at the start of a line)."""
    return len(re.findall(r"^\s*[*-]\s+\S", response, flags=re.M)) == num_bullets


@register_instruction("detectable_format:number_highlighted_sections")
def _highlights(response: str, *, num_highlights: int) -> bool:
    """At least `num_highlights` sections highlighted as `*text*` (or `**text**`)."""
    single = [h for h in re.findall(r"(?<!\*)\*([^\n*]+)\*(?!\*)", response) if h.strip()]
    double = [h for h in re.findall(r"\*\*([^\n*]+)\*\*", response) if h.strip()]
    return len(single) + len(double) >= num_highlights


@register_instruction("detectable_format:title")
def _title(response: str) -> bool:
    """A title in double angular brackets, `<<like this>>`."""
    return any(t.strip() for t in re.findall(r"<<([^\n]+?)>>", response))


@register_instruction("detectable_format:multiple_sections")
def _sections(response: str, *, section_spliter: str, num_sections: int) -> bool:
    """At least `num_sections` sections headed `<section_spliter> <n>` (e.g. "Section 1")."""
    parts = re.split(r"\s?" + re.escape(section_spliter) + r"\s?\d+\s?", response)
    return len(parts) - 1 >= num_sections


@register_instruction("detectable_format:constrained_response")
def _constrained(response: str) -> bool:
    """One of the fixed answers IFEval offers."""
    options = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
    return any(o in response.strip() for o in options)


@register_instruction("detectable_content:number_placeholders")
def _placeholders(response: str, *, num_placeholders: int) -> bool:
    """At least `num_placeholders` square-bracket placeholders like `[address]`."""
    return len(re.findall(r"\[[^\[\]\n]+\]", response)) >= num_placeholders


@register_instruction("detectable_content:postscript")
def _postscript(response: str, *, postscript_marker: str) -> bool:
    """A postscript starting with the marker (`P.S.`, `P.P.S`) on its own line."""
    marker = re.escape(postscript_marker.strip()).replace(r"\.", r"\.?")
    return re.search(r"(?:^|\n)\s*" + marker, response, flags=re.I) is not None


@register_instruction("startend:end_checker")
def _end_checker(response: str, *, end_phrase: str) -> bool:
    return response.strip().lower().endswith(end_phrase.strip().lower())


@register_instruction("startend:quotation")
def _quotation(response: str) -> bool:
    text = response.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


@register_instruction("change_case:english_lowercase")
def _lowercase(response: str) -> bool:
    return response == response.lower() and any(c.isalpha() for c in response)


@register_instruction("change_case:english_capital")
def _uppercase(response: str) -> bool:
    return response == response.upper() and any(c.isalpha() for c in response)


@register_instruction("change_case:capital_word_frequency")
def _capital_words(response: str, *, capital_frequency: int, capital_relation: str) -> bool:
    """Words written entirely in capitals (at least two letters)."""
    count = sum(1 for w in _words(response) if len(w) > 1 and w.isupper())
    return _compare(count, capital_relation, capital_frequency)


@register_instruction("punctuation:no_comma")
def _no_comma(response: str) -> bool:
    return "," not in response and "，" not in response


@register_instruction("combination:repeat_prompt")
def _repeat_prompt(response: str, *, prompt_to_repeat: str) -> bool:
    return response.strip().lower().startswith(prompt_to_repeat.strip().lower())


@register_instruction("combination:two_responses")
def _two_responses(response: str) -> bool:
    """Two different responses separated by six asterisks `******`."""
    parts = [p.strip() for p in response.split("******")]
    return len(parts) == 2 and all(parts) and parts[0] != parts[1]


def check_instruction(name: str, response: str, kwargs: Mapping[str, Any] | None = None) -> bool:
    """Run one registered checker; unknown ids and wrong kwargs raise `ValueError`."""
    if name not in INSTRUCTIONS:
        raise ValueError(f"unknown instruction {name!r}; known: {sorted(INSTRUCTIONS)}")
    fn = INSTRUCTIONS[name]
    kw = {k: v for k, v in (kwargs or {}).items() if v is not None}
    try:
        inspect.signature(fn).bind(response, **kw)
    except TypeError as err:
        raise ValueError(f"instruction {name!r}: bad kwargs {sorted(kw)} ({err})") from None
    return bool(fn(response, **kw))


class InstructionVerifier:
    """Checks every constraint of a prompt; reward 1 when all pass (OlmoRL), or the fraction that
    pass with `partial_credit`."""

    name = "ifeval"

    def __init__(self, *, partial_credit: bool = False) -> None:
        self.partial_credit = partial_credit

    def __call__(
        self,
        completion: str,
        instruction_ids: Sequence[str],
        kwargs: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> Reward:
        if not instruction_ids:
            raise ValueError("instruction_ids must name at least one constraint")
        kwargs = list(kwargs) if kwargs is not None else [None] * len(instruction_ids)
        if len(kwargs) != len(instruction_ids):
            raise ValueError("kwargs must have one entry per instruction id")
        response = answer_text(completion)
        results = {
            name: check_instruction(name, response, kw)
            for name, kw in zip(instruction_ids, kwargs, strict=True)
        }
        frac = sum(results.values()) / len(results)
        value = frac if self.partial_credit else float(frac == 1.0)
        failed = [k for k, ok in results.items() if not ok]
        reason = "all constraints pass" if not failed else "failed: " + ", ".join(failed)
        return Reward(value, reason, {"constraints_passed": frac})
