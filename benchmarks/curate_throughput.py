"""Curation throughput and dedup quality, every figure measured in this run.

    python benchmarks/curate_throughput.py                    # the packaged tinyshakespeare
    python benchmarks/curate_throughput.py --docs 300 --no-ray --json out.json --out runs/curate

1. Per-stage throughput on one core (docs/s): each per-document stage runs alone over the same
   real documents (the packaged tinyshakespeare's passages grouped to ~1,500 characters);
   global stages are timed observe + plan + apply over the whole set.
2. The whole pipeline on the in-process executor vs Ray Data with 2 workers on a local 2-CPU Ray
   instance (started before timing), run twice: cold (worker processes start and import the
   package) and warm (workers reused); speedup = local seconds / warm Ray seconds. The machine's
   load average is printed with it: on a shared machine the speedup is bounded by free cores.
   Every output must be identical to the local one document for document, or the script
   exits 1.
3. Dedup precision/recall with planted near-duplicates: copies of real documents with a fraction
   e of their words replaced (e in 0, 0.5%, 1%, 2%, 3%, 5%, 10%), plus exact copies with
   whitespace changes. Ground truth is the true 5-gram Jaccard to the source: a copy with
   J >= 0.75 (the verification threshold) should be removed. Reported: recall per edit rate,
   recall on the copies that should go (per edit rate: the copy and its source end in one
   duplicate cluster), and precision (removed documents that have a true
   J >= 0.75 partner / all removed), for MinHash and for exact dedup.
4. Substring dedup recall: spans of 600 to 2,000 bytes copied from one document into 3 others;
   recall = planted repeat bytes removed / planted repeat bytes (first occurrences excluded),
   precision = removed bytes that lie in planted repeats / removed bytes.

Exits 1 when a check fails: Ray output != local output, MinHash recall on copies with J >= 0.75
below 0.95, MinHash or exact precision below 0.95, exact recall on exact copies below 1, substring
recall below 0.9.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hybridlm.curate.core import CurateDoc, DocStage, GlobalStage, StageStats, run_in_memory
from hybridlm.curate.dedup import ExactDedup, MinHashDedup, SubstringDedup, jaccard
from hybridlm.curate.dedup import shingle_hashes as shingles
from hybridlm.curate.pipeline import (
    CurateConfig,
    CurateInput,
    default_stages,
    iter_output,
    run_curate,
)
from hybridlm.data import builtin
from hybridlm.data.sources import TextFileSource
from hybridlm.report.plot import save_figure

EDIT_RATES = (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.10)


def load_corpus(n: int) -> tuple[str, list[CurateDoc]]:
    """Real documents: tinyshakespeare passages grouped to ~1,500 chars."""
    path = builtin.path(builtin.TINYSHAKESPEARE)
    src = TextFileSource(path, split="blank_line", group_chars=1500, name="shakespeare")
    docs = [CurateDoc.from_document(d) for d in src]
    return "tinyshakespeare", docs[:n]


def stage_throughput(docs: list[CurateDoc]) -> list[dict]:
    rows = []
    for spec in default_stages():
        from hybridlm.curate.core import build_stage

        stage = build_stage(spec)
        stage.setup()
        batch = [copy.deepcopy(d) for d in docs]
        stats = StageStats(stage=stage.name)
        t0 = time.perf_counter()
        if isinstance(stage, GlobalStage):
            plan = stage.plan([stage.observe(batch)])[0]
            kept = list(stage.run_apply(batch, plan, stats))
        else:
            assert isinstance(stage, DocStage)
            kept = list(stage.run(batch, stats))
        seconds = time.perf_counter() - t0
        rows.append(
            {
                "stage": stage.name,
                "docs": len(batch),
                "kept": len(kept),
                "docs_per_s": len(batch) / seconds,
                "mb_per_s": sum(len(d.text) for d in batch) / seconds / 1e6,
            }
        )
        print(
            f"[curate] stage {stage.name:<18} {rows[-1]['docs_per_s']:9.0f} docs/s "
            f"{rows[-1]['mb_per_s']:6.2f} MB/s (1 core, {len(batch)} docs, kept {len(kept)})",
            flush=True,
        )
    return rows


def pipeline_ratio(docs: list[CurateDoc], shards: int, workers: int) -> tuple[dict, bool]:
    import ray

    from hybridlm.curate.pipeline import write_docs

    tmp = Path(tempfile.mkdtemp(prefix="curate_bench_"))
    per = (len(docs) + shards - 1) // shards
    for k in range(shards):
        write_docs(tmp / "in" / f"part_{k:03d}.jsonl.gz", docs[k * per : (k + 1) * per])
    cfg = CurateConfig(
        inputs=[CurateInput(name="bench", kind="jsonl", path=str(tmp / "in"), id_field="id")],
        stages=default_stages(),
        output_dir=str(tmp / "local"),
        progress=False,
    )
    t0 = time.perf_counter()
    run_curate(cfg)
    local_s = time.perf_counter() - t0
    ray.init(
        num_cpus=workers, include_dashboard=False, log_to_driver=False, configure_logging=False
    )
    ray_s = []
    try:
        for k in range(2):  # cold (workers start and import) and warm (workers reused)
            t0 = time.perf_counter()
            run_curate(
                dataclasses.replace(
                    cfg, output_dir=str(tmp / f"ray{k}"), executor="ray", num_workers=workers
                )
            )
            ray_s.append(time.perf_counter() - t0)
    finally:
        ray.shutdown()
    want = [d.to_record() for d in iter_output(tmp / "local")]
    same = all(want == [d.to_record() for d in iter_output(tmp / f"ray{k}")] for k in range(2))
    load = os.getloadavg()[0]
    row = {
        "docs": len(docs),
        "shards": shards,
        "local_s": local_s,
        "ray_cold_s": ray_s[0],
        "ray_warm_s": ray_s[1],
        "speedup_warm": local_s / ray_s[1],
        "identical": same,
        "cpus": os.cpu_count(),
        "load1": load,
    }
    print(
        f"[curate] pipeline {len(docs)} docs / {shards} shards: local {local_s:.1f} s, "
        f"ray x{workers} cold {ray_s[0]:.1f} s, warm {ray_s[1]:.1f} s, speedup (warm) "
        f"{local_s / ray_s[1]:.2f}x, identical output {same} "
        f"({os.cpu_count()} cores, load average {load:.1f})",
        flush=True,
    )
    return row, same


def _edit(words: list[str], rate: float, vocab: list[str], rng: np.random.Generator) -> list[str]:
    out = list(words)
    for k in np.flatnonzero(rng.random(len(out)) < rate):
        out[int(k)] = vocab[int(rng.integers(len(vocab)))]
    return out


def dedup_quality(docs: list[CurateDoc], copies: int, seed: int) -> tuple[dict, bool]:
    rng = np.random.default_rng(seed)
    vocab = sorted({w for d in docs for w in d.text.split()})
    corpus, truth = [], {}  # truth: id -> (source index, edit rate, jaccard to source)
    for k, d in enumerate(docs):
        corpus.append(CurateDoc(id=f"src{k}", text=d.text))
    sources = rng.choice(len(docs), size=copies, replace=False)
    for c, src in enumerate(sources):
        rate = EDIT_RATES[c % len(EDIT_RATES)]
        words = docs[int(src)].text.split()
        text = " ".join(_edit(words, rate, vocab, rng))
        j = jaccard(shingles(docs[int(src)].text), shingles(text))
        corpus.append(CurateDoc(id=f"near{c}", text=text))
        truth[f"near{c}"] = (int(src), rate, j)
    for c, src in enumerate(rng.choice(len(docs), size=copies // 4, replace=False)):
        exact = docs[int(src)].text.replace(" ", "  ").replace("\n", "\n\n")
        corpus.append(CurateDoc(id=f"exact{c}", text=exact))
        truth[f"exact{c}"] = (int(src), -1.0, 1.0)
    order = rng.permutation(len(corpus))  # copies are not always after their source
    corpus = [corpus[int(i)] for i in order]
    planted_src = {f"src{s}" for s, _, j in truth.values() if j >= 0.75}

    def should_go(doc_id: str) -> bool:
        return doc_id in truth and truth[doc_id][2] >= 0.75 or doc_id in planted_src

    out, ok = {}, True
    for name, stage in (("minhash", MinHashDedup(keep="first")), ("exact", ExactDedup())):
        t0 = time.perf_counter()
        _, _, removed = run_in_memory(
            [stage], [corpus[: len(corpus) // 2], corpus[len(corpus) // 2 :]]
        )
        seconds = time.perf_counter() - t0
        gone = {d.id for d in removed}
        keeper = {d.id: str(d.provenance[-1].scores["dup_of"]) for d in removed}

        def root(doc_id: str, keeper: dict[str, str] = keeper) -> str:
            return keeper.get(doc_id, doc_id)

        precision = sum(should_go(i) for i in gone) / max(1, len(gone))
        # a source or its copy may be the survivor: count groups, not documents
        groups: dict[int, list[str]] = {}
        for doc_id, (src, _, j) in truth.items():
            if j >= 0.75:
                groups.setdefault(src, [f"src{src}"]).append(doc_id)
        expected = sum(len(g) - 1 for g in groups.values())
        removed_in = sum(sum(i in gone for i in g) for g in groups.values())
        recall = removed_in / max(1, expected)
        per_rate = {}
        for rate in (-1.0, *EDIT_RATES):
            ids = [i for i, t in truth.items() if t[1] == rate]
            # caught: the copy and its source end in the same duplicate cluster
            pairs_gone = sum(root(i) == root(f"src{truth[i][0]}") for i in ids)
            per_rate[rate] = (
                pairs_gone / max(1, len(ids)),
                float(np.mean([truth[i][2] for i in ids])),
            )
        copies_rows = [
            {
                "kind": "copy",
                "method": name,
                "jaccard": t[2],
                "edit_rate": t[1],
                "caught": root(i) == root(f"src{t[0]}"),
            }
            for i, t in sorted(truth.items())
        ]
        out[name] = {
            "copies": copies_rows,
            "precision": precision,
            "recall_j75": recall,
            "removed": len(gone),
            "seconds": seconds,
            "per_rate": {str(k): v for k, v in per_rate.items()},
        }
        rates = "  ".join(
            f"{'exact' if r < 0 else f'{r:.1%}'}: {v[0]:.2f} (J {v[1]:.2f})"
            for r, v in per_rate.items()
        )
        print(
            f"[curate] {name} dedup over {len(corpus)} docs: precision {precision:.3f}, "
            f"recall (copies with J>=0.75) {recall:.3f}, {seconds:.2f} s; "
            f"recall by edit rate: {rates}",
            flush=True,
        )
        if precision < 0.95:
            ok = False
        if name == "minhash" and recall < 0.95:
            ok = False
        if name == "exact" and per_rate[-1.0][0] < 1.0:
            ok = False
    return out, ok


def substring_quality(docs: list[CurateDoc], seed: int) -> tuple[dict, bool]:
    rng = np.random.default_rng(seed)
    hosts = [d.text for d in docs[: 4 * 12]]
    planted = []  # (doc index, byte start, byte end) of repeats that should go
    texts = list(hosts)
    for g, length in enumerate((600, 800, 1000, 1500, 2000, 600, 800, 1000, 1500, 2000, 700, 900)):
        donor = " ".join(docs[-1 - g].text.split())
        span = donor.encode()[:length].decode("utf-8", "ignore")
        members = [4 * g + m for m in range(4)]
        for pos, k in enumerate(members):
            cut = int(rng.integers(0, len(texts[k])))
            while cut < len(texts[k]) and not texts[k][cut].isspace():
                cut += 1
            before = texts[k][:cut].encode()
            texts[k] = texts[k][:cut] + " " + span + " " + texts[k][cut:]
            if pos > 0:  # the first occurrence stays
                start = len(before) + 1
                planted.append((k, start, start + len(span.encode())))
    corpus = [CurateDoc(id=f"d{k}", text=t) for k, t in enumerate(texts)]
    stage = SubstringDedup(min_bytes=500, merge_gap=0, min_chars=0)
    stage.setup()
    partial = stage.observe(corpus)
    plan = stage.plan([partial])[0]
    marked = {k: sum(e - s for s, e in iv) for k, iv in plan.items()}
    hit = 0
    for k, s, e in planted:
        hit += sum(max(0, min(e, b) - max(s, a)) for a, b in plan.get(k, []))
    total_planted = sum(e - s for _, s, e in planted)
    total_marked = sum(marked.values())
    recall = hit / total_planted
    precision = hit / max(1, total_marked)
    print(
        f"[curate] substring dedup (>=500 bytes): recall {recall:.3f} of {total_planted} "
        f"planted repeat bytes, precision {precision:.3f} ({total_marked} bytes marked)",
        flush=True,
    )
    return {"recall": recall, "precision": precision, "bytes": total_planted}, recall >= 0.9


def write_metrics(out: Path, result: dict) -> Path:
    """One JSON row per measured figure (and per planted copy) in `out/metrics.jsonl`."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"kind": "stage", **r} for r in result["stages"]]
    if "pipeline" in result:
        rows.append({"kind": "pipeline", **result["pipeline"]})
    for method, res in result["dedup"].items():
        rows.extend(res["copies"])
        rows.append(
            {
                "kind": "dedup",
                "method": method,
                **{k: v for k, v in res.items() if k not in ("copies", "per_rate")},
            }
        )
    rows.append({"kind": "substring", **result["substring"]})
    path = out / "metrics.jsonl"
    path.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    return path


