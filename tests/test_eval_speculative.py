"""spec_bench (SPEED-Bench protocol): acceptance statistics against hand-computed `SpecStats`
merges, a model whose drafts are always accepted, greedy equality, seeded determinism, the
prompt categories, and `hybridlm eval --tasks spec_bench` end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.cli import main
from hybridlm.data import builtin
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.eval.speculative import (
    CATEGORIES,
    SpecBenchConfig,
    SpecBenchTask,
    acceptance_summary,
    build_prompts,
    encode_prompt,
    mean_over_categories,
    plot_spec_bench,
    run_spec_bench,
)
from hybridlm.eval.tasks import EvalRunner, bootstrap_ratio_stderr, get_task, resolve_tasks
from hybridlm.infer.speculative import SpecStats, merge_stats
from hybridlm.interop.hf import save_pretrained
from hybridlm.presets import get_preset
from hybridlm.train.mtp_boost import measure_acceptance

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int = 0) -> HybridLM:
    """A tiny random Super-shaped model (Mamba, attention, LatentMoE) with a `*E` MTP head,
    in fp64 so one-token and multi-token forwards agree far below any argmax margin."""
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.d_model, cfg.pattern = 258, 64, "M*E"
    cfg.mamba.num_heads, cfg.mamba.head_dim, cfg.mamba.chunk_size = 2, 32, 16
    cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim = 2, 1, 32
    cfg.moe.latent_size, cfg.moe.shared_expert_hidden = 32, 64
    cfg.mtp.pattern = "*E"
    return HybridLM(cfg, seed=seed).double().eval()


# ---------------------------------------------------------------------- statistics
def _stats(k: int, rounds: list[tuple[int, int]]) -> SpecStats:
    s = SpecStats(draft_len=k)
    for drafted, accepted in rounds:
        s.record(drafted, accepted)
    return s


def test_acceptance_summary_on_hand_computed_merges():
    # request 1: rounds (drafted, accepted) (3, 3), (3, 1), (2, 0) -> drafted at positions
    # [3, 3, 2], accepted [2, 1, 1], 3 steps, 4 accepted drafts
    # request 2: (3, 2), (1, 1) -> drafted [2, 1, 1], accepted [2, 1, 0], 2 steps, 3 accepted
    s1, s2 = _stats(3, [(3, 3), (3, 1), (2, 0)]), _stats(3, [(3, 2), (1, 1)])
    assert (s1.accepted_at, s1.drafted_at) == ([2, 1, 1], [3, 3, 2])
    got = acceptance_summary([s1, s2], iters=200, seed=0)
    # merged: 5 steps, 7 accepted -> (7 + 5) / 5 tokens per verify step
    assert got["steps"] == 5 and got["accepted_tokens"] == 7
    assert got["acceptance_length"] == pytest.approx(12 / 5)
    assert got["acceptance_by_position"] == pytest.approx([4 / 5, 2 / 4, 1 / 3])
    assert got["drafted_at"] == [5, 4, 3]
    # SpecStats identity: AL = 1 + sum_i rate_i * drafted_i / steps (= 1 + 7 / 5 here)
    ident = 1 + sum(
        r * d / got["steps"]
        for r, d in zip(got["acceptance_by_position"], got["drafted_at"], strict=True)
    )
    assert got["acceptance_length"] == pytest.approx(ident)
    # the same numbers as the shared merge used by MTP boosting
    ref = merge_stats([s1, s2])
    assert got["acceptance_length"] == ref["acceptance_length"]
    assert got["acceptance_by_position"] == ref["acceptance_by_position"]
    # standard errors: bootstrap over requests of the ratio of sums
    assert got["acceptance_length_se"] == bootstrap_ratio_stderr([7, 5], [3, 2], iters=200)
    assert got["acceptance_by_position_se"][0] == bootstrap_ratio_stderr([2, 2], [3, 2], iters=200)
    # identical requests: no spread, zero standard error; one request: undefined (NaN)
    same = acceptance_summary([s1, _stats(3, [(3, 3), (3, 1), (2, 0)])], iters=50)
    assert same["acceptance_length_se"] == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(acceptance_summary([s1], iters=50)["acceptance_length_se"])
    # SPEED-Bench's average over categories, and the standard error of a mean of independent
    # estimates: sqrt(0.3^2 + 0.4^2) / 2
    mean, se = mean_over_categories(
        {
            "a": {"acceptance_length": 2.0, "acceptance_length_se": 0.3},
            "b": {"acceptance_length": 4.0, "acceptance_length_se": 0.4},
        }
    )
    assert (mean, se) == (pytest.approx(3.0), pytest.approx(0.25))
    with pytest.raises(ValueError, match="no requests"):
        acceptance_summary([])


def test_config_errors():
    with pytest.raises(ValueError, match="draft_len"):
        SpecBenchConfig(draft_len=0).validate()
    with pytest.raises(ValueError, match="new_tokens"):
        SpecBenchConfig(new_tokens=1).validate()
    with pytest.raises(ValueError, match="categories"):
        SpecBenchConfig(categories=["poetry"]).validate()
    with pytest.raises(ValueError, match="temperatures"):
        SpecBenchConfig(temperatures=[-1.0]).validate()
    model = _model()
    model.mtp = None
    with pytest.raises(ValueError, match="MTP head"):
        run_spec_bench(model, ByteTokenizer(), build_prompts(data_dir="-", per_category=1),
                       SpecBenchConfig())  # fmt: skip


# ---------------------------------------------------------------------- prompts
def test_prompts_are_deterministic_per_category_with_fallbacks(tmp_path):
    a = build_prompts(data_dir=tmp_path, per_category=3, seed=0)
    assert [p.category for p in a] == [c for c in CATEGORIES for _ in range(3)]
    assert a == build_prompts(data_dir=tmp_path, per_category=3, seed=0)
    assert a != build_prompts(data_dir=tmp_path, per_category=3, seed=1)
    by = {p.category: p for p in a}
    assert by["code"].text.startswith("def ") and '"""' in by["code"].text
    assert by["math"].source == "generated" and by["math"].text.startswith("Question: ")
    assert "docstring" in by["writing"].source  # no tinyshakespeare: stdlib docstrings
    assert by["chat"].text.endswith("<|im_start|>assistant\n")
    # one category alone gives the same prompts as in the full set (its own seeded RNG)
    assert build_prompts(data_dir=tmp_path, per_category=3, categories=["math"]) == [
        p for p in a if p.category == "math"
    ]
    chat = build_prompts(data_dir=tmp_path, per_category=1, prompt_format="chat")
    assert all(p.text.startswith("<|im_start|>") for p in chat)
    assert all(p.text.endswith("<|im_start|>assistant\n") for p in chat)
    with pytest.raises(ValueError, match="prompt_format"):
        build_prompts(data_dir=tmp_path, per_category=1, prompt_format="raw")
    ids = encode_prompt(ByteTokenizer(), "x" * 50, 10)
    assert len(ids) == 10 and ids[0] == ByteTokenizer.bos_id


