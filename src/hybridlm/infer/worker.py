"""The server's engine thread (`infer.server`): `EngineWorker` owns the engine, `Generation` is
the engine requests of one HTTP request as the event loop sees them.

Threading: the `Engine` is not thread-safe, so exactly one background thread (`EngineWorker`)
owns it. Request handlers put commands on a thread-safe queue; the worker drains the queue,
loops `engine.step()` while any request is unfinished and blocks on the queue otherwise. Each
HTTP request owns an `asyncio.Queue` that the worker feeds through `loop.call_soon_threadsafe`.
A client that disconnects aborts its requests; an engine exception fails only the requests in
flight (500) and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from .engine import Engine, RequestOutput
from .protocol import APIError, bad
from .sampling import SamplingParams

log = logging.getLogger("hybridlm.server")  # the server's one logger


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


class Generation:
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
        return bad(str(err))
    return APIError(500, f"the engine failed: {type(err).__name__}: {err}")
