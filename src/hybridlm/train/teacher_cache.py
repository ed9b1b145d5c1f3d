"""Cached teacher top-k: one teacher pass writes each token's top-k (ids, log-probs) to disk, and
distillation reads them instead of running the teacher (Nemotron 3.5: pretraining-scale
distillation from cached top-128 teacher logits; `hybridlm distill-cache`).

Shape legend: B rows, L sequence, V vocabulary, K cached top-k, T selected token positions.

A cache is a directory with one folder per example set (`train`, `held`), built for an exact
list of tokenised conversations (`ChatExample`s):

    meta.json                       teacher, k, vocab size, log-prob dtype, per set: the
                                    examples' fingerprint, examples per shard, finished shards
    <set>/offsets.npy               int64 [N + 1]: example i's tokens are rows
                                    offsets[i]..offsets[i+1] of the set's token stream
    <set>/shard_00000.ids.npy       int32 [tokens of the shard's examples, K], memory-mapped
    <set>/shard_00000.logp.npy      float32 (or float16 / bfloat16 bits) [tokens, K]

Row `offsets[i] + t` holds the teacher's top-k at position t of example i: the next-token
distribution after tokens 0..t, sorted by log-prob, the log-probs normalised over the whole
vocabulary. The top-k forward KL (`objectives.topk_forward_kl`) renormalises over the k kept
entries, so cached log-probs give the same loss as the teacher's logits (they differ per
position by a constant, logsumexp).

Pretraining text (`build_text_teacher_cache`, `TextTeacherTopK`): per source of a pretraining
run, a folder `<source>/` whose `shard_0000k.{ids,logp}.npy` are aligned with the data shard
`shard_0000k.tokens.npy` token for token (entry `ShardSet.token_starts[d] + j` is token j of
document d; the packed loader hands each position's entry to the loss as `token_index`). The
teacher sees each piece of a document alone, as training rows hold them (pieces of at most
seq_len + 1 tokens at stride seq_len, `data.loader`): an entry is the distribution after the
tokens of its piece up to it, so the cache holds for one `seq_len`, and it covers every document
of the source (training and held-out splits alike). meta.json records the data shards' content
hashes; a rebuilt or re-tokenised shard is refused.

The teacher sees each conversation alone (packed rows with per-document masking, as the online
teacher in `OfflineDistiller` sees them), so a cached entry does not depend on how training
packs or shuffles. Shards of `examples_per_shard` examples are written through a temporary
file and recorded in meta.json when complete; a rerun skips the finished ones (resume), and a
cache built for other examples, another k or another teacher is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.loader import PackedLoader
from ..data.sft import ChatExample, SFTLoader
from ..data.shards import ShardSet
from ..files import atomic_write
from ..model.model import HybridLM

VERSION = 1
LOGPROB_DTYPES = ("float32", "float16", "bfloat16")


def fingerprint(examples: Sequence[ChatExample]) -> str:
    """sha256 over the examples' token ids (their order included)."""
    h = hashlib.sha256()
    for ex in examples:
        ids = np.asarray(ex.input_ids, dtype=np.int64)
        h.update(np.int64(len(ids)).tobytes())
        h.update(ids.tobytes())
    return h.hexdigest()


def _shard_name(s: int) -> str:
    return f"shard_{s:05d}"


def _save_npy(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda fh: np.save(fh, array))


