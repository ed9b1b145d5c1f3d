"""The report card of a flow run: `report.md`, `report.html` and `plots/*.png`, derived afterwards
from the run directory's files (nothing is measured here).

    hybridlm report runs/speedrun      # (re)render a finished or partial run

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
deltas per recipe and per operator group, decode-cache memory vs context (`figures.py`). A
section whose stage did not run says so instead of showing a plot.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..stage import Report, Stage
from ..stage import dotted_get as _get
from .doc import Doc, fmt_duration, fmt_pm, fmt_rate
from .figures import plot_acceptance, plot_bpb, plot_cache, plot_loss, plot_quant, plot_reward
from .plot import read_metrics
from .stats import change_text, env_changes, heal_intervals, reward_ends, window_text


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file; none when its stage did not run."""
    return read_metrics(path) if path.is_file() else []


def _mib(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB" if b < 2**30 else f"{b / 2**30:,.2f} GiB"


def _short_time(iso: str | None) -> str:
    """`2025-01-31 14:02` from an ISO time (as written; no zone conversion)."""
    if not iso:
        return "–"
    return iso.replace("T", " ")[:16]


def _records(run: Path, order: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in order:
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
            "**held-out solved**",
            f"fraction of {n_problems or '?'} held-out problems (the RL eval set over its "
            "environments, drawn with another seed: a generated family's small prompt space "
            "can repeat a training prompt) that the greedy reply solves (the verifier's reward "
            "is 1); 95% Wilson interval",
            "fraction",
        ],
        [
            "**SFT exact match**",
            f"the same on {sft_n or '?'} held-out SFT conversations, by the SFT trainer",
            "fraction",
        ],
        [
            "**GRPO train reward**",
            f"mean verifier reward of a step's {_get(cfg, 'rl.rl.groups_per_step', '?')} x "
            f"{_get(cfg, 'rl.rl.group_size', '?')} sampled completions (T="
            f"{_get(cfg, 'rl.rl.temperature', '?')})",
            "reward (0-1)",
        ],
        [
            "**RL held-out solved**",
            f"fraction of {_get(cfg, 'rl.data.eval_problems', '?')} held-out problems solved "
            "greedily at an RL eval step; 95% Wilson interval",
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


@dataclass
class _Card:
    """What the report's sections read: the run's records, config, provenance and metrics files
    (read once), and the document they write (`add`: a plot, when one was drawn)."""

    run: Path
    run_dir: str | Path
    measured: list[Stage]  # the registry's stages less the report itself, in chain order
    rec: dict[str, dict[str, Any]]
    prov: dict[str, Any]
    cfg: dict[str, Any]
    pre: list[dict]
    sft: list[dict]
    rl: list[dict]
    heal: list[dict]
    models: list[dict]
    cache: list[dict]
    spec: dict[str, list[dict]]
    harness: dict[str, list[dict]]
    quant: dict[str, Any]
    sft_n: int
    defs: list[list[str]]
    names: dict[str, str]
    plots: Path
    doc: Doc = field(default_factory=Doc)
    title: str = ""
    out_plots: list[str] = field(default_factory=list)

    @property
    def stage_order(self) -> list[str]:
        return [s.name for s in self.measured]

    def add(self, png: Path | None, alt: str) -> None:
        if png is not None:
            self.doc.img(png, alt)
            self.out_plots.append(str(png))

    @classmethod
    def read(cls, run_dir: str | Path, stages: Sequence[Stage]) -> _Card:
        run = Path(run_dir)
        if not run.is_dir():
            raise ValueError(f"no run directory at {run}")
        plots = run / "plots"
        plots.mkdir(parents=True, exist_ok=True)
        # the stages in chain order, one folder each in a run directory (the report itself aside)
        measured = [s for s in stages if not s.derived]
        rec = _records(run, [s.name for s in measured])
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
        qad = _read_json(run / "qad" / "qad.json")
        if (
            "qad" in rec and "delta" in qad
        ):  # QAD's held-out text figures, in quantize.json's layout
            quant[next(iter(rec["qad"]["summary"]["models"]))] = qad
        order = {r["model"]: i for i, r in enumerate(models)}  # chain order, as evaluated

        def chain(d: dict[str, Any]) -> dict[str, Any]:
            return dict(sorted(d.items(), key=lambda kv: order.get(kv[0], len(order))))

        quant, spec, harness = chain(quant), chain(spec), chain(harness)
        sft_n = min(
            _get(cfg, "sft.sft.eval_generate", 0) or 0,
            _get(cfg, "sft.data.held_out", 0) or 0,
        )
        defs, names = definitions(cfg, pre, models, quant, sft_n)
        return cls(
            run=run,
            run_dir=run_dir,
            measured=measured,
            rec=rec,
            prov=prov,
            cfg=cfg,
            pre=pre,
            sft=sft,
            rl=rl,
            heal=heal,
            models=models,
            cache=cache,
            spec=spec,
            harness=harness,
            quant=quant,
            sft_n=sft_n,
            defs=defs,
            names=names,
            plots=plots,
        )


def render_report(run_dir: str | Path, stages: Sequence[Stage]) -> dict[str, Any]:
    """Write `report.md`, `report.html` and `plots/` for the run of the flow `stages` (the
    registry, `hybridlm.stages.STAGES`); returns their paths."""
    c = _Card.read(run_dir, stages)
    _header_section(c)
    _stages_section(c)
    c.doc.h(2, "Figures and their data")
    c.doc.table(["figure", "data and method", "unit"], c.defs)
    for section in (
        _data_section,
        _training_section,
        _rl_section,
        _speculative_section,
        _quantisation_section,
        _harness_section,
        _cache_section,
    ):
        section(c)
    md = c.run / "report.md"
    md.write_text(c.doc.markdown(c.run))
    page = c.run / "report.html"
    page.write_text(c.doc.html(c.title))
    return {"report_md": str(md), "report_html": str(page), "plots": c.out_plots}


def _header_section(c: _Card) -> None:
    """The title, whether the run used the default settings, and its provenance."""
    run, prov, doc = c.run, c.prov, c.doc
    c.title = f"hybridlm speedrun — {prov.get('run_dir') or str(c.run_dir)}"
    doc.h(1, c.title)
    if prov.get("overrides"):
        doc.note(
            f"Not the default speedrun: {_settings_differ(len(prov['overrides']))} from "
            "configs/speedrun.yaml (see Provenance). Its numbers are not comparable with a "
            "default run's."
        )
    elif prov.get("is_default"):
        doc.p("The default speedrun: the settings of `configs/speedrun.yaml`, no overrides.")
    provenance_section(doc, prov, run)


def _stages_section(c: _Card) -> None:
    """Each stage's status, wall time and headline (`Stage.headline`), in registry order."""
    run, measured, stage_order, rec, prov, cfg, names, doc = (
        c.run,
        c.measured,
        c.stage_order,
        c.rec,
        c.prov,
        c.cfg,
        c.names,
        c.doc,
    )
    doc.h(2, "Stages")
    total = sum(r["seconds"] for r in rec.values())
    budget = prov.get("budget_minutes", cfg.get("budget_minutes"))
    done = [s for s in stage_order if s in rec]
    skipped = set(cfg.get("skip") or [])
    wanted = [s for s in stage_order if s not in skipped or s in rec]
    doc.p(
        f"Stages finished: {len(done)} of {len(wanted)} ({', '.join(done) or 'none'})"
        + (f"; skipped: {', '.join(s for s in stage_order if s not in wanted)}" if skipped else "")
        + ". "
        f"Compute time of the stage outputs in this directory: {fmt_duration(total)}"
        + (f" (budget {budget:g} min)" if budget else "")
        + ", summed over the runs that produced them. Figures below are read from the run's "
        "metrics files; their data sets are defined in the next section."
    )
    stage_rows = []
    report = Report(run, cfg, names)
    for s in measured:
        status, wall = _status(s.name, prov, rec.get(s.name))
        stage_rows.append([s.name, status, wall, _headline(s, rec.get(s.name), report)])
    doc.table(["stage", "status", "wall time", "headline (metric: value)"], stage_rows)


def _data_section(c: _Card) -> None:
    """What curation kept, stage by stage, and the tokenizer."""
    rec, doc = c.rec, c.doc
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


def _training_section(c: _Card) -> None:
    """Pretraining and SFT: steps, tokens, held-out figures; the loss and bpb plots."""
    rec, pre, sft, models, sft_n, names, plots, doc, add = (
        c.rec,
        c.pre,
        c.sft,
        c.models,
        c.sft_n,
        c.names,
        c.plots,
        c.doc,
        c.add,
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


def _rl_section(c: _Card) -> None:
    """GRPO reward and held-out accuracy; every model's held-out figures."""
    rec, cfg, rl, models, plots, doc, add = c.rec, c.cfg, c.rl, c.models, c.plots, c.doc, c.add
    doc.h(2, "RL (GRPO) and held-out accuracy")
    train_rl = [r for r in rl if r.get("kind") == "train"]
    if "rl" in rec and train_rl:
        k, first, last = _reward_ends(train_rl)
        ev_rl = [r for r in rl if r.get("kind") == "eval"]
        rl_n = _get(cfg, "rl.data.eval_problems")
        doc.p(
            f"GRPO train reward, {window_text(k, len(train_rl))}: {first:.3f} -> {last:.3f}. "
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
        _rl_env_table(c, train_rl, ev_rl)
    else:
        doc.p("The rl stage did not run.")
    if models:
        envs = sorted({e for r in models for e in r.get("solved_by_env") or {}})
        doc.table(
            ["model", "eval text loss (nats/token)", "eval bpb", "held-out solved", *envs],
            [
                [
                    r["model"],
                    _fixed(r.get("text_loss"), 3),
                    _fixed(r.get("text_bpb"), 3),
                    fmt_rate(r["exact_match"], int(r["problems"])),
                    *(_fixed((r.get("solved_by_env") or {}).get(e), 2) for e in envs),
                ]
                for r in models
            ],
        )
    add(plot_reward(rl, models, plots / "reward.png", _get(cfg, "rl.data.eval_problems")), "reward")


def _rl_env_table(c: _Card, train: list[dict], evals: list[dict]) -> None:
    """Per environment: what the starting policy solves sampled (the difficulty filter's pass@1
    and pass@k on training problems), the problems kept, the held-out greedy solve rate before
    and after with the change's standard error, and the sampled solve rate of the first / last
    steps' draws."""
    changes, sampled = env_changes(evals), env_changes(evals, "sampled")
    filt = ((c.rec.get("rl") or {}).get("summary") or {}).get("difficulty_filter") or {}
    envs = sorted({*filt, *(e for e in changes if e != "all")})
    if not envs:
        return
    k = _get(c.cfg, "rl.data.difficulty_filter.samples", 8)
    rows = []
    for env in envs:
        f = filt.get(env, {})
        draws = [r[f"draw/{env}/solved"] for r in train if f"draw/{env}/solved" in r]
        w, first, last = reward_ends(draws)
        row = [
            env,
            _fixed(f.get("pass@1"), 2) + " / " + _fixed(f.get(f"pass@{k}"), 2) if f else "-",
            f"{f['kept']:.0f} of {f['pool']:.0f}" if f else "-",
        ]
        for ch in (changes, sampled):
            p, q, se, n = ch.get(env, (None, None, 0.0, 0))
            row += [
                f"{p:.2f} -> {q:.2f} (n={n})" if p is not None else "-",
                change_text(q - p, se) if p is not None else "-",
            ]
        rows.append([*row, f"{first:.2f} -> {last:.2f}" if first is not None else "-"])
    doc = c.doc
    doc.p(
        f"Per environment: the SFT model's pass@1 / pass@{k} at T="
        f"{_get(c.cfg, 'rl.rl.temperature', '?')} on the first "
        f"{_get(c.cfg, 'rl.data.difficulty_filter.problems', '?')} training problems (the "
        "difficulty filter's samples), the pool problems it kept, the held-out solve rate at "
        "the first and last RL eval, greedy and sampled at the RL temperature, each change ± "
        "one standard error (evaluation noise of this one run: two proportions; a change under "
        "2 SE is called within noise; training noise needs several seeds), and the sampled "
        "solve rate of the training draws (mean of the first / last steps)."
    )
    doc.table(
        ["environment", f"SFT pass@1 / pass@{k}", "kept", "held-out greedy", "change",
         "held-out sampled", "change", "training draws"],
        rows,
    )  # fmt: skip


def _speculative_section(c: _Card) -> None:
    """MTP acceptance before / after healing and SPEED-Bench."""
    heal, spec, plots, doc, add = c.heal, c.spec, c.plots, c.doc, c.add
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


def _quantisation_section(c: _Card) -> None:
    """The quantised checkpoints (PTQ recipes and QAD) against the unquantised model."""
    rec, models, quant, names, plots, doc, add = (
        c.rec,
        c.models,
        c.quant,
        c.names,
        c.plots,
        c.doc,
        c.add,
    )
    doc.h(2, "Post-training quantisation")
    if quant:
        em = {r["model"]: r for r in models}
        first = next(iter(quant.values()))
        doc.p(
            f"Calibrated on {first['calibration']['tokens']:,} tokens of "
            f"{first['calibration'].get('data', 'the training data')}; {names['quant_bpb']} "
            f"(held-out pretraining text, {first['eval']['tokens']:,} tokens): unquantised "
            f"{first['unquantized']['bpb']:.3f}. ModelOpt-format checkpoints in "
            "`quantize/<recipe>/`"
            + (" and `qad/hf`" if "qad" in rec else "")
            + (
                f"; KV cache {first['kv_cache']['format'].upper()} (per-tensor scales)."
                if first.get("kv_cache")
                else "."
            )
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
                "held-out solved",
                "operators",
            ],
            rows,
        )
    else:
        doc.p("The quantize stage did not run.")
    add(plot_quant(quant, models, plots / "quantization.png", names), "quantisation deltas")


def _harness_section(c: _Card) -> None:
    """The harness tasks' figures, per model."""
    harness, doc = c.harness, c.doc
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


def _cache_section(c: _Card) -> None:
    """Decode-cache memory against context, hybrid vs all attention."""
    cache, plots, doc, add = c.cache, c.plots, c.doc, c.add
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


def _fixed(x: float | None, digits: int) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _reward_ends(train: list[dict]) -> tuple[int, float, float]:
    """`reward_ends` of the `train` rows of an RL metrics file (at least one row)."""
    k, first, last = reward_ends([r["reward_mean"] for r in train])
    assert first is not None and last is not None
    return k, first, last


def _headline(stage: Stage, rec: dict[str, Any] | None, report: Report) -> str:
    """The stage's headline of its summary ("done" when a summary lacks what it reads)."""
    if rec is None:
        return "not run"
    try:
        return stage.headline(rec["summary"], report)
    except (KeyError, TypeError, ValueError, IndexError):
        return "done"


# report.md + report.html with plots, from the other stages' files
STAGE = Stage("report", run=lambda flow: render_report(flow.run_dir, flow.stages), derived=True)
