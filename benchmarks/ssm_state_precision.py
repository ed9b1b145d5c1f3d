"""SSM-state cache precision study: drift of each storage precision against fp32 over long decodes.

    python benchmarks/ssm_state_precision.py          # 4096 steps, writes runs/ssm_precision/
    python benchmarks/ssm_state_precision.py --steps 512 --out /tmp/ssm

One Mamba-2 mixer of the tiny-super preset decodes the same input stream token by token with its
SSM state stored in fp32 and in each low precision (`model.state_precision`). Every
`--every` steps it records, per precision, the relative state error ||s - s_fp32|| / ||s_fp32||
and the signed bias mean(s - s_fp32) / mean|s_fp32| (drift that does not average out). Rows go
to `metrics.jsonl`; `drift.png` is rendered from that file afterwards.

The inputs are the mixer's own: hidden states drawn once from N(0, 1) and fed through the real
in_proj / conv / dt path. The heads are set to long memory (dt = dt_min, A from 0.02 to 1, so the
per-step decay dt*A spans 2e-5 to 1e-3): there the per-step change of the state is below half an
fp16 ulp and round-to-nearest loses it, which is what stochastic rounding is for.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from hybridlm import HybridLM
from hybridlm.model.cache import MambaState
from hybridlm.model.state_precision import SSM_PRECISIONS
from hybridlm.presets import get_preset


def run(steps: int, every: int, seed: int) -> list[dict]:
    cfg = get_preset("tiny-super")
    cfg.pattern = "M"
    cfg.mtp.pattern = ""
    torch.manual_seed(seed)
    mixer = HybridLM(cfg, seed=seed).layers[0].mixer.eval()
    with torch.no_grad():  # long-memory heads: dt at dt_min, per-step decay dt*A from 2e-5 to 1e-3
        dt = torch.full_like(mixer.dt_bias, cfg.mamba.dt_min)
        mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        mixer.A_log.copy_(torch.linspace(math.log(0.02), 0.0, mixer.A_log.numel()))
    x = torch.randn(1, steps, cfg.d_model, generator=torch.Generator().manual_seed(seed))
    states = {p: MambaState(p, seed=seed) for p in SSM_PRECISIONS}
    rows = []
    with torch.no_grad():
        for t in range(steps):
            for st in states.values():
                mixer(x[:, t : t + 1], state=st)
            if (t + 1) % every == 0 or t == 0:
                ref = states["fp32"].ssm_BHPN
                for p, st in states.items():
                    if p == "fp32":
                        continue
                    s = st.ssm_BHPN
                    rows.append(
                        {
                            "step": t + 1,
                            "precision": p,
                            "rel_error": float((s - ref).norm() / ref.norm()),
                            "bias": float((s - ref).mean() / ref.abs().mean()),
                            "bytes": st.ssm_nbytes(),
                        }
                    )
    return rows


def plot(metrics: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for p in sorted({r["precision"] for r in rows}):
        mine = [r for r in rows if r["precision"] == p]
        steps = [r["step"] for r in mine]
        ax1.plot(steps, [r["rel_error"] for r in mine], label=p)
        ax2.plot(steps, [r["bias"] for r in mine], label=p)
    ax1.set(
        xlabel="decode step",
        ylabel="||s - s_fp32|| / ||s_fp32||",
        yscale="log",
        title="SSM state error vs fp32",
    )
    ax2.set(xlabel="decode step", ylabel="mean(s - s_fp32) / mean|s_fp32|", title="signed drift")
    ax2.axhline(0, color="k", lw=0.5)
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4096)
    p.add_argument("--every", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/ssm_precision")
    args = p.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        p.error("--steps and --every must be positive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run(args.steps, args.every, args.seed)
    metrics = out / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot(metrics, out / "drift.png")
    last = {r["precision"]: r for r in rows if r["step"] == rows[-1]["step"]}
    print(f"after {rows[-1]['step']} steps (state bytes per sequence for this layer):")
    for prec, r in last.items():
        print(
            f"  {prec:12s} rel_error {r['rel_error']:.2e}  bias {r['bias']:+.2e}  "
            f"bytes {r['bytes']}"
        )
    print(f"wrote {metrics} and {out / 'drift.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
