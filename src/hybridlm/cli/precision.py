"""`hybridlm precision-plan | quantize`: low-precision training plan and post-training
quantisation (precision/policy.py, train/stages/quantize.py)."""

from __future__ import annotations

import argparse

from ..choices import PTQ_DEFAULT_EXCLUDE, PTQ_RECIPES
from .args import add_overrides_arg
from .train import add_overwrite_arg


def register(sub: argparse._SubParsersAction) -> None:
    """Add the precision commands to the CLI's sub-command parsers."""
    p = sub.add_parser(
        "precision-plan",
        help="which layers train in NVFP4 / MXFP8 / BF16 (Nemotron 3 Super §2.2 policy)",
    )
    p.add_argument("--preset", default="tiny-super", help="model preset name")
    p.add_argument("--config", default=None, help="model config YAML/JSON (instead of --preset)")
    p.add_argument(
        "--tail", type=float, default=0.15, help="fraction of final layers kept in high precision"
    )
    p.set_defaults(fn=cmd_precision_plan)

    p = sub.add_parser(
        "quantize",
        help="PTQ (FP8 W8A8, NVFP4 W4A4, AutoQuantize mixed) + ModelOpt/vLLM-format export",
        description="Every flag is a field of train.stages.quantize.QuantizeConfig, which "
        "--set KEY=VALUE also sets (applied after the flags): the flag's name with _ for - "
        "(--calib-samples 8 is --set calib_samples=8, --kv-cache fp8 is --set kv_cache=fp8), "
        "except --dtype (export_dtype) and --no-per-layer (per_layer=false); --set "
        "exclude=[...] replaces the whole list, the default exclusions included.",
    )
    p.add_argument(
        "checkpoint",
        help="the model: a run directory, a training checkpoint of any stage, or a transformers "
        "/ ModelOpt directory",
    )
    p.add_argument("out", help="output directory (quantised checkpoint + reports)")
    add_overwrite_arg(p)
    p.add_argument("--recipe", choices=PTQ_RECIPES, default="nvfp4")
    p.add_argument(
        "--budget", type=float, default=4.75, help="autoquant: average effective bits per weight"
    )
    p.add_argument(
        "--cost",
        choices=["params", "flops"],
        default="params",
        help="autoquant: weight the bits average by parameters or by MACs per token",
    )
    p.add_argument("--calib-samples", type=int, default=64, help="calibration sequences")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches to compare on")
    p.add_argument(
        "--weight-scale",
        choices=["mse", "max"],
        default="mse",
        help="NVFP4 weight block scales: per-block MSE search or plain amax",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=None,
        metavar="PATTERN",
        help=f"module-name glob kept unquantised, added to {list(PTQ_DEFAULT_EXCLUDE)} "
        "(repeatable)",
    )
    p.add_argument(
        "--no-per-layer",
        dest="per_layer",
        action="store_false",
        help="skip the per-group loss deltas (one evaluation per group)",
    )
    p.add_argument(
        "--kv-cache",
        choices=["none", "fp8", "nvfp4"],
        default="none",
        help="declare a quantised attention KV cache (scales calibrated on the calibration rows)",
    )
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument(
        "--data",
        default="",
        help="calibrate and evaluate on the data of this pretraining run (dir or run.yaml)",
    )
    p.add_argument(
        "--calib-data",
        default="",
        help="calibrate on the chat data of this SFT run (dir or run.yaml) instead of `--data` "
        "(default: the model's own run's chat data, when it was post-trained on chats)",
    )
    add_overrides_arg(p, "calib_samples=16 --set kv_cache=fp8")
    p.set_defaults(fn=cmd_quantize)


def cmd_precision_plan(args: argparse.Namespace) -> None:
    """Print which GEMM of a model trains in which format under the §2.2 policy."""
    import torch

    from ..config import ModelConfig
    from ..model.model import HybridLM
    from ..precision.policy import ConversionReport, PrecisionPolicy, assign_formats
    from ..presets import get_preset

    cfg = ModelConfig.load(args.config) if args.config else get_preset(args.preset)
    with torch.device("meta"):  # no memory: the 120B preset plans in a second
        model = HybridLM(cfg)
    policy = PrecisionPolicy(high_precision_tail=args.tail)
    report = ConversionReport([row for _, _, row in assign_formats(model, policy)])
    print(report.table())


def cmd_quantize(args: argparse.Namespace) -> None:
    from ..train.stages.quantize import QuantizeConfig, run_quantize

    cfg = QuantizeConfig(
        checkpoint=args.checkpoint,
        out=args.out,
        recipe=args.recipe,
        budget=args.budget,
        cost=args.cost,
        calib_samples=args.calib_samples,
        eval_batches=args.eval_batches,
        weight_scale=args.weight_scale,
        exclude=[*PTQ_DEFAULT_EXCLUDE, *(args.exclude or ())],
        per_layer=args.per_layer,
        kv_cache=args.kv_cache,
        export_dtype=args.dtype,
        device=args.device,
        data=args.data,
        calib_data=args.calib_data,
    )
    run_quantize(cfg.override(args.overrides), overwrite=args.overwrite)
