"""Training throughput of a ~1B-parameter hybrid (Mamba-2 + attention + LatentMoE + MTP) under
FSDP2 on one GPU, with and without activation checkpointing: tokens/s, MFU and peak memory.

    python benchmarks/parallel_gpu.py                     # CUDA: bf16, 4 x 4096 tokens
    python benchmarks/parallel_gpu.py --tiny --steps 2    # CPU smoke run (gloo), seconds

Every step is the library's: `apply_activation_checkpointing`, FSDP2 `apply_fsdp2` over a
one-rank process group (nccl on CUDA), bf16 autocast with fp32 master weights, the fused LM-head
cross-entropy with MTP and the MoE balancing loss (`causal_lm_loss`), `optim.optimizer_step`
(clip, AdamW, MoE bias step). The routed experts run on `F.grouped_mm` on CUDA. MFU is
`flops_per_token(training=True) x tokens/s` over the bf16 matmul FLOP/s measured in the same
run (also printed against the device's nominal dense bf16 peak when it is known: H100/H200
989 TFLOP/s). Sized to finish in under 8 minutes on one H100/H200; prints one JSON line per
mode. Run it as `python` (it starts its own one-rank group) or under `torchrun` with one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

NOMINAL_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def hybrid_1b(tiny: bool):
    """~0.95B parameters (0.42B active): the Nemotron 3 Super layout at width 1536."""
    from hybridlm.presets import get_preset

    c = get_preset("nemotron-3-super-120b-a12b")
    c.d_model, c.pattern, c.vocab_size = 1536, "MEMEM*EMEMEM*EMEME", 32768
    c.mamba.num_heads, c.mamba.head_dim, c.mamba.n_groups, c.mamba.state_size = 48, 64, 8, 128
    c.attention.num_heads, c.attention.num_kv_heads, c.attention.head_dim = 12, 2, 128
    c.moe.num_experts, c.moe.top_k, c.moe.expert_hidden = 32, 4, 1536
    c.moe.latent_size, c.moe.shared_expert_hidden = 768, 3072
    c.mtp.pattern = "*E"
    if tiny:
        c.d_model, c.pattern, c.vocab_size = 64, "ME*", 258
        c.mamba.num_heads, c.mamba.head_dim, c.mamba.n_groups, c.mamba.state_size = 4, 32, 1, 16
        c.mamba.chunk_size = 16
        c.attention.num_heads, c.attention.num_kv_heads, c.attention.head_dim = 4, 2, 16
        c.moe.num_experts, c.moe.top_k, c.moe.expert_hidden = 8, 2, 32
        c.moe.latent_size, c.moe.shared_expert_hidden = 32, 64
    c.validate()
    return c


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dense_1b(tiny: bool = False):
    """~1.5B dense Olmo-3-style transformer (the OLMo 2 1B shape: 16 layers of width 2048, 16
    heads, SwiGLU 8192, Olmo 3's vocabulary, QK-norm, post-norm, SWA on 3 of 4 layers);
    `tiny`: the tiny-olmo preset."""
    from hybridlm.presets import get_preset

    if tiny:
        return get_preset("tiny-olmo")
    c = get_preset("olmo-3-7b")
    c.d_model, c.pattern = 2048, "*-" * 16
    c.attention.num_heads, c.attention.num_kv_heads, c.attention.head_dim = 16, 16, 128
    c.mlp.hidden = 8192
    c.validate()
    return c


def learnable_ids(vocab: int, batch: int, seq: int, period: int = 64) -> torch.Tensor:
    """Rows that repeat a random segment of `period` tokens: a model learns to copy them within a
    few hundred steps, so a loss curve means something (random tokens only reach log V)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    seg = torch.randint(0, vocab, (batch, period), generator=gen)
    return seg.repeat(1, -(-seq // period))[:, :seq]


def run_mode(
    cfg,
    mode: str,
    args,
    device: torch.device,
    peak: float,
    *,
    fused: bool = True,
    compile: bool | str = False,
    bf16_params: bool = False,
    fp8: bool = False,
    ids: torch.Tensor | None = None,
) -> dict:
    """One configuration's training steps. `fused`: the Triton kernels of `ops.fused` on CUDA
    (off: the pure-torch chains); `compile`: regional torch.compile (`train.compile`; a string
    names the backend); `bf16_params`: FSDP2 gathers bf16 parameters (routers fp32; what
    `train.precision: bf16` does under FSDP2); `fp8`: torchao Float8Linear on the Super
    recipe's quantised linears (`train.low_precision: fp8`). `ids`: the rows to train on
    (default: random tokens)."""
    from hybridlm.model.model import build_model
    from hybridlm.ops import fused as fused_ops
    from hybridlm.precision.fp8 import convert_for_fp8_training
    from hybridlm.train.activation_checkpointing import apply_activation_checkpointing
    from hybridlm.train.compile import apply_compile
    from hybridlm.train.config import TrainConfig
    from hybridlm.train.distributed.parallel import apply_fsdp2
    from hybridlm.train.objectives import causal_lm_loss
    from hybridlm.train.optim import build_optimizer, optimizer_step

    tc = TrainConfig(lr=3e-4, warmup_steps=1, max_steps=args.steps + args.warmup, progress=False)
    model = build_model(cfg, seed=0, device=device)
    cuda = device.type == "cuda"
    if fp8:
        convert_for_fp8_training(model)
    apply_activation_checkpointing(model, mode)
    if compile:
        apply_compile(model, *([compile] if isinstance(compile, str) else []))
    apply_fsdp2(model, param_dtype=torch.bfloat16 if bf16_params and cuda else None)
    optimizer = build_optimizer(model, tc)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if ids is None:
        gen = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    ids = ids.to(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []

    def head(out):  # the loss inside the forward, where FSDP2 has the LM head unsharded
        return causal_lm_loss(model, out, ids, include_aux=True)

    with fused_ops.enabled(fused):
        for step in range(args.warmup + args.steps):
            sync(device)
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=dtype, enabled=cuda):
                out = model(ids, mtp_depth=model.train_mtp_depth, return_logits=False, head=head)
            loss = out.head[0]
            loss.backward()
            losses.append(float(loss.detach()))
            optimizer_step(
                model,
                optimizer,
                params,
                loss=losses[-1],
                tc=tc,
                step=step,
                total_steps=tc.max_steps,
            )
            sync(device)
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
    tok_s = args.batch * args.seq / statistics.median(times)
    flops = cfg.flops_per_token(args.seq, training=True) * tok_s
    row = {
        "activation_checkpointing": mode,
        "fused": fused,
        "compile": compile,
        "bf16_params": bf16_params,
        "fp8": fp8,
        "losses": [round(v, 4) for v in losses],
        "tokens_per_s": round(tok_s, 1),
        "mfu_measured_peak": round(flops / peak, 4),
        "step_s_median": round(statistics.median(times), 4),
    }
    if device.type == "cuda":
        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        name = torch.cuda.get_device_name(device)
        nominal = next((v for k, v in NOMINAL_BF16.items() if k in name), None)
        if nominal:
            row["mfu_nominal_peak"] = round(flops / nominal, 4)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default="none,selective,full")
    ap.add_argument("--tiny", action="store_true", help="the unit tests' shape (CPU smoke run)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("no CUDA device: run with --tiny for a CPU smoke run", file=sys.stderr)
        return 0
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 64)
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    cfg = hybrid_1b(args.tiny)
    counts = cfg.num_params()
    from hybridlm.train.text_training import measure_peak_flops

    peak = measure_peak_flops(
        device, torch.bfloat16 if cuda else torch.float32, 8192 if cuda else 512
    )
    head = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "params_total": counts.total,
        "params_active": counts.active,
        "batch": args.batch,
        "seq": args.seq,
        "matmul_peak_tflops": round(peak / 1e12, 2),
        "torch": torch.__version__,
    }
    print(json.dumps(head), flush=True)
    for mode in args.modes.split(","):
        print(json.dumps(run_mode(cfg, mode, args, device, peak)), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
