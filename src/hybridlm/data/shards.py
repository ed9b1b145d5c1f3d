"""Tokenised, memory-mapped document shards: written in parallel, deterministic, resumable.

Layout of a shard directory (`write_shards(source, tokenizer, out_dir)`):

    manifest.json                totals, tokenizer hash, dtype, settings, source stats, shards
    shard_00000.tokens.npy       uint16 (vocab <= 65536) or uint32: documents back to back
    shard_00000.offsets.npy      int64 [docs + 1]: document d is tokens[offsets[d]:offsets[d+1]]
    shard_00000.keys.npy         uint64 [docs]: first 8 bytes of blake2b(document id), for
                                 hash-based held-out splits that survive re-sharding
    shard_00000.json             the shard's record (also in the manifest): counts, sha256 of its
                                 content, sha256 of its input (documents + tokenizer + settings)

Each document is `[BOS] + encode(text) + [EOS]` (BOS as configured). Shard boundaries are fixed
by the documents alone (`shard_chars` characters / `shard_docs` documents, whichever comes
first), and workers' results are gathered in order, so the bytes do not depend on the number of
workers. A shard whose record exists, whose input hash matches and whose files hash to the
recorded content hash is not tokenised again (resume after a crash, or add documents at the end).
`ShardSet(dir)` opens the shards with `np.load(mmap_mode="r")` (an `np.memmap`).

`hybridlm shard OUT [--tokenizer DIR] [--workers N]` shards the embedded default corpus (the
standard library, `shard_text`) and prints throughput.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..files import atomic_write
from .bpe import load_tokenizer, tokenizer_sha256
from .sources import (
    Document,
    DocumentSource,
    IterableSource,
    SourceStats,
    StdlibSource,
    TextFileSource,
)

FORMAT = "hybridlm-shards"
FORMAT_VERSION = 1
_FILES = ("tokens", "offsets", "keys")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def doc_key(doc_id: str) -> int:
    """Stable 64-bit key of a document id (blake2b), used for hash-based splits."""
    return int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "little")


def _shard_name(index: int, part: str) -> str:
    return f"shard_{index:05d}.{part}.npy" if part in _FILES else f"shard_{index:05d}.{part}"


def _file_sha256(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------- workers
_WORKER: dict[str, Any] = {}


def _init_worker(
    tokenizer: Any, add_bos: bool, add_eos: bool, dtype: str, in_worker: bool = True
) -> None:
    if in_worker:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _WORKER.update(tokenizer=tokenizer, add_bos=add_bos, add_eos=add_eos, dtype=np.dtype(dtype))


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of `texts` back to back and their lengths, in the worker's tokenizer."""
    tok, add_bos, add_eos = _WORKER["tokenizer"], _WORKER["add_bos"], _WORKER["add_eos"]
    dtype = _WORKER["dtype"]
    pieces, lengths = [], np.empty(len(texts), dtype=np.int64)
    limit = np.iinfo(dtype).max
    for k, text in enumerate(texts):
        ids = tok.encode(text, add_bos=add_bos)
        if add_eos:
            ids.append(tok.eos_id)
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.max() > limit or arr.min() < 0):
            raise ValueError(f"token id {int(arr.max())} does not fit {dtype.name}")
        pieces.append(arr.astype(dtype))
        lengths[k] = arr.size
    tokens = np.concatenate(pieces) if pieces else np.empty(0, dtype=dtype)
    return tokens, lengths


@dataclass
class WriteReport:
    """What `write_shards` did: the manifest, how many shards it wrote / reused, timing."""

    manifest: dict[str, Any]
    shards_written: int
    shards_reused: int
    seconds: float
    stats: SourceStats = field(default_factory=SourceStats)

    @property
    def num_documents(self) -> int:
        return self.manifest["num_documents"]

    @property
    def num_tokens(self) -> int:
        return self.manifest["num_tokens"]

    @property
    def docs_per_second(self) -> float:
        return self.num_documents / max(self.seconds, 1e-9)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / max(self.seconds, 1e-9)


@dataclass
class _Pending:
    index: int
    ids: list[str]
    texts: list[str]
    input_sha256: str
    chars: int


