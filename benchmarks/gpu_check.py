"""One GPU, under 8 minutes: parity of the CUDA fast paths, the training-step MFU of a ~1B hybrid,
and batch-1 / batch-64 decode tok/s next to transformers on the same weights.

    python benchmarks/gpu_check.py                  # all sections, one JSON line each
    python benchmarks/gpu_check.py --only parity,decode

parity   on CUDA against CPU references: `ssd_chunked` (fp32) vs the token recurrence in fp64;
         SDPA (the flash backend forced, bf16) vs `attention_ref` in fp32; `_experts_grouped`
         (`F.grouped_mm`) vs the per-expert loop; tiny-super's logits on CUDA vs CPU (fp32).
         mamba-ssm's Triton SSD and causal-conv1d are used when importable (reported either way).
train    the ~1B hybrid of `parallel_gpu.py` (bf16 autocast, fp32 master weights, FSDP2 over one
         rank, the library's optimizer step), tokens/s and MFU against the bf16 matmul peak
         measured in the same run.
decode   `decode.memory_bound_config()` (super-150m) in bf16: greedy `infer.generate.generate`
         vs transformers' `generate` on the same weights, batch 1 and batch 64, interleaved,
         median tok/s of each and greedy-token agreement (bf16 rounding lets long greedy runs
         part, so agreement is reported, not required).

Every section catches its own failure and prints it, so one run reports all it can.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SECTIONS = ("parity", "train", "decode")


def _emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).abs().max())


def section_parity(device: torch.device) -> None:
    from hybridlm import HybridLM
    from hybridlm.model.moe import _experts_grouped, _experts_loop
    from hybridlm.ops.attention import attention, attention_ref
    from hybridlm.ops.ssd import ssd_chunked, ssd_recurrent
    from hybridlm.presets import get_preset

    g = torch.Generator().manual_seed(0)
    avail = {}
    for mod in ("mamba_ssm", "causal_conv1d"):
        try:
            __import__(mod)
            avail[mod] = True
        except Exception:
            avail[mod] = False
    _emit({"section": "parity", "kernels_importable": avail})

    B, L, H, P, G, N = 2, 300, 8, 64, 2, 64
    x = torch.randn(B, L, H, P, generator=g)
    dt = torch.rand(B, L, H, generator=g) * 0.1
    A = -torch.rand(H, generator=g) - 0.5
    Bm, Cm = torch.randn(B, L, G, N, generator=g), torch.randn(B, L, G, N, generator=g)
    D = torch.randn(H, generator=g)
    ref_y, ref_s = ssd_recurrent(*(t.double() for t in (x, dt, A, Bm, Cm, D)))
    cu = [t.to(device) for t in (x, dt, A, Bm, Cm, D)]
    y, s = ssd_chunked(*cu, 64)
    _emit(
        {
            "section": "parity",
            "what": "ssd_chunked cuda fp32 vs recurrence fp64",
            "max_err_y": _max_err(y, ref_y),
            "max_err_state": _max_err(s, ref_s),
            "scale": float(ref_y.abs().max()),
        }
    )

    q = torch.randn(2, 8, 512, 128, generator=g)
    k, v = torch.randn(2, 2, 512, 128, generator=g), torch.randn(2, 2, 512, 128, generator=g)
    ref = attention_ref(q, k, v)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qc, kc, vc = (t.to(device, torch.bfloat16) for t in (q, k, v))
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = attention(qc, kc, vc)
        backend = "flash"
    except RuntimeError as err:
        o, backend = attention(qc, kc, vc), f"default (flash refused: {str(err)[:80]})"
    _emit(
        {
            "section": "parity",
            "what": "SDPA bf16 causal GQA vs attention_ref fp32",
            "backend": backend,
            "max_err": _max_err(o, ref),
            "scale": float(ref.abs().max()),
        }
    )

    counts = [5, 0, 17, 3, 8, 0, 1, 30]
    z = torch.randn(sum(counts), 64, generator=g).to(device)
    up = (torch.randn(8, 96, 64, generator=g) * 0.1).to(device)
    down = (torch.randn(8, 64, 96, generator=g) * 0.1).to(device)
    _emit(
        {
            "section": "parity",
            "what": "experts F.grouped_mm vs per-expert loop, fp32 cuda",
            "max_err": _max_err(
                _experts_grouped(z, counts, up, down), _experts_loop(z, counts, up, down)
            ),
        }
    )

    cfg = get_preset("tiny-super")
    model = HybridLM(cfg, seed=0).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 256), generator=g)
    with torch.no_grad():
        ref = model(ids).logits
        got = model.to(device)(ids.to(device)).logits
    _emit(
        {
            "section": "parity",
            "what": "tiny-super logits cuda vs cpu, fp32",
            "max_err": _max_err(got, ref),
            "scale": float(ref.abs().max()),
        }
    )


def section_train(
    device: torch.device, steps: int, batch: int, seq: int, profile: bool = False
) -> None:
    import torch.distributed as dist

    from hybridlm.train.text_training import measure_peak_flops
    from parallel_gpu import hybrid_1b, run_mode

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29519")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("nccl")
    try:
        cfg = hybrid_1b(False)
        peak = measure_peak_flops(device, torch.bfloat16, 8192)
        args = argparse.Namespace(steps=steps, warmup=2, batch=batch, seq=seq)
        row = run_mode(cfg, "none", args, device, peak)
        if profile:  # where a step's GPU time goes: one more step under torch.profiler
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                run_mode(cfg, "none", argparse.Namespace(steps=1, warmup=0, batch=batch, seq=seq),
                         device, peak)  # fmt: skip
            events = sorted(
                prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0)
            )
            total = sum(getattr(e, "self_device_time_total", 0) for e in events) or 1
            _emit(
                {
                    "section": "train",
                    "top_gpu_ops": [
                        [e.key[:60], e.count, round(e.self_device_time_total / total, 3)]
                        for e in events[:15]
                    ],
                }
            )
        n = cfg.num_params()
        _emit(
            {
                "section": "train",
                "params_total": n.total,
                "params_active": n.active,
                "batch": batch,
                "seq": seq,
                "matmul_peak_tflops": round(peak / 1e12, 1),
                **row,
            }
        )
    finally:
        dist.destroy_process_group()


def section_decode(device: torch.device, new_tokens: int, repeats: int) -> None:
    from transformers import AutoModelForCausalLM

    from decode import greedy_config, memory_bound_config
    from hybridlm import HybridLM
    from hybridlm.infer.generate import generate
    from hybridlm.interop.hf import save_pretrained

    cfg = memory_bound_config()
    ours = HybridLM(cfg, seed=0).eval()
    theirs, note = None, None
    try:  # an older transformers may not read the exported config: time hybridlm alone then
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(ours, tmp)
            theirs = AutoModelForCausalLM.from_pretrained(tmp).eval().to(device, torch.bfloat16)
    except Exception as err:
        note = f"transformers could not load the checkpoint: {type(err).__name__}: {err}"[:300]
    ours = ours.to(device, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    for bsz in (1, 64):
        x = torch.randint(0, cfg.vocab_size, (bsz, 16), generator=g).to(device)
        gen_cfg = greedy_config(new_tokens)

        def run_theirs(x=x, gen_cfg=gen_cfg):
            with torch.no_grad():
                return theirs.generate(
                    x, attention_mask=torch.ones_like(x), generation_config=gen_cfg
                )[:, x.shape[1] :]

        def run_ours(x=x):
            return generate(ours, x, new_tokens)

        runners = {"hybridlm": run_ours}
        if theirs is not None:
            runners["transformers"] = run_theirs
        toks = {k: fn() for k, fn in runners.items()}  # warm-up
        times = {k: [] for k in runners}
        for r in range(repeats):
            for k in list(runners)[:: 1 if r % 2 == 0 else -1]:
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                runners[k]()
                torch.cuda.synchronize(device)
                times[k].append(time.perf_counter() - t0)
        tps = {k: bsz * new_tokens / statistics.median(v) for k, v in times.items()}
        row = {
            "section": "decode",
            "model": "super-150m bf16",
            "batch": bsz,
            "new_tokens": new_tokens,
            "tok_s": {k: round(v, 1) for k, v in tps.items()},
        }
        if theirs is not None:
            row["ratio"] = round(tps["hybridlm"] / tps["transformers"], 3)
            same = (toks["hybridlm"] == toks["transformers"]).all(1).float().mean().item()
            row["rows_with_identical_greedy_tokens"] = same
        else:
            row["note"] = note
        _emit(row)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SECTIONS))
    p.add_argument("--train-steps", type=int, default=6)
    p.add_argument("--train-batch", type=int, default=4)
    p.add_argument("--train-seq", type=int, default=4096)
    p.add_argument("--profile", action="store_true", help="also the top GPU ops of a step")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: gpu_check.py measures GPU fast paths only", file=sys.stderr)
        return 0
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    _emit(
        {
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "commit": os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip(),
        }
    )
    only = [s for s in args.only.split(",") if s]
    failed = 0
    for name in only:
        t0 = time.perf_counter()
        try:
            if name == "parity":
                section_parity(device)
            elif name == "train":
                section_train(
                    device, args.train_steps, args.train_batch, args.train_seq, args.profile
                )
            elif name == "decode":
                section_decode(device, args.new_tokens, args.repeats)
            else:
                raise ValueError(f"unknown section {name!r}")
        except Exception as err:
            failed += 1
            _emit({"section": name, "error": f"{type(err).__name__}: {err}"[:500]})
            traceback.print_exc()
        _emit({"section": name, "seconds": round(time.perf_counter() - t0, 1)})
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
