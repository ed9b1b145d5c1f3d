"""OpenAI-compatible HTTP server over the continuous-batching `Engine` (FastAPI + uvicorn).

    hybridlm serve --preset tiny-super --port 8000
    OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x").completions.create(...)

Endpoints: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`,
`POST /v1/chat/completions` (both with SSE streaming and `stream_options.include_usage`),
`GET /health`, and vLLM's `POST /tokenize` ({prompt | messages (+ tools), add_special_tokens,
add_generation_prompt, return_token_strs} -> {count, max_model_len, tokens, token_strs}) and
`POST /detokenize` ({tokens} -> {prompt}).

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

Log-probs are those of the raw model distribution, log_softmax of the logits before
temperature, penalties, bias and masks (vLLM's default `logprobs_mode`), -inf written as -9999.
A token's `token` string is its text, `"bytes:\\xNN..."` when it is part of a UTF-8 character,
or a special token's name; `bytes` are its raw UTF-8 bytes (`infer.token_text`). Streamed
chunks carry the log-probs of the tokens whose text they release; concatenated, they equal the
non-streamed ones.

Responses carry `usage`, and with speculation a top-level `speculative` field with the
acceptance statistics. `max_tokens` defaults to 16 for completions (as OpenAI's) and to the rest
of the context for chat; a prompt that leaves no room, or an explicit `max_tokens` beyond
`max_model_len`, is a 400 `context_length_exceeded`. `n` (up to 128) and lists of prompts fan
out to one engine request per choice (choice j samples with `seed + j`; a structured-output
constraint is built once and instantiated per choice).
Chat replies are parsed back with the chat template: a `<think>` block becomes
`reasoning_content` and `<tool_call>` lines become `tool_calls` (finish reason "tool_calls"),
streamed as separate deltas. With `tools`, only calls to the offered tools are parsed
(`infer.tools`: ids `call_...`, `content` None when the reply is only calls; `tool_choice`
"none" leaves the text as it is); without, any `<tool_call>` line is (`data.chat`).
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
- A bug is still an OpenAI-shaped 500 (mid-stream: an `{"error": ...}` event ending the stream),
  and the keep-alive connection stays usable for the client's next request.

Threading: the `Engine` is not thread-safe, so exactly one background thread (`EngineWorker`)
owns it. Request handlers put commands on a thread-safe queue; the worker drains the queue,
loops `engine.step()` while any request is unfinished and blocks on the queue otherwise. Each
HTTP request owns an `asyncio.Queue` that the worker feeds through `loop.call_soon_threadsafe`.
A client that disconnects aborts its requests; an engine exception fails only the requests in
flight (500) and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from .. import untrusted
from ..choices import LOG_LEVELS
from ..data import chat as chat_template
from . import grammar
from . import tools as tool_mod
from .engine import Engine, RequestOutput
from .sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob
from .token_text import Offsets, TokenText

log = logging.getLogger("hybridlm.server")

SPEC_HEADER = "X-Speculative-Draft-Length"
MAX_CHOICES = 128  # OpenAI's limit on n; also bounds prompts x n for list prompts
# 4 MiB holds a 1M-token context of text (about 4 bytes a token), the longest these models
# take; a bigger body is refused before it is read, so it costs no memory
DEFAULT_MAX_BODY_BYTES = 4 << 20
MAX_JSON_DEPTH = 64  # a chat request nests about 6 deep (tool-call arguments a few more)
# the body's size is checked as it is read (max_body_bytes); depth and values here
_BODY_LIMITS = untrusted.JSONLimits(max_depth=MAX_JSON_DEPTH, max_chars=1 << 40, max_items=1 << 22)
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
MIN_LOGPROB = -9999.0  # what -inf becomes in JSON (OpenAI's and vLLM's)


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


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _schema_error(errors: list[dict[str, Any]]) -> APIError:
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
    return _bad("invalid request: " + "; ".join(msgs), param=first or None)


def _short(value: Any, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters, for echoing client input in a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------- request bodies
async def _read_body(request: Request, limit: int) -> bytes:
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
        raise _bad(f"Content-Length must be a non-negative integer, got {_short(declared)}")
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
        raise _bad(
            f"the request body is not valid UTF-8 (byte 0x{body[err.start]:02x} at offset "
            f"{err.start}); send JSON encoded as UTF-8",
            code="invalid_json",
        ) from None
    try:
        data = untrusted.loads(text, _BODY_LIMITS, what="the request body")
    except untrusted.UntrustedJSONError as err:  # syntax, depth, NaN, 4300+ digit integers
        raise _bad(str(err), code="invalid_json") from None
    if not isinstance(data, dict):
        raise _bad("the request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(body):
        found = _lone_surrogate(data)
        if found is not None:
            field, where = found
            raise _bad(
                f"{where}: a string holds a lone UTF-16 surrogate (an escape like \\ud800 "
                "without its pair), which is not text; send valid Unicode",
                param=field,
                code="invalid_unicode",
            )
    return data


# ---------------------------------------------------------------------- request schemas
class _Body(BaseModel):
    """A request body. Unknown fields are ignored (as vLLM does); types are strict (as OpenAI's:
    `"5"` is not an integer, `1` not a boolean) and null means absent."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # clients send `"n": null` / `"stream": null` for "the default"
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    model: str | None = None


class _Request(_Body):
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


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None


class TokenizeRequest(_Body):
    """vLLM's `/tokenize`: a completions `prompt` or chat `messages`."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Body):
    """vLLM's `/detokenize`."""

    tokens: list[int]