def _encode_logp(logp: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # numpy has no bfloat16: its 16 bits as int16
        return logp.to(torch.bfloat16).view(torch.int16).numpy()
    return logp.to(getattr(torch, dtype)).numpy()


def _stored_dtype(dtype: str) -> np.dtype:
    """How log-probs of `dtype` are stored (bfloat16 as its 16 bits in int16)."""
    return np.dtype(np.int16 if dtype == "bfloat16" else dtype)


def _decode_logp(raw: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(raw))
    return (t.view(torch.bfloat16) if dtype == "bfloat16" else t).float()


@dataclass(frozen=True)
class CacheSpec:
    teacher: str
    k: int
    vocab_size: int
    logprob_dtype: str = "float32"
    examples_per_shard: int = 256


def _read_meta(root: Path) -> dict[str, Any] | None:
    path = root / "meta.json"
    return json.loads(path.read_text()) if path.exists() else None


def _write_meta(root: Path, meta: dict[str, Any]) -> None:
    atomic_write(root / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())


class _Pass:
    """One teacher pass over a cache's shards (both kinds): the shard being filled, written
    through memory-mapped temporary files (a shard's entries never sit in memory whole) and
    renamed into place when complete, then recorded in meta.json (a shard is done once
    recorded); and the pass's counters."""

    def __init__(self, root: Path, meta: dict[str, Any], k: int, dtype: str, progress: bool):
        self.root, self.meta, self.k, self.dtype, self.progress = root, meta, k, dtype, progress
        self.t0, self.tokens, self.written, self.skipped = time.perf_counter(), 0, 0, 0
        self.logp_dtype = _stored_dtype(dtype)

    def start(self, name: str, s: int, n_tok: int) -> None:
        self.paths = {
            part: self.root / name / f"{_shard_name(s)}.{part}.npy" for part in ("ids", "logp")
        }
        self.maps = {
            part: np.lib.format.open_memmap(
                path.with_suffix(".tmp"),
                mode="w+",
                dtype=np.int32 if part == "ids" else self.logp_dtype,
                shape=(n_tok, self.k),
            )
            for part, path in self.paths.items()
        }

    def add(self, rows_T: torch.Tensor, logits_TV: torch.Tensor) -> None:
        """The top-k of the log-softmax of `logits_TV` into rows `rows_T` of the shard."""
        top_TK, top_ids_TK = torch.log_softmax(logits_TV.float(), dim=-1).topk(self.k, dim=-1)
        rows = rows_T.cpu().numpy()
        self.maps["logp"][rows] = _encode_logp(top_TK.cpu(), self.dtype)
        self.maps["ids"][rows] = top_ids_TK.cpu().to(torch.int32).numpy()

    def save(self, name: str, s: int, num_shards: int) -> None:
        n_tok = len(self.maps["ids"])
        for part, path in self.paths.items():
            self.maps[part].flush()
            del self.maps[part]
            os.replace(path.with_suffix(".tmp"), path)
        info = self.meta["sets"][name]
        info["done"] = sorted({*info["done"], s})
        _write_meta(self.root, self.meta)
        self.tokens += n_tok
        self.written += 1
        if self.progress:
            print(f"teacher cache {name}: shard {s + 1}/{num_shards} ({n_tok} tokens)")

    def result(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "bytes_per_token": self.k * (4 + self.logp_dtype.itemsize),
            "seconds": time.perf_counter() - self.t0,
            "shards_written": self.written,
            "shards_skipped": self.skipped,
        }


def _open_shards(
    root: Path, name: str, info: dict[str, Any], num_shards: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The memory-mapped (ids, log-probs) of a finished set's shards."""
    missing = sorted(set(range(num_shards)) - set(info["done"]))
    if missing:
        raise ValueError(
            f"teacher cache {root} ({name}) is unfinished: shards {missing[:5]} missing "
            "(rerun `hybridlm distill-cache` to finish it)"
        )
    folder = root / name
    return tuple(  # type: ignore[return-value]
        [np.load(folder / f"{_shard_name(s)}.{part}.npy", mmap_mode="r") for s in range(num_shards)]
        for part in ("ids", "logp")
    )


class _Reader:
    """What both cache readers share: the finished cache's meta.json (refused when missing, of
    another version or of the other kind), its k / vocabulary / dtype, and the gather."""

    KIND: str | None = None  # meta.json "kind": None for conversations, "text" for shards
    WHAT = "conversation"

    def __init__(self, root: Path) -> None:
        meta = _read_meta(root)
        if meta is None:
            raise ValueError(f"no teacher cache at {root} (build it with `hybridlm distill-cache`)")
        if meta.get("version") != VERSION:
            raise ValueError(
                f"teacher cache {root} has version {meta.get('version')}, need {VERSION}"
            )
        if meta.get("kind") != self.KIND:
            raise ValueError(f"teacher cache {root} is not a {self.WHAT} cache")
        self.meta = meta
        self.k, self.vocab_size, self.dtype = meta["k"], meta["vocab_size"], meta["logprob_dtype"]
        self.teacher = meta["teacher"]

    def width(self, k: int) -> int:
        """The entries a lookup of `k` reads (0: every cached entry)."""
        k = k or self.k
        if k > self.k:
            raise ValueError(f"distill.top_k={k} exceeds the cache's k={self.k}")
        return k

    def gather(
        self,
        id_maps: list[np.ndarray],
        lp_maps: list[np.ndarray],
        shard_T: np.ndarray,
        rows_T: np.ndarray,
        k: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(ids [T, k] int64, stored log-probs [T, k]) of rows `rows_T` of shards `shard_T`."""
        ids = np.empty((len(rows_T), k), dtype=np.int64)
        raw = np.empty((len(rows_T), k), dtype=_stored_dtype(self.dtype))
        for s in np.unique(shard_T):
            sel = shard_T == s
            ids[sel] = id_maps[s][rows_T[sel], :k]
            raw[sel] = lp_maps[s][rows_T[sel], :k]
        return ids, raw


@torch.no_grad()
def build_teacher_cache(
    root: str | Path,
    teacher: HybridLM,
    example_sets: dict[str, Sequence[ChatExample]],
    spec: CacheSpec,
    *,
    seq_len: int,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """Write (or finish) the cache at `root` for `example_sets` ({set name: examples}); returns
    {tokens, bytes_per_token, seconds, shards_written, shards_skipped} of this call (the
    shards it skipped were finished before)."""
    root = Path(root)
    if spec.logprob_dtype not in LOGPROB_DTYPES:
        raise ValueError(f"logprob_dtype must be one of {LOGPROB_DTYPES}, got {spec.logprob_dtype}")
    k = min(spec.k, spec.vocab_size)
    head = {
        "version": VERSION,
        "teacher": spec.teacher,
        "k": k,
        "vocab_size": spec.vocab_size,
        "logprob_dtype": spec.logprob_dtype,
        "examples_per_shard": spec.examples_per_shard,
    }
    meta = _read_meta(root)
    sets = {
        name: {"fingerprint": fingerprint(ex), "num_examples": len(ex)}
        for name, ex in example_sets.items()
    }
    if meta is not None:
        old = {key: meta.get(key) for key in head}
        if old != head or any(
            name in meta["sets"] and {key: meta["sets"][name][key] for key in info} != info
            for name, info in sets.items()
        ):
            raise ValueError(
                f"teacher cache {root} was built for another teacher, k, dtype or other "
                "examples: give a new directory or delete it"
            )
    else:
        meta = {**head, "sets": {}}
    for name, info in sets.items():
        meta["sets"].setdefault(name, {**info, "done": []})
    _write_meta(root, meta)

    teacher = teacher.to(device).eval()
    run = _Pass(root, meta, k, spec.logprob_dtype, progress)
    E = spec.examples_per_shard
    for name, examples in example_sets.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        lengths = np.array([len(ex) for ex in examples], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        _save_npy(folder / "offsets.npy", offsets)
        num_shards = -(-len(examples) // E)
        for s in range(num_shards):
            lo, hi = s * E, min(len(examples), (s + 1) * E)
            if s in meta["sets"][name]["done"]:
                run.skipped += 1
                continue
            run.start(name, s, int(offsets[hi] - offsets[lo]))
            local = offsets[lo:hi] - offsets[lo]
            chunk = list(examples[lo:hi])
            loader = SFTLoader(chunk, seq_len=seq_len, batch_size=batch_size, sequential=True)
            for batch in loader:
                ids_BL = batch["input_ids"].to(device)
                doc_BL = batch["doc_ids"].to(device)
                logits = teacher(ids_BL, doc_ids=doc_BL, mtp_depth=0).logits
                conv_BL, pos_BL = batch["conv_ids"], batch["position_ids"]
                keep_BL = conv_BL >= 0
                rows = torch.from_numpy(local)[conv_BL[keep_BL]] + pos_BL[keep_BL]
                run.add(rows, logits[keep_BL.to(device)])
            run.save(name, s, num_shards)
    return run.result()


class TeacherTopK(_Reader):
    """One example set of a finished cache, memory-mapped; `lookup` gathers the top-k of the
    positions a packed micro-batch selects."""

    def __init__(self, root: str | Path, name: str, examples: Sequence[ChatExample]) -> None:
        root = Path(root)
        super().__init__(root)
        meta = self.meta
        info = meta["sets"].get(name)
        if info is None:
            raise ValueError(f"teacher cache {root} has no {name!r} set")
        if info["fingerprint"] != fingerprint(examples):
            raise ValueError(
                f"teacher cache {root} ({name}) was built for other conversations than this run's "
                "(data, tokenizer or held-out split changed): rebuild it"
            )
        E = meta["examples_per_shard"]
        self.ids, self.logp = _open_shards(root, name, info, -(-info["num_examples"] // E))
        self.offsets = np.load(root / name / "offsets.npy")
        self.examples_per_shard = E

    def lookup(
        self, conv_BL: torch.Tensor, pos_BL: torch.Tensor, mask_BL: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [T, k], ids [T, k]) of the positions where `mask_BL` is true, in row-major
        order (as `tensor[mask_BL]` selects); `conv_BL` / `pos_BL` are the micro-batch's example
        indices and positions (`collate_rows`)."""
        k = self.width(k)
        conv = conv_BL[mask_BL].cpu().numpy()
        pos = pos_BL[mask_BL].cpu().numpy()
        if (conv < 0).any():
            raise ValueError("a selected position belongs to no conversation (padding)")
        E = self.examples_per_shard
        shard = conv // E
        row = self.offsets[conv] - self.offsets[shard * E] + pos
        ids, raw = self.gather(self.ids, self.logp, shard, row, k)
        return _decode_logp(raw, self.dtype), torch.from_numpy(ids)


# ---------------------------------------------------------------------- pretraining text
def _text_head(spec: CacheSpec, seq_len: int) -> dict[str, Any]:
    return {
        "version": VERSION,
        "kind": "text",
        "teacher": spec.teacher,
        "k": min(spec.k, spec.vocab_size),
        "vocab_size": spec.vocab_size,
        "logprob_dtype": spec.logprob_dtype,
        "seq_len": seq_len,
    }


def _shard_hashes(shards: ShardSet) -> list[str]:
    return [r["sha256"] for r in shards.manifest["shards"]]


@torch.no_grad()
def build_text_teacher_cache(
    root: str | Path,
    teacher: HybridLM,
    sources: dict[str, ShardSet],
    spec: CacheSpec,
    *,
    seq_len: int,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """Write (or finish) the cache of a pretraining run's `sources` ({name: the source's whole
    ShardSet}) at `root`, one data shard at a time (module docstring); returns {tokens,
    bytes_per_token, seconds, shards_written, shards_skipped} of this call."""
    root = Path(root)
    if spec.logprob_dtype not in LOGPROB_DTYPES:
        raise ValueError(f"logprob_dtype must be one of {LOGPROB_DTYPES}, got {spec.logprob_dtype}")
    head = _text_head(spec, seq_len)
    k = head["k"]
    meta = _read_meta(root)
    if meta is not None and (
        {key: meta.get(key) for key in head} != head
        or any(
            name in meta["sets"] and meta["sets"][name]["shards"] != _shard_hashes(sh)
            for name, sh in sources.items()
        )
    ):
        raise ValueError(
            f"teacher cache {root} was built for another teacher, k, dtype, seq_len or other "
            "data shards: give a new directory or delete it"
        )
    meta = meta or {**head, "sets": {}}
    for name, sh in sources.items():
        meta["sets"].setdefault(name, {"shards": _shard_hashes(sh), "done": []})
    _write_meta(root, meta)

    teacher = teacher.to(device).eval()
    run = _Pass(root, meta, k, spec.logprob_dtype, progress)
    for name, sh in sources.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        starts = sh.shard_token_starts
        for s in range(len(starts) - 1):
            if s in meta["sets"][name]["done"]:
                run.skipped += 1
                continue
            run.start(name, s, int(starts[s + 1] - starts[s]))
            docs = np.flatnonzero(sh.shard_of == s)
            batches = (
                PackedLoader(
                    sh.subset(docs), seq_len=seq_len, batch_size=batch_size, sequential=True
                )
                if len(docs)
                else []
            )
            for batch in batches:
                # every position with a target: the training loss reads no others
                keep_BL = batch["targets"] != -100
                ids_BL, doc_BL = batch["input_ids"].to(device), batch["doc_ids"].to(device)
                logits = teacher(ids_BL, doc_ids=doc_BL).logits
                run.add(batch["token_index"][keep_BL] - int(starts[s]), logits[keep_BL.to(device)])
            run.save(name, s, len(starts) - 1)
    return run.result()


class TextTeacherTopK(_Reader):
    """A finished pretraining-text cache for a run's sources, memory-mapped; `lookup` gathers
    the top-k at the positions a packed batch selects (by `source_ids` and `token_index`)."""

    KIND, WHAT = "text", "pretraining-text"

    def __init__(self, root: str | Path, sources: dict[str, ShardSet], *, seq_len: int) -> None:
        root = Path(root)
        super().__init__(root)
        meta = self.meta
        if meta["seq_len"] != seq_len:
            raise ValueError(
                f"teacher cache {root} was built for seq_len {meta['seq_len']}, this run has "
                f"{seq_len} (documents split into other pieces): rebuild it"
            )
        self.sources: dict[str, tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]] = {}
        for name, sh in sources.items():
            info = meta["sets"].get(name)
            if info is None:
                raise ValueError(f"teacher cache {root} has no source {name!r}")
            if info["shards"] != _shard_hashes(sh):
                raise ValueError(
                    f"teacher cache {root} ({name}) was built for other data shards "
                    "(re-tokenised or rebuilt): rebuild it"
                )
            ids, logp = _open_shards(root, name, info, len(info["shards"]))
            self.sources[name] = (sh.shard_token_starts, ids, logp)

    def lookup(
        self,
        names: list[str],
        source_BL: torch.Tensor,
        index_BL: torch.Tensor,
        mask_BL: torch.Tensor,
        k: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [T, k], ids [T, k]) of the positions where `mask_BL` is true, in row-major
        order; `source_BL` / `index_BL` are the batch's `source_ids` (indices into `names`, its
        loader's sources) and `token_index`."""
        k = self.width(k)
        src = source_BL[mask_BL].cpu().numpy()
        index = index_BL[mask_BL].cpu().numpy()
        if (src < 0).any() or (index < 0).any():
            raise ValueError("a selected position is padding: it has no cached entry")
        ids = np.empty((len(src), k), dtype=np.int64)
        raw = np.empty((len(src), k), dtype=_stored_dtype(self.dtype))
        for i in np.unique(src):
            if names[i] not in self.sources:
                raise ValueError(f"the teacher cache has no source {names[i]!r}")
            starts, id_maps, lp_maps = self.sources[names[i]]
            where = np.flatnonzero(src == i)
            shard = np.searchsorted(starts, index[where], side="right") - 1
            ids[where], raw[where] = self.gather(
                id_maps, lp_maps, shard, index[where] - starts[shard], k
            )
        return _decode_logp(raw, self.dtype), torch.from_numpy(ids)
