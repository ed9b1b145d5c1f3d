"""Initialising the shared MTP head, then its warm-up (Nemotron 3.5 §1, §2.1): speculative
acceptance of each initialisation before and after the same warm-up, on one backbone.

    hybridlm pretrain --config runs/speedrun/pretrain/run.yaml --set model.mtp.shared=false \\
        --set train.out_dir=runs/mtp_init/pretrain_per_depth
    python benchmarks/mtp_init.py [--per-depth runs/mtp_init/pretrain_per_depth]
        [--shared runs/speedrun/pretrain] [--steps 300]

The per-depth run is the speedrun's pretraining with one MTP head per depth (`mtp.shared:
false`) instead of one shared head; everything else (data, steps, seed) is the same. On its
backbone the shared head is initialised four ways (`train.mtp_init`): consolidating the two
trained heads by averaging or by keeping the first (Super), fusing a head out of the backbone's
tail (Lightning), or drawing it at random. Each is then warmed up by the same `hybridlm
mtp-boost` run with `data: text` (backbone frozen, 1,024 windows of 144 tokens of the
pretraining data, hidden-state mixing, distillation from the backbone). The speedrun's
shared-head pretraining (the Nemotron 3 Super recipe) is the reference, with the same warm-up.

Measured per variant: teacher-forced greedy agreement by depth on the held-out prompts' greedy
continuations (for the per-depth heads the only measure: they cannot draft), and speculative
acceptance length at draft length `draft_len`, greedy and T=1, before and after the warm-up,
with standard errors over prompts. Writes runs/mtp_init/{results.json, mtp_init.png} and each
warm-up's run directory runs/mtp_init/<variant>/.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from hybridlm.provenance import collect
from hybridlm.report.plot import pyplot, save_figure
from hybridlm.threads import configure_threads
from hybridlm.train.mtp_boost import (
    MTPBoostConfig,
    MTPBoostDataConfig,
    MTPBoostRunConfig,
    MTPBoostTrainConfig,
    boost_checkpoint,
)

# (name, which pretraining, init, consolidate)
VARIANTS = [
    ("shared head (trained)", "shared", "keep", "average"),
    ("consolidate: average", "per_depth", "consolidate", "average"),
    ("consolidate: first", "per_depth", "consolidate", "first"),
    ("fuse (tail + projection)", "per_depth", "fuse", "average"),
    ("random", "per_depth", "random", "average"),
]


def prompt_acceptance(row: dict) -> tuple[float, float]:
    """Acceptance length (tokens per verify step) and its standard error over prompts."""
    per = []
    for accepted, drafted in row["by_prompt"]:
        steps = max(drafted[0], 1)  # every round drafts at least one token
        per.append(1.0 + sum(accepted) / steps)
    n = len(per)
    mean = sum(per) / n
    var = sum((x - mean) ** 2 for x in per) / max(n - 1, 1)
    return row["acceptance_length"], math.sqrt(var / n)


def summarise(name: str, source: str, init: str, res: dict, metrics: Path) -> dict:
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    agree = {r["when"]: r for r in rows if r.get("kind") == "agreement"}
    out = {
        "variant": name,
        "pretraining": source,
        "init": init,
        "agreement": {
            w: {"by_depth": r["agreement_by_depth"], "chain_length": r["chain_length"]}
            for w, r in agree.items()
        },
        "fuse_relative_residual": agree.get("init", {}).get("fuse_relative_residual"),
        "acceptance": {},
        "generation_s": res["generation_s"],
        "train_s": res["train_s"],
    }
    for when in ("before", "after"):
        for r in res[when]:
            al, se = prompt_acceptance(r)
            out["acceptance"][f"{when} T={r['temperature']:g}"] = {
                "acceptance_length": al,
                "se": se,
                "by_position": r["acceptance_by_position"],
            }
    return out


def plot(results: list[dict], path: Path) -> None:
    plt = pyplot()
    temps = sorted({k.split("T=")[1] for r in results for k in r["acceptance"]})
    fig, axes = plt.subplots(1, len(temps) + 1, figsize=(5.2 * (len(temps) + 1), 4.2))
    names = [r["variant"] for r in results]
    x = range(len(results))
    for ax, t in zip(axes, temps, strict=False):
        for off, when, color in ((-0.18, "before", "tab:gray"), (0.18, "after", "tab:blue")):
            vals = [r["acceptance"][f"{when} T={t}"] for r in results]
            ax.bar(
                [i + off for i in x],
                [v["acceptance_length"] for v in vals],
                width=0.36,
                yerr=[v["se"] for v in vals],
                color=color,
                label=f"{when} warm-up",
            )
        ax.set_xticks(list(x), names, rotation=25, ha="right", fontsize=8)
        ax.set(
            title=f"speculative acceptance, T={t}", ylabel="tokens per verify step", ylim=(1, None)
        )
        ax.legend(fontsize=8)
    ax = axes[-1]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for r, color in zip(results, colors, strict=False):
        for when, style in (("init", "--"), ("after", "-")):
            d = r["agreement"].get(when) or (r["agreement"]["source"] if when == "init" else None)
            if d is not None:
                label = r["variant"] if when == "after" else None
                depths = range(1, len(d["by_depth"]) + 1)
                ax.plot(depths, d["by_depth"], style, color=color, marker="o", label=label)
    per_depth = next((r for r in results if r["pretraining"] == "per_depth"), None)
    if per_depth is not None:  # the per-depth heads themselves, each at its own depth
        d = per_depth["agreement"]["source"]["by_depth"]
        ax.plot(range(1, len(d) + 1), d, ":", color="black", marker="s", label="per-depth heads")
    ax.set_xticks(range(1, max(len(r["agreement"]["after"]["by_depth"]) for r in results) + 1))
    ax.set(
        title="teacher-forced agreement (dashed: initialised, solid: after warm-up)",
        xlabel="MTP depth",
        ylabel="head argmax = backbone argmax",
        ylim=(0, 1),
    )
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="lower left")
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-depth", default="runs/mtp_init/pretrain_per_depth")
    ap.add_argument("--shared", default="runs/speedrun/pretrain")
    ap.add_argument("--out", default="runs/mtp_init")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-prompts", type=int, default=24)
    ap.add_argument("--variants", default="", help="comma-separated subset of variant indices")
    ap.add_argument("--plot-only", action="store_true", help="re-render OUT/results.json")
    args = ap.parse_args()
    threads = configure_threads(None)
    out = Path(args.out)
    if args.plot_only:
        plot(json.loads((out / "results.json").read_text())["results"], out / "mtp_init.png")
        return
    for path in (args.per_depth, args.shared):
        if not Path(path).exists():
            raise SystemExit(f"{path} does not exist: run the pretraining in the docstring first")
    picks = [int(i) for i in args.variants.split(",")] if args.variants else range(len(VARIANTS))
    results = []
    for i in picks:
        name, source, init, consolidate = VARIANTS[i]
        checkpoint = args.per_depth if source == "per_depth" else args.shared
        run = out / f"variant_{i}"
        cfg = MTPBoostRunConfig(
            train=MTPBoostTrainConfig(
                max_steps=args.steps, lr=1e-3, init_from=str(checkpoint), out_dir=str(run)
            ),
            data=MTPBoostDataConfig(
                kind="text",  # the warm-up trains on the pretraining data (Nemotron 3.5 §2.1)
                num_sequences=1024,
                gen_len=80,
                eval_prompts=args.eval_prompts,
            ),
            mtp_boost=MTPBoostConfig(
                eval_new_tokens=64, draft_len=3, init=init, consolidate=consolidate
            ),
        )
        res = boost_checkpoint(cfg, progress=False, overwrite=True)
        results.append(summarise(name, source, init, res, run / "metrics.jsonl"))
        r = results[-1]
        acc = " ".join(
            f"{k} {v['acceptance_length']:.2f}±{v['se']:.2f}" for k, v in r["acceptance"].items()
        )
        print(f"{name}: {acc}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "results": results,
        "per_depth": args.per_depth,
        "shared": args.shared,
        "steps": args.steps,
        "provenance": collect(argv=None, threads=threads),
    }
    (out / "results.json").write_text(json.dumps(report, indent=1))
    plot(results, out / "mtp_init.png")
    print(f"wrote {out / 'results.json'} and {out / 'mtp_init.png'}")


if __name__ == "__main__":
    main()
