"""Multi-turn tool-use RL end to end: a tiny policy taught the calculator's call format by a
short tool-use SFT (the environment's own demonstrations) rolls episodes out on the rollout
workers (inline and Ray), the GRPO learner trains on them with the loss mask on generated tokens
only, and a run resumed mid-way repeats the uninterrupted one. Also the GRPO options the reports
use: leave-one-out baseline, overlong filtering, router freeze."""

from __future__ import annotations

import json

import pytest
import torch

from _tiny import tool_rl_config
from hybridlm.data.chat import continuation
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.rollout import RolloutRequest, RolloutWorker
from hybridlm.io import load_model
from hybridlm.model.moe import TopKRouter
from hybridlm.rl.env_config import EnvConfig
from hybridlm.rl.environments import (
    ArithmeticEnvironment,
    CalculatorEnvironment,
    MixtureEnvironment,
)
from hybridlm.rl.grpo import group_advantages
from hybridlm.rl.learner import RLRunConfig, completion_logprobs, run_rl

TOK = ByteTokenizer()


def test_workers_roll_out_tool_episodes_with_generated_tokens_masked(tool_policy, one_thread):
    model = load_model(tool_policy).float().eval()
    env = MixtureEnvironment([CalculatorEnvironment(num_problems=50, digits=2, seed=7)])
    worker = RolloutWorker(model.config, TOK, model.state_dict(), env=env)
    problems = env.sample(3, seed=1)
    reqs = [RolloutRequest(p.id, [], 2, problem=p) for p in problems]
    params = {"max_tokens": 100, "temperature": 0.5, "stop": []}
    comps = worker.generate(reqs, params, max_turns=3)
    assert [(c.key, c.index) for c in comps] == [(p.id, g) for p in problems for g in range(2)]
    assert sum(c.turns >= 2 for c in comps) >= 4, [c.info for c in comps]  # the tool was called
    for c in comps:
        problem = problems[[p.id for p in problems].index(c.key)]
        assert c.reward == env.score(problem, c.text).value and c.info["turns"] == c.turns
        n = len(c.token_ids)
        assert len(c.mask) == len(c.logprobs) == len(c.versions) == n
        assert all(
            (v == 0) == bool(m) and (v == -1) == (not m)
            for v, m in zip(c.versions, c.mask, strict=True)
        )
        if c.turns < 2:
            continue
        # between the turns: exactly the tool's answer, as the chat template renders it
        first = c.mask.index(0)
        gap = c.token_ids[first : c.mask.index(1, first)]
        call = json.loads(TOK.decode(c.token_ids[:first]).split("<tool_call>")[1].split("</")[0])
        result = env.envs["calculator"].tools()[0](call["arguments"])
        msg = [{"role": "tool", "tool_call_id": "call_0", "content": result}]
        assert TOK.decode(gap) == continuation(msg)
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.mask, strict=True) if not m)
    # the trainer's log-probs equal the engine's on generated tokens (TIS compares them)
    with torch.no_grad():
        logp_BT, mask_BT = completion_logprobs(model, comps, temperature=0.5)
    for i, c in enumerate(comps):
        assert mask_BT[i, : len(c.mask)].tolist() == [bool(m) for m in c.mask]
        got = logp_BT[i, : len(c.mask)][mask_BT[i, : len(c.mask)]]
        want = torch.tensor([lp for lp, m in zip(c.logprobs, c.mask, strict=True) if m])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def _cfg(tool_policy: str, out, **kw) -> RLRunConfig:
    return tool_rl_config(tool_policy, out, **kw)


def _rows(path, drop=("wait_s", "train_s", "sync_s", "steps_per_s")) -> list[dict]:
    lines = (path / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in drop} for x in lines]


def test_rl_trains_on_tool_episodes_and_resumes_mid_run(tool_policy, tmp_path, one_thread):
    full = _cfg(tool_policy, tmp_path / "full", steps=4, checkpoint_interval=2)
    res = run_rl(full, progress=False)
    train = res["train"]
    assert all(r["groups_kept"] >= 1 for r in train)
    # multi-turn episodes: the batch's mean turns and tool calls, tokens = generated only
    assert max(r["batch/calculator/turns"] for r in train) > 1.5, train
    assert max(r["batch/calculator/tool_calls"] for r in train) > 0.5
    assert all(r["tokens"] <= 2 * 4 * 220 for r in train)
    ev = res["eval"][-1]
    assert ev["calculator/count"] == 4 and ev["calculator/turns"] >= 1
    # stopped after step 2 (episodes of the next batch already rolled out) and resumed
    part = _cfg(tool_policy, tmp_path / "part", steps=4, checkpoint_interval=2)
    run_rl(part, progress=False, until_step=2)
    resumed = run_rl(part, progress=False, resume=True)
    assert resumed["step"] == 4
    assert _rows(tmp_path / "part") == _rows(tmp_path / "full")


