"""`hybridlm curate`: typed config -> sharded, resumable curation run -> report.

    cfg = CurateConfig.load("configs/curate.yaml")     # or CurateConfig(inputs=[...], stages=[...])
    report = run_curate(cfg)                            # same result with cfg.executor = "ray"

Inputs are `hybridlm.data.sources` readers (jsonl, parquet, text, tinyshakespeare, stdlib), so bad
input (non-UTF-8 bytes, empty documents, malformed JSON, truncated gzip, corrupt Parquet) is
counted under a reason and skipped, never fatal; on top of that a document longer than
`max_doc_chars` is skipped as `huge` and one with lone surrogates (possible in JSON) as
`bad_unicode`. Input shards are the input files, `files_per_shard` at a time, in sorted order.

The stage list is cut at every global stage into segments; a segment is one task per shard:

    segment 0:  read shard -> per-document stages -> [observe for the next global stage]
    segment j:  global stage j's apply (with its shard plan) -> per-document stages -> [observe]

and between segments the driver runs the global stage's `plan` over every shard's partial.
Every shard task of every segment has a key: sha256 of its input (files with size and mtime, or
the previous segment's key), the stages' configurations and, after a global stage, the digest of
that shard's plan. A task whose done-record carries the same key is skipped, so a rerun redoes
only what changed (a finished shard is skipped; a shard whose dedup decisions did not change is
skipped too).

Output folder:

    data/shard_00000.jsonl.gz      kept documents {id, text, source, metadata, provenance}
                                   (or .parquet with metadata/provenance as JSON strings); a
                                   `jsonl` source of `hybridlm.data.config` reads `data/` as is
    data/shard_00000.json          the shard's done-record (key, counts, per-stage stats)
    removed/shard_00000.seg0.jsonl.gz  removed documents with the provenance that says why
    _work/                         segment outputs, global-stage partials (resume state)
    report.json, report.md         per-stage statistics, drop reasons, global-stage summaries

Repeats (Olmo 3 §2.6): the `upsample` stage writes a copy count to `metadata["repeat"]`; with
`expand_repeats` (on by default when an `upsample` stage is in the list) the writer emits each
kept document that many times, as `id#0 ... id#(n-1)`, each copy with an `expand_repeats`
provenance record (copy, copies, repeat). A real-valued `repeat` (e.g. read from an input's
metadata) is rounded first: `repeat_rounding: stochastic` gives floor(r) + 1 with probability
r - floor(r) drawn from a hash of (`repeat_seed`, id) (the expected count is r), `round` gives
floor(r + 0.5); a document rounded to 0 copies goes to `removed/`. The expansion is part of the
last segment, so it is deterministic and resumable per shard like every other step; a document
that already carries an `expand_repeats` record (the output of an earlier run) is written once.
The report counts documents and characters before and after the expansion.

Scale: a shard task holds one shard's documents in memory and streams them through the stages;
a global stage's `plan` holds every shard's partial on the driver (exact: a 16-byte hash, the id
and date of each document; MinHash: also the signatures and shingle-hash sets; substring: the
corpus bytes), which fits the MB-GB corpora this runs on (Olmo 3 split MinHash into 32 and the
suffix array into 57 groups at TB scale). On a Ray cluster `output_dir` must be on storage every
node sees. Parquet inputs carry no metadata columns (the reader yields the text and id only), so
keep-newest needs JSONL inputs with `metadata_fields: [date]`.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import hashlib
import json
import math
import pickle
import time
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..config import Config
from ..data.config import SourceConfig
from ..data.pipeline import build_source
from ..data.sources import (
    DocumentSource,
    SourceStats,
)
from ..files import atomic_write
from ..stage import Flow, Report
from ..stage import Stage as FlowStage
from .core import (
    CurateDoc,
    DocStage,
    GlobalStage,
    Stage,
    StageRecord,
    StageStats,
    build_stage,
    load_stage_modules,
    stage_fingerprint,
)
from .executor import Executor, make_executor
from .upsample import repeat_count

FORMAT = "hybridlm-curate"
FORMAT_VERSION = 1


# ---------------------------------------------------------------------------- config
InputKind = Literal["jsonl", "parquet", "text", "tinyshakespeare", "stdlib"]


@dataclass(kw_only=True)
class CurateInput(SourceConfig):
    """One input corpus: a pretraining `SourceConfig` (kinds jsonl, parquet, text,
    tinyshakespeare, stdlib; `weight` and the hf fields are unused here) read in shards of
    `files_per_shard` files. stdlib and tinyshakespeare need no path (the packaged copy)."""

    kind: InputKind = "jsonl"
    files_per_shard: int = 1


def default_inputs() -> list[CurateInput]:
    return [CurateInput(name="stdlib", kind="stdlib", docstrings_only=True, files_per_shard=64)]


def default_stages() -> list[dict[str, Any]]:
    """A FineWeb-like chain (Penedo et al. 2024) followed by the Olmo 3 dedup sequence."""
    return [
        {"stage": "normalize"},
        {"stage": "length", "min_chars": 200},
        {"stage": "langid", "languages": ["en"], "min_score": 0.65},
        {"stage": "gopher_repetition"},
        {"stage": "gopher_quality"},
        {"stage": "c4", "filter_no_terminal_punct": False},
        {"stage": "fineweb"},
        {"stage": "exact_dedup"},
        {"stage": "minhash_dedup"},
        {"stage": "substring_dedup"},
    ]


@dataclass(kw_only=True)
class CurateConfig(Config):
    """A curation run: inputs, an ordered stage list, output and executor settings."""

    WHAT = "curate config"
    KEY = "curate"

    inputs: list[CurateInput] = field(default_factory=default_inputs)
    stages: list[dict[str, Any]] = field(default_factory=default_stages)
    output_dir: str = "runs/curate"
    output_format: Literal["jsonl", "parquet"] = "jsonl"
    write_removed: bool = True
    max_doc_chars: int = 10_000_000  # longer documents are skipped as "huge"
    executor: Literal["local", "ray"] = "local"
    ray_address: str = ""  # "" starts a local Ray instance; "auto" / "ray://..." a cluster
    ray_num_cpus: int = 0  # local Ray instance size; 0 = all cores
    num_workers: int = 0  # concurrent shard tasks on Ray; 0 = the cluster's CPUs
    resume: bool = True
    progress: bool = True
    expand_repeats: bool | None = None  # None: on when an `upsample` stage is in `stages`
    repeat_rounding: Literal["stochastic", "round"] = "stochastic"  # real-valued repeats
    repeat_seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.inputs:
            raise ValueError("curate.inputs must list at least one input")
        names = [i.name for i in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"curate.inputs names must be unique, got {names}")
        for k, inp in enumerate(self.inputs):
            where = f"curate.inputs[{k}] ({inp.name!r})"
            if not inp.name or "/" in inp.name:
                raise ValueError(f"{where}: name must be non-empty and without '/'")
            if inp.kind not in ("stdlib", "tinyshakespeare") and not inp.path:
                raise ValueError(f"{where}: kind {inp.kind!r} needs a path")
            if inp.files_per_shard <= 0:
                raise ValueError(f"{where}: files_per_shard must be positive")
        if self.output_format not in ("jsonl", "parquet"):
            raise ValueError(
                f"curate.output_format must be jsonl or parquet, got {self.output_format!r}"
            )
        if self.executor not in ("local", "ray"):
            raise ValueError(f"curate.executor must be 'local' or 'ray', got {self.executor!r}")
        if self.max_doc_chars <= 0:
            raise ValueError("curate.max_doc_chars must be positive")
        if not self.output_dir:
            raise ValueError("curate.output_dir must be set")
        if self.repeat_rounding not in ("stochastic", "round"):
            raise ValueError(
                f"curate.repeat_rounding must be stochastic or round, got {self.repeat_rounding!r}"
            )
        self.build_stages()  # unknown stages / options fail here, before any work

    def build_stages(self) -> list[Stage]:
        load_stage_modules()
        stages = []
        for k, spec in enumerate(self.stages):
            try:
                stages.append(build_stage(spec))
            except ValueError as err:
                raise ValueError(f"curate.stages[{k}]: {err}") from None
        return stages

    def expands(self, stages: Sequence[Stage]) -> bool:
        """Whether the writer expands `metadata["repeat"]` (see the module docstring)."""
        if self.expand_repeats is not None:
            return bool(self.expand_repeats)
        return any(s.name == "upsample" for s in stages)


# ---------------------------------------------------------------------------- input shards
def build_reader(inp: CurateInput) -> DocumentSource:
    """The `hybridlm.data.sources` reader of one input (all its files)."""
    if inp.kind not in typing.get_args(InputKind):
        raise ValueError(f"input {inp.name!r}: unknown kind {inp.kind!r}")
    return build_source(inp)


@dataclass(kw_only=True)
class InputShard:
    """A slice of one reader's files; reading it gives documents and a `SourceStats`."""

    index: int
    input_name: str
    reader: DocumentSource
    files: list[tuple[Path, str]]
    config: dict[str, Any] = field(default_factory=dict)  # the CurateInput, for resume keys

    def fingerprint(self) -> dict[str, Any]:
        files = []
        for path, rel in self.files:
            try:
                st = path.stat()
                files.append([rel, st.st_size, st.st_mtime_ns])
            except OSError:
                files.append([rel, -1, -1])
        return {"reader": self.reader.describe(), "input": self.config, "files": files}

    def read(self, max_doc_chars: int) -> tuple[list[CurateDoc], SourceStats]:
        reader = copy.copy(self.reader)
        reader.files = list(self.files)  # every file-based reader iterates `self.files`
        docs: list[CurateDoc] = []
        for doc in reader:
            if len(doc.text) > max_doc_chars:
                reader.stats.skip(doc.id, "huge", f"{len(doc.text)} chars")
                continue
            try:
                doc.text.encode("utf-8")
            except UnicodeEncodeError:
                reader.stats.skip(doc.id, "bad_unicode", "lone surrogate")
                continue
            docs.append(CurateDoc.from_document(doc))
        stats = reader.stats
        stats.documents = len(docs)
        stats.chars = sum(len(d.text) for d in docs)
        return docs, stats


