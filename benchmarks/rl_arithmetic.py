"""GRPO after SFT on arithmetic, against a random-reward negative control.

    hybridlm sft                                  # runs/sft: the quickstart model, arithmetic chats
    python benchmarks/rl_arithmetic.py [--sft runs/sft/checkpoints/step_00000500] [--steps 80]

Two GRPO runs from the same SFT checkpoint with the same settings: one rewarded by the verifier
(final number == the answer), one by a fair coin (`reward: random`, no information about the
task). Both evaluate greedy exact match on the same held-out problems every 10 steps. Prints one
figure line per run and renders `OUT/rl_vs_control.png` from the two `metrics.jsonl` files.
Existing runs in OUT are reused unless `--rerun`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hybridlm.report.plot import save_figure
from hybridlm.rl.learner import EnvConfig, RLConfig, run_rl


def config(sft: str, out: Path, reward: str, args: argparse.Namespace) -> RLConfig:
    return RLConfig(
        checkpoint=sft,
        out_dir=str(out),
        envs=[EnvConfig(kind="sft_arithmetic", digits=2, seed=1, num_problems=4000)],
        eval_envs=[EnvConfig(kind="sft_arithmetic", digits=2, seed=2, num_problems=4000)],
        eval_problems=96,
        eval_interval=10,
        reward=reward,
        steps=args.steps,
        groups_per_step=8,
        group_size=8,
        max_draws=24,
        max_new_tokens=96,
        lr=args.lr,
        executor=args.executor,
        num_workers=1,
        max_policy_lag=1,
        micro_batch_size=32,
    )


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]


def summary(run: Path) -> dict:
    rs = rows(run)
    train = [r["reward_mean"] for r in rs if r["kind"] == "train"]
    evals = [(r["step"], r["all/solved"]) for r in rs if r["kind"] == "eval"]
    return {
        "steps": len(train),
        "reward_first10": sum(train[:10]) / len(train[:10]),
        "reward_last10": sum(train[-10:]) / len(train[-10:]),
        "eval": evals,
    }


def plot(runs: dict[str, Path], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, run in runs.items():
        rs = rows(run)
        train = [(r["step"], r["reward_mean"]) for r in rs if r["kind"] == "train"]
        steps, rew = zip(*train, strict=True)
        k = 10  # moving average over 10 steps
        avg = [
            sum(rew[max(0, i - k + 1) : i + 1]) / len(rew[max(0, i - k + 1) : i + 1])
            for i in range(len(rew))
        ]
        a1.plot(steps, avg, label=f"{label} (10-step mean)")
        ev = [(r["step"], r["all/solved"]) for r in rs if r["kind"] == "eval"]
        a2.plot(*zip(*ev, strict=True), marker="o", label=label)
    a1.set(title="training reward (its own reward)", xlabel="step", ylim=(0, 1))
    a2.set(title="held-out exact match (greedy, verifier)", xlabel="step", ylim=(0, 1))
    a1.legend()
    a2.legend()
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sft", default="runs/sft/checkpoints/step_00000500")
    p.add_argument("--out", default="runs/rl-arith-bench")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--executor", default="ray", choices=["ray", "inline"])
    p.add_argument("--rerun", action="store_true")
    args = p.parse_args(argv)
    if not Path(args.sft).exists():
        print(f"[rl] skipped: no SFT checkpoint at {args.sft} (run `hybridlm sft` first)")
        return 0
    torch.set_num_threads(1)
    out = Path(args.out)
    runs = {"verifier reward": out / "grpo", "random reward (control)": out / "control"}
    for (label, run), reward in zip(runs.items(), ("verifier", "random"), strict=True):
        if args.rerun or not (run / "metrics.jsonl").is_file():
            run_rl(config(args.sft, run, reward, args), progress=True, overwrite=True)
        s = summary(run)
        ev = " ".join(f"{step}:{v:.3f}" for step, v in s["eval"])
        print(
            f"[rl] {label}: {s['steps']} steps from {args.sft} | train reward (first / last 10"
            f" steps) {s['reward_first10']:.3f} -> {s['reward_last10']:.3f} | held-out exact"
            f" match by step {ev}"
        )
    plot(runs, out / "rl_vs_control.png")
    print(f"[rl] plot {out / 'rl_vs_control.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
