"""The report card's figures (PNG): pretraining / SFT loss, bits per byte, GRPO reward and
held-out exact match, MTP acceptance by draft position, quantisation deltas, decode-cache memory.
Each takes the rows of a run's metrics files and returns None when its stage did not run; bars
start at zero, deltas are plotted against a labelled zero line, rates carry 95% intervals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .plot import pyplot, save_figure
from .stats import Z95, heal_intervals, rate_ci

# per-group quantisation plot: the largest |delta| groups shown, the rest summarised
TOP_GROUPS = 12


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
        ax.set_title(f"held-out RL problems, greedy ({n_txt}, 95% Wilson CI)")
        ax.tick_params(axis="x", labelsize=8)
    else:
        _no_data(ax, "the eval stage did not run")
    ax.set_ylabel("solved (fraction of problems)")
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
    labelled zero line) and the held-out solved fraction with Wilson intervals; then the loss change
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
        ax.set_title(f"held-out solved ({n_txt}, 95% Wilson CI)")
    else:
        _no_data(ax, "the eval stage did not run")
    ax.set_ylabel("solved (fraction of problems)")
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
