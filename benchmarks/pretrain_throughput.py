"""Pretraining throughput: hybridlm's `Trainer.train_step` vs a plain transformers NemotronH loop.

    python benchmarks/pretrain_throughput.py                  # tiny-super without MTP, 4 x 512
    python benchmarks/pretrain_throughput.py --tiny --batch 2 --seq 64 --steps 2 --json out.json

hybridlm runs its real optimizer step (`Trainer.train_step`: fused LM-head + CE, global-token
loss normalisation, grad clipping, LR schedule, AdamW, MoE bias update) in fp32; transformers
runs `loss = model(ids, labels=ids).loss; loss.backward(); opt.step(); opt.zero_grad()` (its own
loss) with
torch AdamW on the same config. Both start from identical weights (hybridlm's, converted with
`save_pretrained` / `AutoModelForCausalLM.from_pretrained`) and see the same batch every step.
Steps are interleaved so machine noise hits both alike; tokens/s are medians. MFU is
`config.flops_per_token(training=True) x tokens/s` over the best `torch.matmul` FLOP/s measured
in the same run. Exits 1 if the two models' logits disagree before training.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_config(preset: str, tiny: bool):
    from hybridlm.presets import get_preset

    cfg = get_preset(preset)
    cfg.mtp.pattern = ""  # transformers' NemotronH has no MTP module
    if tiny:  # the shape of the unit tests: seconds on one CPU thread
        cfg.vocab_size, cfg.d_model, cfg.pattern = 258, 64, "ME*"
        cfg.mamba.num_heads, cfg.mamba.head_dim = 4, 32
        cfg.mamba.state_size, cfg.mamba.chunk_size = 16, 16
        cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim = 4, 2, 16
        cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_hidden = 8, 2, 32
        cfg.moe.latent_size, cfg.moe.shared_expert_hidden = 32, 64
    cfg.validate()
    return cfg


def build_trainer(cfg, tmp: Path, *, batch: int, seq: int, device: str):
    """A real `Trainer` (byte data written to `tmp`) with its loader replaced by one batch."""
    from hybridlm.data.config import DataConfig, SourceConfig
    from hybridlm.train.config import RunConfig, TrainConfig
    from hybridlm.train.text_training import pretrain_trainer

    txt = tmp / "txt"
    txt.mkdir()
    for i in range(8):
        (txt / f"{i}.txt").write_text(f"Doc {i}. " + "The quick brown fox jumps. " * 40)
    data = DataConfig(
        sources=[SourceConfig(name="t", kind="text", path=str(txt))],
        shards_dir=str(tmp / "shards"),
        seq_len=seq,
        batch_size=batch,
        eval_fraction=0.0,
        num_workers=0,
    )
    train = TrainConfig(
        max_steps=10**6,
        warmup_steps=0,
        precision="fp32",
        out_dir=str(tmp / "run"),
        device=device,
        peak_flops=1.0,
        progress=False,
        plot=False,
    )
    return pretrain_trainer(RunConfig(model=cfg, data=data, train=train))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny-super")
    p.add_argument("--tiny", action="store_true", help="shrink the model to the unit-test shape")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from hybridlm.interop.hf import save_pretrained

    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = model_config(args.preset, args.tiny)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, Path(tmp), batch=args.batch, seq=args.seq, device=args.device)
        ours = trainer.model
        save_pretrained(ours, Path(tmp) / "hf")
        theirs = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", attn_implementation="sdpa")
    theirs = theirs.to(device).train()
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    with torch.no_grad():
        ours.eval()
        probe = x[:1, : min(64, args.seq)]
        diff = (ours(probe).logits - theirs(probe, use_cache=False).logits).abs().max().item()
        ours.train()
    if diff > 1e-4:
        print(f"models disagree (max |logit diff| {diff:.2e}); not benchmarking", file=sys.stderr)
        return 1

    # the same batch every step, in the loader's format (labels[t + 1] is the target of t)
    batch = {
        "input_ids": x.cpu(),
        "labels": x.cpu().clone(),
        "num_valid_tokens": torch.tensor(args.batch * (args.seq - 1)),
        "doc_ids": torch.zeros_like(x.cpu()),
    }
    trainer.module.train_loader = itertools.repeat(batch)
    tc = trainer.cfg
    opt = torch.optim.AdamW(
        theirs.parameters(), lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, foreach=True
    )

    def hf_step() -> None:
        loss = theirs(x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    runners = {"hybridlm": trainer.train_step, "transformers": hf_step}
    from hybridlm.train.text_training import measure_peak_flops

    peak = measure_peak_flops(device)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for i in range(args.warmup + args.steps):
        for k, fn in runners.items():  # interleaved
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if i >= args.warmup:
                times[k].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    ratio = tps["hybridlm"] / tps["transformers"]
    flops_tok = cfg.flops_per_token(args.seq, training=True)
    mfu = {k: flops_tok * v / peak for k, v in tps.items()}
    n_params = cfg.num_params().total
    print(
        f"pretrain {args.preset}{' (tiny)' if args.tiny else ''} no MTP fp32 AdamW, "
        f"{n_params / 1e6:.2f}M params, batch {args.batch} x {args.seq}, "
        f"{torch.get_num_threads()} threads: hybridlm {tps['hybridlm']:.0f} tok/s | "
        f"transformers {tps['transformers']:.0f} tok/s | ratio {ratio:.2f}x (target >= 1.8x) | "
        f"MFU hybridlm {100 * mfu['hybridlm']:.1f}% transformers "
        f"{100 * mfu['transformers']:.1f}% of matmul peak {peak / 1e9:.0f} GFLOP/s"
    )
    if args.json:
        results = {
            "preset": args.preset,
            "tiny": args.tiny,
            "params": n_params,
            "batch": args.batch,
            "seq": args.seq,
            "steps": args.steps,
            "threads": torch.get_num_threads(),
            "device": str(device),
            "max_logit_diff": diff,
            "tokens_per_s": tps,
            "ratio": ratio,
            "matmul_peak_flops": peak,
            "mfu": mfu,
            "step_times": times,
        }
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
