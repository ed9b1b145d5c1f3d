"""Deterministic global deduplication stages: exact, MinHash LSH, suffix-array substrings.

All three are `GlobalStage`s: `observe` runs per shard (in parallel), `plan` once over all shards
in shard order, `apply` per document. Results depend only on the documents and their order.

exact_dedup     blake2b-128 of the normalised text (NFC, whitespace runs -> one space, optional
                lowercasing). Olmo 3 removed 67% of web documents this way (notes §2.2). One
                document per hash group is kept: `keep="first"` (corpus order) or `"newest"`
                (largest `metadata[date_field]`, ties -> first).
minhash_dedup   MinHash LSH (Broder 1997; Leskovec et al., MMDS ch. 3) with the Olmo 3 cluster rule
                (notes §2.2): LSH collisions give candidate clusters (union-find); *inside each
                candidate cluster every pair's Jaccard similarity is computed exactly* from the
                shingle sets; a second union-find over the verified pairs (J >= jaccard_threshold)
                gives the duplicate clusters; one document per cluster is kept (keep-newest, as
                Olmo 3 keeps the most recently crawled, or keep-first).
                Shingles: word 5-grams of the lowercased text with punctuation removed (FineWeb
                and Duplodocus use 5-grams). Defaults 20 bands x 5 rows = 100 hashes (Duplodocus'
                CLI defaults, the tool Olmo 3 used); the LSH S-curve P(candidate | J=s) =
                1 - (1 - s^5)^20 is 0.5 at s ~ 0.55 (approx. (1/20)^(1/5) = 0.549), 0.9956 at
                s = 0.75 and 0.047 at s = 0.3. The low candidate threshold is affordable because
                candidates are verified exactly; `jaccard_threshold` = 0.75 is FineWeb's target
                similarity (notes §2.3). `lsh_candidate_probability` / `lsh_threshold` compute
                the curve for other settings (FineWeb: 14 x 8 -> 0.72).
                The MinHash is our own numpy code rather than datasketch's: it hashes all
                shingles of a document at once (vectorised multiply-add-shift hashing on uint64,
                h_k(x) = ((a_k x + b_k) mod 2^64) >> 32 with odd a_k, Dietzfelbinger et al. 1997),
                shingle ids come from blake2b word hashes (Python's `hash` is salted per process,
                so it would break determinism across Ray workers), and the exact Jaccard check
                needs the shingle sets anyway, which datasketch does not keep.
substring_dedup Fuzzy suffix-array substring dedup (Olmo 3 notes §2.2, after Lee et al. 2022):
                every byte range of >= `min_bytes` (500, SPEC §4) that also occurs *earlier* in the
                corpus is marked, so one occurrence of each repeat is kept (unlike Lee et al.,
                who remove every copy). Suffixes of the concatenated corpus (UTF-8 bytes, each
                document followed by a unique separator symbol so no match crosses documents) are
                ranked by their first `min_bytes` bytes with numpy prefix doubling (the first
                ceil(log2 min_bytes) rounds of Manber & Myers' suffix array construction);
                suffixes with equal rank are exactly the suffix-array runs whose LCP >= min_bytes,
                so this needs neither the full suffix array nor an LCP array. Position i starts a
                repeat iff an earlier position has the same rank; [i, i + min_bytes) is marked.
                Marked intervals of a document closer than `merge_gap` bytes are merged (the
                short spans sandwiched between repeats go too, as in Olmo 3), interval ends are
                snapped to UTF-8 character boundaries, the bytes are removed, and a document
                left with fewer than `min_chars` characters is dropped. numpy is preferred to
                pydivsufsort (a C extension, not installed here) because the prefix-doubling code
                is ~40 lines, exact, tested against a naive suffix sort, and fast enough at the
                MB-GB scale this runs on (one global array; Olmo 3 ran 57 shards at TB scale).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .core import CurateDoc, Decision, GlobalStage, register_stage

KeepPolicy = Literal["first", "newest"]
_WORD_RE = re.compile(r"\w+", re.UNICODE)
_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------- helpers
class UnionFind:
    """Union-find over 0..n-1 with path halving; the root of a set is its smallest member,
    so components are labelled deterministically."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            lo, hi = (ra, rb) if ra < rb else (rb, ra)
            self.parent[hi] = lo

    def groups(self) -> dict[int, list[int]]:
        """root -> sorted members, for sets with more than one member."""
        out: dict[int, list[int]] = {}
        for x in range(len(self.parent)):
            out.setdefault(self.find(x), []).append(x)
        return {r: m for r, m in out.items() if len(m) > 1}


