"""Curation core and pipeline: documents and provenance, stage registry, sharded resumable runs,
bad input next to good input, reports, output read back by the pretraining data pipeline, CLI."""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from hybridlm.cli.data import register
from hybridlm.curate.core import (
    STAGES,
    CurateDoc,
    Decision,
    StageStats,
    build_stage,
    load_stage_modules,
    stage_fingerprint,
)
from hybridlm.curate.filters import GopherRepetitionFilter, LengthFilter
from hybridlm.curate.pipeline import (
    CurateConfig,
    CurateInput,
    iter_output,
    read_docs,
    run_curate,
)
from hybridlm.data.config import SourceConfig
from hybridlm.data.pipeline import build_source
from hybridlm.data.sources import Document

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- documents, stages
def test_doc_from_document_and_record_round_trip():
    doc = CurateDoc.from_document(Document("s/1", "hello", "s", {"url": "http://a.b"}))
    assert (doc.id, doc.text, doc.source, doc.metadata) == (
        "s/1",
        "hello",
        "s",
        {"url": "http://a.b"},
    )
    LengthFilter(min_chars=1).run([doc], StageStats(stage="length")).__next__()
    rec = json.loads(json.dumps(doc.to_record()))
    assert rec["provenance"] == [{"stage": "length", "kept": True, "scores": {"chars": 5}}]
    assert CurateDoc.from_record(rec) == doc
    assert doc.to_document() == Document("s/1", "hello", "s", {"url": "http://a.b"})


def test_doc_stage_records_provenance_and_statistics():
    docs = [CurateDoc(id=str(k), text="x" * n) for k, n in enumerate([5, 50, 500, 5])]
    stats, removed = StageStats(stage="length"), []
    kept = list(LengthFilter(min_chars=10, max_chars=100).run(docs, stats, removed.append))
    assert [d.id for d in kept] == ["1"]
    assert (stats.docs_in, stats.docs_out, stats.chars_in, stats.chars_out) == (4, 1, 560, 50)
    assert stats.dropped == {"length:too_short": 2, "length:too_long": 1}
    assert [d.drop_record.reason for d in removed] == [
        "length:too_short",
        "length:too_long",
        "length:too_short",
    ]
    assert stats.seconds > 0 and kept[0].drop_record is None
    total = StageStats(stage="length").merge(stats).merge(stats)
    assert total.docs_in == 8 and total.dropped["length:too_short"] == 4
    with pytest.raises(ValueError):
        total.merge(StageStats(stage="other"))
    with pytest.raises(ValueError):
        Decision.drop("")


def test_registry_builds_stages_from_config():
    load_stage_modules()
    for name in (
        "normalize",
        "html_extract",
        "length",
        "char_ratio",
        "gopher_quality",
        "gopher_repetition",
        "c4",
        "fineweb",
        "url_blocklist",
        "langid",
        "exact_dedup",
        "minhash_dedup",
        "substring_dedup",
    ):
        assert name in STAGES
    stage = build_stage({"stage": "gopher_repetition", "top_ngram_max": [[2, 0.5]]})
    assert isinstance(stage, GopherRepetitionFilter) and stage.top_ngram_max == ((2, 0.5),)
    again = build_stage(json.loads(json.dumps(stage.to_dict())))
    assert stage_fingerprint(again) == stage_fingerprint(stage)
    assert stage_fingerprint(stage) != stage_fingerprint(GopherRepetitionFilter())
    with pytest.raises(ValueError, match="unknown stage"):
        build_stage({"stage": "nope"})
    with pytest.raises(ValueError, match="unknown options"):
        build_stage({"stage": "length", "min_char": 3})
    with pytest.raises(ValueError, match="'stage' key"):
        build_stage({"min_chars": 3})


# ---------------------------------------------------------------------------- corpus on disk
VOCAB = None


