"""lm-evaluation-harness's own OpenAI-API backends pointed at `hybridlm serve` give the numbers
of its in-process `hybridlm` backend (`hybridlm.eval.lm_eval_adapter`) on the same model:

- `local-completions` (tokenizer: the model's saved HF tokenizer, BOS added as the in-process
  backend does) on a log-likelihood task (multiple choice: echo + logprobs requests, scored from
  the prompt's log-probs) and a generate_until task;
- `local-chat-completions` (`apply_chat_template`, no tokenizer) on the generate_until task.

Tasks come from local JSONL files (`dataset_path: json`), so nothing is downloaded; the server
listens on 127.0.0.1. The figures are printed (pytest -s shows them)."""

from __future__ import annotations

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")
for _api_dep in ("tenacity", "aiohttp", "requests"):  # lm-eval[api]: its API backends need them
    pytest.importorskip(_api_dep)

import test_eval_lm_eval as lm_local  # noqa: E402
from _tiny import tiny_train_model  # noqa: E402
from hybridlm.data.tokenizer import ByteTokenizer  # noqa: E402
from hybridlm.eval.lm_eval_adapter import HybridLMEval  # noqa: E402
from hybridlm.eval.tasks import EvalRunner, copycolors_items  # noqa: E402
from hybridlm.infer.engine import Engine  # noqa: E402
from hybridlm.infer.server import serve_in_background  # noqa: E402
from hybridlm.model.model import HybridLM  # noqa: E402

MAX_LEN = 256

# the in-process tests' multiple-choice task, without acc_mutual_info (more requests, same path)
MC_YAML = lm_local.MC_YAML.replace("task: hybridlm_local_mc", "task: hybridlm_api_mc").replace(
    "  - metric: acc_mutual_info\n", ""
)

GEN_YAML = """task: hybridlm_api_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _tasks(tmp_path):
    lm_local.write_mc_task(tmp_path, copycolors_items(10, seed=5), MC_YAML)
    gen = tmp_path / "gen.jsonl"
    qa = [(f"What is {a} plus {b}?", str(a + b)) for a, b in [(1, 2), (3, 4), (10, 5), (7, 7)]]
    gen.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in qa))
    (tmp_path / "gen.yaml").write_text(GEN_YAML.format(path=gen))


def _evaluate(model, tasks, tmp_path, **kw):
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
        **kw,
    )
    return out["results"], out["samples"]


def _responses(samples, task):
    """Per document, per request: the model's raw answer (log-prob, greedy) or text."""
    return [[r[0] for r in s["resps"]] for s in sorted(samples[task], key=lambda s: s["doc_id"])]


def test_lm_eval_api_backends_match_in_process(tmp_path, monkeypatch, one_thread, capsys):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    _tasks(tmp_path)
    torch.manual_seed(0)
    model = HybridLM(tiny_train_model(mtp=False), seed=0).eval()
    tok = ByteTokenizer()
    hf_tok = tok.save(tmp_path / "tokenizer")
    # generation one request at a time, as lm-eval's API backends send them
    runner = EvalRunner(model=model, tokenizer=tok, max_len=MAX_LEN, gen_batch_size=1)
    local, local_samples = _evaluate(
        HybridLMEval(runner=runner), ["hybridlm_api_mc", "hybridlm_api_gen"], tmp_path
    )
    local_chat, local_chat_samples = _evaluate(
        HybridLMEval(runner=runner), ["hybridlm_api_gen"], tmp_path, apply_chat_template=True
    )
    engine = Engine(model, tok, max_batch_size=4, max_model_len=MAX_LEN)
    with serve_in_background(engine, "tiny") as url:
        args = (
            f"model=tiny,base_url={url}/completions,tokenizer_backend=huggingface,"
            f"tokenizer={hf_tok},add_bos_token=True,max_length={MAX_LEN},max_retries=1"
        )
        api, api_samples = _evaluate(
            "local-completions", ["hybridlm_api_mc", "hybridlm_api_gen"], tmp_path, model_args=args
        )
        chat_args = (
            f"model=tiny,base_url={url}/chat/completions,tokenizer_backend=None,max_retries=1"
        )
        chat, chat_samples = _evaluate(
            "local-chat-completions",
            ["hybridlm_api_gen"],
            tmp_path,
            model_args=chat_args,
            apply_chat_template=True,
        )
    # log-likelihoods: the same numbers per answer (fp32: chunked prefill vs a padded batch)
    ours, theirs = (
        _responses(local_samples, "hybridlm_api_mc"),
        _responses(api_samples, "hybridlm_api_mc"),
    )
    flat_ours = [x for doc in ours for x in doc]
    flat_api = [x for doc in theirs for x in doc]
    err = max(abs(a[0] - b[0]) for a, b in zip(flat_ours, flat_api, strict=True))
    assert err < 1e-4
    assert [a[1] for a in flat_ours] == [b[1] for b in flat_api]  # is_greedy
    for metric in ("acc,none", "acc_norm,none"):
        assert api["hybridlm_api_mc"][metric] == local["hybridlm_api_mc"][metric]
    # generations: the same texts, so the same scores
    gen_ours = _responses(local_samples, "hybridlm_api_gen")
    assert _responses(api_samples, "hybridlm_api_gen") == gen_ours
    assert any(g[0] for g in gen_ours)  # not vacuous: the model wrote something
    assert api["hybridlm_api_gen"] == local["hybridlm_api_gen"]
    chat_ours = _responses(local_chat_samples, "hybridlm_api_gen")
    assert _responses(chat_samples, "hybridlm_api_gen") == chat_ours
    assert chat["hybridlm_api_gen"] == local_chat["hybridlm_api_gen"]
    with capsys.disabled():
        print(
            f"\nlm-eval local-completions vs in-process: {len(flat_api)} log-likelihoods, max abs "
            f"diff {err:.2e}; acc {api['hybridlm_api_mc']['acc,none']:.3f} == "
            f"{local['hybridlm_api_mc']['acc,none']:.3f}; {len(gen_ours)} generations equal "
            f"(completions and chat)"
        )
