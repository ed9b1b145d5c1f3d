"""`hybridlm quantize`: calibrate, quantise (FP8 / NVFP4 / AutoQuantize mixed precision),
evaluate against the unquantised model on held-out data, export a ModelOpt-format checkpoint.
The stage around the algorithms of `precision.ptq` / `precision.autoquant`: it loads the model
(`hybridlm.io`), reads a run's data or an SFT run's chat rows for calibration, and writes the
export with `interop.modelopt`.

    hybridlm quantize --recipe autoquant --budget 4.75 runs/quickstart out/quickstart-aq

CKPT is any model path `hybridlm.io` loads: a training checkpoint of any stage, a run directory
(its newest checkpoint), a transformers or ModelOpt directory (quantised already: its dequantised
weights are the model quantised anew, `ptq.dequantize_model`). The held-out data is `--data` (a
pretraining run), else that of the run the model comes from (`run_data.training_data`: the run
config in meta.json, or `../run.yaml` beside a run's export): a pretraining run's text; for a
model post-trained on chats (SFT, distillation, QAD) the embedded Python-stdlib corpus, with its
run's chat rows as the calibration set (as `--calib-data` would); the stdlib corpus otherwise.
The stdlib corpus is read in the model's own tokenizer and sharded under OUT/shards. Settings
are flags or `--set key=value` on `QuantizeConfig`'s fields. OUT receives the quantised
checkpoint (config.json, hf_quant_config.json, model.safetensors: what vLLM loads),
`metrics.jsonl` (one row per evaluated model and per decision group) and `quantize.json`
(settings, plan, sensitivities, results). An OUT that holds an earlier run's `metrics.jsonl` is
an error unless `--overwrite` (then it is removed first).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from ...choices import PTQ_RECIPES
from ...config import Config, from_dict, read_mapping
from ...data.bpb import token_byte_lengths
from ...data.bpe import load_tokenizer
from ...data.config import DataConfig
from ...data.pipeline import build_loaders, build_tokenizer, prepare_shards
from ...interop.modelopt import export_modelopt
from ...io import load_model, resolve, tokenizer_spec_for
from ...io.checkpoint import read_meta
from ...precision.autoquant import autoquantize, measure_sensitivities, print_table
from ...precision.kv_cache import KV_FORMATS, declare_kv_cache
from ...precision.ptq import (
    BITS,
    DEFAULT_EXCLUDE,
    calibrate,
    clone_model,
    dequantize_model,
    evaluate,
    find_ops,
    groups_of,
    model_bits,
    quantize_model,
    recipe_plan,
    take,
)
from ...stage import Flow, Report, Stage
from ..checkpoint import METRICS, prepare_run_dir
from ..post_training import SFTDataConfig, chat_batches
from ..run_data import pretraining_data, training_data


@dataclass(kw_only=True)
class QuantizeConfig(Config):
    """Settings of one `hybridlm quantize` run (its flags, or `--set key=value` on these
    fields)."""

    WHAT = "quantize config"

    checkpoint: str
    out: str
    recipe: Literal["fp8", "nvfp4", "autoquant"] = "nvfp4"
    budget: float = 4.75  # AutoQuantize: average effective bits per weight
    cost: Literal["params", "flops"] = "params"  # AutoQuantize: weighting of the average
    calib_samples: int = 64  # calibration rows (sequences of the data's seq_len)
    eval_batches: int = 8  # held-out batches for the loss / bpb comparison
    weight_scale: Literal["mse", "max"] = "mse"  # NVFP4 weight block scales
    exclude: list[str] = field(default_factory=lambda: list(DEFAULT_EXCLUDE))
    per_layer: bool = True  # measure each decision group's loss delta alone
    # the attention KV cache the checkpoint declares (precision/kv_cache.py): scales calibrated
    # on the calibration rows, exported as kv_cache_quant_algo + k_scale / v_scale
    kv_cache: Literal["none", "fp8", "nvfp4"] = "none"
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # unquantised tensors
    device: str = "cpu"  # "auto": cuda when available
    # calibration / held-out data: a run directory or run.yaml whose `data` section to use (e.g.
    # the pretraining run of a post-trained model); "" = the checkpoint's own run, else the stdlib
    data: str = ""
    # calibration rows from an SFT run's chat data (its directory or run.yaml): quantise a
    # post-trained model on the data it serves, as Nemotron 3 Super calibrates on its SFT set;
    # "" = the chat data of the model's own run when it has some, else the training rows of
    # `data`
    calib_data: str = ""
    progress: bool = True

    def validate(self) -> None:
        if self.recipe not in PTQ_RECIPES:
            raise ValueError(f"recipe must be one of {list(PTQ_RECIPES)}, got {self.recipe!r}")
        if self.calib_samples < 1 or self.eval_batches < 1:
            raise ValueError("calib_samples and eval_batches must be >= 1")
        if self.recipe == "autoquant" and not 4.5 <= self.budget <= 16:
            raise ValueError(
                f"budget must lie in [4.5, 16] bits per weight (all NVFP4 .. all BF16), "
                f"got {self.budget}"
            )
        if self.cost not in ("params", "flops"):
            raise ValueError(f"cost must be 'params' or 'flops', got {self.cost!r}")
        if self.weight_scale not in ("mse", "max"):
            raise ValueError(f"weight_scale must be 'mse' or 'max', got {self.weight_scale!r}")
        if self.kv_cache not in ("none", *KV_FORMATS):
            raise ValueError(f"kv_cache must be none, fp8 or nvfp4, got {self.kv_cache!r}")


# ============================================================================ inputs
def default_data(out: Path, tokenizer: str = "byte") -> DataConfig:
    """The embedded corpus (Python stdlib source) in `tokenizer` (a spec: the model's own) with
    a held-out split."""
    return DataConfig(
        tokenizer=tokenizer,
        shards_dir=str(out / "shards"),
        seq_len=256,
        batch_size=8,
        eval_split="hash",
        eval_fraction=0.02,
        eval_docs=8,
    )


def sft_calibration_batches(path: str | Path, rows: int, tokenizer: Any) -> list:
    """`rows` packed training rows of a run on chat data (SFT, distillation, QAD; its directory
    or run.yaml), in `tokenizer`'s ids (the quantised model's)."""
    path = Path(path)
    if path.is_dir():
        path = path / "run.yaml"
    if not path.is_file():
        raise ValueError(f"no SFT run config at {path} (calib_data: an SFT run dir or run.yaml)")
    data = read_mapping(path, "run config").get("data")
    try:
        chats = from_dict(SFTDataConfig, data if data is not None else {}, "data.")
    except ValueError as err:
        raise ValueError(f"calib_data: {path} holds no chat data ({err})") from None
    return chat_batches(chats, rows, tokenizer)


_KINDS = {"checkpoint": "training checkpoint", "transformers": "transformers checkpoint"}


class Inputs(NamedTuple):
    """What a quantisation starts from (`load_checkpoint_and_data`)."""

    model: Any
    data: DataConfig  # the held-out (and, without chats, calibration) data
    chats: SFTDataConfig | None  # chat data to calibrate on, or None
    tokenizer: str  # the spec of the model's own tokenizer
    what: str  # a description for the report


def load_checkpoint_and_data(ckpt: str | Path, out: Path, *, data: str = "") -> Inputs:
    """The model of any model path `hybridlm.io` loads (module docstring), its data and its
    tokenizer; `data`: a pretraining run whose data to use."""
    path, kind = resolve(ckpt)  # a run directory: its newest checkpoint
    spec = tokenizer_spec_for(ckpt)
    model = load_model(path)
    what = f"{_KINDS.get(kind, 'ModelOpt checkpoint')} {path}"
    if kind == "checkpoint":
        what += f" (step {read_meta(path).get('step')})"
    if kind == "modelopt":  # quantised already: start from the weights it computes with
        dequantize_model(model)
        what += " (dequantised)"
    if data:
        return Inputs(model, pretraining_data(data), None, spec, f"{what}, data of {data}")
    trained = training_data(ckpt, fix="give the evaluation data with --data (a pretraining run)")
    if isinstance(trained, DataConfig):
        return Inputs(model, trained, None, spec, f"{what}, data of its run")
    # no pretraining text to evaluate on: the embedded corpus, in the model's own tokenizer
    stdlib = default_data(out, spec)
    if isinstance(trained, SFTDataConfig):
        what += ", stdlib corpus, calibrated on its run's chat data"
        return Inputs(model, stdlib, trained, spec, what)
    return Inputs(model, stdlib, None, spec, f"{what}, stdlib corpus")


# ============================================================================ run
def run_quantize(cfg: QuantizeConfig, *, overwrite: bool = False) -> dict[str, Any]:
    """The whole flow; returns the summary also written to OUT/quantize.json. `overwrite`:
    replace an earlier run's metrics.jsonl in OUT (without it, one is an error)."""
    from rich.console import Console

    cfg.validate()
    console = Console(quiet=not cfg.progress)
    out = prepare_run_dir(cfg.out, overwrite=overwrite, outputs=(METRICS,))
    t0 = time.time()
    model, data, chats, spec, what = load_checkpoint_and_data(cfg.checkpoint, out, data=cfg.data)
    tokenizer = load_tokenizer(spec)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    )
    model.to(device).eval()
    console.print(f"[bold]quantize[/]: {what}, recipe {cfg.recipe}, device {device}")

    sets = prepare_shards(data)
    vocab = max(s.vocab_size for s in sets.values())
    if vocab > model.config.vocab_size:
        raise ValueError(
            f"the data's tokenizer has {vocab} ids but the model only {model.config.vocab_size}"
        )
    train_loader, held_loader = build_loaders(data, sets)
    if held_loader is None:
        raise ValueError("the data has no held-out split (data.eval_fraction is 0)")
    if cfg.calib_data:
        calib = sft_calibration_batches(cfg.calib_data, cfg.calib_samples, tokenizer)
        what += f", calibrated on the chat data of {cfg.calib_data}"
    elif chats is not None:
        calib = chat_batches(chats, cfg.calib_samples, tokenizer)
    else:
        calib = take(train_loader, math.ceil(cfg.calib_samples / data.batch_size))
    held = take(held_loader, cfg.eval_batches)
    token_bytes = token_byte_lengths(build_tokenizer(data), model.config.vocab_size)

    def ev(m: torch.nn.Module) -> dict[str, float]:
        return evaluate(m, held, token_bytes)

    with _progress(cfg.progress) as prog:
        base = ev(model)
        task = prog.add_task("calibrating", total=len(calib))
        stats = calibrate(
            model, calib, exclude=cfg.exclude, progress=lambda i: prog.update(task, completed=i)
        )
        ops = find_ops(model, cfg.exclude)
        sens = None
        aq = None
        if cfg.recipe == "autoquant":
            task = prog.add_task("sensitivities (fwd+bwd)", total=len(calib))
            sens = measure_sensitivities(
                model,
                calib,
                stats,
                exclude=cfg.exclude,
                weight_scale=cfg.weight_scale,
                progress=lambda i: prog.update(task, completed=i),
            )
            aq = autoquantize(sens, ops, budget=cfg.budget, cost=cfg.cost)
            plan = aq.plan
        else:
            plan = recipe_plan(model, cfg.recipe, cfg.exclude)
        qmodel = clone_model(model)
        applied = quantize_model(
            qmodel, plan, stats, weight_scale=cfg.weight_scale, exclude=cfg.exclude
        )
        quant = ev(qmodel)
        groups = groups_of(ops)
        rows = []
        task = prog.add_task("per-group loss deltas", total=len(groups) if cfg.per_layer else 0)
        for g, members in groups.items():
            fmt = applied[members[0].name]
            row = {
                "group": g,
                "ops": [op.name for op in members],
                "params": sum(op.params for op in members),
                "format": fmt,
                "bits": BITS[fmt],
            }
            if sens is not None:
                row["sensitivity"] = sens[g]
            if cfg.per_layer and fmt != "bf16":
                alone = clone_model(model)
                quantize_model(
                    alone,
                    {op.name: fmt for op in members},
                    stats,
                    weight_scale=cfg.weight_scale,
                    exclude=cfg.exclude,
                )
                row["loss_delta"] = ev(alone)["loss"] - base["loss"]
            elif cfg.per_layer:
                row["loss_delta"] = 0.0
            rows.append(row)
            prog.update(task, advance=1)

    kv = declare_kv_cache(qmodel, cfg.kv_cache, calib)
    dtype = getattr(torch, cfg.export_dtype)
    export_modelopt(qmodel.to("cpu"), out, dtype=dtype, tokenizer=tokenizer)
    bits = model_bits(qmodel, applied, ops)
    summary = {
        "checkpoint": str(cfg.checkpoint),
        "source": what,
        "settings": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "progress"},
        "calibration": {
            "batches": stats.batches,
            "tokens": stats.tokens,
            "data": cfg.calib_data
            or ("its run's chat data" if chats else "training rows of the evaluation data"),
        },
        "eval": {"batches": len(held), "tokens": base["tokens"]},
        "unquantized": {"loss": base["loss"], "bpb": base["bpb"], "dtype": _dtype_name(model)},
        "quantized": {"loss": quant["loss"], "bpb": quant["bpb"], "effective_bits": bits},
        "delta": {
            "loss": quant["loss"] - base["loss"],
            "loss_rel": (quant["loss"] - base["loss"]) / base["loss"],
            "bpb_rel": (quant["bpb"] - base["bpb"]) / base["bpb"],
        },
        "plan": applied,
        "kv_cache": kv,
        "groups": rows,
        "seconds": time.time() - t0,
    }
    if aq is not None:
        summary["autoquant"] = {
            "budget": aq.budget,
            "cost": aq.cost_mode,
            "effective_bits": aq.effective_bits,
            "total_sensitivity": aq.total_sensitivity,
            "exact": aq.exact,
        }
    (out / "quantize.json").write_text(json.dumps(summary, indent=2))
    with open(out / METRICS, "w") as f:  # prepare_run_dir kept no earlier run's rows
        f.write(json.dumps({"stage": "quantize", "model": "unquantized", **base}) + "\n")
        f.write(
            json.dumps({"stage": "quantize", "model": cfg.recipe, "effective_bits": bits, **quant})
            + "\n"
        )
        for row in rows:
            flat = {k: v for k, v in row.items() if k not in ("ops", "sensitivity")}
            f.write(json.dumps({"stage": "quantize", "model": cfg.recipe, **flat}) + "\n")
    if aq is not None:
        print_table(aq, console)
    _print_summary(console, summary)
    return summary