# ---------------------------------------------------------------------- the engine thread
@dataclass
class _Sink:
    """Where the worker delivers a request's events: an asyncio queue on some event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int

    def put(self, kind: str, payload: Any = None) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, self.index, payload))
            return True
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return False


_STOP = object()


class EngineWorker:
    """Owns the (not thread-safe) engine in one thread. `submit` and `abort` are thread-safe."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}  # touched by the worker thread only
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failures = 0

    def start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="hybridlm-engine", daemon=True
                )
                self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._commands.put(_STOP)
            thread.join(timeout)

    def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, sink: _Sink
    ) -> None:
        """Queue a request; the sink receives ("accepted" | "error" | "output", index, payload)."""
        self.start()
        self._commands.put(("add", request_id, prompt, params, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # -- worker thread
    def _run(self) -> None:
        while True:
            try:
                if not self._run_once():
                    return
            except Exception as err:  # a bug outside engine.step(): keep serving
                self._failures += 1
                log.exception("the engine worker failed")
                self._fail_all(APIError(500, f"the engine failed: {type(err).__name__}: {err}"))
                time.sleep(min(0.05 * self._failures, 1.0))  # no hot loop on a broken engine

    def _run_once(self) -> bool:
        """Take the queued commands (blocking while there is nothing to do), then one step.
        Returns False when asked to stop."""
        idle = not self.engine.has_unfinished()
        backoff = self._failures > 0 and not self._sinks
        try:
            cmd = (
                self._commands.get(timeout=0.5 if backoff and not idle else None)
                if idle or backoff
                else self._commands.get_nowait()
            )
        except queue.Empty:
            cmd = None
        while cmd is not None:
            if cmd is _STOP:
                self._fail_all(APIError(503, "the server is shutting down"))
                return False
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                cmd = None
        if self.engine.has_unfinished():
            self._step()
        return True

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, sink = cmd
            try:
                self.engine.add_request(prompt, params, request_id=rid)
            except Exception as err:  # ValueError: a bad request; anything else: our bug
                sink.put("error", err)
                return
            self._sinks[rid] = sink
            if not sink.put("accepted"):
                self._abort(rid)
        elif cmd[0] == "abort":
            self._abort(cmd[1])

    def _abort(self, rid: str) -> None:
        if self._sinks.pop(rid, None) is not None:
            try:
                self.engine.abort(rid)
            except Exception:  # pragma: no cover - abort must never take the worker down
                log.exception("engine.abort(%s) failed", rid)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:
            self._failures += 1
            log.exception(
                "engine.step() failed; failing the %d requests in flight", len(self._sinks)
            )
            self._fail_all(APIError(500, f"the engine failed: {type(err).__name__}: {err}"))
            return
        self._failures = 0
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            if not sink.put("output", out) and not out.finished:
                self._abort(out.request_id)

    def _fail_all(self, err: Exception) -> None:
        for rid, sink in list(self._sinks.items()):
            sink.put("error", err)
            self._abort(rid)


class _Generation:
    """The engine requests of one HTTP request (n choices x prompts), seen from the event loop."""

    def __init__(self, worker: EngineWorker, prefix: str) -> None:
        self.worker = worker
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids: list[str] = []
        self.open: set[int] = set()
        self._early: list[tuple[int, RequestOutput]] = []

    async def start(self, requests: list[tuple[list[int], SamplingParams]]) -> None:
        """Submit every request and wait until the engine accepted all of them (or raise)."""
        loop = asyncio.get_running_loop()
        for i, (prompt, params) in enumerate(requests):
            rid = f"{self.id}-{i}"
            self.rids.append(rid)
            self.open.add(i)
            self.worker.submit(rid, prompt, params, _Sink(loop, self.queue, i))
        accepted = 0
        try:
            while accepted < len(requests):
                kind, idx, payload = await self.queue.get()
                if kind == "accepted":
                    accepted += 1
                elif kind == "output":
                    self._early.append((idx, payload))
                    if payload.finished:
                        self.open.discard(idx)
                else:
                    self.open.discard(idx)
                    raise _engine_error(payload)
        except BaseException:  # refused, or cancelled while waiting: drop the siblings too
            self.abort()
            raise

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as they come, until every choice finished."""
        early, self._early = self._early, []
        for idx, payload in early:
            if payload.error:
                self.abort()
                raise APIError(500, payload.error)
            yield idx, payload
        while self.open:
            kind, idx, payload = await self.queue.get()
            if kind == "error":
                self.open.discard(idx)
                self.abort()
                raise _engine_error(payload)
            if kind == "output":
                if payload.finished:
                    self.open.discard(idx)
                if payload.error:  # its constraint failed: this request only
                    self.abort()
                    raise APIError(500, payload.error)
                yield idx, payload

    def abort(self) -> None:
        """Abort every choice not finished yet (client gone, or a sibling failed)."""
        for i in sorted(self.open):
            self.worker.abort(self.rids[i])
        self.open.clear()


def _engine_error(err: Any) -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, ValueError):
        return _bad(str(err))
    return APIError(500, f"the engine failed: {type(err).__name__}: {err}")


# ---------------------------------------------------------------------- request -> params
def _check_unsupported(req: _Request) -> None:
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, req.n):
            raise _bad("best_of must equal n (best-of ranking is not supported)", param="best_of")
        if req.suffix:
            raise _bad("suffix (insertion) is not supported", param="suffix")
    if isinstance(req, ChatCompletionRequest):
        for name in ("functions", "function_call"):
            if getattr(req, name):
                raise _bad(
                    f"{name} (the deprecated function-calling API) is not supported; use tools "
                    "and tool_choice",
                    param=name,
                )


_NO_SCHEMA = object()


def _response_format(fmt: dict[str, Any] | None) -> Any:
    """OpenAI `response_format` -> the JSON schema to constrain to (None: any JSON object), or
    `_NO_SCHEMA` for plain text; a 400 naming `response_format` for anything else."""
    if fmt is None:
        return _NO_SCHEMA
    kind = fmt.get("type")
    if kind == "text":
        return _NO_SCHEMA
    if kind == "json_object":
        return None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad(
                "response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
                "response_format",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise _bad("response_format json_schema.schema must be an object", "response_format")
        return schema
    raise _bad(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {_short(kind)}",
        "response_format",
    )


def _speculative(req: _Request, headers: Any) -> int:
    if req.speculative is not None:
        k, param = req.speculative, "speculative"
    else:
        raw = headers.get(SPEC_HEADER)
        if raw is None:
            return 0
        try:
            k = int(raw)
        except ValueError:
            raise _bad(f"{SPEC_HEADER} must be an integer, got {raw!r}", SPEC_HEADER) from None
        param = SPEC_HEADER
    if not 0 <= k <= 16:
        raise _bad(f"speculative draft length must be in [0, 16], got {k}", param)
    return k


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's `logit_bias` ({"token id": bias}) as {id: bias}, or a 400 naming it."""
    out: dict[int, float] = {}
    for key, bias in (raw or {}).items():
        if not (key.isascii() and key.isdigit()) or len(key) > 18 or int(key) >= vocab_size:
            raise _bad(
                f"logit_bias keys must be token ids in [0, {vocab_size}) written as strings, "
                f"got {_short(key)}",
                "logit_bias",
            )
        if not -100.0 <= bias <= 100.0:
            raise _bad(
                f"logit_bias values must be in [-100, 100], got {_short(bias)}", "logit_bias"
            )
        out[int(key)] = float(bias)
    return out


def _sampling_extras(req: _Request, vocab_size: int) -> dict[str, Any]:
    """The penalty / bias / min-p / min_tokens / stop_token_ids fields, validated (400 naming
    the field) as SamplingParams keyword arguments."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise _bad(f"{name} must be in [-2, 2], got {_short(value)}", name)
    rep = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    if not 0.0 < rep < float("inf"):
        raise _bad(
            f"repetition_penalty must be > 0 (1 = off), got {_short(rep)}", "repetition_penalty"
        )
    min_p = 0.0 if req.min_p is None else req.min_p
    if not 0.0 <= min_p <= 1.0:
        raise _bad(f"min_p must be in [0, 1], got {_short(min_p)}", "min_p")
    min_tokens = req.min_tokens or 0
    if min_tokens < 0:
        raise _bad(f"min_tokens must be >= 0, got {_short(min_tokens)}", "min_tokens")
    stop_ids = list(req.stop_token_ids or [])
    if len(stop_ids) > MAX_STOP:
        raise _bad(
            f"at most {MAX_STOP} stop_token_ids are supported, got {len(stop_ids)}",
            "stop_token_ids",
        )
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise _bad(f"stop_token_ids must be token ids in [0, {vocab_size})", "stop_token_ids")
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


def _params(
    req: _Request,
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
        raise _bad(f"{max_tokens_param} must be >= 0, got {max_tokens}", max_tokens_param)
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise _bad(f"temperature must be in [0, 2], got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = None if req.top_k in (None, -1, 0) else req.top_k
    if top_k is not None and top_k < 1:
        raise _bad(f"top_k must be >= 1 (or -1 / unset for no limit), got {top_k}", "top_k")
    if not 1 <= req.n <= MAX_CHOICES:
        raise _bad(f"n must be in [1, {MAX_CHOICES}], got {_short(req.n)}", "n")
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        raise _bad(f"seed must be an int64, in [-2**63, 2**63 - 1], got {_short(req.seed)}", "seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise _bad(f"at most {MAX_STOP} stop strings are supported, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise _bad("stop strings must be non-empty", "stop")
    room = max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise _bad(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} and {max_tokens_param} asks for {_short(max_tokens)} more. Reduce the "
            f"prompt or {max_tokens_param} (at most {room} here).",
            max_tokens_param,
            "context_length_exceeded",
        )
    extras = _sampling_extras(req, vocab_size)
    if extras["min_tokens"] > max_tokens:
        raise _bad(
            f"min_tokens ({extras['min_tokens']}) must be <= {max_tokens_param} ({max_tokens})",
            "min_tokens",
        )
    budget = req.max_thinking_tokens
    if budget is not None and budget < 0:
        raise _bad(f"max_thinking_tokens must be >= 0, got {_short(budget)}", "max_thinking_tokens")
    if req.reasoning_effort is not None:
        if req.reasoning_effort not in REASONING_EFFORT:
            raise _bad(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORT)}, got "
                f"{_short(req.reasoning_effort)}",
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
            raise _bad(
                f"{field} cannot be used with speculative decoding (the MTP drafter samples "
                "with temperature / top-k / top-p only); set speculative to 0",
                field,
            )
    try:
        return params.validate()
    except ValueError as err:
        raise _bad(str(err)) from None


def _check_prompt(ids: list[int], max_model_len: int, param: str) -> None:
    if len(ids) >= max_model_len:
        raise _bad(
            f"the prompt has {len(ids)} tokens; this model's maximum context length is "
            f"{max_model_len} tokens, which leaves room for at most {max_model_len - 1} prompt "
            "tokens. Shorten the prompt.",
            param,
            "context_length_exceeded",
        )


def _seeded(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n choices: seed + j, so that n samples differ and stay reproducible."""
    seed = None if params.seed is None else params.seed + j
    return params if j == 0 else dataclasses.replace(params, seed=seed, stop=list(params.stop))


# ---------------------------------------------------------------------- responses
def spec_stats_dict(stats: Any) -> dict[str, Any]:
    """`SpecStats.to_dict()`, or the same fields read from its attributes."""
    if hasattr(stats, "to_dict"):
        return stats.to_dict()
    return {
        "draft_len": stats.draft_len,
        "steps": stats.steps,
        "acceptance_length": stats.acceptance_length,
        "acceptance_by_position": list(stats.acceptance_by_position()),
    }


def _merged_spec(stats: list[Any]) -> dict[str, Any] | None:
    """One stats dict for a response: the single choice's, or the counts summed over choices."""
    stats = [s for s in stats if s is not None]
    if not stats:
        return None
    if len(stats) == 1:
        return spec_stats_dict(stats[0])
    try:
        merged = type(stats[0])(stats[0].draft_len)
        for s in stats:
            merged.steps += s.steps
            merged.accepted += s.accepted
            for name in ("accepted_at", "drafted_at"):
                acc, add = getattr(merged, name), getattr(s, name)
                if add:
                    acc = acc or [0] * len(add)
                    setattr(merged, name, [a + b for a, b in zip(acc, add, strict=True)])
        return spec_stats_dict(merged)
    except (
        AttributeError,
        TypeError,
        ValueError,
    ):  # a SpecStats of another shape: report the first
        return spec_stats_dict(stats[0])


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON that always encodes: a lone surrogate in a string (refused in requests,
    but an exception message may carry one) becomes "?" rather than an exception."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8", "replace")


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj.encode() if isinstance(obj, str) else _dumps(obj)
    return b"data: " + data + b"\n\n"


class _JSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return _dumps(content)


def _json(status: int, body: dict[str, Any]) -> Response:
    return _JSONResponse(body, status_code=status)


def _error_response(err: APIError) -> Response:
    return _json(err.status, err.body())


@dataclass
class _Job:
    """A validated request, ready to run: one engine request per choice."""

    kind: Literal["completion", "chat"]
    model: str
    stream: bool
    include_usage: bool
    prompts: list[list[int]]  # distinct prompts
    requests: list[tuple[list[int], SamplingParams]]  # one per choice (prompt-major)
    echo: list[str]  # per choice: text to prefix (completions with echo)
    logprobs: int | None = None  # the API's logprobs: None off, else the top-k asked for
    token_ids_as_strings: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N"
    texts: TokenText | None = None
    # chat: the offered tools, whose calls are parsed; [] with tool_choice "none" (the text is
    # the answer); None when no tools were offered (`data.chat.parse_assistant`'s reading)
    tools: list[dict[str, Any]] | None = None

    def token(self, tid: int) -> str:
        return f"token_id:{tid}" if self.token_ids_as_strings else self.texts.token(tid)

    def token_bytes(self, tid: int) -> list[int]:
        if self.token_ids_as_strings:
            return list(self.token(tid).encode())
        return self.texts.token_bytes(tid)

    def completion_logprobs(
        self, ids: list[int], entries: list[TokenLogprob | None], offsets: list[int]
    ) -> dict[str, list]:
        """OpenAI's completions `logprobs` of tokens `ids`: their strings, log-probs, a dict of
        the token and the k most likely per position (vLLM's: up to k + 1 entries), and each
        token's character offset in the choice's text."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        for tid, e in zip(ids, entries, strict=True):
            out["tokens"].append(self.token(tid))
            if e is None:  # the prompt's first token
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(max(e.logprob, MIN_LOGPROB))
            top = {self.token(tid): max(e.logprob, MIN_LOGPROB)}
            for t, v in e.top:
                top.setdefault(self.token(t), max(v, MIN_LOGPROB))
            out["top_logprobs"].append(top)
        out["text_offset"] = list(offsets)
        return out

    def chat_logprobs(self, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        """OpenAI's chat `logprobs.content` entries."""
        return [
            {
                "token": self.token(e.token_id),
                "logprob": max(e.logprob, MIN_LOGPROB),
                "bytes": self.token_bytes(e.token_id),
                "top_logprobs": [
                    {
                        "token": self.token(t),
                        "logprob": max(v, MIN_LOGPROB),
                        "bytes": self.token_bytes(t),
                    }
                    for t, v in e.top
                ],
            }
            for e in entries
        ]


_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")


class _Guard:
    """ASGI middleware (inside Starlette's ServerErrorMiddleware) in front of every route:

    - request ids: every response carries `X-Request-ID`, the client's own when it sent a short
      one (letters, digits, `._:-`, at most 64), else a fresh one; log lines name it;
    - authentication: with a `token`, a request without `Authorization: Bearer <token>` is a
      401 (compared in constant time), before its body is read;
    - a log line per request at DEBUG (id, method, path, status, milliseconds), a WARNING per
      5xx;
    - an exception raised before the response started becomes an OpenAI-shaped 500 and is not
      re-raised: uvicorn closes the connection of an app that raises, so the client's next
      request would fail too. An exception after the response started is re-raised, as only
      closing can end that response."""

    def __init__(self, app: Any, token: str | None = None) -> None:
        self.app = app
        self.token = None if token is None else b"Bearer " + token.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        headers = dict(scope.get("headers") or ())
        given = headers.get(b"x-request-id", b"")
        rid = given.decode() if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]
        started, status = False, 0

        async def watched_send(message: Any) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())],
                }
            await send(message)

        try:
            if self.token is not None and not hmac.compare_digest(
                headers.get(b"authorization", b""), self.token
            ):
                err = APIError(
                    401, "a valid 'Authorization: Bearer <token>' header is required",
                    code="unauthorized",
                )  # fmt: skip
                response = _error_response(err)
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, watched_send)
            else:
                await self.app(scope, receive, watched_send)
        except Exception as err:
            if started:
                raise
            log.exception("request %s: unhandled error", rid)
            message = f"internal error: {type(err).__name__}: {str(err)[:500]}"
            await _error_response(APIError(500, message))(scope, receive, watched_send)
        finally:
            ms = 1000 * (time.monotonic() - t0)
            line = "request %s: %s %s -> %s (%.0f ms)"
            args = (rid, scope.get("method"), scope.get("path"), status, ms)
            log.log(logging.WARNING if status >= 500 else logging.DEBUG, line, *args)