def input_shards(cfg: CurateConfig) -> list[InputShard]:
    """All input shards in a deterministic order (inputs in config order, files sorted)."""
    shards: list[InputShard] = []
    for inp in cfg.inputs:
        reader = build_reader(inp)
        files = list(reader.files)
        if not files:
            raise ValueError(f"input {inp.name!r}: no files match {inp.path!r}")
        for lo in range(0, len(files), inp.files_per_shard):
            shards.append(
                InputShard(
                    index=len(shards),
                    input_name=inp.name,
                    reader=reader,
                    files=files[lo : lo + inp.files_per_shard],
                    config=dataclasses.asdict(inp),
                )
            )
    return shards


# ---------------------------------------------------------------------------- shard I/O
def _jsonl_gz(records: Sequence[dict[str, Any]]) -> bytes:
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    return gzip.compress(body, mtime=0)  # mtime=0: identical bytes for identical documents


def write_docs(path: Path, docs: Sequence[CurateDoc], fmt: str = "jsonl") -> None:
    """Write documents with provenance as JSONL.gz or Parquet (atomically)."""
    if fmt == "jsonl":
        atomic_write(path, _jsonl_gz([d.to_record() for d in docs]))
        return
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": [d.id for d in docs],
            "text": [d.text for d in docs],
            "source": [d.source for d in docs],
            "metadata": [json.dumps(d.metadata, ensure_ascii=False) for d in docs],
            "provenance": [json.dumps([r.to_dict() for r in d.provenance]) for d in docs],
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    atomic_write(path, buf.getvalue())