def _group_shards(
    docs: Iterable[Document], shard_chars: int, shard_docs: int | None, salt: bytes
) -> Iterator[_Pending]:
    """Cut the document stream into shards (by characters / documents, never by tokens, so the
    cut is known before tokenising) and hash each shard's input."""
    index, ids, texts, chars, h = 0, [], [], 0, hashlib.sha256(salt)
    for doc in docs:
        # a document derived from another (a synthetic task over a segment) names its parent in
        # metadata "split_id", so hash splits keep it on its parent's side
        ids.append(str(doc.metadata.get("split_id", doc.id)))
        texts.append(doc.text)
        chars += len(doc.text)
        for part in (doc.id, doc.text):
            data = part.encode("utf-8", errors="surrogatepass")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        if chars >= shard_chars or (shard_docs is not None and len(ids) >= shard_docs):
            yield _Pending(index, ids, texts, h.hexdigest(), chars)
            index, ids, texts, chars, h = index + 1, [], [], 0, hashlib.sha256(salt)
    if ids:
        yield _Pending(index, ids, texts, h.hexdigest(), chars)


def _chunks(texts: list[str], chunk_docs: int, chunk_chars: int) -> list[list[str]]:
    out, current, size = [], [], 0
    for text in texts:
        current.append(text)
        size += len(text)
        if len(current) >= chunk_docs or size >= chunk_chars:
            out.append(current)
            current, size = [], 0
    if current:
        out.append(current)
    return out


def _existing_record(out_dir: Path, index: int, input_sha256: str) -> dict[str, Any] | None:
    """The shard's record when its files are complete and match; None means rewrite it."""
    record_file = out_dir / _shard_name(index, "json")
    if not record_file.is_file():
        return None
    try:
        record = json.loads(record_file.read_text())
    except json.JSONDecodeError:
        return None
    if record.get("input_sha256") != input_sha256:
        return None
    files = [out_dir / _shard_name(index, p) for p in _FILES]
    if not all(f.is_file() for f in files) or _file_sha256(files) != record.get("sha256"):
        return None
    return record


