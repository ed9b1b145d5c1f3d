"""Writing a file so that readers only ever see a whole one."""

from __future__ import annotations

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
