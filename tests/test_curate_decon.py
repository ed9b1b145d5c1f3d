"""Decontamination: hashing and scoring by hand, cluster expansion, and recall / false positives
on the packaged GSM8K + HumanEval with planted copies in Shakespeare."""

import json
import math
import random

import numpy as np
import pytest

from hybridlm.curate.benchmarks import BenchmarkRegistry, EvalItem
from hybridlm.curate.core import CurateDoc, StageStats, build_stage
from hybridlm.curate.decon import (
    EDITS,
    DeconReport,
    NgramOverlapDetector,
    OverlapConfig,
    SampledNgramDetector,
    SimpleConfig,
    decontaminate,
    edit_text,
    ngram_hashes,
    tokens,
)
from hybridlm.data import builtin
from hybridlm.data.fim import chat_to_text
from hybridlm.data.sources import StdlibSource, tinyshakespeare

WORDS = [f"w{i}" for i in range(400)]


def _items(n_items: int = 6, length: int = 60, seed: int = 0) -> list[EvalItem]:
    rng = random.Random(seed)
    return [
        EvalItem(
            "toy",
            f"q{k}",
            " ".join(rng.choices(WORDS, k=length)),
            " ".join(rng.choices(WORDS, k=12)),
        )
        for k in range(n_items)
    ]


# ---------------------------------------------------------------------------- units
def test_tokens_and_hashes():
    assert tokens("Hello,  WORLD!\n x_1 2.5") == ["hello", "world", "x_1", "2", "5"]
    ids = np.array([3, 1, 4, 1, 5], np.uint64)
    h = ngram_hashes(ids, 2)
    assert len(h) == 4 and h[1] == h[1] and len(set(h.tolist())) == 4
    # equal n-grams hash equal; an n-gram with an unknown token (id 0) hashes to 0
    assert (
        ngram_hashes(np.array([1, 4, 1, 4], np.uint64), 2)[[0, 2]].tolist()[0]
        == ngram_hashes(np.array([1, 4], np.uint64), 2)[0]
    )
    assert ngram_hashes(np.array([1, 0, 2], np.uint64), 2).tolist() == [0, 0]
    assert len(ngram_hashes(ids, 6)) == 0


def test_threshold_schedule():
    cfg = SimpleConfig()
    assert cfg.threshold(10) == 1.0 and cfg.threshold(25) == 1.0
    assert math.isclose(cfg.threshold(50), 0.815) and math.isclose(cfg.threshold(200), 0.815)
    assert math.isclose(cfg.threshold(37.5), (1 + 0.815) / 2)
    with pytest.raises(ValueError, match="min_item_tokens"):
        SimpleConfig(min_item_tokens=3)


def test_idf_scores_by_hand():
    # two items share the 5-gram "a b c d e": its IDF is log(2/2) + 1 = 1, unique ones 1 + log 2
    items = [
        EvalItem("toy", "x", "a b c d e f"),  # 5-grams: abcde, bcdef
        EvalItem("toy", "y", "a b c d e g"),  # 5-grams: abcde, bcdeg
    ]
    cfg = SimpleConfig(min_item_tokens=5, sample_every=1)
    det = SampledNgramDetector(BenchmarkRegistry().add(items), cfg)
    unique = 1 + math.log(2)
    # only the shared n-gram present: score = 1 / (1 + unique)
    [m] = [m for m in det.detect_all("zz a b c d e zz") if m.item_id == "x"]
    assert math.isclose(m.question_score, 1 / (1 + unique), rel_tol=1e-12)
    assert math.isclose(det.q.score(0, []), 0.0)
    # the full item: score 1, contaminated (6 tokens <= 25: a perfect match is required)
    found = det.detect("prefix words a b c d e f and more")
    assert [(m.item_id, m.question_score) for m in found] == [("x", 1.0)]