def read_docs(path: str | Path) -> list[CurateDoc]:
    """Documents of one output / work shard (JSONL.gz or Parquet)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path).to_pylist()
        return [
            CurateDoc.from_record(
                {
                    **row,
                    "metadata": json.loads(row["metadata"]),
                    "provenance": json.loads(row["provenance"]),
                }
            )
            for row in table
        ]
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [CurateDoc.from_record(json.loads(line)) for line in fh if line.strip()]


def iter_output(out_dir: str | Path) -> Iterator[CurateDoc]:
    """Kept documents of a finished run, in shard order."""
    data = Path(out_dir) / "data"
    for path in sorted(p for p in data.iterdir() if p.name.startswith("shard_")):
        if path.name.endswith((".jsonl.gz", ".parquet")):
            yield from read_docs(path)


# ---------------------------------------------------------------------------- repeats
EXPAND_STAGE = "expand_repeats"


def repeat_copies(doc: CurateDoc, rounding: str = "stochastic", seed: int = 0) -> int:
    """How many times `doc` is written: `metadata["repeat"]` as is when it is an integer, else
    rounded (`stochastic`: floor(r) + Bernoulli(r - floor(r)) keyed by (seed, id); `round`:
    floor(r + 0.5)); 1 without a `repeat`."""
    rate = doc.metadata.get("repeat", 1)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate >= 0:
        raise ValueError(
            f"document {doc.id!r}: metadata['repeat'] must be a number >= 0, got {rate!r}"
        )
    if isinstance(rate, int) or float(rate).is_integer():
        return int(rate)
    if rounding == "round":
        return math.floor(rate + 0.5)
    return repeat_count(float(rate), doc.id, seed)


def expand_repeats(
    docs: Sequence[CurateDoc],
    *,
    rounding: str = "stochastic",
    seed: int = 0,
    removed: Any = None,
) -> list[CurateDoc]:
    """Each document of `docs` `repeat_copies` times (ids `id#k`, an `expand_repeats`
    provenance record on each copy); documents without a `repeat`, or already expanded, once.
    Documents with 0 copies are passed to `removed` (if given) with a drop record."""
    out: list[CurateDoc] = []
    for doc in docs:
        if "repeat" not in doc.metadata or any(r.stage == EXPAND_STAGE for r in doc.provenance):
            out.append(doc)
            continue
        rate = doc.metadata["repeat"]
        n = repeat_copies(doc, rounding, seed)
        if n == 0:
            doc.provenance.append(
                StageRecord(
                    stage=EXPAND_STAGE,
                    kept=False,
                    reason=f"{EXPAND_STAGE}:zero_copies",
                    scores={"repeat": rate},
                )
            )
            if removed is not None:
                removed(doc)
            continue
        for k in range(n):
            rec = StageRecord(
                stage=EXPAND_STAGE, kept=True, scores={"copy": k, "copies": n, "repeat": rate}
            )
            out.append(
                CurateDoc(
                    id=f"{doc.id}#{k}",
                    text=doc.text,
                    source=doc.source,
                    metadata=dict(doc.metadata),
                    provenance=[*doc.provenance, rec],
                )
            )
    return out


def _digest(obj: Any) -> str:
    payload = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


# ---------------------------------------------------------------------------- segment tasks
@dataclass(kw_only=True)
class SegmentTask:
    """One shard of one segment: everything a worker needs, picklable."""

    shard: int
    segment: int
    key: str
    out_dir: str
    input_shard: InputShard | None  # segment 0
    input_path: str  # segments > 0: the previous segment's work file
    max_doc_chars: int
    global_stage: tuple[int, GlobalStage] | None
    shard_plan: Any
    doc_stages: list[tuple[int, DocStage]]
    next_global: tuple[int, GlobalStage] | None
    last: bool
    output_format: str
    write_removed: bool
    expand: dict[str, Any] | None = None  # last segment: {"rounding", "seed"} or None (off)


def _paths(out_dir: str | Path, shard: int, segment: int, last: bool, fmt: str) -> dict[str, Path]:
    root = Path(out_dir)
    name = f"shard_{shard:05d}"
    if last:
        ext = "jsonl.gz" if fmt == "jsonl" else "parquet"
        return {
            "docs": root / "data" / f"{name}.{ext}",
            "done": root / "data" / f"{name}.json",
            "removed": root / "removed" / f"{name}.seg{segment}.jsonl.gz",
            "partial": root / "_work" / f"seg{segment}" / f"{name}.partial.pkl",
        }
    work = root / "_work" / f"seg{segment}"
    return {
        "docs": work / f"{name}.jsonl.gz",
        "done": work / f"{name}.json",
        "removed": root / "removed" / f"{name}.seg{segment}.jsonl.gz",
        "partial": work / f"{name}.partial.pkl",
    }


def run_segment(task: SegmentTask) -> dict[str, Any]:
    """Run one shard through one segment; writes its files and returns its done-record."""
    t0 = time.perf_counter()
    paths = _paths(task.out_dir, task.shard, task.segment, task.last, task.output_format)
    read_stats = None
    if task.input_shard is not None:
        docs, source_stats = task.input_shard.read(task.max_doc_chars)
        read_stats = source_stats.to_dict()
    else:
        docs = read_docs(task.input_path)
    removed: list[CurateDoc] = []
    stats: dict[int, StageStats] = {}
    stream: Any = iter(docs)
    if task.global_stage is not None:
        index, stage = task.global_stage
        stats[index] = StageStats(stage=stage.name)
        stream = stage.run_apply(stream, task.shard_plan, stats[index], removed.append)
    for index, stage in task.doc_stages:
        stats[index] = StageStats(stage=stage.name)
        stream = stage.run(stream, stats[index], removed.append)
    kept = list(stream)
    unique = (len(kept), sum(len(d.text) for d in kept))
    zero_before = len(removed)
    if task.last and task.expand is not None:
        kept = expand_repeats(kept, **task.expand, removed=removed.append)
    write_docs(paths["docs"], kept, task.output_format if task.last else "jsonl")
    if task.write_removed and removed:
        write_docs(paths["removed"], removed, "jsonl")
    else:  # no stale file from an earlier run with other settings
        paths["removed"].unlink(missing_ok=True)
    observe = None
    if task.next_global is not None:
        t1 = time.perf_counter()
        next_index, next_stage = task.next_global
        next_stage.setup()
        atomic_write(paths["partial"], pickle.dumps(next_stage.observe(kept)))
        observe = {"index": next_index, "seconds": time.perf_counter() - t1}
    record = {
        "key": task.key,
        "shard": task.shard,
        "segment": task.segment,
        "docs_out": len(kept),
        "chars_out": sum(len(d.text) for d in kept),
        "docs_before_expand": unique[0],
        "chars_before_expand": unique[1],
        "zero_copies": len(removed) - zero_before,
        "removed": len(removed),
        "read": read_stats,
        "stages": {str(k): s.to_dict() for k, s in stats.items()},
        "observe": observe,
        "seconds": time.perf_counter() - t0,
    }
    atomic_write(paths["done"], json.dumps(record, indent=1).encode())
    return record


def _finished(task: SegmentTask) -> dict[str, Any] | None:
    paths = _paths(task.out_dir, task.shard, task.segment, task.last, task.output_format)
    try:
        record = json.loads(paths["done"].read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if record.get("key") != task.key or not paths["docs"].is_file():
        return None
    if task.next_global is not None and not paths["partial"].is_file():
        return None
    return record


# ---------------------------------------------------------------------------- the run
@dataclass
class CurateReport:
    """What `run_curate` did (also written as report.json / report.md)."""

    data: dict[str, Any]

    @property
    def docs_out(self) -> int:
        return int(self.data["output"]["docs"])

    @property
    def shards_run(self) -> int:
        return int(self.data["shards"]["run"])

    @property
    def shards_skipped(self) -> int:
        return int(self.data["shards"]["skipped"])

    def stage(self, name: str) -> dict[str, Any]:
        """Statistics of the first stage called `name`."""
        for entry in self.data["stages"]:
            if entry["stage"] == name:
                return entry
        raise KeyError(name)


def _segments(
    stages: list[Stage],
) -> list[tuple[tuple[int, GlobalStage] | None, list[tuple[int, DocStage]]]]:
    segs: list[tuple[tuple[int, GlobalStage] | None, list[tuple[int, DocStage]]]] = [(None, [])]
    for k, stage in enumerate(stages):
        if isinstance(stage, GlobalStage):
            segs.append(((k, stage), []))
        elif isinstance(stage, DocStage):
            segs[-1][1].append((k, stage))
        else:
            raise ValueError(f"stage {stage.name!r} is neither a DocStage nor a GlobalStage")
    return segs


def run_curate(cfg: CurateConfig, executor: Executor | None = None) -> CurateReport:
    """Run the pipeline `cfg` describes; returns (and writes) the report."""
    t_start = time.perf_counter()
    stages = cfg.build_stages()
    for stage in stages:
        stage.setup()  # fail fast on missing models / lists, before any shard runs
    shards = input_shards(cfg)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    own_executor = executor is None
    if executor is None:
        executor = make_executor(
            cfg.executor,
            address=cfg.ray_address,
            num_cpus=cfg.ray_num_cpus,
            num_workers=cfg.num_workers,
            progress=cfg.progress,
        )
    segs = _segments(stages)
    expand = (
        {"rounding": cfg.repeat_rounding, "seed": cfg.repeat_seed} if cfg.expands(stages) else None
    )
    keys = [
        _digest({"v": FORMAT_VERSION, "input": s.fingerprint(), "max": cfg.max_doc_chars})
        for s in shards
    ]
    records: list[list[dict[str, Any]]] = []
    summaries: dict[int, dict[str, Any]] = {}
    run = skipped = 0
    try:
        for j, (glob, doc_stages) in enumerate(segs):
            last = j == len(segs) - 1
            next_global = None if last else segs[j + 1][0]
            plans: list[Any] = [None] * len(shards)
            if glob is not None:
                gidx, gstage = glob
                partial_paths = [
                    _paths(out_dir, s.index, j - 1, False, "jsonl")["partial"] for s in shards
                ]
                partials = [pickle.loads(p.read_bytes()) for p in partial_paths]
                t_plan = time.perf_counter()
                plans = gstage.plan(partials)
                if len(plans) != len(shards):
                    raise RuntimeError(f"{gstage.name}.plan returned {len(plans)} shard plans")
                summaries[gidx] = {
                    **getattr(gstage, "summary", {}),
                    "plan_seconds": round(time.perf_counter() - t_plan, 4),
                }
            tasks, results = [], {}
            for s in shards:
                key = _digest(
                    {
                        "prev": keys[s.index],
                        "global": stage_fingerprint(glob[1]) if glob else None,
                        "plan": _digest(plans[s.index]) if glob else None,
                        "stages": [stage_fingerprint(st) for _, st in doc_stages],
                        "next": stage_fingerprint(next_global[1]) if next_global else None,
                        "out": [
                            cfg.output_format if last else None,
                            cfg.write_removed,
                            expand if last else None,
                        ],
                    }
                )
                keys[s.index] = key
                task = SegmentTask(
                    shard=s.index,
                    segment=j,
                    key=key,
                    out_dir=str(out_dir),
                    input_shard=s if j == 0 else None,
                    input_path=""
                    if j == 0
                    else str(_paths(out_dir, s.index, j - 1, False, "jsonl")["docs"]),
                    max_doc_chars=cfg.max_doc_chars,
                    global_stage=glob,
                    shard_plan=plans[s.index],
                    doc_stages=doc_stages,
                    next_global=next_global,
                    last=last,
                    output_format=cfg.output_format,
                    write_removed=cfg.write_removed,
                    expand=expand if last else None,
                )
                done = _finished(task) if cfg.resume else None
                if done is not None:
                    results[s.index] = done
                    skipped += 1
                else:
                    tasks.append(task)
            for rec in executor.map(run_segment, tasks, desc=f"curate segment {j}"):
                results[rec["shard"]] = rec
            run += len(tasks)
            records.append([results[s.index] for s in shards])
    finally:
        if own_executor:
            executor.close()
    _remove_stale_outputs(out_dir, len(shards), len(segs), cfg.output_format)
    report = _build_report(
        cfg,
        expand is not None,
        stages,
        shards,
        records,
        summaries,
        executor,
        run,
        skipped,
        time.perf_counter() - t_start,
    )
    write_report(out_dir, report)
    return report


def _remove_stale_outputs(out_dir: Path, num_shards: int, num_segments: int, fmt: str) -> None:
    """Delete output shards an earlier run left that this run did not produce (fewer input
    shards, another output format), so `data/` holds exactly this run's documents."""
    last = num_segments - 1
    expected = {
        p.name
        for k in range(num_shards)
        for key, p in _paths(out_dir, k, last, True, fmt).items()
        if key in ("docs", "done")
    }
    for path in (out_dir / "data").glob("shard_*"):
        if path.name not in expected:
            path.unlink()


