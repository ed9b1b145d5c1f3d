"""Small public evaluation sets shipped inside the package, and the gzip-aware readers of them.

    gsm8k/train.jsonl.gz          GSM8K, 7473 problems (few-shot examples, SFT, RL, decon)
    gsm8k/test.jsonl.gz           GSM8K, 1319 problems
    humaneval/HumanEval.jsonl.gz  HumanEval, 164 problems
    tinyshakespeare/input.txt.gz  tinyshakespeare, 1,115,394 characters

Each folder holds the upstream `LICENSE` (all MIT; Shakespeare's text is public domain) and a
`README.md` with the source and the change (gzip compression only). Names follow the usual
on-disk layout (`gsm8k/test.jsonl`, `humaneval/HumanEval.jsonl.gz`, `tinyshakespeare/input.txt`),
so one name finds a file both here and in a user's folder:

    path(GSM8K_TEST)                    # the packaged copy
    path(GSM8K_TEST, "data")            # data/gsm8k/test.jsonl, or data/gsm8k/test.jsonl.gz
    read_jsonl(path(HUMANEVAL))         # 164 dicts
    read_text(path(TINYSHAKESPEARE))    # the whole play text
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, TextIO

GSM8K_TRAIN = "gsm8k/train.jsonl"
GSM8K_TEST = "gsm8k/test.jsonl"
HUMANEVAL = "humaneval/HumanEval.jsonl.gz"
TINYSHAKESPEARE = "tinyshakespeare/input.txt"
NAMES = (GSM8K_TRAIN, GSM8K_TEST, HUMANEVAL, TINYSHAKESPEARE)

ROOT = Path(__file__).resolve().parent


def _gz(name: str) -> str:
    return name if name.endswith(".gz") else name + ".gz"


def path(name: str, data_dir: str | Path | None = None) -> Path:
    """The file `name` (one of `NAMES`): the packaged copy when `data_dir` is None or "", else
    `data_dir/name` (or `data_dir/name.gz` when only that exists). A path under `data_dir` may
    not exist: the caller reports it, or falls back to generated data."""
    if data_dir:
        plain = Path(data_dir) / name
        packed = plain.with_name(_gz(plain.name))
        return packed if not plain.exists() and packed.exists() else plain
    if name not in NAMES:
        raise ValueError(f"no packaged data set {name!r}; packaged: {', '.join(NAMES)}")
    return ROOT / _gz(name)


def open_text(file: str | Path) -> TextIO:
    """A UTF-8 text stream of `file`, decompressed when its name ends in `.gz`."""
    file = Path(file)
    if not file.is_file():
        raise ValueError(f"no such file: {file}")
    if file.name.endswith(".gz"):
        return gzip.open(file, "rt", encoding="utf-8")
    return open(file, encoding="utf-8")


def read_text(file: str | Path) -> str:
    """The whole text of `file` (`.gz` decompressed)."""
    with open_text(file) as f:
        return f.read()


def read_jsonl(file: str | Path, *, limit: int | None = None) -> list[dict[str, Any]]:
    """The rows of a JSON Lines file (`.gz` decompressed), blank lines skipped; the first `limit`
    rows when given. A line that is not JSON is a ValueError naming the file and line."""
    rows: list[dict[str, Any]] = []
    with open_text(file) as f:
        for i, line in enumerate(f):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}:{i + 1}: not JSON ({err})") from None
    return rows
