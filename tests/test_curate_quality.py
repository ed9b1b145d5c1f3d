"""fastText-style classifier (features, a numpy reference forward, training, save/load, the
example on the packaged data sets), topic x quality vingtiles, up-sampling curves and their
stages."""

import json
import math
import zlib

import numpy as np
import pytest
import torch

from hybridlm.curate.core import CurateDoc, StageStats, build_stage
from hybridlm.curate.quality import (
    BucketThresholds,
    ClassifierConfig,
    FastTextClassifier,
    example_quality_data,
    example_topic_data,
    feature_ids,
    make_junk,
    read_texts,
    tokenize,
    train_test_split,
    vingtiles,
)
from hybridlm.curate.upsample import (
    CurveConfig,
    UpsampleCurve,
    plan_upsampling,
    plot_curves,
    repeat_count,
    write_curves,
)
from hybridlm.data import builtin

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- features
def test_features_by_hand():
    cfg = ClassifierConfig(buckets=1 << 30)
    assert tokenize("The cat, sat!") == ["the", "cat", ",", "sat", "!"]
    ids = feature_ids("A b a", cfg)
    expected = [zlib.crc32(s.encode()) % (1 << 30) for s in ("a", "b", "a", "a b", "b a")]
    assert ids.tolist() == expected
    chars = feature_ids("ab", ClassifierConfig(buckets=1 << 30, min_char=2, max_char=3))
    grams = ["<a", "ab", "b>", "<ab", "ab>"]
    assert chars.tolist() == [zlib.crc32(b"ab") % (1 << 30)] + [
        zlib.crc32(("\x01" + g).encode()) % (1 << 30) for g in grams
    ]
    assert len(feature_ids("", cfg)) == 1  # an empty document still has a feature
    with pytest.raises(ValueError, match="min_char"):
        ClassifierConfig(min_char=3, max_char=2)


def test_forward_matches_numpy_reference(tmp_path):
    cfg = ClassifierConfig(dim=4, buckets=97)
    model = FastTextClassifier(["a", "b", "c"], cfg)
    with torch.no_grad():
        model.output.weight.normal_()
        model.output.bias.normal_()
    texts = ["one two three", "two", "x y z w v u"]
    emb = model.embeddings.weight.detach().numpy()
    w, b = model.output.weight.detach().numpy(), model.output.bias.detach().numpy()
    for text, probs in zip(texts, model.predict_proba(texts), strict=True):
        h = emb[feature_ids(text, cfg)].mean(axis=0)
        logits = w @ h + b
        ref = np.exp(logits - logits.max())
        np.testing.assert_allclose(probs, ref / ref.sum(), rtol=1e-5)
    model.save(tmp_path / "m")
    again = FastTextClassifier.load(tmp_path / "m")
    assert again.labels == ["a", "b", "c"] and again.cfg == cfg
    np.testing.assert_array_equal(again.predict_proba(texts), model.predict_proba(texts))
    with pytest.raises(ValueError, match="not a classifier directory"):
        FastTextClassifier.load(tmp_path)


def test_training_separates_and_is_deterministic():
    rng = np.random.default_rng(0)
    vocab_a = [f"alpha{i}" for i in range(30)]
    vocab_b = [f"beta{i}" for i in range(30)]
    texts, labels = [], []
    for k in range(200):
        vocab = vocab_a if k % 2 else vocab_b
        texts.append(" ".join(rng.choice(vocab, 8)))
        labels.append("A" if k % 2 else "B")
    cfg = ClassifierConfig(dim=8, buckets=1 << 12, epochs=3)
    m1 = FastTextClassifier.train_model(texts, labels, cfg)
    m2 = FastTextClassifier.train_model(texts, labels, cfg)
    assert m1.accuracy(texts, labels) == 1.0
    torch.testing.assert_close(m1.embeddings.weight, m2.embeddings.weight)
    assert m1.score(["alpha3 alpha7"], "A")[0] > 0.9
    with pytest.raises(ValueError, match="not in label_set"):
        FastTextClassifier.train_model(texts, labels, cfg, label_set=["A", "C"])
    with pytest.raises(ValueError, match="unknown label"):
        m1.score(["x"], "C")


