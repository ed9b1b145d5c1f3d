"""Normalisations, pass@k, standard errors, the task registry and `hybridlm eval` end to end."""

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from _tiny import tiny_train_model
from hybridlm.cli import main
from hybridlm.data import builtin
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.eval.harness import EvalConfig, LoadedModel, evaluate, load_model
from hybridlm.eval.loglik import LN2, encode_pair, loglikelihood
from hybridlm.eval.tasks import (
    EvalRunner,
    MCItem,
    MCTask,
    bootstrap_ratio_stderr,
    cloze_prompt,
    copycolors_items,
    get_task,
    gsm8k_final,
    gsm8k_mc_items,
    humaneval_environment,
    mc_prompt,
    mean_stderr,
    normalised_scores,
    resolve_tasks,
    score_humaneval,
)
from hybridlm.interop.hf import save_pretrained
from hybridlm.model.model import HybridLM
from hybridlm.report.stats import mean_pass_at_k, pass_at_k

QUICKSTART = Path(__file__).resolve().parents[1] / "runs/quickstart/checkpoints/step_00001200"


# ---------------------------------------------------------------------- normalisations
def test_normalisations_on_hand_computed_numbers():
    # choices " ab" (3 chars, 2 tokens) and " abcdef" (7 chars, 5 tokens)
    lps, toks, chars, unc = [-3.0, -5.0], [2, 5], [3, 7], [-1.0, -6.5]
    kw = {"num_tokens": toks, "num_chars": chars, "uncond_logprobs": unc}
    assert normalised_scores(lps, norm="none", **kw) == [-3.0, -5.0]  # picks 0
    assert normalised_scores(lps, norm="token", **kw) == [-1.5, -1.0]  # picks 1
    assert normalised_scores(lps, norm="char", **kw) == pytest.approx([-1.0, -5 / 7])  # 1
    assert normalised_scores(lps, norm="pmi", **kw) == [-2.0, 1.5]  # picks 1
    with pytest.raises(ValueError, match="normalisation"):
        normalised_scores(lps, norm="bytes", **kw)


def test_mc_prompt_formats():
    it = MCItem(question="Sky?", choices=("blue", "red"), answer=0)
    assert cloze_prompt(it) == "Question: Sky?\nAnswer:"
    assert mc_prompt(it) == "Question: Sky?\n A. blue\n B. red\nAnswer:"


@pytest.fixture(scope="module")
def tiny_runner():
    torch.manual_seed(0)
    model = HybridLM(tiny_train_model(mtp=False), seed=0).eval()
    return EvalRunner(model=model, tokenizer=ByteTokenizer(), max_batch_tokens=2048)


def test_mc_task_metrics_match_recomputed_loglikelihoods(tiny_runner, one_thread):
    items = copycolors_items(6)
    task = MCTask(name="cc", load=lambda: items, fmt="rc", norm="char")
    res = task.run(tiny_runner)
    tok, model = tiny_runner.tokenizer, tiny_runner.model
    hits = {n: 0 for n in ("none", "token", "char", "pmi")}
    gold_nll = gold_bytes = 0.0
    for it in items:
        conts = [f" {c}" for c in it.choices]
        cond = loglikelihood(model, [encode_pair(tok, cloze_prompt(it), c) for c in conts])
        unc = loglikelihood(model, [encode_pair(tok, "Answer:", c) for c in conts])
        scores = {
            "none": [r.logprob for r in cond],
            "token": [r.logprob / r.num_tokens for r in cond],
            "char": [r.logprob / len(c) for r, c in zip(cond, it.choices, strict=True)],
            "pmi": [r.logprob - u.logprob for r, u in zip(cond, unc, strict=True)],
        }
        for n, s in scores.items():
            hits[n] += int(max(range(len(s)), key=lambda i: (s[i], -i)) == it.answer)
        gold_nll -= cond[it.answer].logprob
        gold_bytes += len(conts[it.answer].encode())
    for n, h in hits.items():
        assert res.metrics[f"acc_{n}"] == pytest.approx(h / len(items))
    assert res.metrics["acc"] == res.metrics["acc_char"]
    assert res.metrics["bpb_gold"] == pytest.approx(gold_nll / (LN2 * gold_bytes), rel=1e-6)
    p = res.metrics["acc"]
    if 0 < p < 1:  # binomial standard error with n - 1
        assert res.stderr["acc"] == pytest.approx(math.sqrt(p * (1 - p) / (len(items) - 1)))
    mc = MCTask(name="cc", load=lambda: items, fmt="mc").run(tiny_runner)
    assert set(mc.metrics) == {"acc", "acc_none"} and 0 <= mc.metrics["acc"] <= 1


