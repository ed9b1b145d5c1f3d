"""`DataConfig`: the typed, YAML-round-tripping description of a pretraining data pipeline.

    sources:                       # each becomes a shard directory <shards_dir>/<name>
      - {name: web, kind: jsonl, path: data/web, weight: 0.7}
      - {name: code, kind: stdlib, weight: 0.3}
    tokenizer: tokenizers/bpe32k   # "byte", or a tokenizer directory (trained there when absent
    tokenizer_vocab_size: 32768    #  and tokenizer_vocab_size > 0)
    seq_len: 4096
    batch_size: 8                  # rows per data-parallel rank
    packing: best_fit
    phases:                        # optional curriculum; replaces the source weights
      - {fraction: 0.8, weights: {web: 0.7, code: 0.3}}
      - {fraction: 0.2, weights: {web: 0.4, code: 0.6}}
    total_tokens: 1000000000

`hybridlm.data.pipeline` turns it into shards (`prepare_shards`) and loaders (`build_loaders`).
Source kinds map to `hybridlm.data.sources`: text, tinyshakespeare (the packaged copy when `path`
is empty), jsonl, parquet, hf, stdlib, plus `shards` (an existing shard directory at `path`).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from ..config import Config
from .loader import Phase
from .longcontext import check_options

SourceKind = Literal["text", "tinyshakespeare", "jsonl", "parquet", "hf", "stdlib", "shards"]


@dataclass(kw_only=True)
class SourceConfig:
    """One corpus and its mixture weight. Fields a kind does not use are ignored."""

    name: str
    kind: SourceKind = "stdlib"
    path: str = ""  # file / folder / glob; hf: the dataset; shards: the folder; "" for stdlib and
    # tinyshakespeare (the packaged copy)
    weight: float = 1.0  # token fraction in the mixture (normalised over sources)
    pattern: str = ""  # glob inside folders; "" = the kind's default (**/*.txt, **/*.jsonl*, ...)
    split: Literal["file", "blank_line", "separator"] = "file"  # text: how files become docs
    separator: str = ""
    group_chars: int = 0  # text / tinyshakespeare: merge passages up to this many characters
    text_field: str = "text"  # jsonl field (dotted ok) / parquet column / hf column
    id_field: str = ""  # "" = ids from file and line / row
    metadata_fields: list[str] = field(default_factory=list)  # jsonl: kept, e.g. [url, date]
    hf_config: str = ""  # datasets.load_dataset(path, hf_config, split=hf_split, data_files=...)
    hf_split: str = "train"
    data_files: list[str] = field(default_factory=list)
    docstrings_only: bool = False  # stdlib: docstrings instead of source
    max_files: int = 0  # stdlib: 0 = all files
    # long documents (Olmo 3 §5): keep documents of at least `min_chars` characters, and with
    # `gzip_band: [lo, hi]` only those whose gzip ratio lies between those percentiles
    min_chars: int = 0
    gzip_band: list[float] = field(default_factory=list)
    # synthetic long-context tasks (hybridlm.data.longcontext): each of the source's documents is
    # cut into segments of `segment_chars: [min, max]` characters, and every segment becomes one
    # example per task listed (cwe, rex, records, recall, repeat) instead of the documents
    longcontext_tasks: list[str] = field(default_factory=list)
    segment_chars: list[int] = field(default_factory=lambda: [2000, 3000])


@dataclass(kw_only=True)
class AlternateConfig:
    """A second sequence length in turn with the main one (`data.alternate`; Nemotron 3 Super
    §2.6 LC-2 alternates 1M- and 4K-token sequences): each cycle is `data.every` batches of
    `data.seq_len` x `data.batch_size`, then `batches` batches of `seq_len` x `batch_size` drawn
    from `weights` (empty: the main mixture)."""

    seq_len: int = 256
    batch_size: int = 8
    batches: int = 1
    weights: dict[str, float] = field(default_factory=dict)


def _default_sources() -> list[SourceConfig]:
    return [SourceConfig(name="stdlib", kind="stdlib")]


@dataclass(kw_only=True)
class DataConfig(Config):
    """Sources with weights, tokenizer, sharding, packing, curriculum phases, held-out split."""

    WHAT = "data config"
    KEY = "data"

    sources: list[SourceConfig] = field(default_factory=_default_sources)
    # "byte", a tokenizer directory (tokenizer.json), or "": the tokenizer of the model the run
    # starts from (train.init_from), byte for a fresh model (train.trainer.resolve_tokenizer)
    tokenizer: str = ""
    tokenizer_vocab_size: int = 0  # > 0: train a BPE of this size into `tokenizer` if absent
    tokenizer_train_chars: int = 50_000_000  # characters of the sources to train it on
    shards_dir: str = "data/shards"
    num_workers: int = 1  # tokenising processes
    add_bos: bool = True
    seq_len: int = 1024
    batch_size: int = 8  # rows per data-parallel rank
    packing: Literal["best_fit", "greedy"] = "best_fit"
    buffer_docs: int = 1024  # documents per best-fit buffer
    phases: list[Phase] = field(default_factory=list)  # empty: one phase with source weights
    total_tokens: int = 0  # training budget in tokens; needed to place phases
    alternate: AlternateConfig | None = None  # long and short sequences in turn
    every: int = 1  # with `alternate`: batches of the main length per cycle
    seed: int = 0
    shuffle: bool = True
    eval_split: Literal["hash", "last"] = "hash"
    eval_fraction: float = 0.0  # held-out share of each source's documents
    eval_docs: int = 0  # "last": this many documents; "hash": a cap on the held-out count

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        if not self.sources:
            raise ValueError("data.sources must list at least one source")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"data.sources names must be unique, got {names}")
        for k, src in enumerate(self.sources):
            where = f"data.sources[{k}] ({src.name!r})"
            if not src.name or "/" in src.name:
                raise ValueError(f"{where}: name must be non-empty and without '/'")
            if src.kind not in typing.get_args(SourceKind):
                raise ValueError(
                    f"{where}: kind must be one of {list(typing.get_args(SourceKind))}"
                )
            if src.kind not in ("stdlib", "tinyshakespeare") and not src.path:
                raise ValueError(f"{where}: kind {src.kind!r} needs a path")
            if src.weight < 0:
                raise ValueError(f"{where}: weight must be >= 0, got {src.weight}")
            try:
                check_options(
                    min_chars=src.min_chars,
                    gzip_band=src.gzip_band,
                    tasks=src.longcontext_tasks,
                    segment_chars=src.segment_chars,
                )
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            if src.kind == "text" and src.split == "separator" and not src.separator:
                raise ValueError(f"{where}: split 'separator' needs a separator string")
        if not self.phases and not any(s.weight > 0 for s in self.sources):
            raise ValueError("data.sources: at least one source needs a positive weight")
        for name in ("seq_len", "batch_size", "buffer_docs", "tokenizer_train_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"data.{name} must be positive, got {getattr(self, name)}")
        if self.num_workers < 0 or self.total_tokens < 0 or self.eval_docs < 0:
            raise ValueError("data.num_workers, data.total_tokens, data.eval_docs must be >= 0")
        if self.tokenizer_vocab_size and self.tokenizer in ("", "byte"):
            raise ValueError(
                "data.tokenizer_vocab_size trains a BPE: set data.tokenizer to the directory "
                "to train it into (or set the vocab size to 0 for the byte tokenizer)"
            )
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.alternate is not None:
            alt = self.alternate
            if min(alt.seq_len, alt.batch_size, alt.batches, self.every) < 1:
                raise ValueError(
                    "data.alternate.seq_len / batch_size / batches and data.every must be >= 1"
                )
            unknown = sorted(set(alt.weights) - set(names))
            if unknown:
                raise ValueError(f"data.alternate.weights: unknown sources {unknown}")
            if alt.weights and not any(w > 0 for w in alt.weights.values()):
                raise ValueError("data.alternate.weights needs one positive weight")
            if self.phases:
                raise ValueError("data.alternate does not combine with data.phases")
        if self.phases:
            fractions = [p.fraction for p in self.phases]
            if any(f <= 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
                raise ValueError(
                    f"data.phases fractions must be positive and sum to 1, got {fractions}"
                )
            if len(self.phases) > 1 and self.total_tokens <= 0:
                raise ValueError("data.phases with several phases need data.total_tokens > 0")
            for k, phase in enumerate(self.phases):
                unknown = sorted(set(phase.weights) - set(names))
                if unknown:
                    raise ValueError(f"data.phases[{k}].weights: unknown sources {unknown}")

    @property
    def weights(self) -> dict[str, float]:
        return {s.name: s.weight for s in self.sources}
