"""Verification with a deadline, in worker processes: a slow or crashing verifier costs its own
completion a zero reward, never the learner, the environment server or other clients.

In RL the policy writes whatever earns reward or breaks the loop, and a verifier is ordinary
code (regular expressions, SymPy, Math-Verify) that holds the interpreter while it runs: a
regular expression that backtracks on a megabyte of whitespace cannot be interrupted by a
thread, and holds the GIL, so every other request of an environment server and the learner's
own loop stop with it. The parsers of `rl.verifiers` are linear in their input
(tests/test_untrusted_text.py), and this module is the guarantee behind them, for every
verifier, including an environment a user writes:

    env = with_deadline(env, timeout_s=10)     # scored in a worker process, 10 s per completion
    env.score_many(problems, completions)      # as before; a timeout is reward 0

`ScoringPool` keeps `workers` processes (`python -m hybridlm.rl.scoring`: a fresh interpreter
with the caller's `sys.path`, which inherits none of its threads, locks or model) that each hold
the environments registered with the pool, and scores one completion at a time per worker. A
completion still running at its deadline gets `Reward(0.0, "verification timed out")` with the
metric `verify_timeout` 1; its worker is killed and replaced. A verifier that raises, or a
worker that dies, gives `Reward(0.0, "verifier error")` with `verify_error` 1 (the exception in
`detail`, logged once per kind): the learner's per-environment metrics show both, so a broken
verifier is visible rather than a silent zero.

`DeadlineEnvironment` is the environment seen through a pool: `score` / `score_many` go to the
pool, `submit` gives a `Future` (the environment server awaits it without holding a thread),
and its episodes score their final reply through it (`Environment.episode(scorer)`).
Environments whose scoring bounds its own time (`Environment.own_deadline`: code in the sandbox,
an environment server, a judge model) are not wrapped. An environment that cannot be pickled, or
unpickled by a worker (a class defined in a script's `__main__`), and a pool whose workers cannot
start, fall back to scoring in-process, without a deadline, with a warning.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from .environments import Environment, MixtureEnvironment, Problem
from .episodes import Episode
from .verifiers import Reward

log = logging.getLogger("hybridlm.scoring")

DEFAULT_TIMEOUT_S = 10.0
_START_TIMEOUT_S = 120.0  # a fresh worker imports the environment's modules (torch among them)


def timed_out(timeout_s: float) -> Reward:
    return Reward(
        0.0,
        "verification timed out",
        {"verify_timeout": 1.0},
        detail=f"the verifier ran longer than {timeout_s:g} s; its worker was replaced",
    )


def verifier_error(detail: str) -> Reward:
    return Reward(0.0, "verifier error", {"verify_error": 1.0}, detail=detail)


def _worker_main(conn: Connection) -> None:
    """A scoring worker: holds the registered environments, scores one completion per job."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    envs: dict[int, Environment] = {}
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if msg[0] == "env":
            try:
                envs[msg[1]] = pickle.loads(msg[2])
                conn.send(("loaded", msg[1], None))  # the job's deadline starts now
            except Exception as err:  # noqa: BLE001 - the parent falls back to in-process
                why = f"{type(err).__name__}: {str(err)[:500]}"
                if isinstance(err, (AttributeError, ImportError)):
                    why += " (a worker imports the environment's class by its module's name)"
                conn.send(("loaded", msg[1], why))
            continue
        _, job, key, problem, completion = msg
        try:
            out: Any = ("ok", job, envs[key].score(problem, completion))
        except Exception as err:  # noqa: BLE001 - the verifier's bug costs its reward only
            out = ("error", job, f"{type(err).__name__}: {str(err)[:500]}")
        conn.send(out)


class PoolUnavailable(RuntimeError):
    """The pool cannot score this environment (its workers do not start, or cannot load it)."""


