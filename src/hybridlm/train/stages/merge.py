"""Checkpoint merging over a sliding window of a run's last checkpoints (Olmo 3 §3; Nemotron 3
Super §2.5; WSM, Tian et al. 2025), and model soups across runs (Olmo 3 §4: two midtraining
seeds; §5: the last long-context checkpoints).

    hybridlm merge --run runs/quickstart --windows 2,3,4 --weights uniform,minus_sqrt

For every window size N and weighting, the last N checkpoints of the run are averaged
(`checkpoint.merge_checkpoints`), the average is evaluated on the run's own held-out split
(`Trainer.evaluate`: eval loss in nats/token and bits per byte), and the candidate with the lowest
eval loss is written as a transformers export plus `merge.json`. The last checkpoint alone is a
candidate too (window 1, weights "last"), so the export is never worse than not merging.

    hybridlm soup --runs runs/lc_seed0,runs/lc_seed1 [--last 3] [--eval-run runs/lc_seed0]

`soup_runs` averages the last `last` checkpoints of every run (uniformly: a soup of the runs'
final states), evaluates every run's newest checkpoint alone, every run's own last-`last`
average and the soup on the held-out split of `eval_run` (default: the first run), and exports
the best the same way (`soup.json`). The runs must share the architecture.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...interop.hf import save_pretrained
from ...io import load_tokenizer_for
from ...io.checkpoint import list_checkpoints, read_meta, save_checkpoint
from ..checkpoint import merge_checkpoints, merge_weights
from ..config import RunConfig, TrainConfig
from ..text_training import HeldOutEvaluator, load_merged


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The run's config: `<run>/run.yaml`, else the one stored in its newest checkpoint."""
    run_dir = Path(run_dir)
    if (run_dir / "run.yaml").is_file():
        return RunConfig.load(run_dir / "run.yaml")
    ckpts = list_checkpoints(run_dir)
    if ckpts:
        return RunConfig.from_dict(read_meta(ckpts[-1])["run_config"])
    raise ValueError(f"{run_dir} has no run.yaml and no checkpoints; is it a pretrain out_dir?")


def checkpoints_kept(tc: TrainConfig) -> int:
    """How many checkpoints a finished run with these settings keeps: one every
    `checkpoint_interval` steps and one at the last step (the Trainer's saves), of which the
    newest `keep_last_n` (0: all)."""
    saves = {tc.max_steps}
    if tc.checkpoint_interval:
        saves |= set(range(tc.checkpoint_interval, tc.max_steps + 1, tc.checkpoint_interval))
    return min(len(saves), tc.keep_last_n) if tc.keep_last_n else len(saves)


def _too_few_checkpoints(run_dir: Path, have: int, need: int) -> str:
    """The error for a window of `need` checkpoints over a run that has `have`: which setting
    to change, from the run's own config (the pruning, else the interval or the length)."""
    text = f"{run_dir} has {have} checkpoint(s) but window {need} needs {need}"
    text += f"; pass --windows up to {have}" if have else ""
    try:
        tc = load_run_config(run_dir).train
    except ValueError:  # no readable pretraining run config: name the settings generally
        return f"{text}, or train with train.keep_last_n >= {need} and enough checkpoints"
    fixes = []
    if 0 < tc.keep_last_n < need:
        text += f" (train.keep_last_n: {tc.keep_last_n} keeps the last {tc.keep_last_n})"
        fixes.append(f"--set train.keep_last_n={need}")
    if checkpoints_kept(dataclasses.replace(tc, keep_last_n=0)) < need:
        interval = tc.max_steps // need
        fixes.append(
            f"--set train.checkpoint_interval={interval}"
            if interval
            else f"--set train.checkpoint_interval=1 --set train.max_steps={need}"
        )
    if not fixes:  # its settings keep enough: stopped early, or checkpoints were removed
        return f"{text}, or finish the run (--resume): its settings keep {checkpoints_kept(tc)}"
    return f"{text}, or train the run again with {' '.join(fixes)}"