def test_junk_kinds():
    texts = ["the quick brown fox jumps over the lazy dog"] * 3
    shuffled, boiler, spam = make_junk(texts, seed=1)
    assert sorted(shuffled.split()) == sorted(texts[0].split()) and shuffled != texts[0]
    assert boiler and spam and all(w.isalpha() for w in spam.split())


def test_quality_example_on_packaged_data(tmp_path):
    texts, labels = example_quality_data(per_source=300, seed=0)
    tr_x, tr_y, te_x, te_y = train_test_split(texts, labels, test_fraction=0.25, seed=0)
    clf = FastTextClassifier.train_model(tr_x, tr_y, ClassifierConfig(epochs=5))
    acc = clf.accuracy(te_x, te_y)
    majority = max(te_y.count("high"), te_y.count("low")) / len(te_y)
    print(f"quality classifier held-out accuracy {acc:.3f} (majority {majority:.3f})")
    assert majority < 0.6 and acc > 0.8
    # boilerplate and keyword spam are easy; real questions score high
    gsm = read_texts(builtin.path(builtin.GSM8K_TEST), text_field="question", limit=50)
    assert np.mean(clf.score(gsm, "high") > 0.5) > 0.9


def test_topic_example_on_packaged_data():
    texts, labels = example_topic_data(per_topic=100)
    tr_x, tr_y, te_x, te_y = train_test_split(texts, labels, test_fraction=0.3, seed=1)
    clf = FastTextClassifier.train_model(tr_x, tr_y, ClassifierConfig(epochs=10))
    assert clf.labels == ["code", "literature", "math"]
    assert clf.accuracy(te_x, te_y) > 0.9
    assert clf.predict(["def f(x):\n    return x + 1"]) == ["code"]


