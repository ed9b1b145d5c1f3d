"""Benchmark decontamination: a decon-style sampled n-gram index with cluster expansion and
IDF-weighted question/answer scoring, and Tulu-style n-gram overlap for post-training data.

Shape legend: T tokens of a document, P = T - n + 1 n-gram positions.

Text is normalised to lower-cased word tokens (`\\w+`: whitespace, case and punctuation edits
do not hide a copy); every token of the benchmark vocabulary gets an id (others are 0) and every
n-gram a 64-bit polynomial hash, computed for a whole document at once with numpy.

`SampledNgramDetector` (Olmo 3 §4.4, allenai/decon "SIMPLE" mode; defaults from decon's
`config/default.yaml`):
  1. index: the `ngram_size`-grams (5) of every benchmark question -> the items containing them;
     IDF(g) = 1 + log(items / items containing g), so n-grams shared by many items
     (boilerplate, `from typing import list`) count little (and never nothing);
  2. detection: look up the n-gram at every `sample_every`-th (10) position of a document;
  3. cluster expansion: on a hit, for each candidate item walk left and right over consecutive
     positions while the item's n-grams keep matching, tolerating up to `max_consecutive_misses`
     (11) misses in a row; the matched region is the cluster;
  4. scoring: question score = IDF mass of the item's n-grams found in the cluster / the item's
     total IDF mass; answer score = the same over the item's answer `answer_ngram_size`-grams (3)
     found within max(2 x answer length, 20) tokens around the cluster (the answer is evidence
     for edited or short questions: DROP fix of Olmo 3 §4.4); combined = max(q, (1 - w) q + w a)
     with w = `answer_weight`;
  5. threshold: `question_threshold` (0.815) for questions of >= 50 tokens; a perfect match for
     questions of <= 25 tokens; linear in between. Items with fewer than `min_item_tokens`
     tokens are not indexed (decon: 20; reported as skipped).

`NgramOverlapDetector` (Olmo 3 §7.1, Tulu 3's decontamination for SFT/DPO/RL data): a training
example is contaminated by a benchmark item when at least `threshold` (0.5) of the item's
`ngram_size`-grams (8) appear in it; n-grams made mostly of 1-character tokens (math symbols,
digits) are ignored (the Olmo 3 heuristic against false positives).

`CodeEmbeddingDetector` (`embed.py`; Olmo 3 §4.4/§7.1: embedding similarity > 0.8 for code):
documents are cut into functions and flagged when a function's embedding has cosine >= 0.8
against a HumanEval function (hashed code n-gram TF-IDF, or all-MiniLM-L6-v2 through
sentence-transformers, the `[embed]` extra).

The benchmark items come from `benchmarks.BenchmarkRegistry` (GSM8K, HumanEval, any JSON Lines
benchmark); `DeconReport` counts per benchmark, with examples.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .benchmarks import BenchmarkRegistry, EvalItem, Match
from .core import CurateDoc, Decision, Filter, register_stage
from .embed import MINILM_MODEL, CodeEmbeddingDetector, EmbedDeconConfig

_TOKEN_RE = re.compile(r"\w+", re.UNICODE)
_P = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the polynomial n-gram hash


def tokens(text: str) -> list[str]:
    """Lower-cased word tokens: the unit of every n-gram here."""
    return _TOKEN_RE.findall(text.lower())


# ---------------------------------------------------------------------------- hashing
class _Vocab:
    """Token -> id (1..V); unknown tokens are 0 and never occur in an indexed n-gram."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def add(self, toks: Sequence[str]) -> np.ndarray:
        return np.array([self.ids.setdefault(t, len(self.ids) + 1) for t in toks], np.uint64)

    def lookup(self, toks: Sequence[str]) -> np.ndarray:
        get = self.ids.get
        return np.array([get(t, 0) for t in toks], np.uint64)


