"""Decontamination recall on planted benchmark copies and false-positive rate on clean text.

    python benchmarks/decon_recall.py [--data DIR] [--items 300] [--clean 500]

Index: GSM8K (train + test) and HumanEval, the packaged copies (`hybridlm.data.builtin`) or
those in `--data`. Planted documents: a benchmark
question (optionally followed by its answer) edited by `hybridlm.curate.decon.edit_text`
(verbatim, format, word_swap, number, two_edits) and embedded between two Shakespeare passages.
Clean documents: tinyshakespeare passages and Python standard-library source files, and (near
domain) GSM8K train problems against an index of the GSM8K test split only. Three
detectors: decon SIMPLE with its defaults, SIMPLE with relaxed thresholds, and the 8-gram >= 0.5
overlap used for post-training data. Prints recall per benchmark x edit, the false-positive rate
and docs/s; exits 1 when verbatim recall < 0.99 or the false-positive rate > 1% for any detector.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from hybridlm.curate.benchmarks import BenchmarkRegistry
from hybridlm.curate.decon import (
    EDITS,
    NgramOverlapDetector,
    SampledNgramDetector,
    SimpleConfig,
    edit_text,
)
from hybridlm.data import builtin
from hybridlm.data.sources import StdlibSource, tinyshakespeare


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="", help="GSM8K / HumanEval / tinyshakespeare folder")
    ap.add_argument("--items", type=int, default=300, help="planted items per benchmark")
    ap.add_argument("--clean", type=int, default=500, help="clean docs per clean corpus")
    ap.add_argument("--near", type=int, default=2000, help="GSM8K train problems as clean text")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    data = Path(args.data) if args.data else None  # None: the packaged data sets
    if data is not None and not data.is_dir():
        print(f"no data folder at {data}; omit --data for the packaged copies", file=sys.stderr)
        return 2
    reg = BenchmarkRegistry.from_data_dir(data)
    shakes = [
        d.text
        for d in tinyshakespeare(builtin.path(builtin.TINYSHAKESPEARE, data), group_chars=2000)
    ]
    stdlib = [d.text for d in StdlibSource(max_files=args.clean)]
    clean = {"shakespeare": shakes[: args.clean], "stdlib": stdlib}
    relaxed = SimpleConfig(
        question_threshold=0.6,
        perfect_below=15,
        interpolate_until=30,
        answer_weight=0.5,
        min_item_tokens=10,
    )
    detectors = {
        "simple (decon defaults)": lambda: SampledNgramDetector(reg),
        "simple (relaxed)": lambda: SampledNgramDetector(reg, relaxed),
        "8-gram overlap >= 0.5": lambda: NgramOverlapDetector(reg),
    }
    failed = False
    print(
        f"index: {len(reg.items)} items ({', '.join(reg.benchmarks)}); planted "
        f"{args.items} per benchmark; clean: "
        + ", ".join(f"{k} {len(v)}" for k, v in clean.items())
    )
    for name, build in detectors.items():
        t0 = time.perf_counter()
        det = build()
        build_s = time.perf_counter() - t0
        print(
            f"\n== {name}: index built in {build_s:.1f} s; not indexed (too short): "
            f"{det.skipped or 'none'}"
        )
        rng = random.Random(args.seed)
        n_docs, t_docs = 0, 0.0
        for bench in reg.benchmarks:
            items = [i for i in det.items if i.benchmark == bench]
            items = rng.sample(items, min(args.items, len(items)))
            for with_answer in (False, True):
                cells = []
                for kind in EDITS:
                    hits = 0
                    for it in items:
                        body = edit_text(it.question, kind, rng)
                        if with_answer:
                            body += "\n" + it.answer
                        doc = rng.choice(shakes)[:600] + "\n" + body + "\n" + rng.choice(shakes)
                        t0 = time.perf_counter()
                        found = det.detect(doc)
                        t_docs += time.perf_counter() - t0
                        n_docs += 1
                        hits += any(m.item_id == it.id for m in found)
                    recall = hits / len(items)
                    cells.append(f"{kind} {recall:.3f}")
                    if kind == "verbatim" and recall < 0.99:
                        failed = True
                label = "question+answer" if with_answer else "question only  "
                print(f"  recall {bench:9s} {label}: " + "  ".join(cells))
        for corpus, docs in clean.items():
            t0 = time.perf_counter()
            flagged = [d for d in docs if det.detect(d)]
            t_docs += time.perf_counter() - t0
            n_docs += len(docs)
            fpr = len(flagged) / len(docs)
            failed |= fpr > 0.01
            print(f"  false positives on {corpus}: {len(flagged)}/{len(docs)} ({fpr:.2%})")
        print(f"  throughput: {n_docs / t_docs:,.0f} docs/s ({n_docs} docs, one thread)")
    # near-domain clean text: GSM8K train problems against an index of the test split only
    test_only = BenchmarkRegistry().add_jsonl(builtin.path(builtin.GSM8K_TEST, data), "gsm8k")
    train = BenchmarkRegistry().add_jsonl(builtin.path(builtin.GSM8K_TRAIN, data), "gsm8k-train")
    near = [it.question + "\n" + it.answer for it in train.items[: args.near]]
    print(f"\n== near-domain clean: {len(near)} GSM8K train problems vs a GSM8K-test index")
    for name, build in (
        ("simple (decon defaults)", lambda: SampledNgramDetector(test_only)),
        ("simple (relaxed)", lambda: SampledNgramDetector(test_only, relaxed)),
        ("8-gram overlap >= 0.5", lambda: NgramOverlapDetector(test_only)),
    ):
        det = build()
        hits = [(t, det.detect(t)) for t in near]
        hits = [(t, m) for t, m in hits if m]
        print(f"  {name}: flagged {len(hits)}/{len(near)} ({len(hits) / len(near):.2%})")
        for text, matches in hits[:2]:
            item = next(i for i in test_only.items if i.id == matches[0].item_id)
            print(f"    train: {text.splitlines()[0][:110]}")
            print(f"    test : {item.question[:110]}  (score {matches[0].score:.3f})")
    print("\nFAIL" if failed else "\nOK: verbatim recall >= 0.99 and false positives <= 1%")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
