"""`hybridlm speedrun`: the whole model flow on one machine, in one run directory.

    hybridlm speedrun [--config configs/speedrun.yaml] [--out runs/speedrun] [--skip rl,quantize]
                      [--only eval,report] [--set pretrain.train.max_steps=300]

The flow is one table, `STAGES`: each `Stage` names the stages whose outputs it reads, its
section of the speedrun config (same name), how the run wires that section (`settings`) and the
library call that runs it (`run`); `Speedrun.run` goes down the table. Stages, in order (SPEC §5),
and where they write:

    curate     the embedded corpus through the curation chain (filters, exact / MinHash /
               substring dedup)                                         <run>/curate/data
    tokenizer  a byte-level BPE trained on the pretraining mix, digits split   <run>/tokenizer
    pretrain   the hybrid Mamba-2 / LatentMoE / MTP model on the curated mix   <run>/pretrain
    midtrain   continued pretraining on a new mix, linear decay to zero (Olmo 3 §4); skipped
               by default                                               <run>/midtrain
    long_context  extension to 4x the training length on long documents and synthetic tasks,
               long and short sequences in turn (Olmo 3 §5, Nemotron 3 Super §2.6), RULER and
               bpb by position before and after; skipped by default     <run>/long_context
    sft        chat SFT (assistant-only loss, packing, MTP loss), arithmetic   <run>/sft
    rl         GRPO with verifiable rewards, rollouts on Ray actors            <run>/rl/model
    mtp_heal   the MTP head re-trained on the RL policy's own generations
               (Nemotron 3 Super §4.7)                                  <run>/mtp_heal/model
    quantize   NVFP4 W4A4 post-training quantisation, ModelOpt layout          <run>/quantize
    qad        quantisation-aware distillation of the NVFP4 checkpoint from the unquantised
               model on the SFT chats (Nemotron 3.5's deployment recipe)    <run>/qad/hf
    eval       every stage's model on held-out text (bpb) and arithmetic (exact match),
               speculative decoding at draft length 7, cache memory vs context  <run>/eval
    report     report.md + report.html with plots, from the metrics files      <run>/report.*

Each stage writes `<run>/<stage>/stage.json` when it finishes, with a fingerprint of its settings
and of its inputs' fingerprints. `<run>/provenance.json` records the run itself (command line,
settings that differ from configs/speedrun.yaml, git commit, library versions, threads, CPU,
and each stage's status and wall time), for the report. A rerun skips every finished stage whose
fingerprint is unchanged and reruns the others (and, through the fingerprints, everything
downstream of them). An input enters a fingerprint with the time its outputs were made, so a
stage rerun with `--force` (same settings, new outputs) reruns everything downstream too.
`--set skip=[]` runs the long-context variant (midtrain and long_context between pretrain and
SFT). Pretraining, midtraining, the extension and SFT continue from their newest checkpoint when
interrupted; the other stages take
minutes and restart. `--skip` leaves stages out: the model chain then continues from the newest
model before the skipped stage (e.g. `--skip rl` heals the SFT model's MTP head), and a skipped
tokenizer means the byte tokenizer. Paths inside the config may use `{run}` for the run directory.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.console import Console

from .config import Config
from .curate.pipeline import CurateConfig, run_curate
from .data.bpe import load_tokenizer, train_bpe
from .data.pipeline import build_source
from .eval.flow import evaluate_flow
from .eval.long_context import (
    extension_verdict,
    held_out_documents,
    measure_extension,
    plot_long_context,
)
from .io.checkpoint import CheckpointError, latest_checkpoint, read_meta, resolve_checkpoint
from .precision.ptq import DEFAULT_EXCLUDE
from .provenance import collect, now_iso
from .report.card import render_report
from .report.stats import reward_ends
from .rl.learner import RLConfig, environment_prompts, run_rl
from .train.config import RunConfig
from .train.mtp_boost import MTPBoostConfig, boost_checkpoint
from .train.pretrain import run_pretrain
from .train.qad import QADRunConfig, run_qad
from .train.quantize import QuantizeConfig, run_quantize
from .train.sft import SFTRunConfig, run_sft

# the reference settings a run's provenance is compared with (present in a source checkout)
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "speedrun.yaml"


# ---------------------------------------------------------------------------- config
@dataclass(kw_only=True)
class TokenizerStageConfig:
    """The BPE trained on the curated corpus (`kind: byte` uses the 256-byte tokenizer)."""

    kind: Literal["bpe", "byte"] = "bpe"
    vocab_size: int = 2048
    min_frequency: int = 2
    split_digits: bool = True  # one token per digit: column arithmetic stays learnable
    max_chars: int = 20_000_000  # characters of the pretraining sources to train on

    def validate(self) -> None:
        if self.kind not in ("bpe", "byte"):
            raise ValueError(f"tokenizer.kind must be 'bpe' or 'byte', got {self.kind!r}")
        if self.kind == "bpe" and self.vocab_size < 300:
            raise ValueError(f"tokenizer.vocab_size must be >= 300, got {self.vocab_size}")


@dataclass(kw_only=True)
class QuantizeStageConfig:
    """`hybridlm quantize` settings (`train.quantize.QuantizeConfig`) for the final model,
    one checkpoint per recipe in `recipes` (`<run>/quantize/<recipe>`); the held-out loss / bpb
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


