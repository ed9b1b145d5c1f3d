"""Continued pretraining and long-context extension, and whether the extension worked.

    hybridlm speedrun --only curate,tokenizer,pretrain      # runs/speedrun/pretrain (~5 min)
    python benchmarks/long_context.py [--out runs/long_context_bench] [--samples 40] [--no-twin]
        [--midtrain-set KEY=VALUE] [--extension-set KEY=VALUE] [--pretrain-set KEY=VALUE]

Two model families of the same size (about 1.6 M parameters) and the same budgets:

- **hybrid**: the speedrun's pretrained Mamba-2 / LatentMoE / NoPE-attention model
  (`MEM*EME`), midtrained (`configs/midtrain.yaml`, 300 steps at 256 tokens) and extended
  (`configs/long_context.yaml`, 600 steps: 2 x 1024 tokens and 8 x 256 tokens in turn); its
  NoPE attention and Mamba layers need no position rescaling.
- **twin** (unless `--no-twin`): attention everywhere the hybrid has Mamba (`*E**E*E`, RoPE,
  8 query / 4 KV heads per layer), pretrained like the speedrun's pretrain stage (same data,
  steps and schedule), then the same midtraining and extension with YaRN x4 from 256 tokens on
  its full-attention layers (Olmo 3 §5).

Every family is measured before the extension (the midtrained model, trained at 256 tokens) and
after it, on the same samples:

- RULER-style accuracy (`hybridlm.eval.ruler`: niah_single, niah_multikey, vt, cwe, fwe; the
  fraction of reference strings in the greedy answer) at 1x, 2x and 4x the training length
  (256, 512, 1024 tokens), `--samples` per task and length; niah_multivalue's prompt does not
  fit 256 tokens, so it is left out of every length;
- held-out bits per byte by position (buckets of 128 tokens) over the first 1,024 tokens of the
  held-out standard-library files, and short-context bpb (the midtraining run's held-out split
  at 256 tokens, the trainer's own evaluation);
- an in-context copy probe (loss on the second copy of 64 random tokens against the first);
- inference cache bytes after a 1,024-token prefill, and the bytes autograd saves per token of a
  training forward at 256 and 1,024 tokens;
- the soup of the extension's last three checkpoints (steps 200, 400, 600) against each of them
  alone, on the extension run's held-out split (`hybridlm soup`).

The targets (issue "long context"): RULER at 4x rises by >= 3 standard errors after the
extension (paired over tasks and samples), and short-context bpb degrades by < 2%. Writes
`OUT/results.json` (command, commit, versions) and `OUT/long_context.png` (RULER against context
length, bpb by position). Finished runs in OUT are reused unless `--rerun`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from hybridlm.config import YarnConfig
from hybridlm.eval.long_context import (
    extension_verdict,
    held_out_documents,
    measure_extension,
    plot_long_context,
)
from hybridlm.io import resolve_checkpoint
from hybridlm.provenance import command_line, cpu_info, git_state, library_versions
from hybridlm.train.config import RunConfig
from hybridlm.train.stages.merge import soup_runs
from hybridlm.train.stages.pretrain import run_pretrain

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("niah_single", "niah_multikey", "vt", "cwe", "fwe")
ORIGINAL = 256


def _train(cfg: RunConfig, rerun: bool, log) -> float:
    """Train `cfg` unless OUT holds it; returns its wall minutes (recorded next to the run)."""
    out = Path(cfg.train.out_dir)
    stamp = out / "wall_minutes.json"
    if out.is_dir() and stamp.is_file() and not rerun:
        resolve_checkpoint(out)
        minutes = json.loads(stamp.read_text())["minutes"]
        log(f"reusing {out} (trained in {minutes:.1f} min)")
        return minutes
    t0 = time.time()
    run_pretrain(cfg, overwrite=True)
    minutes = (time.time() - t0) / 60
    stamp.write_text(json.dumps({"minutes": minutes}) + "\n")
    log(f"trained {out} in {minutes:.1f} min")
    return minutes


def _configs(
    family: str, base: Path, out: Path, args: argparse.Namespace
) -> tuple[RunConfig | None, RunConfig, RunConfig]:
    """(pretrain or None, midtrain, long context) run configs of a family under `out`, with the
    command line's overrides (`--pretrain-set` for the twin's pretraining)."""
    pre = None
    start = base
    if family == "twin":
        pre = RunConfig.load(base / "run.yaml").override(
            [
                "model.pattern=*E**E*E",
                "model.attention.rope_theta=10000.0",
                "model.attention.num_heads=8",
                "model.attention.num_kv_heads=4",
                f"train.out_dir={out / 'twin' / 'pretrain'}",
                *args.pretrain_set,
            ]
        )
        start = Path(pre.train.out_dir)
    mid = RunConfig.load(ROOT / "configs" / "midtrain.yaml").override(
        [
            f"train.init_from={start}",
            f"train.out_dir={out / family / 'midtrain'}",
            f"data.shards_dir={out / 'shards' / 'midtrain'}",
            *args.midtrain_set,
        ]
    )
    lc = RunConfig.load(ROOT / "configs" / "long_context.yaml").override(
        [
            f"train.init_from={mid.train.out_dir}",
            f"train.out_dir={out / family / 'long_context'}",
            f"data.shards_dir={out / 'shards' / 'long_context'}",
            *args.extension_set,
        ]
    )
    if family == "twin":
        lc.train.yarn = YarnConfig(factor=4.0, original_max_position_embeddings=ORIGINAL)
    for cfg in (mid, lc):
        cfg.train.progress = False
    return pre, mid, lc


def _evaluate(path: Path, mid: RunConfig, docs, args, log) -> dict[str, Any]:
    t0 = time.time()
    res = measure_extension(
        path,
        original=ORIGINAL,
        short_run=mid,
        documents=docs,
        tasks=TASKS,
        num_samples=args.samples,
    )
    res["eval_seconds"] = time.time() - t0
    r = res["ruler"]["overall"]
    pos = res["position_bpb"]  # None without a held-out document of the full length
    log(
        f"  {path}: RULER "
        + " ".join(f"@{L} {r[L]:.3f}" for L in res["ruler"]["lengths"])
        + f" | short bpb {res['short_bpb']['eval_bpb']:.4f}"
        + (f" | bpb@1024 {pos['bpb_all']:.4f}" if pos else " | bpb@1024 n/a (no long document)")
        + f" | copy {res['copy']['first']:.2f} -> {res['copy']['second']:.2f}"
        + f" | cache@1024 {res['cache_bytes_4x'] / 1024:.0f} KiB ({res['eval_seconds']:.0f} s)"
    )
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", default="runs/speedrun/pretrain", help="the pretrained hybrid")
    p.add_argument("--out", default="runs/long_context_bench")
    p.add_argument("--samples", type=int, default=40, help="RULER samples per task and length")
    p.add_argument("--no-twin", action="store_true", help="the hybrid only")
    p.add_argument("--rerun", action="store_true", help="retrain runs found in OUT")
    for stage, what in (
        ("midtrain", "configs/midtrain.yaml"),
        ("extension", "configs/long_context.yaml"),
        ("pretrain", "the twin's pretraining (the base run's run.yaml)"),
    ):
        p.add_argument(
            f"--{stage}-set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"override of {what}, e.g. train.max_steps=20 (repeatable)",
        )
    args = p.parse_args(argv)
    base, out = Path(args.base), Path(args.out)
    if not (base / "run.yaml").is_file():
        p.error(f"{base} is not a pretrain run; run `hybridlm speedrun --only pretrain` first")
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    t_start = time.time()
    families = ["hybrid"] if args.no_twin else ["hybrid", "twin"]
    provenance = {
        "command": command_line(),
        "git": git_state(ROOT),
        "versions": library_versions(),
        "cpu": cpu_info(),
        "threads": torch.get_num_threads(),
    }
    results: dict[str, Any] = {"provenance": provenance, "families": {}}
    for fam in families:
        pre, mid, lc = _configs(fam, base, out, args)
        pre_min = _train(pre, args.rerun, log) if pre is not None else 0.0
        chain_min = _train(mid, args.rerun, log) + _train(lc, args.rerun, log)
        # the held-out standard-library files (the runs' own hash split), scored up to 4x
        docs = held_out_documents(lc.data, "code")
        log(f"[{fam}] evaluating before (midtrained) and after (extended)")
        before = _evaluate(Path(mid.train.out_dir), mid, docs, args, log)
        after = _evaluate(Path(lc.train.out_dir), mid, docs, args, log)
        v = extension_verdict(before, after)
        # Olmo 3 §5: a soup of the last long-context checkpoints, on the run's held-out split
        soup = soup_runs([lc.train.out_dir], last=3, out=out / fam / "soup", log=log)
        results["families"][fam] = {
            "before": before,
            "after": after,
            "verdict": v,
            "soup": soup,
            "minutes_midtrain_and_extension": chain_min,
            "minutes_with_pretrain": pre_min + chain_min,
        }
        g, pc = v["ruler_gain"], v["bpb_change_by_position"]
        if pc:
            log(
                f"[{fam}] bpb after - before by position (from "
                + ", ".join(
                    f"{b}: {m:+.3f} ± {e:.3f}"
                    for b, m, e in zip(pc["bucket_start"], pc["mean"], pc["se"], strict=True)
                )
                + f"; {pc['docs']} documents)"
            )
        log(
            f"[verdict] {fam}: RULER@{v['length']} {v['ruler_before']:.3f} -> "
            f"{v['ruler_after']:.3f}, gain {g['gain']:+.3f} ± {g['se']:.3f} ({g['z']:+.1f} SE, "
            f"{g['pairs']} pairs); short bpb {v['short_bpb_before']:.4f} -> "
            f"{v['short_bpb_after']:.4f} ({100 * v['short_bpb_change']:+.2f}%); midtrain + "
            f"extension {chain_min:.1f} min; target (>= 3 SE, < 2%): "
            f"{'met' if v['met'] else 'missed'}"
        )
    results["minutes"] = (time.time() - t_start) / 60
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    curves = {
        f"{fam} {when}": res[when]
        for fam, res in results["families"].items()
        for when in ("before", "after")
    }
    changes = {
        fam: res["verdict"]["bpb_change_by_position"]
        for fam, res in results["families"].items()
        if res["verdict"]["bpb_change_by_position"]
    }
    png = plot_long_context(curves, out / "long_context.png", changes=changes, original=ORIGINAL)
    log(f"wrote {out / 'results.json'} and {png} ({results['minutes']:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