def _build_report(
    cfg: CurateConfig,
    expanded: bool,
    stages: list[Stage],
    shards: list[InputShard],
    records: list[list[dict[str, Any]]],
    summaries: dict[int, dict[str, Any]],
    executor: Executor,
    run: int,
    skipped: int,
    seconds: float,
) -> CurateReport:
    stage_stats = [StageStats(stage=s.name) for s in stages]
    for seg in records:
        for rec in seg:
            for k, st in rec["stages"].items():
                stage_stats[int(k)].merge(StageStats.from_dict(st))
            if rec.get("observe"):  # a global stage's first pass, run in the segment before it
                stage_stats[rec["observe"]["index"]].seconds += rec["observe"]["seconds"]
    for k, summary in summaries.items():
        stage_stats[k].seconds += summary["plan_seconds"]
    inputs: dict[str, dict[str, Any]] = {}
    for shard, rec in zip(shards, records[0], strict=True):
        entry = inputs.setdefault(
            shard.input_name, {"documents": 0, "chars": 0, "skipped": {}, "examples": []}
        )
        read = rec["read"] or {}
        entry["documents"] += read.get("documents", 0)
        entry["chars"] += read.get("chars", 0)
        for reason, count in read.get("skipped", {}).items():
            entry["skipped"][reason] = entry["skipped"].get(reason, 0) + count
        entry["examples"] = (entry["examples"] + read.get("examples", []))[:10]
    last = records[-1]
    stage_entries = []
    for k, (stage, st) in enumerate(zip(stages, stage_stats, strict=True)):
        entry = {
            "index": k,
            **st.to_dict(),
            "docs_per_second": round(st.docs_per_second, 1) if st.seconds > 0 else None,
            "config": stage.to_dict(),
        }
        if k in summaries:
            entry["summary"] = summaries[k]
        stage_entries.append(entry)
    data = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "config": cfg.to_dict(),
        "executor": executor.describe(),
        "inputs": inputs,
        "read": {
            "documents": sum(e["documents"] for e in inputs.values()),
            "skipped": sum(sum(e["skipped"].values()) for e in inputs.values()),
        },
        "stages": stage_entries,
        "shards": {"total": len(shards), "segments": len(records), "run": run, "skipped": skipped},
        "output": {
            "dir": str(Path(cfg.output_dir) / "data"),
            "format": cfg.output_format,
            "docs": sum(r["docs_out"] for r in last),
            "chars": sum(r["chars_out"] for r in last),
            "removed_dir": str(Path(cfg.output_dir) / "removed") if cfg.write_removed else None,
            "expansion": {
                "enabled": expanded,
                "docs_before": sum(r.get("docs_before_expand", r["docs_out"]) for r in last),
                "chars_before": sum(r.get("chars_before_expand", r["chars_out"]) for r in last),
                "docs_after": sum(r["docs_out"] for r in last),
                "chars_after": sum(r["chars_out"] for r in last),
                "zero_copies": sum(r.get("zero_copies", 0) for r in last),
            },
        },
        "seconds": round(seconds, 3),
    }
    return CurateReport(data)