def _sentence(rng: np.random.Generator, n: int) -> str:
    global VOCAB
    if VOCAB is None:
        r = np.random.default_rng(123)
        syll = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po", "an", "el", "ur"]
        VOCAB = ["".join(r.choice(syll, size=int(r.integers(2, 4)))) for _ in range(4000)]
    return " ".join(rng.choice(VOCAB, size=n)).capitalize() + "."


def _text(rng: np.random.Generator, sentences: int = 12) -> str:
    return "\n".join(_sentence(rng, 12) for _ in range(sentences))


def _write_jsonl_gz(path: Path, records: list, corrupt_tail: bool = False) -> None:
    lines = b"".join(
        (r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records
    )
    data = gzip.compress(lines, mtime=0)
    path.write_bytes(data[: len(data) - 12] if corrupt_tail else data)


def make_corpus(root: Path) -> dict:
    """Three JSONL.gz files (one truncated), planted duplicates and bad lines."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    docs = [
        {
            "id": f"a{k}",
            "text": _text(rng),
            "url": f"https://site{k}.org/p",
            "date": f"2021-0{1 + k % 9}-01",
        }
        for k in range(8)
    ]
    near = docs[1]["text"].split(" ")
    near[40] = "changed"  # one word of ~150: a near duplicate
    b_docs = [{"id": f"b{k}", "text": _text(rng), "date": "2022-01-01"} for k in range(6)]
    b_docs += [
        {"id": "b_exact", "text": docs[0]["text"].replace("\n", "\n\n"), "date": "2020-01-01"},
        {"id": "b_near", "text": " ".join(near), "date": "2025-01-01"},
    ]
    bad = [
        b'{"id": "bad_utf8", "text": "caf\xe9 latin-1 bytes"}',
        b'{"id": "bad_json", "text": "unterminated',
        {"id": "empty", "text": "   "},
        {"id": "no_text", "body": "x"},
        {"id": "huge", "text": "word " * 5000},
        {"id": "surrogate", "text": "bad \ud800 surrogate"},
    ]
    _write_jsonl_gz(root / "a.jsonl.gz", docs[:4] + bad[:3] + docs[4:])
    _write_jsonl_gz(root / "b.jsonl.gz", b_docs + bad[3:])
    c_docs = [{"id": f"c{k}", "text": _text(rng)} for k in range(40)]
    _write_jsonl_gz(root / "c.jsonl.gz", c_docs, corrupt_tail=True)
    return {"a": docs, "b": b_docs, "c": c_docs}


def _cfg(tmp_path: Path, **kw) -> CurateConfig:
    base = dict(
        inputs=[
            CurateInput(
                name="web",
                kind="jsonl",
                path=str(tmp_path / "in"),
                id_field="id",
                metadata_fields=["url", "date"],
            )
        ],
        stages=[
            {"stage": "normalize"},
            {"stage": "length", "min_chars": 200},
            {"stage": "gopher_repetition"},
            {"stage": "exact_dedup"},
            {"stage": "minhash_dedup", "keep": "newest"},
        ],
        output_dir=str(tmp_path / "out"),
        max_doc_chars=20_000,
        progress=False,
    )
    base.update(kw)
    return CurateConfig(**base)


def test_pipeline_bad_input_dedup_report_and_pretraining_source(tmp_path):
    corpus = make_corpus(tmp_path / "in")
    report = run_curate(_cfg(tmp_path))
    kept = {d.id: d for d in iter_output(tmp_path / "out")}
    # every good document of the intact files is there, except the planted duplicates
    for rec in corpus["a"] + corpus["b"]:
        assert (f"web/{rec['id']}" in kept) == (rec["id"] not in ("b_exact", "a1")), rec["id"]
    # keep-newest: the 2025 near copy replaces a1; the undated-later exact copy b_exact loses
    near = kept["web/b_near"].provenance[-1]
    assert near.stage == "minhash_dedup" and near.kept
    # the truncated file: what was readable is kept, in order, and the damage counted once
    c_ids = [k for k in kept if k.startswith("web/c")]
    assert 0 < len(c_ids) <= 40 and c_ids == [f"web/c{k}" for k in range(len(c_ids))]
    skipped = report.data["inputs"]["web"]["skipped"]
    assert skipped == {
        "bad_json": 1,
        "non_utf8": 1,
        "empty": 1,
        "missing_field": 1,
        "huge": 1,
        "bad_unicode": 1,
        "unreadable": 1,
    }
    # statistics add up stage to stage
    stages = report.data["stages"]
    assert stages[0]["docs_in"] == report.data["read"]["documents"]
    for prev, cur in zip(stages, stages[1:], strict=False):
        assert cur["docs_in"] == prev["docs_out"]
        assert prev["docs_in"] - prev["docs_out"] == sum(prev["dropped"].values())
    assert report.stage("exact_dedup")["dropped"] == {"exact_dedup": 1}
    assert report.stage("minhash_dedup")["summary"]["duplicates"] == 1
    assert report.docs_out == len(kept) == stages[-1]["docs_out"]
    assert "| minhash_dedup |" in (tmp_path / "out" / "report.md").read_text()
    assert json.loads((tmp_path / "out" / "report.json").read_text())["output"]["docs"] == len(kept)
    # removed documents are written with the reason
    removed = [
        d for p in sorted((tmp_path / "out" / "removed").glob("*.jsonl.gz")) for d in read_docs(p)
    ]
    assert {d.id: d.drop_record.reason for d in removed}["web/b_exact"] == "exact_dedup"
    # the pretraining data pipeline reads the output folder as a jsonl source
    src = build_source(
        SourceConfig(name="curated", kind="jsonl", path=report.data["output"]["dir"])
    )
    texts = [d.text for d in src]
    assert texts == [d.text for d in kept.values()] and src.stats.num_skipped == 0


def _untimed(stages: list[dict]) -> list[dict]:
    out = []
    for s in stages:
        s = {k: v for k, v in s.items() if k not in ("seconds", "docs_per_second")}
        if "summary" in s:
            s["summary"] = {k: v for k, v in s["summary"].items() if k != "plan_seconds"}
        out.append(s)
    return out


def test_resume_skips_finished_shards(tmp_path):
    make_corpus(tmp_path / "in")
    cfg = _cfg(tmp_path)
    first = run_curate(cfg)
    assert first.shards_run == 9 and first.shards_skipped == 0  # 3 shards x 3 segments
    out = sorted((tmp_path / "out" / "data").glob("shard_*.jsonl.gz"))
    before = [p.read_bytes() for p in out]
    again = run_curate(cfg)
    assert again.shards_run == 0 and again.shards_skipped == 9
    assert [p.read_bytes() for p in out] == before
    # statistics of skipped shards come from their done-records
    assert _untimed(again.data["stages"]) == _untimed(first.data["stages"])
    # a changed input file redoes only its shard (its dedup plan changes, the others' do not)
    rng = np.random.default_rng(9)
    path = tmp_path / "in" / "b.jsonl.gz"
    lines = (
        gzip.decompress(path.read_bytes())
        + json.dumps({"id": "new", "text": _text(rng)}).encode()
        + b"\n"
    )
    path.write_bytes(gzip.compress(lines, mtime=0))
    third = run_curate(cfg)
    assert third.shards_run == 3 and third.shards_skipped == 6
    assert "web/new" in {d.id for d in iter_output(tmp_path / "out")}
    # a lost done-record reruns that task only; resume=False reruns everything
    (tmp_path / "out" / "data" / "shard_00002.json").unlink()
    assert run_curate(cfg).shards_run == 1
    assert run_curate(dataclasses.replace(cfg, resume=False)).shards_run == 9
    # switching the output format replaces the shards instead of leaving the old ones next to them
    kept = [d.id for d in iter_output(tmp_path / "out")]
    assert run_curate(dataclasses.replace(cfg, output_format="parquet")).shards_run == 3
    names = sorted(p.name for p in (tmp_path / "out" / "data").iterdir())
    assert names == [f"shard_{k:05d}.{ext}" for k in range(3) for ext in ("json", "parquet")]
    assert [d.id for d in iter_output(tmp_path / "out")] == kept


def test_parquet_input_corrupt_file_and_parquet_output(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(5)
    folder = tmp_path / "pq"
    folder.mkdir()
    texts = [_text(rng) for _ in range(6)]
    pq.write_table(pa.table({"text": texts[:3]}), folder / "a.parquet")
    (folder / "b.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    pq.write_table(pa.table({"text": texts[3:]}), folder / "c.parquet")
    cfg = _cfg(
        tmp_path,
        inputs=[CurateInput(name="pq", kind="parquet", path=str(folder))],
        output_format="parquet",
    )
    report = run_curate(cfg)
    assert report.data["inputs"]["pq"]["skipped"] == {"corrupt_parquet": 1}
    assert [d.text for d in iter_output(tmp_path / "out")] == texts
    back = pq.read_table(tmp_path / "out" / "data" / "shard_00000.parquet").to_pylist()
    assert (
        back[0]["text"] == texts[0] and json.loads(back[0]["provenance"])[0]["stage"] == "normalize"
    )


def test_config_yaml_validation_and_cli(tmp_path, capsys):
    cfg = CurateConfig.load(ROOT / "configs" / "curate.yaml")
    assert [s["stage"] for s in cfg.stages][-1] == "substring_dedup"
    with pytest.raises(ValueError, match="unknown stage"):
        CurateConfig(stages=[{"stage": "bogus"}])
    with pytest.raises(ValueError, match="stages\\[0\\].*unknown options"):
        CurateConfig(stages=[{"stage": "length", "colour": 1}])
    with pytest.raises(ValueError, match="needs a path"):
        CurateConfig(inputs=[CurateInput(name="x", kind="jsonl")])
    with pytest.raises(ValueError, match="executor"):
        CurateConfig.from_dict({"executor": "spark"})
    make_corpus(tmp_path / "in")
    path = tmp_path / "curate.yaml"
    _cfg(tmp_path).save(path)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(
        ["curate", "--config", str(path), "--output", str(tmp_path / "o2"), "--no-progress"]
    )
    args.fn(args)
    out = capsys.readouterr().out
    assert "minhash_dedup" in out and "kept" in out
    assert (tmp_path / "o2" / "report.md").is_file()


def test_html_documents_extracted_in_the_pipeline(tmp_path):
    pytest.importorskip("trafilatura")
    rng = np.random.default_rng(11)
    paras = [_sentence(rng, 14) for _ in range(6)]
    page = (
        "<html><body><nav><a href='/'>Home</a> <a href='/buy'>Buy now</a></nav><main>"
        + "".join(f"<p>{p}</p>" for p in paras)
        + "</main></body></html>"
    )
    (tmp_path / "in").mkdir()
    _write_jsonl_gz(
        tmp_path / "in" / "pages.jsonl.gz",
        [{"id": "p1", "text": page, "content_type": "text/html"}, {"id": "t1", "text": paras[0]}],
    )
    cfg = _cfg(
        tmp_path,
        inputs=[
            CurateInput(
                name="crawl",
                kind="jsonl",
                path=str(tmp_path / "in"),
                id_field="id",
                metadata_fields=["content_type"],
            )
        ],
        stages=[{"stage": "html_extract"}, {"stage": "normalize"}],
    )
    run_curate(cfg)
    docs = {d.id: d for d in iter_output(tmp_path / "out")}
    html = docs["crawl/p1"]
    assert all(p in html.text for p in paras) and "Buy now" not in html.text
    assert html.provenance[0].scores["html"] is True
    assert docs["crawl/t1"].text == paras[0] and docs["crawl/t1"].provenance[0].scores == {
        "html": False
    }