@dataclass(kw_only=True)
class LongContextStageConfig(RunConfig):
    """The extension run (`configs/long_context.yaml`'s sections; its start is the newest model
    before it) and what measures it: RULER (`ruler_tasks`, `ruler_samples` per task and length)
    at 1x, 2x, 4x the starting model's training length, bpb by position over the held-out
    documents of `eval_source`, short-context bpb on the starting run's held-out split."""

    WHAT = "long_context stage config"

    ruler_samples: int = 20
    ruler_tasks: list[str] = field(
        default_factory=lambda: ["niah_single", "niah_multikey", "vt", "cwe", "fwe"]
    )
    eval_source: str = "code"

    def run_config(self) -> RunConfig:
        """The training run alone (what its checkpoints record)."""
        return RunConfig(model=self.model, data=self.data, train=self.train)


@dataclass(kw_only=True)
class EvalStageConfig:
    """What the eval stage measures on every model of the chain."""

    text_batches: int = 8  # held-out pretraining batches: loss and bits per byte
    arithmetic_problems: int = 96  # held-out arithmetic (the RL eval set), greedy exact match
    max_new_tokens: int = 96
    spec_models: list[str] = field(default_factory=lambda: ["mtp_heal", "quantize"])
    spec_prompts: int = 4  # prompts per SPEED-Bench category (5 categories)
    spec_new_tokens: int = 48
    spec_prompt_format: Literal["base", "chat"] = "chat"
    # harness tasks on `harness_models`, over the packaged GSM8K / HumanEval / tinyshakespeare
    # (`data_dir` "") or a folder of them (run only when it exists)
    harness_tasks: list[str] = field(default_factory=lambda: ["base_easy"])
    harness_models: list[str] = field(default_factory=lambda: ["pretrain", "mtp_heal"])
    harness_limit: int = 32
    data_dir: str = ""
    cache_contexts: list[int] = field(
        default_factory=lambda: [2**k for k in range(10, 21)]  # 1K .. 1M tokens
    )


