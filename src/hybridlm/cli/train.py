"""`hybridlm pretrain | merge | soup | sft | dpo | rm | distill | distill-cache | qad |
mtp-boost`: the training stages."""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass

from .args import add_overrides_arg


def add_resume_args(p: argparse.ArgumentParser) -> None:
    """`--resume | --overwrite`: what to do with an earlier run in the output directory (without
    either, finding one is an error)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest intact checkpoint (a damaged newer one is skipped)",
    )
    add_overwrite_arg(g)


def add_overwrite_arg(p: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    """`--overwrite` of the commands that write a run's metrics.jsonl (prepare_run_dir)."""
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run in the output directory: its metrics.jsonl (and "
        "checkpoints) are removed first; without it, finding one is an error",
    )


def add_run_args(p: argparse.ArgumentParser, default_config: str) -> None:
    """`--config RUN.yaml`, `--set` and `--resume | --overwrite`: the flags of a post-training
    stage."""
    p.add_argument("--config", default=default_config, help="run config YAML")
    add_overrides_arg(p, "train.max_steps=100")
    add_resume_args(p)


@dataclass(frozen=True)
class RunCommand:
    """`hybridlm NAME --config configs/NAME.yaml [--set ...] [--resume | --overwrite]`: a
    training stage that runs one run config. Its config class and run function are named, not
    imported (parsing never imports torch); `keys`: the result fields it prints."""

    name: str
    help: str
    module: str  # under hybridlm
    config: str  # the run config class
    run: str  # run(cfg, resume=, overwrite=) -> result
    keys: tuple[str, ...] = ("step", "eval", "checkpoint", "plot", "data")


