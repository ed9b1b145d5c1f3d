"""`hybridlm curate | quality-train | upsample-curve | decon | decon-code-eval | mix | shard`:
pretraining data curation and mixtures (curate/), tokenised shards (data/shards.py)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    """Add the data commands to the CLI's sub-command parsers."""
    p = sub.add_parser("curate", help="curate pretraining text: filters, language ID, dedup")
    p.add_argument(
        "--config",
        default=None,
        help="curate YAML (default: configs/curate.yaml when present, else built-in)",
    )
    p.add_argument("--output", default=None, help="output folder (overrides output_dir)")
    p.add_argument("--executor", choices=["local", "ray"], default=None)
    p.add_argument("--ray-address", default=None, help="Ray cluster address; default: local")
    p.add_argument("--num-cpus", type=int, default=None, help="local Ray instance CPUs")
    p.add_argument("--workers", type=int, default=None, help="concurrent shard tasks on Ray")
    p.add_argument("--no-resume", action="store_true", help="redo every shard")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=cmd_curate)

    p = sub.add_parser(
        "quality-train", help="train a fastText-style quality/topic classifier (numpy-2 safe)"
    )
    p.add_argument("--pos", nargs="*", default=[], help="positive files (JSONL or text)")
    p.add_argument("--neg", nargs="*", default=[], help="negative files (JSONL or text)")
    p.add_argument("--pos-label", default="high")
    p.add_argument("--neg-label", default="low")
    p.add_argument("--text-field", default="text", help="JSONL field (dotted ok)")
    p.add_argument("--split", default="line", choices=["line", "blank_line", "file"])
    p.add_argument(
        "--example",
        nargs="?",
        const="",
        metavar="DATA_DIR",
        help="train the GSM8K/HumanEval/Shakespeare vs synthetic-junk example instead, on the "
        "packaged data sets or those in DATA_DIR",
    )
    p.add_argument("--per-source", type=int, default=1500)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--char-ngrams", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--test-fraction", type=float, default=0.2)
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(fn=cmd_quality_train)

    p = sub.add_parser("upsample-curve", help="fit quality-aware up-sampling curves; plot them")
    p.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="TOPIC=MEAN",
        help="mean repetition of a topic (its token target / its pool tokens); repeatable",
    )
    p.add_argument("--shape", choices=["exp", "power", "linear"], default="exp")
    p.add_argument("--steepness", type=float, default=4.0)
    p.add_argument("--drop-below", type=float, default=0.0, help="quality percentile in [0, 1)")
    p.add_argument("--max-factor", type=float, default=7.0)
    p.add_argument("--buckets", type=int, default=20)
    p.add_argument(
        "--out",
        default="runs/upsample",
        help="folder for curves.jsonl and curves.png (default: runs/upsample, kept out of git)",
    )
    p.set_defaults(fn=cmd_upsample_curve)

    p = sub.add_parser("decon", help="benchmark decontamination of a JSONL corpus")
    p.add_argument("--input", required=True, help="JSON Lines documents")
    p.add_argument("--text-field", default="text")
    p.add_argument(
        "--data-dir",
        help="folder with gsm8k/ and humaneval/ (default, without --benchmark: the packaged "
        "GSM8K train + test and HumanEval)",
    )
    p.add_argument(
        "--benchmark",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="extra JSONL benchmark with question/answer fields (repeatable)",
    )
    p.add_argument(
        "--method",
        choices=["simple", "overlap", "embedding"],
        default="simple",
        help="simple: decon sampled 5-grams; overlap: 8-gram >= 0.5 (post-training); "
        "embedding: code functions with cosine >= 0.8 to a HumanEval function",
    )
    p.add_argument("--embedding-backend", choices=["hashed", "minilm"], default="hashed")
    p.add_argument(
        "--embedding-model",
        default=None,
        help="the minilm backend's sentence-transformers model: a Hub id already in the local "
        "cache (fetch once: hf download ID) or a directory; never downloaded (default "
        "sentence-transformers/all-MiniLM-L6-v2)",
    )
    p.add_argument("--embedding-threshold", type=float, default=0.8)
    p.add_argument("--report", default="decon_report.json")
    p.add_argument("--clean-out", help="write the clean documents here (JSONL)")
    p.set_defaults(fn=cmd_decon)

    p = sub.add_parser(
        "decon-code-eval",
        help="recall on planted HumanEval solutions / false positives on stdlib functions of "
        "code-embedding decontamination",
    )
    add_decon_code_eval_args(p)
    p.set_defaults(fn=cmd_decon_code_eval)

    p = sub.add_parser("mix", help="swarm mixture optimisation -> a mixture (DataConfig) YAML")
    p.add_argument("--data", required=True, help="a DataConfig YAML (its sources and weights)")
    p.add_argument("--out", required=True, help="output folder (swarm.jsonl, mixture.yaml)")
    p.add_argument("--proxy", choices=["bigram", "trainer"], default="trainer")
    p.add_argument("--runs", type=int, default=0, help="swarm size (0: 5 x sources)")
    p.add_argument("--steps", type=int, default=30, help="trainer proxy: steps per run")
    p.add_argument("--model", default="tiny-super", help="trainer proxy: model preset")
    p.add_argument("--budget", type=int, default=20_000, help="bigram proxy: training tokens")
    p.add_argument(
        "--regression", choices=["quadratic", "loglinear", "linear"], default="quadratic"
    )
    p.add_argument(
        "--total-tokens",
        type=float,
        default=0.0,
        help="training budget for the repetition caps (0: no caps)",
    )
    p.add_argument("--max-repetition", type=float, default=4.0)
    p.add_argument(
        "--phase2-weights",
        default="",
        metavar="NAME=W,...",
        help="also write curriculum.yaml: the optimum, then this blend for the last tokens",
    )
    p.add_argument(
        "--phase2-task-weights",
        default="",
        metavar="TASK=W,...",
        help="also write curriculum.yaml with phase 2 = the optimum under these task weights",
    )
    p.add_argument("--phase2-fraction", type=float, default=0.2, help="share of phase 2")
    p.set_defaults(fn=cmd_mix)

    p = sub.add_parser(
        "shard",
        help="tokenise text (default: the embedded stdlib corpus) into memory-mapped shards; "
        "prints throughput",
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--text", nargs="*", help="text files / folders (default: the stdlib)")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer directory")
    p.add_argument("--train-vocab", type=int, default=0, help="train a BPE of this size")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--shard-chars", type=int, default=1 << 26)
    p.set_defaults(fn=cmd_shard, uses_torch=False)  # numpy + tokenizers only


