"""The OpenAI-compatible server's protocol (`infer.server`): the request bodies it reads and the
limits on them, the request models, how their fields become `SamplingParams`, and how errors,
JSON and SSE events are written.

Request fields (vLLM's OpenAI server is the reference; its extras go in the openai client's
`extra_body`):
- both endpoints: `model`, `max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n`, `stream`,
  `stream_options`, `user`, `presence_penalty` / `frequency_penalty` ([-2, 2], OpenAI's
  definition over the generated tokens), `logit_bias` ({"token id": [-100, 100]}, ids below the
  vocabulary size), `response_format` (`text`, `json_object`, `json_schema`); vLLM's `top_k`,
  `min_p`, `repetition_penalty` (> 0, over prompt and generated tokens), `min_tokens` (EOS,
  `stop_token_ids` and stop strings held off), `stop_token_ids` (finish reason "stop"),
  `ignore_eos`, `include_stop_str_in_output`, `return_tokens_as_token_ids` ("token_id:N" in
  log-probs), `structured_outputs` (exactly one of `json`, `regex`, `choice`, `grammar` (Lark,
  llguidance's dialect), `json_object`); and `speculative` (MTP draft length, 0 = off; also the
  header `X-Speculative-Draft-Length`), which refuses what the drafter cannot honour (log-probs,
  penalties, bias, min-p, min_tokens, structured outputs) with a 400 naming the field; the
  reasoning budget `max_thinking_tokens` (at most that many tokens inside the reply's `<think>`
  block, then the engine writes the closing tag and the answer follows) or OpenAI's
  `reasoning_effort` mapped to one (`REASONING_EFFORT`: none / minimal 0, low 256, medium 1024,
  high unbounded; an explicit `max_thinking_tokens` wins).
- completions: `prompt` (text, token ids, or lists of either), `echo`, `logprobs` (0-5: each
  token's log-prob, a {token: log-prob} dict of the k most likely plus the token itself, and
  `text_offset`, the token's character offset in the choice's text; with `echo` the prompt's
  tokens come first, the first one's log-prob None, also with `max_tokens` 0: lm-eval's
  `local-completions` log-likelihood requests). `logprobs` with `max_tokens` 0 needs `echo`.
- chat: `messages`, `max_completion_tokens`, `logprobs` + `top_logprobs` (0-20):
  `logprobs.content` = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}];
  `tools` (rendered in the system message by `data.chat`), `tool_choice` ("auto", "none",
  "required" or a named function: the last two force valid calls with an `infer.tools` grammar),
  `parallel_tool_calls` (false: at most one forced call).

`max_tokens` defaults to 16 for completions (as OpenAI's) and to the rest of the context for
chat; a prompt that leaves no room, or an explicit `max_tokens` beyond `max_model_len`, is a 400
`context_length_exceeded`. `n` (up to 128) and lists of prompts fan out to one engine request
per choice (choice j samples with `seed + j`; a structured-output constraint is built once and
instantiated per choice).
Fields this server cannot honour (`best_of` != n, `suffix`, the deprecated `functions` /
`function_call`) are rejected with a 400 rather than silently ignored; unknown fields are
ignored. Every error is OpenAI-shaped JSON, `{"error": {"message", "type", "param", "code"}}`,
with `param` naming the offending field.

Untrusted input: no request body can make the server answer 5xx.
- Size: at most `max_body_bytes` (default 4 MiB, `hybridlm serve --max-body-bytes`); a larger
  Content-Length is a 413 before anything is read, a chunked body is counted as it arrives (413),
  a POST with neither Content-Length nor chunked encoding is a 411. (A Content-Length that is not
  a number never reaches the app: uvicorn answers its own plain-text 400.)
- Encoding: the body must be UTF-8 (RFC 8259 §8.1), else 400 `invalid_json`. A string anywhere in
  it (prompt, messages, stop, any field, even an ignored one, or a key) that holds a lone UTF-16
  surrogate such as the escape `"\\ud800"` cannot be encoded as UTF-8 text: it is rejected with a
  400 `invalid_unicode` naming the field, never silently replaced.
- Shape: the body is read by the one bounded JSON reader (`hybridlm.untrusted`): arrays and
  objects nest at most `MAX_JSON_DEPTH` deep, checked on the raw text in linear time before
  parsing (so the decoder never recurses deeply); NaN / Infinity literals are not JSON (400
  `invalid_json`); the top level must be an object. JSON inside strings (tool-call arguments,
  `structured_outputs.json`) is read by the same reader under the same depth limit.
- Types are strict: `"5"` is not an integer and `1` is not a boolean (400 naming the field); a
  null field is an absent one. Ranges: `seed` is an int64 (-2**63 <= seed < 2**63, as vLLM;
  choice j uses seed + j, which torch's generator still takes), at most `MAX_STOP` stop strings,
  `n` (times the number of prompts) at most `MAX_CHOICES`, `max_tokens` within the context.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from .. import untrusted
from .sampling import SamplingParams

SPEC_HEADER = "X-Speculative-Draft-Length"
MAX_CHOICES = 128  # OpenAI's limit on n; also bounds prompts x n for list prompts
# 4 MiB holds a 1M-token context of text (about 4 bytes a token), the longest these models
# take; a bigger body is refused before it is read, so it costs no memory
DEFAULT_MAX_BODY_BYTES = 4 << 20
MAX_JSON_DEPTH = 64  # a chat request nests about 6 deep (tool-call arguments a few more)
# the body's size is checked as it is read (max_body_bytes); depth and values here
BODY_LIMITS = untrusted.JSONLimits(max_depth=MAX_JSON_DEPTH, max_chars=1 << 40, max_items=1 << 22)
# reasoning_effort -> the reasoning budget in tokens (None: unbounded)
REASONING_EFFORT: dict[str, int | None] = {
    "none": 0,
    "minimal": 0,
    "low": 256,
    "medium": 1024,
    "high": None,
}
MAX_STOP = 16  # OpenAI takes 4; each one is searched for after every token
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as vLLM
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on completions' logprobs


# ---------------------------------------------------------------------- errors
class APIError(Exception):
    """An error with an HTTP status, rendered as OpenAI's `{"error": {...}}` body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def schema_error(errors: list[dict[str, Any]]) -> APIError:
    """Pydantic's errors as one readable 400 naming the first bad field. A value that matches
    none of a union's forms (e.g. `prompt`) gets one message listing the forms."""
    by_field: dict[str, list[dict[str, Any]]] = {}
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        by_field.setdefault(loc[0] if loc else "", []).append({**e, "loc": loc})
    msgs = []
    for name, errs in by_field.items():
        forms = sorted({e["loc"][1] for e in errs if len(e["loc"]) > 1})
        if len(forms) > 1 and not any(f.isdigit() for f in forms):
            got = type(errs[0].get("input")).__name__
            msgs.append(f"{name}: got {got}, expected one of {', '.join(forms)}")
        else:
            where = ".".join(errs[0]["loc"])
            msgs.append(f"{where}: {errs[0].get('msg')}" if where else str(errs[0].get("msg")))
    first = next(iter(by_field), "")
    return bad("invalid request: " + "; ".join(msgs), param=first or None)


