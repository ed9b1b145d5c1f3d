"""The report card of a flow run: `report.md`, `report.html` and `plots/*.png`, derived afterwards
from the run directory's files (nothing is measured here).

    python -m hybridlm.eval.report runs/speedrun      # (re)render a finished or partial run

Read: `provenance.json` (command line, settings that differ from configs/speedrun.yaml, commit,
versions, threads, CPU, each stage's status and wall time; written by `hybridlm speedrun`),
`speedrun.yaml`, `<stage>/stage.json` and the stages' `metrics.jsonl` files.

What the report promises: every figure is named after the data it is measured on, with its unit
(the definitions table near the top); two measurements on different data never share a name
(the trainer's held-out bpb and the eval stage's are different batches of the same split); rates
measured on samples carry 95% confidence intervals (Wilson for exact match, bootstrap over prompts
for acceptance rates); plotted bars start at zero, or deltas are plotted against a labelled zero
line. Plots: pretraining / SFT loss, bits per byte, GRPO reward and held-out exact match, MTP
acceptance by draft position (before / after healing, SPEED-Bench at draft length 7), quantisation
deltas per recipe and per operator group, decode-cache memory vs context. A section whose stage
did not run says so instead of showing a plot.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..speedrun import STAGES
from ..train.plot import pyplot, read_metrics, save_figure

STAGE_ORDER = STAGES[:-1]  # every stage but the report itself
Z95 = 1.959963984540054  # two-sided 95% normal quantile
TOP_GROUPS = (
    12  # per-group quantisation plot: the largest |delta| groups shown, the rest summarised
)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file; none when its stage did not run."""
    return read_metrics(path) if path.is_file() else []


# ---------------------------------------------------------------------------- numbers
def _fmt(x: Any) -> str:
    """A table cell: floats to 4 significant digits (thousands separated), `–` for missing."""
    if x is None:
        return "–"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "–"
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"
    return str(x)


def fmt_duration(seconds: float | None) -> str:
    """Wall time for people: `0.04 s`, `9.2 s`, `1:03 min`, `1:02:03 h`."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = round(seconds)
    if s < 3600:
        return f"{s // 60}:{s % 60:02d} min"
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d} h"


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927): sensible at 0 / n and n."""
    if n <= 0:
        return (math.nan, math.nan)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def rate_ci(p: float, n: int) -> tuple[float, float]:
    """95% Wilson interval of a rate `p` measured on `n` items (successes = round(p * n))."""
    return wilson_interval(round(p * n), n)


def fmt_rate(p: float | None, n: int | None, digits: int = 2, unit: str = "") -> str:
    """`0.42 [0.29, 0.56] (95% CI, n=50)`: a rate with its Wilson interval."""
    if p is None or not n:
        return _fmt(p)
    lo, hi = rate_ci(p, n)
    n_txt = f"n={n}" + (f" {unit}" if unit else "")
    return f"{p:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}] (95% CI, {n_txt})"


def fmt_pm(value: float | None, se: float | None, n: int | None, unit: str = "") -> str:
    """`0.78 ± 0.12 (95% CI, n=5 prompts)` from a standard error (normal interval)."""
    if value is None:
        return "–"
    n_txt = f", n={n}" + (f" {unit}" if unit else "") if n else ""
    if se is None or not math.isfinite(se):
        return f"{value:.2f} (no CI{n_txt})"
    return f"{value:.2f} ± {Z95 * se:.2f} (95% CI{n_txt})"


def bootstrap_positions(
    by_prompt: list[list[list[int]]], *, iters: int = 2000, seed: int = 0
) -> list[tuple[float, float]]:
    """95% percentile intervals of the acceptance rate at each draft position (accepted / drafted,
    a ratio of sums), resampling prompts: drafts of one prompt are not independent."""
    import numpy as np

    acc = np.array([p[0] for p in by_prompt], dtype=np.float64)  # [prompts, K]
    drafted = np.array([p[1] for p in by_prompt], dtype=np.float64)
    n = len(by_prompt)
    idx = np.random.default_rng(seed).integers(0, n, size=(iters, n))
    num, den = acc[idx].sum(1), drafted[idx].sum(1)  # [iters, K]
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = num / den
    out = []
    for k in range(acc.shape[1]):
        r = ratio[:, k][np.isfinite(ratio[:, k])]
        out.append(
            (float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))) if len(r) else (0, 0)
        )
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB" if b < 2**30 else f"{b / 2**30:,.2f} GiB"


def _get(tree: Any, dotted: str, default: Any = None) -> Any:
    """`pretrain.train.eval_batches` of a plain config tree (`default` when absent)."""
    for key in dotted.split("."):
        if isinstance(tree, dict) and key in tree:
            tree = tree[key]
        elif isinstance(tree, list) and key.isdigit() and int(key) < len(tree):
            tree = tree[int(key)]
        else:
            return default
    return tree


def _short_time(iso: str | None) -> str:
    """`2025-01-31 14:02` from an ISO time (as written; no zone conversion)."""
    if not iso:
        return "–"
    return iso.replace("T", " ")[:16]


