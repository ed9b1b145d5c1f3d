"""Episodes: multi-turn interaction between the policy and an environment over chat messages.

An `Episode` is one rollout's environment state (the per-episode half of NeMo Gym's resource
server; Nemotron 3 Super §3.2.5):

    obs = episode.reset(problem)                  # the opening messages
    obs, reward, done, info = episode.step(reply)  # reply: the assistant message just generated

`Environment.episode()` makes one. A single-turn environment is the one-step case
(`SingleTurnEpisode`: the reply is scored, done). `ToolEpisode` executes the reply's tool calls
(`rl.tools`) and answers with tool-role messages until the reply calls none, which is then scored
by the environment's verifier (or until `max_turns`).

`run_episodes(engine, env, problems, params)` rolls episodes out on an `infer.engine.Engine`,
all in its continuous batch: when one turn's request finishes, the environment steps and the
next turn's request joins the batch at once. A turn's prompt is the episode's token sequence so
far (the engine's prefix cache serves the shared part), so the tokens are never re-tokenised:
the generated tokens stay exactly as sampled, with their log-probs and weight versions, and the
tokens between turns (the turn's end, the tool results, the next assistant header) are encoded
from `data.chat.continuation`. `EpisodeResult.loss_mask` is 1 exactly on generated tokens, so a
loss trains only what the model wrote. Budgets: `params.max_tokens` per turn, `max_turns`, and
`max_episode_tokens` generated per episode; an episode that runs out while the model is still
writing is `truncated` (overlong filtering can mask it).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..data.chat import STOP, continuation, parse_assistant, render
from .tools import Tool

if TYPE_CHECKING:
    from ..infer.engine import Engine
    from ..infer.sampling import SamplingParams

# `rl.environments` builds on this module (`Environment.episode()`), so its types are named
# here without importing it: an Environment has `score(problem, text) -> Reward` and
# `episode()`; a Problem has `messages`.
Environment = Any
Problem = Any

__all__ = [
    "Episode",
    "EpisodeResult",
    "SingleTurnEpisode",
    "Step",
    "ToolEpisode",
    "run_episodes",
]


@dataclass
class Step:
    """What the environment answers to one reply: messages to append (tool results), the
    reward (final on the last step), whether the episode is over, and details."""

    observation: list[dict[str, Any]]
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)

    def __iter__(self):  # obs, reward, done, info = episode.step(reply)
        return iter((self.observation, self.reward, self.done, self.info))


class Episode(ABC):
    """One rollout's environment state. `tools` are offered in the system prompt."""

    tools: Sequence[Tool] = ()

    @abstractmethod
    def reset(self, problem: Problem) -> list[dict[str, Any]]:
        """Start on `problem`; returns the opening messages."""

    @abstractmethod
    def step(self, reply: Mapping[str, Any]) -> Step:
        """Answer the assistant's `reply` (an OpenAI-style message: content, tool_calls)."""

    def tool_specs(self) -> list[dict[str, Any]]:
        return [t.spec() for t in self.tools]


def _score(env: Environment, problem: Problem | None, reply: Mapping[str, Any]) -> Any:
    """The environment's reward for a final reply: its generated text when given (`text`),
    else its content."""
    if problem is None:
        raise RuntimeError("step() before reset()")
    return env.score(problem, reply.get("text", reply.get("content") or ""))