def short(value: Any, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters, for echoing client input in a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------- request bodies
async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes: a larger Content-Length is refused before reading, a
    chunked body as soon as it has sent too much (uvicorn discards the rest and keeps the
    connection)."""
    declared = request.headers.get("content-length")
    if declared is None:
        if "chunked" not in request.headers.get("transfer-encoding", "").lower():
            raise APIError(
                411,
                "a Content-Length header (or chunked encoding) is required",
                code="length_required",
            )
    elif not (declared.isascii() and declared.isdigit()):
        raise bad(f"Content-Length must be a non-negative integer, got {short(declared)}")
    elif len(declared) > 18 or int(declared) > limit:  # (int() refuses 4300+ digits)
        raise _too_large(limit)
    size, chunks = 0, []
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "client closed the request") from None
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes",
        code="request_too_large",
    )


_SURROGATE = re.compile(r"[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how one gets into a UTF-8 body


def _lone_surrogate(data: Any) -> tuple[str | None, str] | None:
    """(top-level field, path) of the first key or string value anywhere in `data` that holds a
    lone surrogate, or None. Iterative: the depth is bounded, but so is the stack here."""
    stack: list[tuple[Any, str, str | None]] = [(data, "", None)]
    while stack:
        obj, path, top = stack.pop()
        for key, value in obj.items() if isinstance(obj, dict) else enumerate(obj):
            if isinstance(key, int):
                where = f"{path}[{key}]"
            else:
                safe = key.encode("utf-8", "backslashreplace").decode()
                where = f"{path}.{safe}" if path else safe
            field = top if path else (None if _SURROGATE.search(key) else key)
            if (isinstance(key, str) and _SURROGATE.search(key)) or (
                isinstance(value, str) and _SURROGATE.search(value)
            ):
                return field, where
            if isinstance(value, (dict, list)):
                stack.append((value, where, field))
    return None


def parse_body(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or a 400 saying what is wrong with it (see the module
    docstring: UTF-8, nesting depth, no NaN, no lone surrogates)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise bad(
            f"the request body is not valid UTF-8 (byte 0x{body[err.start]:02x} at offset "
            f"{err.start}); send JSON encoded as UTF-8",
            code="invalid_json",
        ) from None
    try:
        data = untrusted.loads(text, BODY_LIMITS, what="the request body")
    except untrusted.UntrustedJSONError as err:  # syntax, depth, NaN, 4300+ digit integers
        raise bad(str(err), code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(body):
        found = _lone_surrogate(data)
        if found is not None:
            field, where = found
            raise bad(
                f"{where}: a string holds a lone UTF-16 surrogate (an escape like \\ud800 "
                "without its pair), which is not text; send valid Unicode",
                param=field,
                code="invalid_unicode",
            )
    return data


# ---------------------------------------------------------------------- request schemas
class RequestBody(BaseModel):
    """A request body. Unknown fields are ignored (as vLLM does); types are strict (as OpenAI's:
    `"5"` is not an integer, `1` not a boolean) and null means absent."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # clients send `"n": null` / `"stream": null` for "the default"
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    model: str | None = None


class GenerationRequest(RequestBody):
    """Fields shared by both generation endpoints."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    ignore_eos: bool = False
    speculative: int | None = None
    max_thinking_tokens: int | None = None
    reasoning_effort: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields (the openai client sends them with `extra_body`)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(GenerationRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None


class TokenizeRequest(RequestBody):
    """vLLM's `/tokenize`: a completions `prompt` or chat `messages`."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(RequestBody):
    """vLLM's `/detokenize`."""

    tokens: list[int]


# ---------------------------------------------------------------------- request -> params
def check_unsupported(req: GenerationRequest) -> None:
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, req.n):
            raise bad("best_of must equal n (best-of ranking is not supported)", param="best_of")
        if req.suffix:
            raise bad("suffix (insertion) is not supported", param="suffix")
    if isinstance(req, ChatCompletionRequest):
        for name in ("functions", "function_call"):
            if getattr(req, name):
                raise bad(
                    f"{name} (the deprecated function-calling API) is not supported; use tools "
                    "and tool_choice",
                    param=name,
                )