# the episodes on a worker: test_workers_roll_out_...; RL on Ray workers: tests/test_rl_remote.py
@pytest.mark.slow
def test_rl_tool_episodes_on_ray_workers(tool_policy, tmp_path):
    ray = pytest.importorskip("ray")
    cfg = _cfg(tool_policy, tmp_path / "ray", executor="ray", steps=2, sync_timeout_s=120)
    try:
        res = run_rl(cfg, progress=False)
    finally:
        ray.shutdown()
    train = res["train"]
    assert len(train) == 2 and sum(r["groups_kept"] for r in train) > 0
    assert max(r["batch/calculator/turns"] for r in train) > 1.5, train
    assert all(set(r["staleness"]) <= {"0", "1"} for r in train)


def test_overlong_filter_masks_truncated_episodes_and_router_freeze(
    tool_policy, tmp_path, one_thread
):
    """Replies cut at 20 tokens: every sample is truncated, so overlong filtering leaves no
    token to train on; the frozen routers (weights and balancing bias) do not move while the
    rest of the model does."""
    cfg = _cfg(
        tool_policy,
        tmp_path / "ol",
        max_new_tokens=20,
        overlong_filter=True,
        freeze_router=True,
        steps=1,
        eval_interval=0,
    )
    res = run_rl(cfg, progress=False)
    (row,) = res["train"]
    assert row["truncated_frac"] == 1.0 and row["tokens"] == 0
    cfg = _cfg(tool_policy, tmp_path / "fr", freeze_router=True, steps=1, eval_interval=0)
    res = run_rl(cfg, progress=False)
    before, after = load_model(tool_policy), load_model(res["model"])
    routers = [n for n, m in before.named_modules() if isinstance(m, TopKRouter)]
    assert routers
    a, b = before.state_dict(), after.state_dict()
    for n in routers:
        assert torch.equal(a[f"{n}.weight"], b[f"{n}.weight"])
        assert torch.equal(a[f"{n}.e_score_correction_bias"], b[f"{n}.e_score_correction_bias"])
    assert any(not torch.equal(a[k], b[k]) for k in a if "gate" not in k)


def test_leave_one_out_baseline():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    loo = group_advantages(r, baseline="leave_one_out")
    for n in range(2):
        for i in range(4):
            others = torch.cat([r[n, :i], r[n, i + 1 :]])
            assert loo[n, i] == pytest.approx(float(r[n, i] - others.mean()))
    torch.testing.assert_close(loo, group_advantages(r) * 4 / 3)
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(r, baseline="median")
    with pytest.raises(ValueError, match="single-turn"):  # low-effort mode has no episodes
        EnvConfig(kind="calculator", low_effort_fraction=0.1).validate()


def test_a_mixture_routes_episodes_to_the_problems_environment(one_thread):
    calc = CalculatorEnvironment(num_problems=4, digits=2, seed=0)
    arith = ArithmeticEnvironment(num_problems=4, seed=0)
    mix = MixtureEnvironment([calc, arith])
    assert mix.multi_turn and calc.multi_turn and not arith.multi_turn
    ep = mix.episode()
    ep.reset(calc[0])
    assert [t["function"]["name"] for t in ep.tool_specs()] == ["calculator"]
    ep = mix.episode()
    ep.reset(arith[0])
    assert ep.tool_specs() == []


def test_tool_demos_cli_writes_sft_data_that_renders_as_the_rollouts(tmp_path, capsys):
    from hybridlm.cli import main
    from hybridlm.data.chat import render
    from hybridlm.data.sft import read_conversations
    from hybridlm.infer.rollout import start_episode

    out = tmp_path / "demos.jsonl"
    assert main(["tool-demos", "--num", "5", "--out", str(out), "--set", "digits=3"]) == 0
    convs = list(read_conversations(out))
    assert len(convs) == 5
    env = CalculatorEnvironment(num_problems=2000, digits=3)  # EnvConfig defaults
    for conv, problem in zip(convs, env.sample(5, seed=0), strict=True):
        start, _ = start_episode(env, problem, TOK)  # what a rollout's prompt is
        assert TOK.encode(render(conv[:2])) == start.tokens
        assert conv[-1]["content"] == f"The answer is {problem.answer}."
    assert main(["tool-demos", "--env", "gsm8k", "--num", "1", "--out", str(out)]) == 2
    assert "has no tools" in capsys.readouterr().err
