"""Text that a client or the policy wrote is read in linear time and bounded memory: the one
bounded JSON reader (`hybridlm.untrusted`), and a property test over generated worst cases
(`_hostile.worst_cases`) for every parser and verifier of policy output (the IFEval checkers
have theirs in test_ifeval_hostile.py). The default suite runs 64 KiB cases with a budget far
below what any super-linear parser needs on them; the slow test runs 1 MiB cases, each in under
a second, and prints the worst seconds per MiB of each function."""

from __future__ import annotations

import json

import pytest

from _hostile import assert_linear, worst_cases
from hybridlm import untrusted
from hybridlm.data.chat import AssistantStream, parse_assistant, scan_tool_calls
from hybridlm.eval.ruler import score_prediction
from hybridlm.infer.tools import ToolCallStream, parse_tool_calls
from hybridlm.rl import judge, verifiers
from hybridlm.rl.environments import (
    ArithmeticEnvironment,
    CalculatorEnvironment,
    LowEffortEnvironment,
)

# -------------------------------------------------------------- the bounded JSON reader


def test_json_shape_counts_outside_strings_only():
    cases = {
        b"": (0, 0),
        b"1": (0, 0),
        b"{}": (1, 1),
        b"[[1], [[2]]]": (3, 5),
        b'{"a": "[[[[", "b": [{}]}': (3, 4),
        rb'{"a": "\"[[[\\", "b": []}': (2, 3),
        rb'["\\\"[", ["]"]]': (2, 3),
        b"[" * 50_000: (50_000, 50_000),
        b'"[[[': (0, 0),
    }
    for text, shape in cases.items():
        assert untrusted.json_shape(text) == shape, text[:40]
        assert untrusted.json_shape(text.decode()) == shape
    nested = [[{"a": ['"[\\', {"b": []}]}]]
    assert untrusted.json_shape(json.dumps(nested))[0] == 6


def test_loads_refuses_what_is_over_a_limit_with_one_error_type():
    limits = untrusted.JSONLimits(max_depth=4, max_chars=100, max_items=5)
    assert untrusted.loads('{"a": [1, {"b": [2]}]}', limits) == {"a": [1, {"b": [2]}]}
    bad = {
        "[" * 5 + "]" * 5: "nests arrays/objects 5 deep",
        "[1,2,3,4,5,6]": "more than 5 values",
        '"' + "x" * 200 + '"': "longer than 100",
        "[NaN]": "not a JSON number",
        "{nope": "not valid JSON",
    }
    for text, message in bad.items():
        with pytest.raises(untrusted.UntrustedJSONError, match=message):
            untrusted.loads(text, limits)
    with pytest.raises(untrusted.UntrustedJSONError, match="not valid JSON"):
        untrusted.loads("9" * 5000)  # Python refuses integers of more than 4300 digits
    # nested far past the interpreter's recursion limit: a clear error, never RecursionError
    for deep in ("[" * 100_000, '{"a":' * 50_000):
        with pytest.raises(untrusted.UntrustedJSONError, match="deep"):
            untrusted.loads(deep)


def test_decode_prefix_reads_a_value_inside_a_longer_text():
    text = 'x <tool_call>{"name": "f", "arguments": {"s": "}</tool_call>"}}</tool_call> tail'
    start = text.index("{")
    value, end = untrusted.decode_prefix(text, start)
    assert value == {"name": "f", "arguments": {"s": "}</tool_call>"}}
    assert text[end:].startswith("</tool_call>")
    long_string = '{"s": "' + "y" * 100_000 + '"} rest'  # grows past the first window
    assert untrusted.decode_prefix(long_string, 0) == ({"s": "y" * 100_000}, 100_009)
    assert untrusted.decode_prefix("[12345678] x", 0) == ([12345678], 10)
    assert untrusted.decode_prefix("12345678", 0) == (12345678, 8)  # a number up to the end
    for bad, message in (("[" * 5000, "deep"), ('{"a": 1', "not valid"), ("{x", "not valid")):
        with pytest.raises(untrusted.UntrustedJSONError, match=message):
            untrusted.decode_prefix(bad, 0)


