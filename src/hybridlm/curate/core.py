"""Curation core: documents with provenance, typed stages, per-stage statistics, a registry.

A curation pipeline is a list of stages applied to a stream of `CurateDoc`s:

    CurateDoc      id, text, source, metadata (dict), provenance: one `StageRecord` per stage that
                   looked at the document ({stage, kept, reason, scores}); `CurateDoc.from_document`
                   converts a `hybridlm.data.sources.Document`, `to_record`/`from_record` are the
                   JSON form written to output shards.
    Decision       what a stage says about one document: keep (bool), reason (str, "" when kept),
                   scores (dict of floats/ints/strs kept in provenance).

Two kinds of stages:

    DocStage       per-document, shard-local, stateless between documents. Subclasses implement
                   `process(doc) -> Decision`; they may rewrite `doc.text` / `doc.metadata` in
                   place (extraction, normalisation). Two conveniences:
        Filter     `check(doc) -> Decision` and never edits the text (heuristic rules, language ID).
        Mapper     `map_text(text) -> str`; a document whose text becomes empty is dropped with
                   reason "<stage>:empty".
    GlobalStage    needs the whole (sharded) corpus, e.g. dedup. Three steps, each run by the
                   executor (in-process or on Ray):
                   1. `observe(docs) -> partial`  per input shard, in parallel (signatures, hashes);
                      the partial must be picklable;
                   2. `plan(partials) -> [shard_plan, ...]`  once, on the driver, over the partials
                      of all shards *in shard order* (union-find, suffix array, keep policy);
                   3. `apply(doc, position, shard_plan) -> Decision`  per document, in parallel;
                      `position` is the document's index within its shard at observe time.
                   Everything is deterministic: plans depend on shard order and positions only.

The framework (`DocStage.run`, `GlobalStage.run_apply`) appends the provenance record, counts
`StageStats` (docs in/out, chars in/out, drop reasons, seconds) and drops rejected documents.
Stages are dataclass configs: `Stage.to_dict()` gives `{"stage": name, **fields}` and
`build_stage({"stage": "gopher_quality", "min_words": 50})` builds one through the registry
(`@register_stage("name")`; `load_stage_modules()` imports every stage module of this package),
so YAML configs name stages. `stage_fingerprint` hashes a stage's class and fields; shard resume
keys are built from it. `run_in_memory(stages, shards)` runs a stage list over in-memory shards
without files (tests, notebooks); `pipeline.run_curate` is the sharded, resumable runner.

Writing a stage:

    @register_stage("min_lines")
    @dataclass(kw_only=True)
    class MinLines(Filter):
        min_lines: int = 3
        def check(self, doc: CurateDoc) -> Decision:
            n = doc.text.count("\n") + 1
            if n < self.min_lines:
                return Decision.drop("min_lines", lines=n)
            return Decision.ok(lines=n)
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from ..data.sources import Document

Score = float | int | str | bool


# ---------------------------------------------------------------------------- documents
@dataclass(kw_only=True)
class StageRecord:
    """One stage's decision about one document (provenance entry)."""

    stage: str
    kept: bool
    reason: str = ""
    scores: dict[str, Score] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": self.stage, "kept": self.kept}
        if self.reason:
            out["reason"] = self.reason
        if self.scores:
            out["scores"] = dict(self.scores)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageRecord:
        return cls(
            stage=str(data["stage"]),
            kept=bool(data["kept"]),
            reason=str(data.get("reason", "")),
            scores=dict(data.get("scores", {})),
        )


@dataclass(kw_only=True)
class CurateDoc:
    """A document moving through the pipeline. Mutable: stages may rewrite `text`."""

    id: str
    text: str
    source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    provenance: list[StageRecord] = field(default_factory=list)

    @classmethod
    def from_document(cls, doc: Document) -> CurateDoc:
        return cls(id=doc.id, text=doc.text, source=doc.source, metadata=dict(doc.metadata))

    def to_document(self) -> Document:
        return Document(self.id, self.text, self.source, dict(self.metadata))

    def to_record(self) -> dict[str, Any]:
        """JSON-able form written to output shards (`text` and `id` at top level, so a
        `jsonl` source of `hybridlm.data` reads the shards directly)."""
        return {
            "id": self.id,
            "text": self.text,
            "source": self.source,
            "metadata": self.metadata,
            "provenance": [r.to_dict() for r in self.provenance],
        }

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> CurateDoc:
        return cls(
            id=str(data["id"]),
            text=str(data["text"]),
            source=str(data.get("source", "")),
            metadata=dict(data.get("metadata") or {}),
            provenance=[StageRecord.from_dict(r) for r in data.get("provenance") or []],
        )

    @property
    def drop_record(self) -> StageRecord | None:
        """The record of the stage that removed this document, if any."""
        for rec in reversed(self.provenance):
            if not rec.kept:
                return rec
        return None