# ---------------------------------------------------------------------------- document model
@dataclass
class Doc:
    """Blocks rendered both to Markdown and to a self-contained HTML page."""

    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def h(self, level: int, text: str, anchor: str = "") -> None:
        self.blocks.append(("h", (level, text, anchor)))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def note(self, text: str) -> None:
        """A warning a reader must not miss (bold, boxed in HTML)."""
        self.blocks.append(("note", text))

    def table(
        self, header: list[str], rows: list[list[Any]], cls: str = "", fold: str = ""
    ) -> None:
        """A table; `fold`: in HTML, folded under that summary line (long, secondary tables)."""
        self.blocks.append(("table", (header, [[_fmt(c) for c in r] for r in rows], cls, fold)))

    def img(self, path: Path, alt: str) -> None:
        self.blocks.append(("img", (path, alt)))

    def open(self, anchor: str) -> None:
        """Start a named section (`<section id=...>` in HTML; nothing in Markdown)."""
        self.blocks.append(("open", anchor))

    def close(self) -> None:
        self.blocks.append(("close", None))

    def markdown(self, root: Path) -> str:
        out = []
        for kind, val in self.blocks:
            if kind == "h":
                out.append("#" * val[0] + " " + val[1])
            elif kind == "p":
                out.append(val)
            elif kind == "note":
                out.append(f"> **{val}**")
            elif kind == "table":
                header, rows, _, fold = val
                if fold:
                    out += [fold + ":", ""]
                out.append("| " + " | ".join(_md_cell(h) for h in header) + " |")
                out.append("|" + "---|" * len(header))
                out.extend("| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows)
            elif kind == "img":
                out.append(f"![{val[1]}]({val[0].relative_to(root)})")
            else:
                continue
            out.append("")
        return "\n".join(out)

    def html(self, title: str) -> str:
        parts = [
            "<!doctype html><html><head><meta charset='utf-8'>",
            f"<title>{html.escape(title)}</title><style>",
            "body{font-family:system-ui,sans-serif;max-width:64em;margin:2em auto;padding:0 1em;"
            "color:#222}table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;"
            "padding:.2em .6em;text-align:left;vertical-align:top}th{background:#f3f3f3}"
            "td.num{text-align:right;font-variant-numeric:tabular-nums}summary{cursor:pointer}"
            "img{max-width:100%;border:1px solid #eee}code{background:#f5f5f5;padding:0 .2em}"
            "p.note{border:2px solid #c60;background:#fff4e8;padding:.5em .8em;font-weight:600}"
            "section#provenance{border-left:4px solid #69c;padding-left:1em}",
            "</style></head><body>",
        ]
        for kind, val in self.blocks:
            if kind == "h":
                level, text, anchor = val
                attr = f" id='{html.escape(anchor)}'" if anchor else ""
                parts.append(f"<h{level}{attr}>{html.escape(text)}</h{level}>")
            elif kind == "p":
                parts.append(f"<p>{_inline_html(val)}</p>")
            elif kind == "note":
                parts.append(f"<p class='note'>{_inline_html(val)}</p>")
            elif kind == "table":
                header, rows, cls, fold = val
                attr = f" class='{cls}'" if cls else ""
                if fold:
                    parts.append(f"<details><summary>{_inline_html(fold)}</summary>")
                parts.append(f"<table{attr}>")
                if any(header):
                    parts.append(
                        "<tr>" + "".join(f"<th>{_inline_html(h)}</th>" for h in header) + "</tr>"
                    )
                num = [all(NUMERIC.match(r[i]) for r in rows) for i in range(len(header))]
                for r in rows:
                    parts.append(
                        "<tr>"
                        + "".join(
                            f"<td{' class=num' if n else ''}>{_inline_html(c)}</td>"
                            for c, n in zip(r, num, strict=True)
                        )
                        + "</tr>"
                    )
                parts.append("</table>")
                if fold:
                    parts.append("</details>")
            elif kind == "img":
                data = base64.b64encode(val[0].read_bytes()).decode()
                parts.append(
                    f"<p><img alt='{html.escape(val[1])}' src='data:image/png;base64,{data}'></p>"
                )
            elif kind == "open":
                parts.append(f"<section id='{html.escape(val)}'>")
            elif kind == "close":
                parts.append("</section>")
        parts.append("</body></html>")
        return "\n".join(parts)


# a cell that is a number (a column of them is right-aligned, so digits line up)
NUMERIC = re.compile(r"^[-+–]?[\d,]*\.?\d+(%|x| s| min| h|e[-+]\d+)?$|^–$")


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _inline_html(text: str) -> str:
    """`code` and **bold** spans of the Markdown paragraphs and cells."""
    pieces = html.escape(text).split("`")
    out = []
    for i, piece in enumerate(pieces):
        if i % 2:
            out.append(f"<code>{piece}</code>")
        else:
            bold = piece.split("**")
            out.append("".join(f"<b>{b}</b>" if j % 2 else b for j, b in enumerate(bold)))
    return "".join(out)


# ---------------------------------------------------------------------------- plots
def _integer_x(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _marker(n: int) -> dict[str, Any]:
    """Markers on short curves, where a line alone hides how few points there are."""
    return {"marker": "o", "ms": 3} if n <= 30 else {}


def _no_data(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_loss(pre: list[dict], sft: list[dict], png: Path, names: dict[str, str]) -> Path | None:
    train = [r for r in pre if r.get("kind") == "train"]
    if not train and not sft:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    if train:
        steps = [r["step"] for r in train]
        ax.plot(steps, [r["ce"] for r in train], label="train CE", **_marker(len(train)))
        if "mtp" in train[0]:
            ax.plot(steps, [r["mtp"] for r in train], label="train MTP CE", lw=1)
        ev = [r for r in pre if r.get("kind") == "eval"]
        if ev:
            ax.plot(
                [r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label=names["pre_ce"]
            )
        ax.legend(fontsize=8)
    else:
        _no_data(ax, "pretraining did not run")
    ax.set(title="pretraining", xlabel="step", ylabel="cross-entropy (nats / token)")
    _integer_x(ax)
    ax.grid(alpha=0.3)
    ax = axes[1]
    st = [r for r in sft if r.get("kind") == "train"]
    ev = [r for r in sft if r.get("kind") == "eval" and "eval_loss" in r]
    key = "nll_token" if st and "nll_token" in st[0] else "loss"
    if st:
        label = "train NLL" if key == "nll_token" else "train loss"
        ax.plot([r["step"] for r in st], [r[key] for r in st], label=label, **_marker(len(st)))
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out NLL")
    if st or ev:
        ax.legend(fontsize=8)
    else:
        _no_data(ax, "SFT did not run")
    ax.set(title="SFT", xlabel="step", ylabel="NLL (nats / assistant token)")
    _integer_x(ax)
    ax.grid(alpha=0.3)
    return save_figure(fig, png)


def plot_bpb(pre: list[dict], models: list[dict], png: Path, names: dict[str, str]) -> Path | None:
    ev = [r for r in pre if r.get("kind") == "eval" and "eval_bpb" in r]
    bars = [r for r in models if "text_bpb" in r]
    if not ev and not bars:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_bpb"] for r in ev], "o-")
    else:
        _no_data(ax, "no pretraining evals")
    ax.set(
        title=f"pretraining: {names['trainer_bpb']}",
        xlabel="step",
        ylabel="bits per byte",
    )
    _integer_x(ax)
    ax.grid(alpha=0.3)
    ax = axes[1]
    if bars:
        vals = [r["text_bpb"] for r in bars]
        ax.bar([r["model"] for r in bars], vals, color="tab:blue")
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, max(vals) * 1.12)
    else:
        _no_data(ax, "the eval stage did not run")
    ax.set(title=f"every stage's model: {names['eval_bpb']}", ylabel="bits per byte")
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, png)


def _wilson_err(ps: list[float], ns: list[int]) -> list[list[float]]:
    """Asymmetric error bars (below, above) of Wilson intervals, for `errorbar` / `bar`."""
    lo, hi = [], []
    for p, n in zip(ps, ns, strict=True):
        a, b = rate_ci(p, n)
        lo.append(max(0.0, p - a))
        hi.append(max(0.0, b - p))
    return [lo, hi]


def plot_reward(rl: list[dict], models: list[dict], png: Path, rl_n: int | None) -> Path | None:
    train = [r for r in rl if r.get("kind") == "train"]
    if not train and not models:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    if train:
        ax.plot(
            [r["step"] for r in train],
            [r["reward_mean"] for r in train],
            label="train reward (mean over the step's samples)",
            **_marker(len(train)),
        )
        ev = [r for r in rl if r.get("kind") == "eval"]
        if ev:
            ns = [int(r.get("all/count") or rl_n or 0) for r in ev]
            ps = [r["all/solved"] for r in ev]
            n_txt = f"n={ns[0]}" if len(set(ns)) == 1 else "n varies"
            ax.errorbar(
                [r["step"] for r in ev],
                ps,
                yerr=_wilson_err(ps, ns) if all(ns) else None,
                fmt="o-",
                capsize=3,
                label=f"held-out solved (greedy, {n_txt}, 95% CI)",
            )
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=8)
    else:
        _no_data(ax, "RL did not run")
    ax.set(title="GRPO", xlabel="GRPO step", ylabel="fraction solved (reward 0-1)")
    _integer_x(ax)
    ax.grid(alpha=0.3)
    ax = axes[1]
    if models:
        ps = [r["exact_match"] for r in models]
        ns = [int(r["problems"]) for r in models]
        ax.bar(
            [r["model"] for r in models],
            ps,
            yerr=_wilson_err(ps, ns),
            capsize=3,
            color="tab:green",
        )
        for i, p in enumerate(ps):
            ax.text(i + 0.05, p + 0.01, f"{p:.2f}", ha="left", va="bottom", fontsize=8)
        ax.set_ylim(0, 1)
        n_txt = f"n={ns[0]}" if len(set(ns)) == 1 else "n per model"
        ax.set_title(f"held-out arithmetic, greedy ({n_txt}, 95% Wilson CI)")
        ax.tick_params(axis="x", labelsize=8)
    else:
        _no_data(ax, "the eval stage did not run")
    ax.set_ylabel("exact match (fraction of problems)")
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, png)


