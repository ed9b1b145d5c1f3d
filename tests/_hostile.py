"""Worst-case text for parsers of untrusted text, and a timer that survives a parser that hangs.

Super-linear parsing comes from repetition: a backtracking regex over a long run of what one of
its tokens matches (`\\s*\\s*` over spaces), a scan restarted at every occurrence of an opening
tag that never closes (`<tool_call>` x n, `\\boxed{` x n), a decoder that recurses once per
bracket. `worst_cases` builds such texts from `MOTIFS`, the tokens the parsers of policy output
react to: each motif repeated, a motif followed by another repeated, and pairs repeated, to
`size` characters. `assert_linear` runs a function on every case in a child process and fails,
naming the case, as soon as one takes longer than its budget (a regex holding the GIL cannot be
interrupted in-process); it returns the worst time per MiB, which the tests print.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import random
import time
from collections.abc import Callable, Iterable, Sequence

# the tokens that open, close or separate something in some parser of model output
MOTIFS: tuple[str, ...] = (
    " ", "\n", "\t", "\n\n", " \n", "a", "1", "-1", "1,", "1.", ".", ",", "/", ":", "=", "%", "$",
    "{", "}", "[", "]", "(", ")", '"', "'", "\\", '\\"', "*", "**", "***", "#", "####", "-", "---",
    "<", ">", "<<", ">>", "[[", "]]", "```", "```python", "```\n",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_call>{", '{"name": "calculator",',
    '{"a":', '"arguments": {', "<|im_end|>", "<|im_start|>",
    "\\boxed", "\\boxed{", "\\boxed ", "\\fbox{", "\\frac{", "\\sqrt{", "\\text{", "\\left(", "^",
    "answer", "answer is ", "The answer is ", "final answer", "Final Answer:", "####  ",
    "rating", "Rating: ", "score: ", "[[1", "1/", "/10", " out of 10", "P.S.", "p. s", "SECTION 1",
    "My answer is", "******", "Mr.", "e.g. ", "word ", "A. ", "\u00a0", "\u3000", "é",
)  # fmt: skip


def worst_cases(
    size: int,
    *,
    motifs: Sequence[str] = MOTIFS,
    extra: Iterable[str] = (),
    pairs: int = 48,
    seed: int = 0,
) -> list[tuple[str, str]]:
    """(label, text) cases of about `size` characters (module docstring): every motif repeated,
    `pairs` seeded pairs (a, b) as `a + b * k` and `(a + b) * k`, and the `extra` motifs of a
    particular parser in both roles against every motif."""
    out = []

    def rep(m: str) -> str:
        return m * max(1, size // len(m))

    extra = list(extra)
    for m in list(motifs) + extra:
        out.append((f"{m!r} * n", rep(m)))
    combos = list(itertools.product(motifs, motifs))
    random.Random(seed).shuffle(combos)
    combos = combos[:pairs] + [(e, m) for e in extra for m in motifs]
    combos += [(m, e) for e in extra for m in motifs]
    for a, b in combos:
        out.append((f"{a!r} + {b!r} * n", a + rep(b)))
        out.append((f"({a!r} + {b!r}) * n", rep(a + b)))
    return out


def _run_cases(fn: Callable[[str], object], cases: list[tuple[str, str]], conn) -> None:
    # first calls import and compile (SymPy, Math-Verify, regexes) and load models (langdetect's
    # profiles, reached only by all-lowercase or all-uppercase text): not what is timed
    for warm in (
        "warm up: The answer is \\boxed{1}. <tool_call>{}</tool_call>",
        "warm up",
        "WARM UP",
    ):
        try:
            fn(warm)
        except Exception:  # noqa: BLE001, S110 - the cases report errors
            pass
    for i, (_, text) in enumerate(cases):
        t = time.perf_counter()
        try:
            fn(text)
            error = None
        except Exception as err:  # noqa: BLE001 - the parent reports it
            error = f"{type(err).__name__}: {str(err)[:200]}"
        conn.send((i, time.perf_counter() - t, len(text), error))
    conn.send(None)


def assert_linear(
    fn: Callable[[str], object],
    cases: list[tuple[str, str]],
    *,
    budget_s: float = 1.0,
    allow_errors: bool = False,
) -> float:
    """Run `fn` on every case in a forked child; fail naming the first case that takes longer
    than `budget_s` or raises (unless `allow_errors`). Returns the worst seconds per MiB."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_cases, args=(fn, cases, child), daemon=True)
    proc.start()
    child.close()
    worst, done = 0.0, 0
    try:
        while True:
            if not parent.poll(budget_s + 2.0):  # + start-up and scheduling slack
                label = cases[done][0]
                raise AssertionError(f"{_name(fn)} took over {budget_s} s on {label}")
            msg = parent.recv()
            if msg is None:
                break
            i, seconds, n, error = msg
            done = i + 1
            if error is not None and not allow_errors:
                raise AssertionError(f"{_name(fn)} raised on {cases[i][0]}: {error}")
            if seconds > budget_s:
                raise AssertionError(
                    f"{_name(fn)} took {seconds:.2f} s (budget {budget_s} s) on {cases[i][0]}"
                )
            worst = max(worst, seconds / max(n, 1) * (1 << 20))
    finally:
        proc.kill()
        proc.join(5)
    return worst


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# ---------------------------------------------------------------- verifiers with bugs
# Importable by module name, so `rl.scoring`'s worker processes can load them.
from hybridlm.rl.environments import ArithmeticEnvironment  # noqa: E402


class BacktrackingEnvironment(ArithmeticEnvironment):
    """Arithmetic whose verifier has the bug the verification deadline is for: on "x" * 40 its
    regular expression (nested quantifiers) backtracks for hours, holding the interpreter, and
    on "crash" it raises."""

    name = "backtracking"

    def __init__(self, **kw):
        super().__init__(name="backtracking", **kw)

    def score(self, problem, completion):
        import re

        if completion == "crash":
            raise KeyError("a verifier bug")
        if re.fullmatch(r"(x+x+)+y", completion):
            return super().score(problem, "0")
        return super().score(problem, completion)
