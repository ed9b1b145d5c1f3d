"""Environments as services: any `Environment` behind HTTP, and `HTTPEnvironment`, the client
that the learner and the rollout workers use like a local one (the resource-server split of
NeMo Gym, Nemotron 3 Super §3.2.5: the environment runs in its own process, on its own
machine, in any language, and the trainer only speaks the protocol).

    HYBRIDLM_ENV_TOKEN=s3cret hybridlm env-serve --env calculator --set digits=5 --port 8010
    HYBRIDLM_ENV_TOKEN=s3cret hybridlm rl --set 'envs=[{kind: http, url: "http://127.0.0.1:8010"}]'

The protocol (JSON bodies; every error is `{"error": {"message", "type", "param", "code"}}`
with a 4xx status, or 500 when the environment itself failed):

    GET  /info                       -> {"protocol": 1, "name", "multi_turn", "num_problems"}
    GET  /problems/{index}           -> {"id", "messages", "metadata"}   (no answer: the server
                                        keeps the ground truth, clients cannot read it)
    POST /verify   {"problem_id", "completion"}
                                     -> {"reward", "reason", "metrics"}    (single-turn scoring)
    POST /episodes {"problem_id"}    -> {"episode_id", "messages", "tools"}          (reset)
    POST /episodes/{episode_id}/step {"reply": {"content", "tool_calls", "text"}}
                                     -> {"observation", "reward", "done", "info"}    (step)
    DELETE /episodes/{episode_id}    -> {"deleted": true}   (an episode the trainer abandons)

`messages` are OpenAI chat messages; `tools` OpenAI tool definitions (offered in the system
prompt); `reply` is the assistant message just generated (`tool_calls` as OpenAI's, at most
`MAX_TOOL_CALLS` of them, `text` the raw generated text); `observation` the messages to append
(tool results). An episode is forgotten when it is done or deleted, and the oldest live ones are
dropped beyond `max_episodes` (a step on them is a 404).

The server holds against a hostile policy and hostile clients (tests/test_env_server_hostile.py):
- **No ground truth in any reply.** A reward comes with its `reason` category ("correct",
  "wrong answer", "verification timed out", ...; `verifiers.Reward`), never the reference or
  the hidden tests, and messages quote input only as a short prefix (`untrusted.clip`). The
  verdict spelt out (`Reward.detail`, e.g. "3 != 167436654") is added as `detail` only by a
  server started with `debug_rewards` (`--debug-rewards`), for whoever runs it.
- **Verification off the event loop, with a deadline**: completions are scored in
  `rl.scoring` worker processes, `verify_timeout_s` each (a timeout is reward 0 with reason
  "verification timed out"); a verifier stuck in a regular expression cannot hold this
  process's interpreter, so other clients, `/info` included, are answered meanwhile.
- **One step at a time per episode**: a step on an episode another step is still running on
  is a 409 `episode_busy`; a step on a finished episode a 404; the turn limit is counted per
  accepted step, so an episode pays its reward exactly once.
- **Bounded input**: bodies at most `max_body_bytes` and read by the bounded JSON reader
  (`untrusted`), tool-call arguments likewise, every parser of reply text linear in its length.
- **Authentication**: with a `token` (`--token` or `HYBRIDLM_ENV_TOKEN`), every request must
  send `Authorization: Bearer <token>` (401 otherwise); `HTTPEnvironment` sends it. The server
  binds 127.0.0.1 unless told otherwise, and warns when it binds another address without a
  token. Every response carries an `X-Request-ID`; `--log-level debug` logs each request.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import urllib.error
import urllib.request
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from ..infer.protocol import DEFAULT_MAX_BODY_BYTES, APIError
from ..infer.server import base_app, read_json
from ..untrusted import JSONLimits, UntrustedJSONError, clip, loads
from .environments import Environment, Problem
from .episodes import Episode, EpisodeOver, Step
from .scoring import DEFAULT_TIMEOUT_S, DeadlineEnvironment, ScoringPool, with_deadline
from .verifiers import Reward

PROTOCOL = 1
# what the client reads of a reply (a problem's messages, a step's tool results)
_MAX_RESPONSE_BYTES = 64 << 20
_RESPONSE_LIMITS = JSONLimits(max_depth=64, max_chars=_MAX_RESPONSE_BYTES, max_items=1 << 22)
TOKEN_ENV = "HYBRIDLM_ENV_TOKEN"  # the shared secret, for the server and its clients
MAX_TOOL_CALLS = 32  # tool calls one reply may make


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise APIError(400, f"'{name}' must be {names}", param=name, code="invalid_value")
    return value


def _reply(data: Mapping[str, Any]) -> dict[str, Any]:
    """The step's `reply`, checked: an object with string/null `content`, a list of at most
    `MAX_TOOL_CALLS` tool-call objects, string `text`."""
    reply = _field(data, "reply", dict)
    content = reply.get("content")
    if content is not None and not isinstance(content, str):
        raise APIError(400, "'reply.content' must be a string or null", param="reply.content")
    calls = reply.get("tool_calls") or []
    if not isinstance(calls, list):
        raise APIError(400, "'reply.tool_calls' must be a list", param="reply.tool_calls")
    if len(calls) > MAX_TOOL_CALLS:
        raise APIError(
            400, f"a reply makes at most {MAX_TOOL_CALLS} tool calls, got {len(calls)}",
            param="reply.tool_calls",
        )  # fmt: skip
    for i, call in enumerate(calls):
        where = f"reply.tool_calls[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"'{where}' needs a 'function' with a string 'name'", param=where)
        if not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise APIError(
                400, f"'{where}.function.arguments' must be a JSON string or object", param=where
            )
        if not isinstance(call.get("id", ""), str):
            raise APIError(400, f"'{where}.id' must be a string", param=where)
    text = reply.get("text", content or "")
    if not isinstance(text, str):
        raise APIError(400, "'reply.text' must be a string", param="reply.text")
    return {"role": "assistant", "content": content, "tool_calls": calls, "text": text}


def _reward_body(r: Reward, debug: bool) -> dict[str, Any]:
    out = {"reward": float(r.value), "reason": r.reason, "metrics": dict(r.metrics)}
    if debug and r.detail:
        out["detail"] = r.detail
    return out


class _Episodes:
    """The server's live episodes, oldest first (past `limit` the oldest is closed), and the
    ones a step is running on: one step at a time per episode (module docstring)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.live: OrderedDict[str, Episode] = OrderedDict()
        self.busy: set[str] = set()
        self.lock = threading.Lock()

    def add(self, ep: Episode) -> str:
        """A new episode's id (older ones past the limit are closed)."""
        episode_id = uuid.uuid4().hex
        with self.lock:
            self.live[episode_id] = ep
            evicted = []
            while len(self.live) > self.limit:
                old_id, old = self.live.popitem(last=False)
                self.busy.discard(old_id)
                evicted.append(old)
        for old in evicted:
            old.close()
        return episode_id

    def claim(self, episode_id: str) -> Episode:
        """The live episode, marked busy until `release`; 404 when unknown, 409 when a step is
        already running on it."""
        with self.lock:
            ep = self.live.get(episode_id)
            if ep is not None and episode_id in self.busy:
                raise APIError(
                    409, "a step is already running on this episode; send one at a time",
                    param="episode_id", code="episode_busy",
                )  # fmt: skip
            if ep is not None:
                self.busy.add(episode_id)
        if ep is None:
            raise APIError(
                404, f"unknown episode {clip(episode_id)} (done, deleted or expired)",
                param="episode_id", code="not_found",
            )  # fmt: skip
        return ep

    def release(self, episode_id: str) -> None:
        with self.lock:
            self.busy.discard(episode_id)

    def forget(self, episode_id: str, ep: Episode) -> None:
        with self.lock:
            if self.live.get(episode_id) is ep:
                del self.live[episode_id]
        self.release(episode_id)
        ep.close()