def write_report(out_dir: Path, report: CurateReport) -> None:
    """report.json (everything) and report.md (tables a person reads)."""
    data = report.data
    atomic_write(out_dir / "report.json", json.dumps(data, indent=1, default=str).encode())
    lines = [
        "# Curation report",
        "",
        f"Executor `{data['executor']['name']}`; {data['shards']['total']} input shards, "
        f"{data['shards']['segments']} segments; shard tasks run {data['shards']['run']}, "
        f"skipped (already done) {data['shards']['skipped']}; {data['seconds']:.1f} s.",
        "",
        "## Inputs",
        "",
        "| input | documents | chars | skipped (reason: count) |",
        "|---|---:|---:|---|",
    ]
    for name, e in data["inputs"].items():
        reasons = ", ".join(f"{r}: {c}" for r, c in sorted(e["skipped"].items())) or "-"
        lines.append(f"| {name} | {e['documents']} | {e['chars']} | {reasons} |")
    lines += [
        "",
        "## Stages",
        "",
        "| # | stage | docs in | docs out | dropped % | chars in | chars out | modified | s "
        "| docs/s | top drop reasons |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for e in data["stages"]:
        pct = 100.0 * (e["docs_in"] - e["docs_out"]) / e["docs_in"] if e["docs_in"] else 0.0
        top = sorted(e["dropped"].items(), key=lambda kv: -kv[1])[:3]
        reasons = ", ".join(f"{r}: {c}" for r, c in top) or "-"
        dps = f"{e['docs_per_second']:.0f}" if e["docs_per_second"] else "-"
        lines.append(
            f"| {e['index']} | {e['stage']} | {e['docs_in']} | {e['docs_out']} | {pct:.1f} | "
            f"{e['chars_in']} | {e['chars_out']} | {e['modified']} | {e['seconds']:.2f} | "
            f"{dps} | {reasons} |"
        )
    summaries = [e for e in data["stages"] if "summary" in e]
    if summaries:
        lines += ["", "## Global stages", ""]
        for e in summaries:
            body = ", ".join(f"{k} {v}" for k, v in e["summary"].items())
            lines.append(f"- `{e['stage']}` (#{e['index']}): {body}")
    out = data["output"]
    lines += [
        "",
        "## Output",
        "",
        f"{out['docs']} documents, {out['chars']} characters in `{out['dir']}` ({out['format']}).",
    ]
    exp = out.get("expansion", {})
    if exp.get("enabled"):
        lines += [
            "",
            f"Repeats expanded: {exp['docs_before']} documents / {exp['chars_before']} characters "
            f"before, {exp['docs_after']} / {exp['chars_after']} after "
            f"({exp['zero_copies']} rounded to 0 copies).",
        ]
    atomic_write(out_dir / "report.md", ("\n".join(lines) + "\n").encode())


# ---------------------------------------------------------------------------- the flow's stage
def _stage_settings(flow: Flow) -> dict[str, Any]:
    data = flow.format_paths(flow.cfg.curate.to_dict())
    data["output_dir"] = str(flow.stage_dir("curate"))
    data["progress"] = flow.progress
    return data


def _stage_run(flow: Flow) -> dict[str, Any]:
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


def _headline(s: dict[str, Any], report: Report) -> str:
    return f"documents kept: {s['output']['docs']:,} ({s['output']['chars']:,} chars)"


# the embedded corpus through the curation chain (filters, exact / MinHash / substring dedup)
STAGE = FlowStage(
    "curate",
    config=CurateConfig,
    settings=_stage_settings,
    run=_stage_run,
    headline=_headline,
)