def test_prompts_use_the_packaged_gsm8k_and_tinyshakespeare():
    ps = build_prompts(per_category=4)
    math_rows = builtin.read_jsonl(builtin.path(builtin.GSM8K_TEST))
    text = builtin.read_text(builtin.path(builtin.TINYSHAKESPEARE))
    sources = {p.source.split(":")[0].split("@")[0] for p in ps if p.category != "code"}
    assert {"gsm8k/test.jsonl", "tinyshakespeare/input.txt"} <= sources  # not generated
    for p in ps:
        if p.category == "math":
            row = int(p.source.rsplit(":", 1)[1])
            assert p.text == f"Question: {math_rows[row]['question']}\nAnswer:"
        elif p.category == "writing":
            at = int(p.source.rsplit("@", 1)[1])
            assert at >= int(len(text) * 0.9) and text[at:].startswith(p.text)


# ---------------------------------------------------------------------- measurement
def test_a_head_that_always_agrees_gives_the_hand_computed_acceptance(tmp_path):
    """Final norms' gains zeroed: backbone and MTP emit zero hiddens, so both give all-zero
    logits: greedy drafts (token 0) always match, and at T=1 p = q = uniform, so rejection
    sampling accepts every draft. With 17 new tokens and K = 7: the prefill emits 1, then two
    full rounds of 7 drafts + 1 -> acceptance length 16 / 2 = 8, every position 1.0."""
    model = _model()
    with torch.no_grad():
        model.norm_f.weight.zero_()
        model.mtp.final_layernorm.weight.zero_()
    prompts = build_prompts(data_dir=tmp_path, per_category=2)
    cfg = SpecBenchConfig(new_tokens=17, draft_len=7, timing=False, bootstrap_iters=50)
    res = run_spec_bench(model, ByteTokenizer(), prompts, cfg)
    for tag in ("greedy", "T1"):
        for s in res.by_category[tag].values():
            assert (s["steps"], s["accepted_tokens"]) == (4, 28)  # 2 prompts x 2 rounds
            assert s["acceptance_length"] == 8.0
            assert s["acceptance_by_position"] == [1.0] * 7
            assert s["acceptance_length_se"] == 0.0
        assert res.overall[tag]["mean"] == 8.0 and res.overall[tag]["mean_se"] == 0.0
    assert res.greedy_checked == 10 and res.greedy_mismatches == 0
    # greedy emits token 0 17 times: one distinct 4-gram out of 14
    assert res.metrics()[0]["distinct_4grams:greedy"] == pytest.approx(1 / 14)


