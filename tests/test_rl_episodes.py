"""Multi-turn episodes: the reset / step API (single-turn environments are the one-step case),
tool episodes that execute the calculator, and rollouts on the engine whose token sequences
equal the rendered conversation, with the loss mask exactly on generated tokens and log-probs
and weight versions kept per generated token."""

import json

import pytest

from _tiny import ForcedTokens
from hybridlm import HybridLM
from hybridlm.data.chat import STOP, continuation, render
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.engine import Engine
from hybridlm.infer.sampling import SamplingParams
from hybridlm.presets import get_preset
from hybridlm.rl.environments import ArithmeticEnvironment, CalculatorEnvironment
from hybridlm.rl.episodes import SingleTurnEpisode, ToolEpisode, run_episodes
from hybridlm.rl.tools import Calculator

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = ByteTokenizer()


def _engine(**kw) -> Engine:
    cfg = get_preset("tiny-super")
    cfg.vocab_size = 258
    cfg.max_seq_len = 2048
    return Engine(HybridLM(cfg, seed=0).eval(), TOK, **kw)


class _Script:
    """A policy double: each request's constraint forces the next scripted reply, byte by byte
    (random models never call tools)."""

    def __init__(self, replies):
        self.replies = list(replies)

    def __call__(self):
        return ForcedTokens(TOK.encode(self.replies.pop(0), add_bos=False), 258)


def test_continuation_appends_to_a_generated_turn_as_render_does():
    msgs = [{"role": "user", "content": "What is 12 * 3?"}]
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator",
            "arguments": json.dumps({"expression": "12 * 3"})}}  # fmt: skip
    reply = {"role": "assistant", "content": "", "tool_calls": [call]}
    tool = [{"role": "tool", "tool_call_id": "call_0", "content": "36"}]
    head = render(msgs)
    whole = render([*msgs, reply, *tool])
    body = whole[len(head) : whole.index(STOP, len(head))]
    assert head + body + STOP + continuation(tool) == whole


def test_single_turn_episode_is_the_one_step_case():
    eng = _engine()
    env = ArithmeticEnvironment(num_problems=3, seed=1)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    results = run_episodes(eng, env, list(env), params)
    for res, problem in zip(results, env, strict=True):
        assert isinstance(env.episode(), SingleTurnEpisode)
        assert res.turns == 1 and len(res.tokens) == len(res.loss_mask) == len(res.logprobs)
        prompt = TOK.encode(problem.prompt)
        assert res.tokens[: len(prompt)] == prompt and res.prompt_len == len(prompt)
        gen = res.tokens[len(prompt) :]
        assert res.loss_mask[len(prompt) :] == [1] * len(gen)
        assert all(lp is not None for lp in res.logprobs[len(prompt) :])
        reply = TOK.decode(gen)
        assert res.reward == env.score(problem, reply).value
        assert res.truncated == (STOP not in reply and len(gen) == 12)


def test_tool_episode_runs_the_calculator_and_scores_the_final_reply():
    env = CalculatorEnvironment(num_problems=2, seed=3)
    a, b = env[0].metadata["a"], env[0].metadata["b"]
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
    script = _Script(
        [
            f"<tool_call>{call}</tool_call>{STOP}",
            f"The answer is {a * b}.{STOP}",
            f"The answer is {a * b + 1}.{STOP}",  # the second problem: no tool, wrong
        ]
    )
    eng = _engine()
    params = SamplingParams(max_tokens=200, temperature=0.0, constraint=script)
    first, second = run_episodes(eng, env, [env[0]], params) + run_episodes(
        eng, env, [env[1]], params
    )
    assert (first.turns, first.reward, first.info["tool_calls"]) == (2, 1.0, 1)
    assert (second.turns, second.reward, second.info["tool_calls"]) == (1, 0.0, 0)
    assert first.messages[-2] == {"role": "tool", "tool_call_id": "call_0", "content": str(a * b)}
    # the token sequence is the rendered conversation, never re-tokenised
    tools = [Calculator().spec()]
    rendered = TOK.encode(render(first.messages, False, tools=tools))
    assert first.tokens + TOK.encode("\n", add_bos=False) == rendered  # + the last turn's newline
    generated = [t for t, m in zip(first.tokens, first.loss_mask, strict=True) if m]
    assert TOK.decode(generated) == script_text(call, a, b)
    for _t, m, lp, v in zip(
        first.tokens, first.loss_mask, first.logprobs, first.versions, strict=True
    ):
        assert (lp is not None) == bool(m) and (v == 0) == bool(m)


