"""Tool calling (infer.tools): constrained generation gives parseable calls to offered tools with
valid arguments; the one-shot and streaming parsers agree at every split; clear errors."""

import json
import random

import pytest

pytest.importorskip("llguidance")

from hybridlm.data.chat import STOP, render  # noqa: E402
from hybridlm.data.tokenizer import ByteTokenizer  # noqa: E402
from hybridlm.infer.tools import (  # noqa: E402
    ToolCallStream,
    parse_tool_calls,
    tool_call_constraint,
    tool_choice_name,
    tool_parameters,
)
from test_grammar import check_schema, constrained_sample, tiny_lm, trained_bpe  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["C", "F"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 6},
        "top": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
    },
    "required": ["query", "top"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: arguments are {}
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "now": {"type": "object"}}


@pytest.fixture(scope="module")
def models():
    byte, bpe = ByteTokenizer(), trained_bpe()
    return {
        "byte": (byte, tiny_lm(byte.vocab_size + 6)),
        "bpe": (bpe, tiny_lm(bpe.vocab_size + 6)),
    }


def _prompt(tok) -> list[int]:
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    return tok.encode(render(msgs, tools=TOOLS))


def _calls(tok, ids: list[int], tools=TOOLS) -> tuple[str | None, list[dict]]:
    text = tok.decode(ids).split(STOP, 1)[0]  # the server cuts at the stop string
    return parse_tool_calls(text, tools)