def plot_dedup(metrics: Path, png: Path, bands: int = 20, rows: int = 5) -> Path:
    """Detection of each planted copy against its true Jaccard, with the LSH S-curve times the
    verification step (J >= 0.75) that MinHash dedup should follow, rendered from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybridlm.curate.dedup import lsh_candidate_probability
    from hybridlm.report.plot import read_metrics

    data = [r for r in read_metrics(metrics) if r.get("kind") == "copy"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    s = np.linspace(0, 1, 201)
    p = lsh_candidate_probability(s, bands, rows)
    ax.plot(s, p, "k--", lw=1, label=f"LSH candidate probability ({bands} x {rows})")
    ax.plot(s, p * (s >= 0.75), "k-", lw=1.5, label="expected removal (candidate and J >= 0.75)")
    rng = np.random.default_rng(0)
    for method, color, dy in (("minhash", "C0", 0.03), ("exact", "C3", -0.03)):
        pts = [r for r in data if r["method"] == method]
        x = np.array([r["jaccard"] for r in pts])
        y = np.array([float(r["caught"]) for r in pts]) + dy + rng.normal(0, 0.01, len(pts))
        ax.scatter(x, y, s=12, color=color, alpha=0.7, label=f"{method} dedup: planted copies")
    ax.set_xlabel("true 5-gram Jaccard similarity of the copy to its source")
    ax.set_ylabel("removed (1) / kept (0)")
    ax.set_ylim(-0.15, 1.15)
    ax.legend(loc="center left", fontsize=8)
    ax.set_title("Dedup of planted near-duplicates")
    return save_figure(fig, png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=600, help="documents for throughput / pipeline")
    p.add_argument("--copies", type=int, default=140, help="planted near-duplicates")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--no-ray", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="")
    p.add_argument("--out", default="", help="folder for metrics.jsonl and dedup_scurve.png")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    name, docs = load_corpus(max(args.docs, args.copies + 60))
    print(
        f"[curate] corpus: {len(docs)} {name} documents, "
        f"{sum(len(d.text) for d in docs) / 1e6:.2f} MB",
        flush=True,
    )
    result: dict = {"corpus": name}
    ok = True
    result["stages"] = stage_throughput(docs[: args.docs])
    if not args.no_ray:
        result["pipeline"], same = pipeline_ratio(docs[: args.docs], args.shards, args.workers)
        ok &= same
    result["dedup"], good = dedup_quality(docs[: args.copies + 60], args.copies, args.seed)
    ok &= good
    result["substring"], good = substring_quality(docs, args.seed)
    ok &= good
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    if args.out:
        metrics = write_metrics(Path(args.out), result)
        png = plot_dedup(metrics, Path(args.out) / "dedup_scurve.png")
        print(f"[curate] wrote {metrics} and {png}", flush=True)
    if not ok:
        print("CHECK FAILED: see the lines above", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
