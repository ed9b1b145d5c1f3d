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

The teacher sees each conversation alone (packed rows with per-document masking, as the online
teacher in `OfflineDistiller` sees them), so a cached entry does not depend on how training
packs or shuffles. Shards of `examples_per_shard` examples are written through a temporary
file and recorded in meta.json when complete; a rerun skips the finished ones (resume), and a
cache built for other examples, another k or another teacher is refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.sft import ChatExample, SFTLoader
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
    t0, tokens, written, skipped = time.perf_counter(), 0, 0, 0
    E = spec.examples_per_shard
    for name, examples in example_sets.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        lengths = np.array([len(ex) for ex in examples], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        _save_npy(folder / "offsets.npy", offsets)
        done = set(meta["sets"][name]["done"])
        num_shards = -(-len(examples) // E)
        for s in range(num_shards):
            lo, hi = s * E, min(len(examples), (s + 1) * E)
            if s in done:
                skipped += 1
                continue
            chunk = list(examples[lo:hi])
            n_tok = int(offsets[hi] - offsets[lo])
            ids = torch.zeros((n_tok, k), dtype=torch.int32)
            logp = torch.zeros((n_tok, k), dtype=torch.float32)
            local = offsets[lo:hi] - offsets[lo]
            loader = SFTLoader(chunk, seq_len=seq_len, batch_size=batch_size, sequential=True)
            for batch in loader:
                ids_BL = batch["input_ids"].to(device)
                doc_BL = batch["doc_ids"].to(device)
                logits = teacher(ids_BL, doc_ids=doc_BL, mtp_depth=0).logits.float()
                conv_BL, pos_BL = batch["conv_ids"], batch["position_ids"]
                keep_BL = conv_BL >= 0
                lp_TV = torch.log_softmax(logits[keep_BL.to(device)], dim=-1)
                top_TK, top_ids_TK = lp_TV.topk(k, dim=-1)
                rows = torch.from_numpy(local)[conv_BL[keep_BL]] + pos_BL[keep_BL]
                logp[rows] = top_TK.cpu()
                ids[rows] = top_ids_TK.cpu().to(torch.int32)
            _save_npy(folder / f"{_shard_name(s)}.ids.npy", ids.numpy())
            _save_npy(folder / f"{_shard_name(s)}.logp.npy", _encode_logp(logp, spec.logprob_dtype))
            done.add(s)
            meta["sets"][name]["done"] = sorted(done)
            _write_meta(root, meta)
            tokens += n_tok
            written += 1
            if progress:
                print(
                    f"teacher cache {name}: shard {s + 1}/{num_shards} ({n_tok} tokens)", flush=True
                )
    return {
        "tokens": tokens,
        "bytes_per_token": k * (4 + (4 if spec.logprob_dtype == "float32" else 2)),
        "seconds": time.perf_counter() - t0,
        "shards_written": written,
        "shards_skipped": skipped,
    }


class TeacherTopK:
    """One example set of a finished cache, memory-mapped; `lookup` gathers the top-k of the
    positions a packed micro-batch selects."""

    def __init__(self, root: str | Path, name: str, examples: Sequence[ChatExample]) -> None:
        root = Path(root)
        meta = _read_meta(root)
        if meta is None:
            raise ValueError(f"no teacher cache at {root} (build it with `hybridlm distill-cache`)")
        if meta.get("version") != VERSION:
            raise ValueError(
                f"teacher cache {root} has version {meta.get('version')}, need {VERSION}"
            )
        info = meta["sets"].get(name)
        if info is None:
            raise ValueError(f"teacher cache {root} has no {name!r} set")
        if info["fingerprint"] != fingerprint(examples):
            raise ValueError(
                f"teacher cache {root} ({name}) was built for other conversations than this run's "
                "(data, tokenizer or held-out split changed): rebuild it"
            )
        E = meta["examples_per_shard"]
        num_shards = -(-info["num_examples"] // E)
        missing = sorted(set(range(num_shards)) - set(info["done"]))
        if missing:
            raise ValueError(
                f"teacher cache {root} ({name}) is unfinished: shards {missing[:5]} missing "
                "(rerun `hybridlm distill-cache` to finish it)"
            )
        self.k, self.vocab_size, self.dtype = meta["k"], meta["vocab_size"], meta["logprob_dtype"]
        self.teacher = meta["teacher"]
        folder = root / name
        self.offsets = np.load(folder / "offsets.npy")
        self.examples_per_shard = E
        self.ids = [
            np.load(folder / f"{_shard_name(s)}.ids.npy", mmap_mode="r") for s in range(num_shards)
        ]
        self.logp = [
            np.load(folder / f"{_shard_name(s)}.logp.npy", mmap_mode="r") for s in range(num_shards)
        ]

    def lookup(
        self, conv_BL: torch.Tensor, pos_BL: torch.Tensor, mask_BL: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [T, k], ids [T, k]) of the positions where `mask_BL` is true, in row-major
        order (as `tensor[mask_BL]` selects); `conv_BL` / `pos_BL` are the micro-batch's example
        indices and positions (`collate_rows`)."""
        k = k or self.k  # 0: every cached entry
        if k > self.k:
            raise ValueError(f"distill.top_k={k} exceeds the cache's k={self.k}")
        conv = conv_BL[mask_BL].cpu().numpy()
        pos = pos_BL[mask_BL].cpu().numpy()
        if (conv < 0).any():
            raise ValueError("a selected position belongs to no conversation (padding)")
        E = self.examples_per_shard
        shard = conv // E
        row = self.offsets[conv] - self.offsets[shard * E] + pos
        ids = np.empty((len(conv), k), dtype=np.int64)
        raw = np.empty((len(conv), k), dtype=self.logp[0].dtype if self.logp else np.float32)
        for s in np.unique(shard):
            sel = shard == s
            ids[sel] = self.ids[s][row[sel], :k]
            raw[sel] = self.logp[s][row[sel], :k]
        return _decode_logp(raw, self.dtype), torch.from_numpy(ids)
