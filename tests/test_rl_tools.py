"""RL tools: the calculator is exact, refuses what is not arithmetic (names, calls, attributes),
and refuses results over its size limits before computing them; every refusal is an "error:"
line for the model, never an exception; its schema is a valid OpenAI tool."""

import json
import time

import pytest

from hybridlm.infer.tools import parse_tool_calls, tool_parameters
from hybridlm.rl.tools import Calculator


@pytest.mark.parametrize(
    "expression,result",
    [
        ("48213 * 90317", str(48213 * 90317)),
        ("(12 + 7) * 3", "57"),
        ("2 + 3 * 4 ** 2", "50"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("10 / 4", "2.5"),
        ("10 / 5", "2"),
        ("2 ^ 10", "1024"),
        ("6 × 7 ÷ 2", "21"),
        ("0.1 + 0.2", "0.3"),
        ("2 ** -2", "0.25"),
        ("+-+5", "-5"),
        ("10 ** 999 // 10 ** 998", "10"),
        ("10 ** 900 / 10 ** 899", "10"),  # exact quotients of huge integers stay exact
        ("  3  ", "3"),
    ],
)
def test_calculator_is_exact(expression, result):
    assert Calculator()({"expression": expression}) == result


@pytest.mark.parametrize(
    "arguments,message",
    [
        ({"expression": "__import__('os').system('true')"}, "only numbers"),
        ({"expression": "().__class__"}, "only numbers"),
        ({"expression": "x + 1"}, "only numbers"),
        ({"expression": "'a' * 3"}, "only numbers"),
        ({"expression": "True + 1"}, "only numbers"),
        ({"expression": "3j"}, "only numbers"),
        ({"expression": "[1][0]"}, "only numbers"),
        ({"expression": "1 < 2"}, "only numbers"),
        ({"expression": "1 / 0"}, "division by zero"),
        ({"expression": "5 % 0"}, "division by zero"),
        ({"expression": "9 ** 9 ** 9"}, "more than 1000 digits"),
        ({"expression": "10 ** 1000"}, "more than 1000 digits"),
        ({"expression": "10 ** 600 * 10 ** 600"}, "more than 1000 digits"),
        ({"expression": "10 ** 999 / 7"}, "too large"),  # not exact: a float overflows
        ({"expression": "2.0 ** 5000"}, "too large"),
        ({"expression": "1e308 * 10"}, "not a finite number"),
        ({"expression": "(-8) ** 0.5"}, "not a real number"),
        ({"expression": "1 +"}, "cannot parse"),
        ({"expression": "(" * 200 + "1" + ")" * 200}, "longer than 256"),
        ({"expression": "12,345 + 1"}, "thousands separators"),
        ({"expression": ""}, "empty"),
        ({"expression": 5}, "must be a string"),
        ({"expr": "1"}, "unknown argument 'expr'"),
        (["1 + 1"], "JSON object"),
    ],
)
def test_calculator_refuses_with_an_error_line(arguments, message):
    start = time.perf_counter()
    out = Calculator()(arguments)
    assert out.startswith("error: ") and message in out, out
    assert time.perf_counter() - start < 1.0  # refused before computing anything large


def test_calculator_schema_and_a_parsed_call():
    calc = Calculator()
    tools = [calc.spec()]
    assert set(tool_parameters(tools)) == {"calculator"}
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>'
    _, calls = parse_tool_calls(text, tools)
    args = json.loads(calls[0]["function"]["arguments"])
    assert calc(args) == "56088"
    with pytest.raises(ValueError, match="max_digits"):
        Calculator(max_digits=10_000)


def test_search_ranks_the_matching_document_first():
    from hybridlm.rl.tools import Search

    corpus = [
        "The capital of Zorvania is Kelpton.",
        "Kelpton lies on the river Vessa.",
        "Mount Ubar is the highest peak of Zorvania.",
        "Bread is baked in ovens.",
    ]
    search = Search(corpus, k=2, max_doc_chars=20)
    out = search({"query": "capital of Zorvania"})
    assert out.splitlines()[0] == "[1] The capital of Zo..." and len(out.splitlines()) == 2
    assert search({"query": "the of is"}) == "no results"  # stopwords only
    assert search({"query": "xylophone"}) == "no results"
    assert search({"query": " "}).startswith("error: ")
    assert search({"query": "x" * 600}).startswith("error: ")
    assert search({"q": "x"}).startswith("error: unknown argument 'q'")
    assert set(tool_parameters([search.spec()])) == {"search"}
    with pytest.raises(ValueError, match="non-empty"):
        Search([])