def ngram_hashes(ids_T: np.ndarray, n: int) -> np.ndarray:
    """64-bit hashes [P] of the n-grams of `ids_T`: sum_j ids[i + j] * P^(j + 1) mod 2^64. An
    n-gram that contains id 0 (unknown token) hashes to 0."""
    if len(ids_T) < n:
        return np.zeros(0, np.uint64)
    with np.errstate(over="ignore"):
        h_P = np.zeros(len(ids_T) - n + 1, np.uint64)
        known_P = np.ones(len(h_P), bool)
        power = np.uint64(1)
        for j in range(n):
            power = power * _P
            window = ids_T[j : j + len(h_P)]
            h_P = h_P + window * power
            known_P &= window != 0
    return np.where(known_P, h_P, np.uint64(0))


# ---------------------------------------------------------------------------- sampled index
@dataclass(kw_only=True)
class SimpleConfig:
    """decon "SIMPLE" options (see the module docstring for where each default comes from)."""

    ngram_size: int = 5
    sample_every: int = 10
    max_consecutive_misses: int = 11
    question_threshold: float = 0.815
    perfect_below: int = 25  # questions this short need a perfect match ...
    interpolate_until: int = 50  # ... relaxed linearly to question_threshold at this length
    answer_ngram_size: int = 3
    answer_weight: float = 0.3
    min_item_tokens: int = 20

    def __post_init__(self) -> None:
        for name in ("ngram_size", "sample_every", "answer_ngram_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"decon.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_consecutive_misses < 0:
            raise ValueError("decon.max_consecutive_misses must be >= 0")
        if not 0 < self.question_threshold <= 1 or not 0 <= self.answer_weight <= 1:
            raise ValueError("decon.question_threshold must be in (0, 1], answer_weight in [0, 1]")
        if self.interpolate_until < self.perfect_below:
            raise ValueError("decon.interpolate_until must be >= perfect_below")
        if self.min_item_tokens < self.ngram_size:
            raise ValueError("decon.min_item_tokens must be >= ngram_size")

    def threshold(self, question_tokens: int) -> float:
        """Question-length dependent threshold: 1 up to `perfect_below` tokens, linear down to
        `question_threshold` at `interpolate_until`."""
        if question_tokens <= self.perfect_below:
            return 1.0
        if question_tokens >= self.interpolate_until:
            return self.question_threshold
        frac = (question_tokens - self.perfect_below) / (
            self.interpolate_until - self.perfect_below
        )
        return 1.0 + frac * (self.question_threshold - 1.0)


class _Side:
    """IDF-weighted n-gram sets of one side (questions or answers) of all items."""

    def __init__(self, grams: list[np.ndarray]) -> None:
        df: dict[int, int] = {}
        uniq = [np.unique(g[g != 0]) for g in grams]
        for g in uniq:
            for h in g.tolist():
                df[h] = df.get(h, 0) + 1
        n_items = max(1, sum(1 for g in uniq if len(g)))
        self.idf = {h: math.log(n_items / c) + 1.0 for h, c in df.items()}  # smoothed, > 0
        self.sets: list[dict[int, float]] = [{h: self.idf[h] for h in g.tolist()} for g in uniq]
        self.mass = [sum(s.values()) for s in self.sets]
        self.index: dict[int, list[int]] = {}
        for k, g in enumerate(uniq):
            for h in g.tolist():
                self.index.setdefault(h, []).append(k)

    def score(self, item: int, found: Iterable[int]) -> float:
        s = self.sets[item]
        if not self.mass[item]:
            return 0.0
        return sum(s[h] for h in set(found) if h in s) / self.mass[item]


class SampledNgramDetector:
    """Sampled n-gram lookup + cluster expansion + IDF question/answer scoring (decon SIMPLE)."""

    def __init__(self, registry: BenchmarkRegistry, cfg: SimpleConfig | None = None) -> None:
        self.cfg = cfg = cfg or SimpleConfig()
        self.vocab = _Vocab()
        self.items: list[EvalItem] = []
        self.skipped: dict[str, int] = {}
        q_grams, a_grams, self.q_len, self.a_len = [], [], [], []
        self._a_ids: list[np.ndarray] = []
        for item in registry.items:
            q = tokens(item.question)
            if len(q) < cfg.min_item_tokens:
                self.skipped[item.benchmark] = self.skipped.get(item.benchmark, 0) + 1
                continue
            self.items.append(item)
            q_grams.append(ngram_hashes(self.vocab.add(q), cfg.ngram_size))
            a_ids = self.vocab.add(tokens(item.answer))
            self._a_ids.append(a_ids)
            a_grams.append(ngram_hashes(a_ids, cfg.answer_ngram_size))
            self.q_len.append(len(q))
            self.a_len.append(len(a_ids))
        if not self.items:
            raise ValueError("no benchmark item is long enough to index (min_item_tokens)")
        self.q = _Side(q_grams)
        self.a = _Side(a_grams)

    def _answer_score(self, item: int, ids_T: np.ndarray, start: int, end: int) -> float:
        a_len = self.a_len[item]
        if a_len == 0:
            return 0.0
        window = max(2 * a_len, 20)
        seg = ids_T[max(0, start - window) : end + window]
        if a_len < self.cfg.answer_ngram_size:  # a short answer: an exact token run
            a = self._a_ids[item]
            hits = any(np.array_equal(seg[i : i + a_len], a) for i in range(len(seg) - a_len + 1))
            return float(hits)
        return self.a.score(item, ngram_hashes(seg, self.cfg.answer_ngram_size).tolist())

    def _expand(self, item: int, h_P: np.ndarray, pos: int) -> tuple[int, int, set[int]]:
        """Walk left and right from a hit at `pos` over the item's n-grams; returns the first
        and last matching positions and the matched hashes."""
        grams = self.q.sets[item]
        found = {int(h_P[pos])}
        lo = hi = pos
        for step in (-1, 1):
            misses, p = 0, pos + step
            while 0 <= p < len(h_P) and misses <= self.cfg.max_consecutive_misses:
                h = int(h_P[p])
                if h in grams:
                    found.add(h)
                    misses = 0
                    lo, hi = min(lo, p), max(hi, p)
                else:
                    misses += 1
                p += step
        return lo, hi, found

    def detect(self, text: str) -> list[Match]:
        """The benchmark items contaminating `text`: the best cluster of each item whose score
        passes the item's threshold."""
        best: dict[str, Match] = {}
        for m in self.detect_all(text):
            key = f"{m.benchmark}\x00{m.item_id}"
            if key not in best or m.score > best[key].score:
                best[key] = m
        return [m for m in best.values() if m.score >= m.threshold - 1e-12]

    def detect_all(self, text: str) -> list[Match]:
        """Every (cluster, candidate item) scored, whatever the score, in document order."""
        cfg = self.cfg
        ids_T = self.vocab.lookup(tokens(text))
        h_P = ngram_hashes(ids_T, cfg.ngram_size)
        out: list[Match] = []
        pos = 0
        while pos < len(h_P):
            candidates = self.q.index.get(int(h_P[pos]), ()) if h_P[pos] else ()
            next_pos = pos + cfg.sample_every
            for item in candidates:
                lo, hi, found = self._expand(item, h_P, pos)
                q_score = self.q.score(item, found)
                end = hi + cfg.ngram_size
                a_score = self._answer_score(item, ids_T, lo, end)
                w = cfg.answer_weight
                score = max(q_score, (1 - w) * q_score + w * a_score)
                th = cfg.threshold(self.q_len[item])
                it = self.items[item]
                out.append(Match(it.benchmark, it.id, q_score, a_score, score, th, (lo, end)))
                next_pos = max(next_pos, hi + 1)  # continue sampling after the cluster
            pos = next_pos
        return out


# ---------------------------------------------------------------------------- n-gram overlap
@dataclass(kw_only=True)
class OverlapConfig:
    """Tulu 3 / Olmo 3 §7.1: 8-grams, contaminated at >= 50% of a test item's n-grams;
    n-grams with more than `max_short_token_share` 1-character tokens are ignored."""

    ngram_size: int = 8
    threshold: float = 0.5
    max_short_token_share: float = 0.5
    field: Literal["question", "both"] = "question"

    def __post_init__(self) -> None:
        if self.ngram_size < 1 or not 0 < self.threshold <= 1:
            raise ValueError("overlap.ngram_size must be >= 1 and threshold in (0, 1]")


class NgramOverlapDetector:
    """For post-training examples: the share of each benchmark item's n-grams found in the
    example (an inverted index from n-gram to items)."""

    def __init__(self, registry: BenchmarkRegistry, cfg: OverlapConfig | None = None) -> None:
        self.cfg = cfg = cfg or OverlapConfig()
        self.vocab = _Vocab()
        self.items: list[EvalItem] = []
        self.index: dict[int, list[int]] = {}
        self.counts: list[int] = []
        self.skipped: dict[str, int] = {}
        for item in registry.items:
            text = item.question + ("\n" + item.answer if cfg.field == "both" else "")
            grams = self._grams(tokens(text), add=True)
            if not grams:
                self.skipped[item.benchmark] = self.skipped.get(item.benchmark, 0) + 1
                continue
            k = len(self.items)
            self.items.append(item)
            self.counts.append(len(grams))
            for h in grams:
                self.index.setdefault(h, []).append(k)

    def _grams(self, toks: list[str], *, add: bool = False) -> set[int]:
        n = self.cfg.ngram_size
        ids = self.vocab.add(toks) if add else self.vocab.lookup(toks)
        h_P = ngram_hashes(ids, n)
        if not len(h_P):
            return set()
        short_T = np.array([len(t) == 1 for t in toks], np.int64)
        short_P = np.convolve(short_T, np.ones(n, np.int64), mode="valid")
        keep_P = (short_P <= self.cfg.max_short_token_share * n) & (h_P != 0)
        return set(h_P[keep_P].tolist())

    def overlaps(self, text: str) -> dict[int, float]:
        """Item index -> share of its n-grams present in `text` (items with any overlap)."""
        hits: dict[int, int] = {}
        for h in self._grams(tokens(text)):
            for k in self.index.get(h, ()):
                hits[k] = hits.get(k, 0) + 1
        return {k: c / self.counts[k] for k, c in hits.items()}

    def detect(self, text: str) -> list[Match]:
        out = []
        for k, share in self.overlaps(text).items():
            if share >= self.cfg.threshold:
                it = self.items[k]
                out.append(
                    Match(it.benchmark, it.id, share, 0.0, share, self.cfg.threshold, (0, 0))
                )
        return out


# ---------------------------------------------------------------------------- report
@dataclass(kw_only=True)
class DeconReport:
    """Per-benchmark counts: documents flagged, distinct items matched, examples."""

    documents: int = 0
    contaminated: int = 0
    per_benchmark: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_examples: int = 5

    def add(self, doc_id: str, text: str, matches: Sequence[Match]) -> None:
        self.documents += 1
        if matches:
            self.contaminated += 1
        for bench in sorted({m.benchmark for m in matches}):
            row = self.per_benchmark.setdefault(
                bench, {"documents": 0, "items": set(), "examples": []}
            )
            row["documents"] += 1
            ms = [m for m in matches if m.benchmark == bench]
            row["items"].update(m.item_id for m in ms)
            if len(row["examples"]) < self.max_examples:
                top = max(ms, key=lambda m: m.score)
                row["examples"].append(
                    {"doc": doc_id, **top.to_dict(), "snippet": text[:160].replace("\n", " ")}
                )

    def to_dict(self) -> dict[str, Any]:
        return {
            "documents": self.documents,
            "contaminated": self.contaminated,
            "per_benchmark": {
                b: {**r, "items": len(r["items"])} for b, r in sorted(self.per_benchmark.items())
            },
        }

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def decontaminate(docs: Iterable[tuple[str, str]], detector: Any) -> tuple[list[str], DeconReport]:
    """Ids of the clean documents among (id, text) pairs, and the report. `detector`: any
    object with `detect(text) -> list[Match]` (the n-gram detectors, `CodeEmbeddingDetector`)."""
    report, clean = DeconReport(), []
    for doc_id, text in docs:
        matches = detector.detect(text)
        report.add(doc_id, text, matches)
        if not matches:
            clean.append(doc_id)
    return clean, report


# ---------------------------------------------------------------------------- edits
EDITS = ("verbatim", "format", "word_swap", "number", "two_edits")
_NUM_RE = re.compile(r"\d+")


def edit_text(text: str, kind: str, rng: random.Random) -> str:
    """A paraphrase-like edit of a benchmark item, to measure detection recall: `verbatim`;
    `format` (case flips, whitespace changes); `word_swap` (two adjacent words exchanged);
    `number` (one number changed; a word swap when there is none); `two_edits` (a swap and a
    number change)."""
    if kind == "verbatim":
        return text
    if kind == "format":
        words = text.split()
        out = [w.upper() if rng.random() < 0.3 else w.lower() for w in words]
        return rng.choice(["  ", "\n", " \t "]).join(out)
    if kind == "word_swap":
        words = text.split(" ")
        if len(words) < 2:
            return text
        i = rng.randrange(len(words) - 1)
        words[i], words[i + 1] = words[i + 1], words[i]
        return " ".join(words)
    if kind == "number":
        nums = list(_NUM_RE.finditer(text))
        if not nums:
            return edit_text(text, "word_swap", rng)
        m = rng.choice(nums)
        new = str(int(m.group()) + rng.randint(1, 9))
        return text[: m.start()] + new + text[m.end() :]
    if kind == "two_edits":
        return edit_text(edit_text(text, "word_swap", rng), "number", rng)
    raise ValueError(f"unknown edit {kind!r}; known: {EDITS}")


# ---------------------------------------------------------------------------- stage
_DETECTORS: dict[str, Any] = {}


@register_stage("decontaminate")
@dataclass(kw_only=True)
class DecontaminateStage(Filter):
    """Drop documents that contain a benchmark item (reason `decontaminate:<benchmark>`).
    `data_dir`: a folder with GSM8K / HumanEval (see `BenchmarkRegistry.from_data_dir`);
    `benchmarks`: extra JSON Lines benchmarks as {name, path, question_field, answer_field,
    id_field}; with neither, the packaged GSM8K (train + test) and HumanEval; `method`:
    "simple" (decon, pretraining/midtraining text), "overlap" (8-gram overlap, post-training
    examples) or "embedding" (code: a function whose embedding has cosine >=
    `embedding_threshold` against a benchmark function, see `embed.py`; options
    `embedding_backend` hashed | minilm, `embedding_model` (minilm's sentence-transformers model: a
    Hub id in the local cache or a directory), `embedding_normalize`, `embedding_min_tokens`, and
    `code_benchmarks`, the registry's benchmarks used as references)."""

    data_dir: str = ""
    benchmarks: list[dict[str, str]] = field(default_factory=list)
    method: Literal["simple", "overlap", "embedding"] = "simple"
    embedding_backend: Literal["hashed", "minilm"] = "hashed"
    embedding_model: str = MINILM_MODEL
    embedding_threshold: float = 0.8
    embedding_normalize: Literal["none", "format", "canonical"] = "canonical"
    embedding_min_tokens: int = 24
    code_benchmarks: list[str] = field(default_factory=lambda: ["humaneval"])

    def _key(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def setup(self) -> None:
        key = self._key()
        if key in _DETECTORS:
            return
        reg = BenchmarkRegistry.build(self.data_dir, self.benchmarks)
        if not reg.items:
            raise ValueError("decontaminate: give data_dir or at least one benchmark file")
        if self.method == "simple":
            _DETECTORS[key] = SampledNgramDetector(reg)
        elif self.method == "overlap":
            _DETECTORS[key] = NgramOverlapDetector(reg)
        elif self.method == "embedding":
            cfg = EmbedDeconConfig(
                backend=self.embedding_backend,
                threshold=self.embedding_threshold,
                normalize=self.embedding_normalize,
                min_tokens=self.embedding_min_tokens,
                benchmarks=tuple(self.code_benchmarks),
                model=self.embedding_model,
            )
            _DETECTORS[key] = CodeEmbeddingDetector(reg, cfg)
        else:
            raise ValueError(
                f"decontaminate.method must be simple, overlap or embedding, got {self.method!r}"
            )

    def check(self, doc: CurateDoc) -> Decision:
        self.setup()
        matches = _DETECTORS[self._key()].detect(doc.text)
        if not matches:
            return Decision.ok()
        top = max(matches, key=lambda m: m.score)
        return Decision.drop(
            f"{self.name}:{top.benchmark}",
            item=top.item_id,
            score=round(top.score, 4),
            matches=len(matches),
        )
