"""The flow's tokenizer stage: a byte-level BPE (`data.bpe.train_bpe`) trained on the
pretraining mix of the run, digits split, written to `<run>/tokenizer` (`kind: byte`: the
256-byte tokenizer, nothing trained)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from ..stage import Flow, Report, Stage
from .bpe import train_bpe
from .config import DataConfig
from .pipeline import build_source
from .sources import Document


@dataclass(kw_only=True)
class TokenizerStageConfig:
    """The BPE trained on the curated corpus (`kind: byte` uses the 256-byte tokenizer)."""

    kind: Literal["bpe", "byte"] = "bpe"
    vocab_size: int = 2048
    min_frequency: int = 2
    split_digits: bool = True  # one token per digit: column arithmetic stays learnable
    max_chars: int = 20_000_000  # characters of the pretraining sources to train on

    def validate(self) -> None:
        if self.kind not in ("bpe", "byte"):
            raise ValueError(f"tokenizer.kind must be 'bpe' or 'byte', got {self.kind!r}")
        if self.kind == "bpe" and self.vocab_size < 300:
            raise ValueError(f"tokenizer.vocab_size must be >= 300, got {self.vocab_size}")


def _settings(flow: Flow) -> dict[str, Any]:
    return {
        **dataclasses.asdict(flow.cfg.tokenizer),
        "sources": flow.settings("pretrain")["data"]["sources"],
    }


def _run(flow: Flow) -> dict[str, Any]:
    tcfg = flow.cfg.tokenizer
    out = flow.stage_dir("tokenizer")
    if tcfg.kind == "byte":
        return {"path": "byte", "vocab_size": 258}
    sources = DataConfig.from_dict(flow.settings("pretrain")["data"]).sources

    def docs() -> Iterator[Document]:  # every source of the pretraining mix, in order, lazily
        for src in sources:
            if src.kind != "shards":
                yield from build_source(src)

    tok = train_bpe(
        docs(),
        vocab_size=tcfg.vocab_size,
        min_frequency=tcfg.min_frequency,
        max_chars=tcfg.max_chars,
        split_digits=tcfg.split_digits,
    )
    tok.save(out)
    sample = "\n".join(d.text for d in itertools.islice(docs(), 50))[:200_000]
    ids = tok.encode(sample, add_bos=False)
    return {
        "path": str(out),
        "vocab_size": tok.vocab_size,
        "split_digits": tcfg.split_digits,
        "bytes_per_token": len(sample.encode()) / max(len(ids), 1),
        "sha256": tok.sha256,
    }


def _headline(s: dict[str, Any], report: Report) -> str:
    bpt = s.get("bytes_per_token")
    return f"vocabulary: {s['vocab_size']} ids" + (f", {bpt:.2f} bytes/token" if bpt else "")


STAGE = Stage(
    "tokenizer",
    inputs=("curate",),
    config=TokenizerStageConfig,
    settings=_settings,
    run=_run,
    check=lambda section, cfg, stages: section.validate(),
    headline=_headline,
)