def test_clip_quotes_a_short_prefix():
    assert untrusted.clip("abc") == "'abc'"
    out = untrusted.clip("x" * 10_000_000)
    assert len(out) <= 80 and out.endswith("...")
    assert untrusted.clip(7) == "7"


def test_json_inside_strings_is_bounded_where_it_is_read():
    deep = "[" * 100_000 + "]" * 100_000
    # generated text: a deep tool call stays content, as any call that does not parse
    text = f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>'
    assert parse_assistant(text)["content"] == text
    assert parse_tool_calls(text) == (text, [])
    # a client's (or policy's) tool-call arguments string: one ValueError naming the message
    from hybridlm.data.chat import render

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
    with pytest.raises(ValueError, match=r"messages\[1\]: the arguments of tool call 'f': nests"):
        render(msgs)
    # an episode's tool step: the model reads one error line and the episode goes on
    env = CalculatorEnvironment(num_problems=2, digits=2)
    ep = env.episode()
    ep.reset(env[0])
    call = {"id": "c", "function": {"name": "calculator", "arguments": deep}}
    out = ep.step({"content": "", "tool_calls": [call]})
    assert not out.done and out.observation[0]["content"].startswith("error: the arguments")
    assert len(out.observation[0]["content"]) < 200


# -------------------------------------------------------------- parsers of policy output

_TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]


def _stream(text: str) -> None:  # the server's streamed parsing, in 64 KiB deltas
    s = ToolCallStream(_TOOLS)
    for i in range(0, len(text), 1 << 16):
        s.feed(text[i : i + (1 << 16)])
    s.finish()
    a = AssistantStream()
    for i in range(0, len(text), 1 << 16):
        a.update(text[: i + (1 << 16)], final=i + (1 << 16) >= len(text))


def _tool_step(text: str) -> None:  # a policy's tool call: arguments, name and final reply
    env = CalculatorEnvironment(num_problems=2, digits=2)
    for call in (
        {"id": "c", "function": {"name": "calculator", "arguments": text}},
        {"id": "c", "function": {"name": text, "arguments": "{}"}},
        {"id": "c", "function": {"name": "calculator", "arguments": {"expression": text}}},
    ):
        ep = env.episode()
        ep.reset(env[0])
        out = ep.step({"content": "", "tool_calls": [call]})
        assert len(out.observation[0]["content"]) < 1000  # no echo of the input
    ep = env.episode()
    ep.reset(env[0])
    ep.step({"content": text, "text": text})


_LOW_EFFORT = LowEffortEnvironment(ArithmeticEnvironment(num_problems=4), fraction=1.0)
_MATH = verifiers.MathVerifier()

PARSERS = {
    "parse_assistant": parse_assistant,
    "scan_tool_calls (streaming prefix)": lambda t: scan_tool_calls(t, final=False),
    "parse_tool_calls": lambda t: parse_tool_calls(t, _TOOLS),
    "ToolCallStream / AssistantStream": _stream,
    "untrusted.loads": lambda t: untrusted.loads(t, untrusted.JSONLimits(max_chars=1 << 22)),
    "untrusted.decode_prefix": lambda t: untrusted.decode_prefix(t, 0),
    "answer_text": verifiers.answer_text,
    "parse_number": verifiers.parse_number,
    "extract_gsm8k_answer": verifiers.extract_gsm8k_answer,
    "extract_boxed": verifiers.extract_boxed,
    "extract_math_answer": verifiers.extract_math_answer,
    "math_equal": lambda t: verifiers.math_equal(t, "\\frac{1}{2}"),
    "GSM8KVerifier": lambda t: verifiers.GSM8KVerifier()(t, "42"),
    "MathVerifier": lambda t: _MATH(t, "\\boxed{\\frac{1}{2}}"),
    "extract_code / CodeVerifier.program": verifiers.CodeVerifier(sandbox=object()).program,
    "judge.parse_rating": judge.parse_rating,
    "judge.parse_preference": judge.parse_preference,
    "ToolEpisode.step": _tool_step,
    "LowEffortEnvironment.score": lambda t: _LOW_EFFORT.score(_LOW_EFFORT[0], t),
    "ruler.score_prediction": lambda t: score_prediction(t, ("1234567", "blue-whale")),
}
# may refuse their input: timed, not required to accept
_REFUSE = {"untrusted.loads", "untrusted.decode_prefix"}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_parsers_of_policy_output_are_linear(name):
    cases = worst_cases(64 << 10, pairs=24)
    assert_linear(PARSERS[name], cases, budget_s=0.25, allow_errors=name in _REFUSE)