def _spec_positions(rows: list[dict], tag: str) -> tuple[list[float], list[float | None], int]:
    """SPEED-Bench pooled acceptance by position: values, standard errors, prompts."""
    by: dict[int, tuple[float, float | None]] = {}
    n = 0
    for r in rows:
        m = r.get("metric", "")
        if r.get("task") == "spec_bench" and m.startswith("acceptance@") and m.endswith(":" + tag):
            by[int(m.split("@")[1].split(":")[0])] = (r["value"], r.get("stderr"))
            n = int(r.get("n") or 0)
    keys = sorted(by)
    return [by[k][0] for k in keys], [by[k][1] for k in keys], n


def heal_intervals(row: dict) -> list[tuple[float, float]] | None:
    """95% intervals of a healing acceptance row by position (None: no counts recorded)."""
    if len(row.get("by_prompt") or []) >= 2:
        return bootstrap_positions(row["by_prompt"])
    return None


def plot_acceptance(heal: list[dict], spec: dict[str, list[dict]], png: Path) -> Path | None:
    acc = [r for r in heal if r.get("kind") == "acceptance"]
    if not acc and not spec:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for i, r in enumerate(acc):
        pos = r["acceptance_by_position"]
        xs = [k + 1 + (i - (len(acc) - 1) / 2) * 0.04 for k in range(len(pos))]  # no overlap
        ci = heal_intervals(r)
        err = None
        if ci is not None:
            err = [
                [max(0.0, p - lo) for p, (lo, _) in zip(pos, ci, strict=True)],
                [max(0.0, hi - p) for p, (_, hi) in zip(pos, ci, strict=True)],
            ]
        style = "--" if r["when"] == "before" else "-"
        label = f"{r['when']} healing, T={r['temperature']:g} (AL {r['acceptance_length']:.2f})"
        ax.errorbar(xs, pos, yerr=err, fmt=style, marker="o", ms=4, capsize=2, label=label)
        ax.set_xticks(range(1, len(pos) + 1))
    prompts = {r.get("prompts") for r in acc}
    n_txt = f"n={prompts.pop()} prompts, " if len(prompts) == 1 and None not in prompts else ""
    ax.set(
        title=f"MTP healing ({n_txt}95% CI)" if acc else "MTP healing did not run",
        xlabel="draft position",
        ylabel="fraction of drafts accepted",
        ylim=(-0.02, 1.04),
    )
    ax.grid(alpha=0.3)
    if acc:
        ax.legend(fontsize=7)
    ax = axes[1]
    series = [(name, tag) for name in spec for tag in ("greedy", "T1")]
    ns = set()
    for i, (name, tag) in enumerate(series):
        vals, ses, n = _spec_positions(spec[name], tag)
        if not vals:
            continue
        ns.add(n)
        xs = [k + 1 + (i - (len(series) - 1) / 2) * 0.04 for k in range(len(vals))]
        err = [Z95 * (e or 0.0) for e in ses]
        style = "-" if tag == "greedy" else "--"
        ax.errorbar(
            xs, vals, yerr=err, fmt=style, marker="o", ms=3, capsize=2, label=f"{name} {tag}"
        )
    n_txt = f"n={ns.pop()} prompts, " if len(ns) == 1 else ""
    ax.set(
        title=f"SPEED-Bench, draft length 7 ({n_txt}95% CI)" if spec else "no SPEED-Bench run",
        xlabel="draft position",
        ylabel="fraction of drafts accepted",
        ylim=(-0.02, 1.04),
    )
    _integer_x(ax)
    ax.grid(alpha=0.3)
    if spec:
        ax.legend(fontsize=7)
    return save_figure(fig, png)


