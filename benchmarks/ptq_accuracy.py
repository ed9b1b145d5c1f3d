"""PTQ accuracy table: held-out loss and bits per byte of a trained tiny hybrid model, unquantised
vs FP8 W8A8, NVFP4 W4A4 (plain amax and MSE-searched weight scales) and AutoQuantize at a 4.75-bit
budget (Nemotron 3 Super §4).

    python benchmarks/ptq_accuracy.py                       # ~1-2 min on 2 CPU cores
    python benchmarks/ptq_accuracy.py --checkpoint DIR --calib-samples 64 --eval-batches 16

Uses the quickstart checkpoint (`runs/quickstart`, trained by `hybridlm pretrain`) when present,
else pretrains a short one with `hybridlm.train.run_pretrain` (quickstart config, `--train-steps`
steps). All variants share one calibration set (training split) and one held-out set, and are
computed in one run; the unquantised reference runs in fp32 on this CPU (labelled so). Writes
`<out>/metrics.jsonl` (one row per variant) and `<out>/ptq_accuracy.png` from it.

Exits 1 unless: every variant is finite; FP8's relative loss delta is below NVFP4's; the MSE
weight-scale search does not lose to amax scaling by more than noise (0.1% relative loss);
AutoQuantize stays within its bit budget and beats plain NVFP4; and the AutoQuantize model
exported in the ModelOpt format and read back evaluates to exactly the same loss.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridlm.report.plot import save_figure


def find_checkpoint(args) -> Path:
    from hybridlm.io.checkpoint import latest_checkpoint

    if args.checkpoint:
        return Path(args.checkpoint)
    found = latest_checkpoint("runs/quickstart")
    if found is not None:
        return found
    from hybridlm.train.config import RunConfig
    from hybridlm.train.stages.pretrain import run_pretrain

    run = RunConfig.load("configs/quickstart.yaml")
    run.train.out_dir = str(Path(args.out) / "train")
    run.data.shards_dir = str(Path(args.out) / "train" / "shards")
    run.train.max_steps = args.train_steps
    run.train.checkpoint_interval = args.train_steps
    run.train.eval_interval = args.train_steps
    print(f"no runs/quickstart checkpoint: pretraining {args.train_steps} steps", flush=True)
    run_pretrain(run, overwrite=True)  # the benchmark's own run: a rerun replaces it
    return latest_checkpoint(run.train.out_dir)


def plot(metrics: Path, png: Path) -> Path:
    """Relative held-out loss against effective bits, rendered from metrics.jsonl."""
    import matplotlib

    from hybridlm.report.plot import read_metrics

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics) if r.get("stage") == "ptq_accuracy"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    base = next(r for r in rows if r["variant"] == "unquantized")
    for r in rows:
        ax.scatter(r["bits"], 100 * r["loss_rel"], s=40)
        ax.annotate(
            r["variant"],
            (r["bits"], 100 * r["loss_rel"]),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.set_xlabel("effective bits per weight (quantised operators)")
    ax.set_ylabel("held-out loss vs unquantised (%)")
    ax.set_title(f"PTQ accuracy (unquantised loss {base['loss']:.4f} nats/token)")
    ax.grid(alpha=0.3)
    return save_figure(fig, png, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="", help="training checkpoint / run / HF directory")
    p.add_argument("--out", default="runs/ptq_accuracy")
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--budget", type=float, default=4.75)
    p.add_argument("--train-steps", type=int, default=300, help="only without a checkpoint")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hybridlm.data.bpb import token_byte_lengths
    from hybridlm.data.pipeline import build_loaders, build_tokenizer, prepare_shards
    from hybridlm.interop.modelopt import export_modelopt, load_modelopt
    from hybridlm.precision import ptq
    from hybridlm.precision.autoquant import autoquantize, measure_sensitivities
    from hybridlm.train.stages.quantize import load_checkpoint_and_data

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ckpt = find_checkpoint(args)
    model, data, _, _, what = load_checkpoint_and_data(ckpt, out)  # its text data, not chats
    model.eval()
    sets = prepare_shards(data)
    train_loader, held_loader = build_loaders(data, sets)
    if held_loader is None:
        raise SystemExit("the checkpoint's data has no held-out split")
    calib = ptq.take(train_loader, math.ceil(args.calib_samples / data.batch_size))
    held = ptq.take(held_loader, args.eval_batches)
    token_bytes = token_byte_lengths(build_tokenizer(data), model.config.vocab_size)
    ops = ptq.find_ops(model)

    def ev(m):
        return ptq.evaluate(m, held, token_bytes)

    stats = ptq.calibrate(model, calib)
    sens = measure_sensitivities(model, calib, stats)
    aq = autoquantize(sens, ops, budget=args.budget)
    variants = {
        "fp8": (ptq.recipe_plan(model, "fp8"), "mse"),
        "nvfp4 (amax scales)": (ptq.recipe_plan(model, "nvfp4"), "max"),
        "nvfp4": (ptq.recipe_plan(model, "nvfp4"), "mse"),
        f"autoquant@{args.budget:g}": (aq.plan, "mse"),
    }
    base = ev(model)
    dtype = str(model.embeddings.weight.dtype).removeprefix("torch.")
    rows = [
        {
            "variant": "unquantized",
            "label": f"unquantized ({dtype}, CPU)",
            "bits": 16.0 if dtype == "bfloat16" else 32.0,
            **base,
            "loss_rel": 0.0,
            "bpb_rel": 0.0,
        }
    ]
    models = {}
    for name, (plan, search) in variants.items():
        q = ptq.clone_model(model)
        applied = ptq.quantize_model(q, plan, stats, weight_scale=search)
        r = ev(q)
        models[name] = q
        rows.append(
            {
                "variant": name,
                "label": name,
                "bits": ptq.model_bits(q, applied, ops),
                **r,
                "loss_rel": (r["loss"] - base["loss"]) / base["loss"],
                "bpb_rel": (r["bpb"] - base["bpb"]) / base["bpb"],
            }
        )
    aq_name = f"autoquant@{args.budget:g}"
    with tempfile.TemporaryDirectory() as tmp:
        export_modelopt(models[aq_name], tmp, dtype=torch.float32)
        reloaded = ev(load_modelopt(tmp))
    with open(out / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"stage": "ptq_accuracy", **r}) + "\n")
    png = plot(out / "metrics.jsonl", out / "ptq_accuracy.png")

    print(
        f"PTQ accuracy on {what}; {len(calib)} calibration batches, held-out "
        f"{base['tokens']} tokens ({len(held)} batches)"
    )
    print(f"{'model':<28} {'bits':>6} {'loss':>9} {'bpb':>9} {'d loss':>9} {'d bpb':>9}")
    for r in rows:
        print(
            f"{r['label']:<28} {r['bits']:>6.2f} {r['loss']:>9.5f} {r['bpb']:>9.5f} "
            f"{100 * r['loss_rel']:>+8.3f}% {100 * r['bpb_rel']:>+8.3f}%"
        )
    counts = {f: sum(1 for g in aq.groups if g.format == f) for f in ("nvfp4", "fp8", "bf16")}
    print(f"autoquant groups: {counts}; plot {png}; {time.time() - t0:.0f}s")

    by = {r["variant"]: r for r in rows}
    checks = {
        "all finite": all(math.isfinite(r["loss"]) and math.isfinite(r["bpb"]) for r in rows),
        "fp8 delta < nvfp4 delta": by["fp8"]["loss_rel"] < by["nvfp4"]["loss_rel"],
        "mse search not worse than amax (0.1%)": by["nvfp4"]["loss_rel"]
        <= by["nvfp4 (amax scales)"]["loss_rel"] + 1e-3,
        "autoquant within budget": by[aq_name]["bits"] <= args.budget + 1e-9,
        "autoquant beats nvfp4": by[aq_name]["loss_rel"] < by["nvfp4"]["loss_rel"],
        "export -> import same loss": reloaded["loss"] == by[aq_name]["loss"],
    }
    failed = [k for k, ok in checks.items() if not ok]
    print("checks: " + ", ".join(f"{k}: {'ok' if ok else 'FAIL'}" for k, ok in checks.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
