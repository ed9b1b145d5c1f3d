"""The lm-evaluation-harness backend gives the same numbers as `hybridlm eval` on local tasks."""

import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from _tiny import tiny_train_model  # noqa: E402
from hybridlm.data.tokenizer import ByteTokenizer  # noqa: E402
from hybridlm.eval import lm_eval_adapter  # noqa: E402
from hybridlm.eval.lm_eval_adapter import HybridLMEval  # noqa: E402
from hybridlm.eval.tasks import (  # noqa: E402
    EvalRunner,
    MCItem,
    MCTask,
    RollingBpbTask,
    copycolors_items,
)
from hybridlm.infer.sampling import SamplingParams  # noqa: E402
from hybridlm.interop.hf import save_pretrained  # noqa: E402
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


def write_mc_task(tmp_path, items, yaml: str = MC_YAML) -> None:
    """The multiple-choice items as a local JSONL file and the task YAML that reads it."""
    mc = tmp_path / "mc.jsonl"
    mc.write_text(
        "".join(
            json.dumps({"question": it.question, "choices": list(it.choices), "answer": it.answer})
            + "\n"
            for it in items
        )
    )
    (tmp_path / "mc.yaml").write_text(yaml.format(path=mc))


def _write_tasks(tmp_path, items, docs):
    write_mc_task(tmp_path, items)
    ppl = tmp_path / "ppl.jsonl"
    ppl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
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
    save_pretrained(HybridLM(tiny_train_model(mtp=False), seed=0), ckpt)
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


# ------------------------------------------------------------------ lm-eval's own backends
REGISTRY_CHECK = """
import sys
if sys.argv[1] == "models_first":
    import lm_eval.models
import hybridlm.eval.lm_eval_adapter
from lm_eval.api.registry import get_model
names = ["hf", "local-completions", "local-chat-completions", "hybridlm"]
print(" ".join(get_model(n).__name__ for n in names))
"""


def test_importing_the_adapter_keeps_lm_evals_own_backends():
    """lm-eval imports `lm_eval.models` (its built-in backends) only while the model registry is
    empty; registering `hybridlm` first used to hide `hf` and the rest. A fresh process per
    import order: the adapter first, `lm_eval.models` first."""
    orders = ["adapter_first", "models_first"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", REGISTRY_CHECK, order],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for order in orders
    ]
    for order, proc in zip(orders, procs, strict=True):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (order, err[-3000:])
        want = ["HFLM", "LocalCompletionsAPI", "LocalChatCompletion", "HybridLMEval"]
        assert out.split() == want, (order, out)


# ------------------------------------------------------------------ a standard task, offline
REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "lm_eval"  # gsm8k_local.yaml: the data paths are from REPO


