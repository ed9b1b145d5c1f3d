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

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..data.chat import TOOL_CALL_LIMITS
from ..untrusted import UntrustedJSONError, clip, loads
from .tools import Tool

if TYPE_CHECKING:
    from ..infer.engine import Engine
    from ..infer.rollout import EpisodeResult
    from ..infer.sampling import SamplingParams

# `rl.environments` builds on this module (`Environment.episode()`), so its types are named
# here without importing it: an Environment has `score(problem, text) -> Reward` and
# `episode()`; a Problem has `messages`.
Environment = Any
Problem = Any

__all__ = [
    "Episode",
    "EpisodeOver",
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

    def close(self) -> None:
        """Release what the episode holds; called when its rollout ends (done or cut)."""
        return None


def _score(env: Environment, problem: Problem | None, reply: Mapping[str, Any]) -> Any:
    """The environment's reward for a final reply: its generated text when given (`text`),
    else its content."""
    if problem is None:
        raise RuntimeError("step() before reset()")
    return env.score(problem, reply.get("text", reply.get("content") or ""))


def _verdict(reward: Any) -> dict[str, Any]:
    """A final step's info about its reward: the reason category, and the detail when there is
    one (an environment server drops it unless it debugs rewards)."""
    return {"reason": reward.reason, **({"detail": reward.detail} if reward.detail else {})}


class EpisodeOver(RuntimeError):
    """A step on an episode that has ended: an episode pays its reward once."""


class SingleTurnEpisode(Episode):
    """The one-step case: the reply's text is scored by the environment's verifier."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.problem: Problem | None = None
        self.done = False

    def reset(self, problem: Problem) -> list[dict[str, Any]]:
        self.problem, self.done = problem, False
        return [dict(m) for m in problem.messages]

    def step(self, reply: Mapping[str, Any]) -> Step:
        if self.done:
            raise EpisodeOver("the episode is over")
        self.done = True
        reward = _score(self.env, self.problem, reply)
        return Step([], reward.value, True, _verdict(reward))


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
        self.done = False

    def reset(self, problem: Problem) -> list[dict[str, Any]]:
        self.problem, self.turns, self.calls, self.done = problem, 0, 0, False
        return [dict(m) for m in problem.messages]

    def step(self, reply: Mapping[str, Any]) -> Step:
        if self.problem is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            raise EpisodeOver("the episode is over")
        self.turns += 1
        calls = list(reply.get("tool_calls") or [])
        if not calls:
            self.done = True
            reward = _score(self.env, self.problem, reply)
            info = {**_verdict(reward), "turns": self.turns, "tool_calls": self.calls}
            return Step([], reward.value, True, info)
        if self.turns >= self.max_turns:
            self.done = True
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

    def _run(self, function: Any) -> str:
        if not isinstance(function, Mapping):
            return "error: a tool call needs a 'function' object with 'name' and 'arguments'"
        name = function.get("name")
        tool = self._by_name.get(name) if isinstance(name, str) else None
        if tool is None:
            return f"error: unknown tool {clip(name)}; the tools are {sorted(self._by_name)}"
        args = function.get("arguments") or "{}"
        if not isinstance(args, Mapping):  # OpenAI's form is a JSON string
            if not isinstance(args, str):
                return "error: the arguments must be a JSON object or a string holding one"
            try:
                args = loads(args, TOOL_CALL_LIMITS, what="the arguments")
            except UntrustedJSONError as err:
                return f"error: {err}"
        return tool(args)


def run_episodes(
    engine: Engine,
    env: Environment,
    problems: Sequence[Problem],
    params: SamplingParams,
    *,
    max_turns: int = 4,
    max_episode_tokens: int | None = None,
    seeds: Sequence[int] | None = None,
) -> list[EpisodeResult]:
    """Roll one episode out per problem on `engine` (module docstring); results in problem
    order. Turn t of episode i samples with seed `seeds[i] + t` (default `params.seed + 1000 *
    i`; unseeded when neither is set). Each reply is generated until `data.chat.STOP` (kept in
    the tokens: the policy learns to end its turn). The call steps the engine until its episodes
    end: requests that others added to the same engine advance too, but their outputs are not
    returned to anyone."""
    from ..infer.rollout import roll_out, start_episode  # torch: only where episodes roll out

    starts = [start_episode(env, p, engine.tokenizer) for p in problems]
    roll_out(
        engine,
        starts,
        params,
        max_turns=max_turns,
        max_episode_tokens=max_episode_tokens,
        seeds=seeds,
    )
    return [r for r, _ in starts]