def _dtype_name(model: torch.nn.Module) -> str:
    return str(model.embeddings.weight.dtype).removeprefix("torch.")


class _progress:
    """A rich progress bar, or a no-op one."""

    def __init__(self, enabled: bool) -> None:
        from rich.progress import Progress

        self.p = Progress(disable=not enabled, transient=False)

    def __enter__(self):
        self.p.__enter__()
        return self.p

    def __exit__(self, *exc) -> None:
        self.p.__exit__(*exc)


def _print_summary(console, s: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="per decision group (loss delta: that group quantised alone)")
    for col in ("group", "format", "bits", "params", "loss delta"):
        table.add_column(col, justify="left" if col in ("group", "format") else "right")
    for r in s["groups"]:
        delta = r.get("loss_delta")
        table.add_row(
            r["group"],
            r["format"],
            f"{r['bits']:g}",
            f"{r['params']:,}",
            "-" if delta is None else f"{delta:+.5f}",
        )
    console.print(table)
    u, q, d = s["unquantized"], s["quantized"], s["delta"]
    total = Table(title="held-out evaluation")
    for col in ("model", "eff. bits", "loss (nats/token)", "bpb", "rel. loss delta"):
        total.add_column(col, justify="left" if col == "model" else "right")
    total.add_row(f"unquantized ({u['dtype']})", "-", f"{u['loss']:.5f}", f"{u['bpb']:.5f}", "-")
    total.add_row(
        s["settings"]["recipe"],
        f"{q['effective_bits']:.3f}",
        f"{q['loss']:.5f}",
        f"{q['bpb']:.5f}",
        f"{100 * d['loss_rel']:+.3f}%",
    )
    console.print(total)


