"""The lm-evaluation-harness backend gives the same numbers as `hybridlm eval` on local tasks."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from _tiny import tiny_train_model  # noqa: E402
from hybridlm.data.tokenizer import ByteTokenizer  # noqa: E402
from hybridlm.eval.lm_eval_adapter import HybridLMEval  # noqa: E402
from hybridlm.eval.tasks import (  # noqa: E402
    EvalRunner,
    MCItem,
    MCTask,
    RollingBpbTask,
    copycolors_items,
)
from hybridlm.infer.sampling import SamplingParams  # noqa: E402
from hybridlm.model.model import HybridLM  # noqa: E402

MC_YAML = """task: hybridlm_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
  - metric: acc_mutual_info
"""

PPL_YAML = """task: hybridlm_local_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


@pytest.fixture(scope="module")
def runner():
    torch.manual_seed(0)
    model = HybridLM(tiny_train_model(mtp=False), seed=0).eval()
    # max_len 96 makes the documents below span several rolling windows
    return EvalRunner(model=model, tokenizer=ByteTokenizer(), max_len=96, max_batch_tokens=4096)


def _write_tasks(tmp_path, items, docs):
    mc = tmp_path / "mc.jsonl"
    mc.write_text(
        "".join(
            json.dumps({"question": it.question, "choices": list(it.choices), "answer": it.answer})
            + "\n"
            for it in items
        )
    )
    ppl = tmp_path / "ppl.jsonl"
    ppl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "mc.yaml").write_text(MC_YAML.format(path=mc))
    (tmp_path / "ppl.yaml").write_text(PPL_YAML.format(path=ppl))


def test_simple_evaluate_matches_the_harness(runner, tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    from lm_eval.tasks import TaskManager

    items = copycolors_items(12, seed=3)
    docs = [
        "To be, or not to be, that is the question: whether 'tis nobler in the mind " * 3,
        "def add(a, b):\n    return a + b\n",
    ]
    _write_tasks(tmp_path, items, docs)
    out = lm_eval.simple_evaluate(
        model=HybridLMEval(runner=runner),
        tasks=["hybridlm_local_mc", "hybridlm_local_ppl"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        bootstrap_iters=0,
    )
    res = out["results"]
    # PMI with lm-eval's unconditional context "" (our default is OLMES's "Answer:")
    ours = MCTask(name="mc", load=lambda: items, fmt="rc", unconditional_context="").run(runner)
    assert res["hybridlm_local_mc"]["acc,none"] == pytest.approx(ours.metrics["acc_none"])
    assert res["hybridlm_local_mc"]["acc_norm,none"] == pytest.approx(ours.metrics["acc_char"])
    assert res["hybridlm_local_mc"]["acc_mutual_info,none"] == pytest.approx(
        ours.metrics["acc_pmi"]
    )
    ppl = RollingBpbTask(name="ppl", load=lambda: docs).run(runner)
    assert res["hybridlm_local_ppl"]["bits_per_byte,none"] == pytest.approx(
        ppl.metrics["bpb"], rel=1e-9
    )
    # per-item log-likelihoods are the same numbers too, not just the accuracies
    lls = [s["logprobs"] for s in ours.samples]
    flat = [x for row in lls for x in row]
    got = [
        r["resps"][j][0][0]
        for r in out["samples"]["hybridlm_local_mc"]
        for j in range(len(items[0].choices))
    ]
    assert got == pytest.approx(flat, abs=1e-9)


def test_generate_until_uses_the_engine(runner, one_thread):
    class Req:  # lm-eval `Instance`s expose `.args`
        def __init__(self, args):
            self.args = args

    lm = HybridLMEval(runner=runner)
    prompts = ["Question: 2+2?\nAnswer:", "def f(x):"]
    got = lm.generate_until([Req((p, {"until": ["\n"], "max_gen_toks": 12})) for p in prompts])
    want = runner.generate(prompts, [SamplingParams(max_tokens=12, stop=["\n"])] * 2)
    assert got == want and all("\n" not in g for g in got)
    shown = dataclasses.replace(runner, progress=True)  # the progress-bar loop: same outputs
    assert shown.generate(prompts, [SamplingParams(max_tokens=12, stop=["\n"])] * 2) == want
    # rolling log-likelihood of one request equals the harness's
    (ll,) = lm.loglikelihood_rolling([Req(("abc " * 40,))])
    assert ll == pytest.approx(runner.rolling(["abc " * 40])[0])
    assert math.isfinite(ll) and ll < 0
    # --apply_chat_template renders with the project's chat template
    from hybridlm.data.chat import render

    msgs = [{"role": "user", "content": "Hi"}]
    assert lm.apply_chat_template(msgs) == render(msgs) and lm.chat_template(True)


@pytest.mark.slow
def test_command_line_registers_the_backend(tmp_path):
    """`python -m hybridlm.eval.lm_eval_adapter run --model hybridlm ...` resolves the model
    (slow: lm-eval's CLI indexes its thousands of built-in task YAMLs first)."""
    items = [MCItem(question="The cup is red. What color is the cup?", choices=("red", "blue"),
                    answer=0)]  # fmt: skip
    _write_tasks(tmp_path, items, ["abc"])
    ckpt = tmp_path / "ckpt"
    HybridLM(tiny_train_model(mtp=False), seed=0).save_pretrained(ckpt)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["HF_DATASETS_CACHE"] = str(tmp_path / "hf_cache")
    proc = subprocess.run(
        [
            sys.executable, "-m", "hybridlm.eval.lm_eval_adapter", "run",
            "--model", "hybridlm", "--model_args", f"path={ckpt},max_length=128",
            "--tasks", "hybridlm_local_mc", "--include_path", str(tmp_path),
            "--output_path", str(tmp_path / "out"),
        ],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hybridlm_local_mc" in proc.stdout
