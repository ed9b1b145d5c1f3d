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

Executors: `"ray"` runs each worker as a Ray actor process, with a GPU of its own when the
cluster has them (`worker_gpus`), on the CPU otherwise (`ray.init()` on a laptop starts a
local cluster; `ray_address` joins an existing one). The actor runs three calls at once
(`max_concurrency=3`): two `generate` calls share the engine's continuous batch, and a weight
update can arrive while they run. `"inline"` runs the worker in this process, synchronously
(no overlap; on-policy), for debugging and tests.

A request with a `problem` is rolled out as a multi-turn episode of the worker's environment
(`roll_out`: each turn a request of the continuous batch, tool results appended between turns,
`Completion.mask` 0 on them); a request without one is a plain completion of its prompt.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from ..config import ModelConfig
from ..data.chat import STOP, continuation, parse_assistant, render
from ..infer.engine import Engine
from ..infer.sampling import SamplingParams
from ..model.model import HybridLM

Executor = Literal["ray", "inline"]


@dataclass
class RolloutRequest:
    """One prompt to sample `group_size` completions for (a GRPO group). With a `problem`, each
    completion is a multi-turn episode of the worker's environment on it (`rl.episodes`; the
    prompt is then rendered by the episode and `prompt_ids` is ignored)."""

    key: str  # the problem's id, carried back to the learner
    prompt_ids: list[int]
    group_size: int = 1
    problem: Any = None


@dataclass
class Completion:
    """One sampled completion. `token_ids` include the EOS / stop token that ended it (a policy
    must learn to stop), with `logprobs` and `versions` aligned to them; `text` excludes it.

    An episode's completion is everything after its opening prompt: the generated turns and,
    between them, the environment's tokens (tool results, the next turn's header), which `mask`
    marks 0 (their `logprobs` 0.0, `versions` -1); `reward` is the episode's, `turns` its replies
    and `info` the environment's last answer. A plain completion has `mask` None (every token
    generated) and `reward` None (scored by the learner)."""

    key: str
    index: int  # position in its group
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the engine's log-probs (behaviour policy) under softmax(logits / T)
    versions: list[int]  # the weight version that sampled each token (-1: not sampled)
    finish_reason: str
    text: str
    worker: int = 0
    mask: list[int] | None = None
    reward: float | None = None
    turns: int = 1
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def loss_mask(self) -> list[int]:
        """1 on the tokens the policy generated."""
        return [1] * len(self.token_ids) if self.mask is None else self.mask

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) if self.mask is None else sum(self.mask)

    @property
    def lag_versions(self) -> tuple[int, int]:
        """(oldest, newest) weight version among the sampled tokens (both -1 for none)."""
        v = [x for x in self.versions if x >= 0]
        return (min(v), max(v)) if v else (-1, -1)


# ---------------------------------------------------------------------- episodes
# Multi-turn rollouts (Nemotron 3 Super §3.2.5: the model alternates with an environment). The
# environments and episodes are `rl.environments` / `rl.episodes`, which build on this module,
# so they are named here by what the loop uses: an Environment has `episode()`; an Episode has
# `reset(problem) -> messages`, `tool_specs()`, `step(reply) -> (observation, reward, done,
# info)` (`rl.episodes.Step`) and `close()`; a Problem is whatever the environment's episodes take.
Environment = Any
Episode = Any
Problem = Any


@dataclass
class EpisodeResult:
    """A finished episode: the whole token sequence (prompt, generated turns, the tokens
    between turns), `loss_mask` 1 on generated tokens, and per token the behaviour log-prob and
    weight version (None / -1 where not generated). `finish_reason` is the last turn's ("stop",
    or "length" when a budget cut it) and `text` the last reply's text."""

    problem: Problem
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    versions: list[int]
    reward: float
    turns: int
    messages: list[dict[str, Any]]
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = "stop"
    text: str = ""

    @classmethod
    def start(
        cls, problem: Problem, prompt_ids: Sequence[int], messages: Sequence[Mapping] = ()
    ) -> EpisodeResult:
        """An episode (or one plain generation) before its first turn."""
        res = cls(problem, [], [], [], [], 0.0, 0, [dict(m) for m in messages])
        res.append_context(prompt_ids)
        return res

    def append_context(self, ids: Sequence[int]) -> None:
        """Tokens the policy did not generate (the prompt, tool results between turns)."""
        n = len(ids)
        self.tokens += ids
        self.loss_mask += [0] * n
        self.logprobs += [None] * n
        self.versions += [-1] * n

    def append_generated(
        self, ids: Sequence[int], logprobs: Sequence[float | None], versions: Sequence[int]
    ) -> None:
        """Tokens the policy sampled, with their log-probs and weight versions."""
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError("generated tokens, log-probs and versions must align")
        self.tokens += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    @property
    def prompt_len(self) -> int:
        """Tokens before the first generated one."""
        return self.loss_mask.index(1) if 1 in self.loss_mask else len(self.tokens)

    @property
    def generated(self) -> int:
        return sum(self.loss_mask)