RUN_COMMANDS = (
    RunCommand(
        "sft",
        "supervised fine-tuning on chat data (assistant-only loss)",
        "train.stages.sft",
        "SFTRunConfig",
        "run_sft",
    ),  # data: rows read, kept, skipped
    RunCommand(
        "dpo",
        "direct preference optimisation (dpo / dpo_norm)",
        "train.stages.dpo",
        "DPORunConfig",
        "run_dpo",
    ),
    RunCommand(
        "rm",
        "a Bradley-Terry reward model on preference pairs",
        "train.stages.rm",
        "RMRunConfig",
        "run_rm",
    ),
    RunCommand(
        "distill",
        "distillation: offline top-k KL + CE, or on-policy multi-teacher",
        "train.stages.distill",
        "DistillRunConfig",
        "run_distill",
        ("step", "eval", "checkpoint", "plot"),
    ),
    RunCommand(
        "qad",
        "quantisation-aware distillation: the quantised model (NVFP4 / FP8) trained toward "
        "itself unquantised; exports a ModelOpt checkpoint",
        "train.stages.qad",
        "QADRunConfig",
        "run_qad",
        ("step", "eval", "checkpoint", "hf", "plot", "figures"),
    ),
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the training commands to the CLI's sub-command parsers."""
    p = sub.add_parser("pretrain", help="pretrain from a run YAML (default: the quickstart)")
    p.add_argument("--config", default="configs/quickstart.yaml", help="a run YAML")
    add_overrides_arg(p, "train.max_steps=200")
    add_resume_args(p)
    p.add_argument("--prompt", default="def ", help="prompt of the closing sample")
    p.add_argument("--sample-tokens", type=int, default=200)
    p.set_defaults(fn=cmd_pretrain)

    p = sub.add_parser(
        "merge", help="merge a run's last checkpoints (sliding windows), export the best"
    )
    p.add_argument("--run", required=True, help="a pretrain out_dir (run.yaml + checkpoints/)")
    p.add_argument("--windows", default="2,3,4", help="window sizes, comma-separated")
    p.add_argument(
        "--weights", default="uniform,minus_sqrt", help="weightings: uniform, minus_sqrt"
    )
    p.add_argument("--out", default=None, help="export directory (default: RUN/merged)")
    p.set_defaults(fn=cmd_merge)

    p = sub.add_parser(
        "soup", help="average checkpoints across runs (model soup), evaluate, export the best"
    )
    p.add_argument("--runs", required=True, help="pretrain out_dirs, comma-separated")
    p.add_argument("--last", type=int, default=1, help="checkpoints per run to average")
    p.add_argument("--eval-run", default=None, help="run whose held-out split scores them")
    p.add_argument("--out", default=None, help="export directory (default: FIRST_RUN/soup)")
    p.set_defaults(fn=cmd_soup)

    for c in RUN_COMMANDS:
        p = sub.add_parser(c.name, help=c.help)
        add_run_args(p, f"configs/{c.name}.yaml")
        p.set_defaults(fn=cmd_run, run_command=c)

    p = sub.add_parser(
        "distill-cache",
        help="run an offline distillation's teacher once; write its top-k to distill.teacher_cache",
    )
    p.add_argument(
        "--config",
        default="",
        help="the run config (default: configs/distill.yaml, or configs/quickstart.yaml with "
        "--pretraining)",
    )
    p.add_argument(
        "--pretraining",
        action="store_true",
        help="the config is a pretraining run distilling on its text shards (its distill section)",
    )
    add_overrides_arg(p, "distill.teacher_cache=runs/distill_cache")
    p.set_defaults(fn=cmd_distill_cache)

    p = sub.add_parser(
        "mtp-boost",
        help="MTP healing/boosting: train only the MTP head on the model's own generations",
    )
    p.add_argument("--checkpoint", required=True, help="run, training checkpoint or HF directory")
    p.add_argument("--out", default="", help="output directory (default: <checkpoint>-mtp-boost)")
    add_resume_args(p)
    add_overrides_arg(p, "train.max_steps=300 --set mtp_boost.mix_true=0.5")
    p.set_defaults(fn=cmd_mtp_boost)


def cmd_pretrain(args: argparse.Namespace) -> None:
    """Pretrain from a run YAML (model + data + train); ends with a sample, the loss plot and a
    transformers export of the final weights."""
    from pathlib import Path

    import torch

    from ..data.pipeline import build_tokenizer
    from ..infer.generate import generate
    from ..interop.hf import save_pretrained
    from ..train import RunConfig
    from ..train.distributed import parallel
    from ..train.text_training import pretrain_trainer

    path = Path(args.config)
    if not path.is_file():
        raise ValueError(
            f"run config {path} not found (run from the repository root, or pass --config)"
        )
    run = RunConfig.load(path).override(args.overrides)
    trainer = pretrain_trainer(run, resume=args.resume, overwrite=args.overwrite)
    trainer.module.run.save(Path(trainer.module.run.train.out_dir) / "run.yaml")
    result = trainer.train()
    if not parallel.is_main():  # under torchrun only rank 0 samples, exports and reports
        parallel.destroy()
        return
    model, tok = trainer.model.eval(), build_tokenizer(trainer.module.run.data)
    ids = torch.tensor([tok.encode(args.prompt)], device=trainer.device)
    with torch.no_grad():
        out = generate(model, ids, args.sample_tokens, temperature=0.8, top_p=0.95, seed=0)
    export: Path | str = Path(trainer.module.run.train.out_dir) / "hf"
    try:
        save_pretrained(model, export, tokenizer=tok)
    except ValueError as err:  # an architecture transformers has no class for (e.g. RoPE + Mamba)
        export = f"skipped ({err}); the checkpoint loads with hybridlm.io"
    ev = result.get("eval") or {}
    print("--- sample (T=0.8, top-p 0.95) ---")
    print(args.prompt + tok.decode(out[0].tolist()))
    print("---")
    last = result.get("last_train") or {}
    summary = [
        f"step {result['step']}/{result['total_steps']}",
        f"tokens {result['tokens_seen']:,}",
    ]
    if "loss" in last:
        summary.append(f"train loss {last['loss']:.3f}")
    if ev:
        summary.append(
            " ".join(
                f"{k} {v:.3f}"
                for k, v in ev.items()
                if k.startswith("eval_") and isinstance(v, float)
            )
        )
    print("[" + " | ".join(summary) + "]")
    print(f"metrics:    {result['metrics']}")
    print(f"loss plot:  {result['plot']}")
    print(f"checkpoint: {result['checkpoint']}")
    where = "  (hybridlm.io.load_model / transformers)" if isinstance(export, Path) else ""
    print(f"hf export:  {export}{where}")
    parallel.destroy()


def cmd_merge(args: argparse.Namespace) -> None:
    """Average sliding windows of a run's last checkpoints, evaluate each on the held-out split
    and export the best (train/stages/merge.py)."""
    from ..train.stages.merge import merge_run, parse_list

    merge_run(
        args.run,
        windows=parse_list(args.windows, int),
        weights=parse_list(args.weights),
        out=args.out,
    )


def cmd_soup(args: argparse.Namespace) -> None:
    """Soup the runs' last checkpoints, evaluate every candidate, export the best
    (train/stages/merge.py)."""
    from ..train.stages.merge import parse_list, soup_runs

    soup_runs(parse_list(args.runs), last=args.last, eval_run=args.eval_run, out=args.out)


def cmd_run(args: argparse.Namespace) -> None:
    """Load a training command's run config, apply `--set`, run it and print the result's
    `keys` as JSON (under torchrun: rank 0 prints, every rank leaves the process group
    together)."""
    from ..train.distributed import parallel

    c: RunCommand = args.run_command
    module = importlib.import_module(f"hybridlm.{c.module}")
    cfg = getattr(module, c.config).load(args.config).override(args.overrides)
    result = getattr(module, c.run)(cfg, resume=args.resume, overwrite=args.overwrite)
    if parallel.is_main():
        print(json.dumps({k: result[k] for k in c.keys}, indent=1))
    parallel.destroy()


def cmd_distill_cache(args: argparse.Namespace) -> None:
    """Write (or finish) the teacher top-k cache of an offline distillation config, or of a
    pretraining run's text (`--pretraining`)."""
    if args.pretraining:
        from ..train.config import RunConfig
        from ..train.stages.pretrain import cache_text_teacher

        cfg = RunConfig.load(args.config or "configs/quickstart.yaml").override(args.overrides)
        result = cache_text_teacher(cfg)
    else:
        from ..train.distillation import DistillRunConfig
        from ..train.stages.distill import cache_teacher

        cfg = DistillRunConfig.load(args.config or "configs/distill.yaml").override(args.overrides)
        result = cache_teacher(cfg)
    print(json.dumps({"teacher_cache": cfg.distill.teacher_cache, **result}, indent=1))


def cmd_mtp_boost(args: argparse.Namespace) -> None:
    from pathlib import Path

    from ..rl.env_config import environment_prompts
    from ..train.distributed import parallel
    from ..train.mtp_boost import MTPBoostRunConfig, boost_checkpoint

    cfg = MTPBoostRunConfig()
    cfg.train.init_from = args.checkpoint
    cfg.train.out_dir = args.out or str(Path(args.checkpoint).resolve()) + "-mtp-boost"
    cfg = cfg.override(args.overrides)
    res = boost_checkpoint(
        cfg,
        overwrite=args.overwrite,
        resume=args.resume,
        environment_prompts=environment_prompts,
    )
    if not parallel.is_main():  # under torchrun rank 0 reports; every rank leaves together
        parallel.destroy()
        return
    print(
        f"[mtp-boost] {res['sequences']} self-generated sequences ({res['generation_s']:.0f} s),"
        f" {cfg.train.max_steps} steps ({res['train_s']:.0f} s): loss {res['first']['loss']:.3f} ->"
        f" {res['last']['loss']:.3f}"
    )
    for b, a in zip(res["before"], res["after"], strict=True):
        pos_b = " ".join(f"{x:.2f}" for x in b["acceptance_by_position"])
        pos_a = " ".join(f"{x:.2f}" for x in a["acceptance_by_position"])
        print(
            f"[mtp-boost] T={b['temperature']:g}, k={cfg.mtp_boost.draft_len}, "
            f"{res['eval_prompts']} held-out"
            f" prompts: acceptance length {b['acceptance_length']:.2f} ->"
            f" {a['acceptance_length']:.2f} | by position {pos_b} -> {pos_a}"
        )
    print(f"plot: {res['plot']}\nmodel: {res['model']}")
    parallel.destroy()