def test_cluster_expansion_and_answer_support():
    items = _items()
    cfg = SimpleConfig()
    det = SampledNgramDetector(BenchmarkRegistry().add(items), cfg)
    rng = random.Random(1)
    filler = " ".join(rng.choices(["zz", "yy", "xx"], k=300))
    q = items[2].question.split()
    # a copy with 3 spread edits: the cluster spans the whole copy across the misses
    edited = list(q)
    for i in (12, 30, 48):
        edited[i] = "EDITED"
    text = filler + " " + " ".join(edited) + " " + filler
    [m] = det.detect_all(text)
    start = 300
    assert m.span == (start, start + len(q))  # the cluster covers the copy exactly
    lost = 3 * cfg.ngram_size  # every edit breaks the 5 n-grams that cover it
    assert math.isclose(m.question_score, 1 - lost / (len(q) - cfg.ngram_size + 1), rel_tol=0.05)
    assert m.answer_score == 0.0
    with_answer = text.replace(filler, filler + " " + items[2].answer, 1)
    [m2] = det.detect_all(with_answer)
    assert m2.answer_score == 1.0 and m2.score > m.score
    # misses beyond max_consecutive_misses split the copy into clusters
    far = q[:20] + ["zz"] * (cfg.max_consecutive_misses + cfg.ngram_size + 1) + q[20:]
    spans = sorted(m.span for m in det.detect_all(filler + " " + " ".join(far) + " " + filler))
    assert spans[0] == (300, 320)


def test_registry_and_errors(tmp_path):
    f = tmp_path / "bench.jsonl"
    f.write_text(
        json.dumps({"q": {"text": "one two three"}, "a": "x", "id": 7})
        + "\n\n"
        + json.dumps({"q": {"text": "four"}, "a": "y", "id": 8})
        + "\n"
    )
    reg = BenchmarkRegistry().add_jsonl(
        f, "mine", question_field="q.text", answer_field="a", id_field="id"
    )
    assert [(i.id, i.question, i.answer) for i in reg.items] == [
        ("7", "one two three", "x"),
        ("8", "four", "y"),
    ]
    with pytest.raises(ValueError, match="not found"):
        reg.add_jsonl(tmp_path / "missing.jsonl", "x")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        reg.add_jsonl(tmp_path / "bad.jsonl", "x")
    with pytest.raises(ValueError, match="long enough"):
        SampledNgramDetector(reg)
    with pytest.raises(ValueError, match="unknown edit"):
        edit_text("a", "rewrite", random.Random(0))


def test_registry_defaults_to_the_packaged_sets(tmp_path):
    reg = BenchmarkRegistry.from_data_dir()  # GSM8K train + test and HumanEval, packaged
    by = {b: [i for i in reg.items if i.benchmark == b] for b in ("gsm8k", "humaneval")}
    assert len(by["gsm8k"]) == 7473 + 1319 and len(by["humaneval"]) == 164
    # ids name the file without .gz: the same as for the uncompressed originals
    assert by["gsm8k"][0].id == "train.jsonl:0" and by["gsm8k"][-1].id == "test.jsonl:1318"
    (tmp_path / "humaneval").mkdir()
    with pytest.raises(ValueError, match="no GSM8K or HumanEval files"):
        BenchmarkRegistry.from_data_dir(tmp_path)  # an explicit folder is not mixed with ours


# ---------------------------------------------------------------------------- packaged data
@pytest.fixture(scope="module")
def bench():
    reg = BenchmarkRegistry()
    reg.add_jsonl(builtin.path(builtin.GSM8K_TEST), "gsm8k")
    reg.add_jsonl(
        builtin.path(builtin.HUMANEVAL),
        "humaneval",
        question_field="prompt",
        answer_field="canonical_solution",
        id_field="task_id",
    )
    shakes = [d.text for d in tinyshakespeare(group_chars=2000)]
    stdlib = [d.text for d in StdlibSource(max_files=120)]
    return reg, shakes, stdlib


def _planted(det, shakes, kinds, with_answer, seed=0, per_benchmark=(60, 40)):
    rng = random.Random(seed)
    gsm = [i for i in det.items if i.benchmark == "gsm8k"][: per_benchmark[0]]
    he = [i for i in det.items if i.benchmark == "humaneval"][: per_benchmark[1]]
    recall = {}
    for kind in kinds:
        hits = 0
        for it in gsm + he:
            body = edit_text(it.question, kind, rng) + ("\n" + it.answer if with_answer else "")
            doc = rng.choice(shakes)[:600] + "\n" + body + "\n" + rng.choice(shakes)[:600]
            hits += any(m.item_id == it.id for m in det.detect(doc))
        recall[kind] = hits / len(gsm + he)
    return recall