# ---------------------------------------------------------------------- pass@k, stderr
def _enumerated_pass_at_k(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_exact_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_enumerated_pass_at_k(n, c, k))
    assert pass_at_k(200, 3, 1) == pytest.approx(3 / 200)
    # stable at sizes where C(n, k) overflows a float
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pass_at_k(5, 2, 6)
    mean, se = mean_pass_at_k([4, 4], [0, 4], 1)
    assert mean == 0.5 and se == pytest.approx(0.5)  # std([0, 1], ddof=1) / sqrt(2)


def test_standard_errors():
    mean, se = mean_stderr([1.0, 0.0, 1.0, 1.0])
    assert mean == 0.75 and se == pytest.approx(math.sqrt(0.75 * 0.25 / 3))
    assert math.isnan(mean_stderr([1.0])[1])
    num, den = [1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]
    a = bootstrap_ratio_stderr(num, den, seed=1)
    assert a == bootstrap_ratio_stderr(num, den, seed=1)  # seeded
    # equal denominators: the bootstrap SE of the mean is close to std(ddof=0) / sqrt(n)
    assert a == pytest.approx(math.sqrt(1.25 / 4), rel=0.1)


# ---------------------------------------------------------------------- data-backed tasks
def test_humaneval_canonical_solutions_pass_in_the_sandbox():
    env = humaneval_environment()  # the packaged HumanEval
    probs = list(env)[:3]
    good = [p.metadata["canonical_solution"] for p in probs]
    bad = ["    return None\n"] * 3
    # problem-major: problem p's two samples are [good, bad]
    comps = [c for pair in zip(good, bad, strict=True) for c in pair]
    rewards, correct = score_humaneval(env, probs, comps, 2)
    assert correct == [1, 1, 1], [r.reason for r in rewards]
    assert [r.value for r in rewards] == [1.0, 0.0] * 3


def test_gsm8k_mc_items_hold_the_gold_answer():
    items = gsm8k_mc_items()[:50]
    rows = builtin.read_jsonl(builtin.path(builtin.GSM8K_TEST))
    for it in items:
        assert len(set(it.choices)) == 4
    assert items[0].choices[items[0].answer] == gsm8k_final(rows[0]["answer"])
    assert gsm8k_mc_items()[:50] == items  # deterministic