# ---------------------------------------------------------------------------- the flow's stage
@dataclass(kw_only=True)
class QuantizeStageConfig:
    """`hybridlm quantize` settings (`QuantizeConfig`) for the flow's final model, one
    checkpoint per recipe in `recipes` (`<run>/quantize/<recipe>`); the held-out loss / bpb
    is measured on the pretraining data. Nemotron 3 Super's NVFP4 checkpoint is `autoquant`:
    NVFP4 with MSE weight scales and dynamic activation scales, with the most sensitive
    operators raised to FP8 / BF16 under the bit budget (§4.2)."""

    recipes: list[Literal["fp8", "nvfp4", "autoquant"]] = field(
        default_factory=lambda: ["nvfp4", "autoquant"]
    )
    # calibration rows: the SFT chat data (Nemotron 3 Super calibrates on its SFT set) or the
    # pretraining text; the held-out loss / bpb is always on the pretraining text
    calibration: Literal["sft", "pretrain"] = "sft"
    budget: float = 6.0  # autoquant: mean bits per quantised weight (NVFP4 4.5, FP8 8, BF16 16)
    calib_samples: int = 32
    # kept in BF16 besides lm_head and MTP: Nemotron 3 Super's checkpoints keep attention and the
    # MoE latent projections in BF16 (precision.ptq.NEMOTRON_FP8_EXCLUDE)
    exclude: list[str] = field(
        default_factory=lambda: ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*latent_proj"]
    )
    eval_batches: int = 8
    weight_scale: Literal["mse", "max"] = "mse"
    per_layer: bool = True
    # the KV cache the checkpoints declare (Nemotron 3.5 serves with an FP8 KV cache)
    kv_cache: Literal["none", "fp8", "nvfp4"] = "none"

    def validate(self) -> None:
        if not self.recipes:  # the values are checked when the config is read
            raise ValueError("quantize.recipes must name at least one of fp8 / nvfp4 / autoquant")