def test_simple_recall_and_false_positives(bench):
    reg, shakes, stdlib = bench
    det = SampledNgramDetector(reg)  # decon's defaults
    assert det.skipped == {"gsm8k": 13, "humaneval": 2}  # < 20 tokens: not indexed
    recall = _planted(det, shakes, EDITS, with_answer=True)
    print("decon defaults recall", recall)
    assert recall["verbatim"] == 1.0 and recall["format"] == 1.0
    assert recall["number"] > 0.4 and recall["word_swap"] > 0.4
    relaxed = SampledNgramDetector(
        reg,
        SimpleConfig(
            question_threshold=0.6,
            perfect_below=15,
            interpolate_until=30,
            answer_weight=0.5,
            min_item_tokens=10,
        ),
    )
    r2 = _planted(relaxed, shakes, ["word_swap", "number", "two_edits"], with_answer=False)
    print("relaxed recall", r2)
    assert min(r2.values()) > 0.8
    # near-domain clean text: GSM8K *train* problems (same style, not in the test-only index)
    train = BenchmarkRegistry().add_jsonl(builtin.path(builtin.GSM8K_TRAIN), "train")
    near = [it.question + "\n" + it.answer for it in train.items[:300]]
    for d in (det, relaxed):
        clean, report = decontaminate(
            [(f"s{i}", t) for i, t in enumerate(shakes[:200] + stdlib + near)], d
        )
        assert report.contaminated == 0 and len(clean) == 200 + len(stdlib) + len(near)


def test_overlap_detector(bench):
    reg, shakes, _ = bench
    det = NgramOverlapDetector(reg, OverlapConfig())
    rng = random.Random(0)
    test = det.items[:60] + det.items[-30:]
    for kind, floor in (("verbatim", 1.0), ("format", 1.0), ("number", 0.9)):
        hits = 0
        for it in test:
            msgs = [
                {"role": "user", "content": "Please solve: " + edit_text(it.question, kind, rng)},
                {"role": "assistant", "content": it.answer},
            ]
            hits += any(m.item_id == it.id for m in det.detect(chat_to_text(msgs)))
        assert hits / len(test) >= floor, kind
    # a short quote (the first 30% of the words) stays below the 50% overlap threshold
    partial = sum(
        bool(det.detect(" ".join(it.question.split()[: len(it.question.split()) * 3 // 10])))
        for it in test
    )
    assert partial / len(test) < 0.05
    assert not any(det.detect(s) for s in shakes[:200])
    # 1-character-token n-grams are ignored: a run of digits matches nothing
    assert det._grams(tokens("1 2 3 4 5 6 7 8 9 0")) == set()


def test_stage_and_report(bench, tmp_path):
    reg, shakes, _ = bench
    gsm = [i for i in reg.items if i.benchmark == "gsm8k"]
    bench_file = tmp_path / "mine.jsonl"
    bench_file.write_text(
        json.dumps({"question": shakes[5][:400], "answer": ""}) + "\n"
    )  # a user benchmark that happens to be Shakespeare
    stage = build_stage(
        {
            "stage": "decontaminate",
            "benchmarks": [
                {"name": "gsm8k", "path": str(builtin.path(builtin.GSM8K_TEST))},
                {"name": "mine", "path": str(bench_file)},
            ],
        }
    )
    docs = [
        CurateDoc(id="clean", text=shakes[0]),
        CurateDoc(id="gsm", text=shakes[1][:300] + "\n" + gsm[3].question + "\n" + gsm[3].answer),
        CurateDoc(id="mine", text="Intro.\n" + shakes[5][:400]),
    ]
    stats = StageStats(stage="decontaminate")
    kept = list(stage.run(docs, stats))
    assert [d.id for d in kept] == ["clean"]
    assert stats.dropped == {"decontaminate:gsm8k": 1, "decontaminate:mine": 1}
    assert docs[1].provenance[-1].scores["item"] == gsm[3].id
    report = DeconReport()
    det = SampledNgramDetector(reg)
    for d in docs:
        report.add(d.id, d.text, det.detect(d.text))
    out = json.loads(report.write(tmp_path / "r.json").read_text())
    assert out["contaminated"] == 1 and out["per_benchmark"]["gsm8k"]["items"] == 1
    assert out["per_benchmark"]["gsm8k"]["examples"][0]["item_id"] == gsm[3].id
