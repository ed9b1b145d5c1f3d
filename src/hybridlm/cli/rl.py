"""`hybridlm rl`: GRPO with verifiable rewards (rl/learner.py)."""

from __future__ import annotations

import argparse
import dataclasses

from .args import add_overrides_arg
from .train import add_resume_args


def register(sub: argparse._SubParsersAction) -> None:
    """Add `hybridlm rl` to the CLI's sub-command parsers."""
    p = sub.add_parser("rl", help="GRPO with verifiable rewards and asynchronous rollouts")
    p.add_argument("--config", default="", help="an RL YAML (default: configs/rl.yaml if present)")
    p.add_argument("--checkpoint", default="", help="the starting policy (overrides the config)")
    add_resume_args(p)
    add_overrides_arg(p, "steps=20 --set grpo.eps_high=0.28")
    p.set_defaults(fn=cmd_rl)


def cmd_rl(args: argparse.Namespace) -> None:
    from pathlib import Path

    from ..rl.learner import RLConfig, run_rl
    from ..train import parallel

    path = Path(args.config or "configs/rl.yaml")
    if args.config and not path.is_file():
        raise ValueError(f"rl config {path} not found")
    cfg = RLConfig.load(path) if path.is_file() else RLConfig()
    if args.checkpoint:
        cfg = dataclasses.replace(cfg, checkpoint=args.checkpoint)
    cfg = cfg.override(args.overrides)
    res = run_rl(cfg, resume=args.resume, overwrite=args.overwrite)
    if not parallel.is_main():  # under torchrun rank 0 reports; every rank leaves together
        parallel.destroy()
        return
    first, last = res["eval"][0], res["eval"][-1]
    tr = res["train"]
    print(
        f"[rl] {len(tr)} steps | train reward {tr[0]['reward_mean']:.3f} -> "
        f"{tr[-1]['reward_mean']:.3f} | held-out solved {first['all/solved']:.3f} -> "
        f"{last['all/solved']:.3f} ({int(first['all/count'])} problems, greedy)"
    )
    print(f"metrics: {res['metrics']}\nplot:    {res['plot']}\nmodel:   {res['model']}")
    parallel.destroy()
