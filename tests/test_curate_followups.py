"""Curation follow-ups: up-sampling repeats expanded by the writer (Olmo 3 §2.6), two-phase
curriculum mixture files (Nemotron 3 Super §2.3), embedding-similarity decontamination of code
(Olmo 3 §4.4/§7.1: cosine > 0.8 against benchmark code)."""

import gzip
import json
import math

import numpy as np
import pytest

from hybridlm.curate.benchmarks import BenchmarkRegistry
from hybridlm.curate.core import CurateDoc, StageRecord, run_in_memory
from hybridlm.curate.decon import DecontaminateStage, decontaminate
from hybridlm.curate.embed import (
    CodeEmbeddingDetector,
    EmbedDeconConfig,
    HashedTfidfEmbedder,
    function_chunks,
    item_code,
    measure_code_decon,
    minilm_available,
    normalize_code,
    plant_variant,
    stdlib_functions,
)
from hybridlm.curate.mixing import parse_weights, write_curriculum
from hybridlm.curate.pipeline import (
    CurateConfig,
    CurateInput,
    expand_repeats,
    iter_output,
    repeat_copies,
    run_curate,
)
from hybridlm.curate.upsample import CurveConfig, UpsampleCurve, repeat_count
from hybridlm.data.config import DataConfig, SourceConfig
from hybridlm.data.pipeline import build_loaders, prepare_shards


# ---------------------------------------------------------------------------- repeats
def _doc(doc_id, repeat=None, text="x" * 10):
    meta = {} if repeat is None else {"repeat": repeat}
    return CurateDoc(id=doc_id, text=text, metadata=meta)


def test_expand_repeats_by_hand():
    removed = []
    docs = [
        _doc("a", 3),
        _doc("b"),  # no repeat: once, id unchanged
        _doc("c", 2.5),  # round: floor(3.0) = 3
        _doc("d", 0.4),  # round: 0 -> removed
        _doc("e", 2.0),  # an integral float is exact
    ]
    out = expand_repeats(docs, rounding="round", removed=removed.append)
    assert [d.id for d in out] == ["a#0", "a#1", "a#2", "b", "c#0", "c#1", "c#2", "e#0", "e#1"]
    assert [d.id for d in removed] == ["d"]
    assert removed[0].provenance[-1].reason == "expand_repeats:zero_copies"
    last = out[1].provenance[-1]
    assert (last.stage, last.kept, last.scores) == (
        "expand_repeats",
        True,
        {"copy": 1, "copies": 3, "repeat": 3},
    )
    assert out[1].metadata == {"repeat": 3} and out[1].metadata is not out[0].metadata
    # an already expanded document is written once: a second pass is the identity
    again = expand_repeats(out, rounding="round")
    assert [d.id for d in again] == [d.id for d in out]
    # stochastic rounding is the seeded hash of (seed, id): floor or ceil, mean = rate
    counts = [repeat_copies(_doc(f"s{k}", 1.3), "stochastic", seed=7) for k in range(4000)]
    assert set(counts) == {1, 2}
    assert abs(np.mean(counts) - 1.3) < 4 * math.sqrt(0.3 * 0.7 / 4000)
    assert counts[:50] == [repeat_count(1.3, f"s{k}", 7) for k in range(50)]
    for bad in ("3", -1, True, float("nan")):
        with pytest.raises(ValueError, match="metadata\\['repeat'\\]"):
            repeat_copies(_doc("z", bad))


