"""NVFP4 training study: the same tiny hybrid model on the same tokens, high precision vs the
Nemotron 3 Super §2.2 NVFP4 recipe (emulated), with the trainer's own loop.

    python benchmarks/nvfp4_training.py                    # ~2-4 min on 2 CPU cores
    python benchmarks/nvfp4_training.py --steps 40 --out /tmp/study --max-gap 0.08

Both runs use `hybridlm.train.run_pretrain` with identical RunConfigs (seed, data order,
schedule) except `train.low_precision`: "none" (baseline) vs "nvfp4" (NVFP4 GEMMs with 2-D
weight blocks, RHT + stochastic rounding on gradients, MXFP8 Mamba out_proj, the §2.2 layers
kept in high precision). The baseline runs in fp32: this CPU (AVX2 only) emulates bf16 GEMMs
~16x slower than fp32, and the quantisation error studied here (4-bit elements) is ~30x larger
than bf16's. Both runs log zero-weight-gradient fractions (§2.3) every `log_interval` steps.

Prints one line: final train loss (mean of the last 5 logged steps) and held-out loss of each
run, the relative held-out gap, and the zero-wgrad fraction of the NVFP4-quantised weights in
both runs. Renders `<out>/nvfp4_training.png` from the two metrics.jsonl files. Exits 1 if
either run is not finite or the relative held-out gap exceeds `--max-gap`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from hybridlm.report.plot import save_figure


def study_config(out: Path, *, steps: int, low_precision: str, seq_len: int, batch: int):
    from hybridlm.data.config import DataConfig, SourceConfig
    from hybridlm.presets import get_preset
    from hybridlm.train.config import RunConfig, TrainConfig

    m = get_preset("tiny-super")  # the quickstart shape, narrower: MEM*EME + MTP *E
    m.vocab_size, m.d_model, m.pattern = 258, 96, "MEM*EME"
    m.mamba.num_heads, m.mamba.head_dim, m.mamba.state_size = 3, 64, 32
    m.mamba.n_groups, m.mamba.chunk_size = 1, 64
    m.attention.num_heads, m.attention.num_kv_heads, m.attention.head_dim = 4, 2, 24
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 8, 2, 64
    m.moe.latent_size, m.moe.shared_expert_hidden, m.moe.routed_scaling_factor = 48, 192, 2.5
    m.mtp.pattern, m.mtp.depth, m.mtp.loss_weight = "*E", 1, 0.3
    m.validate()
    data = DataConfig(
        sources=[SourceConfig(name="stdlib", kind="stdlib")],
        tokenizer="byte",
        shards_dir=str(out / "shards"),
        num_workers=0,
        seq_len=seq_len,
        batch_size=batch,
        eval_split="hash",
        eval_fraction=0.02,
        eval_docs=8,
    )
    train = TrainConfig(
        lr=3e-3,
        min_lr=3e-5,
        warmup_steps=max(1, steps // 10),
        decay_fraction=0.2,
        max_steps=steps,
        log_interval=max(1, steps // 25),
        eval_interval=0,
        eval_batches=4,
        checkpoint_interval=0,
        keep_last_n=1,
        out_dir=str(out / low_precision.replace("none", "fp32")),
        seed=0,
        peak_flops=1e11,
        plot=False,
        low_precision=low_precision,
        monitor_zero_grads=True,
    )
    return RunConfig(model=m, data=data, train=train)


def _weighted_zero_frac(row: dict, numel: dict[str, int], names: list[str]) -> float:
    zero = row["zero_wgrad"]
    tot = sum(numel[n] for n in names if n in zero)
    return sum(zero[n] * numel[n] for n in names if n in zero) / max(1, tot)


def summarize(out: Path, cfg) -> dict:
    """Figures of the two runs under `out` (read back from their metrics.jsonl)."""
    from hybridlm.model.model import HybridLM
    from hybridlm.precision.policy import PrecisionPolicy, assign_formats
    from hybridlm.report.plot import read_metrics

    with torch.device("meta"):
        model = HybridLM(cfg.model)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    plan = assign_formats(model, PrecisionPolicy())
    quantised = []
    for name, module, row in plan:
        if row.format != "bf16":
            quantised += [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
    res: dict = {"quantised_tensors": len(quantised)}
    for run in ("fp32", "nvfp4"):
        rows = read_metrics(out / run / "metrics.jsonl")
        train = [r for r in rows if r["kind"] == "train"]
        evals = [r for r in rows if r["kind"] == "eval"]
        tail = train[-5:]
        zero = [_weighted_zero_frac(r, numel, quantised) for r in train if "zero_wgrad" in r]
        res[run] = {
            "final_train_loss": sum(r["loss"] for r in tail) / len(tail),
            "eval_loss": evals[-1]["eval_loss"] if evals else math.nan,
            "zero_wgrad_frac_quantised": zero[-1] if zero else math.nan,
            "zero_wgrad_frac_quantised_mean": sum(zero) / len(zero) if zero else math.nan,
            "skipped_steps": train[-1]["skipped_steps"],
        }
        if run == "nvfp4":
            res[run]["nvfp4_underflow_frac"] = train[-1].get("nvfp4_underflow_frac", math.nan)
    b, q = res["fp32"]["eval_loss"], res["nvfp4"]["eval_loss"]
    res["relative_gap"] = (q - b) / b
    return res


def plot_study(out: Path, cfg, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybridlm.model.model import HybridLM
    from hybridlm.precision.policy import PrecisionPolicy, assign_formats
    from hybridlm.report.plot import read_metrics

    with torch.device("meta"):
        model = HybridLM(cfg.model)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    quantised = [
        f"{name}.{p}"
        for name, module, row in assign_formats(model, PrecisionPolicy())
        if row.format != "bf16"
        for p, _ in module.named_parameters(recurse=False)
    ]
    fig, (ax, ax_z) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[3, 2])
    for run, color in (("fp32", "C0"), ("nvfp4", "C3")):
        rows = read_metrics(out / run / "metrics.jsonl")
        train = [r for r in rows if r["kind"] == "train"]
        evals = [r for r in rows if r["kind"] == "eval"]
        label = "fp32 baseline" if run == "fp32" else "NVFP4 recipe (emulated)"
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], c=color, lw=1, label=label)
        if evals:
            ax.plot(evals[-1]["step"], evals[-1]["eval_loss"], "o", c=color, label=f"{run} eval")
        zs = [(r["step"], _weighted_zero_frac(r, numel, quantised)) for r in train]
        ax_z.plot(*zip(*zs, strict=True), c=color, lw=1, label=f"{run}")
        if run == "nvfp4":
            under = [(r["step"], r["nvfp4_underflow_frac"]) for r in train]
            ax_z.plot(*zip(*under, strict=True), c=color, ls="--", lw=1, label="NVFP4 underflow")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title("Same model, same tokens: fp32 vs NVFP4 training (Nemotron 3 Super §2.2)")
    ax.legend()
    ax.grid(alpha=0.3)
    ax_z.set_ylabel("fraction")
    ax_z.set_xlabel("step")
    ax_z.set_title(
        "solid: exactly-zero wgrad elements of the NVFP4-quantised tensors; dashed: nonzero "
        "NVFP4 GEMM operands quantised to 0 (§2.3)",
        fontsize=8,
    )
    ax_z.legend()
    ax_z.grid(alpha=0.3)
    return save_figure(fig, png, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default="runs/nvfp4_study")
    p.add_argument("--max-gap", type=float, default=0.08, help="fail above this relative gap")
    p.add_argument("--json", default="", help="also write the figures here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 5:
        raise SystemExit("--steps must be >= 5")

    from hybridlm.train.stages.pretrain import run_pretrain

    out = Path(args.out)
    for lp in ("none", "nvfp4"):
        cfg = study_config(
            out, steps=args.steps, low_precision=lp, seq_len=args.seq, batch=args.batch
        )
        cfg.train.progress = not args.no_progress
        run_pretrain(cfg, overwrite=True)  # the study's own directories: a rerun replaces them
    res = summarize(out, cfg)
    png = plot_study(out, cfg, out / "nvfp4_training.png")
    b, q = res["fp32"], res["nvfp4"]
    print(
        f"nvfp4 study ({args.steps} steps x {args.batch}x{args.seq} tokens, baseline fp32 on "
        f"CPU): final train loss fp32 {b['final_train_loss']:.4f} | nvfp4 "
        f"{q['final_train_loss']:.4f}; held-out fp32 {b['eval_loss']:.4f} | nvfp4 "
        f"{q['eval_loss']:.4f}; relative gap {100 * res['relative_gap']:+.2f}%; zero wgrad "
        f"(quantised tensors) fp32 {100 * b['zero_wgrad_frac_quantised']:.3f}% | nvfp4 "
        f"{100 * q['zero_wgrad_frac_quantised']:.3f}%; NVFP4 underflow "
        f"{100 * q['nvfp4_underflow_frac']:.2f}%; plot {png}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    finite = all(
        math.isfinite(res[r][k])
        for r in ("fp32", "nvfp4")
        for k in ("final_train_loss", "eval_loss")
    )
    if not finite or res["relative_gap"] > args.max_gap:
        print(f"FAIL: finite={finite}, relative gap {res['relative_gap']:.4f} > {args.max_gap}")
        return 1
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
