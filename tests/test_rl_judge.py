"""Generative reward models: verdicts parsed robustly (last verdict wins, reasoning ignored,
out-of-scale numbers refused), a judge on the engine grading and comparing (scripted verdicts),
its prompt showing the reply's answer without the reasoning, and a judged environment built
from a config."""

import pytest

from _tiny import ForcedTokens
from hybridlm import HybridLM
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.engine import Engine
from hybridlm.infer.sampling import SamplingParams
from hybridlm.interop.hf import save_pretrained
from hybridlm.presets import get_preset
from hybridlm.rl.env_config import EnvConfig, build_environment
from hybridlm.rl.environments import ArithmeticEnvironment
from hybridlm.rl.judge import GenerativeJudge, JudgedEnvironment, parse_preference, parse_rating

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = ByteTokenizer()


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Good reply.\n[[8]]", 8.0),
        ("[[ 7 ]]", 7.0),
        ("Rating: 6", 6.0),
        ("My score is 9/10.", 9.0),
        ("Score: **4** out of 10", 4.0),
        ("Solid, 7/10", 7.0),
        ("First I thought [[3]] but on reflection [[5]]", 5.0),  # the last verdict wins
        ("<think>maybe [[2]]</think>\nFinal: [[9]]", 9.0),  # reasoning ignored
        ("<think>it is a [[2]] reply", None),  # the reasoning never closed: no verdict
        ("[[11]]", None),  # outside 1..10
        ("Rating: 0", None),
        ("This reply is great.", None),
        ("[[8]]<|im_end|>[[2]]", 8.0),  # past the end of the turn is not the judge's
    ],
)
def test_parse_rating(text, want):
    assert parse_rating(text) == want


def test_parse_preference():
    assert parse_preference("A is more accurate. [[A]]") == "A"
    assert parse_preference("[[A]] ... no wait, [[B]]") == "B"
    assert parse_preference("equal: [[C]]") == "tie"
    assert parse_preference("A is better") is None


class _Script:
    def __init__(self, replies):
        self.replies = list(replies)

    def __call__(self):
        return ForcedTokens(TOK.encode(self.replies.pop(0) + "<|im_end|>", add_bos=False), 258)


def _engine() -> Engine:
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.mtp.pattern, cfg.max_seq_len = 258, "", 2048
    return Engine(HybridLM(cfg, seed=0).eval(), TOK)


def test_judge_grades_and_compares_with_the_answers_only():
    verdicts = ["Correct. [[10]]", "Wrong sum. Rating: 1", "No idea.", "[[B]]"]
    params = SamplingParams(max_tokens=64, constraint=_Script(verdicts))
    judge = GenerativeJudge(_engine(), params=params)
    seen = []
    generate = judge.engine.generate
    judge.engine.generate = lambda prompts, p: seen.extend(prompts) or generate(prompts, p)
    rewards = judge.grade(
        ["What is 2 + 2?"] * 3,
        ["<think>\n2 + 2 is 4\n</think>\nThe answer is 4.", "The answer is 5.", "4"],
        ["The answer is 4.", None, None],
    )
    assert [r.value for r in rewards] == [1.0, 0.0, 0.0]
    assert [r.reason for r in rewards] == ["rated 10", "rated 1", "no verdict"]
    assert judge.unparsed == 1 and rewards[2].metrics["judge_unparsed"] == 1.0
    first = TOK.decode(seen[0])
    assert "The answer is 4." in first and "2 + 2 is 4" not in first  # no reasoning shown
    assert "[Reference answer]" in first and "[Reference answer]" not in TOK.decode(seen[1])
    assert judge.compare(["q"], ["a"], ["b"]) == ["B"]


def test_judged_environment_from_a_config(tmp_path):
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.mtp.pattern = 258, ""
    path = tmp_path / "judge"
    save_pretrained(HybridLM(cfg, seed=0), path, tokenizer=TOK)
    env = build_environment(EnvConfig(kind="arithmetic", num_problems=4, judge=str(path)))
    assert isinstance(env, JudgedEnvironment) and len(env) == 4
    assert env[0].env == "arithmetic_judged" and not env.multi_turn
    env.judge.params = SamplingParams(max_tokens=16, constraint=_Script(["[[10]]", "meh"]))
    got = env.score_many([env[0], env[1]], ["The answer is 3.", "no"])
    assert [r.value for r in got] == [1.0, 0.0]
    base = ArithmeticEnvironment(num_problems=4, difficulty=[1, 2], seed=0)
    assert env[2].messages == base[2].messages
    with pytest.raises(ValueError, match="single-turn"):
        EnvConfig(kind="calculator", judge="x").validate()
