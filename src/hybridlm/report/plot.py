"""Loss curves rendered from `metrics.jsonl` after a run (DESIGN habit 15: reports are derived)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..files import read_metrics


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, png: str | Path, *, dpi: int = 110) -> Path:
    """Lay out, write the PNG and close the figure (releasing its memory); returns the path.
    A figure made with a layout engine (`layout="constrained"`, needed for subfigures) keeps it."""
    import matplotlib.pyplot as plt

    if fig.get_layout_engine() is None:
        fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=dpi)
    plt.close(fig)
    return png


def plot_loss_curves(metrics_path: str | Path, out_png: str | Path) -> Path:
    """Train loss parts (ce, mtp, total) and held-out loss / bpb against tokens seen, as a PNG."""
    plt = pyplot()
    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[3, 1])
    x = [r["tokens"] for r in train]
    for key in ("loss", "ce", "mtp"):
        ys = [(xi, r[key]) for xi, r in zip(x, train, strict=True) if r.get(key) is not None]
        if ys:
            ax.plot(*zip(*ys, strict=True), label=f"train {key}", lw=1)
    if evals:
        ax.plot(
            [r["tokens"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval ce"
        )
        ax2 = ax.twinx()
        ax2.plot(
            [r["tokens"] for r in evals], [r["eval_bpb"] for r in evals], "s--", c="gray", ms=3
        )
        ax2.set_ylabel("eval bits per byte")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    ax_lr.plot(x, [r["lr"] for r in train], lw=1)
    ax_lr.set_ylabel("lr")
    ax_lr.set_xlabel("tokens seen")
    ax_lr.grid(alpha=0.3)
    return save_figure(fig, out_png, dpi=100)


def plot_post_training(
    metrics_path: str | Path,
    out_png: str | Path,
    keys: Sequence[str],
    eval_keys: Sequence[str] | None = None,
) -> Path:
    """Train curves (`keys` of kind "train" rows) and eval curves (`eval_keys`, default every
    numeric eval field) against the step, as a PNG rendered from metrics.jsonl (the SFT, DPO
    and distillation runs)."""
    plt = pyplot()
    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    fig, (ax, ax_eval) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for key in keys:
        pts = [(r["step"], r[key]) for r in train if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts, strict=True), lw=1, label=key)
    ax.set_ylabel("train")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    if eval_keys is None:
        eval_keys = sorted(
            {k for r in evals for k, v in r.items() if isinstance(v, float) and k != "step"}
        )
    eval_keys = [k for k in eval_keys if any(k in r for r in evals)]
    for key in eval_keys:
        pts = [(r["step"], r[key]) for r in evals if isinstance(r.get(key), (int, float))]
        ax_eval.plot(*zip(*pts, strict=True), "o-", ms=3, label=key)
    ax_eval.set_ylabel("held-out")
    ax_eval.set_xlabel("step")
    if eval_keys:
        ax_eval.legend(loc="best")
    ax_eval.grid(alpha=0.3)
    return save_figure(fig, out_png, dpi=100)