def _offline(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random model as a transformers directory with its byte tokenizer. Its 2-D weights
    are scaled x10: a small-init random model decodes the same loop whatever the prompt, which
    would hide a prompt (BOS, truncation, few-shot text) that differs between the backends."""
    model = HybridLM(tiny_train_model(mtp=False), seed=0).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    out = tmp_path_factory.mktemp("tiny") / "hf"
    return save_pretrained(model, out, tokenizer=ByteTokenizer())


def test_gsm8k_offline_hybridlm_equals_hf(hf_dir, tmp_path, monkeypatch, one_thread):
    """lm-eval's standard `gsm8k` (5-shot, strict / flexible filters) from the packaged GSM8K file
    (`examples/lm_eval/gsm8k_local.yaml`) with nothing downloaded, through `--model hybridlm` and
    lm-eval's own `hf` backend on the same weights: the same generations, token for token, and
    the same log-likelihoods (multiple choice, rolling) to fp32 rounding."""
    from lm_eval.tasks import TaskManager

    _offline(monkeypatch, tmp_path)
    monkeypatch.chdir(REPO)
    _write_tasks(
        tmp_path,
        copycolors_items(6, seed=3),
        ["Once upon a time a fox met a crow. " * 4, "def add(a, b):\n    return a + b\n"],
    )
    # index only the built-in gsm8k folder, not lm-eval's ~15k task YAMLs (25 s)
    builtin_gsm8k = Path(lm_eval.__file__).parent / "tasks" / "gsm8k"
    tm = TaskManager(include_path=[builtin_gsm8k, EXAMPLES, tmp_path], include_defaults=False)
    tasks = ["gsm8k_local", "hybridlm_local_mc", "hybridlm_local_ppl"]
    backends = {"hybridlm": f"path={hf_dir}", "hf": f"pretrained={hf_dir},dtype=float32"}
    out = {
        name: lm_eval.simple_evaluate(
            model=name,
            model_args=f"{args},device=cpu,batch_size=4",
            tasks=tasks,
            task_manager=tm,
            limit=4,
            bootstrap_iters=0,
        )
        for name, args in backends.items()
    }
    ours, hf = out["hybridlm"], out["hf"]
    cfg = ours["configs"]["gsm8k"]  # the standard task with only the dataset replaced
    assert cfg["dataset_path"] == "json" and cfg["num_fewshot"] == 5
    assert "gsm8k_local" in ours["group_subtasks"]
    for res in (ours["results"]["gsm8k"], hf["results"]["gsm8k"]):
        assert res["sample_len"] == 4
        assert {"exact_match,strict-match", "exact_match,flexible-extract"} <= set(res)
    first = ours["samples"]["gsm8k"][0]["arguments"][0][0]
    assert first.count("Question: ") == 6 and "#### " in first  # 5 worked examples + the item

    def gens(o):
        return [s["resps"][0][0] for s in o["samples"]["gsm8k"]]

    assert gens(ours) == gens(hf) and len(set(gens(ours))) > 1
    for key in ("exact_match,strict-match", "exact_match,flexible-extract"):
        assert ours["results"]["gsm8k"][key] == hf["results"]["gsm8k"][key]

    def lls(o):
        return [r[0] for s in o["samples"]["hybridlm_local_mc"] for r in s["resps"]]

    a, b = lls(ours), lls(hf)
    # 4 items x 4 colours, after the question and after lm-eval's "" (acc_mutual_info)
    assert len(a) == 32 and [x[1] for x in a] == [x[1] for x in b]  # is_greedy too
    assert [x[0] for x in a] == pytest.approx([x[0] for x in b], abs=5e-5)
    for key in ("acc,none", "acc_norm,none", "acc_mutual_info,none"):
        assert ours["results"]["hybridlm_local_mc"][key] == hf["results"]["hybridlm_local_mc"][key]
    # rolling: ours scores each text token once, after BOS (as `hybridlm eval` does); lm-eval's
    # `hf` encodes the text with the tokenizer's BOS (add_bos_token: true) and prefixes BOS
    # again, so it scores [BOS] + text after BOS (EleutherAI/lm-evaluation-harness#3333)
    runner = HybridLMEval(path=str(hf_dir)).runner
    docs = [s["doc"]["text"] for s in ours["samples"]["hybridlm_local_ppl"]]
    bos = runner.tokenizer.bos_id
    pairs = [([bos], [bos, *runner.tokenizer.encode(d, add_bos=False)]) for d in docs]
    double_bos = [r.logprob for r in runner.loglik_tokens(pairs)]

    def rolling(o):
        return [s["resps"][0][0] for s in o["samples"]["hybridlm_local_ppl"]]

    assert len(docs) == 2 and rolling(ours) == pytest.approx(runner.rolling(docs), abs=1e-9)
    assert rolling(hf) == pytest.approx(double_bos, abs=5e-5)


def _documented_commands() -> list[str]:
    """The offline gsm8k commands of the adapter's docstring, continuation lines joined."""
    doc = lm_eval_adapter.__doc__.replace("\\\n", " ")
    return re.findall(r"^ +(HF_DATASETS_OFFLINE=1 .*)$", doc, flags=re.M)


@pytest.mark.slow
def test_documented_offline_gsm8k_commands(hf_dir, tmp_path):
    """The two command lines documented in the adapter (hybridlm and lm-eval's `hf` backend),
    run as written from the repository root on a tiny model, with --limit 2: both succeed and
    log the same generations (slow: lm-eval's CLI indexes its ~15k built-in task YAMLs)."""
    commands = _documented_commands()
    assert len(commands) == 2, commands
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(tmp_path / "hf_cache"))
    samples = []
    for i, command in enumerate(commands):
        argv = shlex.split(command)
        while "=" in argv[0]:  # the environment prefix
            key, value = argv.pop(0).split("=", 1)
            env[key] = value
        argv = [sys.executable, *(["-m", "lm_eval"] if argv[0] == "lm_eval" else []), *argv[1:]]
        argv = [a.replace("runs/speedrun/rl/model", str(hf_dir)) for a in argv]
        argv[argv.index("--limit") + 1] = "2"
        out_dir = tmp_path / f"out{i}"
        argv += ["--output_path", str(out_dir), "--log_samples"]
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
        assert "gsm8k" in proc.stdout and "exact_match" in proc.stdout
        (path,) = out_dir.rglob("samples_gsm8k_*.jsonl")
        samples.append([json.loads(line)["resps"] for line in path.read_text().splitlines()])
    assert samples[0] == samples[1] and len(samples[0]) == 2 * 2  # items x answer filters
