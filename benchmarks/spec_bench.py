"""Speculative-decoding benchmark (SPEED-Bench protocol) on models with a trained MTP head.

    python benchmarks/spec_bench.py                         # every trained model present
    python benchmarks/spec_bench.py --checkpoint runs/quickstart --per-category 16
    python benchmarks/spec_bench.py --plot-only             # re-render the PNGs

Models: `--checkpoint` (repeatable), else whichever of `runs/quickstart` (byte-level MEM*EME,
MTP `*E` depth 2, trained on Python standard-library source) and `runs/decode-bench/spec-model`
(byte-level MEM*EME, MTP `*E` depth 3, trained on tinyshakespeare by `benchmarks/decode.py`) are
present; with none, a skip line and exit 0 (train one with `hybridlm pretrain
configs/quickstart.yaml` or `python benchmarks/decode.py --only speculative`).

For each model, `eval.speculative` on `--per-category` prompts of each category (code, math,
writing, chat, repetitive), draft length `--draft-len` (7, SPEED-Bench), `--new-tokens` each,
greedy and T=1: average acceptance length per category and the category mean (standard errors
over prompts), acceptance by draft position, greedy speculative == plain greedy token for token,
and plain vs speculative engine tokens/s, time to first token and inter-token latency measured
in the same run, interleaved. One line per category and an overall line per model; the harness
files (results.json, metrics.jsonl, samples/) and `spec_bench.png` (rendered from metrics.jsonl)
go to `--out/<model name>/`. Exits 1 if any greedy speculative output differs from plain greedy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from hybridlm.eval.harness import EvalConfig, load_model, write_results
from hybridlm.eval.speculative import (
    CATEGORIES,
    SpecBenchConfig,
    SpecBenchTask,
    plot_spec_bench,
    temperature_tag,
)
from hybridlm.eval.tasks import EvalRunner

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS = (REPO / "runs" / "quickstart", REPO / "runs" / "decode-bench" / "spec-model")


def _pm(m: dict, se: dict, key: str) -> str:
    v, e = m.get(key), se.get(key)
    if v is None:
        return "n/a"
    return f"{v:.2f}" + (f" ± {e:.2f}" if e is not None and e == e else "")


def _positions(m: dict, tag: str, cat: str | None, k: int) -> str:
    suffix = f":{cat}" if cat else ""
    return " ".join(f"{m[f'acceptance@{i}:{tag}{suffix}']:.2f}" for i in range(1, k + 1))


def bench_one(path: Path, args: argparse.Namespace) -> bool:
    loaded = load_model(path, dtype=args.dtype)
    model = loaded.model
    if model.mtp is None:
        print(f"[spec_bench] {loaded.name}: skipped, the model has no MTP head")
        return True
    mc = model.config
    spec_cfg = SpecBenchConfig(
        draft_len=args.draft_len,
        new_tokens=args.new_tokens,
        temperatures=args.temperatures,
        prompts_per_category=args.per_category,
        prompt_format=args.prompt_format,
        max_prompt_tokens=args.max_prompt_tokens,
        seed=args.seed,
        timing=not args.no_timing,
        timing_batch_size=args.timing_batch,
        timing_repeats=args.timing_repeats,
    ).validate()
    task = SpecBenchTask(data_dir=Path(args.data_dir) if args.data_dir else None, config=spec_cfg)
    runner = EvalRunner(model=model, tokenizer=loaded.tokenizer, progress=not args.no_progress)
    t0 = time.perf_counter()
    res = task.run(runner)
    secs = time.perf_counter() - t0
    out = Path(args.out) / loaded.name
    eval_cfg = EvalConfig(
        tasks=["spec_bench"],
        data_dir=args.data_dir,
        out_dir=str(out),
        seed=args.seed,
        max_new_tokens=args.new_tokens,
        prompt_format=args.prompt_format,
        progress=False,
    )
    write_results(out, loaded, eval_cfg, {"spec_bench": (res, secs)})
    plot_spec_bench(out / "metrics.jsonl", out / "spec_bench.png")

    m, se, k = res.metrics, res.stderr, args.draft_len
    tags = [temperature_tag(t) for t in args.temperatures]
    n = args.per_category
    print(
        f"[spec_bench] {loaded.name} ({len(mc.pattern)} blocks {mc.pattern}, d {mc.d_model},"
        f" MTP {mc.mtp.pattern!r} trained to depth {mc.mtp.depth}; {args.dtype},"
        f" {torch.get_num_threads()} threads): draft length {k}, {n} prompts x"
        f" {len(CATEGORIES)} categories, {args.new_tokens} new tokens, {secs:.0f} s"
    )
    for cat in CATEGORIES:
        parts = [
            f"AL {tag} {_pm(m, se, f'acceptance_length:{tag}:{cat}')}"
            f" (by position {_positions(m, tag, cat, k)})"
            for tag in tags
        ]
        print(f"[spec_bench]   {cat:10s} " + " | ".join(parts))
    checked = n * len(CATEGORIES)
    line = " | ".join(
        f"AL {tag} {_pm(m, se, f'acceptance_length:{tag}')}"
        f" (pooled {_pm(m, se, f'acceptance_length_pooled:{tag}')};"
        f" by position {_positions(m, tag, None, k)};"
        f" distinct 4-grams {m[f'distinct_4grams:{tag}']:.2f})"
        for tag in tags
    )
    line += f" | greedy spec != plain: {int(m.get('greedy_mismatches', 0))}/{checked}"
    ok = m.get("greedy_mismatches", 0) == 0
    if "speedup" in m:
        ok &= m["engine_greedy_mismatches"] == 0
        line += (
            f" (engine {int(m['engine_greedy_mismatches'])}/{checked * args.timing_repeats})"
            f" | engine batch {args.timing_batch}, greedy: plain"
            f" {m['tokens_per_s:plain']:.0f} tok/s, speculative"
            f" {m['tokens_per_s:speculative']:.0f} tok/s, speedup {m['speedup']:.2f}x,"
            f" TTFT ratio {m['ttft_ratio']:.2f}, ITL ratio {m['itl_ratio']:.2f}"
        )
    print(f"[spec_bench]   {'overall':10s} (mean of categories) " + line)
    print(f"[spec_bench]   wrote {out / 'results.json'} and {out / 'spec_bench.png'}")
    return ok


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", action="append", default=[], help="repeatable")
    p.add_argument("--out", default=str(REPO / "runs" / "spec-bench"))
    p.add_argument(
        "--data-dir", default="", help="GSM8K / tinyshakespeare folder (default: packaged copies)"
    )
    p.add_argument("--per-category", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--draft-len", type=int, default=7)
    p.add_argument("--temperatures", type=_floats, default=[0.0, 1.0])
    p.add_argument("--prompt-format", choices=("base", "chat"), default="base")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    p.add_argument("--no-timing", action="store_true", help="skip the engine speed comparison")
    p.add_argument("--timing-batch", type=int, default=1, help="concurrent engine requests")
    p.add_argument("--timing-repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--plot-only", action="store_true", help="re-render PNGs from metrics.jsonl")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.plot_only:
        for metrics in sorted(Path(args.out).glob("*/metrics.jsonl")):
            png = plot_spec_bench(metrics, metrics.parent / "spec_bench.png")
            print(f"[spec_bench] {png or 'no spec_bench rows in ' + str(metrics)}")
        return 0
    paths = [Path(c) for c in args.checkpoint] or [p for p in DEFAULT_MODELS if p.is_dir()]
    if not paths:
        print(
            "[spec_bench] skipped: no model with a trained MTP head (looked for "
            + ", ".join(str(p) for p in DEFAULT_MODELS)
            + "); train one with `hybridlm pretrain configs/quickstart.yaml` or"
            " `python benchmarks/decode.py --only speculative`, or pass --checkpoint"
        )
        return 0
    ok = True
    try:
        for path in paths:
            ok &= bench_one(path, args)
    except ValueError as err:
        print(f"[spec_bench] error: {err}", file=sys.stderr)
        return 2
    if not ok:
        print("CHECK FAILED: greedy speculative output differs from plain greedy decoding")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
