"""From a `DataConfig` to loaders: sources -> tokenizer -> shards -> train / held-out loaders.

cfg = DataConfig.load("data.yaml")
sets = prepare_shards(cfg)                   # resumable: intact shards are not redone
train, held_out = build_loaders(cfg, sets, rank=rank, world_size=world)
batch = next(train)                          # input_ids, labels, doc_ids, position_ids, ...
meta["data"] = train.state_dict()            # ... and train.load_state_dict(meta["data"])
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .bpe import load_tokenizer, train_bpe
from .config import DataConfig, SourceConfig
from .loader import AlternatingLoader, PackedLoader
from .longcontext import LongContextTaskSource, LongDocumentSource
from .shards import ShardSet, write_shards
from .sources import (
    Document,
    DocumentSource,
    HFDatasetSource,
    JsonlSource,
    ParquetSource,
    StdlibSource,
    TextFileSource,
    tinyshakespeare,
)


def build_source(cfg: SourceConfig, seed: int = 0) -> DocumentSource:
    """The `DocumentSource` a `SourceConfig` describes (not for kind `shards`): the corpus of its
    kind, restricted to long documents (`min_chars`, `gzip_band`) and turned into synthetic
    long-context tasks (`longcontext_tasks`, drawn from `seed`) when those are set."""
    source = _corpus(cfg)
    if cfg.min_chars or cfg.gzip_band:
        source = LongDocumentSource(
            source, min_chars=cfg.min_chars, gzip_band=cfg.gzip_band, name=cfg.name
        )
    if cfg.longcontext_tasks:
        source = LongContextTaskSource(
            source,
            tasks=cfg.longcontext_tasks,
            segment_chars=cfg.segment_chars,
            seed=seed,
            name=cfg.name,
        )
    return source


def _corpus(cfg: SourceConfig) -> DocumentSource:
    kw: dict[str, Any] = {"name": cfg.name}
    if cfg.pattern:
        kw["pattern"] = cfg.pattern
    if cfg.kind == "text":
        return TextFileSource(
            cfg.path,
            split=cfg.split,
            separator=cfg.separator or None,
            group_chars=cfg.group_chars,
            **kw,
        )
    if cfg.kind == "tinyshakespeare":
        return tinyshakespeare(cfg.path, group_chars=cfg.group_chars, name=cfg.name)
    if cfg.kind == "jsonl":
        return JsonlSource(
            cfg.path,
            text_field=cfg.text_field,
            id_field=cfg.id_field or None,
            metadata_fields=cfg.metadata_fields,
            **kw,
        )
    if cfg.kind == "parquet":
        return ParquetSource(
            cfg.path, text_column=cfg.text_field, id_column=cfg.id_field or None, **kw
        )
    if cfg.kind == "hf":
        return HFDatasetSource(
            cfg.path,
            config_name=cfg.hf_config or None,
            split=cfg.hf_split,
            text_field=cfg.text_field,
            id_field=cfg.id_field or None,
            data_files=cfg.data_files or None,
            name=cfg.name,
        )
    if cfg.kind == "stdlib":
        return StdlibSource(
            docstrings_only=cfg.docstrings_only, max_files=cfg.max_files or None, name=cfg.name
        )
    raise ValueError(f"source {cfg.name!r}: kind {cfg.kind!r} has no document source")


def _training_texts(cfg: DataConfig) -> Iterator[Document]:
    """Documents for tokenizer training: each source's share of `tokenizer_train_chars` is
    proportional to its weight (sources of kind `shards` are skipped)."""
    usable = [s for s in cfg.sources if s.kind != "shards" and s.weight > 0]
    total = sum(s.weight for s in usable) or 1.0
    for src_cfg in usable:
        budget = cfg.tokenizer_train_chars * src_cfg.weight / total
        used = 0
        for doc in build_source(src_cfg, cfg.seed):
            if used >= budget:
                break
            used += len(doc.text)
            yield doc


def build_tokenizer(cfg: DataConfig) -> Any:
    """`cfg.tokenizer`: "byte", an existing tokenizer directory, or (with
    `tokenizer_vocab_size > 0`) a directory to train a BPE into from the sources. "" (a run's
    own, resolved from the model it starts from before this is called) is a fresh model's:
    byte."""
    if cfg.tokenizer in ("", "byte"):
        return load_tokenizer("byte")
    path = Path(cfg.tokenizer)
    if (path / "tokenizer.json").is_file() or path.is_file():
        return load_tokenizer(path)  # a saved byte tokenizer stays a ByteTokenizer
    if cfg.tokenizer_vocab_size <= 0:
        raise ValueError(
            f"no tokenizer at {path}: point data.tokenizer at a directory with tokenizer.json, "
            "use 'byte', or set data.tokenizer_vocab_size to train one there"
        )
    tok = train_bpe(_training_texts(cfg), vocab_size=cfg.tokenizer_vocab_size)
    tok.save(path, model_max_length=cfg.seq_len)
    return tok


def prepare_shards(cfg: DataConfig, *, progress: bool = False) -> dict[str, ShardSet]:
    """Shard every source into `<shards_dir>/<name>` (resumable) and open them."""
    tokenizer = None
    sets: dict[str, ShardSet] = {}
    for src_cfg in cfg.sources:
        if src_cfg.kind == "shards":
            sets[src_cfg.name] = ShardSet(src_cfg.path)
            continue
        if tokenizer is None:
            tokenizer = build_tokenizer(cfg)
        out = Path(cfg.shards_dir) / src_cfg.name
        report = write_shards(
            build_source(src_cfg, cfg.seed),
            tokenizer,
            out,
            num_workers=cfg.num_workers,
            add_bos=cfg.add_bos,
            progress=progress,
        )
        if progress:
            print(
                f"{src_cfg.name}: {report.num_documents} docs, {report.num_tokens} tokens "
                f"({report.shards_written} shards written, {report.shards_reused} reused; "
                f"skipped {report.stats.skipped or 'none'})",
                flush=True,
            )
        sets[src_cfg.name] = ShardSet(out)
    return sets


def build_loaders(
    cfg: DataConfig, sets: dict[str, ShardSet], *, rank: int = 0, world_size: int = 1
) -> tuple[PackedLoader | AlternatingLoader, PackedLoader | None]:
    """(train loader, held-out loader or None). The held-out part of every source is
    `cfg.eval_split` of `eval_fraction` / `eval_docs`; it is read once, in order, at
    `cfg.seq_len`. With `cfg.alternate` the train loader alternates the two lengths."""
    missing = [s.name for s in cfg.sources if s.name not in sets]
    if missing:
        raise ValueError(f"no shards for sources {missing}; run prepare_shards(cfg) first")
    train_sets, eval_sets = {}, {}
    for src in cfg.sources:
        shard_set = sets[src.name]
        if cfg.eval_fraction or cfg.eval_docs:
            train, held = shard_set.split(
                eval_docs=cfg.eval_docs, eval_fraction=cfg.eval_fraction, method=cfg.eval_split
            )
            train_sets[src.name] = train
            if len(held):
                eval_sets[src.name] = held
        else:
            train_sets[src.name] = shard_set
    common = {
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "packing": cfg.packing,
        "buffer_docs": cfg.buffer_docs,
        "rank": rank,
        "world_size": world_size,
    }
    all_train = dict(train_sets)
    if cfg.phases:
        mix: dict[str, Any] = {"phases": cfg.phases, "total_tokens": cfg.total_tokens or None}
    else:
        weights = {n: w for n, w in cfg.weights.items() if w > 0}
        train_sets = {n: s for n, s in train_sets.items() if n in weights}
        mix = {"weights": weights, "total_tokens": cfg.total_tokens or None}
    train: PackedLoader | AlternatingLoader
    train = PackedLoader(train_sets, seed=cfg.seed, shuffle=cfg.shuffle, **mix, **common)
    if cfg.alternate is not None:
        alt = cfg.alternate
        alt_mix = {n: w for n, w in (alt.weights or mix.get("weights") or {}).items() if w > 0}
        short = PackedLoader(
            {n: s for n, s in all_train.items() if n in alt_mix},
            seed=cfg.seed + 1,  # its own stream of draws
            shuffle=cfg.shuffle,
            weights=alt_mix,
            **(common | {"seq_len": alt.seq_len, "batch_size": alt.batch_size}),
        )
        train = AlternatingLoader([train, short], [cfg.every, alt.batches])
    held_out = PackedLoader(eval_sets, sequential=True, **common) if eval_sets else None
    return train, held_out
