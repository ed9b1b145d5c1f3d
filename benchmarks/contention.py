"""Training and decode speed on a shared CPU: idle vs one CPU-bound neighbour, as ratios.

    python benchmarks/contention.py [--rounds 3] [--seconds 4] [--out runs/bench/contention]

For each threading setting, a fresh worker process measures pretraining tokens/s (the speedrun's
hybrid model, batch 8 x 256, AdamW) and batch-1 greedy decode tokens/s in three conditions:

- idle:      nothing else running;
- busy:      one CPU-bound neighbour (a Python spin loop) running before the worker starts;
- busy late: the neighbour starts after the worker has chosen its threads.

Settings: `hybridlm` = the CLI's `configure_threads()` (free cores at start, followed while it
runs), `torch` = PyTorch's defaults (one thread per core); `NAME:POLICY` (`hybridlm:PASSIVE`)
runs a setting with that `OMP_WAIT_POLICY`.
Conditions and settings are interleaved round by round; the table shows medians and each busy
condition as a ratio of the same setting's idle speed (the target is >= 0.4).
Results go to `metrics.jsonl` (one row per measurement) and `contention.png` in `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPIN = "while True: pass"


def worker(setting: str, seconds: float) -> None:
    info: dict = {}
    setting, _, policy = setting.partition(":")
    if policy:  # `hybridlm:ACTIVE` -- a wait policy set by the user, which configure_threads keeps
        os.environ["OMP_WAIT_POLICY"] = "" if policy == "runtime" else policy
    if setting == "hybridlm":
        from hybridlm.threads import configure_threads

        info = configure_threads(None)
    import torch
    import yaml

    print("ready", flush=True)
    sys.stdin.readline()  # the parent starts a late neighbour, then says go

    from hybridlm.config import ModelConfig
    from hybridlm.infer.generate import generate
    from hybridlm.model.model import HybridLM
    from hybridlm.train.objectives import causal_lm_loss

    spec = yaml.safe_load((ROOT / "configs" / "speedrun.yaml").read_text())["pretrain"]["model"]
    cfg = ModelConfig.from_dict(spec)
    model = HybridLM(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (8, 256), generator=gen)

    def step() -> None:
        out = model(x, mtp_depth=model.train_mtp_depth, return_logits=False)
        causal_lm_loss(model, out, x)[0].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 2:
        step()
        n += 1
    train = n * x.numel() / (time.perf_counter() - t0)

    model.eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 16), generator=gen)
    with torch.no_grad():
        generate(model, prompt, 4)
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 2 or steps == 0:
            generate(model, prompt, 32)
            steps += 32
    decode = steps / (time.perf_counter() - t0)
    from hybridlm.threads import governor

    gov = governor()
    out = {
        "threads": torch.get_num_threads(),
        "threads_start": info.get("threads", torch.get_num_threads()),
        "thread_changes": len(gov.changes) if gov else 0,
        "train_tok_s": train,
        "decode_tok_s": decode,
    }
    print(json.dumps({**out, "config": info}), flush=True)


def measure(setting: str, condition: str, seconds: float) -> dict:
    spin = None
    if condition == "busy":
        spin = subprocess.Popen([sys.executable, "-c", SPIN])
        time.sleep(0.5)
    cmd = [sys.executable, __file__, "--worker", setting, "--seconds", str(seconds)]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"worker {setting} failed to start")
        if condition == "busy late":
            spin = subprocess.Popen([sys.executable, "-c", SPIN])
            time.sleep(0.3)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if proc.wait(timeout=600) != 0 or not line:
            raise RuntimeError(f"worker {setting} / {condition} failed")
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
        if proc.poll() is None:
            proc.kill()
    return json.loads(line)


def plot(rows: list[dict], out: Path) -> None:
    from hybridlm.report.plot import pyplot, save_figure

    plt = pyplot()
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    conds = ["idle", "busy", "busy late"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(
        axes, ("train_tok_s", "decode_tok_s"), ("pretraining", "batch-1 greedy decode"), strict=True
    ):
        width = 0.8 / len(settings)
        top = 0.0
        for i, s in enumerate(settings):
            meds = [
                statistics.median(r[key] for r in rows if r["setting"] == s and r["condition"] == c)
                for c in conds
            ]
            xs = [j + (i - (len(settings) - 1) / 2) * width for j in range(len(conds))]
            ax.bar(xs, meds, width, label=f"{s} threading")
            top = max(top, *meds)
        ax.set_xticks(range(len(conds)), conds)
        ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
        ax.set_ylabel("tokens / s (median of rounds)")
        ax.set_title(title)
        ax.legend(loc="upper right", ncol=len(settings), fontsize=8)
    fig.suptitle("CPU contention: one CPU-bound neighbour process")
    save_figure(fig, out / "contention.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="measuring time per workload")
    ap.add_argument("--settings", default="hybridlm,torch")
    ap.add_argument("--out", default="runs/bench/contention")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.seconds)
        return

    settings = args.settings.split(",")
    conds = ["idle", "busy", "busy late"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with open(out / "metrics.jsonl", "w") as f:
        for r in range(args.rounds):
            for s in settings:
                for c in conds:
                    res = measure(s, c, args.seconds)
                    row = {"round": r, "setting": s, "condition": c, **res}
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(
                        f"round {r} {s:16s} {c:10s} "
                        f"threads {res['threads_start']}->{res['threads']}  "
                        f"train {res['train_tok_s']:7.0f} tok/s  "
                        f"decode {res['decode_tok_s']:6.1f} tok/s",
                        flush=True,
                    )

    print(f"\nmedians over {args.rounds} rounds; ratio = busy / idle of the same setting")
    print(
        f"{'setting':9s} {'condition':10s} {'train tok/s':>12s} {'ratio':>6s} "
        f"{'decode tok/s':>13s} {'ratio':>6s}"
    )
    summary = {}
    for s in settings:
        base = {}
        for c in conds:
            sel = [x for x in rows if x["setting"] == s and x["condition"] == c]
            tr = statistics.median(x["train_tok_s"] for x in sel)
            de = statistics.median(x["decode_tok_s"] for x in sel)
            if c == "idle":
                base = {"train": tr, "decode": de}
            rt, rd = tr / base["train"], de / base["decode"]
            summary[f"{s}/{c}"] = {"train_ratio": rt, "decode_ratio": rd}
            print(f"{s:16s} {c:10s} {tr:12.0f} {rt:6.2f} {de:13.1f} {rd:6.2f}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(rows, out)
    for s in settings:
        worst = min(
            min(v["train_ratio"], v["decode_ratio"])
            for k, v in summary.items()
            if k.startswith(f"{s}/") and not k.endswith("/idle")
        )
        print(f"{s} threading: worst busy / idle ratio {worst:.2f} (target >= 0.40)")
    if "hybridlm" in settings and "torch" in settings:
        idle = {
            s: statistics.median(
                x["train_tok_s"] for x in rows if x["setting"] == s and x["condition"] == "idle"
            )
            for s in ("hybridlm", "torch")
        }
        ratio = idle["hybridlm"] / idle["torch"]
        print(f"idle pretraining, hybridlm / torch defaults: {ratio:.2f}")
    print(f"wrote {out / 'metrics.jsonl'} and {out / 'contention.png'}")


if __name__ == "__main__":
    main()