# --------------------------------------------------------------------------- constraint
@pytest.mark.parametrize("name", ["byte", "bpe"])
def test_required_tool_choice_gives_valid_calls(models, name):
    tok, model = models[name]
    V = model.config.vocab_size
    factory = tool_call_constraint(tok, TOOLS, "required", vocab_size=V)
    prompt = _prompt(tok)
    runs = constrained_sample(model, factory, prompt, n=8, temperature=1.0, seed=2, max_new=600)
    runs += constrained_sample(model, factory, prompt[:-1], n=1, temperature=0.0, max_new=600)
    counts, names = [], set()
    for ids, finished in runs:
        assert finished, tok.decode(ids)
        if name == "bpe":  # the tags are the single tokens the model was trained on
            assert ids[0] == tok.token_to_id("<tool_call>")
            assert ids[-1] in (tok.eos_id, tok.token_to_id(STOP))
        content, calls = _calls(tok, ids)
        assert content is None and calls, tok.decode(ids)
        for call in calls:
            assert call["type"] == "function" and call["id"].startswith("call_")
            fn = call["function"]
            check_schema(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
            names.add(fn["name"])
        counts.append(len(calls))
    assert names == set(SCHEMAS) and max(counts) > 1, (names, counts)  # parallel calls happen


@pytest.mark.parametrize("name", ["byte", "bpe"])
def test_named_tool_choice_and_single_call(models, name):
    tok, model = models[name]
    V = model.config.vocab_size
    choice = {"type": "function", "function": {"name": "search"}}
    for factory in (
        tool_call_constraint(tok, TOOLS, choice, vocab_size=V),
        tool_call_constraint(tok, TOOLS, choice, vocab_size=V, parallel_tool_calls=False),
    ):
        for ids, finished in constrained_sample(model, factory, _prompt(tok), n=6, temperature=1):
            content, calls = _calls(tok, ids)
            assert finished and content is None and len(calls) == 1
            assert calls[0]["function"]["name"] == "search"
            check_schema(json.loads(calls[0]["function"]["arguments"]), SEARCH)
    single = tool_call_constraint(tok, TOOLS, "required", vocab_size=V, parallel_tool_calls=False)
    for ids, _ in constrained_sample(model, single, _prompt(tok), n=6, temperature=1.0, seed=3):
        assert len(_calls(tok, ids)[1]) == 1


def test_auto_and_none_are_unconstrained_and_errors_are_clear():
    tok = ByteTokenizer()
    assert tool_call_constraint(tok, TOOLS, "auto", vocab_size=258) is None
    assert tool_call_constraint(tok, TOOLS, "none", vocab_size=258) is None
    assert tool_call_constraint(tok, TOOLS, None, vocab_size=258) is None  # OpenAI's default
    assert tool_choice_name({"type": "function", "function": {"name": "now"}}, ["now"]) == "now"
    assert list(tool_parameters(TOOLS)) == ["get_weather", "search", "now"]
    bad = [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice names"),
        (TOOLS, "sometimes", "tool_choice must be"),
        (TOOLS, {"function": "now"}, "tool_choice must be"),
        ([], "required", "at least one tool"),
        ({"type": "function"}, "auto", "tools must be a list"),
        ([{"type": "function", "function": {}}], "auto", r"tools\[0\].function needs"),
        ([{"type": "retrieval"}], "auto", r"tools\[0\] must be"),
        ([{"function": {"name": "a b"}}], "auto", "letters, digits"),
        ([TOOLS[2], TOOLS[2]], "auto", "repeated"),
        ([{"function": {"name": "f", "parameters": []}}], "auto", "JSON schema object"),
        (
            [{"function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
            "required",
            "^tools: unsupported or invalid parameters schema: .*not",
        ),
    ]
    for tools, choice, match in bad:
        with pytest.raises(ValueError, match=match):
            tool_call_constraint(tok, tools, choice, vocab_size=258)


# --------------------------------------------------------------------------- parsing
def _fn(call: dict) -> tuple[str, dict]:
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_parse_tool_calls_by_hand():
    text = (
        "Let me check.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>\n'
        '<tool_call>{"name": "now"}</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": {"query": "a</tool_call>b", "top": [true]}}'
        "</tool_call>"
    )
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check."
    assert [_fn(c) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("now", {}),
        ("search", {"query": "a</tool_call>b", "top": [True]}),  # the first close that parses
    ]
    assert len({c["id"] for c in calls}) == 3
    assert calls[0]["function"]["arguments"] == '{"city": "Oslo", "days": 2}'
    # only whitespace around the calls: no content
    assert parse_tool_calls('\n<tool_call>{"name": "now"}</tool_call>\n ', TOOLS)[0] is None
    # malformed blocks stay in the content as written: bad JSON, unknown tool, arguments that are
    # not an object, a block that never closes
    for block in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>',
        '<tool_call>["now"]</tool_call>',
        '<tool_call>{"name": "now"}',
    ):
        text = f'Hi {block} and\n<tool_call>{{"name": "now"}}</tool_call> bye'
        content, calls = parse_tool_calls(text, TOOLS)
        assert content == f"Hi {block} and bye" and [_fn(c) for c in calls] == [("now", {})]
    # without tools any name is a call
    assert _fn(parse_tool_calls('<tool_call>{"name": "rm_rf"}</tool_call>')[1][0])[0] == "rm_rf"
    assert parse_tool_calls("plain text", TOOLS) == ("plain text", [])
    assert parse_tool_calls("", TOOLS) == ("", [])


SAMPLES = [
    "Let me check.\n"
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>\n'
    '<tool_call>{"name": "now"}</tool_call>',
    ' \n<tool_call>{"name": "search", "arguments": {"query": "x</tool_call>", "top": [false]}}'
    "</tool_call>\n\nDone <tool_call> is a tag; <tool_call>{bad}</tool_call> stays.\n",
    'a<tool_call>{"name": "rm"}</tool_call>\n<tool_call>  {"name": "now"} </tool_call>\n<tool_',
    "\n\n",
    "no calls at all, just <tool text\n",
]


def _streamed(pieces: list[str]) -> tuple[str, list]:
    stream, content, calls = ToolCallStream(TOOLS), "", []
    for delta in [*(stream.feed(p) for p in pieces), stream.finish()]:
        assert set(delta) <= {"content", "tool_calls"}
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            assert call["index"] == len(calls) and call["id"].startswith("call_")
            calls.append((call["type"], _fn(call)))
    return content, calls


def _one_shot(text: str) -> tuple[str, list]:
    content, calls = parse_tool_calls(text, TOOLS)
    return content or "", [(c["type"], _fn(c)) for c in calls]


def test_stream_agrees_with_one_shot_at_every_split():
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", '{"name": "now"}', "\n", " ", "x", "<tool",
              "_call>", '{"name": "search", "arguments": {"query": "</tool_call>", "top": []}}',
              "{", "}", "</tool", '<tool_call>{"name": "now"}</tool_call>',
              '<tool_call>{"name": "rm"}</tool_call>']  # fmt: skip
    fuzz = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 7))) for _ in range(600)]
    for text in SAMPLES + fuzz:
        expected = _one_shot(text)
        assert _streamed([text]) == expected, text
        assert _streamed(list(text)) == expected, text  # one character at a time
        for i in range(len(text) + 1):
            assert _streamed([text[:i], text[i:]]) == expected, (text, i)
    assert sum(bool(_one_shot(t)[1]) for t in fuzz) > 100  # the fuzz makes calls too


def test_stream_releases_content_early_and_holds_only_what_may_be_a_call():
    stream = ToolCallStream(TOOLS)
    assert stream.feed("Hello") == {"content": "Hello"}
    assert stream.feed(" wor") == {"content": " wor"}
    assert stream.feed("ld\n<tool") == {"content": "ld"}  # "\n<tool" may open a call
    assert stream.feed('_call>{"name": "now", "argu') == {}
    delta = stream.feed('ments": {}}</tool_call>\nok')
    assert delta["content"] == "\nok" and [_fn(c) for c in delta["tool_calls"]] == [("now", {})]
    assert stream.feed(" <tool_call>prose") == {"content": " <tool_call>prose"}  # not JSON: text
    assert stream.finish() == {}
    blank = ToolCallStream(TOOLS)  # leading whitespace waits: it is no content before a call
    assert blank.feed("\n ") == {} and blank.finish() == {"content": "\n "}
