"""Exact, MinHash-LSH and suffix-array substring dedup: reference implementations and planted
duplicates with known answers."""

from __future__ import annotations

import hashlib
import itertools
import json

import numpy as np
import pytest

from hybridlm.curate.core import CurateDoc, run_in_memory
from hybridlm.curate.dedup import (
    ExactDedup,
    MinHashDedup,
    SubstringDedup,
    UnionFind,
    exact_key,
    jaccard,
    lsh_candidate_probability,
    lsh_threshold,
    minhash_params,
    minhash_signature,
    prefix_doubling_ranks,
    remove_intervals,
    repeated_mask,
    shingle_hashes,
    suffix_array,
)

M64 = (1 << 64) - 1


def _words(rng: np.random.Generator, n: int) -> list[str]:
    syll = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po", "an", "el"]
    return ["".join(rng.choice(syll, size=int(rng.integers(2, 4)))) for _ in range(n)]


def _doc(k: int, text: str, **meta) -> CurateDoc:
    return CurateDoc(id=f"d{k}", text=text, source="t", metadata=dict(meta))


def _kept_ids(shards) -> list[str]:
    return [d.id for docs in shards for d in docs]


# ---------------------------------------------------------------------------- exact
def test_exact_dedup_normalised_hash_and_keep_policies():
    assert exact_key("a  b\n c") == exact_key("a b c")
    assert exact_key("Cafe\u0301") == exact_key("Café")  # NFC
    assert exact_key("A b") != exact_key("a b") and exact_key("A b", True) == exact_key("a b")
    shards = [
        [_doc(0, "same text here", date="2020-01-01"), _doc(1, "other text")],
        [_doc(2, "same  text\nhere", date="2023-05-01"), _doc(3, "same text here")],
    ]
    kept, stats, removed = run_in_memory([ExactDedup(keep="first")], shards)
    assert _kept_ids(kept) == ["d0", "d1"]
    assert stats[0].dropped == {"exact_dedup": 2}
    assert {d.id: d.provenance[-1].scores["dup_of"] for d in removed} == {"d2": "d0", "d3": "d0"}
    fresh = [[_doc(d.id[1:], d.text, **d.metadata) for d in s] for s in shards]
    kept, _, removed = run_in_memory([ExactDedup(keep="newest")], fresh)
    assert _kept_ids(kept) == ["d1", "d2"]  # 2023 beats 2020; an undated copy is oldest
    with pytest.raises(ValueError):
        ExactDedup(keep="last")


# ---------------------------------------------------------------------------- minhash
def _ref_shingles(text: str, n: int) -> set[int]:
    """Pure-Python reference of `shingle_hashes` (blake2b words, SplitMix64 chaining)."""
    import re

    def mix(x: int) -> int:
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & M64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & M64
        return x ^ (x >> 31)

    words = re.findall(r"\w+", text.lower())
    hw = [
        int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") for w in words
    ]
    n = min(n, len(words))
    out = set()
    for i in range(len(words) - n + 1):
        acc = 0
        for j in range(n):
            acc = mix(acc ^ hw[i + j] ^ (((j + 1) * 0x9E3779B97F4A7C15) & M64))
        out.add(acc)
    return out


def test_shingles_match_reference_and_are_order_sensitive():
    text = "The cat, the DOG and the bird sat on the mat; the cat sat."
    got = shingle_hashes(text, 5)
    assert set(got.tolist()) == _ref_shingles(text, 5)
    assert np.all(np.diff(got.astype(np.float64)) > 0)  # sorted unique
    assert set(shingle_hashes("a b c", 5).tolist()) == _ref_shingles("a b c", 5)  # one shingle
    assert shingle_hashes("...", 5).size == 0
    assert set(shingle_hashes("x y", 2).tolist()) != set(shingle_hashes("y x", 2).tolist())


def test_minhash_estimates_jaccard():
    a_K, b_K = minhash_params(256, seed=3)
    rng = np.random.default_rng(0)
    universe = rng.integers(0, 2**63, size=3000, dtype=np.uint64)
    for overlap in (0.2, 0.5, 0.8):
        n_common = int(1000 * overlap)
        a = np.unique(np.concatenate([universe[:n_common], universe[1000 : 2000 - n_common]]))
        b = np.unique(np.concatenate([universe[:n_common], universe[2000 : 3000 - n_common]]))
        true = jaccard(a, b)
        est = np.mean(minhash_signature(a, a_K, b_K) == minhash_signature(b, a_K, b_K))
        assert abs(est - true) < 0.08, (overlap, true, est)  # 256 hashes: sd < 0.032
    assert jaccard(np.array([1, 2, 3], np.uint64), np.array([2, 3, 4], np.uint64)) == 0.5