def _date_key(value: Any) -> tuple[int, float, str]:
    """Sort key of a metadata date: missing < numbers < strings (ISO dates sort as text)."""
    if value is None or value == "":
        return (0, 0.0, "")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (1, float(value), "")
    return (2, 0.0, str(value))


def _choose_keeper(members: Sequence[int], dates: Sequence[Any], keep: KeepPolicy) -> int:
    """Index (into the global order) of the document to keep in a duplicate cluster."""
    if keep == "first":
        return min(members)
    # newest date wins; among equal dates the earliest in corpus order
    return max(members, key=lambda m: (_date_key(dates[m]), -m))


def _flatten(partials: Sequence[Mapping[str, Any]], key: str) -> list[Any]:
    return [x for part in partials for x in part[key]]


def _shard_plans(partials: Sequence[Mapping[str, Any]], drops: Mapping[int, Any]) -> list[Any]:
    """Split {global index: info} into one {position: info} dict per shard."""
    plans: list[dict[int, Any]] = []
    start = 0
    for part in partials:
        n = len(part["ids"])
        plans.append({g - start: info for g, info in drops.items() if start <= g < start + n})
        start += n
    return plans


def _check_keep(keep: str, stage: str) -> None:
    if keep not in ("first", "newest"):
        raise ValueError(f"{stage}.keep must be 'first' or 'newest', got {keep!r}")


# ---------------------------------------------------------------------------- exact
def exact_key(text: str, lowercase: bool = False) -> bytes:
    """128-bit blake2b of NFC text with whitespace runs collapsed (optionally lowercased)."""
    norm = " ".join(unicodedata.normalize("NFC", text).split())
    if lowercase:
        norm = norm.lower()
    return hashlib.blake2b(norm.encode("utf-8"), digest_size=16).digest()


@register_stage("exact_dedup")
@dataclass(kw_only=True)
class ExactDedup(GlobalStage):
    """Exact duplicates by hash of the normalised text; one kept per group."""

    keep: KeepPolicy = "first"
    date_field: str = "date"
    lowercase: bool = False

    def __post_init__(self) -> None:
        _check_keep(self.keep, "exact_dedup")
        self.summary: dict[str, Any] = {}

    def observe(self, docs: Sequence[CurateDoc]) -> dict[str, Any]:
        return {
            "ids": [d.id for d in docs],
            "keys": [exact_key(d.text, self.lowercase) for d in docs],
            "dates": [d.metadata.get(self.date_field) for d in docs],
        }

    def plan(self, partials: Sequence[Mapping[str, Any]]) -> list[Any]:
        ids, keys, dates = (_flatten(partials, k) for k in ("ids", "keys", "dates"))
        groups: dict[bytes, list[int]] = {}
        for g, key in enumerate(keys):
            groups.setdefault(key, []).append(g)
        drops: dict[int, dict[str, Any]] = {}
        clusters = 0
        for members in groups.values():
            if len(members) < 2:
                continue
            clusters += 1
            keeper = _choose_keeper(members, dates, self.keep)
            for m in members:
                if m != keeper:
                    drops[m] = {"dup_of": ids[keeper], "cluster_size": len(members)}
        self.summary = {"docs": len(ids), "clusters": clusters, "duplicates": len(drops)}
        return _shard_plans(partials, drops)

    def apply(self, doc: CurateDoc, position: int, shard_plan: Any) -> Decision:
        info = shard_plan.get(position)
        if info is None:
            return Decision.ok()
        return Decision.drop("exact_dedup", **info)


# ---------------------------------------------------------------------------- minhash
def lsh_candidate_probability(s: float | np.ndarray, bands: int, rows: int) -> Any:
    """P(two documents with Jaccard s share at least one band) = 1 - (1 - s^rows)^bands."""
    return 1.0 - (1.0 - np.asarray(s, dtype=np.float64) ** rows) ** bands


def lsh_threshold(bands: int, rows: int) -> float:
    """The usual approximation (1/bands)^(1/rows) of the S-curve's steepest point."""
    return float((1.0 / bands) ** (1.0 / rows))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (Steele et al. 2014): a bijective 64-bit mixer, vectorised."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _word_hash(word: str, cache: dict[str, int]) -> int:
    h = cache.get(word)
    if h is None:
        h = int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")
        cache[word] = h
    return h


