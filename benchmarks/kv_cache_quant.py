"""Quantised inference caches vs context length: bits per byte and top-1 next-token accuracy
by position, with the attention KV cache in FP8 (per-tensor or per-head scales) or NVFP4 and
the Mamba state in fp16 / fp16 with stochastic rounding / int16 blocks, each against the same
model with an unquantised cache, paired over the same held-out documents.

    python benchmarks/kv_cache_quant.py [--model runs/speedrun/long_context] [--length 1024]
        [--docs 8] [--bucket 128] [--chunk 1]

Every configuration decodes the documents through the inference cache `chunk` tokens at a time
(1: one token per step, as a server decodes), so each position reads what the cache stored of
the earlier ones. KV scales are calibrated on training rows of the model's own data
(`precision.kv_cache.calibrate_kv`); held-out documents of `--source`. The unquantised cache's
bpb equals the plain forward's (checked here). Writes runs/kv_cache_quant/{results.json,
kv_cache_quant.png} (bpb change by position with paired standard errors, accuracy by position,
cache bytes per token of context).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hybridlm.data.pipeline import build_loaders, build_tokenizer, prepare_shards
from hybridlm.eval.long_context import held_out_documents, position_bpb, position_change
from hybridlm.io import load
from hybridlm.model.cache import HybridCache
from hybridlm.precision.kv_cache import calibrate_kv
from hybridlm.precision.ptq import take
from hybridlm.provenance import collect
from hybridlm.report.plot import pyplot, save_figure
from hybridlm.threads import configure_threads
from hybridlm.train.config import RunConfig

# (name, KV format or "", KV scale granularity, Mamba state precision)
CONFIGS = [
    ("unquantised", "", "tensor", "fp32"),
    ("KV fp8", "fp8", "tensor", "fp32"),
    ("KV fp8 per head", "fp8", "head", "fp32"),
    ("KV nvfp4", "nvfp4", "tensor", "fp32"),
    ("state fp16", "", "tensor", "fp16"),
    ("state fp16-sr", "", "tensor", "fp16-sr"),
    ("state int16-block", "", "tensor", "int16-block"),
    ("KV fp8 + state fp16-sr", "fp8", "tensor", "fp16-sr"),
]


def cache_bytes_per_token(model, spec, fmt: str, granularity: str, state: str, length: int):
    """Bytes the cache holds per sequence after `length` tokens (KV grows, the state does
    not), measured on a real cache."""
    codecs = spec.codecs(fmt, granularity) if fmt else {}
    cache = HybridCache.for_pattern(model.config.pattern, ssm_precision=state, kv_codecs=codecs)
    with torch.no_grad():
        model(torch.zeros(1, length, dtype=torch.long), cache=cache)
    return cache.nbytes()


def study(model, docs, tok, spec, *, length: int, bucket: int, chunk: int = 1) -> dict:
    """Every configuration of `CONFIGS` on `docs` (see the module docstring); `spec`: the
    model's KV calibration."""
    kw = {"length": length, "bucket": bucket, "tokenizer": tok, "batch_size": len(docs)}
    plain = position_bpb(model, docs, **kw)
    results: dict[str, dict] = {}
    for name, fmt, gran, state in CONFIGS:
        codecs = spec.codecs(fmt, gran) if fmt else {}

        def fresh(codecs=codecs, state=state) -> HybridCache:
            return HybridCache.for_pattern(
                model.config.pattern, ssm_precision=state, kv_codecs=codecs
            )

        t0 = time.perf_counter()
        r = position_bpb(model, docs, **kw, cache=fresh, chunk=chunk)
        r["seconds"] = time.perf_counter() - t0
        r["cache_bytes"] = cache_bytes_per_token(model, spec, fmt, gran, state, length)
        r["settings"] = {"kv": fmt or "fp32", "granularity": gran, "state": state}
        results[name] = r
        print(
            f"{name:24s} bpb {r['bpb_all']:.4f}  acc {sum(r['accuracy']) / len(r['accuracy']):.4f}"
            f"  cache {r['cache_bytes'] / 1024:.1f} KiB at {length}  ({r['seconds']:.0f} s)"
        )
    base = results["unquantised"]
    gap = abs(base["bpb_all"] - plain["bpb_all"])
    print(
        f"unquantised cache vs plain forward: bpb {base['bpb_all']:.6f} vs "
        f"{plain['bpb_all']:.6f} (|diff| {gap:.2e})"
    )
    return {
        "length": length,
        "bucket": bucket,
        "chunk": chunk,
        "documents": len(docs),
        "plain_forward_bpb": plain["bpb_all"],
        "results": {
            n: {k: v for k, v in r.items() if k != "per_document"} for n, r in results.items()
        },
        "change_vs_unquantised": {
            n: position_change(base, r) for n, r in results.items() if n != "unquantised"
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/speedrun/long_context")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=1)
    ap.add_argument("--source", default="code", help="held-out documents of this data source")
    ap.add_argument("--calib-batches", type=int, default=2)
    ap.add_argument("--out", default="runs/kv_cache_quant")
    args = ap.parse_args()
    threads = configure_threads(None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    loaded = load(args.model)
    model = loaded.model.float().eval()
    run = RunConfig.from_dict(loaded.meta["run_config"])
    tok = build_tokenizer(run.data)
    docs = [d for d in held_out_documents(run.data, args.source) if len(d) > args.length]
    docs = docs[: args.docs]
    if not docs:
        raise SystemExit(f"no held-out {args.source} document has {args.length + 1} tokens")
    train_loader, _ = build_loaders(run.data, prepare_shards(run.data))
    spec = calibrate_kv(model, take(train_loader, args.calib_batches))
    print(
        f"{args.model}: {len(docs)} documents of >= {args.length + 1} tokens, "
        f"KV calibrated on {spec.tokens} tokens"
    )

    summary = study(
        model, docs, tok, spec, length=args.length, bucket=args.bucket, chunk=args.chunk
    )
    summary |= {
        "model": args.model,
        "source": args.source,
        "kv_calibration_tokens": spec.tokens,
        "provenance": collect(argv=None, threads=threads),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    plot(summary, out / "kv_cache_quant.png")
    print(f"wrote {out / 'results.json'} and {out / 'kv_cache_quant.png'}")


def plot(s: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax, ax_acc, ax_mem) = plt.subplots(1, 3, figsize=(16, 4.6), layout="constrained")
    names = [n for n in s["results"] if n != "unquantised"]
    mid = [b + s["bucket"] / 2 for b in s["results"]["unquantised"]["bucket_start"]]
    for n in names:
        c = s["change_vs_unquantised"][n]
        d, se = c["mean"], c["se"]
        ax.errorbar(mid, d, yerr=[1.96 * e for e in se], marker="o", ms=3, capsize=2, label=n)
    ax.axhline(0, color="k", lw=1)
    ax.set(
        xlabel="target position (tokens)",
        ylabel="bpb change vs unquantised cache",
        title=f"bits per byte by position ({s['documents']} held-out docs, 95% CI paired)",
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    for n in ["unquantised", *names]:
        ax_acc.plot(mid, s["results"][n]["accuracy"], marker="o", ms=3, label=n)
    ax_acc.set(
        xlabel="target position (tokens)",
        ylabel="top-1 next-token accuracy",
        title="accuracy by position",
    )
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(fontsize=7)
    kib = [s["results"][n]["cache_bytes"] / 1024 for n in ["unquantised", *names]]
    ax_mem.barh(["unquantised", *names], kib, color="tab:blue")
    ax_mem.invert_yaxis()
    ax_mem.set(
        xlabel=f"cache KiB per sequence at {s['length']} tokens",
        title="cache memory (KV + Mamba state)",
    )
    for i, v in enumerate(kib):
        ax_mem.text(v, i, f" {v:.0f}", va="center", fontsize=7)
    ax_mem.tick_params(axis="y", labelsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