@pytest.fixture(scope="module")
def random_bench(tmp_path_factory):
    torch.set_num_threads(1)
    model = _model()
    tok = ByteTokenizer()
    prompts = build_prompts(data_dir=tmp_path_factory.mktemp("nodata"), per_category=2)
    cfg = SpecBenchConfig(new_tokens=12, draft_len=7, timing_batch_size=2, bootstrap_iters=100)
    return model, tok, prompts, cfg, run_spec_bench(model, tok, prompts, cfg)


def test_random_model_metrics_plumbing_and_greedy_equality(random_bench):
    model, tok, prompts, cfg, res = random_bench
    # greedy speculative == plain greedy, in speculative_generate and in the engine
    assert res.greedy_checked == len(prompts) and res.greedy_mismatches == 0
    assert res.timing is not None and res.timing["greedy_mismatches"] == 0
    for tag, t in (("greedy", 0.0), ("T1", 1.0)):
        runs = [r for r in res.runs if r.temperature == t]
        assert len(runs) == len(prompts)
        for cat in CATEGORIES:
            s = res.by_category[tag][cat]
            ref = merge_stats([r.stats for r in runs if r.prompt.category == cat])
            assert s["acceptance_length"] == ref["acceptance_length"]
            assert s["acceptance_by_position"] == ref["acceptance_by_position"]
            assert 1.0 <= s["acceptance_length"] <= cfg.draft_len + 1
            rates, drafted = s["acceptance_by_position"], s["drafted_at"]
            ident = 1 + sum(r * d for r, d in zip(rates, drafted, strict=True)) / s["steps"]
            assert s["acceptance_length"] == pytest.approx(ident)
        cats = res.by_category[tag].values()
        assert res.overall[tag]["mean"] == pytest.approx(
            sum(s["acceptance_length"] for s in cats) / len(CATEGORIES)
        )
    # the pooled T=1 figure is exactly what MTP boosting's `measure_acceptance` measures on
    # the same prompts with the same seeds (seed + prompt index)
    ids = [encode_prompt(tok, p.text, cfg.max_prompt_tokens) for p in prompts]
    ref = measure_acceptance(
        model, ids, draft_len=cfg.draft_len, new_tokens=cfg.new_tokens, temperature=1.0, seed=0
    )
    pooled = res.overall["T1"]["pooled"]
    assert pooled["acceptance_length"] == ref["acceptance_length"]
    assert pooled["acceptance_by_position"] == ref["acceptance_by_position"]
    m, se = res.metrics()
    for key in ("acceptance_length:greedy", "acceptance_length:T1:code", "acceptance@7:T1:chat"):
        assert key in m and math.isfinite(se[key]) and se[key] >= 0
    assert m["greedy_mismatches"] == 0 and m["engine_greedy_mismatches"] == 0
    assert 0 < m["distinct_4grams:T1"] <= 1 and se["distinct_4grams:T1"] >= 0
    t = res.timing
    assert t["requests"] == len(prompts)
    for mode in ("plain", "speculative"):  # every request generated its full budget
        assert t[mode]["tokens"] == cfg.new_tokens * len(prompts)
    for key in ("speedup", "ttft_ratio", "itl_ratio"):  # ratios only: no absolute times
        assert math.isfinite(m[key]) and m[key] > 0
    assert m["speedup"] == pytest.approx(m["tokens_per_s:speculative"] / m["tokens_per_s:plain"])