def shingle_hashes(text: str, ngram: int = 5, cache: dict[str, int] | None = None) -> np.ndarray:
    """Sorted unique uint64 hashes of the word n-grams of the lowercased, punctuation-free
    text. A text shorter than `ngram` words is one shingle; an empty text has none."""
    cache = {} if cache is None else cache
    words = _WORD_RE.findall(text.lower())
    if not words:
        return np.empty(0, dtype=np.uint64)
    w_W = np.fromiter((_word_hash(w, cache) for w in words), dtype=np.uint64, count=len(words))
    n = min(ngram, len(words))
    count = len(words) - n + 1
    acc_S = np.zeros(count, dtype=np.uint64)
    for j in range(n):  # position-dependent mixing so "a b" != "b a"
        acc_S = _splitmix64(
            acc_S ^ w_W[j : j + count] ^ np.uint64(((j + 1) * 0x9E3779B97F4A7C15) & _MASK64)
        )
    return np.unique(acc_S)


def minhash_params(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(a_K odd, b_K) uint64 multipliers of the multiply-add-shift hash family."""
    rng = np.random.default_rng(seed)
    a_K = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b_K = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2)
    return a_K, b_K


def minhash_signature(
    shingles_S: np.ndarray, a_K: np.ndarray, b_K: np.ndarray, block: int = 4096
) -> np.ndarray:
    """uint32 [K] MinHash signature; an empty shingle set gives all 0xFFFFFFFF."""
    sig_K = np.full(a_K.shape[0], 0xFFFFFFFF, dtype=np.uint64)
    for lo in range(0, shingles_S.size, block):
        x_S1 = shingles_S[lo : lo + block, None]
        h_SK = (x_S1 * a_K[None, :] + b_K[None, :]) >> np.uint64(32)  # wraps mod 2^64
        np.minimum(sig_K, h_SK.min(axis=0), out=sig_K)
    return sig_K.astype(np.uint32)


def jaccard(a_S: np.ndarray, b_S: np.ndarray) -> float:
    """Exact Jaccard similarity of two sorted unique hash arrays."""
    if a_S.size == 0 and b_S.size == 0:
        return 1.0
    inter = np.intersect1d(a_S, b_S, assume_unique=True).size
    return inter / (a_S.size + b_S.size - inter)


@register_stage("minhash_dedup")
@dataclass(kw_only=True)
class MinHashDedup(GlobalStage):
    """MinHash LSH near-duplicate removal with exact Jaccard verification in each cluster."""

    ngram: int = 5
    bands: int = 20
    rows: int = 5
    jaccard_threshold: float = 0.75
    seed: int = 1
    keep: KeepPolicy = "newest"
    date_field: str = "date"

    def __post_init__(self) -> None:
        _check_keep(self.keep, "minhash_dedup")
        for name in ("ngram", "bands", "rows"):
            if getattr(self, name) <= 0:
                raise ValueError(f"minhash_dedup.{name} must be positive")
        if not 0.0 < self.jaccard_threshold <= 1.0:
            raise ValueError("minhash_dedup.jaccard_threshold must be in (0, 1]")
        self.summary: dict[str, Any] = {}

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows

    def observe(self, docs: Sequence[CurateDoc]) -> dict[str, Any]:
        a_K, b_K = minhash_params(self.num_perm, self.seed)
        cache: dict[str, int] = {}
        shingles = [shingle_hashes(d.text, self.ngram, cache) for d in docs]
        sig_NK = np.zeros((len(docs), self.num_perm), dtype=np.uint32)
        for k, sh in enumerate(shingles):
            sig_NK[k] = minhash_signature(sh, a_K, b_K)
        return {
            "ids": [d.id for d in docs],
            "dates": [d.metadata.get(self.date_field) for d in docs],
            "sig": sig_NK,
            "shingles": shingles,
        }

    def candidate_pairs(self, sig_NK: np.ndarray) -> set[tuple[int, int]]:
        """Pairs (i < j) that share a band; consecutive members of each bucket (enough for
        the union-find)."""
        pairs: set[tuple[int, int]] = set()
        for b in range(self.bands):
            band_NR = np.ascontiguousarray(sig_NK[:, b * self.rows : (b + 1) * self.rows])
            key_N = np.zeros(band_NR.shape[0], dtype=np.uint64)
            for r in range(self.rows):
                key_N = _splitmix64(key_N ^ band_NR[:, r].astype(np.uint64))
            order = np.argsort(key_N, kind="stable")
            sorted_keys = key_N[order]
            same = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
            for k in same:  # order is stable, so order[k] < order[k + 1] within a bucket
                i, j = int(order[k]), int(order[k + 1])
                if np.array_equal(band_NR[i], band_NR[j]):  # guard against key collisions
                    pairs.add((i, j))
        return pairs

    def plan(self, partials: Sequence[Mapping[str, Any]]) -> list[Any]:
        ids, dates, shingles = (_flatten(partials, k) for k in ("ids", "dates", "shingles"))
        n = len(ids)
        sig_NK = (
            np.concatenate([p["sig"] for p in partials])
            if n
            else np.zeros((0, self.num_perm), np.uint32)
        )
        # empty shingle sets (no words) are never near-duplicates of anything
        empty = {k for k, s in enumerate(shingles) if s.size == 0}
        pairs = {(i, j) for i, j in self.candidate_pairs(sig_NK) if i not in empty}
        candidates = UnionFind(n)
        for i, j in pairs:
            candidates.union(i, j)
        verified = UnionFind(n)
        best: dict[int, float] = {}
        checked = 0
        for members in candidates.groups().values():
            for x, i in enumerate(members):  # exhaustive check inside the candidate cluster
                for j in members[x + 1 :]:
                    checked += 1
                    sim = jaccard(shingles[i], shingles[j])
                    if sim >= self.jaccard_threshold:
                        verified.union(i, j)
                        best[i] = max(best.get(i, 0.0), sim)
                        best[j] = max(best.get(j, 0.0), sim)
        drops: dict[int, dict[str, Any]] = {}
        clusters = verified.groups()
        for members in clusters.values():
            keeper = _choose_keeper(members, dates, self.keep)
            for m in members:
                if m != keeper:
                    drops[m] = {
                        "dup_of": ids[keeper],
                        "jaccard": round(best[m], 4),
                        "cluster_size": len(members),
                    }
        self.summary = {
            "docs": n,
            "candidate_pairs": len(pairs),
            "candidate_clusters": len(candidates.groups()),
            "pairs_checked": checked,
            "clusters": len(clusters),
            "duplicates": len(drops),
            "lsh_threshold": round(lsh_threshold(self.bands, self.rows), 4),
        }
        return _shard_plans(partials, drops)

    def apply(self, doc: CurateDoc, position: int, shard_plan: Any) -> Decision:
        info = shard_plan.get(position)
        if info is None:
            return Decision.ok()
        return Decision.drop("minhash_dedup", **info)


# ---------------------------------------------------------------------------- suffix array
def prefix_doubling_ranks(x_N: np.ndarray, depth: int | None = None) -> np.ndarray:
    """Dense ranks of the suffixes of `x_N` by their first `depth` symbols (all symbols when
    None): rank[i] == rank[j] <=> x[i:i+depth] == x[j:j+depth], and the order of ranks is the
    lexicographic order of those prefixes (a suffix that ends sorts before its extensions).
    Manber & Myers prefix doubling: ranks of length h at i and i+step give length h + step."""
    n = x_N.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    depth = n if depth is None else min(depth, n)
    _, rank_N = np.unique(x_N, return_inverse=True)
    rank_N = rank_N.astype(np.int64).reshape(-1)
    h = 1
    while h < depth:
        num = int(rank_N.max()) + 1
        if num == n:  # all prefixes distinct: longer prefixes cannot merge them
            break
        step = min(h, depth - h)
        second_N = np.full(n, -1, dtype=np.int64)
        second_N[: n - step] = rank_N[step:]
        key_N = rank_N * (num + 1) + (second_N + 1)
        _, rank_N = np.unique(key_N, return_inverse=True)
        rank_N = rank_N.astype(np.int64).reshape(-1)
        h += step
    return rank_N


def suffix_array(x_N: np.ndarray) -> np.ndarray:
    """Suffix array of an integer sequence (prefix doubling to full depth)."""
    return np.argsort(prefix_doubling_ranks(x_N), kind="stable")


def repeated_mask(x_N: np.ndarray, min_len: int) -> np.ndarray:
    """Boolean mask of the symbols covered by a window of `min_len` symbols that also occurs
    at an earlier position (the first occurrence of every repeat stays unmarked)."""
    n = x_N.size
    if n < min_len or min_len <= 0:
        return np.zeros(n, dtype=bool)
    rank_N = prefix_doubling_ranks(x_N, min_len)
    rank_N[n - min_len + 1 :] = -1 - np.arange(min_len - 1)  # windows past the end: unique
    _, first_idx, inverse = np.unique(rank_N, return_index=True, return_inverse=True)
    starts = np.flatnonzero(first_idx[inverse.reshape(-1)] < np.arange(n))
    cover = np.zeros(n + 1, dtype=np.int64)
    np.add.at(cover, starts, 1)
    np.add.at(cover, starts + min_len, -1)
    return np.cumsum(cover[:-1]) > 0


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of True."""
    if not mask.any():
        return []
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(
        zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist(), strict=True)
    )