def create_env_app(
    env: Environment,
    *,
    max_episodes: int = 4096,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    expose_metadata: bool = False,
    token: str | None = None,
    verify_timeout_s: float = DEFAULT_TIMEOUT_S,
    verify_workers: int = 1,
    debug_rewards: bool = False,
):
    """The FastAPI app serving `env` (module docstring). Problems go out without their
    metadata unless `expose_metadata` (it may hold what solves them: operands, a reference
    solution). `verify_timeout_s` 0 scores in this process without a deadline (an environment
    that bounds its own scoring, `own_deadline`, always does)."""
    if max_episodes < 1:
        raise ValueError(f"max_episodes must be >= 1, got {max_episodes}")
    if verify_timeout_s < 0:
        raise ValueError(f"verify_timeout_s must be >= 0, got {verify_timeout_s}")
    by_id = {p.id: i for i, p in enumerate(env)}
    episodes = _Episodes(max_episodes)
    pool = ScoringPool(verify_workers) if verify_timeout_s > 0 else None
    served = with_deadline(env, timeout_s=verify_timeout_s, pool=pool) if pool else env

    @asynccontextmanager
    async def lifespan(app: Any):
        yield
        if pool is not None:
            await run_in_threadpool(pool.close)

    app = base_app(f"hybridlm environment {env.name}", lifespan=lifespan, token=token)

    def problem(problem_id: Any) -> Problem:
        if not isinstance(problem_id, str) or problem_id not in by_id:
            raise APIError(
                404, f"unknown problem_id {clip(problem_id)}", param="problem_id",
                code="not_found",
            )  # fmt: skip
        return env[by_id[problem_id]]

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return {
            "protocol": PROTOCOL,
            "name": env.name,
            "multi_turn": bool(env.multi_turn),
            "num_problems": len(env),
        }

    @app.get("/problems/{index}")
    async def get_problem(index: int) -> dict[str, Any]:
        if not 0 <= index < len(env):
            raise APIError(404, f"problem index {index} not in [0, {len(env)})", code="not_found")
        p = env[index]
        metadata = dict(p.metadata) if expose_metadata else {}
        return {"id": p.id, "messages": [dict(m) for m in p.messages], "metadata": metadata}

    @app.post("/verify")
    async def verify(request: Request) -> dict[str, Any]:
        data = await read_json(request, max_body_bytes)
        p = problem(data.get("problem_id"))
        completion = _field(data, "completion", str)
        scorer = served.env_of(p) if hasattr(served, "env_of") else served
        if isinstance(scorer, DeadlineEnvironment):  # awaited: no thread held while it runs
            r = await asyncio.wrap_future(scorer.submit(p, completion))
        else:
            r = await run_in_threadpool(served.score, p, completion)
        return _reward_body(r, debug_rewards)

    @app.post("/episodes")
    async def reset(request: Request) -> dict[str, Any]:
        data = await read_json(request, max_body_bytes)
        p = problem(data.get("problem_id"))
        ep = served.episode()
        messages = await run_in_threadpool(ep.reset, p)
        episode_id = episodes.add(ep)
        return {"episode_id": episode_id, "messages": messages, "tools": ep.tool_specs()}

    @app.post("/episodes/{episode_id}/step")
    async def step(episode_id: str, request: Request) -> dict[str, Any]:
        data = await read_json(request, max_body_bytes)
        reply = _reply(data)
        ep = episodes.claim(episode_id)
        try:
            out = await run_in_threadpool(ep.step, reply)
        except EpisodeOver:
            episodes.forget(episode_id, ep)
            raise APIError(
                404, "the episode is over", param="episode_id", code="not_found"
            ) from None
        except BaseException:
            episodes.release(episode_id)
            raise
        if out.done:
            episodes.forget(episode_id, ep)
        else:
            episodes.release(episode_id)
        info = out.info if debug_rewards else {k: v for k, v in out.info.items() if k != "detail"}
        return {
            "observation": out.observation,
            "reward": float(out.reward),
            "done": bool(out.done),
            "info": info,
        }

    @app.delete("/episodes/{episode_id}")
    async def delete(episode_id: str) -> dict[str, Any]:
        ep = episodes.claim(episode_id)
        await run_in_threadpool(episodes.forget, episode_id, ep)
        return {"deleted": True}

    return app


