"""Does a fresh model learn to copy from its context (form induction heads), and how fast?

    python benchmarks/copy_formation.py [--runs MODEL:TASK:STEPS[:LR] ...] [--out DIR]

RULER's needles, variable chains and word lists are read back by copying a span seen earlier
(Olsson et al. 2022, "In-context learning and induction heads"): find where the current prefix
occurred, emit what followed. This trains fresh models of the speedrun's width (its pretrain
model in configs/speedrun.yaml: d 128, 4 query / 2 KV heads of 32, Mamba-2 4 x 64, state 32,
its LatentMoE) from scratch on two synthetic copy tasks and reports the loss on the copied
tokens, next to the same tokens' loss without copying (log 26 = 3.258 nats):

- `gap`: `BOS x filler_a x filler_b` per row, x 48 random tokens of 26, the filler between the
  copies 0..32 random tokens (so the copy sits at a different offset in every row, and a head
  that attends a fixed distance back cannot solve it); the loss is on x[1:] of the second copy;
- `rep`: `BOS x x x ...` to 160 tokens, |x| drawn from 8..32 per row; the loss is on every token
  from the second one of the second x on (dense copy signal, the offset again varying by row).

Models (`MODEL`): a `HybridLM` layer pattern, NoPE attention, or with `+rope` RoPE (theta
10,000), e.g. `MEM*EME` (the speedrun's hybrid, its LatentMoE included), `M*`, `*-*-+rope`; or
`reference`: a plain PyTorch two-layer attention-only transformer with learned absolute
positions (the peer that shows how many steps the task takes outside this code base). AdamW,
lr `LR` (default 3e-3, 1e-3 for the reference), no weight decay, 16 rows per step, seed 0.
Writes `DIR/results.json` (default runs/copy_formation: command, commit, versions, the loss
every 50 steps) and prints one line per run.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch import nn

from hybridlm.config import ModelConfig
from hybridlm.model.model import HybridLM
from hybridlm.provenance import command_line, cpu_info, git_state, library_versions

SYMBOLS, ROWS, VOCAB = 26, 16, 64
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RUNS = (
    "*-*-+rope:gap:3000",
    "reference:gap:2000",
    "M*:gap:600",
    "M*:rep:1200",
    "MM*:rep:800",
    "M*E:rep:800",
    "MEM*:rep:800",
    "MEM*EME:rep:1200",
    "MEM*EME:rep:1200:1e-3",
)


def batch(task: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [ROWS, L], mask [ROWS, L-1] over the next-token targets that a copy predicts)."""
    rows, masks = [], []
    bos = torch.ones(1, dtype=torch.long)
    for _ in range(ROWS):
        if task == "gap":
            n, gap = 48, 32
            x = torch.randint(2, 2 + SYMBOLS, (n,), generator=g)
            fill = torch.randint(2, 2 + SYMBOLS, (gap,), generator=g)
            m = int(torch.randint(0, gap + 1, (1,), generator=g))
            row = torch.cat([bos, x, fill[:m], x, fill[m:]])
            mask = torch.zeros(row.numel() - 1)
            mask[1 + n + m : 2 * n + m] = 1  # targets x[1:] of the second copy
        elif task == "rep":
            k = int(torch.randint(8, 33, (1,), generator=g))
            x = torch.randint(2, 2 + SYMBOLS, (k,), generator=g)
            row = torch.cat([bos, x.repeat(160 // k + 1)[:160]])
            mask = torch.zeros(160)
            mask[k + 1 :] = 1  # targets from the second token of the second repetition on
        else:
            raise ValueError(f"unknown task {task!r}; choose gap or rep")
        rows.append(row)
        masks.append(mask)
    return torch.stack(rows), torch.stack(masks)


class Reference(nn.Module):
    """Two pre-norm attention-only layers (4 heads), learned absolute positions."""

    def __init__(self, d: int = 128, heads: int = 4, layers: int = 2, max_len: int = 256):
        super().__init__()
        self.heads = heads
        self.embed, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(max_len, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d, bias=False) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))
        self.final, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, L = ids.shape
        x = self.embed(ids) + self.pos(torch.arange(L))
        for norm, qkv, out in zip(self.norms, self.qkv, self.out, strict=True):
            q, k, v = qkv(norm(x)).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + out(o.transpose(1, 2).reshape(B, L, -1))
        return self.head(self.final(x))


def build(name: str) -> tuple[nn.Module, float]:
    if name == "reference":
        torch.manual_seed(0)
        return Reference(), 1e-3
    pattern, rope = name.removesuffix("+rope"), 1e4 if name.endswith("+rope") else None
    # the speedrun's pretrain model (configs/speedrun.yaml), with this task's vocabulary, no MTP
    # head, and 512-wide MLPs for the `-` layers of attention-only patterns
    spec = yaml.safe_load((ROOT / "configs" / "speedrun.yaml").read_text())["pretrain"]["model"]
    cfg = ModelConfig.from_dict(
        {
            **spec,
            "vocab_size": VOCAB,
            "pattern": pattern,
            "mtp": {},
            "mlp": {"hidden": 512},
            "attention": {**spec["attention"], "rope_theta": rope},
        }
    )
    model = HybridLM(cfg, seed=0)
    return model, 3e-3


def train(name: str, task: str, steps: int, lr: float | None = None) -> dict:
    model, default_lr = build(name)
    lr = default_lr if lr is None else lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    curve, t0 = [], time.perf_counter()
    for step in range(steps + 1):
        ids, mask = batch(task, g)
        out = model(ids)
        logits = (out if isinstance(out, torch.Tensor) else out.logits)[:, :-1]
        nll = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        copied = float((nll.detach().view_as(mask) * mask).sum() / mask.sum())
        opt.zero_grad()
        nll.mean().backward()
        opt.step()
        if step % 50 == 0:
            curve.append({"step": step, "copied_loss": copied})
    return {
        "model": name,
        "task": task,
        "steps": steps,
        "lr": lr,
        "curve": curve,
        "final": curve[-1]["copied_loss"],
        "no_copy": math.log(SYMBOLS),
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="MODEL:TASK:STEPS[:LR]")
    ap.add_argument("--out", type=Path, default=Path("runs/copy_formation"))
    args = ap.parse_args(argv)
    results = []
    for spec in args.runs:
        name, task, *rest = spec.split(":")
        if not rest or len(rest) > 2 or task not in ("gap", "rep"):
            raise SystemExit(
                f"--runs takes MODEL:TASK:STEPS[:LR] with TASK gap or rep, got {spec!r}"
            )
        r = train(name, task, int(rest[0]), float(rest[1]) if len(rest) == 2 else None)
        first_low = next((c["step"] for c in r["curve"] if c["copied_loss"] < 1.0), None)
        print(
            f"[{name} {task} lr {r['lr']:g}] copied-token loss "
            f"{r['curve'][0]['copied_loss']:.3f} -> "
            f"{r['final']:.3f} after {r['steps']} steps (no copying: {r['no_copy']:.3f}; "
            f"below 1.0 from step {first_low}); {r['seconds']:.0f} s",
            flush=True,
        )
        results.append(r)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": command_line(),
        "git": git_state(Path(__file__).resolve().parent),
        "versions": library_versions(),
        "cpu": cpu_info(),
        "runs": results,
    }
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    print(f"results: {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
