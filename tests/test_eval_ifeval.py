"""The `ifeval` eval task: the four IFEval numbers on known responses (hand-computed), the
official JSONL format (null kwargs as in google/IFEval), data sources, and a run on a tiny
random model through the command line and in both prompt formats."""

import json

import pytest
import torch

from _tiny import tiny_train_model
from hybridlm.cli import main
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.eval.ifeval import IFEvalTask, load_ifeval_records, score_responses
from hybridlm.eval.tasks import EvalRunner, get_task, resolve_tasks
from hybridlm.interop.hf import save_pretrained
from hybridlm.model.model import HybridLM
from hybridlm.rl.ifeval import IFEVAL_METRICS

# google/IFEval rows list every argument name; the unused ones are null
_NULLS = dict.fromkeys(["num_words", "relation", "keywords", "end_phrase", "num_bullets"])
ROWS = [
    {
        "key": 1,
        "prompt": "Write a lowercase note about tea without commas.",
        "instruction_id_list": ["punctuation:no_comma", "change_case:english_lowercase"],
        "kwargs": [dict(_NULLS), dict(_NULLS)],
    },
    {
        "key": 2,
        "prompt": "Write about tea with a title. End with 'Any other questions?'",
        "instruction_id_list": ["detectable_format:title", "startend:end_checker"],
        "kwargs": [dict(_NULLS), {**_NULLS, "end_phrase": "Any other questions?"}],
    },
    {
        "key": 3,
        "prompt": "Give two bullet points about tea.",
        "instruction_id_list": ["detectable_format:number_bullet_lists"],
        "kwargs": [{**_NULLS, "num_bullets": 2}],
    },
]
RESPONSES = [
    "hello there my friend, how are you doing on this fine morning",  # comma: fails both ways
    # title ok; the end phrase only once the sign-off line is dropped (loose)
    "Sure!\n<<Tea>>\nTea is a drink. Any other questions?\n**Hope this helps**",
    "* green tea\n* black tea",
]
# strict: [F, T], [T, F], [T]; loose: [F, T], [T, T], [T]
EXPECTED = {
    "prompt_level_strict_acc": 1 / 3,
    "inst_level_strict_acc": 3 / 5,
    "prompt_level_loose_acc": 2 / 3,
    "inst_level_loose_acc": 4 / 5,
}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_known_responses_give_known_numbers():
    ids = [r["instruction_id_list"] for r in ROWS]
    kwargs = [r["kwargs"] for r in ROWS]
    metrics, stderr, results = score_responses(RESPONSES, ids, kwargs)
    assert list(metrics) == list(IFEVAL_METRICS)
    assert metrics == pytest.approx(EXPECTED)
    assert [r.strict for r in results] == [[False, True], [True, False], [True]]
    assert [r.loose for r in results] == [[False, True], [True, True], [True]]
    assert stderr["prompt_level_strict_acc"] == pytest.approx((1 / 3) ** 0.5 / 3**0.5)


class _Canned:
    """A runner that answers each prompt with a fixed completion (chat or raw)."""

    def __init__(self, by_prompt):
        self.by_prompt = by_prompt
        self.prompts = []

    def generate(self, prompts, params):
        self.prompts += prompts
        return [next(v for k, v in self.by_prompt.items() if k in p) for p in prompts]


def test_task_on_official_jsonl_with_canned_answers(tmp_path):
    path = _write(tmp_path / "input_data.jsonl", ROWS)
    answers = {r["prompt"]: a for r, a in zip(ROWS, RESPONSES, strict=True)}
    for fmt, wrap in (("base", "{}"), ("chat", "<think>\nok\n</think>\n{}<|im_end|>")):
        runner = _Canned({k: wrap.format(v) for k, v in answers.items()})
        res = IFEvalTask(data=str(path), prompt_format=fmt).run(runner)
        assert res.num_items == 3 and res.metrics == pytest.approx(EXPECTED), fmt
        assert [s["key"] for s in res.samples] == ["1", "2", "3"]
        if fmt == "chat":
            assert all(p.rstrip().endswith("assistant") for p in runner.prompts), runner.prompts
        else:
            assert runner.prompts == [r["prompt"] for r in ROWS]
    # the same file found under --data-dir, and the limit
    (tmp_path / "ifeval").mkdir()
    _write(tmp_path / "ifeval" / "input_data.jsonl", ROWS)
    task = get_task("ifeval", data_dir=str(tmp_path))
    res = task.run(_Canned(answers), limit=1)
    assert res.num_items == 1 and res.metrics["prompt_level_strict_acc"] == 0.0


def test_data_sources_and_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="not found"):
        load_ifeval_records(tmp_path / "missing.jsonl")
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "x"}])
    with pytest.raises(ValueError, match="misses"):
        load_ifeval_records(bad)
    unknown = _write(tmp_path / "u.jsonl", [{**ROWS[2], "instruction_id_list": ["x:y"]}])
    with pytest.raises(ValueError, match="unknown instructions"):
        IFEvalTask(data=str(unknown)).run(_Canned({}))
    datasets = pytest.importorskip("datasets")
    seen = []

    def fake_load(name, split):
        seen.append((name, split))
        return ROWS

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert load_ifeval_records("google/IFEval") == ROWS and seen == [("google/IFEval", "train")]
    assert resolve_tasks("ifeval") == ["ifeval"]


@pytest.fixture(scope="module")
def tiny_runner():
    torch.manual_seed(0)
    model = HybridLM(tiny_train_model(mtp=False), seed=0).eval()
    return EvalRunner(model=model, tokenizer=ByteTokenizer(), max_batch_tokens=2048)


def test_generated_prompts_on_a_tiny_model(tiny_runner, one_thread):
    """No data: the seeded synthetic prompts of the RL environment; the four numbers exist and
    lie in [0, 1] in both prompt formats."""
    for fmt in ("base", "chat"):
        res = IFEvalTask(max_tokens=8, prompt_format=fmt).run(tiny_runner, limit=3)
        assert res.num_items == 3 and set(res.metrics) == set(IFEVAL_METRICS)
        assert all(0.0 <= v <= 1.0 for v in res.metrics.values()), res.metrics
        assert res.samples[0]["source"].startswith("generated")
    again = IFEvalTask(max_tokens=8).run(tiny_runner, limit=3)
    assert [s["prompt"] for s in again.samples] == [s["prompt"] for s in res.samples]


def test_cli_runs_ifeval(tmp_path, one_thread, capsys):
    ckpt = tmp_path / "tiny"
    save_pretrained(HybridLM(tiny_train_model(), seed=0), ckpt)
    data = _write(tmp_path / "ifeval.jsonl", ROWS)
    out = tmp_path / "ev"
    args = ["eval", "--checkpoint", str(ckpt), "--tasks", "ifeval", "--limit", "2"]
    args += ["--ifeval-data", str(data), "--max-new-tokens", "8", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    got = doc["tasks"]["ifeval"]
    assert got["num_items"] == 2 and set(got["metrics"]) == set(IFEVAL_METRICS)
    assert all(0.0 <= v <= 1.0 for v in got["metrics"].values())
    assert doc["config"]["ifeval_data"] == str(data)
    printed = capsys.readouterr().out
    assert "prompt_level_strict_acc" in printed and "inst_level_loose_acc" in printed
    bad = ["eval", "--preset", "tiny-olmo", "--tasks", "ifeval", "--ifeval-data", "nope.jsonl"]
    assert main(bad) == 2