def start_episode(
    env: Environment, problem: Problem, tokenizer: Any
) -> tuple[EpisodeResult, Episode]:
    """A fresh episode of `env` reset on `problem`, and its result holding the rendered opening
    messages (the tools, if any, offered in the system prompt)."""
    episode = env.episode()
    messages = episode.reset(problem)
    ids = tokenizer.encode(render(messages, tools=episode.tool_specs() or None))
    return EpisodeResult.start(problem, ids, messages), episode


@dataclass
class _Live:
    index: int
    episode: Episode | None
    result: EpisodeResult
    seed: int | None
    turn: int = 0


class Rollout:
    """The rollout state machine under `roll_out`, `run_episodes` and the rollout workers:
    every start is an `EpisodeResult` holding its prompt and the `Episode` that answers its
    replies, or None for one plain generation (the prompt's continuation under `params` as
    given, one turn, reward 0). `start()` adds the first turns to the engine, `feed(output)`
    takes a finished request of this rollout (and adds the episode's next turn), `done` says
    when every episode has ended; results are filled in place. Several rollouts may share one
    engine (a worker's prefetched calls in one continuous batch): `owns(request_id)` routes."""

    def __init__(
        self,
        engine: Engine,
        starts: Sequence[tuple[EpisodeResult, Episode | None]],
        params: SamplingParams,
        *,
        max_turns: int = 4,
        max_episode_tokens: int | None = None,
        seeds: Sequence[int | None] | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_episode_tokens is not None and max_episode_tokens < 1:
            raise ValueError(f"max_episode_tokens must be >= 1, got {max_episode_tokens}")
        if seeds is not None and len(seeds) != len(starts):
            raise ValueError(f"{len(seeds)} seeds for {len(starts)} episodes")
        self.engine, self.starts, self.params = engine, list(starts), params
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.seeds = seeds
        self._stops = [params.stop] if isinstance(params.stop, str) else list(params.stop)
        self._live: dict[str, _Live] = {}
        self.started = False
        self.error: BaseException | None = None  # what ended it early (its episode's error)

    @property
    def done(self) -> bool:
        return self.started and not self._live

    def owns(self, request_id: str) -> bool:
        return request_id in self._live

    def abort(self, error: BaseException | None = None) -> None:
        """Drop every request this rollout still has in the engine and close their episodes;
        `error` is kept for its caller to raise (`check`)."""
        self.started = True
        for request_id, st in list(self._live.items()):
            self.engine.abort(request_id)
            if st.episode is not None:
                st.episode.close()
        self._live.clear()
        self.error = self.error or error

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def start(self) -> None:
        self.started = True
        params = self.params
        for i, (result, episode) in enumerate(self.starts):
            if self.seeds is not None:
                seed = self.seeds[i]
            else:
                seed = None if params.seed is None else params.seed + 1000 * i
            self._submit(_Live(i, episode, result, seed))

    def _submit(self, st: _Live) -> None:
        params, engine = self.params, self.engine
        left = None
        if self.max_episode_tokens is not None:
            left = self.max_episode_tokens - st.result.generated
        room = engine.max_model_len - len(st.result.tokens)
        n = min(params.max_tokens, room, left if left is not None else room)
        if n < 1:
            self._finish(st, truncated=True)
            return
        sp = replace(
            params,
            max_tokens=n,
            logprobs=True,
            seed=None if st.seed is None else st.seed + st.turn,
        )
        if st.episode is not None:  # a chat turn: it ends at the end-of-turn string
            sp = replace(sp, stop=[*self._stops, STOP], include_stop_str_in_output=True)
        self._live[engine.add_request(list(st.result.tokens), sp)] = st

    def _finish(self, st: _Live, *, truncated: bool = False, reward: float = 0.0, info=None):
        if st.episode is not None:
            st.episode.close()
        if truncated:  # cut by a budget (or no room left): what overlong filtering masks
            st.result.finish_reason = "length"
        st.result.truncated = truncated
        st.result.reward = reward
        st.result.turns = st.turn
        st.result.info.update(info or {})

    def feed(self, out: Any) -> None:
        """A finished output of one of this rollout's requests."""
        st = self._live.pop(out.request_id)
        res = st.result
        st.turn += 1
        gen, lps = list(out.token_ids), list(out.logprobs or [None] * len(out.token_ids))
        versions = list(out.token_versions)
        if out.stop_token_id is not None:  # EOS / a stop token ended the turn: keep it
            gen.append(out.stop_token_id)
            lps.append(out.stop_token_logprob)
            versions.append(self.engine.weight_version)
        res.append_generated(gen, lps, versions)
        res.finish_reason, res.text = out.finish_reason, out.text
        if st.episode is None:  # one plain generation
            self._finish(st, truncated=out.finish_reason == "length")
            return
        reply = parse_assistant(out.text)
        reply["text"] = out.text
        res.messages.append({k: v for k, v in reply.items() if k != "text"})
        if out.finish_reason != "stop":  # cut by a budget while the model was writing
            self._finish(st, truncated=True)
            return
        try:
            step = st.episode.step(reply)
        except BaseException:
            st.episode.close()
            raise
        if step.done or st.turn >= self.max_turns:
            info = dict(step.info)
            if not step.done:
                info["unfinished"] = True
            self._finish(st, reward=step.reward, info=info)
            return
        res.messages += step.observation
        res.append_context(
            self.engine.tokenizer.encode(continuation(step.observation), add_bos=False)
        )
        self._submit(st)


def step_rollouts(engine: Engine, rollouts: Sequence[Rollout]) -> None:
    """One engine step, its finished outputs routed to the rollouts that own them (outputs of
    requests no rollout owns are dropped: they belong to nobody here)."""
    for out in engine.step():
        if not out.finished:
            continue
        for r in rollouts:
            if r.owns(out.request_id):
                try:
                    r.feed(out)
                except Exception as err:  # its episode failed: it ends, the others go on
                    r.abort(err)
                break


def roll_out(
    engine: Engine,
    starts: Sequence[tuple[EpisodeResult, Episode | None]],
    params: SamplingParams,
    **budgets: Any,
) -> None:
    """Roll `starts` out on `engine` to the end (`Rollout`, whose keyword arguments `budgets`
    are: max_turns, max_episode_tokens, seeds); results are filled in place."""
    r = Rollout(engine, starts, params, **budgets)
    r.start()
    while not r.done:
        step_rollouts(engine, [r])
    r.check()


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
        env: Any = None,
        device: str = "cpu",
    ) -> None:
        if threads > 0:
            torch.set_num_threads(threads)
        # copied into memory of its own: the state may be read-only (Ray's object store)
        model = HybridLM.empty(model_cfg, device)
        model.load_state_dict(state_dict, strict=True)
        self.engine = Engine(model.eval(), tokenizer, **(engine_kwargs or {}))
        self.engine.weight_version = version
        self.worker_id = worker_id
        self.seed = seed
        self.env = env  # steps the episodes of requests with a problem (rl.environments)
        self._calls = 0
        self._pending = _Pending()
        # the engine is not thread-safe: one thread steps it at a time (`_engine_lock`);
        # calls queue their rollouts (`_waiting`) for it; set_weights may come meanwhile
        self._engine_lock = threading.Lock()
        self._admit = threading.Lock()
        self._stepped = threading.Condition()
        self._waiting: list[Rollout] = []
        self._running: list[Rollout] = []

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
    def generate(
        self,
        requests: list[RolloutRequest],
        params: dict[str, Any],
        *,
        max_turns: int = 1,
        max_episode_tokens: int | None = None,
    ) -> list[Completion]:
        """Sample every request's group in one continuous batch; returns the completions in
        request order, group members in index order. `params` bound each reply; episodes also
        end after `max_turns` replies or `max_episode_tokens` generated tokens. Concurrent calls
        (a Ray actor runs two) share the engine's continuous batch."""
        return self._generate(requests, params, max_turns, max_episode_tokens)

    def _generate(
        self,
        requests: list[RolloutRequest],
        params: dict[str, Any],
        max_turns: int,
        max_episode_tokens: int | None,
    ) -> list[Completion]:
        with self._admit:  # calls are numbered (their seeds) in the order they arrive
            self._calls += 1
            call = self._calls
        sp = SamplingParams(**{**params, "logprobs": True})
        for req in requests:  # before any episode starts (and holds something)
            if req.problem is not None and self.env is None:
                raise ValueError(f"request {req.key!r} has a problem but the worker no environment")
        starts, seeds, keys = [], [], []
        for r, req in enumerate(requests):
            for g in range(req.group_size):
                if req.problem is None:
                    starts.append((EpisodeResult.start(None, req.prompt_ids), None))
                else:
                    starts.append(start_episode(self.env, req.problem, self.engine.tokenizer))
                # distinct, reproducible streams: (seed, worker, call, request, member)
                seeds.append(hash((self.seed, self.worker_id, call, r, g)) % 2**62)
                keys.append((r, g))
        rollout = Rollout(
            self.engine,
            starts,
            sp,
            max_turns=max_turns,
            max_episode_tokens=max_episode_tokens,
            seeds=seeds,
        )
        with self._admit:
            self._waiting.append(rollout)
        # whichever call holds the engine steps it for every call admitted so far: a call that
        # arrives while another runs joins the same continuous batch at the next step boundary;
        # a call whose rollout is done returns at once (it waits on `_stepped`, not the engine)
        while not rollout.done:
            if not self._engine_lock.acquire(timeout=0.05):
                with self._stepped:
                    self._stepped.wait(0.05)
                continue
            try:
                self._apply_pending()  # new weights at a step boundary
                with self._admit:
                    fresh, self._waiting = self._waiting, []
                for r in fresh:
                    try:
                        r.start()
                    except Exception as err:  # e.g. a prompt the engine refuses: that call ends
                        r.abort(err)
                    self._running.append(r)
                self._running = [r for r in self._running if not r.done]
                if self._running:
                    step_rollouts(self.engine, self._running)
            except BaseException as err:  # the engine itself failed: every call running ends
                for r in [*self._running, rollout]:
                    r.abort(err)
                self._running = []
                raise
            finally:
                self._engine_lock.release()
                with self._stepped:
                    self._stepped.notify_all()
        rollout.check()  # its own episode failed
        return [
            _completion(requests[r], g, res, episodic, self.worker_id)
            for (r, g), (res, episodic) in zip(keys, starts, strict=True)
        ]


