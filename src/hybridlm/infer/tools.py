"""Tool calling for the OpenAI-compatible server: parse tool calls out of generated text (whole
or streamed) and constrain generation to valid calls.

The chat format (`hybridlm.data.chat`, Hermes / Qwen2.5 style) renders the offered tools in the
system message (a `<tools>` block of their JSON definitions, `chat.tools_section`) and each
assistant tool call as one line

    <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>

`parse_tool_calls(text, tools)` extracts such blocks with the chat format's one scanner
(`data.chat.scan_tool_calls`, linear in the text, JSON read by the bounded reader): the JSON
inside must be an object with a `name` among the offered tools and an object `arguments`
(absent: `{}`). The content is the text around the calls, less the newline before each call; a
block that does not parse or names an unknown tool stays in the content as written. The body is
read as one JSON object, so a `</tool_call>` inside a string argument does not end the call.
`ToolCallStream` gives the same result for text that arrives in pieces.

`tool_call_constraint` turns OpenAI's `tool_choice` into a grammar (`infer.grammar`):

- `"required"`: one or more calls (one when `parallel_tool_calls` is false), each to an offered
  tool with arguments valid for its `parameters` schema, newline-separated, then the end;
- `{"type": "function", "function": {"name": ...}}`: exactly one call to that tool;
- `"auto"` and `"none"`: no constraint (None). With `"none"` the tools are still rendered in the
  prompt (vLLM's default; OpenAI does not say) and the server should not parse tool calls: the
  text is the answer.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ..data.chat import STOP, TOOL_CLOSE, TOOL_OPEN, scan_tool_calls
from .grammar import (
    JSON_OPTIONS,
    GrammarFactory,
    _llguidance,
    end_token_ids,
    llg_tokenizer,
    token_literal,
)

__all__ = [
    "ToolCallStream",
    "parse_tool_calls",
    "tool_call_constraint",
    "tool_choice_name",
    "tool_parameters",
]

# OpenAI's rule for function names; it also keeps names safe inside grammar literals
_NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# "Omitting parameters defines a function with an empty parameter list" (OpenAI API reference)
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_parameters(tools: Any) -> dict[str, dict[str, Any]]:
    """Validate OpenAI `tools` (`[{"type": "function", "function": {"name", "description",
    "parameters"}}]`) and return name -> parameters schema, in order. ValueError (starting with
    `tools`) for anything else, a repeated name or a name OpenAI would reject."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}}")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.function needs a string 'name'")
        name = fn["name"]
        if not _NAME_RE.fullmatch(name):
            raise ValueError(
                f"{where}.function.name {name!r} must be 1-64 letters, digits, '_' or '-'"
            )
        if name in out:
            raise ValueError(f"{where}.function.name {name!r} is repeated")
        params = fn.get("parameters")
        if params is None:
            params = _NO_PARAMETERS
        if not isinstance(params, Mapping):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
        out[name] = dict(params)
    return out