@dataclass
class _Job:
    id: int
    key: int
    problem: Problem
    completion: str
    timeout_s: float
    future: Future = field(default_factory=Future)


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    envs: set[int] = field(default_factory=set)
    job: _Job | None = None
    job_start: float = 0.0


class ScoringPool:
    """`workers` scoring processes (module docstring). Thread-safe: any thread may `submit`;
    one dispatcher thread feeds the workers and enforces the deadlines."""

    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"a scoring pool needs at least one worker, got {workers}")
        self._n = workers
        self._envs: dict[int, bytes] = {}
        self._keys = itertools.count()
        self._jobs = itertools.count()
        self._pending: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._closed = False
        self._errors_logged: set[str] = set()
        self._thread: threading.Thread | None = None
        self._failed_starts = 0
        self.broken: str | None = None  # why the workers cannot start
        self._unloadable: dict[int, str] = {}  # env key -> why a worker could not load it

    # -------------------------------------------------------------- the callers' side
    def register(self, env: Environment) -> int:
        """Ship `env` to the workers (pickled once); the key names it in `submit`.
        `TypeError` when it cannot be pickled."""
        try:
            blob = pickle.dumps(env)
        except Exception as err:  # noqa: BLE001 - pickle raises many types
            raise TypeError(f"environment {env.name!r} cannot be pickled: {err}") from None
        with self._lock:
            key = next(self._keys)
            self._envs[key] = blob
        return key

    def submit(self, key: int, problem: Problem, completion: str, timeout_s: float) -> Future:
        """The reward of one completion, as a `Future` (never an exception: a timeout or a
        verifier error is a zero `Reward`, module docstring)."""
        job = _Job(next(self._jobs), key, problem, completion, timeout_s)
        with self._lock:
            if self._closed:
                raise RuntimeError("the scoring pool is closed")
            if self.broken or key in self._unloadable:
                raise PoolUnavailable(self.broken or self._unloadable[key])
            self._pending.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._dispatch, name="hybridlm-scoring", daemon=True
                )
                self._thread.start()
        self._wake()
        return job.future

    def close(self) -> None:
        """Stop the workers; pending completions get a verifier error."""
        with self._lock:
            self._closed = True
        self._wake()
        if self._thread is not None:
            self._thread.join(10)
        for w in self._workers:
            self._stop(w)
        self._workers.clear()
        for job in self._pending:
            job.future.set_result(verifier_error("the scoring pool closed"))
        self._pending.clear()

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # the buffer is full: the dispatcher is awake anyway
            pass

    # -------------------------------------------------------------- the dispatcher
    def _spawn(self) -> _Worker:
        parent, child = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridlm.rl.scoring", str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child.close()
        return _Worker(proc, Connection(parent.detach()))

    @staticmethod
    def _stop(w: _Worker) -> None:
        if w.proc.poll() is None:
            w.proc.kill()
        try:
            w.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        w.conn.close()

    def _finish(self, w: _Worker, reward: Reward) -> None:
        job, w.job = w.job, None
        if job is not None and not job.future.done():
            job.future.set_result(reward)

    def _replace(self, w: _Worker) -> None:
        self._stop(w)
        self._workers[self._workers.index(w)] = self._spawn()

    def _error(self, w: _Worker, detail: str) -> None:
        kind = detail.split(":", 1)[0]
        if kind not in self._errors_logged:
            self._errors_logged.add(kind)
            log.warning("verifier error (reward 0; logged once per kind): %s", detail)
        self._finish(w, verifier_error(detail))

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                while len(self._workers) < self._n:
                    self._workers.append(self._spawn())
                for w in self._workers:
                    if w.ready and w.job is None and self._pending:
                        job = self._pending.popleft()
                        try:
                            if job.key not in w.envs:
                                w.conn.send(("env", job.key, self._envs[job.key]))
                                w.envs.add(job.key)
                            w.conn.send(("job", job.id, job.key, job.problem, job.completion))
                        except (OSError, ValueError):  # a dead worker: replaced below
                            self._pending.appendleft(job)
                            w.ready = False
                            continue
                        w.job, w.job_start = job, time.monotonic()
            now = time.monotonic()
            deadlines = [w.job_start + w.job.timeout_s for w in self._workers if w.job]
            deadlines += [w.started + _START_TIMEOUT_S for w in self._workers if not w.ready]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            ready = wait([self._wake_r, *(w.conn for w in self._workers)], timeout)
            if self._wake_r in ready:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            for w in list(self._workers):
                if w.conn in ready:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):  # the worker died (killed, out of memory)
                        try:
                            code = w.proc.wait(1)
                        except subprocess.TimeoutExpired:
                            code = None
                        if w.job is not None:
                            self._error(w, f"WorkerDied: exit code {code}")
                        if not w.ready:
                            self._start_failed(f"a scoring worker exited with code {code}")
                        self._replace(w)
                        continue
                    if msg[0] == "ready":
                        w.ready, self._failed_starts = True, 0
                    elif msg[0] == "loaded" and msg[2] is not None:  # cannot load the env
                        self._unloadable[msg[1]] = msg[2]
                        w.envs.discard(msg[1])
                        job, w.job = w.job, None
                        if job is not None:
                            job.future.set_exception(PoolUnavailable(msg[2]))
                    elif msg[0] == "loaded":
                        w.job_start = time.monotonic()
                    elif w.job is not None and msg[1] == w.job.id:
                        if msg[0] == "ok":
                            self._finish(w, msg[2])
                        else:
                            self._error(w, msg[2])
                elif w.job is not None and time.monotonic() > w.job_start + w.job.timeout_s:
                    self._finish(w, timed_out(w.job.timeout_s))
                    self._replace(w)
                elif not w.ready and time.monotonic() > w.started + _START_TIMEOUT_S:
                    self._start_failed(f"a scoring worker did not start in {_START_TIMEOUT_S} s")
                    self._replace(w)
            if self.broken:
                self._fail_all()
                return

    def _start_failed(self, why: str) -> None:
        self._failed_starts += 1
        if self._failed_starts >= 3:
            self.broken = why

    def _fail_all(self) -> None:
        """The workers cannot start: every waiting caller falls back (`PoolUnavailable`)."""
        with self._lock:
            jobs = list(self._pending) + [w.job for w in self._workers if w.job]
            self._pending.clear()
            for w in self._workers:
                w.job = None
                self._stop(w)
            self._workers.clear()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(PoolUnavailable(self.broken))