def script_text(call, a, b):
    return f"<tool_call>{call}</tool_call>{STOP}The answer is {a * b}.{STOP}"


def test_budgets_end_episodes():
    env = CalculatorEnvironment(num_problems=1, seed=3, max_turns=1)
    call = json.dumps({"name": "calculator", "arguments": {"expression": "1 + 1"}})
    eng = _engine()
    forced = SamplingParams(
        max_tokens=200, constraint=_Script([f"<tool_call>{call}</tool_call>{STOP}"])
    )
    (res,) = run_episodes(eng, env, list(env), forced)
    assert res.turns == 1 and res.reward == 0.0 and res.info["unfinished"]
    cut_params = SamplingParams(max_tokens=3, ignore_eos=True, stop="never")  # a str: one stop
    (cut,) = run_episodes(eng, env, list(env), cut_params)
    assert cut.truncated and cut.turns == 1 and cut.generated == 3
    (capped,) = run_episodes(
        eng, env, list(env), SamplingParams(max_tokens=50, ignore_eos=True), max_episode_tokens=5
    )
    assert capped.truncated and capped.generated == 5


def test_tool_episode_answers_bad_calls_with_errors():
    env = CalculatorEnvironment(num_problems=1)
    ep = ToolEpisode(env, [Calculator()], max_turns=3)
    ep.reset(env[0])
    calls = [
        {"id": "a", "function": {"name": "search", "arguments": "{}"}},
        {"id": "b", "function": {"name": "calculator", "arguments": "{not json"}},
        {"id": "c", "function": {"name": "calculator", "arguments": '{"expression": "2**10"}'}},
    ]
    obs, reward, done, info = ep.step({"role": "assistant", "content": "", "tool_calls": calls})
    assert not done and reward == 0.0 and info["tool_calls"] == 3
    assert [o["content"][:6] for o in obs] == ["error:", "error:", "1024"]
    assert [o["tool_call_id"] for o in obs] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="unique"):
        ToolEpisode(env, [Calculator(), Calculator()])
    problem = env[0]
    assert problem.answer == str(problem.metadata["a"] * problem.metadata["b"])
    assert len(str(problem.metadata["a"])) == 5


def test_search_episode_finds_the_fact_and_scores_the_answer():
    from hybridlm.rl.environments import SearchQAEnvironment

    env = SearchQAEnvironment(num_problems=20, num_towns=50, seed=2)
    again = SearchQAEnvironment(num_problems=20, num_towns=50, seed=2)
    assert [p.messages for p in env] == [p.messages for p in again]  # deterministic by seed
    problem = env[0]
    question = problem.messages[-1]["content"]
    # the answer is in the corpus, and searching the question finds its town's document first
    hit = env.search({"query": question}).splitlines()[0]
    assert problem.metadata["town"] in hit and problem.answer in hit
    call = json.dumps({"name": "search", "arguments": {"query": question}})
    script = _Script(
        [f"<tool_call>{call}</tool_call>{STOP}", f"The answer is {problem.answer}.{STOP}"]
    )
    (res,) = run_episodes(
        _engine(), env, [problem], SamplingParams(max_tokens=300, constraint=script)
    )
    assert (res.turns, res.reward, res.info["tool_calls"]) == (2, 1.0, 1)
    assert problem.answer in res.messages[-2]["content"]
