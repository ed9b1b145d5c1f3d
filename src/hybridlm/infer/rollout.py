"""Rollout workers: groups of completions from the inference engine, on Ray actors or inline,
with in-flight weight updates (asynchronous RL: OlmoRL, Olmo 3 §4.4.3 "inflight updates";
Nemotron 3 Super §3.3 asynchronous GRPO; PipelineRL).

    pool = RolloutPool(model_cfg, tokenizer, model.state_dict(), executor="ray", num_workers=2)
    handle = pool.submit([RolloutRequest(key="gsm8k/17", prompt_ids=ids, group_size=8)], params)
    for handle, completions in pool.wait(timeout=60): ...
    pool.set_weights(model.state_dict(), version=step)   # fails loudly after sync_timeout_s

A `RolloutWorker` owns one `Engine` (continuous batching: the G samples of a group and all the
groups of a call decode in one batch). `set_weights` only *hands over* new weights (the call
returns at once, which is the acknowledgement the learner waits for); the worker loads them at the
next engine step boundary, so requests in flight finish with the new weights — their earlier
tokens keep the version that sampled them (`Completion.versions`), which the learner uses to bound
the policy lag and to weight tokens by truncated importance sampling.

Executors: `"ray"` runs each worker as a Ray actor process (`ray.init()` on a laptop starts a
local cluster; `ray_address` joins an existing one); the actor runs two calls at once
(`max_concurrency=2`) so that a weight update can arrive while `generate` runs. `"inline"` runs
the worker in this process, synchronously (no overlap; on-policy), for debugging and tests.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..config import ModelConfig
from ..infer.engine import Engine
from ..infer.sampling import SamplingParams
from ..model.model import HybridLM

Executor = Literal["ray", "inline"]


@dataclass
class RolloutRequest:
    """One prompt to sample `group_size` completions for (a GRPO group)."""

    key: str  # the problem's id, carried back to the learner
    prompt_ids: list[int]
    group_size: int = 1


@dataclass
class Completion:
    """One sampled completion. `token_ids` include the EOS / stop token that ended it (a policy
    must learn to stop), with `logprobs` and `versions` aligned to them; `text` excludes it."""

    key: str
    index: int  # position in its group
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the engine's log-probs (behaviour policy) under softmax(logits / T)
    versions: list[int]  # the weight version that sampled each token
    finish_reason: str
    text: str
    worker: int = 0

    @property
    def lag_versions(self) -> tuple[int, int]:
        """(oldest, newest) weight version among the tokens (both -1 for an empty completion)."""
        return (min(self.versions), max(self.versions)) if self.versions else (-1, -1)


@dataclass
class _Pending:
    state: dict[str, torch.Tensor] | None = None
    version: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class RolloutWorker:
    """An `Engine` over a private copy of the policy. Built from a config and a state dict so it
    can be constructed in another process."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        tokenizer: Any,
        state_dict: dict[str, torch.Tensor],
        *,
        version: int = 0,
        worker_id: int = 0,
        threads: int = 1,
        seed: int = 0,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if threads > 0:
            torch.set_num_threads(threads)
        with torch.device("meta"):
            model = HybridLM(model_cfg)
        model.to_empty(device="cpu")
        model.load_state_dict(state_dict, strict=True)
        self.engine = Engine(model.eval(), tokenizer, **(engine_kwargs or {}))
        self.engine.weight_version = version
        self.worker_id = worker_id
        self.seed = seed
        self._calls = 0
        self._pending = _Pending()
        # the engine is not thread-safe: one generate at a time; set_weights may come meanwhile
        self._generating = threading.Lock()

    # -- weights
    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        """Hand over new weights; they are loaded at the next engine step boundary (or by the
        next `generate`). Returns the version, as the acknowledgement."""
        with self._pending.lock:
            if version < max(self._pending.version, self.engine.weight_version):
                raise ValueError(f"weight version {version} is older than the worker's")
            self._pending.state, self._pending.version = state_dict, version
        return version

    def version(self) -> int:
        return self.engine.weight_version

    def calls(self) -> int:
        """Generation calls so far: the sampling seeds of the next call derive from it."""
        return self._calls

    def set_calls(self, calls: int) -> None:
        """Continue the sampling streams of a resumed run (after `calls` calls)."""
        self._calls = calls

    def _apply_pending(self) -> None:
        with self._pending.lock:
            state, version, self._pending.state = self._pending.state, self._pending.version, None
        if state is not None:
            self.engine.update_weights(state, version)

    # -- generation
    def generate(self, requests: list[RolloutRequest], params: dict[str, Any]) -> list[Completion]:
        """Sample every request's group in one continuous batch; returns the completions in
        request order, group members in index order."""
        with self._generating:
            return self._generate(requests, params)

    def _generate(self, requests: list[RolloutRequest], params: dict[str, Any]) -> list[Completion]:
        self._apply_pending()
        self._calls += 1
        keys: dict[str, tuple[int, int]] = {}
        for r, req in enumerate(requests):
            for g in range(req.group_size):
                # distinct, reproducible streams: (seed, worker, call, request, member)
                seed = hash((self.seed, self.worker_id, self._calls, r, g)) % 2**62
                sp = SamplingParams(**{**params, "seed": seed, "logprobs": True})
                rid = self.engine.add_request(req.prompt_ids, sp, request_id=f"{r}/{g}")
                keys[rid] = (r, g)
        done: dict[str, Any] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
            self._apply_pending()  # in-flight update between steps
        completions = []
        for rid, (r, g) in keys.items():
            out, req = done[rid], requests[r]
            tokens, logprobs, versions = (
                list(out.token_ids),
                list(out.logprobs),
                list(out.token_versions),
            )
            if out.stop_token_id is not None:
                tokens.append(out.stop_token_id)
                logprobs.append(out.stop_token_logprob)
                versions.append(versions[-1] if versions else self.engine.weight_version)
            completions.append(
                Completion(
                    key=req.key,
                    index=g,
                    prompt_ids=req.prompt_ids,
                    token_ids=tokens,
                    logprobs=logprobs,
                    versions=versions,
                    finish_reason=out.finish_reason,
                    text=out.text,
                    worker=self.worker_id,
                )
            )
        return completions