def add_decon_code_eval_args(p: argparse.ArgumentParser) -> None:
    """The flags of `hybridlm decon-code-eval`."""
    p.add_argument(
        "--data-dir",
        default="",
        help="folder with humaneval/HumanEval.jsonl.gz (default: the packaged copy)",
    )
    p.add_argument("--backend", action="append", choices=["hashed", "minilm"], default=None)
    p.add_argument("--embedding-model", default=None, help="the minilm backend's model (see decon)")
    p.add_argument(
        "--normalize", action="append", choices=["none", "format", "canonical"], default=None
    )
    p.add_argument("--threshold", type=float, default=0.8)
    p.add_argument("--min-tokens", type=int, default=24)


# ---------------------------------------------------------------------------- handlers
def cmd_curate(args: argparse.Namespace) -> None:
    """Run `hybridlm curate` and print the per-stage summary."""
    import dataclasses
    from pathlib import Path

    from ..curate.pipeline import CurateConfig, run_curate

    path = args.config
    if path is None and Path("configs/curate.yaml").is_file():
        path = "configs/curate.yaml"
    cfg = CurateConfig.load(path) if path else CurateConfig()
    changes: dict[str, Any] = {}
    if args.output:
        changes["output_dir"] = args.output
    if args.executor:
        changes["executor"] = args.executor
    if args.ray_address is not None:
        changes["ray_address"] = args.ray_address
    if args.num_cpus is not None:
        changes["ray_num_cpus"] = args.num_cpus
    if args.workers is not None:
        changes["num_workers"] = args.workers
    if args.no_resume:
        changes["resume"] = False
    if args.no_progress:
        changes["progress"] = False
    cfg = dataclasses.replace(cfg, **changes)
    report = run_curate(cfg)
    d = report.data
    print(
        f"read {d['read']['documents']} documents ({d['read']['skipped']} skipped by the readers: "
        "empty, undecodable, malformed or huge; reasons in the report)"
    )
    for e in d["stages"]:
        print(
            f"  {e['index']:>2} {e['stage']:<18} {e['docs_in']:>8} -> {e['docs_out']:<8} "
            f"{e['seconds']:7.2f} s"
        )
    exp = d["output"]["expansion"]
    if exp["enabled"]:
        print(
            f"repeats expanded: {exp['docs_before']} -> {exp['docs_after']} documents, "
            f"{exp['chars_before']} -> {exp['chars_after']} characters"
        )
    print(
        f"kept {report.docs_out} documents in {d['output']['dir']} "
        f"(shards run {report.shards_run}, skipped {report.shards_skipped}); "
        f"report: {Path(cfg.output_dir) / 'report.md'}"
    )