class SingleTurnEpisode(Episode):
    """The one-step case: the reply's text is scored by the environment's verifier."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.problem: Problem | None = None

    def reset(self, problem: Problem) -> list[dict[str, Any]]:
        self.problem = problem
        return [dict(m) for m in problem.messages]

    def step(self, reply: Mapping[str, Any]) -> Step:
        reward = _score(self.env, self.problem, reply)
        return Step([], reward.value, True, {"reason": reward.reason})


class ToolEpisode(Episode):
    """Tool use: each tool call of a reply is executed and answered by a tool-role message; a
    reply without calls ends the episode and is scored. `max_turns` replies at most: a reply
    that still calls tools on the last turn ends it with reward 0 (`info["unfinished"]`)."""

    def __init__(self, env: Environment, tools: Sequence[Tool], *, max_turns: int = 4) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        self.env = env
        self.tools = list(tools)
        self.max_turns = max_turns
        self._by_name = {t.name: t for t in self.tools}
        self.problem: Problem | None = None
        self.turns = 0
        self.calls = 0

    def reset(self, problem: Problem) -> list[dict[str, Any]]:
        self.problem, self.turns, self.calls = problem, 0, 0
        return [dict(m) for m in problem.messages]

    def step(self, reply: Mapping[str, Any]) -> Step:
        if self.problem is None:
            raise RuntimeError("step() before reset()")
        self.turns += 1
        calls = list(reply.get("tool_calls") or [])
        if not calls:
            reward = _score(self.env, self.problem, reply)
            info = {"reason": reward.reason, "turns": self.turns, "tool_calls": self.calls}
            return Step([], reward.value, True, info)
        if self.turns >= self.max_turns:
            info = {"unfinished": True, "turns": self.turns, "tool_calls": self.calls}
            return Step([], 0.0, True, info)
        out = []
        for call in calls:
            self.calls += 1
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call.get("id", ""),
                    "content": self._run(call.get("function", {})),
                }
            )
        return Step(out, 0.0, False, {"turns": self.turns, "tool_calls": self.calls})

    def _run(self, function: Mapping[str, Any]) -> str:
        name = function.get("name")
        tool = self._by_name.get(name) if isinstance(name, str) else None
        if tool is None:
            return f"error: unknown tool {name!r}; the tools are {sorted(self._by_name)}"
        try:
            args = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            return "error: the arguments are not valid JSON"
        return tool(args)


@dataclass
class EpisodeResult:
    """A finished episode: the whole token sequence (prompt, generated turns, the tokens
    between turns), `loss_mask` 1 on generated tokens, and per token the behaviour log-prob and
    weight version (None / -1 where not generated)."""

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

    @property
    def prompt_len(self) -> int:
        """Tokens before the first generated one."""
        return self.loss_mask.index(1) if 1 in self.loss_mask else len(self.tokens)

    @property
    def generated(self) -> int:
        return sum(self.loss_mask)


@dataclass
class _Live:
    index: int
    episode: Episode
    problem: Problem
    result: EpisodeResult
    turn: int = 0


def run_episodes(
    engine: Engine,
    env: Environment,
    problems: Sequence[Problem],
    params: SamplingParams,
    *,
    max_turns: int = 4,
    max_episode_tokens: int | None = None,
) -> list[EpisodeResult]:
    """Roll one episode out per problem on `engine` (module docstring); results in problem
    order. Turn t of episode i samples with seed `params.seed + 1000 * i + t` when a seed is
    set. Each reply is generated until `data.chat.STOP` (kept in the tokens: the policy learns
    to end its turn). The call steps the engine until its episodes end: requests that others
    added to the same engine advance too, but their outputs are not returned to anyone."""
    tok = engine.tokenizer
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if max_episode_tokens is not None and max_episode_tokens < 1:
        raise ValueError(f"max_episode_tokens must be >= 1, got {max_episode_tokens}")
    live: dict[str, _Live] = {}

    def submit(st: _Live) -> None:
        left = None
        if max_episode_tokens is not None:
            left = max_episode_tokens - st.result.generated
        room = engine.max_model_len - len(st.result.tokens)
        n = min(params.max_tokens, room, left if left is not None else room)
        if n < 1:
            finish(st, truncated=True)
            return
        seed = None if params.seed is None else params.seed + 1000 * st.index + st.turn
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop)
        sp = replace(
            params,
            max_tokens=n,
            stop=[*stops, STOP],
            include_stop_str_in_output=True,
            logprobs=True,
            seed=seed,
        )
        live[engine.add_request(list(st.result.tokens), sp)] = st

    def finish(st: _Live, *, truncated: bool = False, reward: float = 0.0, info=None) -> None:
        st.result.truncated = truncated
        st.result.reward = reward
        st.result.turns = st.turn
        st.result.info.update(info or {})

    results = []
    for i, problem in enumerate(problems):
        episode = env.episode()
        messages = episode.reset(problem)
        ids = tok.encode(render(messages, tools=episode.tool_specs() or None))
        res = EpisodeResult(
            problem, ids, [0] * len(ids), [None] * len(ids), [-1] * len(ids), 0.0, 0, messages
        )
        results.append(res)
        submit(_Live(i, episode, problem, res))
    while live:
        for out in engine.step():
            if not out.finished or out.request_id not in live:
                continue
            st = live.pop(out.request_id)
            res = st.result
            st.turn += 1
            gen, lps = list(out.token_ids), list(out.logprobs or [None] * len(out.token_ids))
            versions = list(out.token_versions)
            if out.stop_token_id is not None:  # EOS / a stop token ended the turn: keep it
                gen.append(out.stop_token_id)
                lps.append(out.stop_token_logprob)
                versions.append(engine.weight_version)
            res.tokens += gen
            res.loss_mask += [1] * len(gen)
            res.logprobs += lps
            res.versions += versions
            reply = parse_assistant(out.text)
            reply["text"] = out.text
            res.messages.append({k: v for k, v in reply.items() if k != "text"})
            if out.finish_reason != "stop":  # cut by a budget while the model was writing
                finish(st, truncated=True)
                continue
            step = st.episode.step(reply)
            if step.done or st.turn >= max_turns:
                info = dict(step.info)
                if not step.done:
                    info["unfinished"] = True
                finish(st, reward=step.reward, info=info)
                continue
            between = tok.encode(continuation(step.observation), add_bos=False)
            res.messages += step.observation
            res.tokens += between
            res.loss_mask += [0] * len(between)
            res.logprobs += [None] * len(between)
            res.versions += [-1] * len(between)
            submit(st)
    return results