def plot_quant(
    quant: dict[str, dict[str, Any]], models: list[dict], png: Path, names: dict[str, str]
) -> Path | None:
    """Per recipe: the change of held-out bpb against the unquantised model (a delta, with a
    labelled zero line) and arithmetic exact match with Wilson intervals; then the loss change
    of each operator group quantised alone (horizontal bars, the largest |delta| first)."""
    if not quant:
        return None
    per_group = None
    for name, q in quant.items():
        groups = [g for g in q.get("groups", []) if g.get("loss_delta") is not None]
        if groups and (per_group is None or name != "autoquant"):
            per_group = (name, groups)
            if name != "autoquant":
                break
    plt = pyplot()
    shown = min(TOP_GROUPS, len(per_group[1])) if per_group else 0
    group_h = 0.3 * shown + 1.4
    fig = plt.figure(figsize=(11, 3.8 + (group_h if per_group else 0)), layout="constrained")
    # subfigures: the long operator names of the lower panel do not squeeze the upper ones
    rows = fig.subfigures(2, 1, height_ratios=[3.8, group_h]) if per_group else [fig]
    ax, ax_em = rows[0].subplots(1, 2)
    first = next(iter(quant.values()))
    base = first["unquantized"]["bpb"]
    rel = [100 * q["delta"]["bpb_rel"] for q in quant.values()]
    ax.bar(list(quant), rel, color=["tab:red" if v > 0 else "tab:blue" for v in rel])
    ax.axhline(0, color="k", lw=1, label=f"0 = unquantised ({base:.3f} bpb)")
    for i, v in enumerate(rel):
        ax.text(i, v, f"{v:+.3f}%", ha="center", va="bottom" if v >= 0 else "top", fontsize=8)
    lo, hi = min(0.0, *rel), max(0.0, *rel)
    pad = 0.25 * ((hi - lo) or 1.0)
    ax.set_ylim(lo - pad, hi + pad)
    ax.legend(fontsize=8, loc="lower right" if hi > -lo else "upper right")
    ax.set(title=f"{names['quant_bpb']}: change per recipe", ylabel="bpb change vs unquantised (%)")
    ax.grid(alpha=0.3, axis="y")
    ax = ax_em
    em = {r["model"]: r for r in models}
    src = next((r for r in models if r.get("stage") == "mtp_heal"), None) or next(
        (r for r in models if r.get("stage") != "quantize"), None
    )
    bars = ([(src["model"], src)] if src else []) + [(n, em[n]) for n in quant if n in em]
    if bars:
        ps = [r["exact_match"] for _, r in bars]
        ns = [int(r["problems"]) for _, r in bars]
        ax.bar(
            [n for n, _ in bars],
            ps,
            yerr=_wilson_err(ps, ns),
            capsize=3,
            color=["tab:gray"] + ["tab:orange"] * (len(bars) - 1),
        )
        for i, p in enumerate(ps):
            ax.text(i + 0.05, p + 0.01, f"{p:.2f}", ha="left", va="bottom", fontsize=8)
        ax.set_ylim(0, 1)
        n_txt = f"n={ns[0]}" if len(set(ns)) == 1 else "n per model"
        ax.set_title(f"arithmetic exact match ({n_txt}, 95% Wilson CI)")
    else:
        _no_data(ax, "the eval stage did not run")
    ax.set_ylabel("exact match (fraction of problems)")
    ax.grid(alpha=0.3, axis="y")
    if per_group:
        name, groups = per_group
        ax = rows[1].subplots(1, 1)
        ranked = sorted(groups, key=lambda g: abs(g["loss_delta"]), reverse=True)
        top, rest = ranked[:shown], ranked[shown:]
        vals = [g["loss_delta"] for g in top]
        ys = list(range(len(top)))[::-1]  # the largest at the top
        ax.barh(ys, vals, color=["tab:red" if v > 0 else "tab:blue" for v in vals])
        ax.set_yticks(ys)
        ax.set_yticklabels([f"{g['group']} ({g.get('format', '?')})" for g in top], fontsize=8)
        ax.axvline(0, color="k", lw=1)
        title = f"{name}: held-out loss change with only this operator group quantised"
        if rest:
            biggest = max(abs(g["loss_delta"]) for g in rest)
            title += f"\n(top {len(top)} of {len(groups)} by |change|; the other {len(rest)}"
            title += f" are within ±{biggest:.2g})"
        ax.set(title=title, xlabel="loss change (nats / token; > 0 is worse)")
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-3, 3))
        ax.grid(alpha=0.3, axis="x")
    return save_figure(fig, png)


