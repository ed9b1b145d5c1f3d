"""The server's responses (`infer.server`): a validated request (`Job`) run on the engine worker
and answered as one JSON body or as an SSE stream, with usage, speculation statistics and
log-probs, chat replies parsed into reasoning, content and tool calls.

Responses carry `usage`, and with speculation a top-level `speculative` field with the
acceptance statistics.

Log-probs are those of the raw model distribution, log_softmax of the logits before
temperature, penalties, bias and masks (vLLM's default `logprobs_mode`), -inf written as -9999.
A token's `token` string is its text, `"bytes:\\xNN..."` when it is part of a UTF-8 character,
or a special token's name; `bytes` are its raw UTF-8 bytes (`infer.token_text`). Streamed
chunks carry the log-probs of the tokens whose text they release; concatenated, they equal the
non-streamed ones.

Chat replies are parsed back with the chat template: a `<think>` block becomes
`reasoning_content` and `<tool_call>` lines become `tool_calls` (finish reason "tool_calls"),
streamed as separate deltas. With `tools`, only calls to the offered tools are parsed
(`infer.tools`: ids `call_...`, `content` None when the reply is only calls; `tool_choice`
"none" leaves the text as it is); without, any `<tool_call>` line is (`data.chat`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from starlette.responses import Response, StreamingResponse

from ..data import chat as chat_template
from . import tools as tool_mod
from .engine import RequestOutput
from .protocol import APIError, json_response, sse
from .sampling import SamplingParams, TokenLogprob
from .speculative import merge_stats
from .token_text import Offsets, TokenText
from .worker import EngineWorker, Generation

log = logging.getLogger("hybridlm.server")  # the server's one logger

MIN_LOGPROB = -9999.0  # what -inf becomes in JSON (OpenAI's and vLLM's)


# ---------------------------------------------------------------------- jobs
@dataclass
class Job:
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


# ---------------------------------------------------------------------- bodies
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
    """One stats dict for a response: the single choice's, or the counts summed over its
    choices (`infer.speculative.merge_stats`)."""
    stats = [s for s in stats if s is not None]
    if not stats:
        return None
    return spec_stats_dict(stats[0]) if len(stats) == 1 else merge_stats(stats)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# ---------------------------------------------------------------------- answering a job
async def respond(job: Job, worker: EngineWorker, request: Request) -> Response:
    """Run `job` on the engine `worker` and answer it: an SSE stream, or one JSON body once every
    choice finished (the client leaving first aborts its requests)."""
    gen = Generation(worker, "cmpl" if job.kind == "completion" else "chatcmpl")
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
        return json_response(499, APIError(499, "client closed the request").body())
    return json_response(200, _final_body(job, gen, collect.result()))


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


async def _collect(gen: Generation) -> dict[int, RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async for idx, out in gen.outputs():
        if out.finished:
            final[idx] = out
    return final


def _chat_finish(reason: str | None, message: dict[str, Any]) -> str | None:
    """OpenAI reports "tool_calls" when a turn that stopped by itself called tools."""
    return "tool_calls" if reason == "stop" and message.get("tool_calls") else reason


def _final_body(job: Job, gen: Generation, final: dict[int, RequestOutput]) -> dict[str, Any]:
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


# ---------------------------------------------------------------------- chat replies
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


# ---------------------------------------------------------------------- log-probs and streams
def _completion_choice_logprobs(job: Job, i: int, out: RequestOutput) -> dict[str, list]:
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

    def __init__(self, job: Job, start: int) -> None:
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


async def _stream(job: Job, gen: Generation) -> AsyncIterator[bytes]:
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
        return sse(body)

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
        yield sse("[DONE]")
    except APIError as err:
        yield sse(err.body())
    except Exception as err:  # a bug: end the stream with an error event, not a cut connection
        log.exception("streaming failed")
        yield sse(APIError(500, f"internal error: {type(err).__name__}: {str(err)[:500]}").body())
    finally:
        gen.abort()