# ---------------------------------------------------------------------------- vingtiles
def test_vingtiles_per_topic():
    rng = np.random.default_rng(0)
    scores = np.concatenate([rng.random(1000), 10 + rng.random(400)])
    topics = ["web"] * 1000 + ["pdf"] * 400
    buckets = vingtiles(scores, topics)
    for topic, n in (("web", 1000), ("pdf", 400)):
        counts = np.bincount(buckets[np.array(topics) == topic], minlength=20)
        assert counts.tolist() == [n // 20] * 20  # ties are absent: exact equal buckets
    # monotone in score within a topic, and per-topic (pdf's scores are all higher)
    order = np.argsort(scores[:1000])
    assert np.all(np.diff(buckets[:1000][order]) >= 0)
    th = BucketThresholds.fit(scores, topics)
    assert th.assign([-1.0, 99.0], ["web", "web"]).tolist() == [0, 19]
    assert BucketThresholds.from_dict(json.loads(json.dumps(th.to_dict()))) == th
    with pytest.raises(ValueError, match="no fitted buckets"):
        th.assign([0.5], ["news"])


# ---------------------------------------------------------------------------- curves
@pytest.mark.parametrize("shape", ["exp", "power", "linear"])
@pytest.mark.parametrize("drop", [0.0, 0.4])
def test_curve_constraints(shape, drop):
    cfg = CurveConfig(shape=shape, steepness=3.0, drop_below=drop)
    for mean in (0.3, 1.0, 2.5):
        curve = UpsampleCurve.fit_mean(mean, cfg)
        rates = curve.rates()
        assert math.isclose(rates.mean(), mean, rel_tol=1e-8)  # integral matches the target
        assert np.all(np.diff(rates) >= -1e-12)  # monotone
        assert rates.max() <= 7.0 + 1e-12  # max factor 7
        xs = np.linspace(0, 1, 1001)
        assert np.all(np.diff(curve(xs)) >= 0) and curve(xs).max() <= 7.0
        assert np.all(rates[: int(drop * 20)] == 0)  # the bottom is dropped
    tokens = np.random.default_rng(1).uniform(1, 9, 20)
    curve = UpsampleCurve.fit_tokens(tokens, 1.7 * tokens.sum(), cfg)
    assert math.isclose(curve.rates() @ tokens, 1.7 * tokens.sum(), rel_tol=1e-8)


def test_curve_rates_by_hand():
    # linear, no drop, below the cap: f = c x, bucket [a, b] rate = c (a + b) / 2
    curve = UpsampleCurve(cfg=CurveConfig(shape="linear", num_buckets=4), scale=2.0)
    np.testing.assert_allclose(curve.rates(), [0.25, 0.75, 1.25, 1.75], rtol=1e-12)
    # capped: f = min(7, 10 x) on 1 bucket: integral = 0.7 * 7 / 2 + 0.3 * 7 = 4.55
    capped = UpsampleCurve(cfg=CurveConfig(shape="linear", num_buckets=1), scale=10.0)
    assert math.isclose(capped.rates()[0], 4.55, rel_tol=1e-12)
    # power 2 with drop 0.5: f = c ((x - .5) / .5)^2 on [.5, 1]: integral = c * 0.5 / 3
    sq = UpsampleCurve(
        cfg=CurveConfig(shape="power", steepness=2, drop_below=0.5, num_buckets=1), scale=3.0
    )
    assert math.isclose(sq.rates()[0], 0.5, rel_tol=1e-12)


def test_curve_errors_and_repeats(tmp_path):
    with pytest.raises(ValueError, match="out of reach"):
        UpsampleCurve.fit_mean(5.0, CurveConfig(drop_below=0.4))  # at most 7 * 0.6 = 4.2
    with pytest.raises(ValueError, match="max_factor"):
        CurveConfig(max_factor=0)
    with pytest.raises(ValueError, match="topics"):
        plan_upsampling({"a": [1.0] * 20}, {"b": 3.0})
    counts = [repeat_count(2.3, f"d{i}") for i in range(20000)]
    assert set(counts) == {2, 3} and abs(np.mean(counts) - 2.3) < 0.02
    curves = plan_upsampling(
        {"science": [5.0] * 20, "sports": [20.0] * 20}, {"science": 300.0, "sports": 100.0}
    )
    assert math.isclose(curves["science"].mean(), 3.0, rel_tol=1e-8)
    jsonl = write_curves(curves, tmp_path / "curves.jsonl")
    png = plot_curves(jsonl, tmp_path / "curves.png")
    assert png.stat().st_size > 10_000


# ---------------------------------------------------------------------------- stages
def _run_global(stage, shards):
    partials = [stage.observe(docs) for docs in shards]
    plans = stage.plan(partials)
    stats = StageStats(stage=stage.name)
    return [list(stage.run_apply(d, p, stats)) for d, p in zip(shards, plans, strict=True)], stats


def test_classify_bucket_upsample_stages(tmp_path):
    rng = np.random.default_rng(0)
    good = [" ".join(rng.choice([f"good{i}" for i in range(20)], 10)) for _ in range(60)]
    bad = [" ".join(rng.choice([f"bad{i}" for i in range(20)], 10)) for _ in range(60)]
    clf = FastTextClassifier.train_model(
        good + bad, ["high"] * 60 + ["low"] * 60, ClassifierConfig(dim=8, buckets=4096)
    )
    clf.save(tmp_path / "q")
    classify = build_stage({"stage": "classify", "model": str(tmp_path / "q"), "label": "high"})
    docs = [CurateDoc(id=f"d{i}", text=t) for i, t in enumerate(good + bad)]
    stats = StageStats(stage="classify")
    out = list(classify.run(docs, stats))
    assert len(out) == 120 and all(0 <= d.metadata["quality"] <= 1 for d in out)
    assert np.mean([d.metadata["quality"] for d in out[:60]]) > 0.9
    buckets = build_stage({"stage": "quality_buckets", "num_buckets": 4})
    (a, b), _ = _run_global(buckets, [out[:50], out[50:]])
    assert sorted(np.bincount([d.metadata["quality_bucket"] for d in a + b])) == [30] * 4
    up = build_stage(
        {
            "stage": "upsample",
            "targets": {"": 2.0 * sum(len(d.text) for d in out)},
            "num_buckets": 4,
            "drop_below": 0.25,
        }
    )
    bottom = {d.id for d in a + b if d.metadata["quality_bucket"] == 0}
    (a, b), st = _run_global(up, [a, b])
    kept = a + b
    assert not bottom & {d.id for d in kept}  # the bottom quarter is dropped
    assert st.dropped["upsample:zero_rate"] >= 30 and max(d.metadata["repeat"] for d in kept) <= 7
    copies = sum(d.metadata["repeat"] * len(d.text) for d in kept)
    assert abs(copies / (2.0 * sum(len(d.text) for d in out)) - 1) < 0.1
