"""Structured outputs and tool calling on `hybridlm serve`, through the official `openai`
client: `response_format` json_object / json_schema, `tools` with `tool_choice` "required", a
named function, "auto" and "none", streamed and not; the replies are valid by construction
(`infer.grammar` / `infer.tools` constraints) even from a random tiny model.

The model is the training tests' tiny-super (d_model 64, byte vocabulary) so that the long
tool prompts (the tools section of the system message) decode quickly; 127.0.0.1 only."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from _tiny import tiny_train_model  # noqa: E402
from hybridlm.data.chat import render  # noqa: E402
from hybridlm.data.tokenizer import ByteTokenizer  # noqa: E402
from hybridlm.infer.engine import Engine  # noqa: E402
from hybridlm.infer.server import serve_in_background  # noqa: E402
from hybridlm.model.model import HybridLM  # noqa: E402

MODEL = "tiny"
pytestmark = pytest.mark.usefixtures("one_thread")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def srv():
    tok = ByteTokenizer()
    model = HybridLM(tiny_train_model(mtp=True), seed=0).eval()
    engine = Engine(model, tok, max_batch_size=4, max_model_len=2048)
    with serve_in_background(engine, MODEL) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        http = httpx.Client(timeout=60)
        yield SimpleNamespace(url=url, engine=engine, tok=tok, client=client, http=http)
        http.close()


def _chat(srv, **kw):
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 80, "temperature": 0.0, **kw}
    return srv.client.chat.completions.create(**kw)


def _check_call(call, allowed=("get_weather", "get_time")) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 8
    args = json.loads(call.function.arguments)
    assert call.function.name in allowed
    if call.function.name == "get_weather":
        assert set(args) == {"city", "days"} and len(args["city"]) <= 6
        assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
    else:
        assert args in ({"zone": "UTC"}, {"zone": "CET"})
    return args


def test_json_object_and_json_schema(srv):
    # greedy, the random model writes one endless key; a bias towards "}" (added before the
    # grammar's mask) lets it close the object, and the mask still makes it valid JSON
    for bias in ({"125": 5}, {"125": 100}):
        res = _chat(srv, response_format={"type": "json_object"}, logit_bias=bias)
        assert res.choices[0].finish_reason == "stop"
        assert json.loads(res.choices[0].message.content) == {}
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 5},
            "sure": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["answer", "sure", "n"],
        "additionalProperties": False,
    }
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "reply", "schema": schema, "strict": True},
    }
    for temperature in (0.0, 1.0):
        res = _chat(srv, response_format=fmt, temperature=temperature, seed=3, n=2)
        for choice in res.choices:  # each of n choices has its own constraint
            value = json.loads(choice.message.content)
            assert list(value) == ["answer", "sure", "n"] and len(value["answer"]) <= 5
            assert isinstance(value["sure"], bool) and 0 <= value["n"] <= 99
            assert choice.finish_reason == "stop"
    streamed = _chat(srv, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == _chat(srv, response_format=fmt).choices[0].message.content


def test_vllm_structured_outputs_on_both_endpoints(srv):
    """vLLM's `structured_outputs` extra field (regex, choice, Lark grammar, JSON schema) and
    OpenAI's response_format, on completions as on chat."""

    def complete(**extra):
        kw = {"model": MODEL, "prompt": "Answer:", "max_tokens": 40, "temperature": 0.0}
        return srv.client.completions.create(**kw, extra_body=extra).choices[0]

    out = complete(structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.text) and out.finish_reason == "stop"
    choices = ["red", "green", "blue"]
    assert complete(structured_outputs={"choice": choices}).text in choices
    lark = 'start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/'
    assert re.fullmatch(r"x=[1-9][0-9]?;", complete(structured_outputs={"grammar": lark}).text)
    schema = {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}
    for extra in (
        {"structured_outputs": {"json": schema}},
        {"structured_outputs": {"json": json.dumps(schema)}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": schema},
            }
        },
    ):
        value = json.loads(complete(**extra).text)
        assert len(value) == 2 and all(isinstance(v, bool) for v in value), extra
    chat = _chat(srv, extra_body={"structured_outputs": {"choice": choices}})
    assert chat.choices[0].message.content in choices
    n = complete(structured_outputs={"regex": "[ab]{4}"}, n=1)
    assert re.fullmatch("[ab]{4}", n.text)


def test_required_and_named_tool_choice(srv):
    res = _chat(srv, tools=TOOLS, tool_choice="required", max_tokens=200)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)
    named = {"type": "function", "function": {"name": "get_time"}}
    res = _chat(srv, tools=TOOLS, tool_choice=named, max_tokens=200)
    (call,) = res.choices[0].message.tool_calls
    assert _check_call(call, allowed=("get_time",)) and res.choices[0].finish_reason == "tool_calls"
    # streamed: OpenAI's tool_calls deltas (index, id, type, function), same calls
    chunks = list(_chat(srv, tools=TOOLS, tool_choice=named, max_tokens=200, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0] and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_time" and deltas[0].type == "function"
    assert deltas[0].function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the tools are in the prompt: /tokenize with them counts what the request used
    root = srv.url.removesuffix("/v1")
    counted = srv.http.post(root + "/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    assert counted["count"] == res.usage.prompt_tokens
    assert counted["tokens"] == srv.tok.encode(render(ASK, tools=TOOLS))
    single = _chat(
        srv, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200
    )
    assert len(single.choices[0].message.tool_calls) == 1


def test_auto_parses_offered_calls_and_none_does_not(srv, monkeypatch):
    """ "auto" is unconstrained: what the model writes is parsed, calls to offered tools become
    tool_calls, anything else stays content; "none" keeps the text as it is. The engine's text
    is scripted (a random model does not write calls)."""
    reply = (
        "Checking.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
        '\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    )
    real = srv.engine.step

    def scripted():
        outs = real()
        for out in outs:
            n = len(out.token_ids)
            out.text = reply if out.finished else reply[: 9 * n]
            if out.finished:
                out.finish_reason = "stop"
        return outs

    monkeypatch.setattr(srv.engine, "step", scripted)
    kw = {"tools": TOOLS, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    msg = _chat(srv, **kw).choices[0].message
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}
    assert msg.content == 'Checking.\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    chunks = list(_chat(srv, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == msg.content
    (streamed,) = [t for d in deltas for t in (d.tool_calls or [])]
    assert streamed.function.arguments == call.function.arguments and streamed.index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = _chat(srv, tool_choice="none", **kw).choices[0]
    assert plain.message.content == reply and not plain.message.tool_calls
    assert plain.finish_reason == "stop"
    chunks = [c.choices[0] for c in _chat(srv, tool_choice="none", stream=True, **kw) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == reply
    assert not any(c.delta.tool_calls for c in chunks) and chunks[-1].finish_reason == "stop"


BAD = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
         "tool_choice": "required"},
        "tools",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
        "response_format",
    ),
    ({"response_format": {"type": "json_object"}, "speculative": 2}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "speculative": 2}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(?=a)"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
    (
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "structured_outputs",
    ),
    ({"structured_outputs": {"regex": "a"}, "speculative": 1}, "structured_outputs"),
    ({"stop_token_ids": [9999], "response_format": {"type": "json_object"}}, "stop_token_ids"),
]  # fmt: skip


@pytest.mark.parametrize("body,param", BAD)
def test_bad_structured_requests_name_the_field(srv, body, param):
    res = srv.http.post(srv.url + "/chat/completions", json={"messages": ASK, **body})
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == param, res.text
