"""Environments: problems and rewards for GSM8K, generated arithmetic, math, HumanEval code,
instruction following; the low-effort length penalty, mixtures and the difficulty filter."""

import pytest

from hybridlm.data import builtin
from hybridlm.rl.environments import (
    LOW_EFFORT_SYSTEM,
    ArithmeticEnvironment,
    CodeEnvironment,
    GSM8KEnvironment,
    InstructionFollowingEnvironment,
    LowEffortEnvironment,
    MathEnvironment,
    MixtureEnvironment,
    Problem,
    filter_by_pass_rate,
    reward_metrics,
)
from hybridlm.rl.sandbox import Sandbox, SandboxConfig
from hybridlm.rl.verifiers import INSTRUCTIONS, Reward


def test_arithmetic_is_seeded_and_correct():
    env = ArithmeticEnvironment(num_problems=5, difficulty=(1, 2, 3, 4, 5), seed=0)
    again = ArithmeticEnvironment(num_problems=5, difficulty=(1, 2, 3, 4, 5), seed=0)
    other = ArithmeticEnvironment(num_problems=5, difficulty=(1, 2, 3, 4, 5), seed=1)
    assert [p.metadata["expression"] for p in env] == [p.metadata["expression"] for p in again]
    assert [p.answer for p in env] != [p.answer for p in other]
    assert [p.metadata["difficulty"] for p in env] == [1, 2, 3, 4, 5]
    # seed 0, checked by hand:
    #   7 + 7 = 14 ; 34 - 66 - 63 = -95 ; (992 + 489 - 367) + 598 = 1114 + 598 = 1712
    #   ((257 * 4) * 3 * 7 + 830) = 1028 * 21 + 830 = 21588 + 830 = 22418
    #   (((324 * 9 * 6) * 2) - 210 * 12) = 34992 - 2520 = 32472
    assert [p.answer for p in env] == ["14", "-95", "1712", "22418", "32472"]
    p = env[1]
    assert p.env == "arithmetic" and p.id == "arithmetic/0/1"
    assert p.prompt.startswith("<|im_start|>user\nCompute 34 - 66 - 63.")
    assert p.prompt.endswith("<|im_start|>assistant\n")
    assert env.score(p, "<think>\n34-66=-32, -32-63=-95\n</think>\nThe answer is -95.").value == 1
    assert env.score(p, "The answer is 95.").value == 0
    assert env.sample(4, seed=3) == env.sample(4, seed=3)
    with pytest.raises(ValueError, match="difficulty"):
        ArithmeticEnvironment(difficulty=7)


def test_gsm8k_environment(tmp_path):
    env = GSM8KEnvironment(builtin.path(builtin.GSM8K_TEST), limit=50)
    assert len(env) == 50 and env[0].answer == "18"
    assert "Janet" in env[0].user_text
    completions = [p.metadata["solution"] for p in env]
    assert all(r.value == 1.0 for r in env.score_many(list(env), completions))
    assert env.score(env[0], "She makes $17 every day.").value == 0.0
    with pytest.raises(ValueError, match="no such file"):
        GSM8KEnvironment(tmp_path / "gsm8k" / "missing.jsonl")


