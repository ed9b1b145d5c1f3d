"""Chat template: exact ChatML text, assistant spans for loss masks, parse-back, clear errors."""

import json
import random

import pytest

from hybridlm.data.chat import (
    CHAT_TEMPLATE,
    STOP,
    AssistantStream,
    parse_assistant,
    render,
    render_with_spans,
    tools_section,
)
from hybridlm.data.tokenizer import ByteTokenizer

CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Add them.\nTwo and two."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Oslo?"}],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "-3 °C"},
    {"role": "assistant", "content": "Cold: −3 °C."},
]


def test_render_is_chatml():
    text = render(CONVO[:3])
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd them.\nTwo and two.\n</think>\n4<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(CONVO[:2], add_generation_prompt=False).endswith("2?<|im_end|>\n")
    assert STOP == "<|im_end|>"
    full = render(CONVO, add_generation_prompt=False)
    assert "user\nWeather in\nOslo?<|im_end|>" in full
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>' in full
    assert "<|im_start|>tool\n-3 °C<|im_end|>" in full
    assert render([{"role": "developer", "content": "x"}]).startswith("<|im_start|>system\nx")


def test_spans_cover_exactly_the_assistant_turns():
    text, spans = render_with_spans(CONVO)
    bodies = [text[s:e] for s, e in spans]
    assert len(bodies) == 3 and all(b.endswith(STOP) for b in bodies)
    assert bodies[0] == "<think>\nAdd them.\nTwo and two.\n</think>\n4" + STOP
    assert bodies[2] == "Cold: −3 °C." + STOP
    # everything outside the spans is template or non-assistant text
    for (s, _), (_, prev_e) in zip(spans[1:], spans[:-1], strict=True):
        assert "<|im_start|>assistant\n" in text[prev_e:s]
    text2, exact = render_with_spans(CONVO, include_stop=False)
    assert text2 == text
    assert [text[s:e] for s, e in exact] == [b[: -len(STOP)] for b in bodies]
    # a span starts right after the assistant header
    assert all(text[:s].endswith("<|im_start|>assistant\n") for s, _ in spans)
    assert render_with_spans(CONVO[:2])[1] == []


def test_parse_assistant_round_trips():
    text, spans = render_with_spans(CONVO, include_stop=False)
    parsed = [parse_assistant(text[s:e]) for s, e in spans]
    assert parsed[0] == {
        "role": "assistant",
        "reasoning_content": "Add them.\nTwo and two.",
        "content": "4",
    }
    assert parsed[1]["content"] is None
    call = parsed[1]["tool_calls"][0]["function"]
    assert call["name"] == "weather" and json.loads(call["arguments"]) == {"city": "Oslo"}
    assert parsed[2] == {"role": "assistant", "content": "Cold: −3 °C."}
    # re-rendering the parsed messages gives the same text
    again = list(CONVO)
    for idx, msg in zip((2, 4, 6), parsed, strict=True):
        again[idx] = msg
    assert render(again, add_generation_prompt=False) == text
    assert parse_assistant("hi<|im_end|>junk") == {"role": "assistant", "content": "hi"}
    bad = parse_assistant("x\n<tool_call>{not json}</tool_call>")
    assert "tool_calls" not in bad and "{not json}" in bad["content"]
    # generation cut off mid-thought: all reasoning, no content
    assert parse_assistant("<think>\nstill going") == {
        "role": "assistant",
        "reasoning_content": "still going",
        "content": "",
    }


def _stream_fields(text: str) -> tuple[str, str, list]:
    """Feed `text` one character at a time, then final; concatenate the deltas."""
    stream, reasoning, content = AssistantStream(), "", ""
    for i in range(1, len(text) + 1):
        d = stream.update(text[:i])
        assert "tool_calls" not in d
        reasoning += d.get("reasoning_content", "")
        content += d.get("content", "")
    d = stream.update(text, final=True)
    reasoning += d.get("reasoning_content", "")
    return reasoning, content + d.get("content", ""), d.get("tool_calls", [])


def test_stream_parser_agrees_with_parse_assistant_at_every_split():
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "\n", " ", "a", "<", "<thi", "</th", "<tool_call>",
              "</tool_call>", '{"name": "f"}', "<tool_ca"]  # fmt: skip
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 8))) for _ in range(2000)]
    for text in texts:
        msg = parse_assistant(text)
        assert _stream_fields(text) == (
            msg.get("reasoning_content") or "",
            msg.get("content") or "",
            msg.get("tool_calls", []),
        ), text
    # nothing that may become a tag is released early
    stream = AssistantStream()
    assert stream.update(" <thi") == {}
    assert stream.update(" <think>\nab</thi") == {"reasoning_content": "ab"}
    assert stream.update(" <think>\nab</think>\nok\n<tool") == {"content": "ok"}