def _completion(req: RolloutRequest, g: int, res: Any, episode: Any, worker: int) -> Completion:
    """An `rl.episodes.EpisodeResult` as the learner's `Completion` (class docstring)."""
    p = res.prompt_len if episode is not None else len(req.prompt_ids)
    mask = res.loss_mask[p:]
    return Completion(
        key=req.key,
        index=g,
        prompt_ids=res.tokens[:p],
        token_ids=res.tokens[p:],
        logprobs=[0.0 if lp is None else lp for lp in res.logprobs[p:]],
        versions=res.versions[p:],
        finish_reason=res.finish_reason,
        text=res.text,
        worker=worker,
        mask=None if episode is None else mask,
        reward=None if episode is None else res.reward,
        turns=res.turns,
        info=dict(res.info) if episode is not None else {},
    )


def worker_gpus(requested: float | None, cluster_gpus: float, num_workers: int) -> float:
    """GPUs each Ray rollout actor asks for: `requested` when given (0: decode on the CPU);
    by default one each when the cluster has one per worker, a share when it has fewer, and
    none on a cluster without GPUs (a laptop)."""
    if requested is not None:
        if requested < 0:
            raise ValueError(f"gpus_per_worker must be >= 0, got {requested}")
        if requested > 0 and cluster_gpus < requested * num_workers:
            raise ValueError(
                f"{num_workers} rollout workers x {requested} GPUs, the Ray cluster has "
                f"{cluster_gpus:g}"
            )
        return float(requested)
    if cluster_gpus <= 0:
        return 0.0
    return min(1.0, cluster_gpus / num_workers)