@pytest.mark.slow
def test_parsers_of_policy_output_take_under_a_second_per_mebibyte():
    cases = worst_cases(1 << 20, pairs=16, seed=1)
    worst = {
        name: assert_linear(fn, cases, budget_s=1.0, allow_errors=name in _REFUSE)
        for name, fn in PARSERS.items()
    }
    print("\nworst seconds per MiB over", len(cases), "cases of 1 MiB:")
    for name, s in sorted(worst.items(), key=lambda kv: -kv[1]):
        print(f"  {s:7.3f}  {name}")


def test_the_reported_cases_stay_fast():
    """The inputs that stalled the environment server for 18-52 s, at 1 MiB."""
    n = 1 << 20
    cases = [
        ("'answer' + spaces (adjacent \\s* backtracking)", "The answer is" + " " * n + "x"),
        ("\\boxed{ x n (rescan per match)", "\\boxed{" * (n // 7)),
        ("\\boxed + spaces", "\\boxed" + " " * n),
        ("<tool_call> x n unclosed", "<tool_call>" * (n // 11)),
        ("<tool_call>{ x n", "<tool_call>{" * (n // 12)),
        ("``` + a long line", "```" + "a" * n),
        ("'1' x n (a rating's number run)", "1" * n),
        ("final answer + newlines", "final answer" + "\n" * n + "x"),
    ]
    fns = [verifiers.GSM8KVerifier().__call__, _MATH.__call__, judge.parse_rating]
    for fn in fns:
        args = (lambda t, f=fn: f(t, "42")) if fn is not judge.parse_rating else fn
        assert_linear(args, cases, budget_s=1.0)
    assert_linear(verifiers.CodeVerifier(sandbox=object()).program, cases, budget_s=1.0)


# -------------------------------------------------------------- what the verifiers say


def test_reasons_are_categories_without_the_ground_truth():
    gsm, math = verifiers.GSM8KVerifier(), verifiers.MathVerifier(use_math_verify=False)
    wrong = gsm("The answer is 3.", "167436654")
    assert (wrong.value, wrong.reason) == (0.0, "wrong answer")
    assert "167436654" in wrong.detail  # for the environment's owner
    assert gsm("The answer is 167436654.", "167436654").reason == "correct"
    assert gsm("no digits", "5").reason == "no number in the answer"
    r = math("so \\boxed{7}", "\\frac{22}{7}")
    assert r.reason == "wrong answer" and "22" not in r.reason and "22" in r.detail
    huge = "The answer is " + "9" * 100_000
    r = gsm(huge, "5")
    assert r.reason == "wrong answer" and len(r.detail) < 200  # no echo of the completion


def test_boxed_and_fences_read_as_before():
    assert verifiers.extract_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert verifiers.extract_boxed("\\boxed{1} then \\boxed{2") == "1"  # unclosed: not it
    assert verifiers.extract_boxed("\\boxed 5 apples") == "5"
    assert verifiers.extract_boxed("\\boxed $x$") is None  # used to raise AttributeError
    assert verifiers.extract_boxed("\\fbox{ {a} }") == "{a}"
    assert verifiers.extract_boxed("no box") is None
    text = "x\n```python\na = 1\n```\n```js\nb\n```\n```\nc = 3\n"
    assert verifiers.code_blocks(text) == [("python", "a = 1\n"), ("js", "b\n"), ("", "c = 3")]
    assert verifiers.extract_code(text) == "c = 3"
    assert verifiers.extract_code("```py\nd\n```") == "d\n"
    assert verifiers.extract_code("``` no newline") == "``` no newline"