def test_a_seed_reproduces_the_sampled_runs(random_bench):
    model, tok, prompts, cfg, res = random_bench
    sub = [p for p in prompts if p.category in ("code", "chat")]
    small = SpecBenchConfig(new_tokens=12, temperatures=[1.0], timing=False, bootstrap_iters=20)
    again = run_spec_bench(model, tok, sub, small)
    assert again.samples() == run_spec_bench(model, tok, sub, small).samples()
    other = run_spec_bench(model, tok, sub, SpecBenchConfig(**{**small.__dict__, "seed": 1}))
    assert [r.tokens for r in other.runs] != [r.tokens for r in again.runs]


# ---------------------------------------------------------------------- harness
def test_registered_and_runs_through_hybridlm_eval(tmp_path, capsys):
    assert resolve_tasks("speculative") == ["spec_bench"]
    task = get_task("spec_bench", data_dir=tmp_path, max_tokens=33, prompt_format="chat", seed=3)
    assert isinstance(task, SpecBenchTask) and task.kind == "speculative"
    assert (task.config.draft_len, task.config.new_tokens, task.config.seed) == (7, 33, 3)
    assert task.config.prompt_format == "chat"
    ckpt = tmp_path / "tiny"
    save_pretrained(_model(), ckpt)
    out = tmp_path / "ev"
    args = ["eval", "--checkpoint", str(ckpt), "--tasks", "speculative,copycolors:rc",
            "--limit", "2", "--data-dir", str(tmp_path / "nodata"), "--out", str(out),
            "--max-new-tokens", "10", "--dtype", "float64", "--no-progress"]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    spec = doc["tasks"]["spec_bench"]
    assert "acc" in doc["tasks"]["copycolors:rc"]["metrics"]  # next to an accuracy task
    assert spec["kind"] == "speculative" and spec["num_items"] == 2 * len(CATEGORIES)
    assert spec["metrics"]["greedy_mismatches"] == 0
    assert spec["metrics"]["engine_greedy_mismatches"] == 0
    for tag in ("greedy", "T1"):
        assert 1 <= spec["metrics"][f"acceptance_length:{tag}"] <= 8
        assert spec["stderr"][f"acceptance_length:{tag}"] is not None
        for cat in CATEGORIES:
            assert f"acceptance_length:{tag}:{cat}" in spec["metrics"]
            assert spec["stderr"][f"acceptance@1:{tag}:{cat}"] is not None
    assert "bootstrap" in spec["stderr_method"]
    samples = (out / "samples" / "spec_bench.jsonl").read_text().splitlines()
    assert len(samples) == 2 * 2 * len(CATEGORIES)  # prompts x temperatures
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    pos = [r for r in rows if r["task"] == "spec_bench" and r["metric"].startswith("acceptance@")]
    assert len(pos) == 2 * 7 * (len(CATEGORIES) + 1)  # temperatures x positions x (cats + all)
    png = plot_spec_bench(out / "metrics.jsonl", out / "spec_bench.png")
    assert png is not None and png.stat().st_size > 0
    # a model without an MTP head is a user error, not a traceback
    plain = tmp_path / "nomtp"
    cfg = _model().config
    cfg.mtp.pattern = ""
    save_pretrained(HybridLM(cfg, seed=0), plain)
    bad = ["eval", "--checkpoint", str(plain), "--tasks", "spec_bench", "--limit", "1",
           "--no-progress", "--data-dir", str(tmp_path),
           "--out", str(tmp_path / "ev2")]  # fmt: skip
    assert main(bad) == 2
    assert "MTP head" in capsys.readouterr().err