@dataclass(frozen=True)
class Decision:
    """A stage's verdict on one document."""

    keep: bool = True
    reason: str = ""
    scores: Mapping[str, Score] = field(default_factory=dict)

    @staticmethod
    def ok(**scores: Score) -> Decision:
        return Decision(True, "", scores)

    @staticmethod
    def drop(reason: str, **scores: Score) -> Decision:
        if not reason:
            raise ValueError("a dropped document needs a reason")
        return Decision(False, reason, scores)


# ---------------------------------------------------------------------------- statistics
@dataclass(kw_only=True)
class StageStats:
    """Counts of one stage over one or more shards (`merge` adds them up)."""

    stage: str
    docs_in: int = 0
    docs_out: int = 0
    chars_in: int = 0
    chars_out: int = 0
    modified: int = 0  # documents whose text the stage changed and kept
    dropped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def docs_dropped(self) -> int:
        return self.docs_in - self.docs_out

    @property
    def docs_per_second(self) -> float:
        return self.docs_in / self.seconds if self.seconds > 0 else float("inf")

    def merge(self, other: StageStats) -> StageStats:
        if other.stage != self.stage:
            raise ValueError(f"cannot merge stats of {other.stage!r} into {self.stage!r}")
        self.docs_in += other.docs_in
        self.docs_out += other.docs_out
        self.chars_in += other.chars_in
        self.chars_out += other.chars_out
        self.modified += other.modified
        self.seconds += other.seconds
        for reason, count in other.dropped.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + count
        return self

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["dropped"] = dict(sorted(self.dropped.items()))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageStats:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# ---------------------------------------------------------------------------- stages
class Stage:
    """Base of every stage. Subclasses are kw-only dataclasses registered by name; the
    dataclass fields are the stage's configuration (and its YAML keys)."""

    name: ClassVar[str] = "stage"

    def setup(self) -> None:
        """Load heavy resources (models, lists) lazily, once per process. Idempotent."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": self.name}
        if dataclasses.is_dataclass(self):
            for f in dataclasses.fields(self):
                if f.init and not f.name.startswith("_"):
                    out[f.name] = _plain(getattr(self, f.name))
        return out

    def _record(self, doc: CurateDoc, decision: Decision) -> None:
        doc.provenance.append(
            StageRecord(
                stage=self.name,
                kept=decision.keep,
                reason=decision.reason,
                scores=dict(decision.scores),
            )
        )


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _account(stats: StageStats, doc: CurateDoc, decision: Decision, before: str) -> None:
    if decision.keep:
        stats.docs_out += 1
        stats.chars_out += len(doc.text)
        if doc.text != before:
            stats.modified += 1
    else:
        stats.dropped[decision.reason] = stats.dropped.get(decision.reason, 0) + 1


class DocStage(Stage):
    """A per-document stage. `process` returns a Decision and may edit the document."""

    def process(self, doc: CurateDoc) -> Decision:
        raise NotImplementedError

    def run(
        self,
        docs: Iterable[CurateDoc],
        stats: StageStats,
        removed: Callable[[CurateDoc], None] | None = None,
    ) -> Iterator[CurateDoc]:
        """Stream `docs` through the stage, recording provenance and counting into `stats`.
        Rejected documents go to `removed` (if given) with their provenance."""
        self.setup()
        for doc in docs:
            t0 = time.perf_counter()
            before = doc.text
            stats.docs_in += 1
            stats.chars_in += len(before)
            decision = self.process(doc)
            if decision.keep and not doc.text:
                decision = Decision.drop(f"{self.name}:empty")
            self._record(doc, decision)
            _account(stats, doc, decision, before)
            stats.seconds += time.perf_counter() - t0
            if decision.keep:
                yield doc
            elif removed is not None:
                removed(doc)


class Filter(DocStage):
    """A per-document keep/drop rule: implement `check(doc) -> Decision`; text is not edited."""

    def check(self, doc: CurateDoc) -> Decision:
        raise NotImplementedError

    def process(self, doc: CurateDoc) -> Decision:
        return self.check(doc)


class Mapper(DocStage):
    """A per-document text rewrite: implement `map_text(text) -> str`."""

    def map_text(self, text: str) -> str:
        raise NotImplementedError

    def process(self, doc: CurateDoc) -> Decision:
        doc.text = self.map_text(doc.text)
        return Decision.ok() if doc.text else Decision.drop(f"{self.name}:empty")


class GlobalStage(Stage):
    """A stage that needs a pass over the whole corpus (see the module docstring)."""

    def observe(self, docs: Sequence[CurateDoc]) -> Any:
        raise NotImplementedError

    def plan(self, partials: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def apply(self, doc: CurateDoc, position: int, shard_plan: Any) -> Decision:
        raise NotImplementedError

    def run_apply(
        self,
        docs: Iterable[CurateDoc],
        shard_plan: Any,
        stats: StageStats,
        removed: Callable[[CurateDoc], None] | None = None,
    ) -> Iterator[CurateDoc]:
        """Second pass over one shard: `apply` with provenance and statistics."""
        self.setup()
        for position, doc in enumerate(docs):
            t0 = time.perf_counter()
            before = doc.text
            stats.docs_in += 1
            stats.chars_in += len(before)
            decision = self.apply(doc, position, shard_plan)
            if decision.keep and not doc.text:
                decision = Decision.drop(f"{self.name}:empty")
            self._record(doc, decision)
            _account(stats, doc, decision, before)
            stats.seconds += time.perf_counter() - t0
            if decision.keep:
                yield doc
            elif removed is not None:
                removed(doc)


# ---------------------------------------------------------------------------- registry
STAGES: dict[str, type[Stage]] = {}
S = TypeVar("S", bound=type[Stage])


def register_stage(name: str) -> Callable[[S], S]:
    """Class decorator: make a stage buildable from `{"stage": name, ...}`."""

    def deco(cls: S) -> S:
        if name in STAGES and STAGES[name] is not cls:
            raise ValueError(f"stage name {name!r} is already registered by {STAGES[name]}")
        cls.name = name
        STAGES[name] = cls
        return cls

    return deco


_STAGE_MODULES = (
    (".extract", ".filters", ".langid", ".dedup"),  # extraction, heuristics, dedup
    # classifiers, up-sampling, decontamination, mixing, FIM
    (".quality", ".upsample", ".decon", ".mixing", ".fim"),
)


def load_stage_modules(all_groups: bool = True) -> None:
    """Import the modules that register stages: the first group always, the second when
    `all_groups`."""
    package = __name__.rsplit(".", 1)[0]
    for group in _STAGE_MODULES if all_groups else _STAGE_MODULES[:1]:
        for mod in group:
            importlib.import_module(mod, package)


def build_stage(spec: Mapping[str, Any] | Stage) -> Stage:
    """A stage from its config mapping `{"stage": name, **fields}` (or a built stage)."""
    if isinstance(spec, Stage):
        return spec
    load_stage_modules(all_groups=False)
    if not isinstance(spec, Mapping) or "stage" not in spec:
        load_stage_modules()
        raise ValueError(f"a stage config needs a 'stage' key naming one of {sorted(STAGES)}")
    name = spec["stage"]
    if name not in STAGES:
        load_stage_modules()
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; known stages: {sorted(STAGES)}")
    cls = STAGES[name]
    kwargs = {k: v for k, v in spec.items() if k != "stage"}
    allowed = (
        {f.name for f in dataclasses.fields(cls) if f.init}
        if dataclasses.is_dataclass(cls)
        else set()
    )
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(f"stage {name!r}: unknown options {unknown}; allowed: {sorted(allowed)}")
    for f in dataclasses.fields(cls):  # YAML lists -> tuples where the field is a tuple
        if f.name in kwargs and isinstance(kwargs[f.name], list) and "tuple" in str(f.type):
            kwargs[f.name] = tuple(tuple(v) if isinstance(v, list) else v for v in kwargs[f.name])
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"stage {name!r}: {err}") from err


def stage_fingerprint(stage: Stage) -> str:
    """Hash of the stage's class and configuration (resume keys)."""
    payload = json.dumps(
        {"cls": f"{type(stage).__module__}.{type(stage).__qualname__}", **stage.to_dict()},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def run_in_memory(
    stages: Sequence[Stage], shards: Sequence[Sequence[CurateDoc]]
) -> tuple[list[list[CurateDoc]], list[StageStats], list[CurateDoc]]:
    """Run `stages` over in-memory shards without files (tests, notebooks): per-document stages
    stream each shard, a global stage observes every shard, plans once and applies. Returns the
    kept shards, per-stage statistics and the removed documents (with provenance)."""
    current = [list(s) for s in shards]
    all_stats: list[StageStats] = []
    removed: list[CurateDoc] = []
    for stage in stages:
        stats = StageStats(stage=stage.name)
        stage.setup()
        if isinstance(stage, GlobalStage):
            t0 = time.perf_counter()
            plans = stage.plan([stage.observe(docs) for docs in current])
            stats.seconds += time.perf_counter() - t0
            current = [
                list(stage.run_apply(docs, plan, stats, removed.append))
                for docs, plan in zip(current, plans, strict=True)
            ]
        elif isinstance(stage, DocStage):
            current = [list(stage.run(docs, stats, removed.append)) for docs in current]
        else:
            raise TypeError(f"{type(stage).__name__} is neither a DocStage nor a GlobalStage")
        all_stats.append(stats)
    return current, all_stats, removed
