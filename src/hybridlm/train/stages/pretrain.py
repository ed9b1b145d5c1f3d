"""The pretraining and midtraining stages of the flow (`STAGE`, `MIDTRAIN`; `hybridlm pretrain`
runs `text_training.run_pretrain`), and `cache_text_teacher`, the teacher top-k cache of
pretraining by distillation (`hybridlm distill-cache --pretraining`). What a step does is
`train.text_training.Pretrain`'s (its docstring: losses, data parallelism, metrics, bits per
byte, distillation, warm starts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...data.pipeline import build_tokenizer, prepare_shards
from ...stage import Flow, Report, Stage, scalars, text_run_settings
from ..config import RunConfig
from ..teacher import cache_pass_teacher
from ..teacher_cache import build_text_teacher_cache
from ..text_training import run_pretrain
from ..trainer import resolve_device, resolve_tokenizer


def cache_text_teacher(run_cfg: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    """Write (or finish) `distill.teacher_cache` of a pretraining run: the teacher's top-`top_k`
    at every token of every source's shards, aligned with them (`teacher_cache`)."""
    run = run_cfg.resolved()
    resolve_tokenizer(run.data, run.train)
    dd = run.distill
    device = resolve_device(run.train.device)
    teacher, spec = cache_pass_teacher(dd, device=device, tokenizer=build_tokenizer(run.data))
    sets = prepare_shards(run.data)
    return build_text_teacher_cache(
        dd.teacher_cache,
        teacher,
        sets,
        spec,
        seq_len=run.data.seq_len,
        batch_size=run.data.batch_size,
        device=device,
        progress=progress,
    )


# ---------------------------------------------------------------------------- the flow's stages
def _pretrain_run(flow: Flow) -> dict[str, Any]:
    run = RunConfig.from_dict(flow.settings("pretrain"))
    vocab = flow.tokenizer().vocab_size
    model = run.model_config()
    if model.vocab_size != vocab:
        run = dataclasses.replace(run, model=dataclasses.replace(model, vocab_size=vocab))
    result = flow.continue_or_start("pretrain", lambda **kw: run_pretrain(run, **kw))
    return {"model": str(flow.stage_dir("pretrain")), **scalars(result)}


def _midtrain_run(flow: Flow) -> dict[str, Any]:
    run = RunConfig.from_dict(flow.settings("midtrain"))
    result = flow.continue_or_start("midtrain", lambda **kw: run_pretrain(run, **kw))
    return {"model": str(flow.stage_dir("midtrain")), **scalars(result)}


def _bpb_headline(s: dict[str, Any], report: Report) -> str:
    bpb = (s.get("eval") or {}).get("eval_bpb")
    return f"{report.names['trainer_bpb']}: " + (
        f"{bpb:.3f} at step {s.get('step')}" if bpb is not None else f"– (step {s.get('step')})"
    )


# the hybrid Mamba-2 / LatentMoE / MTP model on the curated mix
STAGE = Stage(
    "pretrain",
    inputs=("curate", "tokenizer"),
    config=RunConfig,
    settings=lambda flow: text_run_settings(flow, "pretrain", warm_start=False),
    run=_pretrain_run,
    model="model",
    headline=_bpb_headline,
)


def _midtrain_headline(s: dict[str, Any], report: Report) -> str:
    bpb = (s.get("eval") or {}).get("eval_bpb")
    return f"{report.names['trainer_bpb']}: " + (f"{bpb:.3f}" if bpb is not None else "–")


# continued pretraining on a new mix from the newest model, linear decay to zero (Olmo 3 §4)
MIDTRAIN = Stage(
    "midtrain",
    inputs=("curate", "tokenizer"),
    config=RunConfig,
    settings=lambda flow: text_run_settings(flow, "midtrain"),
    run=_midtrain_run,
    model="model",
    headline=_midtrain_headline,
)