class _InlineHandle:
    def __init__(self, result: list[Completion]) -> None:
        self.result = result


class RolloutPool:
    """`num_workers` rollout workers behind one interface: `submit` (non-blocking on Ray),
    `wait` (completed calls), `set_weights` (broadcast with a timeout), `shutdown`. `env`: the
    environment whose episodes the workers step (requests with a `problem`); each Ray worker
    gets its own copy."""

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
        env: Any = None,
        gpus_per_worker: float | None = None,
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
            threads=threads_per_worker,
            seed=seed,
            version=version,
            engine_kwargs=engine_kwargs,
            env=env,
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
        gpus = worker_gpus(gpus_per_worker, ray.cluster_resources().get("GPU", 0.0), num_workers)
        # three threads: two generate calls sharing the batch and a weight hand-over beside them
        actor = ray.remote(num_cpus=threads_per_worker, num_gpus=gpus, max_concurrency=3)(
            RolloutWorker
        )
        ref = ray.put(state)
        device = "cuda" if gpus > 0 else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES per actor
        self.workers = [
            actor.remote(model_cfg, tokenizer, ref, worker_id=i, device=device, **kw)
            for i in range(num_workers)
        ]
        self._ray = ray
        self._check(ray.get([w.version.remote() for w in self.workers], timeout=sync_timeout_s))

    @staticmethod
    def _check(versions: list[int]) -> None:
        assert len(set(versions)) == 1, versions

    def submit(self, requests: list[RolloutRequest], params: dict[str, Any], **budgets: Any) -> Any:
        """Start one generation call on the next worker (round robin); returns a handle.
        `budgets`: the episodes' `max_turns` / `max_episode_tokens` (`RolloutWorker.generate`)."""
        SamplingParams(**params).validate()  # a bad setting fails here, not in a worker
        w = self.workers[self._next % len(self.workers)]
        self._next += 1
        if self.executor == "inline":
            handle: Any = _InlineHandle(w.generate(requests, params, **budgets))
        else:
            handle = w.generate.remote(requests, params, **budgets)
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