@dataclass(kw_only=True)
class SpeedrunConfig(Config):
    """The flow's settings: one section per stage of `STAGES` that has a `config` (same name)."""

    WHAT = "speedrun config"

    out_dir: str = "runs/speedrun"
    budget_minutes: float = 30.0  # reported against the measured wall time
    skip: list[str] = field(default_factory=list)
    curate: CurateConfig = field(default_factory=CurateConfig)
    tokenizer: TokenizerStageConfig = field(default_factory=TokenizerStageConfig)
    pretrain: RunConfig = field(default_factory=RunConfig)
    midtrain: RunConfig = field(default_factory=RunConfig)
    long_context: LongContextStageConfig = field(default_factory=LongContextStageConfig)
    sft: SFTRunConfig = field(default_factory=SFTRunConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    mtp_heal: MTPBoostConfig = field(default_factory=MTPBoostConfig)
    quantize: QuantizeStageConfig = field(default_factory=QuantizeStageConfig)
    qad: QADRunConfig = field(default_factory=QADRunConfig)
    eval: EvalStageConfig = field(default_factory=EvalStageConfig)

    def validate(self) -> SpeedrunConfig:
        unknown = sorted(set(self.skip) - set(STAGE_NAMES))
        if unknown:
            raise ValueError(f"skip: unknown stages {unknown}; stages are {list(STAGE_NAMES)}")
        self.tokenizer.validate()
        self.mtp_heal.validate()
        bad = sorted(set(self.eval.spec_models + self.eval.harness_models) - set(MODEL_STAGES))
        if bad:
            raise ValueError(f"eval: unknown model stages {bad}; use {list(MODEL_STAGES)}")
        if not self.quantize.recipes:  # the values are checked when the config is read
            raise ValueError("quantize.recipes must name at least one of fp8 / nvfp4 / autoquant")
        # the RL settings, checked now rather than after pretraining (the flow sets checkpoint)
        dataclasses.replace(self.rl, checkpoint="<the flow's model>").validate()
        return self


# ---------------------------------------------------------------------------- helpers
def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _format_paths(obj: Any, run: str) -> Any:
    """`{run}` in every string of a plain config tree -> the run directory."""
    if isinstance(obj, str):
        return obj.replace("{run}", run)
    if isinstance(obj, list):
        return [_format_paths(x, run) for x in obj]
    if isinstance(obj, dict):
        return {k: _format_paths(v, run) for k, v in obj.items()}
    return obj


def _scalars(result: dict[str, Any]) -> dict[str, Any]:
    """The JSON-friendly scalars (and small dicts of scalars) of a stage's result."""
    out: dict[str, Any] = {}
    for k, v in result.items():
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v if not (isinstance(v, float) and math.isnan(v)) else None
        elif isinstance(v, dict) and all(isinstance(x, (int, float, str)) for x in v.values()):
            out[k] = v
        elif isinstance(v, Path):
            out[k] = str(v)
    return out


# a stage's outcome as metrics.jsonl names it (provenance.json keeps the finer status)
_LOG_STATUS = {
    "run": "done",
    "reused": "reused",
    "skipped": "skipped",
    "kept": "skipped",
    "not run": "skipped",
}


def _log(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


# ---------------------------------------------------------------------------- stages
# Each stage: `_<name>_settings(flow)` is its config section with the run's wiring applied (the
# run directory for `{run}`, its output dir, the tokenizer and the model it starts from): what
# its fingerprint covers; `_<name>_run(flow)` runs it and returns the summary kept in stage.json.
def _no_settings(flow: Speedrun) -> dict[str, Any]:
    return {}


def _curate_settings(flow: Speedrun) -> dict[str, Any]:
    data = _format_paths(flow.cfg.curate.to_dict(), str(flow.run_dir))
    data["output_dir"] = str(flow.stage_dir("curate"))
    data["progress"] = flow.progress
    return data


def _curate_run(flow: Speedrun) -> dict[str, Any]:
    report = run_curate(CurateConfig.from_dict(flow.settings("curate")))
    if report.docs_out == 0:
        raise ValueError("curation kept no documents: loosen the filters in `curate.stages`")
    return {
        "data": str(flow.stage_dir("curate") / "data"),
        "docs_out": report.docs_out,
        "output": report.data["output"],
        "report": str(flow.stage_dir("curate") / "report.md"),
        "stages": [
            {k: st.get(k) for k in ("stage", "docs_in", "docs_out", "seconds")}
            for st in report.data["stages"]
        ],
    }


def _tokenizer_settings(flow: Speedrun) -> dict[str, Any]:
    return {
        **dataclasses.asdict(flow.cfg.tokenizer),
        "sources": _pretrain_settings(flow)["data"]["sources"],
    }


def _tokenizer_run(flow: Speedrun) -> dict[str, Any]:
    tcfg = flow.cfg.tokenizer
    out = flow.stage_dir("tokenizer")
    if tcfg.kind == "byte":
        return {"path": "byte", "vocab_size": 258}
    sources = RunConfig.from_dict(_pretrain_settings(flow)).data.sources

    def docs() -> Iterator[Any]:  # every source of the pretraining mix, in order, lazily
        for src in sources:
            if src.kind != "shards":
                yield from build_source(src)

    tok = train_bpe(
        docs(),
        vocab_size=tcfg.vocab_size,
        min_frequency=tcfg.min_frequency,
        max_chars=tcfg.max_chars,
        split_digits=tcfg.split_digits,
    )
    tok.save(out)
    sample = "\n".join(d.text for d in itertools.islice(docs(), 50))[:200_000]
    ids = tok.encode(sample, add_bos=False)
    return {
        "path": str(out),
        "vocab_size": tok.vocab_size,
        "split_digits": tcfg.split_digits,
        "bytes_per_token": len(sample.encode()) / max(len(ids), 1),
        "sha256": tok.sha256,
    }


def _pretrain_settings(flow: Speedrun) -> dict[str, Any]:
    data = _format_paths(flow.cfg.pretrain.to_dict(), str(flow.run_dir))
    out = flow.stage_dir("pretrain")
    data["train"]["out_dir"] = str(out)
    data["data"]["shards_dir"] = str(out / "shards")
    data["data"]["tokenizer"] = flow.tokenizer_spec()
    data["data"]["tokenizer_vocab_size"] = 0
    return data


def _pretrain_run(flow: Speedrun) -> dict[str, Any]:
    run = RunConfig.from_dict(_pretrain_settings(flow))
    vocab = flow.tokenizer().vocab_size
    model = run.model_config()
    if model.vocab_size != vocab:
        run = dataclasses.replace(run, model=dataclasses.replace(model, vocab_size=vocab))
    result = flow._continue_or_start("pretrain", lambda **kw: run_pretrain(run, **kw))
    return {"model": str(flow.stage_dir("pretrain")), **_scalars(result)}


def _warm_start_settings(flow: Speedrun, name: str) -> dict[str, Any]:
    """A continued-pretraining stage's section: its output dir and shards, the run's tokenizer,
    and the newest model before it as `train.init_from`."""
    data = _format_paths(getattr(flow.cfg, name).to_dict(), str(flow.run_dir))
    out = flow.stage_dir(name)
    data["train"]["out_dir"] = str(out)
    data["train"]["init_from"] = flow.model_path(name)
    data["data"]["shards_dir"] = str(out / "shards")
    data["data"]["tokenizer"] = flow.tokenizer_spec()
    data["data"]["tokenizer_vocab_size"] = 0
    return data


def _midtrain_settings(flow: Speedrun) -> dict[str, Any]:
    return _warm_start_settings(flow, "midtrain")


def _midtrain_run(flow: Speedrun) -> dict[str, Any]:
    run = RunConfig.from_dict(flow.settings("midtrain"))
    result = flow._continue_or_start("midtrain", lambda **kw: run_pretrain(run, **kw))
    return {"model": str(flow.stage_dir("midtrain")), **_scalars(result)}


def _long_context_settings(flow: Speedrun) -> dict[str, Any]:
    return _warm_start_settings(flow, "long_context")


def _long_context_run(flow: Speedrun) -> dict[str, Any]:
    cfg = LongContextStageConfig.from_dict(flow.settings("long_context"))
    run = cfg.run_config()
    out = flow.stage_dir("long_context")
    result = flow._continue_or_start("long_context", lambda **kw: run_pretrain(run, **kw))
    # before / after on the same samples: the starting model, trained at its run's length
    start = run.train.init_from
    start_run = RunConfig.from_dict(read_meta(resolve_checkpoint(start))["run_config"])
    original = start_run.data.seq_len
    measure = functools.partial(
        measure_extension,
        original=original,
        short_run=start_run,
        documents=held_out_documents(run.data, cfg.eval_source),
        tasks=cfg.ruler_tasks,
        num_samples=cfg.ruler_samples,
    )
    before, after = measure(start), measure(out)
    verdict = extension_verdict(before, after)
    change = verdict["bpb_change_by_position"]
    plot_long_context(
        {"before": before, "after": after},
        out / "long_context.png",
        changes={"after - before": change} if change else None,
        original=original,
    )
    (out / "measurements.json").write_text(
        json.dumps({"before": before, "after": after, "verdict": verdict}, default=str) + "\n"
    )
    lengths = before["ruler"]["lengths"]
    return {
        "model": str(out),
        **_scalars(result),
        "original_length": original,
        "ruler_before": {str(L): before["ruler"]["overall"][L] for L in lengths},
        "ruler_after": {str(L): after["ruler"]["overall"][L] for L in lengths},
        "ruler_gain": verdict["ruler_gain"],
        "short_bpb_before": verdict["short_bpb_before"],
        "short_bpb_after": verdict["short_bpb_after"],
        "short_bpb_change": verdict["short_bpb_change"],
        "target_met": verdict["met"],
    }


def _sft_settings(flow: Speedrun) -> dict[str, Any]:
    data = _format_paths(flow.cfg.sft.to_dict(), str(flow.run_dir))
    data["train"]["out_dir"] = str(flow.stage_dir("sft"))
    data["data"]["tokenizer"] = flow.tokenizer_spec()
    data["train"]["init_from"] = flow.model_path("sft")
    return data


def _sft_run(flow: Speedrun) -> dict[str, Any]:
    cfg = SFTRunConfig.from_dict(flow.settings("sft"))
    result = flow._continue_or_start("sft", lambda **kw: run_sft(cfg, **kw))
    return {"model": str(flow.stage_dir("sft")), **_scalars(result)}


def _rl_settings(flow: Speedrun) -> dict[str, Any]:
    data = _format_paths(flow.cfg.rl.to_dict(), str(flow.run_dir))
    data["checkpoint"] = flow.model_path("rl")
    data["out_dir"] = str(flow.stage_dir("rl"))
    return data


def _rl_run(flow: Speedrun) -> dict[str, Any]:
    cfg = RLConfig.from_dict(flow.settings("rl"))
    # not resumable: an interrupted attempt's outputs in the stage dir are replaced
    result = run_rl(cfg, progress=flow.progress, overwrite=True)
    rewards = [r["reward_mean"] for r in result["train"]]
    k, first, last = reward_ends(rewards)
    return {
        "model": result["model"],
        "steps": len(rewards),
        "reward_window": k,
        "reward_first": first,
        "reward_last": last,
        "eval": [{"step": e.get("step"), "solved": e["all/solved"]} for e in result["eval"]],
    }


def _mtp_heal_settings(flow: Speedrun) -> dict[str, Any]:
    return {**dataclasses.asdict(flow.cfg.mtp_heal), "checkpoint": flow.model_path("mtp_heal")}


def _mtp_heal_run(flow: Speedrun) -> dict[str, Any]:
    cfg = flow.cfg.mtp_heal
    src = flow.model_path("mtp_heal")
    out = flow.stage_dir("mtp_heal")
    result = boost_checkpoint(
        src,
        cfg,
        out,
        progress=flow.progress,
        overwrite=True,
        environment_prompts=environment_prompts,
    )
    al = {
        f"T{r['temperature']:g}": [r["acceptance_length"], a["acceptance_length"]]
        for r, a in zip(result["before"], result["after"], strict=True)
    }
    return {
        "model": str(out / "model"),
        "from": src,
        "draft_len": cfg.draft_len,
        "acceptance_length": al,  # temperature -> [before, after]
        **_scalars(result),
    }


def _quantize_settings(flow: Speedrun) -> dict[str, Any]:
    sft = flow.cfg.quantize.calibration == "sft" and flow.done("sft")
    return {
        **dataclasses.asdict(flow.cfg.quantize),
        "checkpoint": flow.model_path("quantize"),
        "data": str(flow.stage_dir("pretrain")),
        "calib_data": str(flow.stage_dir("sft")) if sft else "",
    }


def _quantize_run(flow: Speedrun) -> dict[str, Any]:
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


def _qad_settings(flow: Speedrun) -> dict[str, Any]:
    """The qad section, on the SFT stage's chats and tokenizer, from the newest model; held-out
    text of the pretraining run. `qad.plan` (e.g. `{run}/quantize/nvfp4`) takes a quantize
    recipe's operators, exclusions and weight-scale search."""
    data = _format_paths(flow.cfg.qad.to_dict(), str(flow.run_dir))
    data["data"] = _format_paths(flow.cfg.sft.to_dict(), str(flow.run_dir))["data"]
    data["data"]["tokenizer"] = flow.tokenizer_spec()
    data["train"]["out_dir"] = str(flow.stage_dir("qad"))
    data["train"]["init_from"] = flow.model_path("qad")
    data["qad"]["text_data"] = str(flow.stage_dir("pretrain")) if flow.done("pretrain") else ""
    return data


def _qad_run(flow: Speedrun) -> dict[str, Any]:
    cfg = QADRunConfig.from_dict(flow.settings("qad"))
    result = flow._continue_or_start("qad", lambda **kw: run_qad(cfg, **kw))
    name = Path(cfg.qad.plan).name if cfg.qad.plan else cfg.qad.recipe
    name += "_mixed_qad" if cfg.qad.formats else "_qad"  # `qad.formats` changed some operators
    return {
        "model": result["hf"],
        "models": {name: result["hf"]},
        "from": cfg.train.init_from,
        "steps": result["step"],
        "figures": result["figures"],
    }


def _eval_settings(flow: Speedrun) -> dict[str, Any]:
    return {
        **dataclasses.asdict(flow.cfg.eval),
        "models": flow.models(),
        "rl_eval": flow.cfg.rl.to_dict()["envs"],
    }


def _eval_run(flow: Speedrun) -> dict[str, Any]:
    return evaluate_flow(flow, flow.stage_dir("eval"))


def _report_run(flow: Speedrun) -> dict[str, Any]:
    return render_report(flow.run_dir)


@dataclass(frozen=True)
class Stage:
    """One stage of the flow: it writes `<run>/<name>/`.

    `run(flow)` runs it and returns the summary recorded in its stage.json; `settings(flow)` is
    its config section with the run's wiring applied (what its fingerprint covers); `inputs`:
    the stages whose outputs it reads (their fingerprints, when they finished, enter its own);
    `config`: the class of its section of `SpeedrunConfig` (None: no section)."""

    name: str
    run: Callable[[Speedrun], dict[str, Any]]
    settings: Callable[[Speedrun], dict[str, Any]] = _no_settings
    inputs: tuple[str, ...] = ()
    config: type | None = None
    # its place in the model chain: "model" (one model; it starts from the newest model before
    # it, and later stages start from its model), "variants" (it starts from the newest model
    # too, and writes the models named in its summary's `models`, evaluated, not trained on)
    model: Literal["", "model", "variants"] = ""
    # rendered from the other stages' files on every run: never skipped, fingerprinted or reused
    derived: bool = False


STAGES: tuple[Stage, ...] = (
    Stage(
        "curate",
        inputs=(),
        config=CurateConfig,
        settings=_curate_settings,
        run=_curate_run,
    ),
    Stage(
        "tokenizer",
        inputs=("curate",),
        config=TokenizerStageConfig,
        settings=_tokenizer_settings,
        run=_tokenizer_run,
    ),
    Stage(
        "pretrain",
        inputs=("curate", "tokenizer"),
        config=RunConfig,
        settings=_pretrain_settings,
        run=_pretrain_run,
        model="model",
    ),
    Stage(
        "midtrain",
        inputs=("curate", "tokenizer"),
        config=RunConfig,
        settings=_midtrain_settings,
        run=_midtrain_run,
        model="model",
    ),
    Stage(
        "long_context",
        inputs=("curate", "tokenizer"),
        config=LongContextStageConfig,
        settings=_long_context_settings,
        run=_long_context_run,
        model="model",
    ),
    Stage(
        "sft",
        inputs=("tokenizer",),
        config=SFTRunConfig,
        settings=_sft_settings,
        run=_sft_run,
        model="model",
    ),
    Stage(
        "rl",
        inputs=(),
        config=RLConfig,
        settings=_rl_settings,
        run=_rl_run,
        model="model",
    ),
    Stage(
        "mtp_heal",
        inputs=(),
        config=MTPBoostConfig,
        settings=_mtp_heal_settings,
        run=_mtp_heal_run,
        model="model",
    ),
    Stage(
        "quantize",
        inputs=("pretrain", "sft"),  # held-out text, calibration chats
        config=QuantizeStageConfig,
        settings=_quantize_settings,
        run=_quantize_run,
        model="variants",
    ),
    Stage(
        "qad",
        inputs=("pretrain", "sft", "quantize"),  # held-out text, the chats, the NVFP4 plan
        config=QADRunConfig,
        settings=_qad_settings,
        run=_qad_run,
        model="variants",
    ),
    Stage(
        "eval",
        # pretrain's held-out text, rl's problems, and every model it evaluates
        inputs=("pretrain", "rl", "sft", "mtp_heal", "quantize", "qad"),
        config=EvalStageConfig,
        settings=_eval_settings,
        run=_eval_run,
    ),
    Stage("report", run=_report_run, derived=True),
)
STAGE_NAMES = tuple(s.name for s in STAGES)
# stages whose output is a model, in chain order (each starts from the newest one before it)
MODEL_STAGES = tuple(s.name for s in STAGES if s.model)
_STAGE = {s.name: s for s in STAGES}


# ---------------------------------------------------------------------------- the flow
class Speedrun:
    """Runs the stages of a `SpeedrunConfig` in `cfg.out_dir` (see the module docstring)."""

    def __init__(
        self,
        cfg: SpeedrunConfig,
        *,
        only: list[str] | None = None,
        force: list[str] | None = None,
        progress: bool = True,
        threads: dict[str, Any] | None = None,
        argv: list[str] | None = None,
    ) -> None:
        """`threads`: what `hybridlm.threads.configure_threads` returned, when it was called;
        `argv`: the command line to record (default `sys.argv`). Both go to provenance.json."""
        self.cfg = cfg.validate()
        self.run_dir = Path(cfg.out_dir)
        self.only = set(only) if only else None
        self.force = set(force or ())
        for name in (self.only or set()) | self.force:
            if name not in _STAGE:
                raise ValueError(f"unknown stage {name!r}; stages are {list(STAGE_NAMES)}")
        self.progress = progress
        self.console = Console(quiet=not progress)
        self.summaries: dict[str, dict[str, Any]] = {}
        self.threads = threads
        self.argv = argv
        self.provenance: dict[str, Any] = {}

    # -------------------------------------------------------------- bookkeeping
    def stage_dir(self, name: str) -> Path:
        return self.run_dir / name

    def record(self, name: str) -> dict[str, Any] | None:
        """The stage's finished record; None when it has not finished or is skipped (a skipped
        stage's outputs from an earlier run are left out of the chain as well)."""
        path = self.stage_dir(name) / "stage.json"
        if name in self.cfg.skip or not path.is_file():
            return None
        return json.loads(path.read_text())

    def done(self, name: str) -> bool:
        return self.record(name) is not None

    def model_before(self, name: str) -> tuple[str, str] | None:
        """(stage, path) of the newest model produced before stage `name` (finished stages)."""
        order = MODEL_STAGES[: MODEL_STAGES.index(name)] if name in MODEL_STAGES else MODEL_STAGES
        for stage in reversed(order):
            if _STAGE[stage].model == "variants":  # a quantised model is evaluated, not trained
                continue
            rec = self.record(stage)
            if rec is not None:
                return stage, rec["summary"]["model"]
        return None

    def model_path(self, name: str) -> str:
        """The model stage `name` starts from (ValueError when no earlier one has finished)."""
        found = self.model_before(name)
        if found is None:
            raise ValueError(
                f"stage {name} needs a model from an earlier stage (pretrain, midtrain, "
                "long_context, sft, rl, mtp_heal); "
                "none has finished in this run directory"
            )
        return found[1]

    def models(self) -> list[tuple[str, str, str]]:
        """(stage, name, path) of every finished model, in chain order; variants (the quantised
        checkpoints) are named by their recipe."""
        out = []
        for s in MODEL_STAGES:
            rec = self.record(s)
            if rec is None:
                continue
            if _STAGE[s].model == "variants":
                out += [(s, r, p) for r, p in rec["summary"]["models"].items()]
            else:
                out.append((s, s, rec["summary"]["model"]))
        return out

    def tokenizer_spec(self) -> str:
        rec = self.record("tokenizer")
        return rec["summary"]["path"] if rec is not None else "byte"

    def tokenizer(self) -> Any:
        return load_tokenizer(self.tokenizer_spec())

    def settings(self, name: str) -> dict[str, Any]:
        """The stage's section with the run's wiring applied (what its fingerprint covers)."""
        return _STAGE[name].settings(self)

    def inputs(self, name: str) -> list[str]:
        """The stages whose outputs stage `name` reads (their fingerprints enter its own)."""
        stage = _STAGE[name]
        upstream = list(stage.inputs)
        found = self.model_before(name) if stage.model else None
        if found is not None:
            upstream.append(found[0])
        return [s for s in dict.fromkeys(upstream) if self.done(s)]

    def fingerprint(self, name: str) -> str:
        ins = {}
        for s in self.inputs(name):
            rec = self.record(s)
            assert rec is not None  # inputs() keeps finished stages only
            # which outputs, not only which settings: a forced rerun makes new ones
            ins[s] = [rec["fingerprint"], rec.get("made_at")]
        return _fingerprint({"stage": name, "settings": self.settings(name), "inputs": ins})

    def _continue_or_start(self, stage: str, run: Any) -> Any:
        """`run(resume=, overwrite=)` for a checkpointed stage. `Speedrun.run` removed the stage
        dir unless an interrupted attempt with the same settings left it: continue from its
        checkpoints, or replace what it logged before the first one. When none of them is
        intact, the error says how to start the stage again here (`--force`)."""
        resume = latest_checkpoint(self.stage_dir(stage)) is not None
        try:
            return run(resume=resume, overwrite=not resume)
        except CheckpointError as err:
            how = f"start the stage again with `hybridlm speedrun --force {stage}`"
            raise CheckpointError(str(err).replace("start again with --overwrite", how)) from None

    # -------------------------------------------------------------- driver
    def start_provenance(self) -> dict[str, Any]:
        """Write `<run>/provenance.json` for this invocation (see `hybridlm.provenance`); the
        stages' statuses and times are added to it as they finish."""
        defaults = None
        if DEFAULT_CONFIG.is_file():
            try:
                defaults = SpeedrunConfig.load(DEFAULT_CONFIG).to_dict()
            except ValueError:  # an edited default that no longer parses: no reference
                defaults = None
        self.provenance = collect(
            argv=self.argv,
            config=self.cfg.to_dict(),
            defaults=defaults,
            defaults_path=DEFAULT_CONFIG if defaults is not None else None,
            threads=self.threads,
        )
        self.provenance |= {
            "run_dir": str(self.run_dir),
            "only": sorted(self.only) if self.only else None,
            "force": sorted(self.force),
            "skip": list(self.cfg.skip),
            "budget_minutes": self.cfg.budget_minutes,
            "stages": {},
        }
        self._write_provenance()
        return self.provenance

    def _write_provenance(self) -> None:
        path = self.run_dir / "provenance.json"
        path.write_text(json.dumps(self.provenance, indent=1, default=str))

    def _stage_status(self, name: str, status: str, seconds: float | None = None) -> None:
        """Record a stage's outcome in both places the report reads: a `stage` row of
        metrics.jsonl (done / reused / skipped) and provenance.json's `stages` (run / reused /
        skipped / kept / not run, with when a reused output was made)."""
        row: dict[str, Any] = {"kind": "stage", "stage": name, "status": _LOG_STATUS[status]}
        entry: dict[str, Any] = {"status": status}
        if seconds is not None:
            row["seconds"] = entry["seconds"] = seconds
        _log(self.run_dir / "metrics.jsonl", row)
        rec = self.record(name) if status != "run" else None
        if rec is not None:  # reused / kept: when and by what it was produced
            entry["seconds_when_run"] = rec.get("seconds")
            entry["produced_by"] = rec.get("run")
        self.provenance.setdefault("stages", {})[name] = entry
        self._write_provenance()

    def _finish(self, t_start: float) -> None:
        self.provenance["finished"] = now_iso()
        self.provenance["wall_seconds"] = time.time() - t_start
        self._write_provenance()

    def run(self) -> dict[str, Any]:
        """Go down `STAGES`: skip what `--skip` / `--only` leave out, reuse every finished stage
        whose fingerprint is unchanged, run the others; derived stages (the report) always run,
        after the flow's finish is recorded."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg.save(self.run_dir / "speedrun.yaml")
        self.start_provenance()
        made_by = {
            "started": self.provenance["started"],
            "command": self.provenance["command"],
            "commit": self.provenance["git"].get("commit"),
            "dirty": self.provenance["git"].get("dirty"),
        }
        t_start = time.time()
        for i, stage in enumerate(STAGES, 1):
            name = stage.name
            selected = (self.only is None or name in self.only) and name not in self.cfg.skip
            header = f"[bold]speedrun {i}/{len(STAGES)}: {name}[/]"
            if stage.derived:
                self.console.print(header)
                self._finish(t_start)  # the report shows the flow's finish and wall time
                t0 = time.time()
                summary = stage.run(self)
                self._stage_status(name, "run", time.time() - t0)
                self.summaries[name] = summary
                continue
            if not selected:
                self.console.print(f"{header} [dim]skipped[/]")
                if name in self.cfg.skip:
                    self._stage_status(name, "skipped")
                else:  # left out by --only: an earlier run's outputs, if any, are still used
                    self._stage_status(name, "kept" if self.done(name) else "not run")
                continue
            fp = self.fingerprint(name)
            rec = self.record(name)
            if rec is not None and rec["fingerprint"] == fp and name not in self.force:
                self.console.print(f"{header} [dim]done before ({rec['seconds']:.0f} s), reused[/]")
                self._stage_status(name, "reused")
                self.summaries[name] = rec["summary"]
                continue
            out = self.stage_dir(name)
            started = out / "started.json"
            same_start = started.is_file() and json.loads(started.read_text())["fingerprint"] == fp
            if out.exists() and (not same_start or name in self.force):
                shutil.rmtree(out)  # stale outputs of other settings or inputs
            out.mkdir(parents=True, exist_ok=True)
            (out / "stage.json").unlink(missing_ok=True)
            started.write_text(json.dumps({"fingerprint": fp, "time": time.time()}))
            self.console.print(f"{header} -> {out}")
            t0 = time.time()
            summary = stage.run(self)
            seconds = time.time() - t0
            record = {
                "stage": name,
                "fingerprint": fp,
                "seconds": seconds,
                "made_at": time.time(),
                "summary": summary,
                "run": made_by,  # not in the fingerprint: provenance, not settings
            }
            (out / "stage.json").write_text(json.dumps(record, indent=1, default=str))
            self._stage_status(name, "run", seconds)
            self.summaries[name] = summary
            self.console.print(f"[green]{name} done[/] in {seconds:.0f} s")
        total = time.time() - t_start
        self._finish(t_start)
        self.console.print(
            f"[bold]speedrun finished[/] in {total / 60:.1f} min: "
            f"{self.run_dir / 'report.md'}, {self.run_dir / 'report.html'}"
        )
        return {"seconds": total, "stages": self.summaries, "run_dir": str(self.run_dir)}


# ---------------------------------------------------------------------------- loading
def load_config(path: str, overrides: list[str], out: str = "", skip: str = "") -> SpeedrunConfig:
    cfg = SpeedrunConfig.load(path)
    if overrides:
        cfg = cfg.override(overrides)
    if out:
        cfg = dataclasses.replace(cfg, out_dir=out)
    if skip:
        cfg = dataclasses.replace(cfg, skip=[*cfg.skip, *(s for s in skip.split(",") if s)])
    return cfg.validate()
