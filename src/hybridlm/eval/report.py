"""The report card of a flow run: `report.md`, `report.html` and `plots/*.png`, derived afterwards
from the run directory's metrics files and stage records (nothing is measured here).

    python -m hybridlm.eval.report runs/speedrun      # (re)render a finished or partial run

Plots: pretraining / SFT loss, bits per byte (over pretraining and per stage), GRPO reward and
held-out exact match, MTP acceptance by draft position (before / after healing, SPEED-Bench at
draft length 7), NVFP4 loss delta per quantised group, decode-cache memory vs context. A section
whose stage did not run says so instead of showing a plot.
"""

from __future__ import annotations

import base64
import html
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..speedrun import STAGES
from ..train.plot import pyplot, read_metrics, save_figure

STAGE_ORDER = STAGES[:-1]  # every stage but the report itself


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file; none when its stage did not run."""
    return read_metrics(path) if path.is_file() else []


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _mib(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB" if b < 2**30 else f"{b / 2**30:,.2f} GiB"


# ---------------------------------------------------------------------------- document model
@dataclass
class Doc:
    """Blocks rendered both to Markdown and to a self-contained HTML page."""

    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", (level, text)))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def table(self, header: list[str], rows: list[list[Any]]) -> None:
        self.blocks.append(("table", (header, [[_fmt(c) for c in r] for r in rows])))

    def img(self, path: Path, alt: str) -> None:
        self.blocks.append(("img", (path, alt)))

    def markdown(self, root: Path) -> str:
        out = []
        for kind, val in self.blocks:
            if kind == "h":
                out.append("#" * val[0] + " " + val[1])
            elif kind == "p":
                out.append(val)
            elif kind == "table":
                header, rows = val
                out.append("| " + " | ".join(header) + " |")
                out.append("|" + "---|" * len(header))
                out.extend("| " + " | ".join(r) + " |" for r in rows)
            elif kind == "img":
                out.append(f"![{val[1]}]({val[0].relative_to(root)})")
            out.append("")
        return "\n".join(out)

    def html(self, title: str) -> str:
        parts = [
            "<!doctype html><html><head><meta charset='utf-8'>",
            f"<title>{html.escape(title)}</title><style>",
            "body{font-family:system-ui,sans-serif;max-width:60em;margin:2em auto;padding:0 1em;"
            "color:#222}table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;"
            "padding:.2em .6em;text-align:right}th{background:#f3f3f3}td:first-child,"
            "th:first-child{text-align:left}img{max-width:100%;border:1px solid #eee}"
            "code{background:#f5f5f5;padding:0 .2em}",
            "</style></head><body>",
        ]
        for kind, val in self.blocks:
            if kind == "h":
                parts.append(f"<h{val[0]}>{html.escape(val[1])}</h{val[0]}>")
            elif kind == "p":
                parts.append(f"<p>{_inline_html(val)}</p>")
            elif kind == "table":
                header, rows = val
                parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header))
                for r in rows:
                    parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r))
                parts.append("</table>")
            elif kind == "img":
                data = base64.b64encode(val[0].read_bytes()).decode()
                parts.append(
                    f"<p><img alt='{html.escape(val[1])}' src='data:image/png;base64,{data}'></p>"
                )
        parts.append("</body></html>")
        return "\n".join(parts)


def _inline_html(text: str) -> str:
    """`code` spans of the Markdown paragraphs."""
    pieces = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


# ---------------------------------------------------------------------------- plots
def plot_loss(pre: list[dict], sft: list[dict], png: Path) -> Path | None:
    train = [r for r in pre if r.get("kind") == "train"]
    if not train and not sft:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    if train:
        ax.plot([r["step"] for r in train], [r["ce"] for r in train], label="train CE")
        if "mtp" in train[0]:
            ax.plot([r["step"] for r in train], [r["mtp"] for r in train], label="train MTP", lw=1)
        ev = [r for r in pre if r.get("kind") == "eval"]
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out CE")
        ax.legend()
    ax.set(title="pretraining", xlabel="step", ylabel="nats / token")
    ax = axes[1]
    st = [r for r in sft if r.get("kind") == "train"]
    if st:
        ax.plot([r["step"] for r in st], [r["loss"] for r in st], label="train loss")
        ev = [r for r in sft if r.get("kind") == "eval" and "eval_loss" in r]
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out NLL")
        ax.set_yscale("log")
        ax.legend()
    ax.set(title="SFT (assistant tokens)", xlabel="step")
    return save_figure(fig, png)


def plot_bpb(pre: list[dict], models: list[dict], png: Path) -> Path | None:
    ev = [r for r in pre if r.get("kind") == "eval" and "eval_bpb" in r]
    bars = [r for r in models if "text_bpb" in r]
    if not ev and not bars:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    if ev:
        axes[0].plot([r["step"] for r in ev], [r["eval_bpb"] for r in ev], "o-")
    axes[0].set(title="held-out bits per byte during pretraining", xlabel="step", ylabel="bpb")
    if bars:
        names = [r["model"] for r in bars]
        vals = [r["text_bpb"] for r in bars]
        axes[1].bar(names, vals, color="tab:blue")
        for i, v in enumerate(vals):
            axes[1].text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
        lo, hi = min(vals), max(vals)
        axes[1].set_ylim(max(0.0, lo - (hi - lo) - 0.05), hi + (hi - lo) * 0.3 + 0.05)
    axes[1].set(title="held-out pretraining text, each stage's model", ylabel="bpb")
    return save_figure(fig, png)


def plot_reward(rl: list[dict], models: list[dict], png: Path) -> Path | None:
    train = [r for r in rl if r.get("kind") == "train"]
    if not train and not models:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    if train:
        ax.plot([r["step"] for r in train], [r["reward_mean"] for r in train], label="train reward")
        ev = [r for r in rl if r.get("kind") == "eval"]
        ax.plot([r["step"] for r in ev], [r["all/solved"] for r in ev], "o-", label="held-out")
        ax.set_ylim(0, 1)
        ax.legend()
    ax.set(title="GRPO: verifier reward", xlabel="step", ylabel="fraction solved")
    ax = axes[1]
    if models:
        names = [r["model"] for r in models]
        vals = [r["exact_match"] for r in models]
        err = [r["exact_match_stderr"] for r in models]
        ax.bar(names, vals, yerr=err, capsize=3, color="tab:green")
        ax.set_ylim(0, 1)
    ax.set(title="held-out arithmetic exact match (greedy, ± s.e.)")
    return save_figure(fig, png)


def _spec_positions(rows: list[dict], tag: str) -> list[float]:
    by = {}
    for r in rows:
        m = r.get("metric", "")
        if r.get("task") == "spec_bench" and m.startswith("acceptance@") and m.endswith(":" + tag):
            by[int(m.split("@")[1].split(":")[0])] = r["value"]
    return [by[k] for k in sorted(by)]


def plot_acceptance(heal: list[dict], spec: dict[str, list[dict]], png: Path) -> Path | None:
    acc = [r for r in heal if r.get("kind") == "acceptance"]
    if not acc and not spec:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    for r in acc:
        pos = r["acceptance_by_position"]
        style = "--" if r["when"] == "before" else "-"
        label = f"{r['when']} healing, T={r['temperature']:g} (AL {r['acceptance_length']:.2f})"
        ax.plot(range(1, len(pos) + 1), pos, style, marker="o", label=label)
        ax.set_xticks(range(1, len(pos) + 1))
    ax.set(title="MTP healing: acceptance by draft position", xlabel="position", ylim=(0, 1.02))
    if acc:
        ax.legend(fontsize=8)
    ax = axes[1]
    for name, rows in spec.items():
        for tag, style in (("greedy", "-"), ("T1", "--")):
            pos = _spec_positions(rows, tag)
            if pos:
                ax.plot(range(1, len(pos) + 1), pos, style, marker="o", label=f"{name} {tag}")
    ax.set(title="SPEED-Bench, draft length 7", xlabel="position", ylim=(0, 1.02))
    if spec:
        ax.legend(fontsize=8)
    return save_figure(fig, png)


def plot_quant(quant: dict[str, dict[str, Any]], models: list[dict], png: Path) -> Path | None:
    """Held-out bpb and task accuracy per recipe next to the unquantised model, and the loss
    delta of each operator group quantised alone (first recipe with per-group deltas)."""
    if not quant:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), gridspec_kw={"width_ratios": [1, 1, 2.4]})
    first = next(iter(quant.values()))
    names = ["unquantized", *quant]
    bpb = [first["unquantized"]["bpb"], *(q["quantized"]["bpb"] for q in quant.values())]
    axes[0].bar(names, bpb, color=["tab:gray"] + ["tab:orange"] * len(quant))
    axes[0].set_ylim(min(bpb) * 0.98, max(bpb) * 1.01)
    axes[0].set(title="held-out text bpb")
    em = {r["model"]: r for r in models}
    src = next((r for r in models if r.get("stage") == "mtp_heal"), None) or (
        next((r for r in models if r.get("stage") != "quantize"), None)
    )
    bars = [(src["model"], src)] if src else []
    bars += [(n, em[n]) for n in quant if n in em]
    if bars:
        axes[1].bar(
            [n for n, _ in bars],
            [r["exact_match"] for _, r in bars],
            yerr=[r["exact_match_stderr"] for _, r in bars],
            capsize=3,
            color=["tab:gray"] + ["tab:orange"] * (len(bars) - 1),
        )
        axes[1].set_ylim(0, 1)
    axes[1].set(title="arithmetic exact match (± s.e.)")
    for name, q in quant.items():
        groups = [g for g in q.get("groups", []) if g.get("loss_delta") is not None]
        if groups and name != "autoquant":
            axes[2].bar(range(len(groups)), [g["loss_delta"] for g in groups], color="tab:orange")
            axes[2].set_xticks(range(len(groups)))
            axes[2].set_xticklabels([g["group"] for g in groups], rotation=70, fontsize=6)
            axes[2].set(title=f"{name}: loss delta with one group quantised", ylabel="nats/token")
            break
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
        ylabel="MiB",
    )
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


def render_report(run_dir: str | Path) -> dict[str, Any]:
    """Write `report.md`, `report.html` and `plots/` for the run; returns their paths."""
    run = Path(run_dir)
    plots = run / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    rec = _records(run)
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

    doc = Doc()
    doc.h(1, f"hybridlm speedrun: {run.name}")
    total = sum(r["seconds"] for r in rec.values())
    budget = None
    cfg_path = run / "speedrun.yaml"
    if cfg_path.is_file():
        import yaml

        budget = (yaml.safe_load(cfg_path.read_text()) or {}).get("budget_minutes")
    done = [s for s in STAGE_ORDER if s in rec]
    doc.p(
        f"Stages finished: {len(done)} of {len(STAGE_ORDER)} ({', '.join(done) or 'none'}). "
        f"Stage time in all: {total / 60:.1f} min"
        + (f" (budget {budget:g} min)." if budget else ".")
        + " Figures below are read from the run's metrics files."
    )
    doc.table(
        ["stage", "minutes", "headline"],
        [
            [s, rec[s]["seconds"] / 60 if s in rec else None, _headline(s, rec.get(s))]
            for s in STAGE_ORDER
        ],
    )
    out_plots = []

    def add(png: Path | None, alt: str) -> None:
        if png is not None:
            doc.img(png, alt)
            out_plots.append(str(png))

    doc.h(2, "Data: curation and tokenizer")
    if "curate" in rec:
        s = rec["curate"]["summary"]
        doc.p(
            f"Curated {s['output']['docs']} documents ({s['output']['chars']:,} characters); "
            f"the filter and dedup chain is in `curate/report.md`."
        )
        doc.table(
            ["curation stage", "docs in", "docs out", "seconds"],
            [[r["stage"], r["docs_in"], r["docs_out"], r["seconds"]] for r in s["stages"]],
        )
    else:
        doc.p("The curate stage did not run.")
    if "tokenizer" in rec:
        s = rec["tokenizer"]["summary"]
        doc.p(
            f"Tokenizer: {s['path']} ({s['vocab_size']} ids"
            + (
                f", {s['bytes_per_token']:.2f} bytes per token on the training text"
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
            f"Pretraining: {s.get('step')} steps"
            + (
                f", held-out loss {last[-1]['eval_loss']:.4f}, bpb {last[-1]['eval_bpb']:.4f}"
                if last
                else ""
            )
            + (f", median {sorted(tps)[len(tps) // 2]:,.0f} tokens/s" if tps else "")
            + "."
        )
    if "sft" in rec:
        evs = [r for r in sft if r.get("kind") == "eval" and "eval_accuracy" in r]
        if evs:
            doc.p(
                "SFT held-out exact match by step: "
                + ", ".join(f"{r['step']}: {r['eval_accuracy']:.3f}" for r in evs)
                + "."
            )
    add(plot_loss(pre, sft, plots / "loss.png"), "pretraining and SFT loss")
    add(plot_bpb(pre, models, plots / "bpb.png"), "bits per byte")

    doc.h(2, "RL (GRPO) and held-out accuracy")
    if "rl" in rec:
        s = rec["rl"]["summary"]
        doc.p(
            f"GRPO train reward (mean of the first / last 10 steps): "
            f"{s['reward_first10']:.3f} -> {s['reward_last10']:.3f}; held-out by step: "
            + ", ".join(f"{e['step']}: {e['solved']:.3f}" for e in s["eval"])
            + "."
        )
    else:
        doc.p("The rl stage did not run.")
    if models:
        doc.table(
            ["model", "text loss", "text bpb", "arithmetic exact match", "± s.e.", "n"],
            [
                [
                    r["model"],
                    r.get("text_loss"),
                    r.get("text_bpb"),
                    r["exact_match"],
                    r["exact_match_stderr"],
                    r["problems"],
                ]
                for r in models
            ],
        )
    add(plot_reward(rl, models, plots / "reward.png"), "reward and exact match")

    doc.h(2, "Speculative decoding (MTP)")
    acc = [r for r in heal if r.get("kind") == "acceptance"]
    if acc:
        doc.table(
            ["MTP healing", "T", "draft", "acceptance length", "by position"],
            [
                [
                    r["when"],
                    f"{r['temperature']:g}",
                    r["draft_len"],
                    r["acceptance_length"],
                    " ".join(f"{p:.2f}" for p in r["acceptance_by_position"]),
                ]
                for r in acc
            ],
        )
    if spec:
        rows = []
        for name, rs in spec.items():
            v = {r["metric"]: r["value"] for r in rs}
            rows.append(
                [
                    name,
                    v.get("acceptance_length:greedy"),
                    v.get("acceptance_length:T1"),
                    int(v.get("greedy_mismatches", 0)),
                    v.get("speedup"),
                ]
            )
        doc.p("SPEED-Bench protocol (draft length 7, all five categories, chat prompts):")
        doc.table(["model", "AL greedy", "AL T=1", "greedy mismatches", "engine speedup"], rows)
    add(plot_acceptance(heal, spec, plots / "acceptance.png"), "acceptance by position")

    doc.h(2, "Post-training quantisation")
    if quant:
        em = {r["model"]: r for r in models}
        first = next(iter(quant.values()))
        doc.p(
            f"Calibrated on {first['calibration']['tokens']:,} tokens of "
            f"{first['calibration'].get('data', 'the training data')}; held-out loss and bpb on "
            f"{first['eval']['tokens']:,} tokens of pretraining text; ModelOpt-format "
            "checkpoints in `quantize/<recipe>/`."
        )
        rows = []
        for name, q in quant.items():
            formats: dict[str, int] = {}
            for fmt in q["plan"].values():
                formats[fmt] = formats.get(fmt, 0) + 1
            r = em.get(name, {})
            rows.append(
                [
                    name,
                    q["quantized"]["effective_bits"],
                    f"{q['delta']['loss_rel'] * 100:+.3f}%",
                    r.get("exact_match"),
                    ", ".join(f"{k} {v}" for k, v in sorted(formats.items())),
                ]
            )
        doc.table(["recipe", "bits / weight", "d loss (= d bpb)", "exact match", "operators"], rows)
    else:
        doc.p("The quantize stage did not run.")
    add(plot_quant(quant, models, plots / "quantization.png"), "quantisation deltas")

    if harness:
        doc.h(2, "Harness tasks")
        rows = []
        for name, rs in harness.items():
            for r in rs:
                m = r.get("metric", "")
                if m.startswith(("bpb", "acc", "exact", "pass@")) and ":" not in m:
                    rows.append([name, r["task"], m, r["value"], r.get("stderr"), r.get("n")])
        doc.table(["model", "task", "metric", "value", "± s.e.", "n"], rows)

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
                    big["context"],
                    _mib(big["hybrid_bytes"]),
                    _mib(big["attention_only_bytes"]),
                    f"{big['attention_only_bytes'] / big['hybrid_bytes']:.1f}x",
                ]
            )
        doc.table(["model", "pattern", "context", "hybrid", "all attention", "ratio"], rows)
        doc.p("Computed from the model configs (KV bytes per token x context + fixed Mamba state).")
    add(plot_cache(cache, plots / "cache_memory.png"), "cache memory vs context")

    md = run / "report.md"
    md.write_text(doc.markdown(run))
    page = run / "report.html"
    page.write_text(doc.html(f"hybridlm speedrun: {run.name}"))
    return {"report_md": str(md), "report_html": str(page), "plots": out_plots}


def _headline(stage: str, rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "not run"
    s = rec["summary"]
    try:
        if stage == "curate":
            return f"{s['output']['docs']} docs, {s['output']['chars']:,} chars"
        if stage == "tokenizer":
            return f"{s['vocab_size']} ids"
        if stage == "pretrain":
            ev = s.get("eval") or {}
            return f"step {s.get('step')}, held-out bpb {_fmt(ev.get('eval_bpb'))}"
        if stage == "sft":
            return f"step {s.get('step')}"
        if stage == "rl":
            return f"reward {s['reward_first10']:.3f} -> {s['reward_last10']:.3f}"
        if stage == "mtp_heal":
            return f"AL at draft {s['draft_len']}: " + ", ".join(
                f"{t} {b:.2f} -> {a:.2f}" for t, (b, a) in s["acceptance_length"].items()
            )
        if stage == "quantize":
            return ", ".join(
                f"{n}: bpb {r['delta']['bpb_rel'] * 100:+.2f}%" for n, r in s["results"].items()
            )
        if stage == "eval":
            return ", ".join(f"{m['model']} {m['exact_match']:.2f}" for m in s["models"])
    except (KeyError, TypeError):
        pass
    return "done"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m hybridlm.eval.report RUN_DIR")
    print(json.dumps(render_report(sys.argv[1]), indent=1))
