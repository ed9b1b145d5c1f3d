"""ChatML-style chat template: render OpenAI-format messages to text, and back for assistant turns.

    <|im_start|>system
    You are a helpful assistant.<|im_end|>
    <|im_start|>user
    What is 2 + 2?<|im_end|>
    <|im_start|>assistant
    <think>
    Add them.
    </think>
    4<|im_end|>
    <|im_start|>assistant            <- the generation prompt (add_generation_prompt=True)

Roles are `system`, `user`, `assistant` and `tool` (`developer`, the newer OpenAI name for
`system`, is rendered as `system`). An assistant turn's body is, each part on its own line and
each optional: a reasoning block `<think>\\n...\\n</think>` (from `reasoning_content`), the
content, and one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` line per tool call
(OpenAI `tool_calls`). A turn ends with `STOP` (`<|im_end|>`), the stop string for generation.

Tools (OpenAI `tools`, rendered as Qwen2.5 / Hermes do): `render(..., tools=tools)` appends
`tools_section(tools)` to the first system message (or opens the conversation with a system
turn holding it): a `<tools>` block with one JSON tool definition per line, and how to call
them, in this same `<tool_call>` line format.

`render_with_spans` also returns the character spans of every assistant body (plus its `STOP`
by default): the tokens a post-training loss is computed on. Spans are in *characters* of the
returned text; a byte tokenizer needs `len(text[:i].encode())` to turn them into token offsets.

`CHAT_TEMPLATE` is the same rendering as a Jinja chat template, for transformers'
`tokenizer.apply_chat_template` (and the servers that use it); every saved tokenizer carries it.
It renders `bos_token + render(messages, tools=tools)`, so
`apply_chat_template(messages, tokenize=True)` equals `tokenizer.encode(render(messages))` token
for token (tests/test_hf_checkpoint.py; tools: tests/test_chat_template.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..untrusted import JSONLimits, UntrustedJSONError, clip, decode_prefix, loads

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
STOP = IM_END  # generation of an assistant turn stops at this string
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
ROLES = ("system", "user", "assistant", "tool")
_ROLE_ALIASES = {"developer": "system"}

Message = Mapping[str, Any]


@dataclass(frozen=True)
class Turn:
    """One validated message: its role and its rendered body (the text between the header and
    `STOP`)."""

    role: str
    body: str

    @property
    def is_assistant(self) -> bool:
        return self.role == "assistant"


def _text(content: Any, where: str) -> str:
    """OpenAI content: a string or a list of `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(
                    f"{where}: content part {j} has type {kind!r}; only text parts "
                    '({"type": "text", "text": "..."}) are supported'
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}: content part {j} needs a string 'text'")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ValueError(
        f"{where}: content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _tool_call_json(call: Any, where: str) -> str:
    """`{"name", "arguments"}` as compact-ish JSON, from OpenAI's `{"function": {...}}` form or
    the flat form; `arguments` may be a JSON string (OpenAI) or an object."""
    if not isinstance(call, Mapping):
        raise ValueError(f"{where}: each tool call must be an object, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f'{where}: a tool call needs {{"function": {{"name": "...", ...}}}}')
    args = fn.get("arguments", {})
    if isinstance(args, str):
        what = f"{where}: the arguments of tool call {clip(fn['name'], 40)}"
        args = loads(args, TOOL_CALL_LIMITS, what=what) if args.strip() else {}
    return json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)


def assistant_body(
    content: str | None, reasoning: str | None = None, tool_calls: Sequence[Any] = ()
) -> str:
    """The text of an assistant turn between its header and `STOP` (each part optional)."""
    parts = []
    if reasoning:
        parts.append(f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}")
    if content:
        parts.append(content)
    for call in tool_calls:
        parts.append(f"{TOOL_OPEN}{_tool_call_json(call, 'assistant')}{TOOL_CLOSE}")
    return "\n".join(parts)


def _utf8(body: str, where: str) -> str:
    """`body`, which must encode as UTF-8: JSON's `\\ud800` escapes decode to lone surrogates,
    which no tokenizer can encode."""
    try:
        body.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{where}: text is not valid UTF-8 (a lone surrogate at character {err.start})"
        ) from None
    return body


TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags, one call per line:\n"
    '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
)


def tools_section(tools: Sequence[Any]) -> str:
    """The system-message text that offers `tools` (OpenAI `[{"type": "function", "function":
    {"name", "description", "parameters"}}]`), each definition as `json.dumps` writes it (the
    chat template's `tojson`); Qwen2.5's wording, with this format's one-line calls."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError("tools must be a list of tool definitions")
    lines = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(
                f'tools[{i}]: a tool needs {{"type": "function", "function": {{"name": ...}}}}'
            )
        lines.append("\n" + json.dumps(tool, ensure_ascii=False))
    return TOOLS_INTRO + "".join(lines) + TOOLS_OUTRO


def _system_with(first: str, section: str) -> str:
    return f"{first}\n\n{section}" if first else section


def _with_tools(turns: list[Turn], tools: Sequence[Any] | None) -> list[Turn]:
    """`turns` with the tools section appended to the leading system turn (or in a new one)."""
    if not tools:
        return turns
    section = tools_section(tools)
    if turns[0].role == "system":
        return [Turn("system", _system_with(turns[0].body, section)), *turns[1:]]
    return [Turn("system", section), *turns]


def offer_tools(messages: Sequence[Message], tools: Sequence[Any]) -> list[dict[str, Any]]:
    """`messages` with the tools section written into the system message, as `render(...,
    tools=tools)` shows it: a conversation that needs no `tools` argument (SFT data of tool
    use renders exactly as the rollouts that offer the same tools)."""
    msgs = [dict(m) for m in messages]
    section = tools_section(tools)
    if msgs and msgs[0].get("role") == "system":
        msgs[0] = {"role": "system", "content": _system_with(validate(msgs[:1])[0].body, section)}
    else:
        msgs.insert(0, {"role": "system", "content": section})
    return msgs


def validate(messages: Sequence[Message]) -> list[Turn]:
    """Check roles and contents; returns the turns with their rendered bodies."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not messages:
        raise ValueError("messages must contain at least one message")
    turns = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        role = msg.get("role")
        role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {msg.get('role')!r}; expected one of {ROLES}")
        content = msg.get("content")
        tool_calls = msg.get("tool_calls") or []
        reasoning = msg.get("reasoning_content")
        if reasoning is None:  # a null field is an absent one (as transformers treats it)
            reasoning = msg.get("reasoning")
        if role != "assistant":
            if tool_calls:
                raise ValueError(f"{where}: only assistant messages can have tool_calls")
            if content is None:
                raise ValueError(f"{where}: a {role} message needs 'content'")
            turns.append(Turn(role, _utf8(_text(content, where), where)))
            continue
        if content is None and not tool_calls:
            raise ValueError(f"{where}: an assistant message needs 'content' or 'tool_calls'")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"{where}: reasoning_content must be a string")
        if not isinstance(tool_calls, Sequence) or isinstance(tool_calls, (str, Mapping)):
            raise ValueError(f"{where}: tool_calls must be a list of tool calls")
        text = None if content is None else _text(content, where)
        try:
            body = assistant_body(text, reasoning, tool_calls)
        except ValueError as err:
            raise ValueError(str(err).replace("assistant", where, 1)) from None
        turns.append(Turn(role, _utf8(body, where)))
    return turns


def render_with_spans(
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    include_stop: bool = True,
    tools: Sequence[Any] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the `(start, end)` character span of every assistant body, in order.

    With `include_stop` (default) each span also covers the turn's `STOP`, so a loss mask over
    the spans teaches the model to end its turn; without it a span is exactly the body.
    `tools` (OpenAI tool definitions) are offered in the system message (`tools_section`).
    """
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for turn in _with_tools(validate(messages), tools):
        header = f"{IM_START}{turn.role}\n"
        out.append(header + turn.body + IM_END + "\n")
        start = pos + len(header)
        end = start + len(turn.body) + (len(IM_END) if include_stop else 0)
        if turn.is_assistant:
            spans.append((start, end))
        pos += len(out[-1])
    if add_generation_prompt:
        out.append(generation_prompt())
    return "".join(out), spans


def render(
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    *,
    tools: Sequence[Any] | None = None,
) -> str:
    """The conversation as text; with `add_generation_prompt` it ends with the assistant header,
    ready for the model to continue until `STOP`. `tools`: see `render_with_spans`."""
    return render_with_spans(messages, add_generation_prompt=add_generation_prompt, tools=tools)[0]


def generation_prompt() -> str:
    """The header that opens an assistant turn."""
    return f"{IM_START}assistant\n"


def continuation(messages: Sequence[Message]) -> str:
    """The text that follows a generated assistant turn ending in `STOP` when `messages` (tool
    results, a user's follow-up) come next and the assistant answers again: the end of the
    turn's line, their turns, and the generation prompt. Appended to the turn's own tokens, the
    conversation equals `render` of it (multi-turn rollouts never re-tokenise what was
    generated)."""
    return "\n" + render(messages, add_generation_prompt=True)


# `render` as a Jinja chat template (transformers' `apply_chat_template`: `messages`, `tools`,
# `add_generation_prompt`, `bos_token`, `raise_exception`, `tojson` without HTML escaping).
# Every tag trims the template's own whitespace, so the output does not depend on the
# environment's trim_blocks / lstrip_blocks. Jinja cannot parse JSON: a tool call whose
# `arguments` is a JSON *string* is inserted as it is (stripped; blank is `{}`) where `render`
# re-serialises it with `json.dumps`; the two agree whenever the string is
# `json.dumps(arguments, ensure_ascii=False)`, which is what `parse_assistant` (and so the server)
# returns. Pass arguments as an object to be independent of their spelling.
CHAT_TEMPLATE = """\
{%- macro render_text(content, where) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if part is not mapping or part['type'] != 'text' -%}
        {{- raise_exception(where ~ ': only text content parts are supported') -}}
      {%- endif -%}
      {%- if part['text'] is not string -%}
        {{- raise_exception(where ~ ': content part ' ~ loop.index0 ~ " needs a string 'text'") -}}
      {%- endif -%}
      {{- ('\\n' if not loop.first else '') ~ part['text'] -}}
    {%- endfor -%}
  {%- else -%}
    {{- raise_exception(where ~ ': content must be a string or a list of text parts') -}}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token if bos_token else '' -}}
{%- set tools_text = '' -%}
{%- if tools is defined and tools -%}
  {%- if tools is string or tools is mapping or tools is not iterable -%}
    {{- raise_exception('tools must be a list of tool definitions') -}}
  {%- endif -%}
  {%- set tns = namespace(text='') -%}
  {%- for tool in tools -%}
    {%- if tool is not mapping or tool['function'] is not mapping
      or tool['function']['name'] is not string or not tool['function']['name'] -%}
      {{- raise_exception('tools[' ~ loop.index0 ~ ']: a tool needs {"type": "function", '
        ~ '"function": {"name": ...}}') -}}
    {%- endif -%}
    {%- set tns.text = tns.text ~ '\\n' ~ (tool | tojson) -%}
  {%- endfor -%}
  {%- set tools_text = @TOOLS_INTRO@ ~ tns.text ~ @TOOLS_OUTRO@ -%}
  {%- if not messages or messages[0]['role'] not in ['system', 'developer'] -%}
    {{- '<|im_start|>system\\n' ~ tools_text ~ '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endif -%}
{%- for message in messages -%}
  {%- set where = 'messages[' ~ loop.index0 ~ ']' -%}
  {%- set role = 'system' if message['role'] == 'developer' else message['role'] -%}
  {%- if role not in ['system', 'user', 'assistant', 'tool'] -%}
    {{- raise_exception(where ~ ': unknown role ' ~ role) -}}
  {%- endif -%}
  {%- if role != 'assistant' -%}
    {%- if message['tool_calls'] -%}
      {{- raise_exception(where ~ ': only assistant messages can have tool_calls') -}}
    {%- endif -%}
    {%- if message['content'] is not defined -%}
      {{- raise_exception(where ~ ': a ' ~ role ~ " message needs 'content'") -}}
    {%- endif -%}
    {%- set text = render_text(message['content'], where) -%}
    {%- if loop.first and tools_text and role == 'system' -%}
      {%- set text = (text ~ '\\n\\n' if text else '') ~ tools_text -%}
    {%- endif -%}
    {{- '<|im_start|>' ~ role ~ '\\n' ~ text ~ '<|im_end|>\\n' -}}
  {%- else -%}
    {%- set calls = message['tool_calls'] if message['tool_calls'] else [] -%}
    {%- if message['content'] is not defined and not calls -%}
      {{- raise_exception(where ~ ": an assistant message needs 'content' or 'tool_calls'") -}}
    {%- endif -%}
    {%- if message['reasoning_content'] is defined -%}
      {%- set reasoning = message['reasoning_content'] -%}
    {%- else -%}
      {%- set reasoning = message['reasoning'] -%}
    {%- endif -%}
    {%- if reasoning is defined and reasoning is not none and reasoning is not string -%}
      {{- raise_exception(where ~ ': reasoning_content must be a string') -}}
    {%- endif -%}
    {%- if calls is string or calls is mapping -%}
      {{- raise_exception(where ~ ': tool_calls must be a list of tool calls') -}}
    {%- endif -%}
    {%- set ns = namespace(body='') -%}
    {%- if reasoning -%}
      {%- set ns.body = '<think>\\n' ~ reasoning ~ '\\n</think>' -%}
    {%- endif -%}
    {%- if message['content'] is defined -%}
      {%- set text = render_text(message['content'], where) -%}
      {%- if text -%}
        {%- set ns.body = ns.body ~ ('\\n' if ns.body else '') ~ text -%}
      {%- endif -%}
    {%- endif -%}
    {%- for call in calls -%}
      {%- if call is not mapping -%}
        {{- raise_exception(where ~ ': each tool call must be an object') -}}
      {%- endif -%}
      {%- set fn = call['function'] if call['function'] is defined else call -%}
      {%- if fn is not mapping or fn['name'] is not string or not fn['name'] -%}
        {{- raise_exception(where ~ ': a tool call needs {"function": {"name": "...", ...}}') -}}
      {%- endif -%}
      {%- set args = fn['arguments'] if fn['arguments'] is defined else {} -%}
      {%- if args is string -%}
        {%- set args = args.strip() if args.strip() else '{}' -%}
      {%- else -%}
        {%- set args = args | tojson -%}
      {%- endif -%}
      {%- set call_text = '<tool_call>{"name": ' ~ (fn['name'] | tojson) ~ ', "arguments": '
        ~ args ~ '}</tool_call>' -%}
      {%- set ns.body = ns.body ~ ('\\n' if ns.body else '') ~ call_text -%}
    {%- endfor -%}
    {{- '<|im_start|>assistant\\n' ~ ns.body ~ '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""
# one source for the tools wording: the Python constants as Jinja string literals (ASCII, so
# JSON's escapes are Jinja's)
CHAT_TEMPLATE = CHAT_TEMPLATE.replace("@TOOLS_INTRO@", json.dumps(TOOLS_INTRO)).replace(
    "@TOOLS_OUTRO@", json.dumps(TOOLS_OUTRO)
)


# An unclosed reasoning block (generation stopped mid-thought, e.g. at max_tokens) is all
# reasoning: the content is empty.
_THINK_RE = re.compile(
    rf"^\s*{re.escape(THINK_OPEN)}\n?(.*?)(?:\n?{re.escape(THINK_CLOSE)}\n?|\Z)", re.S
)
# what one tool call's JSON may hold (generated or sent by a client): `untrusted`'s limits
TOOL_CALL_LIMITS = JSONLimits(max_depth=64, max_chars=4 << 20, max_items=1 << 20)
_JSON_WS = re.compile(r"[ \t\n\r]*+")  # JSON's whitespace
_OBJECT_START = re.compile(r'\{[ \t\n\r]*+["}]')  # an object's first member, or its end
UNDECIDED = object()  # `scan_tool_calls`: a block that later text may still decide


def _tool_call_block(text: str, start: int, names: Any, final: bool) -> Any:
    """The call opened just before `start`: (name, arguments as JSON text, end of its close
    tag), None when it cannot become a valid call, `UNDECIDED` when later text may still
    decide.

    A valid body is one JSON object (JSON whitespace around it) with a string `name` (one of
    `names` unless None) and an object `arguments` (absent: `{}`), read by the bounded reader
    (`untrusted.decode_prefix`, `TOOL_CALL_LIMITS`). An object is complete at its closing
    brace, so the close tag must follow it, and a `</tool_call>` inside a string argument does
    not end the call. Every step reads forward from `start` and stops where the JSON does, so
    scanning a text costs time linear in its length however many tags it opens."""
    i = _JSON_WS.match(text, start).end()
    if i == len(text):
        return None if final else UNDECIDED
    if text[i] != "{":
        return None
    if not _OBJECT_START.match(text, i):  # cheap refusal of most text that is not a call
        undecided = not final and _JSON_WS.match(text, i + 1).end() == len(text)
        return UNDECIDED if undecided else None
    try:
        obj, end = decode_prefix(text, i, TOOL_CALL_LIMITS, what="a tool call")
    except UntrustedJSONError:  # invalid, too deep, or not complete yet
        return None if final else UNDECIDED
    end = _JSON_WS.match(text, end).end()
    if not text.startswith(TOOL_CLOSE, end):
        undecided = not final and TOOL_CLOSE.startswith(text[end : end + len(TOOL_CLOSE)])
        return UNDECIDED if undecided and len(text) - end < len(TOOL_CLOSE) else None
    if not isinstance(obj.get("name"), str) or (names is not None and obj["name"] not in names):
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False), end + len(TOOL_CLOSE)


def scan_tool_calls(
    text: str, names: Any = None, *, final: bool = True
) -> tuple[list[str | tuple[str, str]], int]:
    """The content pieces and tool calls `(name, arguments JSON)` of assistant text, in order,
    up to the returned position: all of it when `final`, else the prefix that no later text can
    change (streaming). `names` restricts calls to those tool names (None: any). The newline
    before a call is not content; a `<tool_call>` block that is not a valid call
    (`_tool_call_block`) stays in the content as written. Linear in `len(text)`."""
    items: list[str | tuple[str, str]] = []
    pos = 0
    while True:
        i = text.find(TOOL_OPEN, pos)
        if i < 0:
            end = len(text) if final else len(text) - _partial_suffix(text[pos:], TOOL_OPEN)
            items.append(text[pos:end])
            return items, end
        found = _tool_call_block(text, i + len(TOOL_OPEN), names, final)
        before = i - 1 if i > pos and text[i - 1] == "\n" else i  # the newline before a call
        if found is UNDECIDED:
            items.append(text[pos:before])
            return items, before
        if found is None:  # stays in the content; look for calls after its open tag
            items.append(text[pos : i + len(TOOL_OPEN)])
            pos = i + len(TOOL_OPEN)
            continue
        items += [text[pos:before], found[:2]]
        pos = found[2]


def parse_assistant(text: str) -> dict[str, Any]:
    """Split generated assistant text (up to `STOP`) into an OpenAI-style message:
    `content`, and `reasoning_content` / `tool_calls` when present (`scan_tool_calls`: blocks
    that are not valid calls stay in the content); a reasoning block that never closes is all
    reasoning. Inverse of `assistant_body` for the parts it renders. Linear in `len(text)`: it
    reads policy and client text."""
    text = text.split(STOP, 1)[0]
    msg: dict[str, Any] = {"role": "assistant"}
    m = _THINK_RE.match(text)
    if m:
        msg["reasoning_content"] = m.group(1)
        text = text[m.end() :]
    items, _ = scan_tool_calls(text)
    calls = [
        {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": args}}
        for k, (name, args) in enumerate(x for x in items if isinstance(x, tuple))
    ]
    content = "".join(x for x in items if isinstance(x, str))
    msg["content"] = content if content or not calls else None
    if calls:
        msg["tool_calls"] = calls
    return msg


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that may be the start of `marker` or of
    `marker` after a newline (`"\\n" + marker`)."""
    for n in range(min(len(marker), len(text)), 0, -1):
        tail = text[-n:]
        if ("\n" + marker).startswith(tail) or (n < len(marker) and marker.startswith(tail)):
            return n
    return 0


class AssistantStream:
    """`parse_assistant` for text that arrives piece by piece (streamed generation).

    `update(text, final)` takes the whole assistant text so far and returns what became certain
    since the last call: `{"reasoning_content": str, "content": str, "tool_calls": list}` (only
    the non-empty parts). Nothing that may still turn out to be a tag is released: a leading
    prefix of `<think>`, a trailing prefix of `\\n</think>`, and everything from the first
    `<tool_call>` (tool calls are parsed when the text is final). The deltas concatenate to the
    fields of `parse_assistant(final_text)`."""

    def __init__(self) -> None:
        self._sent = {"reasoning_content": "", "content": ""}

    def _certain(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) prefixes of a non-final text that no later text can change."""
        head = text.lstrip()
        if len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
            return "", ""  # may still become a reasoning block
        if head.startswith(THINK_OPEN):
            body = head[len(THINK_OPEN) :]
            end = body.find(THINK_CLOSE)
            if end < 0:  # still thinking; the newline before the close tag is not reasoning
                if body == "\n"[: len(body)]:
                    return "", ""
                body = body[1:] if body.startswith("\n") else body
                return body[: len(body) - _partial_suffix(body, THINK_CLOSE)], ""
            text = body[end + len(THINK_CLOSE) :]
            if text == "\n"[: len(text)]:
                return parse_assistant(head).get("reasoning_content", ""), ""
            reasoning = parse_assistant(head[: len(THINK_OPEN) + end + len(THINK_CLOSE)])
            text = text[1:] if text.startswith("\n") else text
            return reasoning.get("reasoning_content", ""), self._content_prefix(text)
        return "", self._content_prefix(text)

    @staticmethod
    def _content_prefix(text: str) -> str:
        cut = text.find(TOOL_OPEN)
        if cut >= 0:
            text = text[:cut]
            return text[:-1] if text.endswith("\n") else text
        return text[: len(text) - _partial_suffix(text, TOOL_OPEN)]

    def update(self, text: str, final: bool = False) -> dict[str, Any]:
        calls: list[dict[str, Any]] = []
        if final:
            msg = parse_assistant(text)
            fields = {
                "reasoning_content": msg.get("reasoning_content") or "",
                "content": msg.get("content") or "",
            }
            calls = msg.get("tool_calls", [])
        else:
            r, c = self._certain(text.split(STOP, 1)[0])
            fields = {"reasoning_content": r, "content": c}
        out: dict[str, Any] = {}
        for key, value in fields.items():
            sent = self._sent[key]
            # released text is final: later text only extends it (tests check every split)
            assert value.startswith(sent), (key, value, sent)
            if len(value) > len(sent):
                out[key] = value[len(sent) :]
                self._sent[key] = value
        if calls:
            out["tool_calls"] = calls
        return out
