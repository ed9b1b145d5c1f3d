"""`hybridlm eval`: load a model, run registered tasks, write results.

    hybridlm eval --checkpoint runs/quickstart/checkpoints/step_00001200 \\
        --tasks humaneval_bpb,copycolors:rc,ruler_niah_single --limit 50
    hybridlm eval --preset tiny-super --tasks base_easy,mc --limit 20   # a random model

Outputs in `--out` (default `runs/eval/<model name>`):

    results.json     per task: metrics, standard errors (and how they were computed), items,
                     seconds; the eval config and the model's source
    metrics.jsonl    one row per (task, metric): value, stderr, n, checkpoint step (appended,
                     so several checkpoints evaluated into one folder form a learning curve)
    samples/<task>.jsonl   per-item scores and generations
    ruler.png        RULER score against context length, rendered from metrics.jsonl
    spec_bench.png   speculative acceptance by draft position and category (spec_bench)

A model is a hybridlm training checkpoint (`meta.json`: its run config names the model and
the tokenizer), a run directory (its newest checkpoint), a transformers NemotronH / Olmo3
directory, or `--preset NAME` (randomly initialised, `--seed`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..choices import EVAL_DTYPES
from ..config import Config
from ..data.bpe import load_tokenizer
from ..io import load
from ..model.model import HybridLM, build_model
from ..presets import get_preset
from ..report.plot import pyplot, read_metrics, save_figure
from .speculative import plot_spec_bench
from .tasks import EvalRunner, TaskResult, get_task, resolve_tasks

_DTYPES = {name: getattr(torch, name) for name in EVAL_DTYPES}  # "float32" -> torch.float32


@dataclass(kw_only=True)
class EvalConfig(Config):
    """What to evaluate and how (configs/eval.yaml; command-line flags override)."""

    WHAT = "eval config"

    tasks: list[str] = field(default_factory=lambda: ["base_easy", "mc"])
    limit: int | None = None  # items per task (RULER: samples per length)
    data_dir: str = ""  # "": the packaged GSM8K / HumanEval / tinyshakespeare; or a folder of them
    out_dir: str = ""  # default runs/eval/<model name>
    dtype: str = "float32"
    seed: int = 0
    max_len: int | None = None  # default: the model's max_seq_len
    max_batch_tokens: int = 16_384  # padded tokens per log-likelihood forward
    max_batch_rows: int = 64
    gen_batch_size: int = 8  # concurrent requests in the generation engine
    max_new_tokens: int = 256  # generation budget of GSM8K and HumanEval completions
    prompt_format: str = "base"  # GSM8K / HumanEval prompts: "base" (plain text) or "chat"
    gsm8k_fewshot: int = 0  # solved train examples before each base-format GSM8K question
    humaneval_samples: int = 1  # n per problem (greedy when 1); pass@k for k in 1, 10, 100 <= n
    ruler_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    ruler_samples: int = 20
    ifeval_data: str = ""  # IFEval JSONL or HF dataset id; "": data_dir/ifeval/, else generated
    progress: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.prompt_format not in ("base", "chat"):
            raise ValueError(f"prompt_format must be 'base' or 'chat', got {self.prompt_format!r}")
        if self.gsm8k_fewshot < 0:
            raise ValueError(f"gsm8k_fewshot must be >= 0, got {self.gsm8k_fewshot}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        for name in (
            "max_batch_tokens",
            "max_batch_rows",
            "gen_batch_size",
            "humaneval_samples",
            "max_new_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.ruler_lengths or min(self.ruler_lengths) < 1:
            raise ValueError("ruler_lengths must be positive token counts")


# ---------------------------------------------------------------------- loading
@dataclass(kw_only=True)
class LoadedModel:
    model: HybridLM
    tokenizer: Any
    name: str
    source: str
    step: int | None = None


def load_model(
    checkpoint: str | Path | None = None,
    *,
    preset: str | None = None,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: str | None = None,
) -> LoadedModel:
    """A model and its tokenizer from a training checkpoint / run dir / HF dir, or a preset."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    step = None
    if (checkpoint is None) == (preset is None):
        raise ValueError("give exactly one of --checkpoint DIR or --preset NAME")
    if preset is not None:
        cfg = get_preset(preset)
        model = build_model(cfg, seed=seed, device=torch.device("cpu"))
        tok = load_tokenizer(tokenizer or "byte")
        name, source = f"{preset}-random-seed{seed}", preset
    else:
        path = Path(checkpoint)  # type: ignore[arg-type]
        if not path.is_dir():
            raise ValueError(f"checkpoint directory not found: {path}")
        loaded = load(path, tokenizer=tokenizer)  # a run directory: its newest checkpoint
        model, tok, path = loaded.model, loaded.tokenizer, loaded.path
        if loaded.kind == "checkpoint":
            step = int(loaded.meta.get("step", 0))
        name = (
            path.name
            if path.parent.name != "checkpoints"
            else f"{path.parent.parent.name}-{path.name}"
        )
        source = str(path)
    model = model.to(_DTYPES[dtype]).eval()
    if model.config.vocab_size < tok.vocab_size:
        raise ValueError(
            f"the tokenizer has {tok.vocab_size} ids but the model only {model.config.vocab_size}"
        )
    return LoadedModel(model=model, tokenizer=tok, name=name, source=source, step=step)