def _write_shard(
    out_dir: Path, pending: _Pending, results: list[tuple[np.ndarray, np.ndarray]], dtype: np.dtype
) -> dict[str, Any]:
    tokens = (
        np.concatenate([t for t, _ in results]) if results else np.empty(0, dtype=dtype)
    ).astype(dtype, copy=False)
    lengths = np.concatenate([n for _, n in results]) if results else np.empty(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    keys = np.fromiter((doc_key(i) for i in pending.ids), dtype=np.uint64, count=len(pending.ids))
    assert offsets[-1] == tokens.size and len(keys) == len(lengths)
    files = []
    for part, array in (("tokens", tokens), ("offsets", offsets), ("keys", keys)):
        path = out_dir / _shard_name(pending.index, part)
        atomic_write(path, lambda fh, a=array: np.save(fh, a, allow_pickle=False))
        files.append(path)
    record = {
        "index": pending.index,
        "documents": len(lengths),
        "tokens": int(tokens.size),
        "chars": pending.chars,
        "sha256": _file_sha256(files),
        "input_sha256": pending.input_sha256,
        "files": [f.name for f in files],
    }
    record_file = out_dir / _shard_name(pending.index, "json")
    atomic_write(record_file, lambda fh: fh.write(json.dumps(record, indent=1).encode()))
    return record


class _StreamSource(IterableSource):
    """A one-pass iterable of `Document`s (or strings), read lazily, not held in memory."""

    kind = "stream"

    def __init__(self, items: Iterable[Document | str]) -> None:
        self.items = items  # type: ignore[assignment]
        DocumentSource.__init__(self, "documents")


def _default_start_method() -> str:
    # fork starts workers instantly (spawn would re-import torch via hybridlm/__init__, ~2 s);
    # workers only run numpy + tokenizers, never torch.
    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def write_shards(
    source: DocumentSource | Sequence[DocumentSource] | Iterable[Document],
    tokenizer: Any,
    out_dir: str | Path,
    *,
    num_workers: int = 1,
    add_bos: bool = True,
    add_eos: bool = True,
    shard_chars: int = 1 << 26,
    shard_docs: int | None = None,
    chunk_docs: int = 64,
    start_method: str | None = None,
    progress: bool = False,
) -> WriteReport:
    """Tokenise `source` (a `DocumentSource`, several, or an iterable of `Document`s) into
    `out_dir` with `num_workers` processes (<= 1: in this process). See the module docstring for
    the layout. Returns a `WriteReport`; raises `ValueError` when no document survives."""
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if shard_chars <= 0 or (shard_docs is not None and shard_docs <= 0) or chunk_docs <= 0:
        raise ValueError("shard_chars, shard_docs and chunk_docs must be positive")
    if not hasattr(tokenizer, "eos_id") or not hasattr(tokenizer, "encode"):
        raise TypeError("tokenizer needs encode(text, add_bos=...) and eos_id (ByteTokenizer API)")
    if isinstance(source, DocumentSource):
        sources: list[DocumentSource] = [source]
    elif isinstance(source, Sequence) and all(isinstance(s, DocumentSource) for s in source):
        sources = list(source)
    else:
        sources = [_StreamSource(source)]
    if not sources:
        raise ValueError("no sources given")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(int(tokenizer.vocab_size))
    tok_hash = tokenizer_sha256(tokenizer)
    settings = {"add_bos": add_bos, "add_eos": add_eos, "dtype": dtype.name}
    salt = json.dumps({"tokenizer": tok_hash, **settings}, sort_keys=True).encode()

    def documents() -> Iterator[Document]:
        for src in sources:
            yield from src

    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    written = reused = 0
    pool = None
    if num_workers > 1:
        ctx = mp.get_context(start_method or _default_start_method())
        # tokenizers warns in forked children once its thread pool was used; workers are
        # single-threaded anyway, so announce that before forking and restore afterwards.
        previous = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            pool = ctx.Pool(
                num_workers,
                initializer=_init_worker,
                initargs=(tokenizer, add_bos, add_eos, dtype.name),
            )
        finally:
            if previous is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = previous
    else:
        _init_worker(tokenizer, add_bos, add_eos, dtype.name, in_worker=False)

    def finish(pending: _Pending, results: Any) -> None:
        nonlocal written
        got = results.get() if pool is not None else results
        records.append(_write_shard(out_dir, pending, got, dtype))
        written += 1
        if progress:
            r = records[-1]
            print(f"shard {r['index']}: {r['documents']} docs, {r['tokens']} tokens", flush=True)

    try:
        in_flight: tuple[_Pending, Any] | None = None
        for pending in _group_shards(documents(), shard_chars, shard_docs, salt):
            record = _existing_record(out_dir, pending.index, pending.input_sha256)
            if record is not None:
                records.append(record)
                reused += 1
                continue
            chunks = _chunks(pending.texts, chunk_docs, max(1, shard_chars // 64))
            # Submit this shard, then finish the previous one: reading overlaps tokenising.
            if pool is not None:
                job = pool.map_async(_encode_chunk, chunks)
            else:
                job = [_encode_chunk(c) for c in chunks]
            if in_flight is not None:
                finish(*in_flight)
            in_flight = (pending, job)
            if pool is None:
                finish(*in_flight)
                in_flight = None
        if in_flight is not None:
            finish(*in_flight)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    records.sort(key=lambda r: r["index"])

    stats = SourceStats()
    for src in sources:
        stats.documents += src.stats.documents
        stats.chars += src.stats.chars
        for reason, n in src.stats.skipped.items():
            stats.skipped[reason] = stats.skipped.get(reason, 0) + n
        stats.examples.extend(src.stats.examples[: 10 - len(stats.examples)])
    if not records:
        raise ValueError(
            f"no documents to shard from {[s.name for s in sources]}; skipped: "
            f"{stats.skipped or 'nothing'} (e.g. {stats.examples[:3]})"
        )
    _remove_stale(out_dir, len(records))
    pad_id = getattr(tokenizer, "pad_id", None)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "name": sources[0].name if len(sources) == 1 else "+".join(s.name for s in sources),
        "tokenizer": {
            "sha256": tok_hash,
            "class": type(tokenizer).__name__,
            "vocab_size": int(tokenizer.vocab_size),
            "bos_id": int(tokenizer.bos_id),
            "eos_id": int(tokenizer.eos_id),
            "pad_id": int(pad_id if pad_id is not None else tokenizer.eos_id),
        },
        **settings,
        "num_documents": sum(r["documents"] for r in records),
        "num_tokens": sum(r["tokens"] for r in records),
        "sources": [{**s.describe(), "stats": s.stats.to_dict()} for s in sources],
        "shards": records,
    }
    text = json.dumps(manifest, indent=1, default=str)
    atomic_write(out_dir / "manifest.json", lambda fh: fh.write(text.encode()))
    return WriteReport(manifest, written, reused, time.perf_counter() - start, stats)


def _remove_stale(out_dir: Path, num_shards: int) -> None:
    """Drop shard files beyond the last shard (the input shrank since an earlier run)."""
    for path in out_dir.glob("shard_*"):
        try:
            index = int(path.name[6:11])
        except ValueError:
            continue
        if index >= num_shards or path.name.endswith(".tmp"):
            path.unlink()


# ---------------------------------------------------------------------------- reading
class ShardSet:
    """The documents of a shard directory, memory-mapped. Index documents globally
    (`document(i)`, `lengths[i]`, `keys[i]`); `subset(indices)` and `split(...)` give views that
    share the memory maps (held-out splits)."""

    def __init__(self, path: str | Path, *, verify: bool = False) -> None:
        self.path = Path(path)
        manifest_file = self.path / "manifest.json"
        if not manifest_file.is_file():
            raise ValueError(
                f"no manifest.json in {self.path}: write shards first "
                "(hybridlm.data.shards.write_shards(source, tokenizer, dir))"
            )
        try:
            self.manifest: dict[str, Any] = json.loads(manifest_file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"cannot parse {manifest_file}: {err}") from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{manifest_file} is not a {FORMAT} v{FORMAT_VERSION} manifest "
                f"(format={self.manifest.get('format')!r}, version={self.manifest.get('version')})"
            )
        if verify:
            self.verify()
        self.dtype = np.dtype(self.manifest["dtype"])
        tok = self.manifest["tokenizer"]
        self.vocab_size, self.bos_id, self.eos_id = tok["vocab_size"], tok["bos_id"], tok["eos_id"]
        self.pad_id: int = tok.get("pad_id", self.eos_id)
        self.tokenizer_sha256: str = tok["sha256"]
        self._tokens: list[np.ndarray | None] = [None] * len(self.manifest["shards"])
        shard_of, start, keys = [], [], []
        for k, record in enumerate(self.manifest["shards"]):
            offsets = self._load(k, "offsets")
            if len(offsets) != record["documents"] + 1 or int(offsets[-1]) != record["tokens"]:
                raise ValueError(
                    f"{self.path / _shard_name(k, 'offsets')} does not match manifest.json; "
                    "rewrite the shards (write_shards skips the intact ones)"
                )
            shard_of.append(np.full(record["documents"], k, dtype=np.int32))
            start.append(offsets)
            keys.append(self._load(k, "keys"))
        self._doc_shard = np.concatenate(shard_of) if shard_of else np.empty(0, np.int32)
        self._doc_start = (
            np.concatenate([o[:-1] for o in start]) if start else np.empty(0, np.int64)
        )
        all_lengths = np.concatenate([np.diff(o) for o in start]) if start else np.empty(0)
        self._all_lengths = all_lengths.astype(np.int64)
        self._all_keys = np.concatenate(keys) if keys else np.empty(0, np.uint64)
        # where each shard's tokens start in the set's token stream (all shards back to back)
        counts = [int(r["tokens"]) for r in self.manifest["shards"]]
        self.shard_token_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._all_token_starts = self.shard_token_starts[self._doc_shard] + self._doc_start
        self._index: np.ndarray | None = None  # None: all documents

    def _load(self, shard: int, part: str) -> np.ndarray:
        file = self.path / _shard_name(shard, part)
        if not file.is_file():
            raise ValueError(f"missing shard file {file}; rewrite the shards with write_shards")
        try:
            return np.load(file, mmap_mode="r" if part == "tokens" else None, allow_pickle=False)
        except (ValueError, OSError) as err:
            raise ValueError(f"cannot read shard file {file}: {err}") from None

    # ------------------------------------------------------------------ views
    @property
    def name(self) -> str:
        return self.manifest.get("name", self.path.name)

    @property
    def index(self) -> np.ndarray:
        """Global document indices of this view."""
        return self._index if self._index is not None else np.arange(len(self._all_lengths))

    def subset(self, indices: Sequence[int] | np.ndarray) -> ShardSet:
        """A view of documents `indices` (positions in this view), sharing the memory maps."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise ValueError(f"subset indices must be in [0, {len(self)}), got {idx.min()}..")
        view = object.__new__(ShardSet)
        view.__dict__.update(self.__dict__)
        view._index = self.index[idx]
        return view

    def split(
        self, *, eval_docs: int = 0, eval_fraction: float = 0.0, method: str = "hash"
    ) -> tuple[ShardSet, ShardSet]:
        """(train, held-out) views. `method="last"`: the last `eval_docs` documents (or
        `eval_fraction` of them). `method="hash"`: documents whose id hashes below
        `eval_fraction` (stable when documents are added or re-sharded); `eval_docs` then caps
        the held-out count."""
        if eval_fraction < 0 or eval_fraction >= 1:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        if eval_docs < 0:
            raise ValueError(f"eval_docs must be >= 0, got {eval_docs}")
        n = len(self)
        if method == "last":
            count = eval_docs or int(round(eval_fraction * n))
            if count >= n and n:
                raise ValueError(f"eval split of {count} documents leaves none of {n} to train on")
            held = np.arange(n - count, n)
        elif method == "hash":
            threshold = np.uint64(min(int(eval_fraction * 2.0**64), 2**64 - 1))
            held = np.flatnonzero(self.keys < threshold)
            if eval_docs:
                held = held[:eval_docs]
        else:
            raise ValueError(f"split method must be 'last' or 'hash', got {method!r}")
        mask = np.ones(n, dtype=bool)
        mask[held] = False
        return self.subset(np.flatnonzero(mask)), self.subset(held)

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self._all_lengths) if self._index is None else len(self._index)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per document (int64, BOS/EOS included)."""
        return self._all_lengths if self._index is None else self._all_lengths[self._index]

    @property
    def shard_of(self) -> np.ndarray:
        """The shard each document is stored in (int32)."""
        return self._doc_shard if self._index is None else self._doc_shard[self._index]

    @property
    def token_starts(self) -> np.ndarray:
        """Where each document starts in the token stream of all shards (int64): token j of
        document i is entry `token_starts[i] + j` of per-token data aligned with the shards
        (e.g. a teacher's cached top-k)."""
        s = self._all_token_starts
        return s if self._index is None else s[self._index]

    @property
    def keys(self) -> np.ndarray:
        return self._all_keys if self._index is None else self._all_keys[self._index]

    @property
    def num_documents(self) -> int:
        return len(self)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def _shard_tokens(self, shard: int) -> np.ndarray:
        tokens = self._tokens[shard]
        if tokens is None:
            tokens = self._tokens[shard] = self._load(shard, "tokens")
        return tokens

    def document(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Tokens `[start:stop]` of document `i` of this view (a read-only memmap slice)."""
        g = int(self.index[i]) if self._index is not None else int(i)
        if not 0 <= g < len(self._all_lengths):
            raise IndexError(f"document {i} out of range for {len(self)} documents")
        n = int(self._all_lengths[g])
        stop = n if stop is None else min(stop, n)
        base = int(self._doc_start[g])
        return self._shard_tokens(int(self._doc_shard[g]))[base + start : base + stop]

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self.document(i)

    def verify(self) -> None:
        """Recompute every shard's sha256; ValueError naming the first shard that differs."""
        for record in self.manifest["shards"]:
            files = [self.path / _shard_name(record["index"], p) for p in _FILES]
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise ValueError(f"missing shard file {missing[0]}")
            if _file_sha256(files) != record["sha256"]:
                raise ValueError(
                    f"shard {record['index']} in {self.path} does not match its sha256 in "
                    "manifest.json (corrupt or modified); rerun write_shards to rewrite it"
                )

    def __repr__(self) -> str:
        return (
            f"ShardSet({str(self.path)!r}, documents={len(self)}, tokens={self.num_tokens}, "
            f"dtype={self.dtype.name})"
        )


# ---------------------------------------------------------------------------- text corpora
def text_source(paths: Sequence[str | Path] = ()) -> DocumentSource:
    """Text files / folders, or the embedded default corpus (the standard library) when none."""
    return TextFileSource(paths) if paths else StdlibSource()


def shard_text(
    out_dir: str | Path,
    paths: Sequence[str | Path] = (),
    *,
    tokenizer: Any = "byte",
    num_workers: int = 1,
    shard_chars: int = 1 << 26,
) -> WriteReport:
    """Tokenise text files / folders (`text_source(paths)`) into shards in `out_dir`;
    `tokenizer`: "byte", a tokenizer directory or a tokenizer (`hybridlm shard`)."""
    if isinstance(tokenizer, str | Path):
        tokenizer = load_tokenizer(tokenizer)
    return write_shards(
        text_source(paths), tokenizer, out_dir, num_workers=num_workers, shard_chars=shard_chars
    )