def tool_choice_name(tool_choice: Any, names: Sequence[str]) -> str | None:
    """Validate OpenAI `tool_choice` against the offered tool names: `"auto"`, `"none"` and
    `"required"` come back as they are, a named function as its name. ValueError (starting with
    `tool_choice`) otherwise."""
    if tool_choice is None:
        return "auto"
    if tool_choice in ("auto", "none", "required"):
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs at least one tool in tools")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if (
        not isinstance(fn, Mapping)
        or tool_choice.get("type", "function") != "function"
        or not isinstance(fn.get("name"), str)
    ):
        raise ValueError(
            "tool_choice must be 'auto', 'none', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    if fn["name"] not in names:
        raise ValueError(f"tool_choice names function {fn['name']!r}, which is not in tools")
    return fn["name"]


# ---------------------------------------------------------------------------- parsing
def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # OpenAI's shape: call_ + 24 characters


def parse_tool_calls(
    text: str, tools: Sequence[Mapping[str, Any]] | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated assistant text into (content, OpenAI tool calls). `tools` (OpenAI
    `tools`) restricts calls to the offered names; None accepts any name. The content is None
    when there are calls and nothing but whitespace around them. Each call is
    `{"id": "call_...", "type": "function", "function": {"name", "arguments": JSON string}}`."""
    names = None if tools is None else set(tool_parameters(tools))
    items, _ = scan_tool_calls(text, names, final=True)
    content = "".join(x for x in items if isinstance(x, str))
    calls = [
        {"id": _new_id(), "type": "function", "function": {"name": n, "arguments": a}}
        for n, a in (x for x in items if isinstance(x, tuple))
    ]
    return (None if calls and not content.strip() else content), calls


class ToolCallStream:
    """`parse_tool_calls` for text that arrives in pieces: `feed(delta)` returns the OpenAI
    streaming `delta` fields that became certain, `{"content": str}` and/or
    `{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}` (each call
    whole, in one delta), `{}` when nothing did; `finish()` returns the rest. Text that may
    start a `<tool_call>` (or be the newline before one) is held back, as is a block until
    its JSON and closing tag are complete (a block whose JSON never completes holds the rest of
    the stream: it is content only at `finish()`), and content until it has more than
    whitespace (whitespace around calls is no content). The content deltas concatenate to
    `parse_tool_calls(text)[0]` (`''` for None) and the calls equal its calls up to their ids."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self._names = None if tools is None else set(tool_parameters(tools))
        self._buf = ""  # text not yet decided
        self._blank = ""  # content released so far, held while it is only whitespace
        self._started = False  # some content has been sent
        self._calls = 0

    def _emit(self, items: list[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        content, calls = [], []
        for x in items:
            if isinstance(x, tuple):
                name, args = x
                calls.append(
                    {
                        "index": self._calls,
                        "id": _new_id(),
                        "type": "function",
                        "function": {"name": name, "arguments": args},
                    }
                )
                self._calls += 1
            elif self._started:
                content.append(x)
            else:
                self._blank += x
                if self._blank.strip():
                    content.append(self._blank)
                    self._blank, self._started = "", True
        if "".join(content):
            out["content"] = "".join(content)
        if calls:
            out["tool_calls"] = calls
        return out

    def feed(self, delta: str) -> dict[str, Any]:
        self._buf += delta
        items, end = scan_tool_calls(self._buf, self._names, final=False)
        self._buf = self._buf[end:]
        return self._emit(items)

    def finish(self) -> dict[str, Any]:
        items, _ = scan_tool_calls(self._buf, self._names, final=True)
        self._buf = ""
        out = self._emit(items)
        if self._blank and not self._calls:  # whitespace-only content, no calls: it is content
            out["content"] = self._blank
        self._blank = ""
        return out


# ---------------------------------------------------------------------------- constraint
def tool_call_constraint(
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]],
    tool_choice: Any,
    *,
    vocab_size: int,
    parallel_tool_calls: bool = True,
    stop_token_ids: Sequence[int] | None = None,
) -> GrammarFactory | None:
    """The factory of constraints that force tool calls, or None (`"auto"`, `"none"`; see the
    module docstring). ValueError (starting with `tools` or `tool_choice`) for invalid tools, a
    tool choice naming no offered tool, or a `parameters` schema the grammar engine rejects.

    The grammar is the chat format's: `<tool_call>{"name": "<name>", "arguments": <JSON valid
    for that tool's parameters>}</tool_call>` per call, calls separated by a newline, then an
    end token (`grammar.end_token_ids`). `<tool_call>`, `</tool_call>` and `<|im_end|>` are
    single tokens where the tokenizer has them (the project's BPE), else text (the byte
    tokenizer, which then may also write `<|im_end|>` to end)."""
    params = tool_parameters(tools)
    choice = tool_choice_name(tool_choice, list(params))
    if choice in ("auto", "none"):
        return None
    if choice != "required":
        params = {choice: params[choice]}
    lltok = llg_tokenizer(tokenizer, end_token_ids(tokenizer, stop_token_ids or ()))
    open_, close = token_literal(tokenizer, TOOL_OPEN), token_literal(tokenizer, TOOL_CLOSE)
    stop = token_literal(tokenizer, STOP)
    # a one-token stop is an end token already; a spelt one may end the turn as text
    end = f" {stop}?" if stop.startswith('"') else ""
    many = choice == "required" and parallel_tool_calls
    lines = [
        "%llguidance {}",
        f"start: calls{end}",
        'calls: call ("\\n" call)*' if many else "calls: call",
        "call: " + " | ".join(f"call_{k}" for k in range(len(params))),
    ]
    llg = _llguidance()
    for k, (name, schema) in enumerate(params.items()):
        head = json.dumps(f'{{"name": "{name}", "arguments": ')  # the name is [a-zA-Z0-9_-]
        lines.append(f'call_{k}: {open_} {head} args_{k} "}}" {close}')
        # x-guidance is read from the top of each inlined schema: json.dumps spelling
        schema = {"x-guidance": JSON_OPTIONS, **schema}
        try:
            text = json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(f"tools: the parameters of {name!r} are not JSON: {err}") from None
        lines.append(f"args_{k}: %json {text}")
    grammar = llg.LLMatcher.grammar_from_lark("\n".join(lines) + "\n")
    try:
        return GrammarFactory(lltok, grammar, vocab_size=vocab_size, what="parameters schema")
    except ValueError as err:
        raise ValueError(f"tools: {err}") from None