_SHARED: dict[int, ScoringPool] = {}  # per process id: a pool is not shared across a fork
_SHARED_LOCK = threading.Lock()


def shared_pool() -> ScoringPool:
    """This process's default pool (one worker; `HYBRIDLM_VERIFY_WORKERS` sets more), made on
    first use: what `DeadlineEnvironment` uses when given none, e.g. after Ray shipped it to a
    rollout worker."""
    with _SHARED_LOCK:
        pool = _SHARED.get(os.getpid())
        if pool is None:
            pool = ScoringPool(int(os.environ.get("HYBRIDLM_VERIFY_WORKERS", "1")))
            _SHARED[os.getpid()] = pool
        return pool


class DeadlineEnvironment(Environment):
    """`env` scored through a `ScoringPool` with `timeout_s` per completion (module
    docstring). Problems, episodes and sampling are `env`'s own."""

    def __init__(
        self, env: Environment, *, timeout_s: float = DEFAULT_TIMEOUT_S, pool: Any = None
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the verification deadline must be > 0 s, got {timeout_s}")
        self.inner, self.timeout_s, self._pool = env, float(timeout_s), pool
        self.name = env.name
        self._key: int | None = None
        self._in_process = False
        self._lock = threading.Lock()

    @property
    def multi_turn(self) -> bool:  # type: ignore[override]
        return self.inner.multi_turn

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Problem:
        return self.inner[index]

    def sample(self, n: int, *, seed: int = 0) -> list[Problem]:
        return self.inner.sample(n, seed=seed)

    def episode(self, scorer: Environment | None = None) -> Episode:
        return self.inner.episode(scorer or self)

    def __getattr__(self, name: str) -> Any:  # the wrapped environment's other attributes
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _registered(self) -> int | None:
        """This environment's key in the pool (registered on first use), or None when it is
        scored in this process."""
        with self._lock:
            if self._in_process or self._key is not None:
                return None if self._in_process else self._key
            self._pool = self._pool or shared_pool()
            try:
                self._key = self._pool.register(self.inner)
                return self._key
            except TypeError as err:
                why = str(err)
        self._fall_back(why)
        return None

    def _fall_back(self, why: str) -> None:
        with self._lock:
            if not self._in_process:
                log.warning(
                    "environment %r is scored in this process, without a deadline: %s",
                    self.name,
                    why,
                )
                self._in_process = True

    def submit(self, problem: Problem, completion: str) -> Future:
        """The reward of one completion as a `Future`. Where the pool cannot score this
        environment (`PoolUnavailable`, when submitting or later), it is scored in this process
        instead (`_fall_back`), so a caller never sees the pool's failure."""
        key = self._registered()
        if key is not None:
            try:
                pooled = self._pool.submit(key, problem, completion, self.timeout_s)
            except PoolUnavailable as err:
                self._fall_back(str(err))
            else:
                out: Future = Future()
                pooled.add_done_callback(lambda f: self._settle(out, f, problem, completion))
                return out
        fut: Future = Future()
        _resolve(fut, self.inner.score, problem, completion)
        return fut

    def _settle(self, out: Future, pooled: Future, problem: Problem, completion: str) -> None:
        """`out` from the pool's future; a `PoolUnavailable` there is scored in this process,
        on a thread of its own (this runs on the pool's dispatcher)."""
        err = pooled.exception()
        if err is None:
            out.set_result(pooled.result())
            return
        self._fall_back(str(err))
        threading.Thread(
            target=_resolve, args=(out, self.inner.score, problem, completion), daemon=True
        ).start()

    def score(self, problem: Problem, completion: str) -> Reward:
        return self.submit(problem, completion).result()

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[Reward]:
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        futures = [self.submit(p, c) for p, c in zip(problems, completions, strict=True)]
        return [f.result() for f in futures]

    def __getstate__(self) -> dict[str, Any]:  # a pool stays in its process (Ray ships envs)
        state = {**self.__dict__, "_pool": None, "_key": None}
        state.pop("_lock")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _resolve(fut: Future, fn: Any, *args: Any) -> None:
    """`fut` set to `fn(*args)`, or to the exception it raised."""
    try:
        fut.set_result(fn(*args))
    except Exception as err:  # noqa: BLE001 - the caller's `result()` raises it
        fut.set_exception(err)


def with_deadline(
    env: Environment, *, timeout_s: float = DEFAULT_TIMEOUT_S, pool: ScoringPool | None = None
) -> Environment:
    """`env` with its verification under a deadline: a mixture's environments one by one,
    environments that bound their own scoring (`own_deadline`) as they are."""
    if isinstance(env, MixtureEnvironment):
        leaves = [with_deadline(e, timeout_s=timeout_s, pool=pool) for e in env.envs.values()]
        out = MixtureEnvironment(leaves, [env.weights[e.name] for e in env.envs.values()])
        out.weights = dict(env.weights)  # the very same floats: the same draws
        return out
    if isinstance(env, DeadlineEnvironment) or env.own_deadline:
        return env
    return DeadlineEnvironment(env, timeout_s=timeout_s, pool=pool)


if __name__ == "__main__":  # a worker: `python -m hybridlm.rl.scoring FD` (ScoringPool._spawn)
    _worker_main(Connection(int(sys.argv[1])))


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PoolUnavailable",
    "DeadlineEnvironment",
    "ScoringPool",
    "shared_pool",
    "with_deadline",
]