class _InlineHandle:
    def __init__(self, result: list[Completion]) -> None:
        self.result = result


class RolloutPool:
    """`num_workers` rollout workers behind one interface: `submit` (non-blocking on Ray),
    `wait` (completed calls), `set_weights` (broadcast with a timeout), `shutdown`."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        tokenizer: Any,
        state_dict: dict[str, torch.Tensor],
        *,
        executor: Executor = "ray",
        num_workers: int = 1,
        ray_address: str | None = None,
        threads_per_worker: int = 1,
        sync_timeout_s: float = 120.0,
        seed: int = 0,
        version: int = 0,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if executor not in ("ray", "inline"):
            raise ValueError(f"executor must be 'ray' or 'inline', got {executor!r}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if sync_timeout_s <= 0:
            raise ValueError(f"sync_timeout_s must be > 0, got {sync_timeout_s}")
        self.executor, self.sync_timeout_s = executor, sync_timeout_s
        self._next = 0
        self._inflight: list[Any] = []
        state = {k: v.detach().cpu() for k, v in state_dict.items()}
        kw = dict(
            threads=threads_per_worker, seed=seed, version=version, engine_kwargs=engine_kwargs
        )
        if executor == "inline":
            self.workers = [RolloutWorker(model_cfg, tokenizer, state, worker_id=0, **kw)]
            return
        import ray  # the [rl] extra

        if not ray.is_initialized():
            # a laptop: a local cluster sized for the workers; a cluster: its address
            ray.init(
                address=ray_address,
                num_cpus=None if ray_address else max(2, num_workers * threads_per_worker),
                include_dashboard=False,
                log_to_driver=False,
            )
        actor = ray.remote(num_cpus=threads_per_worker, max_concurrency=2)(RolloutWorker)
        ref = ray.put(state)
        self.workers = [
            actor.remote(model_cfg, tokenizer, ref, worker_id=i, **kw) for i in range(num_workers)
        ]
        self._ray = ray
        self._check(ray.get([w.version.remote() for w in self.workers], timeout=sync_timeout_s))

    @staticmethod
    def _check(versions: list[int]) -> None:
        assert len(set(versions)) == 1, versions

    def submit(self, requests: list[RolloutRequest], params: dict[str, Any]) -> Any:
        """Start one generation call on the next worker (round robin); returns a handle."""
        SamplingParams(**params).validate()  # a bad setting fails here, not in a worker
        w = self.workers[self._next % len(self.workers)]
        self._next += 1
        if self.executor == "inline":
            handle: Any = _InlineHandle(w.generate(requests, params))
        else:
            handle = w.generate.remote(requests, params)
        self._inflight.append(handle)
        return handle

    def wait(
        self, *, num: int = 1, timeout: float | None = None
    ) -> list[tuple[Any, list[Completion]]]:
        """Block until at least `num` submitted calls are done (or `timeout` s pass); returns
        every finished call with its completions."""
        if self.executor == "inline":
            done, self._inflight = self._inflight, []
            return [(h, h.result) for h in done]
        if not self._inflight:
            return []
        ready, rest = self._ray.wait(
            self._inflight, num_returns=min(num, len(self._inflight)), timeout=timeout
        )
        self._inflight = rest
        return [(h, self._ray.get(h)) for h in ready]

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        """Broadcast new weights to every worker; returns the seconds the hand-over took. Raises
        `TimeoutError` if a worker does not acknowledge within `sync_timeout_s` (a dead or hung
        worker must stop training, not let it run on stale rollouts)."""
        t0 = time.perf_counter()
        state = {k: v.detach().cpu() for k, v in state_dict.items()}
        if self.executor == "inline":
            self.workers[0].set_weights(state, version)
            return time.perf_counter() - t0
        ref = self._ray.put(state)
        acks = [w.set_weights.remote(ref, version) for w in self.workers]
        try:
            self._check(self._ray.get(acks, timeout=self.sync_timeout_s))
        except self._ray.exceptions.GetTimeoutError as err:
            raise TimeoutError(
                f"weight sync to {len(self.workers)} rollout workers timed out after "
                f"{self.sync_timeout_s:.0f} s (version {version})"
            ) from err
        return time.perf_counter() - t0

    def state_dict(self) -> dict[str, Any]:
        """Where the workers' sampling streams stand (round-robin position, calls per worker),
        for an exact resume; call with nothing in flight."""
        if self._inflight:
            raise RuntimeError("RolloutPool.state_dict with generation calls in flight")
        if self.executor == "inline":
            calls = [w.calls() for w in self.workers]
        else:
            calls = self._ray.get([w.calls.remote() for w in self.workers])
        return {"next": self._next, "calls": calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["calls"]) != len(self.workers):
            raise ValueError(
                f"the checkpoint's rollout pool had {len(state['calls'])} workers, this one has "
                f"{len(self.workers)}; resume with the same num_workers"
            )
        self._next = state["next"]
        if self.executor == "inline":
            for w, n in zip(self.workers, state["calls"], strict=True):
                w.set_calls(n)
        else:
            pairs = zip(self.workers, state["calls"], strict=True)
            self._ray.get([w.set_calls.remote(n) for w, n in pairs])

    def shutdown(self) -> None:
        if self.executor == "ray":
            for w in self.workers:
                self._ray.kill(w)
        self.workers, self._inflight = [], []