def plot_cache(rows: list[dict], png: Path) -> Path | None:
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for i, name in enumerate(dict.fromkeys(r["model"] for r in rows)):
        rs = [r for r in rows if r["model"] == name]
        ctx = [r["context"] for r in rs]
        color = f"C{i}"
        ax.loglog(ctx, [r["hybrid_bytes"] / 2**20 for r in rs], "-o", c=color, label=f"{name}")
        ax.loglog(
            ctx,
            [r["attention_only_bytes"] / 2**20 for r in rs],
            "--",
            c=color,
            label=f"{name}, every layer attention",
        )
    ax.set(
        title="decode cache per sequence (bf16 KV, fp32 Mamba state)",
        xlabel="context (tokens)",
        ylabel="cache per sequence (MiB, log scale)",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save_figure(fig, png)


# ---------------------------------------------------------------------------- report
def _records(run: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for name in STAGE_ORDER:
        path = run / name / "stage.json"
        if path.is_file():
            out[name] = json.loads(path.read_text())
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def _config(run: Path) -> dict[str, Any]:
    path = run / "speedrun.yaml"
    if not path.is_file():
        return {}
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def _versions_text(versions: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in versions.items() if v) or "–"


def _threads_text(t: dict[str, Any]) -> str:
    parts = []
    if "torch_threads" in t:
        parts.append(
            f"torch.get_num_threads() = {t['torch_threads']}, "
            f"interop {t.get('torch_interop_threads', '–')}"
        )
    if t.get("configured"):
        parts.append(
            "configure_threads: "
            + ", ".join(f"{k}={v}" for k, v in sorted(t["configured"].items()))
        )
    else:
        parts.append("configure_threads: not recorded")
    if t.get("env"):
        parts.append(", ".join(f"{k}={v}" for k, v in t["env"].items()))
    return "; ".join(parts)


def _git_text(git: dict[str, Any]) -> str:
    if not git or not git.get("commit"):
        return git.get("note", "unknown") if git else "unknown"
    text = f"`{git['commit'][:12]}`"
    if git.get("dirty"):
        text += f" with uncommitted changes ({git.get('changed_files', '?')} files)"
    else:
        text += " (clean)"
    return text


def _cpu_text(cpu: dict[str, Any]) -> str:
    text = str(cpu.get("model") or "unknown CPU")
    cores = cpu.get("logical_cores")
    usable = cpu.get("usable_cores")
    if cores:
        text += f", {cores} logical cores"
        if usable and usable != cores:
            text += f" ({usable} usable by the run)"
    if cpu.get("memory_gib"):
        text += f", {cpu['memory_gib']:g} GiB memory"
    return text


def _batches(n: Any) -> str:
    return "1 batch" if n == 1 else f"{n} batches"


def _settings_differ(n: int) -> str:
    return "1 setting differs" if n == 1 else f"{n} settings differ"


def _value_text(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, str) else v
    return text if len(text) <= 60 else text[:57] + "…"


def provenance_section(doc: Doc, prov: dict[str, Any], run: Path) -> None:
    """Where the numbers come from: the first thing a reader sees after the title."""
    doc.open("provenance")
    doc.h(2, "Provenance", anchor="provenance-heading")
    if not prov:
        doc.note(
            "No provenance.json in this run directory: the command line, settings, code "
            "version and hardware that produced these numbers are unknown."
        )
        doc.close()
        return
    overrides = prov.get("overrides")
    defaults = Path(prov["defaults"]).name if prov.get("defaults") else None
    if overrides is None:
        settings = "unknown (no reference configs/speedrun.yaml was found)"
    elif not overrides:
        settings = f"the defaults of `configs/{defaults}`"
    else:
        settings = f"{_settings_differ(len(overrides))} from `configs/{defaults}` (table below)"
    if prov.get("only"):
        settings += f"; only stages {', '.join(prov['only'])} selected"
    if prov.get("skip"):
        settings += f"; skipped: {', '.join(prov['skip'])}"
    if prov.get("force"):
        settings += f"; forced to rerun: {', '.join(prov['force'])}"
    wall = prov.get("wall_seconds")
    rows = [
        ["command", f"`{prov.get('command') or '–'}` (in `{prov.get('cwd', '–')}`)"],
        ["settings", settings],
        ["code", _git_text(prov.get("git") or {})],
        ["versions", _versions_text(prov.get("versions") or {})],
        ["threads", _threads_text(prov.get("threads") or {})],
        ["CPU", _cpu_text(prov.get("cpu") or {})],
    ]
    gpus = (prov.get("threads") or {}).get("cuda_devices")
    if gpus:
        rows.append(["GPU", ", ".join(gpus)])
    rows += [
        ["platform", prov.get("platform", "–")],
        [
            "date",
            f"started {_short_time(prov.get('started'))}, finished "
            f"{_short_time(prov.get('finished'))}; report rendered "
            f"{_short_time(_dt.datetime.now().astimezone().isoformat())}",
        ],
        ["wall time of this invocation", fmt_duration(wall) + " (stages below)"],
    ]
    doc.table(["", ""], rows)
    if overrides:
        doc.table(
            ["setting", "default", "this run"],
            [
                [f"`{o['key']}`", _value_text(o["default"]), _value_text(o["value"])]
                for o in overrides
            ],
            fold=f"The {_settings_differ(len(overrides))} from `configs/{defaults}`",
        )
    doc.close()


def _status(name: str, prov: dict[str, Any], rec: dict[str, Any] | None) -> tuple[str, str]:
    """(status, wall time) of a stage in the invocation that rendered the report."""
    entry = (prov.get("stages") or {}).get(name) if prov else None
    if entry is None:  # no provenance: what the records say
        if rec is None:
            return "not run", "–"
        return "finished", fmt_duration(rec.get("seconds"))
    status = entry.get("status", "?")
    if status == "run":
        return "run", fmt_duration(entry.get("seconds"))
    if status in ("reused", "kept"):
        made = entry.get("produced_by") or (rec or {}).get("run") or {}
        when = _short_time(made.get("started")) if made.get("started") else "an earlier run"
        commit = f" at `{made['commit'][:8]}`" if made.get("commit") else ""
        if commit and made.get("dirty"):
            commit += " (dirty)"
        word = "reused" if status == "reused" else "kept (not selected)"
        took = entry.get("seconds_when_run") or (rec or {}).get("seconds")
        return f"{word}: from {when}{commit}", f"{fmt_duration(took)} when run"
    return status, "–"


def definitions(
    cfg: dict[str, Any], pre: list[dict], models: list[dict], quant: dict[str, Any], sft_n: int
) -> tuple[list[list[str]], dict[str, str]]:
    """The table that names every figure after its data, and the short names used elsewhere."""
    pre_ev = [r for r in pre if r.get("kind") == "eval"]
    trainer_tokens = pre_ev[-1].get("eval_tokens") if pre_ev else None
    trainer_batches = _get(cfg, "pretrain.train.eval_batches")
    eval_tokens = next((r.get("text_tokens") for r in models if r.get("text_tokens")), None)
    eval_batches = _get(cfg, "eval.text_batches")
    q_tokens = next(iter(quant.values()))["eval"]["tokens"] if quant else None
    q_batches = next(iter(quant.values()))["eval"]["batches"] if quant else None
    split = (
        f"the pretraining mix's held-out split (`eval_split: "
        f"{_get(cfg, 'pretrain.data.eval_split', '?')}`, "
        f"{_get(cfg, 'pretrain.data.eval_fraction', '?')} of documents)"
    )

    def tok(n: Any) -> str:
        return f"{n:,} tokens" if isinstance(n, (int, float)) else "? tokens"

    names = {
        "trainer_bpb": "trainer bpb",
        "pre_ce": "trainer held-out CE",
        "eval_bpb": "eval bpb",
        "quant_bpb": "eval bpb" if q_tokens == eval_tokens else "quantize bpb",
    }
    rows = [
        [
            "**trainer bpb**, trainer held-out CE",
            f"bits per UTF-8 byte / nats per token on the first {_batches(trainer_batches)} "
            f"({tok(trainer_tokens)}) of {split}, measured by the pretraining trainer at its "
            "eval steps (pretraining checkpoints only)",
            "bits / byte, nats / token",
        ],
        [
            "**eval bpb**, eval text loss",
            f"the same quantities on the first {_batches(eval_batches)} ({tok(eval_tokens)}) of "
            "the same held-out split, measured by the eval stage for every model; "
            + (
                "the same batches as the trainer bpb"
                if eval_batches == trainer_batches
                else "the trainer bpb averages over a different number of batches from the "
                "start of the split, so the two differ for the same pretrained model"
            ),
            "bits / byte, nats / token",
        ],
    ]
    if quant and names["quant_bpb"] != "eval bpb":
        rows.append(
            [
                "**quantize bpb**",
                f"bits per byte on the first {_batches(q_batches)} ({tok(q_tokens)}) of the same "
                "split, measured by the quantize stage before and after quantisation",
                "bits / byte",
            ]
        )
    n_problems = next((int(r["problems"]) for r in models), None)
    rows += [
        [
            "**exact match**",
            f"fraction of {n_problems or '?'} held-out arithmetic problems (the RL eval set, "
            "not trained on) whose greedy answer is exactly right; 95% Wilson interval",
            "fraction",
        ],
        [
            "**SFT exact match**",
            f"the same on {sft_n or '?'} held-out SFT conversations, by the SFT trainer",
            "fraction",
        ],
        [
            "**GRPO train reward**",
            f"mean verifier reward of a step's {_get(cfg, 'rl.groups_per_step', '?')} x "
            f"{_get(cfg, 'rl.group_size', '?')} sampled completions (T="
            f"{_get(cfg, 'rl.temperature', '?')})",
            "reward (0-1)",
        ],
        [
            "**RL held-out solved**",
            f"fraction of {_get(cfg, 'rl.eval_problems', '?')} held-out problems solved greedily "
            "at an RL eval step; 95% Wilson interval",
            "fraction",
        ],
        [
            "**AL** (acceptance length)",
            "tokens emitted per verify step of speculative decoding with the MTP drafter "
            "(accepted drafts + 1); MTP healing: its eval prompts, SPEED-Bench: its prompts",
            "tokens / step",
        ],
        [
            "**acceptance@k**",
            "fraction of drafted tokens at draft position k that the model accepted; 95% "
            "intervals by bootstrap over prompts (healing) or ±1.96 bootstrap s.e. (SPEED-Bench)",
            "fraction",
        ],
    ]
    return rows, names


def render_report(run_dir: str | Path) -> dict[str, Any]:
    """Write `report.md`, `report.html` and `plots/` for the run; returns their paths."""
    run = Path(run_dir)
    plots = run / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    rec = _records(run)
    prov = _read_json(run / "provenance.json")
    cfg = _config(run)
    pre = read_jsonl(run / "pretrain" / "metrics.jsonl")
    sft = read_jsonl(run / "sft" / "metrics.jsonl")
    rl = read_jsonl(run / "rl" / "metrics.jsonl")
    heal = read_jsonl(run / "mtp_heal" / "metrics.jsonl")
    ev = read_jsonl(run / "eval" / "metrics.jsonl")
    models = [r for r in ev if r.get("kind") == "model"]
    cache = [r for r in ev if r.get("kind") == "cache_memory"]
    spec = {}
    harness: dict[str, list[dict]] = {}
    for sub in sorted((run / "eval").glob("*/metrics.jsonl")):
        rows = read_jsonl(sub)
        if any(r.get("task") == "spec_bench" for r in rows):
            spec[sub.parent.name] = rows
        rest = [r for r in rows if r.get("task") != "spec_bench"]
        if rest:
            harness[sub.parent.name] = rest
    quant = {
        q.parent.name: json.loads(q.read_text())
        for q in sorted((run / "quantize").glob("*/quantize.json"))
    }
    order = {r["model"]: i for i, r in enumerate(models)}  # chain order, as evaluated

    def chain(d: dict[str, Any]) -> dict[str, Any]:
        return dict(sorted(d.items(), key=lambda kv: order.get(kv[0], len(order))))

    quant, spec, harness = chain(quant), chain(spec), chain(harness)
    sft_n = min(_get(cfg, "sft.sft.eval_generate", 0) or 0, _get(cfg, "sft.data.held_out", 0) or 0)
    defs, names = definitions(cfg, pre, models, quant, sft_n)

    label = prov.get("run_dir") or str(run_dir)
    title = f"hybridlm speedrun — {label}"
    doc = Doc()
    doc.h(1, title)
    if prov.get("overrides"):
        doc.note(
            f"Not the default speedrun: {_settings_differ(len(prov['overrides']))} from "
            "configs/speedrun.yaml (see Provenance). Its numbers are not comparable with a "
            "default run's."
        )
    elif prov.get("is_default"):
        doc.p("The default speedrun: the settings of `configs/speedrun.yaml`, no overrides.")
    provenance_section(doc, prov, run)

    doc.h(2, "Stages")
    total = sum(r["seconds"] for r in rec.values())
    budget = prov.get("budget_minutes", cfg.get("budget_minutes"))
    done = [s for s in STAGE_ORDER if s in rec]
    doc.p(
        f"Stages finished: {len(done)} of {len(STAGE_ORDER)} ({', '.join(done) or 'none'}). "
        f"Compute time of the stage outputs in this directory: {fmt_duration(total)}"
        + (f" (budget {budget:g} min)" if budget else "")
        + ", summed over the runs that produced them. Figures below are read from the run's "
        "metrics files; their data sets are defined in the next section."
    )
    stage_rows = []
    for s in STAGE_ORDER:
        status, wall = _status(s, prov, rec.get(s))
        stage_rows.append([s, status, wall, _headline(s, rec.get(s), rl, cfg, names)])
    doc.table(["stage", "status", "wall time", "headline (metric: value)"], stage_rows)

    doc.h(2, "Figures and their data")
    doc.table(["figure", "data and method", "unit"], defs)

    out_plots = []

    def add(png: Path | None, alt: str) -> None:
        if png is not None:
            doc.img(png, alt)
            out_plots.append(str(png))

    doc.h(2, "Data: curation and tokenizer")
    if "curate" in rec:
        s = rec["curate"]["summary"]
        doc.p(
            f"Curated {s['output']['docs']:,} documents ({s['output']['chars']:,} characters); "
            f"the filter and dedup chain is in `curate/report.md`."
        )
        doc.table(
            ["curation stage", "docs in", "docs out", "wall time"],
            [
                [r["stage"], r["docs_in"], r["docs_out"], fmt_duration(r.get("seconds"))]
                for r in s["stages"]
            ],
        )
    else:
        doc.p("The curate stage did not run.")
    if "tokenizer" in rec:
        s = rec["tokenizer"]["summary"]
        doc.p(
            f"Tokenizer: {s['path']} ({s['vocab_size']} ids"
            + (
                f", {s['bytes_per_token']:.2f} bytes per token on the first 50 training documents"
                if "bytes_per_token" in s
                else ""
            )
            + (", digits split" if s.get("split_digits") else "")
            + ")."
        )

    doc.h(2, "Pretraining and SFT")
    if "pretrain" in rec:
        s = rec["pretrain"]["summary"]
        last = [r for r in pre if r.get("kind") == "eval"]
        tps = [r["tokens_per_s"] for r in pre if r.get("kind") == "train" and "tokens_per_s" in r]
        doc.p(
            f"Pretraining: {s.get('step')} steps, {s.get('tokens_seen', 0):,} tokens seen"
            + (
                f"; at step {last[-1]['step']}: trainer held-out CE "
                f"{last[-1]['eval_loss']:.3f} nats/token, trainer bpb {last[-1]['eval_bpb']:.3f}"
                if last
                else ""
            )
            + (
                f"; median training throughput {sorted(tps)[len(tps) // 2]:,.0f} tokens/s "
                f"over {len(tps)} logged steps"
                if tps
                else ""
            )
            + "."
        )
    else:
        doc.p("The pretrain stage did not run.")
    if "sft" in rec:
        evs = [r for r in sft if r.get("kind") == "eval" and "eval_accuracy" in r]
        if evs:
            doc.p(
                f"SFT exact match on {sft_n or '?'} held-out conversations, by step: "
                + ", ".join(f"step {r['step']}: {r['eval_accuracy']:.2f}" for r in evs[:-1])
                + (", " if len(evs) > 1 else "")
                + f"step {evs[-1]['step']}: {fmt_rate(evs[-1]['eval_accuracy'], sft_n)}."
            )
    add(plot_loss(pre, sft, plots / "loss.png", names), "pretraining and SFT loss")
    add(plot_bpb(pre, models, plots / "bpb.png", names), "bits per byte")

    doc.h(2, "RL (GRPO) and held-out accuracy")
    train_rl = [r for r in rl if r.get("kind") == "train"]
    if "rl" in rec and train_rl:
        k, first, last = _reward_ends(train_rl)
        ev_rl = [r for r in rl if r.get("kind") == "eval"]
        rl_n = _get(cfg, "rl.eval_problems")
        doc.p(
            f"GRPO train reward, {_window_text(k, len(train_rl))}: {first:.3f} -> {last:.3f}. "
            "Held-out solved by step: "
            + ", ".join(f"step {r['step']}: {r['all/solved']:.2f}" for r in ev_rl[:-1])
            + (", " if len(ev_rl) > 1 else "")
            + (
                f"step {ev_rl[-1]['step']}: "
                f"{fmt_rate(ev_rl[-1]['all/solved'], int(ev_rl[-1].get('all/count') or rl_n or 0))}"
                if ev_rl
                else "none"
            )
            + "."
        )
    else:
        doc.p("The rl stage did not run.")
    if models:
        doc.table(
            ["model", "eval text loss (nats/token)", "eval bpb", "arithmetic exact match"],
            [
                [
                    r["model"],
                    _fixed(r.get("text_loss"), 3),
                    _fixed(r.get("text_bpb"), 3),
                    fmt_rate(r["exact_match"], int(r["problems"])),
                ]
                for r in models
            ],
        )
    add(plot_reward(rl, models, plots / "reward.png", _get(cfg, "rl.eval_problems")), "reward")

    doc.h(2, "Speculative decoding (MTP)")
    acc = [r for r in heal if r.get("kind") == "acceptance"]
    if acc:
        rows = []
        for r in acc:
            ci = heal_intervals(r)
            pos = r["acceptance_by_position"]
            cells = [
                f"{p:.2f}" + (f" [{lo:.2f}, {hi:.2f}]" if ci else "")
                for p, (lo, hi) in zip(pos, ci or [(0, 0)] * len(pos), strict=True)
            ]
            rows.append(
                [
                    r["when"],
                    f"{r['temperature']:g}",
                    r["draft_len"],
                    r.get("prompts", "?"),
                    r.get("steps"),
                    f"{r['acceptance_length']:.2f}",
                    "; ".join(cells),
                ]
            )
        doc.p(
            "MTP healing, measured on its eval prompts before and after healing (acceptance "
            "by position with 95% bootstrap intervals over prompts where counts were recorded):"
        )
        doc.table(
            ["MTP healing", "T", "draft", "prompts", "verify steps", "AL", "acceptance@k"], rows
        )
    if spec:
        rows = []
        for name, rs in spec.items():
            v = {r["metric"]: r for r in rs}
            n = next((int(r["n"]) for r in rs if r.get("n")), None)

            def al(tag: str, v: dict = v, n: int | None = n) -> str:
                r = v.get(f"acceptance_length:{tag}")
                return fmt_pm(r["value"], r.get("stderr"), n, "prompts") if r else "–"

            speed = v.get("speedup")
            mism = v.get("greedy_mismatches")
            rows.append(
                [
                    name,
                    al("greedy"),
                    al("T1"),
                    int(mism["value"]) if mism else "–",
                    f"{speed['value']:.2f}x" if speed else "–",
                ]
            )
        doc.p(
            "SPEED-Bench protocol (draft length 7, all five categories, chat prompts; AL is the "
            "mean over categories, 95% CI from bootstrap standard errors over prompts; speedup "
            "is engine tokens/s with / without drafting on this machine):"
        )
        doc.table(["model", "AL greedy", "AL T=1", "greedy mismatches", "engine speedup"], rows)
    if not acc and not spec:
        doc.p("Neither MTP healing nor SPEED-Bench ran.")
    add(plot_acceptance(heal, spec, plots / "acceptance.png"), "acceptance by position")

    doc.h(2, "Post-training quantisation")
    if quant:
        em = {r["model"]: r for r in models}
        first = next(iter(quant.values()))
        doc.p(
            f"Calibrated on {first['calibration']['tokens']:,} tokens of "
            f"{first['calibration'].get('data', 'the training data')}; {names['quant_bpb']} "
            f"(held-out pretraining text, {first['eval']['tokens']:,} tokens): unquantised "
            f"{first['unquantized']['bpb']:.3f}. ModelOpt-format checkpoints in "
            "`quantize/<recipe>/`."
        )
        rows = []
        for name, q in quant.items():
            formats: dict[str, int] = {}
            for fmt in q["plan"].values():
                formats[fmt] = formats.get(fmt, 0) + 1
            r = em.get(name)
            rows.append(
                [
                    name,
                    f"{q['quantized']['effective_bits']:.2f}",
                    f"{q['quantized']['bpb']:.3f}",
                    f"{q['delta']['bpb_rel'] * 100:+.3f}%",
                    fmt_rate(r["exact_match"], int(r["problems"])) if r else "–",
                    ", ".join(f"{k} {v}" for k, v in sorted(formats.items())),
                ]
            )
        doc.table(
            [
                "recipe",
                "bits / weight",
                names["quant_bpb"],
                "bpb change",
                "arithmetic exact match",
                "operators",
            ],
            rows,
        )
    else:
        doc.p("The quantize stage did not run.")
    add(plot_quant(quant, models, plots / "quantization.png", names), "quantisation deltas")

    if harness:
        doc.h(2, "Harness tasks")
        rows = []
        for name, rs in harness.items():
            for r in rs:
                m = r.get("metric", "")
                if m.startswith(("bpb", "acc", "exact", "pass@")) and ":" not in m:
                    n = r.get("n")
                    rows.append(
                        [name, r["task"], m, fmt_pm(r["value"], r.get("stderr"), n, "items")]
                    )
        doc.table(["model", "task", "metric", "value (95% CI from the task's s.e.)"], rows)

    doc.h(2, "Decode-cache memory vs context")
    if cache:
        rows = []
        for name in dict.fromkeys(r["model"] for r in cache):
            rs = [r for r in cache if r["model"] == name]
            big = rs[-1]
            rows.append(
                [
                    name,
                    rs[0]["pattern"][:40] + ("…" if len(rs[0]["pattern"]) > 40 else ""),
                    f"{big['context']:,}",
                    _mib(big["hybrid_bytes"]),
                    _mib(big["attention_only_bytes"]),
                    f"{big['attention_only_bytes'] / big['hybrid_bytes']:.1f}x",
                ]
            )
        doc.table(
            ["model", "pattern", "context (tokens)", "hybrid", "all attention", "ratio"], rows
        )
        doc.p("Computed from the model configs (KV bytes per token x context + fixed Mamba state).")
    add(plot_cache(cache, plots / "cache_memory.png"), "cache memory vs context")

    md = run / "report.md"
    md.write_text(doc.markdown(run))
    page = run / "report.html"
    page.write_text(doc.html(title))
    return {"report_md": str(md), "report_html": str(page), "plots": out_plots}


def _fixed(x: float | None, digits: int) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def reward_window(steps: int, most: int = 10) -> int:
    """Steps averaged at each end of a curve: up to `most`, at most half of them (0 for none)."""
    return min(most, max(steps // 2, 1)) if steps else 0


def reward_ends(rewards: list[float]) -> tuple[int, float | None, float | None]:
    """(k, mean of the first k, mean of the last k) of a reward curve, k = `reward_window`, so
    the two ends do not overlap; (0, None, None) for an empty curve."""
    k = reward_window(len(rewards))
    if not k:
        return 0, None, None
    return k, sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def _reward_ends(train: list[dict]) -> tuple[int, float, float]:
    """`reward_ends` of the `train` rows of an RL metrics file (at least one row)."""
    k, first, last = reward_ends([r["reward_mean"] for r in train])
    assert first is not None and last is not None
    return k, first, last


def _window_text(k: int, n: int) -> str:
    if k == 1:
        return f"first -> last step of {n}"
    return f"mean of the first / last {k} of {n} steps"


def _headline(
    stage: str,
    rec: dict[str, Any] | None,
    rl: list[dict],
    cfg: dict[str, Any],
    names: dict[str, str],
) -> str:
    if rec is None:
        return "not run"
    s = rec["summary"]
    try:
        if stage == "curate":
            return f"documents kept: {s['output']['docs']:,} ({s['output']['chars']:,} chars)"
        if stage == "tokenizer":
            bpt = s.get("bytes_per_token")
            return f"vocabulary: {s['vocab_size']} ids" + (
                f", {bpt:.2f} bytes/token" if bpt else ""
            )
        if stage == "pretrain":
            ev = s.get("eval") or {}
            bpb = ev.get("eval_bpb")
            return f"{names['trainer_bpb']}: " + (
                f"{bpb:.3f} at step {s.get('step')}"
                if bpb is not None
                else f"– (step {s.get('step')})"
            )
        if stage == "sft":
            ev = s.get("eval") or {}
            acc = ev.get("eval_accuracy")
            text = f"steps: {s.get('step')}"
            if ev.get("eval_loss") is not None:
                text += f"; held-out NLL: {ev['eval_loss']:.3f} nats/token"
            if acc is not None:
                n = min(_get(cfg, "sft.sft.eval_generate", 0), _get(cfg, "sft.data.held_out", 0))
                text += f"; SFT exact match: {acc:.2f}" + (f" (n={n})" if n else "")
            return text
        if stage == "rl":
            train = [r for r in rl if r.get("kind") == "train"]
            if train:
                k, first, last = _reward_ends(train)
                return f"train reward ({_window_text(k, len(train))}): {first:.3f} -> {last:.3f}"
            return "train reward: no steps logged"
        if stage == "mtp_heal":
            return f"AL at draft length {s['draft_len']}, before -> after: " + ", ".join(
                f"{t.replace('T', 'T=')} {b:.2f} -> {a:.2f}"
                for t, (b, a) in s["acceptance_length"].items()
            )
        if stage == "quantize":
            return f"{names['quant_bpb']} change: " + ", ".join(
                f"{n} {r['delta']['bpb_rel'] * 100:+.2f}%" for n, r in s["results"].items()
            )
        if stage == "eval":
            ms = s["models"]
            n = ms[0]["problems"] if ms else 0
            return f"arithmetic exact match (n={n}): " + ", ".join(
                f"{m['model']} {m['exact_match']:.2f}" for m in ms
            )
    except (KeyError, TypeError, ValueError, IndexError):
        pass
    return "done"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m hybridlm.eval.report RUN_DIR")
    print(json.dumps(render_report(sys.argv[1]), indent=1))
