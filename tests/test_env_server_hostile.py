"""The environment server against a hostile policy and hostile clients (rl/remote.py): JSON
nested thousands deep inside strings, inputs that made the verifiers backtrack for tens of
seconds, a verifier stuck holding the interpreter, wrong answers fishing for the ground truth,
concurrent steps on one episode, megabyte echoes, and requests without the token. Each class
answers with JSON, on time, and gives nothing away; and the learner's in-process scoring has the
same deadline (rl/scoring.py)."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from _hostile import BacktrackingEnvironment
from hybridlm.infer.server import run_in_background
from hybridlm.rl.environments import ArithmeticEnvironment, CalculatorEnvironment
from hybridlm.rl.remote import HTTPEnvironment, HTTPError, create_env_app
from hybridlm.rl.scoring import DeadlineEnvironment, ScoringPool, with_deadline

DEEP = "[" * 100_000 + "]" * 100_000  # deep enough for RecursionError in json.loads
MIB = 1 << 20


def _calc(**kw) -> CalculatorEnvironment:
    return CalculatorEnvironment(**{"num_problems": 20, "digits": 5, "seed": 3, **kw})


@pytest.fixture(scope="module")
def server():
    with run_in_background(create_env_app(_calc(), verify_timeout_s=5.0)) as url:
        yield url


def _episode(http: httpx.Client, problem_id: str = "calculator/3/0") -> str:
    out = http.post("/episodes", json={"problem_id": problem_id})
    assert out.status_code == 200, out.text
    return f"/episodes/{out.json()['episode_id']}/step"


def test_json_nested_deep_inside_strings_is_not_a_500(server):
    http = httpx.Client(base_url=server, timeout=60)
    call = {"id": "c", "function": {"name": "calculator", "arguments": DEEP}}
    out = http.post(_episode(http), json={"reply": {"content": "", "tool_calls": [call]}})
    assert out.status_code == 200, out.text
    assert out.json()["observation"][0]["content"].startswith("error: the arguments: nests")
    text = f'<tool_call>{{"name": "calculator", "arguments": {DEEP}}}</tool_call>'
    for path, body in (
        ("/verify", {"problem_id": "calculator/3/0", "completion": text}),
        (_episode(http), {"reply": {"content": text, "text": text}}),
    ):
        out = http.post(path, json=body)
        assert out.status_code == 200 and out.json()["reward"] == 0.0, out.text[:300]


@pytest.mark.parametrize(
    "completion",
    [
        "The answer is" + " " * MIB + "x",  # adjacent \s* backtracking (cubic)
        "\\boxed{" * (MIB // 7),  # the group rescanned to the end per match (quadratic)
        "<tool_call>" * (MIB // 11),  # the unclosed-tag regex (quadratic)
        "```" + "a" * MIB,  # the fence regex on a long line
        "final answer" + "\n" * MIB,
    ],
    ids=["answer-spaces", "boxed", "tool-call", "fence", "final-answer-newlines"],
)
def test_what_stalled_the_verifiers_answers_at_once(server, completion):
    http = httpx.Client(base_url=server, timeout=60)
    t0 = time.monotonic()
    out = http.post("/verify", json={"problem_id": "calculator/3/0", "completion": completion})
    assert out.status_code == 200 and out.json()["reward"] == 0.0
    assert out.json()["reason"] != "verification timed out"  # linear: no deadline needed
    assert time.monotonic() - t0 < 4.0
    assert len(out.content) < 2000  # the reply does not echo the megabyte back


def test_a_verifier_stuck_in_a_regex_costs_only_its_own_request():
    env = BacktrackingEnvironment(num_problems=4)
    with run_in_background(create_env_app(env, verify_timeout_s=1.5)) as url:
        http = httpx.Client(base_url=url, timeout=60)
        pid = env[0].id
        assert http.post("/verify", json={"problem_id": pid, "completion": "1"}).status_code == 200
        with ThreadPoolExecutor(2) as pool:
            t0 = time.monotonic()
            stuck = pool.submit(
                http.post, "/verify", json={"problem_id": pid, "completion": "x" * 40}
            )
            time.sleep(0.3)
            info = [http.get("/info") for _ in range(5)]  # answered while the verifier spins
            t_info = time.monotonic() - t0
            out = stuck.result()
        assert all(r.status_code == 200 for r in info) and t_info < 1.5
        assert out.json() == {
            "reward": 0.0,
            "reason": "verification timed out",
            "metrics": {"verify_timeout": 1.0},
        }
        assert time.monotonic() - t0 < 10
        # the worker was replaced: the next completion is scored as usual
        right = f"The answer is {env[0].answer}."
        assert http.post("/verify", json={"problem_id": pid, "completion": right}).json()[
            "reward"
        ] == (1.0)
        crash = http.post("/verify", json={"problem_id": pid, "completion": "crash"}).json()
        assert crash["reason"] == "verifier error" and crash["reward"] == 0.0
        assert "KeyError" not in json.dumps(crash)  # the detail stays on the server


def test_no_reply_holds_the_ground_truth(server):
    env = _calc()
    http = httpx.Client(base_url=server, timeout=60)
    for i in range(5):
        p = env[i]
        wrong = f"The answer is {int(p.answer) + 1}."
        body = http.post("/verify", json={"problem_id": p.id, "completion": wrong}).text
        assert p.answer not in body and "wrong answer" in body
        out = http.post(_episode(http, p.id), json={"reply": {"content": wrong}})
        assert p.answer not in out.text and out.json()["info"]["reason"] == "wrong answer"
        problem = http.get(f"/problems/{i}").text
        assert p.answer not in problem and str(p.metadata["a"]) in problem  # the question only
    # the verdict spelt out only from a server that debugs its rewards
    with run_in_background(create_env_app(_calc(), debug_rewards=True)) as url:
        out = httpx.post(f"{url}/verify", json={"problem_id": env[0].id, "completion": "1"})
        assert env[0].answer in out.json()["detail"]


def test_one_step_at_a_time_and_one_reward_per_episode():
    class SlowCalc(CalculatorEnvironment):  # a tool step that takes a moment
        def tools(self):
            from hybridlm.rl.tools import Calculator

            class Slow(Calculator):
                def run(self, arguments):
                    time.sleep(0.3)
                    return super().run(arguments)

            return [Slow()]

    env = SlowCalc(num_problems=4, digits=3, seed=1, max_turns=4)
    with run_in_background(create_env_app(env, verify_timeout_s=0)) as url:
        http = httpx.Client(base_url=url, timeout=60)
        step = _episode(http, env[0].id)
        call = {"id": "c", "function": {"name": "calculator", "arguments": '{"expression": "1"}'}}
        tool = {"reply": {"content": "", "tool_calls": [call]}}
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda _: http.post(step, json=tool), range(8)))
        codes = sorted(o.status_code for o in outs)
        assert codes == [200] + [409] * 7, codes
        busy = [o.json()["error"]["code"] for o in outs if o.status_code == 409]
        assert set(busy) == {"episode_busy"}
        # the turn limit counts accepted steps: 3 more tool turns end it, unpaid
        done = [http.post(step, json=tool).json()["done"] for _ in range(3)]
        assert done == [False, False, True]
        assert http.post(step, json=tool).status_code == 404
        # 8 simultaneous right answers on a fresh episode: one is paid, once
        step = _episode(http, env[1].id)
        right = {"reply": {"content": f"The answer is {env[1].answer}."}}
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda _: http.post(step, json=right), range(8)))
        paid = [o.json()["reward"] for o in outs if o.status_code == 200]
        assert paid == [1.0], [o.status_code for o in outs]


def test_no_echo_of_large_input(server):
    http = httpx.Client(base_url=server, timeout=60)
    out = http.post("/verify", json={"problem_id": "x" * MIB, "completion": "1"})
    assert out.status_code == 404 and len(out.content) < 1000
    call = {"id": "c", "function": {"name": "n" * MIB, "arguments": "{}"}}
    out = http.post(_episode(http), json={"reply": {"content": "", "tool_calls": [call]}})
    assert out.status_code == 200 and len(out.content) < 1000
    big = "The answer is " + "9" * MIB
    out = http.post("/verify", json={"problem_id": "calculator/3/0", "completion": big})
    assert len(out.content) < 1000
    small = {"id": "c", "function": {"name": "calculator", "arguments": "{}"}}
    many = [small] * 100  # more tool calls than a reply may make
    out = http.post(_episode(http), json={"reply": {"content": "", "tool_calls": many}})
    assert out.status_code == 400 and "at most 32 tool calls" in out.text


def test_a_token_guards_every_route_and_the_client_sends_it(monkeypatch):
    with run_in_background(create_env_app(_calc(), token="s3cret")) as url:
        for method, path in (("GET", "/info"), ("GET", "/problems/0"), ("POST", "/verify")):
            out = httpx.request(method, url + path, json={})
            assert out.status_code == 401 and out.headers["www-authenticate"] == "Bearer"
            assert out.json()["error"]["code"] == "unauthorized"
        bad = httpx.get(url + "/info", headers={"Authorization": "Bearer s3cre"})
        assert bad.status_code == 401
        with pytest.raises(HTTPError, match="401"):
            HTTPEnvironment(url)
        assert len(HTTPEnvironment(url, token="s3cret")) == 20
        monkeypatch.setenv("HYBRIDLM_ENV_TOKEN", "s3cret")
        env = HTTPEnvironment(url)
        assert env.score(env[0], "The answer is 1.").reason == "wrong answer"
    with pytest.raises(ValueError, match="empty token"):
        create_env_app(_calc(), token="")


def test_request_ids_and_debug_request_logs(server, caplog):
    out = httpx.get(server + "/info", headers={"X-Request-ID": "trainer-7.step-3"})
    assert out.headers["x-request-id"] == "trainer-7.step-3"
    odd = httpx.get(server + "/info", headers={"X-Request-ID": "x" * 500})
    assert len(odd.headers["x-request-id"]) == 16  # not echoed: a fresh one
    with caplog.at_level(logging.DEBUG, logger="hybridlm.server"):
        rid = httpx.get(server + "/problems/1").headers["x-request-id"]
        time.sleep(0.1)
    line = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
    assert line and "GET /problems/1 -> 200" in line[0]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if rid in r.getMessage())


def test_env_serve_flags():
    from hybridlm.cli import build_parser

    args = build_parser().parse_args(["env-serve"])
    assert (args.host, args.token, args.log_level, args.verify_timeout) == (
        "127.0.0.1",
        None,
        "info",
        10.0,
    )
    args = build_parser().parse_args(
        ["env-serve", "--token", "t", "--log-level", "debug", "--debug-rewards"]
    )
    assert (args.token, args.log_level, args.debug_rewards) == ("t", "debug", True)


# -------------------------------------------------------------- in-process: the learner


def test_the_learner_scores_under_the_same_deadline():
    env = BacktrackingEnvironment(num_problems=4)
    with ScoringPool(1) as pool:
        guarded = with_deadline(env, timeout_s=1.5, pool=pool)
        assert isinstance(guarded, DeadlineEnvironment) and guarded.name == "backtracking"
        problems = list(env)[:3]
        right = f"The answer is {env[2].answer}."
        t0 = time.monotonic()
        got = guarded.score_many(problems, ["x" * 40, "crash", right])
        assert time.monotonic() - t0 < 15  # one deadline, one worker start
        assert [(r.value, r.reason) for r in got] == [
            (0.0, "verification timed out"),
            (0.0, "verifier error"),
            (1.0, "correct"),
        ]
        assert got[0].metrics == {"verify_timeout": 1.0} and "KeyError" in got[1].detail
    # episodes score their final reply through the deadline too
    mix = with_deadline(
        __import__("hybridlm.rl.environments", fromlist=["x"]).MixtureEnvironment(
            [_calc(), ArithmeticEnvironment(num_problems=3)]
        ),
        timeout_s=5,
    )
    leaf = mix.env_of(_calc()[0])
    assert isinstance(leaf, DeadlineEnvironment)
    ep = mix.episode()
    ep.reset(_calc()[0])
    assert ep.inner.env is leaf  # the tool episode's scorer is the guarded environment
    out = ep.step({"content": f"The answer is {_calc()[0].answer}."})
    assert out.reward == 1.0 and out.info["reason"] == "correct"


def test_workers_that_cannot_start_fall_back_to_in_process(monkeypatch, caplog):
    import sys

    monkeypatch.setattr(sys, "executable", "/bin/false")  # every worker exits at once
    env = ArithmeticEnvironment(num_problems=3)
    with ScoringPool(1) as pool, caplog.at_level(logging.WARNING, logger="hybridlm.scoring"):
        guarded = with_deadline(env, timeout_s=1.0, pool=pool)
        right = f"The answer is {env[0].answer}."
        assert guarded.score(env[0], right).value == 1.0  # scored all the same
        assert pool.broken and "exited with code 1" in pool.broken
        assert "without a deadline" in caplog.text
    # the server awaits the pool's future: its failure is scored in-process there too, not a 500
    with run_in_background(create_env_app(env, verify_timeout_s=1.0)) as url:
        out = httpx.post(f"{url}/verify", json={"problem_id": env[0].id, "completion": right})
        assert out.status_code == 200 and out.json()["reward"] == 1.0, out.text