def _stage_settings(flow: Flow) -> dict[str, Any]:
    sft = flow.cfg.quantize.calibration == "sft" and flow.done("sft")
    return {
        **dataclasses.asdict(flow.cfg.quantize),
        "checkpoint": flow.model_path("quantize"),
        "data": str(flow.stage_dir("pretrain")),
        "calib_data": str(flow.stage_dir("sft")) if sft else "",
    }


def _stage_run(flow: Flow) -> dict[str, Any]:
    s = flow.settings("quantize")
    models, results = {}, {}
    for recipe in s["recipes"]:
        out = flow.stage_dir("quantize") / recipe
        qcfg = QuantizeConfig(
            checkpoint=s["checkpoint"],
            out=str(out),
            recipe=recipe,
            budget=s["budget"],
            calib_samples=s["calib_samples"],
            eval_batches=s["eval_batches"],
            weight_scale=s["weight_scale"],
            per_layer=s["per_layer"],
            kv_cache=s["kv_cache"],
            data=s["data"],
            calib_data=s["calib_data"],
            exclude=DEFAULT_EXCLUDE + tuple(s["exclude"]),
            progress=flow.progress,
        )
        # the checkpoint carries its model's tokenizer; an interrupted attempt is replaced
        summary = run_quantize(qcfg, overwrite=True)
        models[recipe] = str(out)
        results[recipe] = {
            k: summary[k] for k in ("unquantized", "quantized", "delta", "calibration")
        }
    return {
        "model": models[s["recipes"][-1]],
        "models": models,
        "from": s["checkpoint"],
        "results": results,
    }


def _headline(s: dict[str, Any], report: Report) -> str:
    return f"{report.names['quant_bpb']} change: " + ", ".join(
        f"{n} {r['delta']['bpb_rel'] * 100:+.2f}%" for n, r in s["results"].items()
    )


# post-training quantisation of the newest model, ModelOpt layout
STAGE = Stage(
    "quantize",
    inputs=("pretrain", "sft"),  # held-out text, calibration chats
    config=QuantizeStageConfig,
    settings=_stage_settings,
    run=_stage_run,
    model="variants",
    check=lambda section, cfg, stages: section.validate(),
    headline=_headline,
)