def export(model: torch.nn.Module, out: Path, run: RunConfig, tokenizer: Any) -> str:
    """Write `model` to `out` as a transformers directory, or, for an architecture transformers
    has no class for (e.g. RoPE attention next to Mamba-2), as a training checkpoint under
    `out/checkpoints/` (both load with `hybridlm.io`). Returns which one was written."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        save_pretrained(model, out, tokenizer=tokenizer)
        return "HF export"
    except ValueError as err:
        meta = {"run_config": dataclasses.replace(run, model=model.config).to_dict()}
        save_checkpoint(out, step=0, model=model, optimizer=None, meta=meta)
        return f"training checkpoint ({err})"


def _score_and_export(
    run: RunConfig,
    candidates: Sequence[tuple[dict[str, Any], Sequence[Path], str]],
    out: Path,
    tokenizer: Any,
    scratch_prefix: str,
) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """Average each candidate's checkpoints (its weighting), score the average on `run`'s
    held-out split and export the one with the lowest eval loss to `out`. A candidate is (its
    report fields, its checkpoints oldest first, "uniform" / "minus_sqrt"). Returns (one report
    row per candidate: its fields + eval_loss, eval_bpb; the best row; what `export` wrote)."""
    rows: list[dict[str, Any]] = []
    best_state: dict[str, torch.Tensor] | None = None
    with tempfile.TemporaryDirectory(prefix=scratch_prefix) as scratch:
        evaluate = HeldOutEvaluator(run, scratch)
        for fields, paths, weighting in candidates:
            state = merge_checkpoints(paths, weighting)
            ev = evaluate(state)
            rows.append({**fields, "eval_loss": ev["eval_loss"], "eval_bpb": ev["eval_bpb"]})
            if min(r["eval_loss"] for r in rows) == ev["eval_loss"]:
                best_state = state  # only the best so far stays in memory
        best = min(rows, key=lambda r: r["eval_loss"])
        assert best_state is not None
        load_merged(evaluate.model, best_state)
        return rows, best, export(evaluate.model, out, run, tokenizer)


def parse_list(text: str, kind: type = str) -> list:
    return [kind(t.strip()) for t in text.split(",") if t.strip()]


def merge_run(
    run_dir: str | Path,
    *,
    windows: Sequence[int] = (2, 3, 4),
    weights: Sequence[str] = ("uniform", "minus_sqrt"),
    out: str | Path | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Evaluate every (window, weighting) merge of the run's last checkpoints, export the best.

    Returns the report also written to `<out>/merge.json` (default out: `<run>/merged`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} not found")
    windows = sorted({int(n) for n in windows})
    if not windows or windows[0] < 1:
        raise ValueError(f"windows must be positive integers, got {list(windows)}")
    for kind in weights:
        merge_weights(1, kind)  # unknown weighting -> ValueError before any work
    ckpts = list_checkpoints(run_dir)
    if len(ckpts) < windows[-1]:
        raise ValueError(_too_few_checkpoints(run_dir, len(ckpts), windows[-1]))
    out = Path(out) if out is not None else run_dir / "merged"
    run = load_run_config(run_dir)

    candidates = []
    for n, kind in [(1, "last")] + [(n, w) for n in windows for w in weights]:
        weighting = "uniform" if kind == "last" else kind
        fields = {"window": n, "weights": kind, "checkpoints": [p.name for p in ckpts[-n:]]}
        fields["coefficients"] = merge_weights(n, weighting)
        candidates.append((fields, ckpts[-n:], weighting))
    rows, best, export_kind = _score_and_export(
        run, candidates, out, load_tokenizer_for(run_dir), "hybridlm-merge-"
    )
    base = rows[0]["eval_loss"]
    for r in rows:
        r["delta_vs_last"] = r["eval_loss"] - base

    log(f"{'window':>6}  {'weights':<10}  {'eval loss':>9}  {'bpb':>7}  {'delta vs last':>13}")
    for r in rows:
        mark = "  <- best" if r is best else ""
        log(
            f"{r['window']:>6}  {r['weights']:<10}  {r['eval_loss']:9.4f}  {r['eval_bpb']:7.4f}"
            f"  {r['delta_vs_last']:+13.4f}{mark}"
        )
    report = {"run": str(run_dir), "out": str(out), "export": export_kind}
    report |= {"best": best, "candidates": rows}
    (out / "merge.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"best: window {best['window']} {best['weights']} -> {out} (merge.json, {export_kind})")
    return report


def _same_architecture(paths: Sequence[Path]) -> None:
    models = [read_meta(p)["run_config"].get("model") for p in paths]
    if any(m != models[0] for m in models[1:]):
        raise ValueError(
            "the checkpoints to soup have different architectures: "
            + ", ".join(str(p) for p, m in zip(paths, models, strict=True) if m != models[0])
        )


def soup_runs(
    runs: Sequence[str | Path],
    *,
    last: int = 1,
    eval_run: str | Path | None = None,
    out: str | Path | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Evaluate each run's newest checkpoint, each run's last-`last` average and the uniform soup
    of all those checkpoints; export the best. Returns the report written to `<out>/soup.json`
    (default out: `<first run>/soup`)."""
    runs = [Path(r) for r in runs]
    if len(runs) < 1 or last < 1:
        raise ValueError(f"need at least one run and last >= 1, got {len(runs)} runs, last {last}")
    if len(runs) == 1 and last == 1:
        raise ValueError("a soup of one checkpoint is that checkpoint: give two runs or --last > 1")
    groups: list[list[Path]] = []
    for r in runs:
        ckpts = list_checkpoints(r) if r.is_dir() else []
        if len(ckpts) < last:
            raise ValueError(
                f"{r} has {len(ckpts)} checkpoint(s), --last {last} needs {last}; is it a "
                "pretrain out_dir?"
            )
        groups.append(ckpts[-last:])
    everything = [p for g in groups for p in g]
    _same_architecture(everything)
    eval_run = Path(eval_run) if eval_run is not None else runs[0]
    out = Path(out) if out is not None else runs[0] / "soup"
    named: list[tuple[str, list[Path]]] = [
        (f"{r}: last", [g[-1]]) for r, g in zip(runs, groups, strict=True)
    ]
    if last > 1:
        named += [(f"{r}: last {last}", g) for r, g in zip(runs, groups, strict=True)]
    if len(everything) > max(len(g) for g in groups):
        named.append((f"soup of {len(everything)}", everything))
    candidates = [
        ({"candidate": name, "checkpoints": [str(p) for p in paths]}, paths, "uniform")
        for name, paths in named
    ]
    rows, best, export_kind = _score_and_export(
        load_run_config(eval_run), candidates, out, load_tokenizer_for(runs[0]), "hybridlm-soup-"
    )
    width = max(len(r["candidate"]) for r in rows)
    log(f"{'candidate':<{width}}  {'eval loss':>9}  {'bpb':>7}")
    for r in rows:
        mark = "  <- best" if r is best else ""
        log(f"{r['candidate']:<{width}}  {r['eval_loss']:9.4f}  {r['eval_bpb']:7.4f}{mark}")
    report = {"runs": [str(r) for r in runs], "eval_run": str(eval_run), "out": str(out)}
    report |= {"export": export_kind, "best": best, "candidates": rows}
    (out / "soup.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"best: {best['candidate']} -> {out} (soup.json, {export_kind})")
    return report
