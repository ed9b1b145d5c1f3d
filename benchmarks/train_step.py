"""Forward+backward throughput: hybridlm vs transformers' NemotronH, same config, same weights.

    python benchmarks/train_step.py                       # tiny-super backbone, batch 4 x 512
    python benchmarks/train_step.py --batch 2 --seq 256 --steps 3 --json out.json

Both models get identical weights (hybridlm's, converted with `interop.hf`), the same batch and
the same number of timed steps, interleaved so machine noise hits both alike. Reports tokens/s of
each, the ratio, and achieved matmul GFLOP/s (config.flops_per_token(training=True) x tokens/s)
as a fraction of the best `torch.matmul` throughput measured in the same run. MTP is off in both
(transformers' NemotronH has no MTP module); hybridlm runs its training path (fused LM-head + CE,
`return_logits=False`), transformers its standard one. Exits 1 if the two models' logits disagree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext

import torch


def step_time(fn, x, autocast_dtype) -> float:
    ctx = (
        torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    )
    t0 = time.perf_counter()
    with ctx:
        loss = fn(x)
    loss.backward()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny-super")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from hybridlm import HybridLM
    from hybridlm.interop.hf import save_pretrained
    from hybridlm.presets import get_preset
    from hybridlm.train.objectives import causal_lm_loss
    from hybridlm.train.text_training import measure_peak_flops

    torch.manual_seed(0)
    cfg = get_preset(args.preset)
    cfg.mtp.pattern = ""
    ours = HybridLM(cfg, seed=0).train()
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, tmp)
        theirs = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").train()
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    with torch.no_grad():
        diff = (
            (ours(x[:1, :64]).logits - theirs(x[:1, :64], use_cache=False).logits)
            .abs()
            .max()
            .item()
        )
    if diff > 1e-4:
        print(f"models disagree (max |logit diff| {diff:.2e}); not benchmarking", file=sys.stderr)
        return 1

    runners = {
        "hybridlm": lambda ids: causal_lm_loss(ours, ours(ids, return_logits=False), ids)[1]["ce"],
        "transformers": lambda ids: theirs(ids, labels=ids, use_cache=False).loss,
    }
    n_params = cfg.num_params().total
    flops_tok = cfg.flops_per_token(args.seq, training=True)
    tokens = args.batch * args.seq
    results = {
        "preset": args.preset,
        "params": n_params,
        "batch": args.batch,
        "seq": args.seq,
        "threads": torch.get_num_threads(),
        "max_logit_diff": diff,
        "runs": {},
    }
    print(
        f"{args.preset} without MTP: {n_params / 1e6:.1f}M params, "
        f"batch {args.batch} x {args.seq}, "
        f"{torch.get_num_threads()} threads, logits agree to {diff:.1e}"
    )
    for name in args.dtypes.split(","):
        dtype = {"fp32": None, "bf16": torch.bfloat16}[name]
        # the best torch.matmul throughput on offer: fp32, or the autocast dtype if faster
        # (CPUs without bf16 units emulate bf16 GEMMs far below fp32 speed)
        peak = measure_peak_flops("cpu", torch.float32) / 1e9
        if dtype is not None:
            peak = max(peak, measure_peak_flops("cpu", dtype) / 1e9)
        times = {k: [] for k in runners}
        for i in range(args.warmup + args.steps):
            for k, fn in runners.items():  # interleaved
                for m in (ours, theirs):
                    m.zero_grad(set_to_none=True)
                t = step_time(fn, x, dtype)
                if i >= args.warmup:
                    times[k].append(t)
        med = {k: statistics.median(v) for k, v in times.items()}
        tps = {k: tokens / v for k, v in med.items()}
        ratio = tps["hybridlm"] / tps["transformers"]
        frac = flops_tok * tps["hybridlm"] / 1e9 / peak
        results["runs"][name] = {
            "tokens_per_s": tps,
            "ratio": ratio,
            "matmul_peak_gflops": peak,
            "hybridlm_gflops": flops_tok * tps["hybridlm"] / 1e9,
            "peak_fraction": frac,
        }
        print(
            f"[{name}] hybridlm {tps['hybridlm']:8.0f} tok/s | "
            f"transformers {tps['transformers']:8.0f} tok/s"
            f" | ratio {ratio:.2f}x | hybridlm {flops_tok * tps['hybridlm'] / 1e9:.1f} GFLOP/s"
            f" = {100 * frac:.0f}% of matmul peak {peak:.0f} GFLOP/s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