# ---------------------------------------------------------------------- the app
def base_app(title: str, *, lifespan: Any = None, token: str | None = None) -> FastAPI:
    """A FastAPI app whose every error is a JSON `{"error": {...}}` body in OpenAI's shape
    (`APIError`, schema errors, unknown routes, and unhandled exceptions as a 500 that keeps the
    connection), with request ids and, given a `token`, bearer authentication (`_Guard`): the
    skeleton of this server and of the RL environment server (`rl.remote`)."""
    if token is not None and not token:
        raise ValueError("an empty token would let anyone in; give a secret or none")
    app = FastAPI(title=title, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(_Guard, token=token)
    app.state.token_required = token is not None

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> Response:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> Response:
        return _error_response(_schema_error(list(err.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return _error_response(APIError(err.status_code, str(err.detail), code=code))

    return app


def _token_required(app: Any) -> bool:
    """Whether `app` (a `base_app`) asks every request for a token."""
    return bool(getattr(getattr(app, "state", None), "token_required", False))


async def read_json(request: Request, max_body_bytes: int) -> dict[str, Any]:
    """The request's body as a JSON object: at most `max_body_bytes` (413), valid UTF-8 JSON of
    bounded depth without NaN or lone surrogates (400; `parse_body`)."""
    return parse_body(await _read_body(request, max_body_bytes))


def create_app(
    engine: Engine,
    model_name: str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_key: str | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` under the model id `model_name`; request bodies over
    `max_body_bytes` are refused (413); with `api_key`, requests must send it as a bearer
    token (what the openai client sends as its `api_key`; 401 otherwise). The engine thread
    starts with the first request and stops when the app shuts down."""
    if not model_name:
        raise ValueError("model_name must be a non-empty string (the id clients send as model)")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int):
        raise TypeError(f"max_body_bytes must be an int, got {type(max_body_bytes).__name__}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    worker = EngineWorker(engine)
    created = int(time.time())
    tokenizer = engine.tokenizer
    texts = TokenText(tokenizer)
    max_model_len = int(engine.max_model_len)
    vocab_size = int(engine.model.config.vocab_size)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()

    app = base_app("hybridlm", lifespan=lifespan, token=api_key)
    app.state.worker = worker
    app.state.model_name = model_name

    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "hybridlm",
            "max_model_len": max_model_len,
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        if model_id != model_name:
            raise _unknown_model(model_id)
        return _json(200, model_card())

    def _unknown_model(name: str) -> APIError:
        return APIError(
            404,
            f"the model {_short(name)} does not exist; this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )

    async def parse(request: Request, schema: type[_Body]) -> Any:
        data = parse_body(await _read_body(request, max_body_bytes))
        try:
            req = schema.model_validate(data)
        except ValidationError as err:
            raise _schema_error(err.errors()) from None
        if req.model is not None and req.model != model_name:
            raise _unknown_model(req.model)
        _check_unsupported(req)
        return req

    def completion_job(req: CompletionRequest, headers: Any) -> _Job:
        p = req.prompt
        if isinstance(p, str):
            prompts = [tokenizer.encode(p)]
        elif not p:
            raise _bad("prompt must not be empty", "prompt")
        elif isinstance(p[0], (str, list)) and len(p) > MAX_CHOICES:  # before tokenising them
            raise _bad(f"at most {MAX_CHOICES} prompts are accepted, got {len(p)}", "prompt")
        elif isinstance(p[0], str):
            prompts = [tokenizer.encode(s) for s in p]
        elif isinstance(p[0], int):
            prompts = [list(p)]
        else:
            prompts = [list(x) for x in p]
        for ids in prompts:
            if not ids:
                raise _bad("a prompt of token ids must not be empty", "prompt")
            if min(ids) < 0 or max(ids) >= vocab_size:
                raise _bad(f"prompt token ids must be in [0, {vocab_size})", "prompt")
            _check_prompt(ids, max_model_len, "prompt")
        k = req.logprobs
        if k is not None:
            if not 0 <= k <= MAX_COMPLETION_LOGPROBS:
                raise _bad(
                    f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {_short(k)}",
                    "logprobs",
                )
            if req.max_tokens == 0 and not req.echo:
                raise _bad(
                    "logprobs with max_tokens 0 return nothing; set echo to true to score the "
                    "prompt, or ask for tokens",
                    "logprobs",
                )
        _sampling_extras(req, vocab_size)  # stop_token_ids are checked before they end grammars
        constraint, constraint_param = structured(req)
        return _job(
            "completion",
            req,
            headers,
            prompts,
            req.max_tokens,
            16,
            [],
            req.echo,
            logprobs=k,
            prompt_logprobs=k if req.echo else None,
            constraint=constraint,
            constraint_param=constraint_param,
        )

    def render_chat(
        messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> list[int]:
        """The token ids of a conversation, as the chat endpoint feeds them to the model."""
        try:
            text = chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kw)
        except ValueError as err:
            raise _bad(str(err), "messages") from None
        except RecursionError:  # tool-call arguments: a JSON string nested too deep to decode
            raise _bad("messages: tool call arguments nest too deep to parse", "messages") from None
        return tokenizer.encode(text)

    def tool_schemas(tools: Any) -> dict[str, dict[str, Any]]:
        """The offered tools' parameter schemas by name (`infer.tools`), or a 400 on `tools`."""
        try:
            return tool_mod.tool_parameters(tools)
        except ValueError as err:
            raise _bad(str(err), "tools") from None

    def chat_job(req: ChatCompletionRequest, headers: Any) -> _Job:
        if req.max_tokens is None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        k = None
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise _bad(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                    f"{_short(req.top_logprobs)}",
                    "top_logprobs",
                )
            if not req.logprobs:
                raise _bad("top_logprobs needs logprobs set to true", "top_logprobs")
        if req.logprobs:
            k = req.top_logprobs or 0
        _sampling_extras(req, vocab_size)  # stop_token_ids are checked before they end grammars
        tools = req.tools or None
        names = list(tool_schemas(tools)) if tools else []
        if req.tool_choice is not None and not tools and req.tool_choice not in ("none", "auto"):
            raise _bad("tool_choice needs tools", "tool_choice")
        try:
            choice = tool_mod.tool_choice_name(req.tool_choice, names)
        except ValueError as err:
            raise _bad(str(err), "tool_choice") from None
        ids = render_chat(req.messages, tools=tools)
        _check_prompt(ids, max_model_len, "messages")
        forced = bool(tools) and choice not in ("auto", "none")
        constraint, constraint_param = structured(req)
        if forced:
            if constraint is not None:
                raise _bad(
                    f"{constraint_param} and a forced tool_choice cannot both constrain the reply",
                    constraint_param,
                )
            constraint, constraint_param = (
                compile_constraint(
                    "tools",
                    lambda: tool_mod.tool_call_constraint(
                        tokenizer,
                        tools,
                        req.tool_choice,
                        vocab_size=vocab_size,
                        parallel_tool_calls=req.parallel_tool_calls is not False,
                        stop_token_ids=req.stop_token_ids,
                    ),
                ),
                "tool_choice",
            )
        stop = [chat_template.STOP]
        return _job(
            "chat",
            req,
            headers,
            [ids],
            max_tokens,
            None,
            stop,
            False,
            param,
            logprobs=k,
            constraint=constraint,
            constraint_param=constraint_param,
            tools=([] if choice == "none" else tools) if tools else None,
        )

    def structured(req: CompletionRequest | ChatCompletionRequest) -> tuple[Any, str]:
        """The constraint factory of `response_format` (json_object / json_schema) or vLLM's
        `structured_outputs` ({json | regex | choice | grammar | json_object}), and the field
        it came from; (None, "response_format") for free text."""
        schema = _response_format(req.response_format)
        spec = req.structured_outputs
        if schema is not _NO_SCHEMA and spec:
            raise _bad("give response_format or structured_outputs, not both", "structured_outputs")
        stops = req.stop_token_ids
        if schema is not _NO_SCHEMA:
            return compile_constraint(
                "response_format",
                lambda: grammar.json_constraint(
                    tokenizer, schema, vocab_size=vocab_size, stop_token_ids=stops
                ),
            ), "response_format"
        if not spec:
            return None, "response_format"
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if spec.get(k)]
        if len(kinds) != 1:
            raise _bad(
                "structured_outputs takes exactly one of json, regex, choice, grammar and "
                f"json_object, got {kinds or 'none'}",
                "structured_outputs",
            )
        kind, value = kinds[0], spec[kinds[0]]
        if kind in ("json", "json_object"):
            if kind == "json_object":
                value = None
            elif isinstance(value, str):
                try:
                    value = untrusted.loads(value, _BODY_LIMITS, what="structured_outputs.json")
                except untrusted.UntrustedJSONError as err:
                    raise _bad(str(err), "structured_outputs") from None

            def build() -> Any:
                return grammar.json_constraint(
                    tokenizer, value, vocab_size=vocab_size, stop_token_ids=stops
                )
        else:
            if kind == "choice":
                if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value):
                    raise _bad(
                        "structured_outputs.choice must be a list of non-empty strings",
                        "structured_outputs",
                    )
                value = "start: " + " | ".join(json.dumps(c) for c in value)
            elif not isinstance(value, str):
                raise _bad(f"structured_outputs.{kind} must be a string", "structured_outputs")
            syntax = "regex" if kind == "regex" else "lark"

            def build() -> Any:
                return grammar.grammar_constraint(
                    tokenizer, value, vocab_size=vocab_size, syntax=syntax, stop_token_ids=stops
                )

        return compile_constraint("structured_outputs", build), "structured_outputs"

    def compile_constraint(param: str, build: Any) -> Any:
        """A constraint factory from `infer.grammar` / `infer.tools`, or a 400 naming `param`
        (an invalid or unsupported schema, or no llguidance on this server)."""
        try:
            return build()
        except ImportError as err:
            raise _bad(
                f"structured outputs are not available on this server: {err}", param
            ) from None
        except ValueError as err:
            raise _bad(str(err), param) from None

    def _job(
        kind: Literal["completion", "chat"],
        req: _Request,
        headers: Any,
        prompts: list[list[int]],
        max_tokens: int | None,
        default_max_tokens: int | None,
        extra_stop: list[str],
        echo: bool,
        max_tokens_param: str = "max_tokens",
        *,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        constraint: Any = None,
        constraint_param: str = "response_format",
        tools: list[dict[str, Any]] | None = None,
    ) -> _Job:
        if len(prompts) * req.n > MAX_CHOICES:
            raise _bad(f"prompts x n must be <= {MAX_CHOICES}, got {len(prompts) * req.n}", "n")
        spec = _speculative(req, headers)
        requests, echoes = [], []
        for ids in prompts:
            params = _params(
                req,
                max_tokens=max_tokens,
                prompt_len=len(ids),
                max_model_len=max_model_len,
                default_max_tokens=default_max_tokens,
                extra_stop=extra_stop,
                speculative=spec,
                vocab_size=vocab_size,
                max_tokens_param=max_tokens_param,
                top_logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                constraint=constraint,
                constraint_param=constraint_param,
            )
            for j in range(req.n):
                requests.append((ids, _seeded(params, j)))
                echoes.append(tokenizer.decode(ids) if echo else "")
        include_usage = bool(req.stream_options and req.stream_options.get("include_usage"))
        return _Job(
            kind,
            model_name,
            req.stream,
            include_usage,
            prompts,
            requests,
            echoes,
            logprobs=logprobs,
            token_ids_as_strings=req.return_tokens_as_token_ids,
            texts=texts,
            tools=tools,
        )

    async def run(job: _Job, request: Request) -> Response:
        gen = _Generation(worker, "cmpl" if job.kind == "completion" else "chatcmpl")
        await gen.start(job.requests)  # raises APIError (400) if the engine refuses
        if job.stream:
            return _EventStream(_stream(job, gen), on_close=gen.abort)
        collect = asyncio.ensure_future(_collect(gen))
        gone = asyncio.ensure_future(_disconnected(request))
        left = True
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            left = not collect.done()
        finally:
            gone.cancel()
            if left:  # the client left (or we are being cancelled): stop generating for it
                collect.cancel()
                gen.abort()
        if left:  # nobody reads this; uvicorn needs a response all the same
            return _json(499, APIError(499, "client closed the request").body())
        return _json(200, _final_body(job, gen, collect.result()))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            req = await parse(request, CompletionRequest)
            # tokenising and compiling a grammar off the event loop: other streams keep flowing
            job = await asyncio.to_thread(completion_job, req, request.headers)
            return await run(job, request)
        except APIError as err:
            return _error_response(err)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            req = await parse(request, ChatCompletionRequest)
            job = await asyncio.to_thread(chat_job, req, request.headers)
            return await run(job, request)
        except APIError as err:
            return _error_response(err)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's `/tokenize`: a `prompt` is encoded as /v1/completions encodes a string prompt
        (BOS first unless `add_special_tokens` is false); `messages` as /v1/chat/completions
        renders them (the template starts with BOS; `add_special_tokens` does not apply)."""
        try:
            req = await parse(request, TokenizeRequest)
            if (req.prompt is None) == (req.messages is None):
                raise _bad("give exactly one of prompt and messages", "prompt")
            if req.prompt is not None:
                add_bos = True if req.add_special_tokens is None else req.add_special_tokens
                ids = tokenizer.encode(req.prompt, add_bos=add_bos)
            else:
                if req.tools:
                    tool_schemas(req.tools)
                ids = render_chat(req.messages, req.add_generation_prompt, tools=req.tools)
            body: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len}
            body["tokens"] = ids
            body["token_strs"] = (
                [texts.vocab_token(t) for t in ids] if req.return_token_strs else None
            )
            return _json(200, body)
        except APIError as err:
            return _error_response(err)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM's `/detokenize`: the text of token ids, as completions decode them."""
        try:
            req = await parse(request, DetokenizeRequest)
            if any(not 0 <= t < vocab_size for t in req.tokens):
                raise _bad(f"tokens must be token ids in [0, {vocab_size})", "tokens")
            return _json(200, {"prompt": tokenizer.decode(req.tokens)})
        except APIError as err:
            return _error_response(err)

    return app


class _EventStream(StreamingResponse):
    """SSE response that always watches for the client leaving and aborts its requests."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Any) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
            if stream.done() and not stream.cancelled() and stream.exception():
                if not isinstance(stream.exception(), OSError):  # OSError: client gone
                    raise stream.exception()
        finally:
            for task in (stream, gone):
                task.cancel()
            # let the cancellation reach the generator (its `finally` aborts) before closing
            await asyncio.gather(stream, gone, return_exceptions=True)
            self._on_close()
            await self.body_iterator.aclose()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so only that can come)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(gen: _Generation) -> dict[int, RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async for idx, out in gen.outputs():
        if out.finished:
            final[idx] = out
    return final


def _chat_finish(reason: str | None, message: dict[str, Any]) -> str | None:
    """OpenAI reports "tool_calls" when a turn that stopped by itself called tools."""
    return "tool_calls" if reason == "stop" and message.get("tool_calls") else reason


def _final_body(job: _Job, gen: _Generation, final: dict[int, RequestOutput]) -> dict[str, Any]:
    outs = [final[i] for i in range(len(job.requests))]
    choices = []
    for i, out in enumerate(outs):
        if job.kind == "completion":
            logprobs = None
            if job.logprobs is not None:
                logprobs = _completion_choice_logprobs(job, i, out)
            choices.append(
                {
                    "index": i,
                    "text": job.echo[i] + out.text,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                }
            )
        else:
            message = _assistant_message(out.text, job.tools)
            logprobs = None
            if job.logprobs is not None:
                logprobs = {"content": job.chat_logprobs(out.top_logprobs or [])}
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": _chat_finish(out.finish_reason, message),
                }
            )
    body: dict[str, Any] = {
        "id": gen.id,
        "object": "text_completion" if job.kind == "completion" else "chat.completion",
        "created": int(time.time()),
        "model": job.model,
        "choices": choices,
        "usage": _usage(sum(len(p) for p in job.prompts), sum(len(o.token_ids) for o in outs)),
    }
    spec = _merged_spec([o.spec_stats for o in outs])
    if spec is not None:
        body["speculative"] = spec
    return body


def _after_think(text: str, final: bool) -> str:
    """The assistant text after its reasoning block (`data.chat`'s `<think>` format); while
    streaming, "" as long as the text may still be (or is) inside one."""
    text = text.split(chat_template.STOP, 1)[0]
    m = chat_template._THINK_RE.match(text)
    if m is None:
        head = text.lstrip()
        maybe = len(head) < len(chat_template.THINK_OPEN) and chat_template.THINK_OPEN.startswith(
            head
        )
        return "" if maybe and not final else text
    if not final and chat_template.THINK_CLOSE not in text:
        return ""
    return text[m.end() :]


def _assistant_message(text: str, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The OpenAI message of generated assistant text. With tools offered, calls to them are
    parsed by `infer.tools` (ids `call_` + 24 hex digits; content None when there is nothing
    but the calls); with tool_choice "none" (`tools == []`) the text after any reasoning is the
    content; without tools, `data.chat.parse_assistant`'s reading."""
    message = chat_template.parse_assistant(text)
    if tools is None:
        return message
    message.pop("tool_calls", None)
    if not tools:
        message["content"] = _after_think(text, True)
        return message
    content, calls = tool_mod.parse_tool_calls(_after_think(text, True), tools)
    message["content"] = content
    if calls:
        message["tool_calls"] = calls
    return message


class _ToolChatStream:
    """The streamed deltas of a chat reply with tools: reasoning as `data.chat.AssistantStream`
    releases it, then content and tool calls as `infer.tools.ToolCallStream` does (each call
    whole, with its index). Concatenated they equal `_assistant_message`'s fields."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self._think = chat_template.AssistantStream()
        self._calls = tool_mod.ToolCallStream(tools) if tools else None  # None: "none"
        self._fed = ""

    def update(self, text: str, final: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {}
        reasoning = self._think.update(text, final=final).get("reasoning_content")
        if reasoning:
            out["reasoning_content"] = reasoning
        after = _after_think(text, final)
        if after.startswith(self._fed):  # (always: released text only grows)
            new = after[len(self._fed) :]
            if self._calls is None:
                if new:
                    out["content"] = new
            else:
                out.update(self._calls.feed(new))
            self._fed = after
        if final and self._calls is not None:
            rest = self._calls.finish()
            if "content" in rest:
                out["content"] = out.get("content", "") + rest["content"]
            if "tool_calls" in rest:
                out["tool_calls"] = out.get("tool_calls", []) + rest["tool_calls"]
        return out


def _completion_choice_logprobs(job: _Job, i: int, out: RequestOutput) -> dict[str, list]:
    """A completions choice's `logprobs`: the echoed prompt's tokens (first one None), then
    the generated ones, with offsets into the choice's text."""
    ids: list[int] = []
    entries: list[TokenLogprob | None] = []
    offsets: list[int] = []
    if job.requests[i][1].prompt_logprobs is not None:  # echo
        prompt = job.requests[i][0]
        ids += prompt
        entries += out.prompt_logprobs or [None] * len(prompt)
        offsets += job.texts.offsets(prompt)
    ids += out.token_ids
    entries += out.top_logprobs or []
    offsets += job.texts.offsets(out.token_ids, len(job.echo[i]))
    return job.completion_logprobs(ids, entries, offsets)


class _StreamedLogprobs:
    """Which generated tokens' log-probs a stream can send: those whose text was released (the
    engine holds back a possible stop string, which may still trim tokens), all of them once the
    choice finished. Concatenated, the chunks' log-probs equal the non-streamed ones."""

    def __init__(self, job: _Job, start: int) -> None:
        self.offsets = Offsets(job.texts, start)
        self.sent = 0

    def release(self, out: RequestOutput, released_chars: int) -> tuple[int, int]:
        """(first, end) indices into `out.token_ids` to send now."""
        ids = out.token_ids
        if len(self.offsets) < len(ids):
            self.offsets.extend(ids[len(self.offsets) :])
        first = n = self.sent
        if out.finished:
            n = len(ids)
        else:
            while n < len(ids):
                touched = self.offsets.touched(n + 1)
                if touched is None or touched > released_chars:
                    break
                n += 1
        self.sent = max(n, first)
        return first, n


async def _stream(job: _Job, gen: _Generation) -> AsyncIterator[bytes]:
    """SSE chunks: deltas per choice, a finish chunk per choice, an optional usage chunk, and
    `data: [DONE]`. An engine failure mid-stream becomes an `{"error": ...}` event."""
    created = int(time.time())
    chat = job.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict[str, Any], **extra: Any) -> bytes:
        body = {"id": gen.id, "object": obj, "created": created, "model": job.model}
        body["choices"] = [choice] if choice else []
        if job.include_usage:
            body["usage"] = None
        body.update(extra)
        return _sse(body)

    def delta(i: int, text: str, finish: str | None = None, logprobs: Any = None) -> dict:
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def chat_delta(
        i: int, d: dict[str, Any], finish: str | None = None, logprobs: Any = None
    ) -> dict:
        if "tool_calls" in d and "index" not in d["tool_calls"][0]:
            # streamed tool calls carry their position in the list
            d = {**d, "tool_calls": [{"index": k, **c} for k, c in enumerate(d["tool_calls"])]}
        return {"index": i, "delta": d, "logprobs": logprobs, "finish_reason": finish}

    def new_logprobs(i: int, out: RequestOutput, released: int) -> Any:
        """The log-probs of the tokens released by this output (None: none, or not asked)."""
        if job.logprobs is None:
            return None
        first, end = streamed[i].release(out, released)
        if first == end:
            return None
        entries = (out.top_logprobs or [])[first:end]
        if chat:
            return {"content": job.chat_logprobs(entries)}
        offsets = [streamed[i].offsets.offset(t) for t in range(first, end)]
        return job.completion_logprobs(out.token_ids[first:end], entries, offsets)

    sent = [0] * len(job.requests)
    streamed = [_StreamedLogprobs(job, len(job.echo[i])) for i in range(len(job.requests))]
    started = [False] * len(job.requests)
    # chat: reasoning, content and tool calls are separated as the text arrives
    parsers = [
        chat_template.AssistantStream() if job.tools is None else _ToolChatStream(job.tools)
        for _ in job.requests
    ]
    called = [False] * len(job.requests)  # a tool call was streamed
    final: dict[int, RequestOutput] = {}
    try:
        for i in range(len(job.requests)):
            if chat:
                yield chunk(chat_delta(i, {"role": "assistant", "content": ""}))
            elif job.echo[i] and job.logprobs is None:
                yield chunk(delta(i, job.echo[i]))
                started[i] = True
        async for i, out in gen.outputs():
            if not started[i] and not chat:  # echo with log-probs: they come with the output
                started[i] = True
                if job.requests[i][1].prompt_logprobs is not None:
                    prompt = job.requests[i][0]
                    lp = job.completion_logprobs(
                        prompt,
                        out.prompt_logprobs or [None] * len(prompt),
                        job.texts.offsets(prompt),
                    )
                    yield chunk(delta(i, job.echo[i], logprobs=lp))
            if out.finished:
                final[i] = out
            if chat:
                d = parsers[i].update(out.text, final=out.finished)
                called[i] = called[i] or bool(d.get("tool_calls"))
                lp = new_logprobs(i, out, len(out.text))
                if (d or lp) and not out.finished:
                    yield chunk(chat_delta(i, d, logprobs=lp))
            else:
                # deltas from the stable text, so the stream concatenates to the final text
                text = out.text[sent[i] :] if len(out.text) >= sent[i] else out.delta_text
                sent[i] = max(sent[i], len(out.text))
                lp = new_logprobs(i, out, sent[i])
                if text or lp:
                    yield chunk(delta(i, text, logprobs=lp))
            if out.finished:
                extra = {}
                if out.spec_stats is not None:
                    extra["speculative"] = spec_stats_dict(out.spec_stats)
                if chat:
                    if d or lp:
                        yield chunk(chat_delta(i, d, logprobs=lp))
                    reason = _chat_finish(out.finish_reason, {"tool_calls": called[i]})
                    yield chunk(chat_delta(i, {}, finish=reason), **extra)
                else:
                    yield chunk(delta(i, "", finish=out.finish_reason), **extra)
        if job.include_usage:
            outs = [final[i] for i in range(len(job.requests))]
            extra = {
                "usage": _usage(
                    sum(len(p) for p in job.prompts), sum(len(o.token_ids) for o in outs)
                )
            }
            spec = _merged_spec([o.spec_stats for o in outs])
            if spec is not None:
                extra["speculative"] = spec
            yield chunk({}, **extra)
        yield _sse("[DONE]")
    except APIError as err:
        yield _sse(err.body())
    except Exception as err:  # a bug: end the stream with an error event, not a cut connection
        log.exception("streaming failed")
        yield _sse(APIError(500, f"internal error: {type(err).__name__}: {str(err)[:500]}").body())
    finally:
        gen.abort()


# ---------------------------------------------------------------------- running it
def _warn_if_public(app: Any, host: str) -> None:
    """A warning when `app` is reachable from other machines without a token (`base_app`)."""
    if host not in ("127.0.0.1", "localhost", "::1") and not _token_required(app):
        log.warning("binding %s without a token: anyone who can reach this server can use it", host)


def serve(
    engine: Engine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_level: str = "info",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_key: str | None = None,
) -> None:
    """Serve until interrupted (Ctrl-C). Binds to localhost unless told otherwise."""
    app = create_app(engine, model_name, max_body_bytes=max_body_bytes, api_key=api_key)
    run_app(app, host, port, log_level)


def _configure_logging(log_level: str) -> None:
    """The project's loggers at `log_level`, printed like uvicorn's (its own access log is off:
    `_Guard` logs every request, with its id, at DEBUG)."""
    if log_level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {LOG_LEVELS}, got {log_level!r}")
    logger = logging.getLogger("hybridlm")
    logger.setLevel(log_level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s: %(message)s"))
        logger.addHandler(handler)


def run_app(app: Any, host: str, port: int, log_level: str = "info") -> None:
    """Serve the ASGI `app` with uvicorn until interrupted (a warning when it is reachable from
    other machines without a token)."""
    import uvicorn

    _configure_logging(log_level)
    _warn_if_public(app, host)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)


@contextmanager
def serve_in_background(
    engine: Engine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log_level: str = "warning",
    startup_timeout: float = 30.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_key: str | None = None,
) -> Iterator[str]:
    """Run the server in a thread for the duration of a `with` block; yields its base URL
    (`http://host:port/v1`). `port=0` picks a free port (bound before the server starts, so
    there is no race)."""
    app = create_app(engine, model_name, max_body_bytes=max_body_bytes, api_key=api_key)
    with run_in_background(
        app, host, port, log_level=log_level, startup_timeout=startup_timeout
    ) as url:
        yield f"{url}/v1"


@contextmanager
def run_in_background(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log_level: str = "warning",
    startup_timeout: float = 30.0,
) -> Iterator[str]:
    """Serve the ASGI `app` with uvicorn in a thread for the duration of a `with` block; yields
    `http://host:port`. `port=0` picks a free port (bound before the server starts, so there is
    no race)."""
    import uvicorn

    _warn_if_public(app, host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto TCP, not the default 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and
    # without it Nagle holds each response's body behind its headers for a delayed ACK (~40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level=log_level, access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="hybridlm-server", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"the server did not start on {host}:{sock.getsockname()[1]}")
        time.sleep(0.02)
    bound = sock.getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(startup_timeout)
        sock.close()