def test_tasks_read_an_explicit_data_dir(tmp_path):
    """A given data_dir is used instead of the packaged copies (plain or .gz files), and a file
    missing there is an error that names it."""
    (tmp_path / "gsm8k").mkdir()
    rows = [
        {"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
        for i in (3, 9)
    ]
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = gsm8k_mc_items(tmp_path)
    assert [it.question for it in items] == [r["question"] for r in rows]
    assert [it.choices[it.answer] for it in items] == ["4", "10"]
    task = get_task("gsm8k_bpb", data_dir=str(tmp_path))
    assert task.load() == [(f"Question: {r['question']}\nAnswer:", f" {r['answer']}") for r in rows]
    with pytest.raises(ValueError, match="HumanEval not found at .*HumanEval.jsonl.gz"):
        get_task("humaneval_bpb", data_dir=tmp_path).load()
    assert len(get_task("humaneval_bpb").load()) == 164  # no data_dir: the packaged copy
    assert len(get_task("humaneval_bpb", data_dir="").load()) == 164


def test_resolve_tasks_groups_and_errors():
    assert resolve_tasks("base_easy,gsm8k_bpb") == ["humaneval_bpb", "gsm8k_bpb", "shakespeare_bpb"]
    assert len(resolve_tasks("ruler")) == 6
    with pytest.raises(ValueError, match="unknown task"):
        resolve_tasks("mmlu")


def test_cli_end_to_end_on_a_random_model(tmp_path, one_thread, capsys):
    ckpt = tmp_path / "tiny"
    save_pretrained(HybridLM(tiny_train_model(), seed=0), ckpt)  # transformers directory
    out = tmp_path / "ev"
    rc = main(
        [
            "eval", "--checkpoint", str(ckpt), "--tasks",
            "humaneval_bpb,shakespeare_bpb,copycolors:rc,copycolors:mc,gsm8k,humaneval,"
            "ruler_niah_single",
            "--limit", "2", "--out", str(out),
            "--ruler-lengths", "512", "--max-new-tokens", "64", "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    tasks = doc["tasks"]
    assert tasks["humaneval_bpb"]["metrics"]["bpb"] > 5  # random init: ~log2(V) bits per byte
    assert tasks["copycolors:rc"]["num_items"] == 2
    assert 0 <= tasks["gsm8k"]["metrics"]["exact_match"] <= 1
    assert tasks["humaneval"]["metrics"]["pass@1"] == 0.0
    assert tasks["ruler_niah_single"]["num_items"] == 2
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["task"] for r in rows} == set(tasks)
    assert all(r["stderr"] is not None for r in rows if r["metric"] == "bpb")
    assert (out / "ruler.png").stat().st_size > 0
    assert (out / "samples" / "copycolors_rc.jsonl").is_file()
    # a user error, no traceback
    assert main(["eval", "--preset", "tiny-olmo", "--tasks", "nope"]) == 2


@pytest.mark.slow
def test_quickstart_checkpoint_beats_random_init(tmp_path, one_thread):
    """The quickstart model (trained on Python source) has a lower HumanEval bpb than the same
    architecture at random init."""
    if not QUICKSTART.is_dir():
        pytest.skip("runs/quickstart checkpoint not present")
    from hybridlm.model.model import build_model

    trained = load_model(QUICKSTART)
    random_model = build_model(trained.model.config, seed=0, device=torch.device("cpu"))
    rand = LoadedModel(
        model=random_model.eval(), tokenizer=trained.tokenizer, name="random", source="init"
    )
    cfg = EvalConfig(
        tasks=["humaneval_bpb", "copycolors:rc"], limit=10, progress=False,
    )  # fmt: skip
    a = evaluate(trained, cfg, out_dir=tmp_path / "a")["tasks"]
    b = evaluate(rand, cfg, out_dir=tmp_path / "b")["tasks"]
    assert a["humaneval_bpb"]["metrics"]["bpb"] < 0.5 * b["humaneval_bpb"]["metrics"]["bpb"]
    assert a["copycolors:rc"]["metrics"]["bpb_gold"] < b["copycolors:rc"]["metrics"]["bpb_gold"]


def test_gsm8k_generative_in_both_prompt_formats(tiny_runner, one_thread):
    from hybridlm.eval.tasks import GSM8KTask
    from hybridlm.rl.environments import GSM8KEnvironment

    for fmt, shots in (("base", 0), ("base", 2), ("chat", 0)):
        task = GSM8KTask(name="gsm8k", max_tokens=8, prompt_format=fmt, num_fewshot=shots)
        block = task.fewshot_block()
        assert block.count("Question:") == shots and block.count("####") == shots
        res = task.run(tiny_runner, limit=2)
        assert res.num_items == 2 and res.metrics["exact_match"] in (0.0, 0.5, 1.0)
        assert [s["gold"] for s in res.samples] == ["18", "3"]
    # the same reward as the RL environment: a reference solution scores 1
    env = GSM8KEnvironment(builtin.path(builtin.GSM8K_TEST), limit=1)
    assert env.score(env[0], env[0].metadata["solution"]).value == 1.0
    with pytest.raises(ValueError, match="prompt_format"):
        GSM8KTask(name="gsm8k", prompt_format="cot")