def _merge(intervals: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in intervals:
        if out and s - out[-1][1] <= gap:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _snap(data: bytes, pos: int) -> int:
    """Move a byte offset forward to the next UTF-8 character boundary."""
    while pos < len(data) and (data[pos] & 0xC0) == 0x80:
        pos += 1
    return pos


def remove_intervals(text: str, intervals: Sequence[tuple[int, int]]) -> str:
    """Remove UTF-8 byte intervals from `text`, snapping ends to character boundaries."""
    data = text.encode("utf-8")
    pieces, last = [], 0
    for s, e in intervals:
        s, e = _snap(data, s), _snap(data, e)
        pieces.append(data[last:s])
        last = max(last, e)
    pieces.append(data[last:])
    return b"".join(pieces).decode("utf-8")


@register_stage("substring_dedup")
@dataclass(kw_only=True)
class SubstringDedup(GlobalStage):
    """Remove repeats of >= `min_bytes` bytes that occurred earlier in the corpus."""

    min_bytes: int = 500  # SPEC §4 / Olmo 3 notes §2.2
    merge_gap: int = 64  # bytes; spans this short between two repeats are removed too
    min_chars: int = 100  # documents shorter than this after removal are dropped

    def __post_init__(self) -> None:
        if self.min_bytes < 8:
            raise ValueError(f"substring_dedup.min_bytes must be >= 8, got {self.min_bytes}")
        if self.merge_gap < 0 or self.min_chars < 0:
            raise ValueError("substring_dedup.merge_gap and min_chars must be >= 0")
        self.summary: dict[str, Any] = {}

    def observe(self, docs: Sequence[CurateDoc]) -> dict[str, Any]:
        return {"ids": [d.id for d in docs], "data": [d.text.encode("utf-8") for d in docs]}

    def plan(self, partials: Sequence[Mapping[str, Any]]) -> list[Any]:
        data = _flatten(partials, "data")
        lengths = np.array([len(b) for b in data], dtype=np.int64)
        # document bytes, each followed by a unique separator symbol 256 + index
        x_N = np.empty(int(lengths.sum()) + len(data), dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]]).astype(np.int64)
        for k, b in enumerate(data):
            x_N[starts[k] : starts[k] + lengths[k]] = np.frombuffer(b, dtype=np.uint8)
            x_N[starts[k] + lengths[k]] = 256 + k
        mask_N = repeated_mask(x_N, self.min_bytes)
        drops: dict[int, list[tuple[int, int]]] = {}
        removed = 0
        for k in range(len(data)):
            runs = _runs(mask_N[starts[k] : starts[k] + lengths[k]])
            if runs:
                merged = _merge(runs, self.merge_gap)
                drops[k] = merged
                removed += sum(e - s for s, e in merged)
        self.summary = {
            "docs": len(data),
            "bytes": int(lengths.sum()),
            "docs_with_repeats": len(drops),
            "bytes_marked": int(removed),
        }
        return _shard_plans(partials, drops)

    def apply(self, doc: CurateDoc, position: int, shard_plan: Any) -> Decision:
        intervals = shard_plan.get(position)
        if not intervals:
            return Decision.ok()
        before = len(doc.text)
        doc.text = remove_intervals(doc.text, intervals).strip()
        removed = before - len(doc.text)
        if len(doc.text) < self.min_chars:
            return Decision.drop("substring_dedup:too_short", chars_removed=removed)
        return Decision.ok(chars_removed=removed, spans=len(intervals))