@pytest.mark.parametrize(
    "messages,match",
    [
        ([{"role": "wizard", "content": "x"}], "unknown role 'wizard'"),
        ([{"content": "x"}], "unknown role None"),
        ([{"role": "user"}], r"messages\[0\]: a user message needs 'content'"),
        ([{"role": "assistant"}], "needs 'content' or 'tool_calls'"),
        ([], "at least one message"),
        ("hello", "must be a list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"role": "user", "content": 3}], "must be a string or a list of text parts"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "only text parts",
        ),
        (
            [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}],
            "only assistant messages can have tool_calls",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
            r"messages\[0\]: the arguments of tool call 'f': not valid JSON",
        ),
        ([{"role": "assistant", "tool_calls": [{"function": {}}]}], "needs"),
    ],
)
def test_errors_are_actionable(messages, match):
    with pytest.raises(ValueError, match=match):
        render(messages)


# ------------------------------------------------------------------------- tools
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Forecast for a city — in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]


def test_render_offers_tools_in_the_system_message():
    section = tools_section(TOOLS)
    assert section.startswith("# Tools\n\nYou may call one or more functions")
    lines = section.split("\n")
    start = lines.index("<tools>")
    assert [json.loads(x) for x in lines[start + 1 : start + 3]] == TOOLS
    assert lines[start + 3] == "</tools>"
    assert section.endswith(
        '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
    )
    # appended to the leading system message, or in a system turn of its own
    text = render(CONVO, tools=TOOLS)
    assert text.startswith(
        f"<|im_start|>system\nBe brief.\n\n{section}<|im_end|>\n<|im_start|>user"
    )
    assert text.endswith(render(CONVO)[len("<|im_start|>system\nBe brief.<|im_end|>\n") :])
    no_system = render(CONVO[1:2], tools=TOOLS)
    assert no_system == f"<|im_start|>system\n{section}<|im_end|>\n" + render(CONVO[1:2])
    empty_system = [{"role": "developer", "content": ""}, CONVO[1]]
    assert render(empty_system, tools=TOOLS) == no_system
    # spans still cover exactly the assistant bodies
    text, spans = render_with_spans(CONVO, tools=TOOLS)
    assert [text[s:e] for s, e in spans][2] == "Cold: −3 °C." + STOP
    assert render(CONVO, tools=[]) == render(CONVO, tools=None) == render(CONVO)
    for bad, match in (
        ({"type": "function"}, "tools must be a list"),
        (["weather"], r"tools\[0\]: a tool needs"),
        ([{"type": "function", "function": {"description": "x"}}], r"tools\[0\]"),
    ):
        with pytest.raises(ValueError, match=match):
            render(CONVO, tools=bad)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """transformers' view of a saved tokenizer: the chat template as exported checkpoints ship
    it."""
    transformers = pytest.importorskip("transformers")
    path = ByteTokenizer().save(tmp_path_factory.mktemp("byte"))
    return transformers.AutoTokenizer.from_pretrained(path)


def test_chat_template_renders_tools_as_render_does(hf_tokenizer):
    """`apply_chat_template(messages, tools=tools)` == bos + `render(messages, tools=tools)`, for
    tool definitions with tool calls and tool results in the conversation."""
    hf = hf_tokenizer
    assert hf.chat_template == CHAT_TEMPLATE
    convs = [CONVO, CONVO[1:], [{"role": "developer", "content": ""}, *CONVO[1:3]]]
    convs.append([{"role": "system", "content": [{"type": "text", "text": "A"}]}, *CONVO[1:]])
    for conv in convs:
        for tools in (TOOLS, TOOLS[:1], None, []):
            for gp in (False, True):
                ours = render(conv, add_generation_prompt=gp, tools=tools)
                theirs = hf.apply_chat_template(
                    conv, tools=tools, add_generation_prompt=gp, tokenize=False
                )
                assert theirs == hf.bos_token + ours, (conv, tools, gp)


def test_chat_template_rejects_the_tools_render_rejects(hf_tokenizer):
    from jinja2.exceptions import TemplateError

    # (transformers itself refuses a tool that is not a dict)
    flat = {"type": "function", "name": "weather"}  # the Responses API's form, not Chat's
    for bad in ([flat], [{"type": "function", "function": {"description": "x"}}]):
        with pytest.raises(ValueError, match=r"tools\[0\]"):
            render(CONVO, tools=bad)
        with pytest.raises(TemplateError, match=r"tools\[0\]"):
            hf_tokenizer.apply_chat_template(CONVO, tools=bad, tokenize=False)
