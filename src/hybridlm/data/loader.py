"""Packed pretraining batches from `ShardSet`s: mixtures, phases, exact resume, data parallelism.

Shape legend: B rows per rank, L `seq_len`, R = L + 1 tokens per row (window), G = world * B.

Every row is a window of R tokens cut from documents ([BOS] text [EOS], as sharded). A batch is

    input_ids     [B, L]  window[:, :L]
    labels        [B, L]  the model's convention (transformers'; `HybridLM.forward` shifts):
                          labels[:, t] = input_ids[:, t] where token t is a target, else -100
    targets       [B, L]  the same targets already shifted, for a loss computed outside the model:
                          targets[:, t] = window[:, t + 1] or -100; unlike `labels` it also scores
                          the window's last token
    doc_ids       [B, L]  0, 1, 2, ... per row: the segment of each position, for intra-document
                          masking (varlen attention, Mamba `seq_idx`); padding is one more segment
    position_ids  [B, L]  restart at 0 at every segment
    source_ids    [B, L]  index of the source (mixture component) of each token, -1 for padding
    token_index   [B, L]  the token's entry in its source's shard token stream
                          (`ShardSet.token_starts`), -1 for padding: where per-token data
                          aligned with the shards is read (a cached teacher top-k)
    num_valid_tokens      global (all ranks) count of `labels` targets after the model's shift,
                          for losses normalised by the global count (DESIGN habit 13)
    num_valid_targets     global count of `targets` != -100

A token is a target iff it is not padding and the token before it in the row belongs to the same
segment: a document's first token (BOS) and a segment's first token are context only.

Packing (`packing=`):
  * `"best_fit"` (default; Olmo 3's best-fit document packing, nanochat's BOS-aligned rows): draw
    `buffer_docs` documents, split those longer than a row into pieces of at most R tokens (stride
    L: consecutive pieces share one token, so every token but a document's first is a target once),
    fill rows best-fit-decreasing, pad the rest (labels -100), emit the rows in a seeded order.
    Rows always start at a piece start; no document is cut to fit a row.
  * `"greedy"`: concatenate documents and cut consecutive windows of R tokens at stride L (nanoGPT).

Mixtures: `weights` per source are token fractions in expectation: each draw picks source i with
probability proportional to weight_i / mean document length_i, from a counter-based hash of
(seed, draw), so the stream is a pure function of the seed. Each source is read in a seeded
permutation per epoch (`shuffle=True`) and wraps around.

Phases: `phases=[Phase(fraction=0.8, weights=A), Phase(fraction=0.2, weights=B)]` with
`total_tokens` switches the blend after 80% of `total_tokens` (counted as rows emitted x L, the
trainer's tokens seen; a best-fit buffer stops at the boundary, so the switch lands within a
few rows).

Data parallelism: every rank plans the same global stream of rows (from document lengths alone)
and materialises only its own: step s uses global rows [s*G, (s+1)*G) and rank r takes rows
[r*B, (r+1)*B) of them. Concatenating the ranks' batches in rank order gives the world=1 batch of
G rows; ranks see disjoint rows.

Resume: `state_dict()` (JSON-able; a few integers) after any step, `load_state_dict()` on a fresh
loader, and the following batches equal those of an uninterrupted run. The state counts global
rows, so a run may resume with another world size as long as the global batch is the same.

Long and short sequences in one run (`AlternatingLoader`; Nemotron 3 Super §2.6 LC-2 alternates
1M- and 4K-token sequences): batches come from several `PackedLoader`s of different `seq_len`
in a fixed cycle, e.g. one batch of 2 x 1024 tokens, then one of 8 x 256; its state is the cycle
position plus each loader's state, so it resumes exactly too.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from .shards import ShardSet

IGNORE_INDEX = -100
STATE_VERSION = 1
PackingMode = Literal["best_fit", "greedy"]

Piece = tuple[int, int, int, int]  # (source, document, start, length)
Row = list[Piece]


@dataclass(kw_only=True)
class Phase:
    """One stage of a data curriculum: `fraction` of the total tokens, drawn from `weights`
    (source name -> weight; missing sources get 0). Nemotron 3 Super: phase 2 is the last 20%
    of tokens with a higher-quality blend (SPEC §3)."""

    fraction: float
    weights: dict[str, float] = field(default_factory=dict)


def _u01(*keys: int) -> float:
    """A uniform number in [0, 1) that is a pure function of `keys` (counter-based RNG)."""
    data = struct.pack(f"<{len(keys)}Q", *(k & 0xFFFFFFFFFFFFFFFF for k in keys))
    h = hashlib.blake2b(data, digest_size=8).digest()
    return (int.from_bytes(h, "little") >> 11) / float(1 << 53)


# ---------------------------------------------------------------------------- document streams
class _MixtureStream:
    """Infinite stream of (source, document, length) from a weighted mixture of sources."""

    def __init__(
        self,
        sets: list[ShardSet],
        phase_probs: list[tuple[float, list[float]]],  # (end in tokens seen, cumulative probs)
        seed: int,
        shuffle: bool,
    ) -> None:
        self.sets, self.phase_probs, self.seed, self.shuffle = sets, phase_probs, seed, shuffle
        self.lengths = [s.lengths for s in sets]
        self.state: dict[str, Any] = {"draws": 0, "epoch": [0] * len(sets), "pos": [0] * len(sets)}
        self._perm: dict[int, tuple[int, np.ndarray]] = {}

    def snapshot(self) -> dict[str, Any]:
        s = self.state
        return {"draws": s["draws"], "epoch": list(s["epoch"]), "pos": list(s["pos"])}

    def restore(self, snap: dict[str, Any]) -> None:
        self.state = {
            "draws": snap["draws"],
            "epoch": list(snap["epoch"]),
            "pos": list(snap["pos"]),
        }

    def _order(self, s: int, epoch: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        cached = self._perm.get(s)
        if cached is None or cached[0] != epoch:
            perm = np.random.default_rng([self.seed, 1, s, epoch]).permutation(len(self.sets[s]))
            cached = self._perm[s] = (epoch, perm)
        return cached[1]

    def next_boundary(self, tokens_seen: int) -> float | None:
        """Tokens seen at which the blend changes next (None: no change ahead)."""
        for end, _ in self.phase_probs[:-1]:
            if tokens_seen < end:
                return end
        return None

    def next(self, tokens_seen: int) -> tuple[int, int, int] | None:
        state = self.state
        if len(self.sets) == 1:
            s = 0
        else:
            cum = self.phase_probs[-1][1]
            for end, probs in self.phase_probs:
                if tokens_seen < end:
                    cum = probs
                    break
            s = min(bisect.bisect_right(cum, _u01(self.seed, 0, state["draws"])), len(cum) - 1)
        state["draws"] += 1
        if state["pos"][s] >= len(self.sets[s]):
            state["epoch"][s] += 1
            state["pos"][s] = 0
        order = self._order(s, state["epoch"][s])
        d = state["pos"][s] if order is None else int(order[state["pos"][s]])
        state["pos"][s] += 1
        return s, d, int(self.lengths[s][d])


class _SequentialStream:
    """Every document of every source once, in order (held-out evaluation)."""

    def __init__(self, sets: list[ShardSet]) -> None:
        self.sets = sets
        self.lengths = [s.lengths for s in sets]
        self.state: dict[str, Any] = {"source": 0, "pos": 0}

    def snapshot(self) -> dict[str, Any]:
        return dict(self.state)

    def next_boundary(self, tokens_seen: int) -> float | None:
        return None

    def restore(self, snap: dict[str, Any]) -> None:
        self.state = dict(snap)

    def next(self, tokens_seen: int) -> tuple[int, int, int] | None:
        state = self.state
        while state["source"] < len(self.sets) and state["pos"] >= len(self.sets[state["source"]]):
            state["source"] += 1
            state["pos"] = 0
        if state["source"] >= len(self.sets):
            return None
        s, d = state["source"], state["pos"]
        state["pos"] += 1
        return s, d, int(self.lengths[s][d])


# ---------------------------------------------------------------------------- packers
def _split(s: int, d: int, n: int, seq_len: int) -> list[Piece]:
    """Pieces of at most seq_len + 1 tokens at stride seq_len (neighbours share one token)."""
    if n <= seq_len + 1:
        return [(s, d, 0, n)]
    return [(s, d, a, min(a + seq_len + 1, n) - a) for a in range(0, n - 1, seq_len)]


def best_fit_decreasing(pieces: Sequence[Piece], capacity: int) -> list[Row]:
    """Bins of at most `capacity` tokens: pieces longest first, each into the fullest bin that
    still fits it, else a new bin (ties keep the input order, so the result is deterministic)."""
    order = sorted(range(len(pieces)), key=lambda i: -pieces[i][3])
    bins: list[Row] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin)
    for i in order:
        n = pieces[i][3]
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            remaining, b = free.pop(j)
        else:
            bins.append([])
            remaining, b = capacity, len(bins) - 1
        bins[b].append(pieces[i])
        if remaining - n > 0:
            bisect.insort(free, (remaining - n, b))
    return bins


class _BestFitPacker:
    def __init__(self, stream: Any, seq_len: int, buffer_docs: int, seed: int, shuffle: bool):
        self.stream, self.L, self.buffer_docs = stream, seq_len, buffer_docs
        self.seed, self.shuffle = seed, shuffle
        self.rows = 0  # global rows emitted
        self.block: dict[str, Any] | None = None  # stream snapshot + tokens seen at block start
        self.bins: list[Row] = []
        self.k = 0  # rows of the current block emitted
        self.blocks = 0  # blocks built (keys the row order)

    def _build(self) -> None:
        snap, seen = self.stream.snapshot(), self.rows * self.L
        self.block = {"stream": snap, "seen": seen, "id": self.blocks}
        self.blocks += 1
        self._fill()

    def _fill(self) -> None:
        pieces: list[Piece] = []
        # A block stops short of the next phase boundary (in rows of L new tokens), so the
        # blend switches within a few rows rather than a whole buffer late.
        seen, boundary = self.block["seen"], self.stream.next_boundary(self.block["seen"])
        budget = (boundary - seen) * (self.L + 1) / self.L if boundary is not None else None
        drawn = 0
        for _ in range(self.buffer_docs):
            if budget is not None and drawn >= budget:
                break
            item = self.stream.next(seen)
            if item is None:
                break
            drawn += item[2]
            if item[2] >= 2:  # a one-token document has no target
                pieces.extend(_split(*item, self.L))
        bins = best_fit_decreasing(pieces, self.L + 1)
        if self.shuffle and len(bins) > 1:
            order = np.random.default_rng([self.seed, 2, self.block["id"]]).permutation(len(bins))
            bins = [bins[i] for i in order]
        self.bins, self.k = bins, 0

    def next_row(self) -> Row | None:
        if self.block is None or self.k >= len(self.bins):
            self._build()
            if not self.bins:
                return None
        row = self.bins[self.k]
        self.k += 1
        self.rows += 1
        return row

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "blocks": self.blocks, "block": self.block, "k": self.k}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows, self.blocks, self.block = state["rows"], state["blocks"], state["block"]
        if self.block is not None:
            self.stream.restore(self.block["stream"])
            self._fill()  # the same block again: same draws, same bins, same order
        self.k = state["k"]


class _GreedyPacker:
    def __init__(self, stream: Any, seq_len: int):
        self.stream, self.L = stream, seq_len
        self.rows = 0
        # the document holding the next row's first token: the stream snapshot before it was
        # drawn, the tokens seen at that draw (its phase), and the offset of the row start in it
        self.cur: dict[str, Any] | None = None
        self.item: tuple[int, int, int] | None = None
        self.done = False

    def _draw(self) -> tuple[dict[str, Any], int, tuple[int, int, int] | None]:
        snap, seen = self.stream.snapshot(), self.rows * self.L
        return snap, seen, self.stream.next(seen)

    def next_row(self) -> Row | None:
        if self.done:
            return None
        if self.cur is None:
            snap, seen, item = self._draw()
            if item is None:
                self.done = True
                return None
            self.cur, self.item = {"stream": snap, "seen": seen, "offset": 0}, item
        capacity = self.L + 1
        docs = [(self.cur["stream"], self.cur["seen"], self.item, self.cur["offset"])]
        s, d, n = self.item
        take = min(n - self.cur["offset"], capacity)
        row: Row = [(s, d, self.cur["offset"], take)]
        need = capacity - take
        while need > 0:
            snap, seen, item = self._draw()
            if item is None:
                break
            docs.append((snap, seen, item, 0))
            take = min(item[2], need)
            row.append((item[0], item[1], 0, take))
            need -= take
        if sum(p[3] for p in row) < 2:  # nothing left to predict
            self.done = True
            return None
        # the next row starts L tokens further: find the document holding that token
        advance = self.L
        for (snap, seen, item, offset), piece in zip(docs, row, strict=True):
            if advance < piece[3]:
                self.cur = {"stream": snap, "seen": seen, "offset": offset + advance}
                self.item = item
                break
            advance -= piece[3]
        else:  # the stream ended inside this row
            self.done = True
        self.rows += 1
        return row

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "cur": self.cur, "done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows, self.cur, self.done = state["rows"], state["cur"], state["done"]
        self.item = None
        if self.cur is not None:
            self.stream.restore(self.cur["stream"])
            self.item = self.stream.next(self.cur["seen"])


# ---------------------------------------------------------------------------- the loader
def _as_named_sets(
    sets: ShardSet | Sequence[ShardSet] | Mapping[str, ShardSet],
) -> tuple[list[str], list[ShardSet]]:
    if isinstance(sets, ShardSet):
        return [sets.name], [sets]
    if isinstance(sets, Mapping):
        return list(sets), list(sets.values())
    sets = list(sets)
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be unique, got {names}; pass a dict name -> ShardSet")
    return names, sets


class PackedLoader:
    """Iterator of packed batches (see the module docstring). `sequential=True` reads every
    document once in order and stops (held-out evaluation; the last batch is padded with empty
    rows); otherwise the stream is infinite."""

    def __init__(
        self,
        sets: ShardSet | Sequence[ShardSet] | Mapping[str, ShardSet],
        *,
        seq_len: int,
        batch_size: int,
        packing: PackingMode = "best_fit",
        weights: Mapping[str, float] | None = None,
        phases: Sequence[Phase] | None = None,
        total_tokens: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        buffer_docs: int = 1024,
        rank: int = 0,
        world_size: int = 1,
        sequential: bool = False,
    ) -> None:
        self.names, self.sets = _as_named_sets(sets)
        if not self.sets:
            raise ValueError("PackedLoader needs at least one ShardSet")
        for name, s in zip(self.names, self.sets, strict=True):
            if len(s) == 0:
                raise ValueError(f"source {name!r} has no documents (an empty split?)")
        hashes = {s.tokenizer_sha256 for s in self.sets}
        if len(hashes) > 1:
            raise ValueError(
                f"sources {self.names} were sharded with different tokenizers; re-shard them "
                "with one tokenizer"
            )
        if seq_len < 1 or batch_size < 1 or buffer_docs < 1:
            raise ValueError(
                f"seq_len, batch_size and buffer_docs must be >= 1, got {seq_len}, "
                f"{batch_size}, {buffer_docs}"
            )
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world={world_size}")
        if packing not in ("best_fit", "greedy"):
            raise ValueError(f"packing must be 'best_fit' or 'greedy', got {packing!r}")
        self.seq_len, self.batch_size, self.packing = seq_len, batch_size, packing
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle, self.buffer_docs, self.sequential = shuffle, buffer_docs, sequential
        self.pad_id = int(self.sets[0].pad_id)
        self.total_tokens = total_tokens
        self.phases = self._phases(weights, phases, total_tokens)
        self.step = 0
        self._build()

    # ------------------------------------------------------------------ setup
    def _phases(
        self,
        weights: Mapping[str, float] | None,
        phases: Sequence[Phase] | None,
        total_tokens: int | None,
    ) -> list[Phase]:
        if phases:
            if weights is not None:
                raise ValueError("give either weights or phases (each phase has its weights)")
            total = sum(p.fraction for p in phases)
            if any(p.fraction <= 0 for p in phases) or abs(total - 1.0) > 1e-6:
                raise ValueError(
                    f"phase fractions must be positive and sum to 1, got "
                    f"{[p.fraction for p in phases]} (sum {total})"
                )
            if len(phases) > 1 and (total_tokens is None or total_tokens <= 0):
                raise ValueError("phases need total_tokens (the training budget) to place them")
            out = list(phases)
        else:
            out = [Phase(fraction=1.0, weights=dict(weights or dict.fromkeys(self.names, 1.0)))]
        for k, phase in enumerate(out):
            unknown = sorted(set(phase.weights) - set(self.names))
            if unknown:
                raise ValueError(f"phase {k} weights name unknown sources {unknown}: {self.names}")
            if any(w < 0 for w in phase.weights.values()) or not any(
                phase.weights.get(n, 0) > 0 for n in self.names
            ):
                raise ValueError(f"phase {k} weights must be >= 0 with one positive: {phase}")
        return out

    def _build(self) -> None:
        if self.sequential:
            stream: Any = _SequentialStream(self.sets)
        else:
            mean_len = [float(s.lengths.mean()) for s in self.sets]
            phase_probs, end = [], 0.0
            for phase in self.phases:
                pairs = zip(self.names, mean_len, strict=True)
                raw = np.array([phase.weights.get(n, 0.0) / m for n, m in pairs])
                end += phase.fraction * (self.total_tokens or 0)
                cum = np.cumsum(raw / raw.sum())
                cum[int(np.flatnonzero(raw > 0)[-1]) :] = 1.0  # never land on a 0-weight tail
                phase_probs.append((end, cum.tolist()))
            stream = _MixtureStream(self.sets, phase_probs, self.seed, self.shuffle)
        self.stream = stream
        self.token_starts = [s.token_starts for s in self.sets]
        shuffle_rows = self.shuffle and not self.sequential
        self.packer: Any = (
            _BestFitPacker(stream, self.seq_len, self.buffer_docs, self.seed, shuffle_rows)
            if self.packing == "best_fit"
            else _GreedyPacker(stream, self.seq_len)
        )

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def tokens_per_step(self) -> int:
        """Input tokens per optimizer step over all ranks (G x L)."""
        return self.global_batch_size * self.seq_len

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows: list[Row] = []
        for _ in range(self.global_batch_size):
            row = self.packer.next_row()
            if row is None:
                break
            rows.append(row)
        if not rows:
            raise StopIteration
        rows += [[] for _ in range(self.global_batch_size - len(rows))]  # sequential tail
        self.step += 1
        mine = rows[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        batch = self._materialise(mine)
        L = self.seq_len
        n_labels = sum(max(0, min(a + n, L) - a - 1) for row in rows for a, n in _starts(row))
        n_targets = sum(max(0, n - 1) for row in rows for _, n in _starts(row))
        batch["num_valid_tokens"] = torch.tensor(n_labels, dtype=torch.int64)
        batch["num_valid_targets"] = torch.tensor(n_targets, dtype=torch.int64)
        return batch

    def _materialise(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        B, L, R = len(rows), self.seq_len, self.seq_len + 1
        tokens_BR = np.full((B, R), self.pad_id, dtype=np.int64)
        seg_BR = np.zeros((B, R), dtype=np.int64)
        pos_BR = np.zeros((B, R), dtype=np.int64)
        src_BR = np.full((B, R), -1, dtype=np.int64)
        index_BR = np.full((B, R), -1, dtype=np.int64)
        target_BR = np.zeros((B, R), dtype=bool)
        for b, row in enumerate(rows):
            a = 0
            for k, (s, d, start, n) in enumerate(row):
                tokens_BR[b, a : a + n] = self.sets[s].document(d, start, start + n)
                seg_BR[b, a : a + n] = k
                pos_BR[b, a : a + n] = positions = np.arange(n)
                src_BR[b, a : a + n] = s
                index_BR[b, a : a + n] = self.token_starts[s][d] + start + positions
                target_BR[b, a + 1 : a + n] = True
                a += n
            seg_BR[b, a:] = len(row)  # padding: one more segment
            pos_BR[b, a:] = np.arange(R - a)
        labels_BL = np.where(target_BR[:, :L], tokens_BR[:, :L], IGNORE_INDEX)
        targets_BL = np.where(target_BR[:, 1:], tokens_BR[:, 1:], IGNORE_INDEX)
        return {
            "input_ids": torch.from_numpy(np.ascontiguousarray(tokens_BR[:, :L])),
            "labels": torch.from_numpy(labels_BL),
            "targets": torch.from_numpy(targets_BL),
            "doc_ids": torch.from_numpy(np.ascontiguousarray(seg_BR[:, :L])),
            "position_ids": torch.from_numpy(np.ascontiguousarray(pos_BR[:, :L])),
            "source_ids": torch.from_numpy(np.ascontiguousarray(src_BR[:, :L])),
            "token_index": torch.from_numpy(np.ascontiguousarray(index_BR[:, :L])),
        }

    # ------------------------------------------------------------------ state
    def _fingerprint(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "packing": self.packing,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "buffer_docs": self.buffer_docs,
            "sequential": self.sequential,
            "total_tokens": self.total_tokens,
            "sources": [
                [n, len(s), s.num_tokens] for n, s in zip(self.names, self.sets, strict=True)
            ],
            "phases": [[p.fraction, dict(sorted(p.weights.items()))] for p in self.phases],
        }

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is after the last batch returned (JSON-able)."""
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "fingerprint": self._fingerprint(),
            "packer": self.packer.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state` (from `state_dict()` of a loader over the same data and
        settings; rank, world size and batch size may differ if the global batch is the same)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} != {STATE_VERSION}")
        mine, theirs = self._fingerprint(), state.get("fingerprint", {})
        diff = sorted(k for k in mine if _jsonish(mine[k]) != _jsonish(theirs.get(k)))
        if diff:
            details = ", ".join(f"{k}: saved {theirs.get(k)!r} vs now {mine[k]!r}" for k in diff)
            raise ValueError(f"loader state does not match this loader ({details})")
        self._build()
        self.packer.load_state_dict(state["packer"])
        self.step = state["step"]


def _starts(row: Row) -> Iterator[tuple[int, int]]:
    a = 0
    for piece in row:
        yield a, piece[3]
        a += piece[3]


def _jsonish(value: Any) -> Any:
    """Tuples -> lists, so a state that went through JSON compares equal."""
    if isinstance(value, (list, tuple)):
        return [_jsonish(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonish(v) for k, v in value.items()}
    return value


class AlternatingLoader:
    """Batches from `loaders` in a fixed cycle: `counts[i]` consecutive batches from loader i,
    then the next loader (see the module docstring). Each loader keeps its own stream, sequence
    length and batch size; `tokens_per_step` is the mean over a cycle."""

    def __init__(self, loaders: Sequence[PackedLoader], counts: Sequence[int]) -> None:
        if len(loaders) < 2 or len(counts) != len(loaders) or any(c < 1 for c in counts):
            raise ValueError(
                f"AlternatingLoader needs >= 2 loaders and a count >= 1 for each, got "
                f"{len(loaders)} loaders and counts {list(counts)}"
            )
        self.loaders, self.counts = list(loaders), [int(c) for c in counts]
        self.cycle = [i for i, c in enumerate(self.counts) for _ in range(c)]
        self.step = 0

    @property
    def tokens_per_step(self) -> int:
        """Mean input tokens per batch over one cycle (all ranks), rounded."""
        total = sum(c * ld.tokens_per_step for c, ld in zip(self.counts, self.loaders, strict=True))
        return round(total / len(self.cycle))

    def current(self) -> PackedLoader:
        """The loader the next batch comes from."""
        return self.loaders[self.cycle[self.step % len(self.cycle)]]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self.current())
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "counts": list(self.counts),
            "loaders": [ld.state_dict() for ld in self.loaders],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION or "loaders" not in state:
            raise ValueError("loader state is not an AlternatingLoader's of this version")
        if list(state["counts"]) != self.counts or len(state["loaders"]) != len(self.loaders):
            raise ValueError(
                f"loader state alternates {state['counts']} batches, this loader {self.counts}"
            )
        for ld, sub in zip(self.loaders, state["loaders"], strict=True):
            ld.load_state_dict(sub)
        self.step = state["step"]
