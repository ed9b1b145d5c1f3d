"""A small byte-level hybrid LM with a trained MTP head, for the speculative-decoding benchmark.

    from _tiny_train import spec_config, load_split, train, load_or_train

`spec_config()` is tiny-super's shape scaled to train in minutes on 2 CPU cores: Mamba-2 /
LatentMoE / one NoPE GQA attention block ("MEM*EME", d 192), byte vocabulary (258 ids,
`ByteTokenizer`) and a shared-weight "*E" MTP layer trained at depth 3. `train()` is a plain AdamW
loop over random windows of the first 90% of the text (`load_split` holds out the last 10%); it
appends one row per logged step to `metrics.jsonl` next to the checkpoint, and
`plot_training()` renders the loss curves from that file.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from hybridlm import HybridLM, ModelConfig
from hybridlm.data.builtin import read_text
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.interop.hf import save_pretrained
from hybridlm.io import load_model
from hybridlm.presets import get_preset
from hybridlm.report.plot import save_figure
from hybridlm.train.objectives import causal_lm_loss

HELD_OUT_FRACTION = 0.1


def spec_config(*, mtp_depth: int = 3, mtp_loss_weight: float = 1.0) -> ModelConfig:
    """tiny-super scaled down: 7 blocks at d 192, experts 16 top-4 with latent 48, MTP "*E".

    `mtp_loss_weight` defaults to 1.0 (the papers use 0.3): this model trains for minutes, and a
    heavier MTP term buys draft accuracy at a small cost in next-token CE."""
    cfg = get_preset("tiny-super")
    cfg.vocab_size = ByteTokenizer.vocab_size
    cfg.d_model = 192
    cfg.pattern = "MEM*EME"
    cfg.mamba.num_heads, cfg.mamba.head_dim, cfg.mamba.state_size = 6, 64, 32
    cfg.mamba.n_groups, cfg.mamba.chunk_size = 2, 64
    cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim = 6, 2, 32
    cfg.moe.num_experts, cfg.moe.top_k = 16, 4
    cfg.moe.expert_hidden, cfg.moe.latent_size, cfg.moe.shared_expert_hidden = 96, 48, 384
    cfg.mtp.pattern, cfg.mtp.depth, cfg.mtp.loss_weight = "*E", mtp_depth, mtp_loss_weight
    cfg.validate()
    return cfg


def load_split(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte ids of the text (`.gz` ok): (first 90%, last 10%). No BOS: windows are cut
    anywhere."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"training text not found: {path}")
    ids = torch.tensor(ByteTokenizer().encode(read_text(path), add_bos=False), dtype=torch.long)
    cut = int(len(ids) * (1 - HELD_OUT_FRACTION))
    return ids[:cut], ids[cut:]


def _windows(ids: torch.Tensor, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, len(ids) - seq, (batch,), generator=g)
    return torch.stack([ids[s : s + seq] for s in start.tolist()])


@torch.no_grad()
def _evaluate(model: HybridLM, x: torch.Tensor) -> dict[str, float]:
    model.eval()
    out = model(x, mtp_depth=model.train_mtp_depth, return_logits=False)
    _, parts = causal_lm_loss(model, out, x)
    model.train()
    return {k: float(v) for k, v in parts.items() if k != "moe_aux"}


def train(
    cfg: ModelConfig,
    train_ids: torch.Tensor,
    held_out_ids: torch.Tensor,
    *,
    steps: int,
    batch: int = 16,
    seq: int = 256,
    lr: float = 2e-3,
    warmup: int = 20,
    seed: int = 0,
    log_every: int = 10,
    eval_every: int = 100,
    metrics_path: Path | None = None,
    log=print,
) -> HybridLM:
    """AdamW (betas 0.9/0.95, wd 0.1), linear warmup then cosine to 10%, grad-norm clip 1.0.
    Loss = ce + mtp.loss_weight * mean(mtp depths) + MoE balancing; `update_moe_bias()` after
    every step (aux-loss-free balancing). Held-out loss on 8 fixed windows every `eval_every`."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    torch.manual_seed(seed)
    model = HybridLM(cfg, seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    held_x = _windows(held_out_ids, 8, seq, torch.Generator().manual_seed(seed + 1))
    rows: list[dict] = []
    sink = metrics_path.open("w") if metrics_path is not None else None
    t0 = time.perf_counter()

    def emit(row: dict) -> None:
        rows.append(row)
        if sink is not None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    try:
        for step in range(1, steps + 1):
            frac = min(1.0, step / warmup) if step <= warmup else None
            if frac is None:
                progress = (step - warmup) / max(1, steps - warmup)
                frac = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
            for group in opt.param_groups:
                group["lr"] = lr * frac
            x = _windows(train_ids, batch, seq, g)
            out = model(x, mtp_depth=model.train_mtp_depth, return_logits=False)
            loss, parts = causal_lm_loss(model, out, x)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.update_moe_bias()
            if step % log_every == 0 or step == 1 or step == steps:
                row = {
                    "split": "train",
                    "step": step,
                    "tokens": step * batch * seq,
                    "elapsed_s": time.perf_counter() - t0,
                    "lr": lr * frac,
                    "grad_norm": float(gnorm),
                    **{k: v.item() for k, v in parts.items()},
                }
                emit(row)
                log(
                    f"  step {step:4d}/{steps}  ce {row['ce']:.3f}  mtp {row.get('mtp', 0):.3f}"
                    f"  ({row['elapsed_s']:.0f} s)"
                )
            if step % eval_every == 0 or step == steps:
                emit({"split": "held_out", "step": step, **_evaluate(model, held_x)})
    finally:
        if sink is not None:
            sink.close()
    return model.eval()


def load_or_train(
    ckpt: Path, data: Path, *, retrain: bool, log=print, **train_kw
) -> tuple[HybridLM, bool]:
    """The checkpoint at `ckpt` if present (and not `retrain`), else a freshly trained model
    saved there. Returns (model, trained_now). Training rows go to `ckpt/metrics.jsonl`."""
    ckpt = Path(ckpt)
    if (ckpt / "config.json").is_file() and not retrain:
        return load_model(ckpt).eval(), False
    train_ids, held = load_split(data)
    cfg = spec_config(
        mtp_depth=train_kw.pop("mtp_depth", 3), mtp_loss_weight=train_kw.pop("mtp_loss_weight", 1.0)
    )
    ckpt.mkdir(parents=True, exist_ok=True)
    model = train(cfg, train_ids, held, metrics_path=ckpt / "metrics.jsonl", log=log, **train_kw)
    save_pretrained(model, ckpt, tokenizer=ByteTokenizer())
    return model, True


def read_rows(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def plot_training(metrics: Path, png: Path) -> None:
    """Training CE and MTP loss (per depth, and held-out points) against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(metrics)
    tr = [r for r in rows if r["split"] == "train"]
    ho = [r for r in rows if r["split"] == "held_out"]
    per_step = tr[-1]["tokens"] / tr[-1]["step"] if tr else 1
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r["tokens"] / 1e6 for r in tr]
    ax.plot(x, [r["ce"] for r in tr], label="ce (train)", color="C0")
    if tr and "mtp" in tr[0]:
        ax.plot(x, [r["mtp"] for r in tr], label="mtp mean (train)", color="C1")
        depths = sorted(int(k.split("_")[1]) for k in tr[0] if k.startswith("mtp_"))
        for k in depths:
            ax.plot(x, [r[f"mtp_{k}"] for r in tr], lw=0.8, ls=":", label=f"mtp depth {k}")
    if ho:
        hx = [r["step"] * per_step / 1e6 for r in ho]
        ax.plot(hx, [r["ce"] for r in ho], "o", color="C0", label="ce (held-out)")
        if "mtp" in ho[0]:
            ax.plot(hx, [r["mtp"] for r in ho], "s", color="C1", label="mtp (held-out)")
    ax.set(xlabel="training tokens (M)", ylabel="loss (nats / byte)", title="byte-level training")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, png, dpi=120)
