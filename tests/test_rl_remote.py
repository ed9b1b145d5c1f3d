"""Environments over HTTP (rl/remote.py): a server on 127.0.0.1 serving a local environment,
the client used like the local one (episodes equal token for token, the ground truth never
sent), malformed requests answered with 4xx JSON errors, and `hybridlm rl` training on Ray
workers whose episodes are stepped by the server."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from _tiny import tool_rl_config
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.engine import Engine
from hybridlm.infer.sampling import SamplingParams
from hybridlm.infer.server import run_in_background
from hybridlm.io import load_model
from hybridlm.rl.env_config import EnvConfig
from hybridlm.rl.environments import (
    ArithmeticEnvironment,
    CalculatorEnvironment,
    MixtureEnvironment,
)
from hybridlm.rl.episodes import run_episodes
from hybridlm.rl.learner import run_rl
from hybridlm.rl.remote import HTTPEnvironment, HTTPError, create_env_app

TOK = ByteTokenizer()


def _calc(**kw) -> CalculatorEnvironment:
    return CalculatorEnvironment(**{"num_problems": 40, "digits": 2, "seed": 3, **kw})


def test_http_environment_equals_the_local_one(tool_policy, one_thread):
    local = _calc()
    with run_in_background(create_env_app(_calc())) as url:
        remote = HTTPEnvironment(url)
        assert (remote.name, remote.multi_turn, len(remote)) == ("calculator", True, 40)
        p, q = remote[5], local[5]
        assert (p.id, p.messages) == (q.id, q.messages)
        assert p.answer is None and p.metadata == {}  # the server keeps what solves it
        right, wrong = f"The answer is {q.answer}.", f"The answer is {int(q.answer) + 1}."
        for text in (right, wrong):  # the same verdict, without its detail (the answer)
            got, want = remote.score(p, text), local.score(q, text)
            assert got == dataclasses.replace(want, detail="") and q.answer in want.detail
        # the same policy and seeds: the episodes are the same, token for token
        model = load_model(tool_policy).float().eval()
        params = SamplingParams(max_tokens=100, temperature=0.7, seed=11)
        idx = [0, 5, 9, 17]
        mine = run_episodes(Engine(model, TOK), local, [local[i] for i in idx], params)
        theirs = run_episodes(Engine(model, TOK), remote, [remote[i] for i in idx], params)
        for a, b in zip(mine, theirs, strict=True):
            assert (a.tokens, a.loss_mask, a.logprobs) == (b.tokens, b.loss_mask, b.logprobs)
            assert (a.reward, a.turns, a.messages) == (b.reward, b.turns, b.messages)
        assert any(a.turns == 2 for a in mine)  # the calculator ran on the server


def test_malformed_requests_get_4xx_json_errors():
    with run_in_background(create_env_app(_calc(), max_episodes=2, max_body_bytes=2048)) as url:
        http = httpx.Client(base_url=url)

        def error(resp, status):
            assert resp.status_code == status, resp.text
            return resp.json()["error"]["message"]

        assert "not in [0, 40)" in error(http.get("/problems/40"), 404)
        assert error(http.get("/nowhere"), 404)
        assert "not valid JSON" in error(http.post("/episodes", content=b"{nope"), 400)
        assert "unknown problem_id" in error(http.post("/episodes", json={"problem_id": 7}), 404)
        assert "'completion'" in error(
            http.post("/verify", json={"problem_id": "calculator/3/0", "completion": 5}), 400
        )
        assert error(http.post("/verify", content=b'{"a": "' + b"x" * 4096 + b'"}'), 413)
        assert "unknown episode" in error(http.post("/episodes/abc/step", json={"reply": {}}), 404)
        ep = http.post("/episodes", json={"problem_id": "calculator/3/0"}).json()
        step = f"/episodes/{ep['episode_id']}/step"
        assert "'reply'" in error(http.post(step, json={"reply": "hi"}), 400)
        assert "reply.tool_calls" in error(
            http.post(step, json={"reply": {"content": "", "tool_calls": "x"}}), 400
        )
        for bad in ({"function": "x"}, {"function": {"arguments": "{}"}}, "call"):
            reply = {"content": "", "tool_calls": [bad]}
            assert "reply.tool_calls[0]" in error(http.post(step, json={"reply": reply}), 400)
        bad_call = {"id": "c", "function": {"name": "calculator", "arguments": "{bad"}}
        out = http.post(step, json={"reply": {"content": "", "tool_calls": [bad_call]}}).json()
        assert not out["done"] and out["observation"][0]["content"].startswith("error:")
        out = http.post(step, json={"reply": {"content": "The answer is 1."}}).json()
        assert out["done"] and out["reward"] == 0.0
        assert error(http.post(step, json={"reply": {"content": "again"}}), 404)  # forgotten
        # at most max_episodes live: the oldest is dropped
        ids = [
            http.post("/episodes", json={"problem_id": "calculator/3/1"}).json()["episode_id"]
            for _ in range(3)
        ]
        assert error(http.delete(f"/episodes/{ids[0]}"), 404)
        assert http.delete(f"/episodes/{ids[2]}").json() == {"deleted": True}
    with pytest.raises(HTTPError, match="127.0.0.1"):
        HTTPEnvironment(url, timeout=2)  # the server is gone
    with pytest.raises(ValueError, match="http://"):
        HTTPEnvironment("localhost:1")


def test_rl_on_ray_workers_with_an_environment_server(tool_policy, tmp_path):
    ray = pytest.importorskip("ray")
    train_env = _calc(num_problems=200, seed=1, max_turns=3)
    held_env = _calc(num_problems=200, seed=2, max_turns=3)
    with (
        run_in_background(create_env_app(train_env)) as train_url,
        run_in_background(create_env_app(held_env)) as held_url,
    ):
        cfg = tool_rl_config(
            tool_policy,
            tmp_path / "rl",
            envs=[EnvConfig(kind="http", url=train_url)],
            eval_envs=[EnvConfig(kind="http", url=held_url)],
            executor="ray",
            sync_timeout_s=120,
        )
        try:
            res = run_rl(cfg, progress=False)
        finally:
            ray.shutdown()
    train = res["train"]
    assert len(train) == 2 and sum(r["groups_kept"] for r in train) > 0
    assert max(r["batch/calculator/turns"] for r in train) > 1.5, train
    assert res["eval"][-1]["calculator/count"] == 4
    with pytest.raises(ValueError, match="url"):
        dataclasses.replace(cfg.data, envs=[EnvConfig(kind="http")]).validate()


def test_metadata_only_when_exposed():
    with run_in_background(create_env_app(_calc(), expose_metadata=True)) as url:
        assert HTTPEnvironment(url)[1].metadata == _calc()[1].metadata


def test_a_mixture_of_remote_and_local_environments(one_thread):
    with run_in_background(create_env_app(_calc())) as url:
        mix = MixtureEnvironment([HTTPEnvironment(url), ArithmeticEnvironment(num_problems=4)])
        assert mix.multi_turn
        problems = mix.sample(6, seed=0)
        ep = mix.episode()
        ep.reset(next(p for p in problems if p.env == "calculator"))
        assert [t["function"]["name"] for t in ep.tool_specs()] == ["calculator"]
        ep.close()  # deleted on the server
        assert ep.inner.episode_id is None