def test_lsh_s_curve_values():
    assert lsh_threshold(20, 5) == pytest.approx((1 / 20) ** (1 / 5))
    assert lsh_candidate_probability(0.75, 20, 5) == pytest.approx(1 - (1 - 0.75**5) ** 20)
    assert float(lsh_candidate_probability(0.75, 20, 5)) > 0.99
    assert float(lsh_candidate_probability(0.3, 20, 5)) == pytest.approx(0.0475, abs=1e-4)
    assert lsh_threshold(14, 8) == pytest.approx(0.719, abs=1e-3)  # FineWeb's 14 x 8


def test_union_find_roots_are_smallest():
    uf = UnionFind(6)
    uf.union(4, 2)
    uf.union(2, 5)
    uf.union(0, 1)
    assert uf.groups() == {0: [0, 1], 2: [2, 4, 5]}


def _edit(words: list[str], count: int, rng: np.random.Generator, vocab: list[str]) -> list[str]:
    """`count` words at distinct random positions replaced by random vocabulary words."""
    out = list(words)
    for k in rng.choice(len(out), size=count, replace=False):
        out[int(k)] = vocab[int(rng.integers(len(vocab)))] + "x"  # "x": never the same word
    return out


def test_minhash_removes_planted_near_duplicates_keep_newest():
    rng = np.random.default_rng(1)
    vocab = _words(rng, 3000)
    base = [list(rng.choice(vocab, size=300)) for _ in range(12)]
    docs, k = [], 0
    for i, words in enumerate(base):
        docs.append(_doc(k, " ".join(words), date=f"2020-01-{i + 1:02d}"))
        k += 1
    # near copies of docs 0 and 5 (3 of 300 words replaced: Jaccard ~ 0.9); dates decide
    for src, date in ((0, "2024-01-01"), (5, "2019-01-01")):
        docs.append(_doc(k, " ".join(_edit(base[src], 3, rng, vocab)), date=date))
        k += 1
    shards = [docs[:7], docs[7:]]
    stage = MinHashDedup()
    kept, stats, removed = run_in_memory([stage], shards)
    ids = _kept_ids(kept)
    assert "d0" not in ids and "d12" in ids  # the 2024 copy is newer than its original
    assert "d5" in ids and "d13" not in ids  # the 2019 copy is older than its original
    assert len(ids) == 12 and stats[0].dropped == {"minhash_dedup": 2}
    by_id = {d.id: d.provenance[-1].scores for d in removed}
    assert by_id["d0"]["dup_of"] == "d12" and by_id["d0"]["jaccard"] > 0.85
    assert stage.summary["clusters"] == 2 and stage.summary["duplicates"] == 2
    # keep-first keeps the originals; results do not depend on how documents are sharded
    again = [[_doc(d.id[1:], d.text, **d.metadata) for d in docs]]
    kept1, _, _ = run_in_memory([MinHashDedup(keep="first")], again)
    assert _kept_ids(kept1) == [f"d{i}" for i in range(12)]


def test_minhash_verification_rejects_false_candidates_and_clusters_transitively():
    rng = np.random.default_rng(2)
    vocab = _words(rng, 3000)
    a = list(rng.choice(vocab, size=200))
    # b shares the first 140 words with a: Jaccard ~ 0.5 -> an LSH candidate with 50 x 2 bands
    b = a[:140] + list(rng.choice(vocab, size=60))
    stage = MinHashDedup(bands=50, rows=2, jaccard_threshold=0.75)
    kept, _, _ = run_in_memory([stage], [[_doc(0, " ".join(a)), _doc(1, " ".join(b))]])
    assert stage.summary["candidate_pairs"] == 1 and stage.summary["pairs_checked"] == 1
    assert _kept_ids(kept) == ["d0", "d1"]  # verified Jaccard < 0.75: both kept
    # chain x ~ y ~ z with x !~ z: one verified cluster of three, one survivor
    x = list(rng.choice(vocab, size=400))
    y = [w + "y" for w in x[:36]] + x[36:]  # J(x, y) ~ (396 - 40) / (396 + 40) ~ 0.82
    z = y[:364] + [w + "z" for w in y[364:]]  # J(y, z) ~ 0.82, J(x, z) ~ 0.67
    jx = {
        (i, j): jaccard(shingle_hashes(" ".join(p)), shingle_hashes(" ".join(q)))
        for (i, p), (j, q) in itertools.combinations(enumerate([x, y, z]), 2)
    }
    assert jx[(0, 1)] >= 0.75 and jx[(1, 2)] >= 0.75 and jx[(0, 2)] < 0.75, jx
    stage = MinHashDedup(bands=50, rows=2, keep="first")
    kept, _, removed = run_in_memory(
        [stage], [[_doc(i, " ".join(t)) for i, t in enumerate([x, y, z])]]
    )
    assert _kept_ids(kept) == ["d0"] and stage.summary["clusters"] == 1
    assert {d.provenance[-1].scores["cluster_size"] for d in removed} == {3}