def test_task_limit_is_prompts_per_category(tmp_path):
    task = SpecBenchTask(
        data_dir=tmp_path,
        config=SpecBenchConfig(new_tokens=4, temperatures=[0.0], timing=False,
                               categories=["repetitive", "code"], bootstrap_iters=10),
    )  # fmt: skip
    runner = EvalRunner(model=_model(), tokenizer=ByteTokenizer())
    res = task.run(runner, limit=3)
    assert res.num_items == 6 and res.metrics["greedy_mismatches"] == 0
    assert {s["category"] for s in res.samples} == {"repetitive", "code"}
    with pytest.raises(ValueError, match="limit"):
        task.run(runner, limit=0)


@pytest.mark.slow
def test_the_trained_quickstart_head_drafts_far_better_than_random_init():
    """The quickstart model's MTP head (trained at depth 2, drafting 7 deep here) is accepted
    several tokens per verify step on the real prompt set; the same architecture at random
    init almost never (greedy drafts must equal the backbone's argmax)."""
    from pathlib import Path

    from hybridlm.eval.harness import load_model
    from hybridlm.model.model import build_model

    ckpt = Path(__file__).resolve().parents[1] / "runs/quickstart/checkpoints/step_00001200"
    if not ckpt.is_dir():
        pytest.skip("runs/quickstart checkpoint not present")
    trained = load_model(ckpt, dtype="float64")
    rand = build_model(trained.model.config, seed=0, device=torch.device("cpu")).double().eval()
    prompts = build_prompts(per_category=2)
    cfg = SpecBenchConfig(new_tokens=32, temperatures=[0.0], timing=False, bootstrap_iters=100)
    a = run_spec_bench(trained.model, trained.tokenizer, prompts, cfg)
    b = run_spec_bench(rand, trained.tokenizer, prompts, cfg)
    assert a.greedy_mismatches == 0 and b.greedy_mismatches == 0
    assert a.overall["greedy"]["mean"] > 2.5, a.overall
    assert b.overall["greedy"]["mean"] < 1.5, b.overall
    for cat in CATEGORIES:
        s = a.by_category["greedy"][cat]
        assert s["acceptance_length"] > b.by_category["greedy"][cat]["acceptance_length"]


def test_benchmark_script_prints_a_line_per_category_and_overall(tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import spec_bench

    ckpt = tmp_path / "tiny"
    save_pretrained(_model(), ckpt)
    args = ["--checkpoint", str(ckpt), "--per-category", "1", "--new-tokens", "6",
            "--timing-repeats", "1", "--out", str(tmp_path / "out"), "--dtype", "float64",
            "--data-dir", str(tmp_path / "nodata"), "--no-progress"]  # fmt: skip
    assert spec_bench.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    for cat in (*CATEGORIES, "overall"):
        assert sum(f"]   {cat} " in x for x in lines) == 1, (cat, lines)
    assert "greedy spec != plain: 0/5 (engine 0/5)" in lines[-2]
    assert (tmp_path / "out" / "tiny" / "spec_bench.png").stat().st_size > 0
    assert (tmp_path / "out" / "tiny" / "results.json").is_file()
