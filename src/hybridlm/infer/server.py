"""OpenAI-compatible HTTP server over the continuous-batching `Engine` (FastAPI + uvicorn).

    hybridlm serve --preset tiny-super --port 8000
    OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x").completions.create(...)

Endpoints: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`,
`POST /v1/chat/completions` (both with SSE streaming and `stream_options.include_usage`),
`GET /health`, and vLLM's `POST /tokenize` ({prompt | messages (+ tools), add_special_tokens,
add_generation_prompt, return_token_strs} -> {count, max_model_len, tokens, token_strs}) and
`POST /detokenize` ({tokens} -> {prompt}).

This module is the app: `create_app` wires the routes to a `_ServedModel` (the engine, its
worker thread, the tokenizer and the limits), whose methods turn a request into engine requests
and answer it; `base_app` is the skeleton whose every error is OpenAI-shaped JSON (`_Guard`);
`serve`, `run_app` and `run_in_background` run an app with uvicorn. The rest of the server:
- `infer.protocol`: the request fields, their validation and the limits on untrusted input;
- `infer.worker`: the engine thread (`EngineWorker`) and its bridge to the event loop;
- `infer.responses`: response bodies and SSE streams, log-probs, chat replies parsed back.

Untrusted input: no request body can make the server answer 5xx (`infer.protocol` lists the
limits on size, encoding, shape and types). A bug is still an OpenAI-shaped 500 (mid-stream: an
`{"error": ...}` event ending the stream), and the keep-alive connection stays usable for the
client's next request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from .. import untrusted
from ..choices import LOG_LEVELS
from ..data import chat as chat_template
from . import grammar
from . import tools as tool_mod
from .engine import Engine
from .protocol import (
    BODY_LIMITS,
    DEFAULT_MAX_BODY_BYTES,
    MAX_CHOICES,
    MAX_COMPLETION_LOGPROBS,
    NO_SCHEMA,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    RequestBody,
    TokenizeRequest,
    bad,
    check_prompt,
    check_unsupported,
    draft_length,
    error_response,
    json_response,
    parse_body,
    read_body,
    response_format_schema,
    sampling_extras,
    sampling_params,
    schema_error,
    seeded,
    short,
)
from .responses import Job, respond
from .sampling import MAX_TOP_LOGPROBS
from .token_text import TokenText
from .worker import EngineWorker

log = logging.getLogger("hybridlm.server")


# ---------------------------------------------------------------------- the app
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
                response = error_response(err)
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, watched_send)
            else:
                await self.app(scope, receive, watched_send)
        except Exception as err:
            if started:
                raise
            log.exception("request %s: unhandled error", rid)
            message = f"internal error: {type(err).__name__}: {str(err)[:500]}"
            await error_response(APIError(500, message))(scope, receive, watched_send)
        finally:
            ms = 1000 * (time.monotonic() - t0)
            line = "request %s: %s %s -> %s (%.0f ms)"
            args = (rid, scope.get("method"), scope.get("path"), status, ms)
            log.log(logging.WARNING if status >= 500 else logging.DEBUG, line, *args)


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
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> Response:
        return error_response(schema_error(list(err.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return error_response(APIError(err.status_code, str(err.detail), code=code))

    return app


def _token_required(app: Any) -> bool:
    """Whether `app` (a `base_app`) asks every request for a token."""
    return bool(getattr(getattr(app, "state", None), "token_required", False))


async def read_json(request: Request, max_body_bytes: int) -> dict[str, Any]:
    """The request's body as a JSON object: at most `max_body_bytes` (413), valid UTF-8 JSON of
    bounded depth without NaN or lone surrogates (400; `parse_body`)."""
    return parse_body(await read_body(request, max_body_bytes))


# ---------------------------------------------------------------------- the served model
class _ServedModel:
    """One model served over HTTP: the engine, its worker thread, the tokenizer and the limits.
    The routes' handlers are its methods; `completion_job` / `chat_job` turn a parsed request
    into a `Job` (tokenising, compiling grammars: the handlers run them off the event loop)."""

    def __init__(self, engine: Engine, model_name: str, max_body_bytes: int) -> None:
        self.worker = EngineWorker(engine)
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.tokenizer = engine.tokenizer
        self.texts = TokenText(self.tokenizer)
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(engine.model.config.vocab_size)

    # -- routes
    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "hybridlm",
            "max_model_len": self.max_model_len,
        }

    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    async def get_model(self, model_id: str) -> Response:
        if model_id != self.model_name:
            raise self.unknown_model(model_id)
        return json_response(200, self.model_card())

    async def completions(self, request: Request) -> Response:
        try:
            req = await self.parse(request, CompletionRequest)
            # tokenising and compiling a grammar off the event loop: other streams keep flowing
            job = await asyncio.to_thread(self.completion_job, req, request.headers)
            return await respond(job, self.worker, request)
        except APIError as err:
            return error_response(err)

    async def chat_completions(self, request: Request) -> Response:
        try:
            req = await self.parse(request, ChatCompletionRequest)
            job = await asyncio.to_thread(self.chat_job, req, request.headers)
            return await respond(job, self.worker, request)
        except APIError as err:
            return error_response(err)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's `/tokenize`: a `prompt` is encoded as /v1/completions encodes a string prompt
        (BOS first unless `add_special_tokens` is false); `messages` as /v1/chat/completions
        renders them (the template starts with BOS; `add_special_tokens` does not apply)."""
        try:
            req = await self.parse(request, TokenizeRequest)
            if (req.prompt is None) == (req.messages is None):
                raise bad("give exactly one of prompt and messages", "prompt")
            if req.prompt is not None:
                add_bos = True if req.add_special_tokens is None else req.add_special_tokens
                ids = self.tokenizer.encode(req.prompt, add_bos=add_bos)
            else:
                if req.tools:
                    self.tool_schemas(req.tools)
                ids = self.render_chat(req.messages, req.add_generation_prompt, tools=req.tools)
            body: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len}
            body["tokens"] = ids
            body["token_strs"] = (
                [self.texts.vocab_token(t) for t in ids] if req.return_token_strs else None
            )
            return json_response(200, body)
        except APIError as err:
            return error_response(err)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's `/detokenize`: the text of token ids, as completions decode them."""
        try:
            req = await self.parse(request, DetokenizeRequest)
            if any(not 0 <= t < self.vocab_size for t in req.tokens):
                raise bad(f"tokens must be token ids in [0, {self.vocab_size})", "tokens")
            return json_response(200, {"prompt": self.tokenizer.decode(req.tokens)})
        except APIError as err:
            return error_response(err)

    # -- requests
    def unknown_model(self, name: str) -> APIError:
        return APIError(
            404,
            f"the model {short(name)} does not exist; this server serves {self.model_name!r}",
            param="model",
            code="model_not_found",
        )

    async def parse(self, request: Request, schema: type[RequestBody]) -> Any:
        data = await read_json(request, self.max_body_bytes)
        try:
            req = schema.model_validate(data)
        except ValidationError as err:
            raise schema_error(err.errors()) from None
        if req.model is not None and req.model != self.model_name:
            raise self.unknown_model(req.model)
        check_unsupported(req)
        return req

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> list[int]:
        """The token ids of a conversation, as the chat endpoint feeds them to the model."""
        try:
            text = chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kw)
        except ValueError as err:
            raise bad(str(err), "messages") from None
        except RecursionError:  # tool-call arguments: a JSON string nested too deep to decode
            raise bad("messages: tool call arguments nest too deep to parse", "messages") from None
        return self.tokenizer.encode(text)

    def tool_schemas(self, tools: Any) -> dict[str, dict[str, Any]]:
        """The offered tools' parameter schemas by name (`infer.tools`), or a 400 on `tools`."""
        try:
            return tool_mod.tool_parameters(tools)
        except ValueError as err:
            raise bad(str(err), "tools") from None

    # -- requests -> jobs
    def completion_job(self, req: CompletionRequest, headers: Any) -> Job:
        p = req.prompt
        if isinstance(p, str):
            prompts = [self.tokenizer.encode(p)]
        elif not p:
            raise bad("prompt must not be empty", "prompt")
        elif isinstance(p[0], (str, list)) and len(p) > MAX_CHOICES:  # before tokenising them
            raise bad(f"at most {MAX_CHOICES} prompts are accepted, got {len(p)}", "prompt")
        elif isinstance(p[0], str):
            prompts = [self.tokenizer.encode(s) for s in p]
        elif isinstance(p[0], int):
            prompts = [list(p)]
        else:
            prompts = [list(x) for x in p]
        for ids in prompts:
            if not ids:
                raise bad("a prompt of token ids must not be empty", "prompt")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise bad(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
            check_prompt(ids, self.max_model_len, "prompt")
        k = req.logprobs
        if k is not None:
            if not 0 <= k <= MAX_COMPLETION_LOGPROBS:
                raise bad(
                    f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {short(k)}",
                    "logprobs",
                )
            if req.max_tokens == 0 and not req.echo:
                raise bad(
                    "logprobs with max_tokens 0 return nothing; set echo to true to score the "
                    "prompt, or ask for tokens",
                    "logprobs",
                )
        sampling_extras(req, self.vocab_size)  # stop_token_ids are checked before they end grammars
        constraint, constraint_param = self.structured(req)
        return self.build_job(
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

    def chat_job(self, req: ChatCompletionRequest, headers: Any) -> Job:
        if req.max_tokens is None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        k = None
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                    f"{short(req.top_logprobs)}",
                    "top_logprobs",
                )
            if not req.logprobs:
                raise bad("top_logprobs needs logprobs set to true", "top_logprobs")
        if req.logprobs:
            k = req.top_logprobs or 0
        sampling_extras(req, self.vocab_size)  # stop_token_ids are checked before they end grammars
        tools = req.tools or None
        names = list(self.tool_schemas(tools)) if tools else []
        if req.tool_choice is not None and not tools and req.tool_choice not in ("none", "auto"):
            raise bad("tool_choice needs tools", "tool_choice")
        try:
            choice = tool_mod.tool_choice_name(req.tool_choice, names)
        except ValueError as err:
            raise bad(str(err), "tool_choice") from None
        ids = self.render_chat(req.messages, tools=tools)
        check_prompt(ids, self.max_model_len, "messages")
        forced = bool(tools) and choice not in ("auto", "none")
        constraint, constraint_param = self.structured(req)
        if forced:
            if constraint is not None:
                raise bad(
                    f"{constraint_param} and a forced tool_choice cannot both constrain the reply",
                    constraint_param,
                )
            constraint, constraint_param = (
                _compile_constraint(
                    "tools",
                    lambda: tool_mod.tool_call_constraint(
                        self.tokenizer,
                        tools,
                        req.tool_choice,
                        vocab_size=self.vocab_size,
                        parallel_tool_calls=req.parallel_tool_calls is not False,
                        stop_token_ids=req.stop_token_ids,
                    ),
                ),
                "tool_choice",
            )
        stop = [chat_template.STOP]
        return self.build_job(
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

    def structured(self, req: CompletionRequest | ChatCompletionRequest) -> tuple[Any, str]:
        """The constraint factory of `response_format` (json_object / json_schema) or vLLM's
        `structured_outputs` ({json | regex | choice | grammar | json_object}), and the field
        it came from; (None, "response_format") for free text."""
        tokenizer, vocab_size = self.tokenizer, self.vocab_size
        schema = response_format_schema(req.response_format)
        spec = req.structured_outputs
        if schema is not NO_SCHEMA and spec:
            raise bad("give response_format or structured_outputs, not both", "structured_outputs")
        stops = req.stop_token_ids
        if schema is not NO_SCHEMA:
            return _compile_constraint(
                "response_format",
                lambda: grammar.json_constraint(
                    tokenizer, schema, vocab_size=vocab_size, stop_token_ids=stops
                ),
            ), "response_format"
        if not spec:
            return None, "response_format"
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if spec.get(k)]
        if len(kinds) != 1:
            raise bad(
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
                    value = untrusted.loads(value, BODY_LIMITS, what="structured_outputs.json")
                except untrusted.UntrustedJSONError as err:
                    raise bad(str(err), "structured_outputs") from None

            def build() -> Any:
                return grammar.json_constraint(
                    tokenizer, value, vocab_size=vocab_size, stop_token_ids=stops
                )
        else:
            if kind == "choice":
                if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value):
                    raise bad(
                        "structured_outputs.choice must be a list of non-empty strings",
                        "structured_outputs",
                    )
                value = "start: " + " | ".join(json.dumps(c) for c in value)
            elif not isinstance(value, str):
                raise bad(f"structured_outputs.{kind} must be a string", "structured_outputs")
            syntax = "regex" if kind == "regex" else "lark"

            def build() -> Any:
                return grammar.grammar_constraint(
                    tokenizer, value, vocab_size=vocab_size, syntax=syntax, stop_token_ids=stops
                )

        return _compile_constraint("structured_outputs", build), "structured_outputs"

    def build_job(
        self,
        kind: Literal["completion", "chat"],
        req: GenerationRequest,
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
    ) -> Job:
        """The job of a request: its sampling parameters validated, one engine request per
        prompt and choice."""
        if len(prompts) * req.n > MAX_CHOICES:
            raise bad(f"prompts x n must be <= {MAX_CHOICES}, got {len(prompts) * req.n}", "n")
        spec = draft_length(req, headers)
        requests, echoes = [], []
        for ids in prompts:
            params = sampling_params(
                req,
                max_tokens=max_tokens,
                prompt_len=len(ids),
                max_model_len=self.max_model_len,
                default_max_tokens=default_max_tokens,
                extra_stop=extra_stop,
                speculative=spec,
                vocab_size=self.vocab_size,
                max_tokens_param=max_tokens_param,
                top_logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                constraint=constraint,
                constraint_param=constraint_param,
            )
            for j in range(req.n):
                requests.append((ids, seeded(params, j)))
                echoes.append(self.tokenizer.decode(ids) if echo else "")
        include_usage = bool(req.stream_options and req.stream_options.get("include_usage"))
        return Job(
            kind,
            self.model_name,
            req.stream,
            include_usage,
            prompts,
            requests,
            echoes,
            logprobs=logprobs,
            token_ids_as_strings=req.return_tokens_as_token_ids,
            texts=self.texts,
            tools=tools,
        )


def _compile_constraint(param: str, build: Any) -> Any:
    """A constraint factory from `infer.grammar` / `infer.tools`, or a 400 naming `param`
    (an invalid or unsupported schema, or no llguidance on this server)."""
    try:
        return build()
    except ImportError as err:
        raise bad(f"structured outputs are not available on this server: {err}", param) from None
    except ValueError as err:
        raise bad(str(err), param) from None


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
    served = _ServedModel(engine, model_name, max_body_bytes)
    worker = served.worker

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()

    app = base_app("hybridlm", lifespan=lifespan, token=api_key)
    app.state.worker = worker
    app.state.model_name = model_name
    app.get("/health")(served.health)
    app.get("/v1/models")(served.list_models)
    app.get("/v1/models/{model_id:path}")(served.get_model)
    app.post("/v1/completions")(served.completions)
    app.post("/v1/chat/completions")(served.chat_completions)
    app.post("/tokenize")(served.tokenize)
    app.post("/detokenize")(served.detokenize)
    return app


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
