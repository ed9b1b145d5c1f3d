"""Verifiable rewards: math answer equivalence, GSM8K final numbers, code tests in the sandbox,
and IFEval's instruction-following checkers (`ifeval.py`, re-exported here).

The reward table of OlmoRL (Olmo 3 §4.4.1, Figure 16): math is rule-based (normalise, compare
with SymPy; 1 or 0), code runs test cases (fraction passed, or 1 only when all pass; open-instruct
thresholds the pass rate at 0.99), instruction following is 1 when *all* constraints pass
(IFEval's strict rule, by checkers that follow IFEval's reference code).
Nemotron 3 Super scores math with Math-Verify (§3.2.1, §5); this module uses `math_verify` when
it imports and a SymPy path otherwise.

Every verifier returns a `Reward` with `value` in [0, 1], a `reason` category and a `detail` for
debugging (`Reward`). They score the *answer* of a completion: the reasoning block of the chat
template (`<think>...</think>`) is dropped first, and a completion whose reasoning never closed
has no answer (reward 0).

Completions are written by the policy, which in RL is the adversary, so every parser here runs
in time linear in the completion (tests/test_untrusted_text.py measures them on generated worst
cases): no backtracking regex over policy text (runs of whitespace are matched possessively,
`\\s*+`), one pass for boxed answers and code fences, and a cap on what is handed to number
parsing and symbolic comparison (`MAX_ANSWER_CHARS`): an extracted answer longer than that is
compared as a normalised string only.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from hybridlm.data.chat import STOP, THINK_CLOSE, THINK_OPEN, parse_assistant
from hybridlm.rl.ifeval import (  # noqa: F401 - re-exported: the IFEval registry lives there
    INSTRUCTIONS,
    Checker,
    check_instruction,
    follow_instructions,
    register_instruction,
)
from hybridlm.rl.sandbox import Sandbox
from hybridlm.untrusted import clip


@dataclass(frozen=True)
class Reward:
    """A scalar reward, the category of its verdict (`reason`: "correct", "wrong answer", "no
    final answer", "failed: 2/5 tests", ...), optional per-item metrics, and `detail`, the
    verdict spelt out for a person debugging a verifier ("3 != 167436654"). `reason` never holds
    the ground truth or more than a short quote of the completion, so it may go to whoever sent
    the completion; `detail` may hold both and stays with the environment's owner (an
    environment server sends it only when started with `--debug-rewards`)."""

    value: float
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    detail: str = ""


def answer_text(completion: str) -> str:
    """The answer part of a generated assistant turn: text up to `STOP`, without the reasoning
    block. An unclosed `<think>` (generation truncated mid-reasoning) has no answer: ''."""
    text = completion.split(STOP, 1)[0]
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN) and THINK_CLOSE not in stripped:
        return ""
    content = parse_assistant(text).get("content")
    return content or ""


# -- numbers ---------------------------------------------------------------------------------

# An extracted answer is short ("42", "\\frac{3}{4}"); past this many characters it is compared
# as a normalised string only, never parsed as a number or handed to SymPy / Math-Verify, whose
# parsers are not linear in their input.
MAX_ANSWER_CHARS = 1000
_NUMBER_CHARS = 256  # a leading number is read from this many characters at most

_NUM_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def parse_number(text: str) -> Fraction | None:
    """A number written the way answers write them: `1,234`, `$5`, `3.50`, `-2`, `3/4`, `45%`
    (-> 45), `7 apples`. None when there is no single leading number. Only the first
    `_NUMBER_CHARS` characters are read (the leading number is all that counts)."""
    s = text[:_NUMBER_CHARS].strip().replace("\u2212", "-").replace("$", "").replace("\\$", "")
    s = re.sub(r"\\(?:text|mathrm|mbox)\{[^}]*\}", "", s)
    s = s.strip().rstrip(".").strip()
    m = re.match(r"^(-?\s*+\d[\d,]*+(?:\.\d+)?|-?\.\d+)(?:\s*+/\s*+(\d+))?", s)
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


# Whitespace runs are matched possessively (`\s*+`): every token after them starts with
# something other than whitespace, so no other split of the run could match, and a run of n
# spaces after "answer" costs O(n) instead of the O(n^4) of four backtracking `\s*`.
_STATED_ANSWER = re.compile(
    r"(?:final answer|the answer|answer)\s*+(?:is|:|=)?\s*+:?\s*+\$?\s*+(-?[\d.,/]*\d)", re.I
)


def extract_gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8K-style solution: `#### 42`, then `\\boxed{42}`, then
    "the answer is 42" / "final answer: 42", then the last number in the text."""
    m = re.findall(r"####\s*+([^\n]+)", text)
    if m:
        return m[-1].strip()
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    m = _STATED_ANSWER.findall(text)
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
            return Reward(0.0, "final answer is not a number", detail=clip(pred_text))
        if pred == ref:
            return Reward(1.0, "correct", detail=f"{clip(pred_text)} == {reference}")
        return Reward(0.0, "wrong answer", detail=f"{clip(pred_text)} != {reference}")


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


