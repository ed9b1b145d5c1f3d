"""RULER generators: deterministic, fitted to the length, and the answer is in the context."""

import re
from collections import Counter

import pytest

from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.eval.ruler import RULER_TASKS, make_sample, make_samples, score_prediction

TOK = ByteTokenizer()


@pytest.mark.parametrize("task", RULER_TASKS)
@pytest.mark.parametrize("length", [1024, 4096])
def test_deterministic_and_fitted(task, length):
    a = make_samples(task, length, 3, tokenizer=TOK, seed=0)
    b = make_samples(task, length, 3, tokenizer=TOK, seed=0)
    assert a == b  # same samples on every call
    assert a[0] != a[1]  # but different across indices
    assert make_sample(task, length, 0, tokenizer=TOK, seed=1) != a[0]  # and across seeds
    for s in a:
        assert s.num_tokens == len(TOK.encode(s.prompt))
        assert s.num_tokens + s.max_new_tokens <= length
        # the haystack fills the budget: within one filler unit (~90 bytes) of the limit
        assert length - (s.num_tokens + s.max_new_tokens) < 200
        assert s.prompt.startswith(s.prompt.split("\n", 1)[0]) and s.context in s.prompt


def _needles(context):
    return re.findall(r"One of the special magic numbers for ([\w-]+) is: (\d+)\.", context)


@pytest.mark.parametrize("length", [1024, 2048])
def test_answers_are_in_the_context(length):
    for i in range(5):
        s = make_sample("niah_single", length, i, tokenizer=TOK)
        ((key, val),) = _needles(s.context)
        assert s.answers == (val,) and f"number for {key} mentioned" in s.prompt

        s = make_sample("niah_multikey", length, i, tokenizer=TOK)
        found = dict(_needles(s.context))
        assert len(found) == 4
        asked = re.search(r"magic number for ([\w-]+) mentioned", s.prompt).group(1)
        assert s.answers == (found[asked],)

        s = make_sample("niah_multivalue", length, i, tokenizer=TOK)
        pairs = _needles(s.context)
        assert len({k for k, _ in pairs}) == 1 and tuple(v for _, v in pairs) == s.answers

        s = make_sample("vt", length, i, tokenizer=TOK)
        value = re.search(r"assigned the value (\d+)", s.prompt).group(1)
        assigned = {value}
        holders = []
        for name, rhs in re.findall(r"VAR (\w+) = (\w+)\.", s.context):  # follow the chain
            if rhs in assigned:
                assigned.add(name)
                holders.append(name)
        assert tuple(holders) == s.answers and len(holders) == 5

        s = make_sample("cwe", length, i, tokenizer=TOK)
        counts = Counter(re.findall(r"\d+\. (\S+)", s.context))
        top = [w for w, _ in counts.most_common(5)]
        assert set(top) == set(s.answers)
        assert min(counts[w] for w in s.answers) > max(
            c for w, c in counts.items() if w not in s.answers
        )

        s = make_sample("fwe", length, i, tokenizer=TOK)
        counts = Counter(s.context.split())
        ranked = [w for w, _ in counts.most_common()]
        assert tuple(ranked[:3]) == s.answers  # the three most frequent, in order
        n = [counts[w] for w in ranked]
        assert n[0] > n[1] > n[2] > n[3] and len(counts) > 10  # strict, Zipf-like


def test_scoring_and_errors():
    assert score_prediction(" 1234567.", ("1234567",)) == {
        "string_match": 1.0,
        "exact_match": 1.0,
    }
    assert score_prediction("a, C", ("A", "b", "c", "d")) == {
        "string_match": 0.5,
        "exact_match": 0.0,
    }
    with pytest.raises(ValueError, match="too short"):
        make_sample("niah_multikey", 128, 0, tokenizer=TOK)
    with pytest.raises(ValueError, match="unknown RULER task"):
        make_sample("qa_1", 1024, 0, tokenizer=TOK)


def test_ruler_task_skips_lengths_that_cannot_fit(one_thread):
    import torch

    from _tiny import tiny_train_model
    from hybridlm.eval.tasks import EvalRunner, RulerTask
    from hybridlm.model.model import HybridLM

    torch.manual_seed(0)
    runner = EvalRunner(model=HybridLM(tiny_train_model(mtp=False), seed=0).eval(), tokenizer=TOK)
    task = RulerTask(name="ruler_niah_single", task="niah_single", lengths=(128, 512))
    res = task.run(runner, limit=2)
    assert res.num_items == 2 and set(res.metrics) == {"string_match@512", "string_match"}
    assert len(res.notes) == 1 and "128" in res.notes[0]
    assert all(0.0 <= s["string_match"] <= 1.0 for s in res.samples)
    with pytest.raises(ValueError, match="no usable length"):
        RulerTask(name="x", task="niah_multikey", lengths=(128,)).run(runner, limit=1)
