"""Pretraining-data curation (SPEC §4): typed stages over sharded documents with provenance.

    core.py       CurateDoc, Decision, Stage / DocStage / Filter / Mapper / GlobalStage, StageStats,
                  the stage registry (`register_stage`, `build_stage`)
    executor.py   shard-level executors: in-process (`LocalExecutor`) and Ray Data (`RayExecutor`)
    extract.py    HTML -> text (trafilatura); Unicode, whitespace, control-char normalisation
    filters.py    Gopher quality + repetition, C4, FineWeb, length, symbol/alpha, URL blocklist
    langid.py     language ID with a confidence threshold (py3langid)
    dedup.py      exact, MinHash-LSH (verified clusters, keep-newest), suffix-array substrings
    quality.py    fastText-style quality / topic classifiers
    upsample.py   quality-aware up-sampling curves (`metadata["repeat"]`)
    benchmarks.py benchmark items (GSM8K, HumanEval, JSON Lines) and the `Match` a detector reports
    embed.py      code decontamination by embedding similarity
    decon.py      decon-style sampled n-grams, 8-gram overlap, the `decontaminate` stage
    fim.py        the fill-in-the-middle stage (`hybridlm.data.fim`)
    mixing.py     swarm mixture optimisation (proxy runs on the trainer)
    pipeline.py   `CurateConfig` (YAML), `run_curate(cfg)`, report.json / report.md

`hybridlm curate --config configs/curate.yaml` runs it; see `pipeline.py`.
"""

from .core import (
    STAGES,
    CurateDoc,
    Decision,
    DocStage,
    Filter,
    GlobalStage,
    Mapper,
    Stage,
    StageRecord,
    StageStats,
    build_stage,
    load_stage_modules,
    register_stage,
    run_in_memory,
    stage_fingerprint,
)

__all__ = [
    "STAGES",
    "CurateDoc",
    "Decision",
    "DocStage",
    "Filter",
    "GlobalStage",
    "Mapper",
    "Stage",
    "StageRecord",
    "StageStats",
    "build_stage",
    "load_stage_modules",
    "register_stage",
    "run_in_memory",
    "stage_fingerprint",
]
