"""`hybridlm speedrun | report`: the whole flow, stage by stage, in one run directory
(speedrun.py); its report card re-rendered from the run directory's files (report/card.py)."""

from __future__ import annotations

import argparse
import json

from .args import add_overrides_arg


def register(sub: argparse._SubParsersAction) -> None:
    """Add `hybridlm speedrun` to the CLI's sub-command parsers."""
    p = sub.add_parser(
        "speedrun",
        help="the whole flow: curate -> tokenizer -> pretrain -> SFT -> GRPO -> MTP healing -> "
        "NVFP4 PTQ -> eval -> report, resumable, in one run directory",
    )
    p.add_argument("--config", default="configs/speedrun.yaml", help="speedrun config YAML")
    p.add_argument("--out", default="", help="run directory (default: the config's out_dir)")
    p.add_argument("--skip", default="", help="comma-separated stages to leave out")
    p.add_argument("--only", default="", help="comma-separated stages to run (others untouched)")
    p.add_argument("--force", default="", help="comma-separated stages to rerun even if done")
    add_overrides_arg(p, "pretrain.train.max_steps=300")
    p.set_defaults(fn=cmd_speedrun)

    p = sub.add_parser(
        "report", help="(re)render a flow run's report.md / report.html from its metrics files"
    )
    p.add_argument("run_dir", help="a speedrun run directory (finished or partial)")
    p.set_defaults(fn=cmd_report)


def cmd_speedrun(args: argparse.Namespace) -> None:
    from ..speedrun import Speedrun, load_config

    cfg = load_config(args.config, args.overrides, args.out, args.skip)

    def names(s: str) -> list[str]:
        return [x for x in s.split(",") if x]

    result = Speedrun(
        cfg,
        only=names(args.only) or None,
        force=names(args.force),
        threads=args.threads_info,
    ).run()
    print(json.dumps({"run_dir": result["run_dir"], "minutes": result["seconds"] / 60}, indent=1))


def cmd_report(args: argparse.Namespace) -> None:
    from ..report.card import render_report
    from ..stages import STAGES  # the stages' headlines (their modules import torch)

    print(json.dumps(render_report(args.run_dir, STAGES), indent=1))