def cmd_quality_train(args: argparse.Namespace) -> None:
    """Train a quality (or topic) classifier and report its held-out accuracy."""
    from ..curate.quality import (
        ClassifierConfig,
        FastTextClassifier,
        example_quality_data,
        read_texts,
        train_test_split,
    )

    if args.example is not None:
        texts, labels = example_quality_data(args.example or None, per_source=args.per_source)
    else:
        if not args.pos or not args.neg:
            raise ValueError("give --pos and --neg files (or --example [DATA_DIR])")
        texts, labels = [], []
        for files, label in ((args.pos, args.pos_label), (args.neg, args.neg_label)):
            for f in files:
                docs = read_texts(f, text_field=args.text_field, split=args.split)
                texts += docs
                labels += [label] * len(docs)
    cfg = ClassifierConfig(
        dim=args.dim,
        epochs=args.epochs,
        lr=args.lr,
        min_char=args.char_ngrams[0] if args.char_ngrams else 0,
        max_char=args.char_ngrams[1] if args.char_ngrams else 0,
    )
    tr_x, tr_y, te_x, te_y = train_test_split(texts, labels, test_fraction=args.test_fraction)
    clf = FastTextClassifier.train_model(tr_x, tr_y, cfg, progress=True)
    clf.save(args.out)
    acc = clf.accuracy(te_x, te_y)
    counts = {lab: tr_y.count(lab) for lab in clf.labels}
    print(
        f"trained on {len(tr_x)} documents {counts}; held-out accuracy {acc:.4f} "
        f"on {len(te_x)}; saved to {args.out}"
    )


def cmd_upsample_curve(args: argparse.Namespace) -> None:
    """Fit one curve per `--target topic=mean_repetition`, write curves.jsonl and the PNG."""
    from pathlib import Path

    from ..curate.upsample import CurveConfig, UpsampleCurve, plot_curves, write_curves

    cfg = CurveConfig(
        shape=args.shape,
        steepness=args.steepness,
        drop_below=args.drop_below,
        max_factor=args.max_factor,
        num_buckets=args.buckets,
    )
    curves = {}
    for spec in args.target:
        topic, _, mean = spec.partition("=")
        try:
            curves[topic] = UpsampleCurve.fit_mean(float(mean), cfg)
        except ValueError as err:
            raise ValueError(f"--target {spec}: {err}") from None
    out = Path(args.out)
    jsonl = write_curves(curves, out / "curves.jsonl")
    png = plot_curves(jsonl, out / "curves.png")
    for topic, curve in curves.items():
        rates = " ".join(f"{r:.2f}" for r in curve.rates())
        print(f"{topic}: mean {curve.mean():.4f}, bucket rates {rates}")
    print(f"wrote {jsonl} and {png}")


