"""Quantisation-aware distillation on a speedrun chain, measured on many held-out problems: the
speedrun's `qad` stage with variations of its settings, each judged by greedy exact match of
its exported checkpoint (NVFP4 W4A4, or the mix of `qad.formats`; FP8 KV cache, as it is served)
beside the unquantised model and the PTQ checkpoint, on the same problems.

    hybridlm speedrun                         # the chain (stages up to quantize are used)
    python benchmarks/qad.py [--run runs/speedrun] [--problems 768] [--variants 0,2]

The eval stage's 96 problems give a standard error of about 0.045 at these accuracies, more than
the differences between QAD settings; here every model answers the same `--problems` held-out
problems of the RL eval set (about 0.015; drawn with replacement, so some repeat). Each variant
is the run's `qad` section with the settings in VARIANTS (5.5-8 min each on 2 cores, 16 for 600
steps); writes runs/qad_study/{results.json, <variant>/} and prints a markdown table with the
mean bits per quantised weight.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from hybridlm.threads import configure_threads

# (name, overrides of the qad section); every variant sets the settings it is compared on
BEFORE = {
    "distill.ce_weight": 0.0,
    "qad.correct_only": False,
    "qad.teacher_replies": 1024,
    "train.weight_decay": 0.1,
}
CE = {
    "distill.ce_weight": 0.5,
    "qad.correct_only": True,
    "qad.teacher_replies": 1024,
    "train.weight_decay": 0.0,
}
STAGE = {**CE, "qad.teacher_replies": 4096}  # the speedrun's qad stage
VARIANTS = [
    ("KL only, every teacher reply to 1,024 prompts (weight decay 0.1)", BEFORE),
    ("the same, 600 steps", {**BEFORE, "train.max_steps": 600}),
    ("KL + 0.5 CE, every teacher reply to 1,024 prompts", {**CE, "qad.correct_only": False}),
    ("KL + 0.5 CE, the right replies to 1,024 prompts", CE),
    ("KL + 2 CE, the right replies to 1,024 prompts", {**CE, "distill.ce_weight": 2.0}),
    ("KL + 0.5 CE, the right replies to 4,096 prompts (the speedrun's stage)", STAGE),
    (
        "KL + 0.5 CE, the right replies to 1,024 prompts, no text batches",
        {**CE, "qad.text_per_step": 0},
    ),
    ("the stage, 16 chat rows a step", {**STAGE, "data.batch_size": 16}),
    ("the stage, right replies to 6,000 prompts", {**STAGE, "qad.teacher_replies": 6000}),
    ("the stage, KL + 2 CE", {**STAGE, "distill.ce_weight": 2.0}),
    # not all-NVFP4: Nemotron 3.5's release keeps the Mamba projections in FP8 or BF16 (§4.3)
    (
        "variant 3, Mamba in/out projections FP8 (the rest NVFP4 W4A4)",
        {**CE, "qad.formats": {"*.mixer.in_proj": "fp8", "*.mixer.out_proj": "fp8"}},
    ),
    ("variant 3, Mamba out projections FP8", {**CE, "qad.formats": {"*.mixer.out_proj": "fp8"}}),
    (
        "the stage + MSE of the final hidden states (weight 1)",
        {**STAGE, "distill.hidden_weight": 1.0},
    ),
    (
        "the stage, reverse KL instead of the forward KL",
        {**STAGE, "distill.objective": "skew_reverse_kl", "distill.skew_alpha": 1.0},
    ),
    ("the stage, lr decayed over all 200 steps", {**STAGE, "train.decay_fraction": 1.0}),
]


def set_dotted(d: dict, key: str, value) -> None:
    *path, leaf = key.split(".")
    for k in path:
        d = d.setdefault(k, {})
    d[leaf] = value


def exact_match(model, tok, problems, env) -> tuple[float, float]:
    import torch

    from hybridlm.rl.env_config import evaluate_policy

    with torch.no_grad():
        p = evaluate_policy(model.float().eval(), tok, problems, env, max_new_tokens=96)
    solved = p["all/solved"]
    return solved, math.sqrt(solved * (1 - solved) / len(problems))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/speedrun", help="a speedrun directory")
    ap.add_argument(
        "--config", default="", help="the speedrun config (default: the run's speedrun.yaml)"
    )
    ap.add_argument("--out", default="runs/qad_study")
    ap.add_argument("--problems", type=int, default=768)
    ap.add_argument("--variants", default="", help="comma-separated subset of variant indices")
    args = ap.parse_args()
    threads = configure_threads(None)

    from hybridlm.io import load_model
    from hybridlm.provenance import collect
    from hybridlm.rl.env_config import build_mixture, eval_specs
    from hybridlm.speedrun import Speedrun, load_config
    from hybridlm.train.stages.qad import QADRunConfig, qad_figures, run_qad

    run_dir = Path(args.run)
    if not (run_dir / "quantize" / "stage.json").is_file():
        raise SystemExit(f"{run_dir} has no finished quantize stage: run `hybridlm speedrun` first")
    if not (run_dir / "quantize" / "nvfp4").is_dir():
        raise SystemExit(f"{run_dir}/quantize has no nvfp4 checkpoint (quantize.recipes)")
    # the run's own settings (its data, chain and eval problems); each variant sets what it varies
    config = args.config or str(run_dir / "speedrun.yaml")
    flow = Speedrun(load_config(config, [], out=str(run_dir)), progress=False)
    tok = flow.tokenizer()
    rl = flow.cfg.rl
    env = build_mixture(eval_specs(rl.data.envs, rl.data.eval_envs), tokenizer=tok)
    problems = env.sample(args.problems, seed=rl.train.seed + 12345)  # the RL eval set
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    rows = []
    for name, path in (
        ("unquantised", flow.model_path("qad")),
        ("NVFP4 PTQ", str(run_dir / "quantize" / "nvfp4")),
    ):
        em, se = exact_match(load_model(path), tok, problems, env)
        rows.append({"name": name, "exact_match": em, "se": se, "model": path})
        print(f"{name}: {em:.3f} ± {se:.3f}", flush=True)
    picks = [int(i) for i in args.variants.split(",")] if args.variants else range(len(VARIANTS))
    for i in picks:
        name, overrides = VARIANTS[i]
        settings = flow.settings("qad")
        for key, value in {**overrides, "train.out_dir": str(out / f"variant_{i}")}.items():
            set_dotted(settings, key, value)
        settings["train"]["progress"] = False
        result = run_qad(QADRunConfig.from_dict(settings), overwrite=True)
        em, se = exact_match(load_model(result["hf"]), tok, problems, env)
        fig = qad_figures(out / f"variant_{i}" / "metrics.jsonl")["qad"]
        rows.append(
            {
                "name": name,
                "overrides": overrides,
                "exact_match": em,
                "se": se,
                "kl": fig.get("kl"),
                "text_loss": fig.get("text_loss"),
                "teacher_replies": result.get("teacher_replies"),
                "effective_bits": result.get("effective_bits"),
            }
        )
        print(f"{name}: {em:.3f} ± {se:.3f}, KL {fig.get('kl', float('nan')):.4f}", flush=True)
    report = {
        "run": str(run_dir),
        "problems": args.problems,
        "rows": rows,
        "provenance": collect(argv=None, threads=threads),
    }
    (out / "results.json").write_text(json.dumps(report, indent=1))
    print("| model | exact match | KL to unquantised | text loss | bits |\n|---|---|---|---|---|")
    for r in rows:
        kl = f"{r['kl']:.4f}" if r.get("kl") is not None else "–"
        text = f"{r['text_loss']:.4f}" if r.get("text_loss") is not None else "–"
        bits = f"{r['effective_bits']:.2f}" if r.get("effective_bits") is not None else "–"
        em = f"{r['exact_match']:.3f} ± {r['se']:.3f}"
        print(f"| {r['name']} | {em} | {kl} | {text} | {bits} |")


if __name__ == "__main__":
    main()