# ---------------------------------------------------------------------------- suffix array
def test_suffix_array_matches_naive_sort():
    rng = np.random.default_rng(0)
    for n, alphabet in ((1, 2), (17, 2), (64, 3), (200, 5)):
        x = rng.integers(0, alphabet, size=n)
        naive = sorted(range(n), key=lambda i: tuple(x[i:].tolist()))
        assert suffix_array(x).tolist() == naive
        for depth in (1, 3, 8):
            ranks = prefix_doubling_ranks(x, depth)
            keys = [tuple(x[i : i + depth].tolist()) for i in range(n)]
            for i, j in itertools.combinations(range(n), 2):
                assert (ranks[i] == ranks[j]) == (keys[i] == keys[j])
                assert (ranks[i] < ranks[j]) == (keys[i] < keys[j])


def _naive_repeated(x: np.ndarray, m: int) -> np.ndarray:
    n = x.size
    mask = np.zeros(n, dtype=bool)
    seen: set[tuple[int, ...]] = set()
    for i in range(n - m + 1):
        w = tuple(x[i : i + m].tolist())
        if w in seen:
            mask[i : i + m] = True
        seen.add(w)
    return mask


def test_repeated_mask_matches_brute_force():
    rng = np.random.default_rng(1)
    for n, alphabet, m in ((50, 2, 4), (300, 3, 6), (500, 4, 8), (10, 2, 20)):
        x = rng.integers(0, alphabet, size=n)
        assert np.array_equal(repeated_mask(x, m), _naive_repeated(x, m))


def test_remove_intervals_snaps_to_characters():
    text = "héllo wörld"  # é and ö are two bytes each
    data = text.encode()
    assert remove_intervals(text, [(0, 2)]) == "llo wörld"  # ends inside é -> snapped forward
    assert remove_intervals(text, [(7, 9)]) == "héllo rld"
    assert remove_intervals(text, [(0, len(data))]) == ""


def test_substring_dedup_keeps_one_occurrence():
    rng = np.random.default_rng(3)
    vocab = _words(rng, 2000)
    span = " ".join(rng.choice(vocab, size=150))  # ~900 bytes, planted in three documents
    assert len(span.encode()) > 600
    bodies = [" ".join(rng.choice(vocab, size=120)) for _ in range(4)]
    docs = [
        _doc(0, bodies[0] + " " + span + " " + bodies[1]),
        _doc(1, bodies[2] + " ünïcödé " + span),
        _doc(2, span + " tail words here"),  # nothing but the repeat is left -> dropped
        _doc(3, bodies[3]),
    ]
    stage = SubstringDedup(min_bytes=500, merge_gap=0, min_chars=100)
    kept, stats, removed = run_in_memory([stage], [docs[:2], docs[2:]])
    out = {d.id: d.text for s in kept for d in s}
    assert out["d0"] == docs[0].text  # first occurrence kept
    assert span not in out["d1"] and out["d1"].startswith(bodies[2])
    assert out["d1"].endswith("ünïcödé") or out["d1"].endswith("ünïcödé ")[:-1]
    assert "d2" not in out and removed[0].provenance[-1].reason == "substring_dedup:too_short"
    assert out["d3"] == docs[3].text
    # two copies minus at most the (< 500 byte) boundary slack of the shared word edges
    assert stage.summary["bytes_marked"] >= 2 * (len(span.encode()) - 2)
    assert stats[0].modified == 1


def test_substring_dedup_merge_gap_and_validation():
    rng = np.random.default_rng(4)
    vocab = _words(rng, 2000)
    s1 = " ".join(rng.choice(vocab, size=120))
    s2 = " ".join(rng.choice(vocab, size=120))
    first = s1 + " GAP " + s2
    second = "intro " * 30 + s1 + " xyz " + s2 + " outro" * 30
    stage = SubstringDedup(min_bytes=200, merge_gap=16, min_chars=10)
    kept, _, _ = run_in_memory([stage], [[_doc(0, first), _doc(1, second)]])
    text = kept[0][1].text
    assert "xyz" not in text and s1 not in text and s2 not in text  # the short gap goes too
    assert text.startswith("intro") and text.endswith("outro")
    with pytest.raises(ValueError):
        SubstringDedup(min_bytes=4)


@pytest.mark.slow
def test_curate_benchmark_runs_and_checks(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import curate_throughput

    out = tmp_path / "bench.json"
    rc = curate_throughput.main(
        ["--docs", "40", "--copies", "70", "--no-ray", "--json", str(out), "--out", str(tmp_path)]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["dedup"]["minhash"]["precision"] >= 0.95 and res["substring"]["recall"] >= 0.9
    assert (tmp_path / "dedup_scurve.png").stat().st_size > 10_000