NO_SCHEMA = object()


def response_format_schema(fmt: dict[str, Any] | None) -> Any:
    """OpenAI `response_format` -> the JSON schema to constrain to (None: any JSON object), or
    `NO_SCHEMA` for plain text; a 400 naming `response_format` for anything else."""
    if fmt is None:
        return NO_SCHEMA
    kind = fmt.get("type")
    if kind == "text":
        return NO_SCHEMA
    if kind == "json_object":
        return None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad(
                "response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
                "response_format",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise bad("response_format json_schema.schema must be an object", "response_format")
        return schema
    raise bad(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {short(kind)}",
        "response_format",
    )


def draft_length(req: GenerationRequest, headers: Any) -> int:
    if req.speculative is not None:
        k, param = req.speculative, "speculative"
    else:
        raw = headers.get(SPEC_HEADER)
        if raw is None:
            return 0
        try:
            k = int(raw)
        except ValueError:
            raise bad(f"{SPEC_HEADER} must be an integer, got {raw!r}", SPEC_HEADER) from None
        param = SPEC_HEADER
    if not 0 <= k <= 16:
        raise bad(f"speculative draft length must be in [0, 16], got {k}", param)
    return k


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's `logit_bias` ({"token id": bias}) as {id: bias}, or a 400 naming it."""
    out: dict[int, float] = {}
    for key, bias in (raw or {}).items():
        if not (key.isascii() and key.isdigit()) or len(key) > 18 or int(key) >= vocab_size:
            raise bad(
                f"logit_bias keys must be token ids in [0, {vocab_size}) written as strings, "
                f"got {short(key)}",
                "logit_bias",
            )
        if not -100.0 <= bias <= 100.0:
            raise bad(f"logit_bias values must be in [-100, 100], got {short(bias)}", "logit_bias")
        out[int(key)] = float(bias)
    return out


def sampling_extras(req: GenerationRequest, vocab_size: int) -> dict[str, Any]:
    """The penalty / bias / min-p / min_tokens / stop_token_ids fields, validated (400 naming
    the field) as SamplingParams keyword arguments."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise bad(f"{name} must be in [-2, 2], got {short(value)}", name)
    rep = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    if not 0.0 < rep < float("inf"):
        raise bad(
            f"repetition_penalty must be > 0 (1 = off), got {short(rep)}", "repetition_penalty"
        )
    min_p = 0.0 if req.min_p is None else req.min_p
    if not 0.0 <= min_p <= 1.0:
        raise bad(f"min_p must be in [0, 1], got {short(min_p)}", "min_p")
    min_tokens = req.min_tokens or 0
    if min_tokens < 0:
        raise bad(f"min_tokens must be >= 0, got {short(min_tokens)}", "min_tokens")
    stop_ids = list(req.stop_token_ids or [])
    if len(stop_ids) > MAX_STOP:
        raise bad(
            f"at most {MAX_STOP} stop_token_ids are supported, got {len(stop_ids)}",
            "stop_token_ids",
        )
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise bad(f"stop_token_ids must be token ids in [0, {vocab_size})", "stop_token_ids")
    return {
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": rep,
        "min_p": min_p,
        "min_tokens": min_tokens,
        "stop_token_ids": stop_ids,
        "logit_bias": _logit_bias(req.logit_bias, vocab_size),
        "include_stop_str_in_output": req.include_stop_str_in_output,
    }


# a SamplingParams field that speculation cannot honour -> the request field that set it
_SPEC_FIELDS = {
    "top_logprobs": "logprobs",
    "prompt_logprobs": "logprobs",
    "constraint (structured output)": "response_format",
}


def sampling_params(
    req: GenerationRequest,
    *,
    max_tokens: int | None,
    prompt_len: int,
    max_model_len: int,
    default_max_tokens: int | None,
    extra_stop: list[str],
    speculative: int,
    vocab_size: int,
    max_tokens_param: str = "max_tokens",
    top_logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    constraint: Any = None,
    constraint_param: str = "response_format",
) -> SamplingParams:
    """Validate the sampling fields (400 naming the field) and build `SamplingParams`."""
    if max_tokens is not None and max_tokens < 0:
        raise bad(f"{max_tokens_param} must be >= 0, got {max_tokens}", max_tokens_param)
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise bad(f"temperature must be in [0, 2], got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = None if req.top_k in (None, -1, 0) else req.top_k
    if top_k is not None and top_k < 1:
        raise bad(f"top_k must be >= 1 (or -1 / unset for no limit), got {top_k}", "top_k")
    if not 1 <= req.n <= MAX_CHOICES:
        raise bad(f"n must be in [1, {MAX_CHOICES}], got {short(req.n)}", "n")
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        raise bad(f"seed must be an int64, in [-2**63, 2**63 - 1], got {short(req.seed)}", "seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise bad(f"at most {MAX_STOP} stop strings are supported, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise bad("stop strings must be non-empty", "stop")
    room = max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise bad(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} and {max_tokens_param} asks for {short(max_tokens)} more. Reduce the "
            f"prompt or {max_tokens_param} (at most {room} here).",
            max_tokens_param,
            "context_length_exceeded",
        )
    extras = sampling_extras(req, vocab_size)
    if extras["min_tokens"] > max_tokens:
        raise bad(
            f"min_tokens ({extras['min_tokens']}) must be <= {max_tokens_param} ({max_tokens})",
            "min_tokens",
        )
    budget = req.max_thinking_tokens
    if budget is not None and budget < 0:
        raise bad(f"max_thinking_tokens must be >= 0, got {short(budget)}", "max_thinking_tokens")
    if req.reasoning_effort is not None:
        if req.reasoning_effort not in REASONING_EFFORT:
            raise bad(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORT)}, got "
                f"{short(req.reasoning_effort)}",
                "reasoning_effort",
            )
        if budget is None:
            budget = REASONING_EFFORT[req.reasoning_effort]
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=req.seed,
        stop=stop + extra_stop,
        ignore_eos=req.ignore_eos,
        speculative=speculative,
        max_thinking_tokens=budget,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        constraint=constraint,
        **extras,
    )
    if speculative:
        off = params.speculative_conflicts()
        if off:
            field = _SPEC_FIELDS.get(off[0], off[0])
            if field == "response_format":
                field = constraint_param
            raise bad(
                f"{field} cannot be used with speculative decoding (the MTP drafter samples "
                "with temperature / top-k / top-p only); set speculative to 0",
                field,
            )
    try:
        return params.validate()
    except ValueError as err:
        raise bad(str(err)) from None


def check_prompt(ids: list[int], max_model_len: int, param: str) -> None:
    if len(ids) >= max_model_len:
        raise bad(
            f"the prompt has {len(ids)} tokens; this model's maximum context length is "
            f"{max_model_len} tokens, which leaves room for at most {max_model_len - 1} prompt "
            "tokens. Shorten the prompt.",
            param,
            "context_length_exceeded",
        )


def seeded(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n choices: seed + j, so that n samples differ and stay reproducible."""
    seed = None if params.seed is None else params.seed + j
    return params if j == 0 else dataclasses.replace(params, seed=seed, stop=list(params.stop))


# ---------------------------------------------------------------------- JSON and SSE
def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON that always encodes: a lone surrogate in a string (refused in requests,
    but an exception message may carry one) becomes "?" rather than an exception."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8", "replace")


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj.encode() if isinstance(obj, str) else dumps(obj)
    return b"data: " + data + b"\n\n"


class _JSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content)


def json_response(status: int, body: dict[str, Any]) -> Response:
    return _JSONResponse(body, status_code=status)


def error_response(err: APIError) -> Response:
    return json_response(err.status, err.body())
