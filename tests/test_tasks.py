"""Generated task families (`data.tasks`): each reference solution is right by its environment's
own verifier, the SFT chats render as the rollouts do, the held-out seed gives new problems, and
the offline difficulty filter (`rl.env_config.difficulty_filter`) keeps what it should and
reports pass@k."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import warnings

import pytest
import torch

from hybridlm.data import tasks
from hybridlm.data.sft import arithmetic_conversations
from hybridlm.report.stats import change_text, env_changes, pass_at_k
from hybridlm.rl.env_config import (
    DifficultyFilterConfig,
    EnvConfig,
    build_environment,
    build_mixture,
    difficulty_filter,
)
from hybridlm.rl.environments import DatasetEnvironment, FilterReport, MixtureEnvironment, Problem
from hybridlm.rl.verifiers import Reward
from hybridlm.train.post_training import ChatSource, load_source


def test_two_number_arithmetic_is_unchanged_and_chains_are_right():
    # the two-number questions are the ones every earlier run trained on
    convs = arithmetic_conversations(50, seed=0)
    digest = hashlib.sha256(json.dumps(convs).encode()).hexdigest()[:16]
    assert convs[0][0]["content"] == "What is 97 - 49?" and digest == "310082be2007fd53"
    for conv in arithmetic_conversations(300, seed=3, terms=4):
        question = conv[0]["content"].removeprefix("What is ").removesuffix("?")
        assert len(question.split()) == 7  # four numbers, three operators
        value = int(question.split()[0])
        for op, b in zip(question.split()[1::2], question.split()[2::2], strict=True):
            value = value + int(b) if op == "+" else value - int(b)
            assert value >= 0  # every intermediate value stays >= 0
        assert conv[1]["content"] == str(value)
        # each step of the trace ends with its intermediate value; the last is the answer
        steps = [x for x in conv[1]["reasoning_content"].split("\n") if x.startswith("= ")]
        assert len(steps) == 3 and steps[-1] == f"= {value}"
    with pytest.raises(ValueError, match="terms must be >= 2"):
        arithmetic_conversations(1, terms=1)
    # by one digit: the trace's carries end in the product
    for conv in arithmetic_conversations(200, seed=1, ops="*"):
        a, b = map(int, conv[0]["content"].removeprefix("What is ").removesuffix("?").split(" * "))
        assert 2 <= b <= 9 and conv[1]["content"] == str(a * b)
        digits = [int(x.split("write ")[1][0]) for x in conv[1]["reasoning_content"].split("\n")]
        assert int("".join(map(str, reversed(digits)))) == a * b
    with pytest.raises(ValueError, match="ops must be drawn from"):
        arithmetic_conversations(1, ops="/")
    with pytest.raises(ValueError, match="ops must be drawn from"):
        arithmetic_conversations(1, ops="*", terms=3)


def test_chained_arithmetic_environment_scores_the_sft_answers():
    env = build_environment(EnvConfig(kind="sft_arithmetic", terms=3, num_problems=40, seed=2))
    convs = arithmetic_conversations(40, seed=2, terms=3)
    for p, conv in zip(env, convs, strict=True):
        assert p.user_text == conv[0]["content"] and p.id.startswith("sft_arithmetic/2x3/2/")
        assert env.score(p, conv[1]["content"]).value == 1.0
        assert env.score(p, str(int(conv[1]["content"]) + 1)).value == 0.0


def test_calculator_chats_are_the_environment_demonstrations():
    env = build_environment(EnvConfig(kind="calculator", digits=3, num_problems=6, seed=4))
    chats = {c[1]["content"]: c for c in tasks.calculator_conversations(6, digits=3, seed=4)}
    for demo in env.demonstrations(4, seed=1):  # run the real tool
        assert demo == chats[demo[1]["content"]]
        assert env.score(env.problems[0], demo[-1]["content"]).value in (0.0, 1.0)
    with pytest.raises(ValueError, match="digits"):
        tasks.products(1, digits=0, seed=0)


def test_ifeval_references_follow_every_constraint_of_the_verifier():
    env = build_environment(EnvConfig(kind="ifeval", num_problems=400, seed=7))
    records = tasks.ifeval_records(400, seed=7)
    failed = [
        (r["prompt"], reply.reason)
        for r, p in zip(records, env, strict=True)
        if (reply := env.score(p, tasks.ifeval_response(r, seed=7))).value != 1.0
    ]
    assert not failed, failed[:3]
    # word limits hold however many constraints a record has, whatever the reply's seed
    for max_constraints in (2, 4):
        recs = tasks.ifeval_records(300, seed=3, max_constraints=max_constraints)
        more = build_environment(EnvConfig(kind="ifeval", num_problems=1)).__class__(recs)
        for r, p in zip(recs, more, strict=True):
            for reply_seed in (0, 5):
                got = more.score(p, tasks.ifeval_response(r, seed=reply_seed))
                assert got.value == 1.0, (r["prompt"], got.reason)
    # every constraint kind occurs, and the replies vary
    ids = {i for r in records for i in r["instruction_id_list"]}
    assert len(ids) == 8
    convs = tasks.ifeval_conversations(30, seed=7)
    assert len({c[1]["content"] for c in convs}) == 30
    assert env.score(env.problems[0], "").value == 0.0


def test_code_references_pass_their_tests_and_wrong_code_fails():
    records = tasks.code_records(60, seed=5)
    for rec in records:  # our own generated code: run it here
        scope: dict = {}
        exec(rec["prompt"] + rec["canonical_solution"] + rec["test"], scope)  # noqa: S102
        scope["check"](scope[rec["entry_point"]])
    env = build_environment(EnvConfig(kind="code_gen", num_problems=12, seed=5))
    replies = [c[1]["content"] for c in tasks.code_conversations(12, seed=5)]
    assert [r.value for r in env.score_many(list(env), replies)] == [1.0] * 12
    wrong = [r.replace("return ", "return 1 + ") for r in replies]
    assert sum(r.value for r in env.score_many(list(env), wrong)) <= 1.0
    # the tests tell each function from a shortcut: a constant, the identity, a missing slice
    for rec in tasks.code_records(600, seed=9):
        arg = rec["prompt"].split("(")[1].split(":")[0]
        for body in ("    return 0\n", "    return []\n", "    return ''\n", f"    return {arg}\n"):
            scope: dict = {}
            exec(rec["prompt"] + body + rec["test"], scope)  # noqa: S102
            with pytest.raises(AssertionError):
                scope["check"](scope[rec["entry_point"]])
    # another seed: mostly functions the SFT seed never showed
    seen = {r["prompt"] for r in tasks.code_records(4000, seed=0)}
    fresh = [r["prompt"] not in seen for r in tasks.code_records(300, seed=2)]
    assert sum(fresh) / len(fresh) > 0.8


def test_chat_sources_of_the_task_families():
    for kind, digits in (("calculator", 3), ("ifeval", 2), ("code_gen", 2), ("arithmetic", 2)):
        from hybridlm.data.sft import ReadReport

        report = ReadReport()
        convs = load_source(ChatSource(kind=kind, max_rows=5, digits=digits, seed=1), report)
        assert len(convs) == 5 and report.kept == 5
        assert convs[-1][-1]["role"] == "assistant"
    chained = load_source(ChatSource(kind="arithmetic", max_rows=3, terms=3), ReadReport())
    assert chained == arithmetic_conversations(3, seed=0, terms=3)
    with pytest.raises(ValueError, match="a code_gen chat source needs max_rows"):
        ChatSource(kind="code_gen")
    with pytest.raises(ValueError, match="terms >= 2"):
        ChatSource(kind="arithmetic", max_rows=2, terms=1)


def test_pass_at_k_is_the_unbiased_estimate():
    for n, c, k in ((8, 0, 1), (8, 3, 1), (8, 3, 8), (8, 1, 4), (10, 2, 5)):
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact)


class _ByIdEnvironment(DatasetEnvironment):
    """Problems 'easy/*' always solved, 'hard/*' never, 'mid/*' on about half the samples."""

    def score(self, problem: Problem, completion: str) -> Reward:
        kind = problem.id.split("/")[0]
        if kind == "mid":
            return Reward(float(zlib_parity(completion)), "")
        return Reward(float(kind == "easy"), "")


def zlib_parity(text: str) -> int:
    return hashlib.sha256(text.encode()).digest()[0] % 2


def test_difficulty_filter_keeps_the_problems_in_range_and_reports_pass_at_k(tiny_model):
    model, tok = tiny_model
    msgs = ({"role": "user", "content": "hi"},)
    problems = [
        Problem(id=f"{kind}/{i}", messages=msgs, answer="")
        for kind in ("easy", "hard", "mid")
        for i in range(4)
    ]
    env = _ByIdEnvironment(problems, name="byid")
    other = _ByIdEnvironment([p for p in problems if not p.id.startswith("mid")], name="other")
    mixture = MixtureEnvironment([env, other], [1.0, 1.0])
    cfg = DifficultyFilterConfig(problems=12, samples=4).validate()
    out, stats = difficulty_filter(
        model, tok, mixture, cfg, temperature=1.0, max_new_tokens=4, seed=0
    )
    kept = {p.id for p in out.envs["byid"]}
    assert kept and all(k.startswith("mid/") for k in kept)
    s = stats["byid"]
    assert s["pool"] == 12 and s["dropped_solved"] == 4 and s["dropped_unsolved"] >= 4
    assert s["kept"] == len(kept) and 4 / 12 <= s["pass@1"] < 8 / 12 and s["pass@4"] >= s["pass@1"]
    # nothing of `other` in range: weight 0, and the mixture samples only `byid`
    assert out.weights["other"] == 0.0 and stats["other"]["kept"] == 0
    assert {p.env for p in out.sample(20, seed=1)} == {"byid"}
    # a pool smaller than the dataset: what was not sampled stays
    part, st = difficulty_filter(
        model, tok, MixtureEnvironment([env]), dataclasses.replace(cfg, problems=6),
        temperature=1.0, max_new_tokens=2, seed=0,
    )  # fmt: skip
    assert st["byid"]["pool"] == 6 and st["byid"]["dropped_solved"] == 4
    left = {p.id for p in part.envs["byid"]}
    assert left == {"hard/2", "hard/3"} | {f"mid/{i}" for i in range(4)}
    # no environment with anything in range: the unfiltered mixture, with a warning
    alone = MixtureEnvironment([other])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same, _ = difficulty_filter(
            model, tok, alone, cfg, temperature=1.0, max_new_tokens=2, seed=0
        )
    assert same is alone and "kept no problem" in str(caught[0].message)
    with pytest.raises(ValueError, match="min_rate < max_rate"):
        DifficultyFilterConfig(problems=4, min_rate=0.5, max_rate=0.5).validate()


def test_filter_report_split_matches_the_per_problem_filter():
    msgs = ({"role": "user", "content": "q"},)
    probs = [Problem(id=str(i), messages=msgs, answer="") for i in range(5)]
    rep = FilterReport.split(probs, [0.0, 0.25, 0.5, 1.0, 0.75], 0.0, 1.0)
    assert [p.id for p in rep.kept] == ["1", "2", "4"]
    assert (rep.dropped_solved, rep.dropped_unsolved) == (1, 1)


def test_env_changes_and_their_noise_verdicts():
    evals = [
        {"step": 0, "a/solved": 0.5, "a/count": 100.0, "all/solved": 0.5, "all/count": 100.0},
        {"step": 9, "a/solved": 0.7, "a/count": 100.0, "all/solved": 0.52, "all/count": 100.0},
    ]
    ch = env_changes(evals)
    p, q, se, n = ch["a"]
    assert (p, q, n) == (0.5, 0.7, 100) and se == pytest.approx(math.sqrt((0.25 + 0.21) / 100))
    assert change_text(q - p, se).endswith("up")
    assert change_text(0.02, ch["all"][2]).endswith("within noise")
    assert env_changes(evals[:1]) == {}


@pytest.fixture(scope="module")
def tiny_model():
    from _tiny import tiny_train_model
    from hybridlm.data.tokenizer import ByteTokenizer
    from hybridlm.model.model import HybridLM

    torch.manual_seed(0)
    random.seed(0)
    return HybridLM(tiny_train_model(mtp=False)).eval(), ByteTokenizer()


def test_mixture_of_the_speedrun_environments_builds():
    specs = [
        EnvConfig(kind="sft_arithmetic", terms=3, num_problems=10, seed=1),
        EnvConfig(kind="calculator", digits=3, num_problems=10, seed=1, max_turns=2),
        EnvConfig(kind="ifeval", num_problems=10, seed=1),
        EnvConfig(kind="code_gen", num_problems=10, seed=1),
    ]
    mix = build_mixture(specs)
    assert sorted(mix.envs) == ["calculator", "code_gen", "ifeval", "sft_arithmetic"]
    assert mix.episodic() is not None and sorted(mix.episodic().envs) == ["calculator"]
