"""`hybridlm eval`: evaluate a model on registered tasks (eval/harness.py)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..choices import EVAL_DTYPES
from ..presets import PRESETS


def register(sub: argparse._SubParsersAction) -> None:
    """Add `hybridlm eval` to the CLI's sub-command parsers."""
    p = sub.add_parser(
        "eval", help="evaluate a model: bpb, multiple choice, GSM8K, pass@k, RULER, IFEval"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="training checkpoint, run directory or HF directory")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a randomly initialised preset")
    p.add_argument("--config", help="an eval YAML (configs/eval.yaml); flags override it")
    p.add_argument("--tasks", help="comma-separated tasks or groups (base_easy, mc, ruler)")
    p.add_argument("--limit", type=int, help="items per task")
    p.add_argument(
        "--data-dir",
        help="folder with gsm8k/, humaneval/, tinyshakespeare/ (default: the packaged copies)",
    )
    p.add_argument("--out", help="output folder (default runs/eval/<model name>)")
    p.add_argument("--dtype", choices=sorted(EVAL_DTYPES))
    p.add_argument("--seed", type=int)
    p.add_argument("--tokenizer", help="'byte' or a tokenizer.json / directory (override)")
    p.add_argument("--max-len", type=int, help="context limit (default: the model's)")
    p.add_argument(
        "--max-new-tokens", type=int, help="GSM8K / HumanEval / IFEval generation budget"
    )
    p.add_argument(
        "--prompt-format", choices=("base", "chat"), help="GSM8K / HumanEval / IFEval prompt style"
    )
    p.add_argument("--gsm8k-fewshot", type=int, help="solved examples before each GSM8K question")
    p.add_argument("--humaneval-samples", type=int, help="n completions per HumanEval problem")
    p.add_argument("--ruler-lengths", help="comma-separated context lengths in tokens")
    p.add_argument(
        "--ifeval-data",
        help="IFEval prompts: a JSONL file (key, prompt, instruction_id_list, kwargs) or a Hugging "
        "Face dataset id such as google/IFEval (default: <data-dir>/ifeval/input_data.jsonl, "
        "else seeded synthetic prompts)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=cmd_eval)


def config_from_args(args: argparse.Namespace) -> Any:
    """The EvalConfig of `--config` (or the defaults) with the given flags applied."""
    from ..eval.harness import EvalConfig

    cfg = EvalConfig.load(args.config) if args.config else EvalConfig()
    updates: dict[str, Any] = {}
    if args.tasks:
        updates["tasks"] = [t for t in args.tasks.split(",") if t.strip()]
    for flag, key in (
        ("limit", "limit"),
        ("data_dir", "data_dir"),
        ("dtype", "dtype"),
        ("seed", "seed"),
        ("max_len", "max_len"),
        ("humaneval_samples", "humaneval_samples"),
        ("max_new_tokens", "max_new_tokens"),
        ("prompt_format", "prompt_format"),
        ("gsm8k_fewshot", "gsm8k_fewshot"),
        ("ifeval_data", "ifeval_data"),
    ):
        if getattr(args, flag, None) is not None:
            updates[key] = getattr(args, flag)
    if args.ruler_lengths:
        try:
            updates["ruler_lengths"] = [int(x) for x in args.ruler_lengths.split(",") if x]
        except ValueError:
            raise ValueError(
                f"--ruler-lengths takes integers, got {args.ruler_lengths!r}"
            ) from None
    if args.out:
        updates["out_dir"] = args.out
    if args.no_progress:
        updates["progress"] = False
    return dataclasses.replace(cfg, **updates)


def cmd_eval(args: argparse.Namespace) -> None:
    from pathlib import Path

    from ..eval.harness import evaluate, is_headline_metric, load_model

    cfg = config_from_args(args)
    loaded = load_model(
        args.checkpoint,
        preset=args.preset,
        seed=cfg.seed,
        dtype=cfg.dtype,
        tokenizer=args.tokenizer,
    )
    doc = evaluate(loaded, cfg)
    out = cfg.out_dir or Path("runs") / "eval" / loaded.name
    print(f"results: {Path(out) / 'results.json'}")
    for name, t in doc["tasks"].items():
        for k, v in t["metrics"].items():
            se = t["stderr"].get(k)
            if not is_headline_metric(k):
                continue
            shown = "nan" if v is None else f"{v:.4f}"
            print(f"  {name:24s} {k:14s} {shown}" + (f" ± {se:.4f}" if se is not None else ""))