def _bucketed_corpus(tmp_path, buckets=10, per_bucket=80):
    """Two JSONL files of documents with a topic and a quality bucket; lengths vary."""
    rng = np.random.default_rng(0)
    rows = []
    for b in range(buckets):
        for k in range(per_bucket):
            n = int(rng.integers(40, 160))
            text = " ".join(["word"] * (n // 5)) + f" b{b} d{k}"
            rows.append({"id": f"b{b}-{k}", "text": text, "topic": "web", "quality_bucket": b})
    rng.shuffle(rows)
    folder = tmp_path / "in"
    folder.mkdir()
    half = len(rows) // 2
    for name, part in (("part0.jsonl", rows[:half]), ("part1.jsonl", rows[half:])):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return folder, rows


def _read_bytes(out_dir):
    return {p.name: p.read_bytes() for p in sorted((out_dir / "data").iterdir())}


def test_upsample_output_expanded_bucket_shares_match_curve_and_rerun_is_noop(tmp_path):
    buckets = 10
    folder, rows = _bucketed_corpus(tmp_path, buckets)
    chars_B = np.zeros(buckets)
    for r in rows:
        chars_B[r["quality_bucket"]] += len(r["text"])
    target = 2.0 * chars_B.sum()  # twice the pool, up-sampled towards the top buckets
    out_dir = tmp_path / "out"
    cfg = CurateConfig(
        inputs=[
            CurateInput(
                name="web",
                kind="jsonl",
                path=str(folder),
                id_field="id",
                metadata_fields=["topic", "quality_bucket"],
            )
        ],
        stages=[
            {"stage": "upsample", "targets": {"web": target}, "num_buckets": buckets, "seed": 3}
        ],
        output_dir=str(out_dir),
        progress=False,
    )
    report = run_curate(cfg)
    rates_B = UpsampleCurve.fit_tokens(chars_B, target, CurveConfig(num_buckets=buckets)).rates()
    assert rates_B.max() <= 7.0 + 1e-9 and np.all(np.diff(rates_B) >= -1e-12)

    docs = list(iter_output(out_dir))
    by_source = {r["id"]: r for r in rows}
    exp_B = np.zeros(buckets)
    var_B = np.zeros(buckets)
    copies: dict[str, int] = {}
    for d in docs:
        orig, _, k = d.id.rpartition("#")
        assert orig.startswith("web/") and k.isdigit()
        rec = d.provenance[-1]
        assert rec.stage == "expand_repeats" and rec.scores["copy"] == int(k)
        copies[orig] = rec.scores["copies"]
        exp_B[d.metadata["quality_bucket"]] += len(d.text)
    assert len({d.id for d in docs}) == len(docs)
    for orig, n in copies.items():
        row = by_source[orig.removeprefix("web/")]
        r = rates_B[row["quality_bucket"]]
        assert n in (math.floor(r), math.ceil(r))  # stochastic rounding of the bucket's rate
        assert sum(d.id.startswith(orig + "#") for d in docs) == n
    for r in rows:
        f = rates_B[r["quality_bucket"]] % 1.0
        var_B[r["quality_bucket"]] += len(r["text"]) ** 2 * f * (1 - f)
    # expanded characters per bucket = rate x pool characters, up to the rounding noise (4 sd)
    assert np.all(np.abs(exp_B - rates_B * chars_B) <= 4 * np.sqrt(var_B) + 1e-6)
    share_B, want_B = exp_B / exp_B.sum(), rates_B * chars_B / (rates_B * chars_B).sum()
    assert np.abs(share_B - want_B).max() < 0.02
    assert abs(exp_B.sum() / target - 1.0) < 0.03

    exp = report.data["output"]["expansion"]
    assert exp["enabled"] and exp["docs_after"] == len(docs) == report.docs_out
    assert exp["chars_after"] == int(exp_B.sum())
    assert exp["docs_before"] == len(copies) and exp["chars_before"] == sum(
        len(by_source[o.removeprefix("web/")]["text"]) for o in copies
    )
    assert "Repeats expanded" in (out_dir / "report.md").read_text()

    before = _read_bytes(out_dir)
    again = run_curate(cfg)  # resume: every shard task of every segment is skipped
    assert again.shards_run == 0 and again.shards_skipped == 2 * 2
    assert _read_bytes(out_dir) == before
    assert again.data["output"]["expansion"] == exp

    off = run_curate(CurateConfig(**{**cfg.__dict__, "expand_repeats": False}))
    assert off.shards_run == 2  # only the last segment of each shard is redone
    assert off.docs_out == exp["docs_before"]
    assert all("#" not in d.id for d in iter_output(out_dir))


def test_real_valued_repeats_from_input_metadata(tmp_path):
    rows = [
        {"id": f"d{k}", "text": f"document {k} " * 5, "repeat": 0.25 + k % 4} for k in range(40)
    ]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    inp = CurateInput(
        name="x", kind="jsonl", path=str(path), id_field="id", metadata_fields=["repeat"]
    )
    base = {"inputs": [inp], "stages": [], "progress": False}
    plain = run_curate(CurateConfig(**base, output_dir=str(tmp_path / "a")))
    assert plain.docs_out == 40  # no upsample stage: off unless asked for
    rounded = run_curate(
        CurateConfig(
            **base,
            output_dir=str(tmp_path / "b"),
            expand_repeats=True,
            repeat_rounding="round",
        )
    )
    want = sum(math.floor(r["repeat"] + 0.5) for r in rows)  # 0.25 -> 0, 1.25 -> 1, ...
    assert rounded.docs_out == want == 10 * (0 + 1 + 2 + 3)
    assert rounded.data["output"]["expansion"]["zero_copies"] == 10
    removed = tmp_path / "b" / "removed" / "shard_00000.seg0.jsonl.gz"
    with gzip.open(removed, "rt") as fh:
        gone = [json.loads(x) for x in fh]
    assert len(gone) == 10 and all(g["metadata"]["repeat"] == 0.25 for g in gone)
    stoch = run_curate(
        CurateConfig(**base, output_dir=str(tmp_path / "c"), expand_repeats=True, repeat_seed=5)
    )
    want = sum(repeat_count(r["repeat"], f"x/{r['id']}", 5) for r in rows)
    assert stoch.docs_out == want


# ---------------------------------------------------------------------------- curriculum
def _two_sources(tmp_path):
    rng = np.random.default_rng(0)
    for name, letter in (("web", "a"), ("code", "b")):
        folder = tmp_path / name
        folder.mkdir()
        lines = []
        for k in range(150):
            n = int(rng.integers(20, 120))
            lines.append(json.dumps({"id": k, "text": "".join(rng.choice([letter, " "], n))}))
        (folder / "docs.jsonl").write_text("\n".join(lines) + "\n")
    sources = [
        SourceConfig(name=n, kind="jsonl", path=str(tmp_path / n), id_field="id")
        for n in ("web", "code")
    ]
    return DataConfig(
        sources=sources,
        shards_dir=str(tmp_path / "shards"),
        num_workers=0,
        seq_len=32,
        batch_size=4,
        packing="greedy",
    )


def test_curriculum_file_round_trip_and_loader_switches_at_boundary(tmp_path):
    base = _two_sources(tmp_path)
    steps, B, L = 250, base.batch_size, base.seq_len
    total = steps * B * L
    path = tmp_path / "curriculum.yaml"
    write_curriculum(
        path, base, {"web": 3, "code": 1}, {"code": 1.0}, phase2_fraction=0.2, total_tokens=total
    )
    cfg = DataConfig.load(path)
    assert [p.fraction for p in cfg.phases] == [0.8, 0.2]
    assert cfg.phases[0].weights == {"web": 0.75, "code": 0.25}
    assert cfg.phases[1].weights == {"code": 1.0}
    assert cfg.total_tokens == total
    assert cfg.weights == {"web": 0.6, "code": 0.4}  # 0.8 x (0.75, 0.25) + 0.2 x (0, 1)
    train, _ = build_loaders(cfg, prepare_shards(cfg))
    tokens = np.zeros((steps, 2))
    for s in range(steps):
        ids = next(train)["source_ids"].flatten().numpy()
        tokens[s] = [(ids == 0).sum(), (ids == 1).sum()]
    boundary = int(0.8 * steps)  # the first step of phase 2
    phase1 = tokens[: boundary - 1].sum(0)
    assert abs(phase1[0] / phase1.sum() - 0.75) < 0.06  # the phase-1 blend
    assert tokens[boundary + 1 :, 0].sum() == 0  # phase 2: code only (one boundary row may mix)
    assert tokens[boundary + 1 :, 1].sum() > 0


def test_curriculum_errors_and_weight_parsing(tmp_path):
    base = _two_sources(tmp_path)
    with pytest.raises(ValueError, match="total_tokens"):
        write_curriculum(tmp_path / "c.yaml", base, {"web": 1}, {"code": 1})
    with pytest.raises(ValueError, match="phase2_fraction"):
        write_curriculum(
            tmp_path / "c.yaml", base, {"web": 1}, {"code": 1}, phase2_fraction=1.0, total_tokens=9
        )
    with pytest.raises(ValueError, match="unknown sources \\['news'\\]"):
        write_curriculum(tmp_path / "c.yaml", base, {"web": 1}, {"news": 1}, total_tokens=9)
    assert parse_weights("web=0.3, code=0.7") == {"web": 0.3, "code": 0.7}
    with pytest.raises(ValueError, match="NAME=NUMBER"):
        parse_weights("web:0.3")


# ---------------------------------------------------------------------------- code decon
SNIPPET = '''import os


@cache
def first(a, b):
    """Doc."""
    def inner(x):
        return x + 1
    return inner(a) * b


class K:
    def method(self, y):
        # a comment
        return [y,
                y]


print(first(1, 2))
'''


def test_function_chunks_ast_and_indentation_scan():
    chunks = function_chunks(SNIPPET)
    assert [(c.name, c.start, c.end) for c in chunks] == [("first", 3, 9), ("method", 12, 16)]
    assert chunks[0].text.startswith("@cache\ndef first(a, b):")
    prose = "Here is my solution:\n" + SNIPPET.replace("import os", "import os as")  # no parse
    scanned = function_chunks(prose)
    assert [(c.name, c.start, c.end) for c in scanned] == [("first", 5, 10), ("method", 13, 17)]
    assert function_chunks("no code at all") == []


def test_normalize_code_is_invariant_to_renaming_and_layout():
    a = "def total(xs):\n    '''Sum.'''\n    s = 0\n    for x in xs:  # loop\n        s += x\n"
    a += "    return s\n"
    b = "def acc_sum(items):\n  s2=0\n\n  for it in items :\n    s2+=it\n  return (s2)\n"
    want = "def v(v):\n    v = 0\n    for v in v:\n        v += v\n    return v"
    assert normalize_code(a, "canonical") == normalize_code(b, "canonical") == want
    assert normalize_code(a, "format") != normalize_code(b, "format")  # names kept
    assert "len(" in normalize_code("def f(s):\n    return len(s)\n")  # builtins kept
    assert normalize_code("x = (1,", "canonical") == "v = (1,"  # fragments: textual fallback
    with pytest.raises(ValueError, match="normalize"):
        normalize_code(a, "lower")


def test_hashed_tfidf_by_hand():
    emb = HashedTfidfEmbedder(dim=1 << 20, ngram_sizes=(1,))
    emb.fit(["a", "a b"])  # df(a) = 2, df(b) = 1 over R = 2 references
    idf_a, idf_b = 1.0 + math.log(3 / 3), 1.0 + math.log(3 / 2)
    w_a, w_b = (1.0 + math.log(2)) * idf_a, 1.0 * idf_b  # "a b a": tf(a) = 2, tf(b) = 1
    e = emb.encode(["a b a", "a", "c"])
    assert np.allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-6)
    assert float(e[0] @ e[1]) == pytest.approx(w_a / math.hypot(w_a, w_b), abs=1e-6)
    assert float(e[2] @ e[1]) == pytest.approx(0.0, abs=1e-6)  # no shared n-gram
    assert np.array_equal(e, emb.encode(["a b a", "a", "c"]))  # deterministic


@pytest.fixture
def humaneval():
    return BenchmarkRegistry.from_data_dir()  # the packaged GSM8K + HumanEval


def test_hashed_code_decon_recall_on_planted_solutions_and_stdlib_false_positives(humaneval):
    det = CodeEmbeddingDetector(humaneval, EmbedDeconConfig(backend="hashed"))
    assert len(det.items) + det.skipped_items == 164
    res = measure_code_decon(det, humaneval, negatives=stdlib_functions())
    assert res["items"] >= 140 and res["negatives"] >= 500
    assert res["recall"]["rename"] == 1.0 and res["recall"]["rename_reformat"] == 1.0
    assert res["recall"]["rename_reformat_insert"] >= 0.97
    assert res["false_positives"] == 0 and res["top_negatives"][0]["cosine"] < 0.6
    # the control: without canonical names, renamed copies are missed
    fmt = CodeEmbeddingDetector(humaneval, EmbedDeconConfig(normalize="format"))
    ctl = measure_code_decon(
        fmt, humaneval, kinds=("rename", "reformat"), negatives=[], max_items=60
    )
    assert ctl["recall"]["reformat"] == 1.0 and ctl["recall"]["rename"] < 0.1


def test_decontaminate_stage_embedding_mode(humaneval):
    item = next(it for it in humaneval.items if it.id == "HumanEval/10")
    planted = "Some notes first.\n\n" + plant_variant(item_code(item), "rename_reformat", 1)
    clean = "\n\n".join(code for _, code in stdlib_functions(["textwrap.py"])[:6])
    docs = [
        CurateDoc(id="planted", text=planted),
        CurateDoc(id="stdlib", text=clean),
        CurateDoc(id="prose", text="The cat sat on the mat. " * 20),
    ]
    stage = DecontaminateStage(method="embedding")  # no data_dir: the packaged sets
    kept, stats, removed = run_in_memory([stage], [docs])
    assert [d.id for d in kept[0]] == ["stdlib", "prose"]
    assert [d.id for d in removed] == ["planted"]
    rec: StageRecord = removed[0].provenance[-1]
    assert rec.reason == "decontaminate:humaneval" and rec.scores["item"] == "HumanEval/10"
    assert rec.scores["score"] >= 0.8
    ids, report = decontaminate(
        [(d.id, d.text) for d in docs],
        CodeEmbeddingDetector(humaneval, EmbedDeconConfig(backend="hashed")),
    )
    assert ids == ["stdlib", "prose"] and report.contaminated == 1
    with pytest.raises(ValueError, match="no items of the code benchmarks"):
        CodeEmbeddingDetector(humaneval, EmbedDeconConfig(benchmarks=("mbpp",)))


def _tiny_sentence_model(path):
    """A 2-layer random BERT saved in the sentence-transformers layout all-MiniLM-L6-v2 uses
    (Transformer -> mean Pooling -> Normalize), with a word-piece vocabulary of its own."""
    st = pytest.importorskip("sentence_transformers")
    from transformers import BertConfig, BertModel, BertTokenizerFast

    torch = pytest.importorskip("torch")
    words = sorted({w for w in "def return for in if else while the a of x y n s i j k".split()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *list("()[]:=+-*,.<>_0123456789")]
    vocab += list("abcdefghijklmnopqrstuvwxyz") + words + ["##" + c for c in "abcdefghijklmnopqrs"]
    hf = path / "hf"
    hf.mkdir(parents=True)
    (hf / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    BertTokenizerFast(vocab_file=str(hf / "vocab.txt")).save_pretrained(hf)
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=len(dict.fromkeys(vocab)),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(cfg).save_pretrained(hf)
    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer.modules import (
            Normalize,
            Pooling,
            Transformer,
        )
    except ImportError:
        from sentence_transformers.models import Normalize, Pooling, Transformer
    word = Transformer(str(hf), max_seq_length=48)
    pool = Pooling(word.get_word_embedding_dimension(), pooling_mode="mean")
    model = st.SentenceTransformer(modules=[word, pool, Normalize()], device="cpu")
    model.save(str(path / "st"))
    return path / "st", hf


def test_minilm_backend_loads_a_local_sentence_transformers_model(tmp_path, monkeypatch):
    """The real loading code (sentence-transformers, `local_files_only`) on a model made here:
    rows equal the recipe computed by hand (mean over non-padding tokens, L2 norm), truncation
    follows `max_length`, and a missing model is a one-line error, not a download."""
    st_dir, hf = _tiny_sentence_model(tmp_path)
    import torch
    from transformers import AutoModel, AutoTokenizer

    from hybridlm.curate.embed import MiniLMEmbedder, make_backend

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert minilm_available(str(st_dir))
    emb = make_backend("minilm", model=str(st_dir), max_length=16)
    texts = ["def f(x): return x + 1", "for i in range(n): s = s + i", "a", "x " * 40]
    e = emb.encode(texts)
    tok, enc = AutoTokenizer.from_pretrained(hf), AutoModel.from_pretrained(hf).eval()
    with torch.no_grad():
        b = tok(texts, padding=True, truncation=True, max_length=16, return_tensors="pt")
        h = enc(**b).last_hidden_state
        m = b["attention_mask"].unsqueeze(-1).float()
        ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy()
    assert e.shape == (4, 32) and e.dtype == np.float32
    assert np.allclose(e, ref, atol=1e-5)
    assert emb.encode([]).shape == (0, 32)
    assert emb.describe() == {"backend": "minilm", "model": str(st_dir), "max_length": 16}
    missing = str(tmp_path / "no-such-model")
    assert not minilm_available(missing)
    with pytest.raises(ValueError, match="not on this machine.*hf download"):
        MiniLMEmbedder(model=missing)


@pytest.mark.slow
def test_minilm_backend_offline(humaneval, monkeypatch, one_thread):
    """all-MiniLM-L6-v2 itself, when its weights are in the local Hugging Face cache."""
    if not minilm_available():
        pytest.skip("sentence-transformers/all-MiniLM-L6-v2 is not in the local Hub cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from hybridlm.curate.embed import MiniLMEmbedder

    emb = MiniLMEmbedder()
    items = [it for it in humaneval.items if it.benchmark == "humaneval"][:3]
    texts = [normalize_code(item_code(it), "format") for it in items]
    e = emb.encode(texts + ["short"])
    assert e.shape == (4, 384) and np.allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    det = CodeEmbeddingDetector(humaneval, EmbedDeconConfig(backend="minilm"), backend=emb)
    res = measure_code_decon(
        det, humaneval, kinds=("rename_reformat",), negatives=stdlib_functions()[:100], max_items=20
    )
    assert res["recall"]["rename_reformat"] == 1.0 and res["negatives"] > 50
    # identifier-free code looks alike to a sentence model: 26.5% of these 83 stdlib functions
    # (8.7% of all 766) reach 0.8, against none with the hashed backend
    assert res["fp_rate"] < 0.5
    variant = normalize_code(plant_variant(item_code(items[0]), "reformat", 0), "format")
    v = emb.encode([variant])[0]
    assert float(v @ e[0]) > 0.95 > max(float(v @ e[1]), float(v @ e[2]))
    assert np.array_equal(emb.encode(texts[:1]), e[:1])


def test_mix_command_writes_a_quality_weighted_phase_two(tmp_path, capsys):
    import argparse

    from hybridlm.cli.data import register

    base = _two_sources(tmp_path)
    base.save(tmp_path / "data.yaml")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        ["mix", "--data", str(tmp_path / "data.yaml"), "--out", str(tmp_path / "mix")]
        + ["--proxy", "bigram", "--runs", "12", "--budget", "4000", "--total-tokens", "50000"]
        + ["--phase2-task-weights", "code_bpb=1", "--phase2-fraction", "0.25"]
    )
    args.fn(args)
    mixture = DataConfig.load(tmp_path / "mix" / "mixture.yaml")
    cur = DataConfig.load(tmp_path / "mix" / "curriculum.yaml")
    assert [p.fraction for p in cur.phases] == [0.75, 0.25] and cur.total_tokens == 50000
    assert cur.phases[0].weights == pytest.approx(mixture.weights, abs=1e-6)
    # phase 2 minimises the code domain's held-out loss alone: a code-heavier blend
    code1 = cur.phases[0].weights.get("code", 0.0)
    assert cur.phases[1].weights.get("code", 0.0) > code1 + 0.1
    assert "curriculum: phase 1" in capsys.readouterr().out
