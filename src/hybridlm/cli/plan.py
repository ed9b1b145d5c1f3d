"""`hybridlm plan`: per-device memory and per-step communication of a training layout.

    hybridlm plan --preset nemotron-3-super-120b-a12b --gpus 512 --tp 2 --ep 64 --seq 8192 \\
        --micro-batch 1 --activation-checkpointing full
    hybridlm plan --config configs/quickstart.yaml --gpus 8 --json
    hybridlm plan --preset nemotron-3-super-120b-a12b --gpus 512 --tp 2 --ep 64 --seq 8192 \
        --micro-batch 1 --kernels fused      # the activations of the CUDA kernels

The model comes from `--preset NAME` or `--config FILE` (a run config, whose data and train
sections give the defaults of --seq, --micro-batch, --precision, --activation-checkpointing,
--ep and --dp-replicate; or a model config), with `--set a.b=value` overrides. The numbers and
their assumptions are `hybridlm.train.distributed.plan`'s.
"""

from __future__ import annotations

import argparse
import json

from ..presets import PRESETS
from .args import add_overrides_arg

PRECISIONS = (
    "fp32",
    "bf16",
    "fp8",
    "nvfp4",
)  # train.distributed.plan.PRECISIONS (no torch)
AC_MODES = ("none", "selective", "full")
KERNELS = ("reference", "fused")  # train.distributed.plan.KERNELS


def register(sub: argparse._SubParsersAction) -> None:
    """Add `plan` to the CLI's sub-command parsers."""
    p = sub.add_parser(
        "plan", help="per-device memory and per-step communication of a training layout"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS), help="a named model configuration")
    src.add_argument("--config", help="a run config (model + data + train) or a model config")
    add_overrides_arg(p, "moe.top_k=8")
    p.add_argument("--gpus", type=int, required=True, help="devices of the job (the world size)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (modelled)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (modelled)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (default 1)")
    p.add_argument(
        "--dp-replicate",
        type=int,
        default=None,
        help="whole replicas (HSDP with dp_shard > 1; -1: DDP over what is left; default 1)",
    )
    p.add_argument("--seq", type=int, default=None, help="sequence length of a micro-batch row")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per device per micro-batch")
    p.add_argument("--precision", choices=PRECISIONS, default=None, help="default bf16")
    p.add_argument(
        "--activation-checkpointing", choices=AC_MODES, default=None, help="default none"
    )
    p.add_argument(
        "--kernels",
        choices=KERNELS,
        default="reference",
        help="the Mamba-2 chains' activations: pure torch (the CPU path, default) or the Triton"
        " kernels of ops.fused (the CUDA path)",
    )
    p.add_argument("--no-mtp", action="store_true", help="plan the model without its MTP module")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(fn=cmd_plan, uses_torch=True)


def cmd_plan(args: argparse.Namespace) -> None:
    from ..presets import get_preset
    from ..train.distributed.plan import plan, plan_inputs

    cfg, defaults = plan_inputs(args.config) if args.config else (get_preset(args.preset), {})
    if args.overrides:
        cfg = cfg.override(args.overrides)
    given = {
        "ep": args.ep,
        "dp_replicate": args.dp_replicate,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "precision": args.precision,
        "activation_checkpointing": args.activation_checkpointing,
    }
    kw = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    for key, flag in (("seq", "--seq"), ("micro_batch", "--micro-batch")):
        if key not in kw:
            raise ValueError(f"give {flag} (or a run config whose data section sets it)")
    result = plan(
        cfg,
        gpus=args.gpus,
        tp=args.tp,
        cp=args.cp,
        mtp=not args.no_mtp,
        name=args.preset or args.config,
        kernels=args.kernels,
        **kw,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.render())
