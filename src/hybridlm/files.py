"""Writing a file so that readers only ever see a whole one, and reading the rows of a
`metrics.jsonl` that a killed writer may have left with half a line."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | Path, data: bytes | Callable[[BinaryIO], object]) -> None:
    """Write `data` (bytes, or a function writing to a binary file) to `path` through a
    temporary file renamed into place. The temporary name is per process: the ranks of a job,
    or parallel workers, may write the same file (the same bytes) at once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        if isinstance(data, bytes | bytearray):
            fh.write(data)
        else:
            data(fh)
    os.replace(tmp, path)


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a `metrics.jsonl` (unparseable lines, e.g. a torn last line, are skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def metric_rows(path: str | Path, kind: str) -> list[dict]:
    """The `kind` rows of a `metrics.jsonl` (none when it does not exist)."""
    if not Path(path).exists():
        return []
    return [r for r in read_metrics(path) if r.get("kind") == kind]