# ---------------------------------------------------------------------- running
def task_options(cfg: EvalConfig) -> dict[str, Any]:
    return {
        "num_samples": cfg.humaneval_samples,
        "max_tokens": cfg.max_new_tokens,
        "prompt_format": cfg.prompt_format,
        "gsm8k_fewshot": cfg.gsm8k_fewshot,
        "ruler_lengths": tuple(cfg.ruler_lengths),
        "ruler_samples": cfg.ruler_samples,
        "ifeval_data": cfg.ifeval_data,
        "seed": cfg.seed,
    }


def run_tasks(
    runner: EvalRunner, task_names: list[str], cfg: EvalConfig
) -> dict[str, tuple[TaskResult, float]]:
    """Each task's result and wall seconds, in order."""
    out: dict[str, tuple[TaskResult, float]] = {}
    for name in task_names:
        task = get_task(name, data_dir=cfg.data_dir, **task_options(cfg))
        t0 = time.perf_counter()
        res = task.run(runner, cfg.limit)
        out[name] = (res, time.perf_counter() - t0)
        if cfg.progress:
            shown = ", ".join(
                f"{k} {v:.4f}" for k, v in res.metrics.items() if is_headline_metric(k)
            )
            print(f"[eval] {name}: {shown} ({res.num_items} items, {out[name][1]:.1f}s)")
            for note in res.notes:
                print(f"[eval] {name}: skipped: {note}")
    return out


def is_headline_metric(metric: str) -> bool:
    """Printed metrics: all but the per-length / per-position breakdowns (`string_match@1024`,
    `acceptance@...`)."""
    return not metric.startswith(("string_match@", "acceptance@"))


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None  # NaN / inf -> null in JSON


def write_results(
    out_dir: str | Path,
    loaded: LoadedModel,
    cfg: EvalConfig,
    results: dict[str, tuple[TaskResult, float]],
) -> dict[str, Any]:
    """results.json, appended metrics.jsonl rows, samples/<task>.jsonl and (RULER) ruler.png."""
    out = Path(out_dir)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "model": {
            "name": loaded.name,
            "source": loaded.source,
            "step": loaded.step,
            "params": loaded.model.count_params(),
        },
        "config": dataclasses.asdict(cfg),
        "tasks": {},
    }
    now = time.time()
    with (out / "metrics.jsonl").open("a") as f:
        for name, (res, secs) in results.items():
            doc["tasks"][name] = {
                "kind": get_task(name, data_dir=cfg.data_dir, **task_options(cfg)).kind,
                "num_items": res.num_items,
                "metrics": {k: _finite(v) for k, v in res.metrics.items()},
                "stderr": {k: _finite(v) for k, v in res.stderr.items()},
                "stderr_method": res.stderr_method,
                "seconds": round(secs, 3),
                "notes": res.notes,
            }
            for metric, value in res.metrics.items():
                row = {
                    "kind": "eval",
                    "model": loaded.name,
                    "step": loaded.step,
                    "task": name,
                    "metric": metric,
                    "value": _finite(value),
                    "stderr": _finite(res.stderr.get(metric, float("nan"))),
                    "n": res.num_items,
                    "time": now,
                }
                f.write(json.dumps(row) + "\n")
            safe = name.replace(":", "_").replace("/", "_")
            with (out / "samples" / f"{safe}.jsonl").open("w") as sf:
                for s in res.samples:
                    sf.write(json.dumps(s, default=str) + "\n")
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    if any(n.startswith("ruler_") for n in results):
        plot_ruler(out / "metrics.jsonl", out / "ruler.png")
    if "spec_bench" in results:
        plot_spec_bench(out / "metrics.jsonl", out / "spec_bench.png")
    return doc


def plot_ruler(metrics_path: str | Path, out_png: str | Path) -> Path:
    """RULER string-match against context length, one line per (model, task)."""
    plt = pyplot()
    curves: dict[tuple[str, str], dict[int, float]] = {}
    for r in read_metrics(metrics_path):
        m = str(r.get("metric", ""))
        if r.get("kind") != "eval" or not m.startswith("string_match@") or r["value"] is None:
            continue
        curves.setdefault((r["model"], r["task"]), {})[int(m.split("@")[1])] = r["value"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (model, task), pts in sorted(curves.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], "o-", label=f"{model} {task}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("string match")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("RULER")
    ax.legend(fontsize=7)
    save_figure(fig, out_png, dpi=120)
    return Path(out_png)


def evaluate(
    loaded: LoadedModel, cfg: EvalConfig, *, out_dir: str | Path | None = None
) -> dict[str, Any]:
    """Run `cfg.tasks` on a loaded model and write the results; returns results.json's dict."""
    names = resolve_tasks(cfg.tasks)
    runner = EvalRunner(
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        max_batch_tokens=cfg.max_batch_tokens,
        max_batch_rows=cfg.max_batch_rows,
        gen_batch_size=cfg.gen_batch_size,
        max_len=cfg.max_len,
        progress=cfg.progress,
    )
    torch.manual_seed(cfg.seed)
    results = run_tasks(runner, names, cfg)
    out = out_dir or cfg.out_dir or Path("runs") / "eval" / loaded.name
    return write_results(out, loaded, cfg, results)