def test_math_environment():
    env = MathEnvironment(
        [
            {"problem": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"},
            {"problem": "Solve x + 2 = 7.", "solution": "Subtract: $x = \\boxed{5}$."},
        ]
    )
    assert [p.answer for p in env] == ["\\frac{3}{4}", "5"]
    assert "\\boxed{}" in env[0].user_text
    assert env.score(env[0], "Adding gives \\boxed{0.75}.").value == 1.0
    assert env.score(env[0], "\\boxed{\\frac{3}{8}}").value == 0.0
    assert env.score(env[1], "so x is \\boxed{5}").value == 1.0
    with pytest.raises(ValueError, match="no 'answer'"):
        MathEnvironment([{"problem": "?"}])


def test_code_environment_on_humaneval():
    records = builtin.read_jsonl(builtin.path(builtin.HUMANEVAL), limit=4)
    env = CodeEnvironment(records, sandbox=Sandbox(SandboxConfig(timeout_s=5.0), max_workers=2))
    assert env[0].id == "HumanEval/0" and "```python" in env[0].user_text
    # 1) continuation style: the completion is the body
    cont = [r["canonical_solution"] for r in records]
    # 2) chat style: the whole function in a code block (helpers from the prompt kept)
    full = [
        "Here you go:\n```python\n"
        + r["prompt"][r["prompt"].index(f"def {r['entry_point']}(") :]
        + r["canonical_solution"]
        + "```"
        for r in records
    ]
    # 3) broken: returns None
    broken = [
        "```python\ndef " + r["entry_point"] + "(*args):\n    return None\n```" for r in records
    ]
    problems = list(env)
    assert [x.value for x in env.score_many(problems, cont)] == [1.0] * 4
    assert [x.value for x in env.score_many(problems, full)] == [1.0] * 4
    assert [x.value for x in env.score_many(problems, broken)] == [0.0] * 4
    assert env.score(problems[0], cont[0]).metrics["pass_rate"] == 1.0


def test_instruction_following_environment():
    env = InstructionFollowingEnvironment(
        [
            {
                "key": "if/1",
                "prompt": "Describe a cat in lowercase, without commas.",
                "instruction_id_list": ["punctuation:no_comma", "change_case:english_lowercase"],
                "kwargs": [{}, {}],
            }
        ]
    )
    p = env[0]
    assert env.score(p, "a small cat sleeps on the warm mat near the window").value == 1.0
    r = env.score(p, "A small cat, asleep on the warm mat near the window")
    assert r.value == 0.0 and r.metrics["constraints_passed"] == 0.0
    gen = InstructionFollowingEnvironment.generated(num_problems=40, max_constraints=3, seed=2)
    same = InstructionFollowingEnvironment.generated(num_problems=40, max_constraints=3, seed=2)
    assert [q.user_text for q in gen] == [q.user_text for q in same]
    for q in gen:
        ids = q.answer["instruction_id_list"]
        assert 1 <= len(ids) <= 3 and set(ids) <= set(INSTRUCTIONS) and len(set(ids)) == len(ids)
        assert not {"startend:quotation", "startend:end_checker"} <= set(ids)
    with pytest.raises(ValueError, match="unknown instructions"):
        InstructionFollowingEnvironment(
            [{"prompt": "x", "instruction_id_list": ["nope"], "kwargs": [{}]}]
        )


def test_low_effort_length_penalty():
    base = ArithmeticEnvironment(num_problems=400, difficulty=1, seed=0)
    env = LowEffortEnvironment(base, fraction=0.25, penalty=0.5, free_tokens=10, max_tokens=110)
    low = [p for p in env if p.metadata.get("low_effort")]
    assert 60 <= len(low) <= 140  # about a quarter, and always the same ones for this seed
    assert [p.id for p in low] == [p.id for p in env if env.is_low_effort(p.id)]
    p, q = low[0], next(p for p in env if not p.metadata.get("low_effort"))
    assert p.messages[0] == {"role": "system", "content": LOW_EFFORT_SYSTEM}
    assert q.messages[0]["role"] == "user"
    short = f"The answer is {p.answer}."
    long = short.ljust(60, " ")  # 60 bytes: over = (60 - 10) / (110 - 10) = 0.5 -> 1 - 0.5·0.5
    huge = short.ljust(500, " ")  # over clipped to 1 -> 1 - 0.5 = 0.5
    r = env.score(p, long)
    assert r.value == pytest.approx(0.75) and r.metrics["low_effort_tokens"] == 60
    assert env.score(p, huge).value == pytest.approx(0.5)
    assert env.score(p, "The answer is 123456.".ljust(60)).value == 0.0  # wrong stays 0
    assert env.score(q, f"The answer is {q.answer}.".ljust(500)).value == 1.0  # not low effort
    # free_tokens covers short answers completely
    lenient = LowEffortEnvironment(base, fraction=1.0, free_tokens=30, max_tokens=130)
    assert lenient.score(lenient[0], f"The answer is {base[0].answer}.").value == 1.0
    with pytest.raises(ValueError, match="free_tokens"):
        LowEffortEnvironment(base, free_tokens=10, max_tokens=10)


def test_mixture_sampling_routing_and_metrics():
    arith = ArithmeticEnvironment(num_problems=50, difficulty=1, seed=0)
    ifenv = InstructionFollowingEnvironment.generated(num_problems=30, seed=0)
    mix = MixtureEnvironment([arith, ifenv], weights=[3, 1])
    assert len(mix) == 80 and mix[50].env == "ifeval" and mix[49].env == "arithmetic"
    draws = mix.sample(800, seed=7)
    assert [p.id for p in draws] == [p.id for p in mix.sample(800, seed=7)]
    share = sum(p.env == "arithmetic" for p in draws) / len(draws)
    assert 0.70 < share < 0.80  # weight 3/4
    a, i = arith[0], ifenv[0]
    completions = [f"The answer is {a.answer}.", "WRONG, AND LOUD"]
    rewards = mix.score_many([a, i], completions)
    assert rewards[0].value == 1.0 and rewards[0] == mix.score(a, completions[0])
    assert rewards[1] == ifenv.score(i, completions[1])
    with pytest.raises(ValueError, match="unknown environment"):
        mix.score(Problem(id="x", messages=(), answer=None, env="nope"), "")
    # per-environment aggregation: arithmetic rewards 1, 0, 1 ; ifeval 0.5 with a metric
    probs = [a, a, a, i]
    rs = [Reward(1.0), Reward(0.0), Reward(1.0), Reward(0.5, metrics={"constraints_passed": 0.5})]
    m = reward_metrics(probs, rs)
    assert m["arithmetic/count"] == 3 and m["arithmetic/reward_mean"] == pytest.approx(2 / 3)
    assert m["arithmetic/solved"] == pytest.approx(2 / 3) and m["ifeval/solved"] == 0.0
    assert m["ifeval/constraints_passed"] == 0.5
    assert m["all/reward_mean"] == pytest.approx(2.5 / 4)  # (1 + 0 + 1 + 0.5) / 4
    with pytest.raises(ValueError, match="weights"):
        MixtureEnvironment([arith], weights=[-1])


def test_difficulty_filter_drops_always_and_never_solved():
    env = ArithmeticEnvironment(num_problems=9, difficulty=(1, 2, 3), seed=0)

    def sample(problem, n):
        """A sampler with a known skill: always right at difficulty 1, right on 3 of 8 samples
        at difficulty 2, never right at difficulty 3."""
        right, wrong = f"The answer is {problem.answer}.", "The answer is 0.5."
        k = {1: n, 2: 3, 3: 0}[problem.metadata["difficulty"]]
        return [right] * k + [wrong] * (n - k)

    rep = filter_by_pass_rate(env, sample, num_samples=8)
    assert [p.metadata["difficulty"] for p in rep.kept] == [2, 2, 2]
    assert (rep.dropped_solved, rep.dropped_unsolved) == (3, 3)
    assert rep.pass_rates[env[1].id] == pytest.approx(3 / 8)
    # a lower upper cut: with max_rate 0.3 the 3/8 problems count as solved as well
    strict = filter_by_pass_rate(env, sample, num_samples=8, max_rate=0.3)
    assert strict.kept == [] and strict.dropped_solved == 6
    sub = env.subset(lambda p: p.id in {q.id for q in rep.kept})
    assert len(sub) == 3 and sub.score(sub[0], f"The answer is {sub[0].answer}").value == 1
    with pytest.raises(ValueError, match="completions"):
        filter_by_pass_rate(env, lambda p, n: ["x"], num_samples=2)