# `\boxed` or `\fbox`, the whitespace after it, and the character after that
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(\s*+)(.?)", re.S)
_TOKEN_RE = re.compile(r"[^\s$]+")


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) whose group
    closes. One pass, vectorised: the brace depth after every character is a cumulative sum,
    and the group opened at `j` closes iff the depth later falls back to its level before `j`
    (a suffix minimum), which decides every candidate at once."""
    braced, spaced = [], []  # positions of the "{" / of the token after the spaces
    for m in _BOX_RE.finditer(text):
        if m.group(2) == "{":
            braced.append(m.start(2))
        elif m.group(1) and m.group(2) not in ("", "$"):
            spaced.append(m.start(2))
    if not braced and not spaced:
        return None
    last_spaced = spaced[-1] if spaced else -1
    if braced and braced[-1] > last_spaced:
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        steps = (codes == ord("{")).astype(np.int64) - (codes == ord("}"))
        depth = np.cumsum(steps)  # depth[i]: after character i
        after = np.append(np.minimum.accumulate(depth[::-1])[::-1][1:], np.iinfo(np.int64).max)
        js = np.asarray(braced)
        closed = js[(after[js] <= depth[js] - 1) & (js > last_spaced)]
        if closed.size:
            j = int(closed[-1])
            end = j + 1 + int(np.argmax(depth[j + 1 :] <= depth[j] - 1))
            return text[j + 1 : end].strip()
    if last_spaced < 0:
        return None
    return _TOKEN_RE.match(text, last_spaced).group()


# "final answer" then the rest of its line (whitespace runs possessive, as `_STATED_ANSWER`)
_FINAL_ANSWER = re.compile(r"final answer(?: is)?\s*+:?\s*+(.+)", re.I)


def extract_math_answer(text: str) -> str | None:
    """The final answer of a math solution: the last `\\boxed{}`, then "final answer is X",
    then the last `$...$`, then the last number."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    m = _FINAL_ANSWER.findall(text)
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
    evaluated in bounded time (`_safe_to_evaluate`) or longer than `MAX_ANSWER_CHARS` only
    match as equal strings."""

    def norm(s: str) -> str:
        return re.sub(r"\s+|\\!|\\,|\$|\\left|\\right|\.$", "", s).replace("\\dfrac", "\\frac")

    if norm(pred) == norm(ref):
        return True
    if len(pred) > MAX_ANSWER_CHARS or len(ref) > MAX_ANSWER_CHARS:
        return False  # no parser below is linear in its input (module docstring)
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
            return Reward(1.0, "correct", detail=f"{clip(pred)} == {ref!r}")
        return Reward(0.0, "wrong answer", detail=f"{clip(pred)} != {ref!r}")


# -- code --------------------------------------------------------------------------------------

_FENCE_LANG = re.compile(r"[ \t]*+([\w+-]*)")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, body) of every fenced block in order: a fence is three backticks, the
    rest of its line is the info string (the tag is its first word), the body runs to the next
    three backticks or the end of the text (less one final newline). A fence with no newline
    after it opens no block. One forward pass with `str.find`: a backtracking regex for the
    same blocks takes quadratic time on a long line after a fence."""
    out, pos = [], 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            return out
        line_end = text.find("\n", start + 3)
        if line_end < 0:
            return out  # no later fence has a newline after it either
        lang = _FENCE_LANG.match(text, start + 3, line_end).group(1)
        close = text.find("```", line_end + 1)
        if close < 0:
            end = len(text) - 1 if text.endswith("\n") else len(text)
            out.append((lang, text[line_end + 1 : max(end, line_end + 1)]))
            return out
        out.append((lang, text[line_end + 1 : close]))
        pos = close + 3


def extract_code(text: str, language: str = "python") -> str:
    """The last fenced code block in `language` (or an untagged one); the text itself when there
    is no fence."""
    aliases = ("", language, *{"python": ("py", "python3")}.get(language, ()))
    blocks = [body for lang, body in code_blocks(text) if lang.lower() in aliases]
    if blocks:
        return blocks[-1]
    return text


class CodeVerifier:
    """Runs the completion's code against tests in a `Sandbox`. Reward: 1 when the pass rate is
    at least `pass_threshold` (OlmoRL: all-or-nothing, open-instruct thresholds at 0.99), or the
    pass rate itself with `partial_credit`."""

    name = "code"

    def __init__(
        self, sandbox: Any = None, *, partial_credit: bool = False, pass_threshold: float = 1.0
    ) -> None:

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
        # the sandbox's reason quotes the program's own errors, which may print what the hidden
        # tests call it with: detail only
        reason = f"{result.status}: {result.num_passed}/{result.num_tests} tests"
        return Reward(float(value), reason, metrics, detail=result.reason)

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


# -- instruction following (IFEval) ------------------------------------------------------------
# The checkers, their registry and strict / loose scoring follow IFEval's reference code; they
# live in `ifeval.py` (text measurements in `ifeval_text.py`) and are re-exported here.


class InstructionVerifier:
    """Checks every IFEval constraint of a prompt on the completion's answer: reward 1 when all
    are followed (OlmoRL), or the fraction followed with `partial_credit`. Strict by default
    (IFEval's `test_instruction_following_strict`: a blank answer follows nothing); `loose`
    also accepts the answer without its first / last line or without `*`
    (`test_instruction_following_loose`)."""

    name = "ifeval"

    def __init__(self, *, partial_credit: bool = False, loose: bool = False) -> None:
        self.partial_credit = partial_credit
        self.loose = loose

    def __call__(
        self,
        completion: str,
        instruction_ids: Sequence[str],
        kwargs: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> Reward:
        if not instruction_ids:
            raise ValueError("instruction_ids must name at least one constraint")
        response = answer_text(completion)
        followed = follow_instructions(response, instruction_ids, kwargs, loose=self.loose)
        frac = sum(followed) / len(followed)
        value = frac if self.partial_credit else float(frac == 1.0)
        failed = [k for k, ok in zip(instruction_ids, followed, strict=True) if not ok]
        reason = "all constraints pass" if not failed else "failed: " + ", ".join(failed)
        return Reward(value, reason, {"constraints_passed": frac})