# ---------------------------------------------------------------------- the client
class HTTPError(RuntimeError):
    """The environment server refused a request or could not be reached."""


class HTTPEnvironment(Environment):
    """An environment served over HTTP (module docstring), usable wherever a local one is:
    problems are fetched on first use and cached, `score` asks `/verify`, and `episode()` gives
    episodes stepped by the server. `token` (default: `$HYBRIDLM_ENV_TOKEN`) is sent as a bearer
    token. Holds only its URL, token and caches, so Ray ships it to the rollout workers as
    is."""

    own_deadline = True  # the server scores under its own deadline; `timeout` bounds a call

    def __init__(self, url: str, *, timeout: float = 60.0, token: str | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"an environment URL starts with http:// or https://, got {url!r}")
        self.url, self.timeout = url.rstrip("/"), timeout
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        info = self.call("GET", "/info")
        if info.get("protocol") != PROTOCOL:
            raise HTTPError(
                f"{url} speaks environment protocol {info.get('protocol')!r}, not {PROTOCOL}"
            )
        self.name = str(info["name"])
        self.multi_turn = bool(info["multi_turn"])  # type: ignore[misc]
        self._len = int(info["num_problems"])
        self._problems: dict[int, Problem] = {}

    def call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return loads(resp.read(_MAX_RESPONSE_BYTES + 1), _RESPONSE_LIMITS, what="reply")
        except urllib.error.HTTPError as err:
            try:
                message = loads(err.read(1 << 16), what="error")["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = err.reason
            raise HTTPError(f"{method} {self.url}{path}: {err.code} {str(message)[:500]}") from None
        except UntrustedJSONError as err:  # a server that is not one of ours, or broken
            raise HTTPError(f"{method} {self.url}{path}: {err}") from None
        except (urllib.error.URLError, OSError) as err:
            raise HTTPError(f"{method} {self.url}{path}: {err}") from None

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Problem:
        if not 0 <= index < self._len:
            raise IndexError(index)
        if index not in self._problems:
            p = self.call("GET", f"/problems/{index}")
            self._problems[index] = Problem(
                id=p["id"],
                messages=tuple(p["messages"]),
                answer=None,  # the server keeps it
                metadata=p.get("metadata") or {},
                env=self.name,
            )
        return self._problems[index]

    def score(self, problem: Problem, completion: str) -> Reward:
        r = self.call("POST", "/verify", {"problem_id": problem.id, "completion": completion})
        return Reward(float(r["reward"]), str(r.get("reason", "")), dict(r.get("metrics") or {}))

    def episode(self, scorer: Environment | None = None) -> Episode:
        return HTTPEpisode(self)  # scored by the server

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_problems": {}}


class HTTPEpisode(Episode):
    """An episode stepped by the environment server; `close()` deletes it there when the
    trainer abandons it (a budget cut the reply)."""

    def __init__(self, env: HTTPEnvironment) -> None:
        self.env = env
        self.episode_id: str | None = None
        self._tools: list[dict[str, Any]] = []

    def reset(self, problem: Problem) -> list[dict[str, Any]]:
        out = self.env.call("POST", "/episodes", {"problem_id": problem.id})
        self.episode_id, self._tools = out["episode_id"], list(out.get("tools") or [])
        return list(out["messages"])

    def tool_specs(self) -> list[dict[str, Any]]:
        return self._tools

    def step(self, reply: Mapping[str, Any]) -> Step:
        if self.episode_id is None:
            raise RuntimeError("step() before reset()")
        body = {k: reply.get(k) for k in ("content", "tool_calls", "text") if k in reply}
        out = self.env.call("POST", f"/episodes/{self.episode_id}/step", {"reply": body})
        if out["done"]:
            self.episode_id = None
        return Step(list(out["observation"]), float(out["reward"]), bool(out["done"]),
                    dict(out.get("info") or {}))  # fmt: skip

    def close(self) -> None:
        if self.episode_id is not None:
            episode_id, self.episode_id = self.episode_id, None
            try:
                self.env.call("DELETE", f"/episodes/{episode_id}")
            except HTTPError:  # already expired there: nothing to free
                pass


__all__ = ["HTTPEnvironment", "HTTPEpisode", "HTTPError", "create_env_app"]