def cmd_decon(args: argparse.Namespace) -> None:
    """Decontaminate a JSON Lines file against the benchmark registry; writes the report and
    (optionally) the clean documents."""
    import json

    from ..curate.benchmarks import BenchmarkRegistry
    from ..curate.decon import NgramOverlapDetector, SampledNgramDetector, decontaminate

    extra = []
    for spec in args.benchmark:
        name, _, path = spec.partition("=")
        if not path:
            raise ValueError(f"--benchmark takes NAME=FILE.jsonl, got {spec!r}")
        extra.append({"name": name, "path": path})
    # neither --data-dir nor --benchmark: the packaged GSM8K + HumanEval
    reg = BenchmarkRegistry.build(args.data_dir, extra)
    if not reg.items:
        raise ValueError("no benchmarks: give --data-dir and/or --benchmark NAME=FILE")
    det: Any
    if args.method == "simple":
        det = SampledNgramDetector(reg)
    elif args.method == "overlap":
        det = NgramOverlapDetector(reg)
    else:
        from ..curate.embed import MINILM_MODEL, CodeEmbeddingDetector, EmbedDeconConfig

        det = CodeEmbeddingDetector(
            reg,
            EmbedDeconConfig(
                backend=args.embedding_backend,
                threshold=args.embedding_threshold,
                model=args.embedding_model or MINILM_MODEL,
            ),
        )
    from ..data.sources import JsonlSource

    docs = [(d.id, d.text) for d in JsonlSource(args.input, text_field=args.text_field)]
    clean, report = decontaminate(docs, det)
    report.write(args.report)
    if args.clean_out:
        keep = set(clean)
        with open(args.clean_out, "w") as f:
            for doc_id, text in docs:
                if doc_id in keep:
                    f.write(json.dumps({"id": doc_id, "text": text}) + "\n")
    summary = {b: (r["documents"], len(r["items"])) for b, r in report.per_benchmark.items()}
    print(
        f"{report.contaminated}/{report.documents} documents contaminated; per benchmark "
        f"(documents, items): {summary}; report: {args.report}"
    )


def cmd_decon_code_eval(args: argparse.Namespace) -> None:
    """Print one JSON line of recall / false positives per backend and normalisation."""
    import json

    from ..curate.benchmarks import BenchmarkRegistry
    from ..curate.embed import (
        MINILM_MODEL,
        CodeEmbeddingDetector,
        EmbedDeconConfig,
        measure_code_decon,
        stdlib_functions,
    )

    reg = BenchmarkRegistry.from_data_dir(args.data_dir)
    negatives = stdlib_functions()
    for backend in args.backend or ["hashed"]:
        for norm in args.normalize or ["canonical"]:
            cfg = EmbedDeconConfig(
                backend=backend,
                threshold=args.threshold,
                normalize=norm,
                min_tokens=args.min_tokens,
                model=args.embedding_model or MINILM_MODEL,
            )
            det = CodeEmbeddingDetector(reg, cfg)
            res = measure_code_decon(det, reg, negatives=negatives, progress=True)
            print(json.dumps(res))


def cmd_mix(args: argparse.Namespace) -> None:
    """Swarm -> regression -> optimised mixture file, for the sources of a data config."""
    from ..curate.mixing import run_mix

    res = run_mix(
        args.data,
        args.out,
        proxy=args.proxy,
        runs=args.runs,
        steps=args.steps,
        model=args.model,
        budget=args.budget,
        regression=args.regression,
        total_tokens=args.total_tokens,
        max_repetition=args.max_repetition,
        phase2_weights=args.phase2_weights,
        phase2_task_weights=args.phase2_task_weights,
        phase2_fraction=args.phase2_fraction,
    )
    cur = res["curriculum"]
    if cur is not None:
        print(
            f"curriculum: phase 1 {cur.phases[0].weights} for {cur.phases[0].fraction:.0%}, "
            f"phase 2 {cur.phases[1].weights}; wrote {res['curriculum_path']}"
        )
    print(f"swarm of {res['runs']} runs; regression R^2 (in-sample) {res['r2']}")
    print(
        f"optimised weights { ({k: round(v, 4) for k, v in res['weights'].items()}) }; predicted "
        f"mean loss {res['objective']:.4f}; wrote {res['mixture']}"
    )


def cmd_shard(args: argparse.Namespace) -> None:
    """Shard the text (a BPE trained on it with --train-vocab) and print throughput."""
    import time

    from ..data.bpe import train_bpe
    from ..data.shards import shard_text, text_source

    paths = args.text or ()
    tokenizer = args.tokenizer
    if args.train_vocab:
        t0 = time.perf_counter()
        tokenizer = train_bpe(text_source(paths), vocab_size=args.train_vocab)
        print(f"trained BPE vocab {tokenizer.vocab_size} in {time.perf_counter() - t0:.1f} s")
    report = shard_text(
        args.out,
        paths,
        tokenizer=tokenizer,
        num_workers=args.workers,
        shard_chars=args.shard_chars,
    )
    print(
        f"{report.num_documents} docs, {report.num_tokens} tokens, {report.seconds:.2f} s: "
        f"{report.docs_per_second:.0f} docs/s, {report.tokens_per_second:.0f} tokens/s "
        f"({args.workers} workers; {report.shards_written} written, {report.shards_reused} reused)"
    )
