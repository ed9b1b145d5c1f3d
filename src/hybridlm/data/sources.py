"""Document sources: every corpus becomes an iterator of `Document(id, text, source, metadata)`.

    TextFileSource      plain text files and folders (glob; `.gz` decompressed); one document per
                        file, or split on blank lines / a separator (TinyStories' `<|endoftext|>`)
    tinyshakespeare()   a single file of blank-line separated passages (Karpathy's char-rnn data;
                        the packaged copy, `hybridlm.data.builtin`, by default)
    JsonlSource         JSON Lines (`.jsonl`, `.jsonl.gz`), text field configurable (dotted keys)
    ParquetSource       Parquet via pyarrow, text column configurable, read in record batches
    HFDatasetSource     anything `datasets.load_dataset` opens (hub names, local json/parquet/csv)
    StdlibSource        the embedded default: the running interpreter's standard library (.py
                        source or docstrings only), real text on every machine, no network
    IterableSource      documents or strings already in memory (tests, quick experiments)

Order is deterministic (files sorted by their path relative to the root), so shard bytes and
document ids are reproducible. Bad input never crashes a run: undecodable bytes, empty documents,
malformed JSON, corrupt Parquet files, missing fields and non-string values are counted in
`source.stats.skipped` under a reason, with the first few offenders in `source.stats.examples`.
A *missing path* is a configuration error and raises `ValueError` at construction.
"""

from __future__ import annotations

import ast
import glob as globlib
import gzip
import json
import os
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from . import builtin

SplitMode = Literal["file", "blank_line", "separator"]

_BLANK_LINE_RE = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_MAX_EXAMPLES = 10


@dataclass(frozen=True)
class Document:
    """One training document. `id` is unique within its source and stable across runs; it keys
    the hash-based held-out split."""

    id: str
    text: str
    source: str
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class SourceStats:
    """What one pass over a source produced: documents yielded, and skips counted by reason."""

    documents: int = 0
    chars: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)  # first few "where: reason (detail)"

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def skip(self, where: str, reason: str, detail: str = "") -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(f"{where}: {reason}" + (f" ({detail})" if detail else ""))

    def to_dict(self) -> dict[str, Any]:
        return {
            "documents": self.documents,
            "chars": self.chars,
            "skipped": dict(sorted(self.skipped.items())),
            "examples": list(self.examples),
        }


@dataclass(frozen=True)
class _Skip:
    where: str
    reason: str
    detail: str = ""


class DocumentSource:
    """Base class: subclasses implement `_items()`, yielding `Document`s or `_Skip`s.

    Iterating resets `stats`, drops empty / whitespace-only documents (reason `empty`) and
    counts the rest. `describe()` is a JSON-able description that goes into shard manifests."""

    kind = "source"

    def __init__(self, name: str) -> None:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"source name {name!r} must be non-empty, without '/' or leading '.'")
        self.name = name
        self.stats = SourceStats()

    def _items(self) -> Iterator[Document | _Skip]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name}

    def __iter__(self) -> Iterator[Document]:
        self.stats = stats = SourceStats()
        for item in self._items():
            if isinstance(item, _Skip):
                stats.skip(item.where, item.reason, item.detail)
            elif not item.text.strip():
                stats.skip(item.id, "empty")
            else:
                stats.documents += 1
                stats.chars += len(item.text)
                yield item

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.describe().items() if k != "kind")
        return f"{type(self).__name__}({args})"


# ---------------------------------------------------------------------------- file discovery
def _as_list(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    if isinstance(paths, (str, Path)):
        return [Path(paths)]
    out = [Path(p) for p in paths]
    if not out:
        raise ValueError("no paths given: pass a file, a folder or a glob")
    return out


def _discover(paths: list[Path], pattern: str, what: str) -> list[tuple[Path, str]]:
    """(file, id-relative name) pairs in a deterministic order. Folders are globbed with
    `pattern`; a path with glob characters is expanded; a missing path is a ValueError."""
    found: list[tuple[Path, str]] = []
    for path in paths:
        if path.is_file():
            found.append((path, path.name))
        elif path.is_dir():
            files = sorted(
                (p for p in path.glob(pattern) if p.is_file()),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            found.extend((p, p.relative_to(path).as_posix()) for p in files)
        elif globlib.has_magic(str(path)):
            found.extend((Path(p), Path(p).name) for p in sorted(globlib.glob(str(path))))
        else:
            raise ValueError(f"{what} path not found: {path} (give a file, a folder or a glob)")
    return found


def _decode(data: bytes) -> str:
    """Strict UTF-8, dropping a byte-order mark; raises UnicodeDecodeError."""
    text = data.decode("utf-8")
    return text[1:] if text.startswith("\ufeff") else text


def _split_text(text: str, split: SplitMode, separator: str | None) -> list[str]:
    if split == "file":
        return [text]
    if split == "blank_line":
        parts = _BLANK_LINE_RE.split(text)
    else:
        parts = text.split(separator or "")
    return [p.strip("\n") for p in parts]


def _group(parts: list[str], min_chars: int, joiner: str) -> list[str]:
    """Merge consecutive non-empty parts until each group has at least `min_chars` characters."""
    if min_chars <= 0:
        return parts
    groups, current, size = [], [], 0
    for part in parts:
        if not part.strip():
            continue
        current.append(part)
        size += len(part)
        if size >= min_chars:
            groups.append(joiner.join(current))
            current, size = [], 0
    if current:
        groups.append(joiner.join(current))
    return groups


# ---------------------------------------------------------------------------- sources
class TextFileSource(DocumentSource):
    """Plain UTF-8 text files (gzip when the name ends in `.gz`; ids and metadata name the file
    without `.gz`, so a compressed copy gives the same documents). `split="file"`: one document
    per file; `"blank_line"`: one per blank-line separated passage; `"separator"`: split on the
    string `separator`.
    `group_chars > 0` merges consecutive passages until each document has that many characters
    (short passages, like tinyshakespeare's speaker turns, make poor documents alone)."""

    kind = "text"

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        pattern: str = "**/*.txt",
        split: SplitMode = "file",
        separator: str | None = None,
        group_chars: int = 0,
        name: str | None = None,
    ) -> None:
        if split not in ("file", "blank_line", "separator"):
            raise ValueError(f"split must be 'file', 'blank_line' or 'separator', got {split!r}")
        if split == "separator" and not separator:
            raise ValueError("split='separator' needs a non-empty separator string")
        if group_chars < 0:
            raise ValueError(f"group_chars must be >= 0, got {group_chars}")
        self.paths = _as_list(paths)
        self.files = _discover(self.paths, pattern, "text")
        self.pattern, self.split, self.separator, self.group_chars = (
            pattern,
            split,
            separator,
            group_chars,
        )
        super().__init__(name or (self.paths[0].stem if len(self.paths) == 1 else "text"))

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "paths": [str(p) for p in self.paths],
            "pattern": self.pattern,
            "split": self.split,
            "separator": self.separator,
            "group_chars": self.group_chars,
        }

    def _items(self) -> Iterator[Document | _Skip]:
        for path, rel in self.files:
            rel = rel.removesuffix(".gz")
            where = f"{self.name}/{rel}"
            try:
                raw = path.read_bytes()
                text = _decode(gzip.decompress(raw) if path.name.endswith(".gz") else raw)
            except UnicodeDecodeError as err:
                yield _Skip(where, "non_utf8", f"byte {err.start}")
                continue
            except (OSError, EOFError) as err:  # unreadable file, bad or truncated gzip
                yield _Skip(where, "unreadable", str(err))
                continue
            if "\x00" in text:
                yield _Skip(where, "binary", "NUL byte")
                continue
            parts = _split_text(text, self.split, self.separator)
            joiner = "\n\n" if self.split == "blank_line" else (self.separator or "")
            parts = _group(parts, self.group_chars, joiner)
            for k, part in enumerate(parts):
                doc_id = where if self.split == "file" else f"{where}#{k}"
                yield Document(doc_id, part, self.name, {"path": rel, "part": k})


def tinyshakespeare(
    path: str | Path | None = None, *, group_chars: int = 0, name: str = "tinyshakespeare"
) -> TextFileSource:
    """A single file of blank-line separated passages (tinyshakespeare's `input.txt`: one speaker
    turn per passage, ~40k lines, 1.1 MB; `.gz` ok), the packaged copy when `path` is None or "".
    `group_chars` merges turns into longer documents."""
    path = Path(path) if path else builtin.path(builtin.TINYSHAKESPEARE)
    if not path.is_file():
        raise ValueError(f"tinyshakespeare file not found: {path}")
    return TextFileSource(path, split="blank_line", group_chars=group_chars, name=name)


def _lookup(record: Any, dotted: str) -> Any:
    value = record
    for key in dotted.split("."):
        if not isinstance(value, Mapping) or key not in value:
            raise KeyError(dotted)
        value = value[key]
    return value


class JsonlSource(DocumentSource):
    """JSON Lines files (gzip when the name ends in `.gz`). `text_field` may be dotted
    (`"meta.body"`); `id_field` is used when present, else `<file>:<line>`; `metadata_fields`
    are copied into `Document.metadata`."""

    kind = "jsonl"

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        text_field: str = "text",
        id_field: str | None = "id",
        metadata_fields: Sequence[str] = (),
        pattern: str = "**/*.jsonl*",
        name: str | None = None,
    ) -> None:
        if not text_field:
            raise ValueError("text_field must be a non-empty key, e.g. 'text'")
        self.paths = _as_list(paths)
        self.files = _discover(self.paths, pattern, "jsonl")
        self.text_field, self.id_field = text_field, id_field
        self.metadata_fields, self.pattern = tuple(metadata_fields), pattern
        super().__init__(name or (self.paths[0].stem.split(".")[0] if self.paths else "jsonl"))

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "paths": [str(p) for p in self.paths],
            "pattern": self.pattern,
            "text_field": self.text_field,
            "id_field": self.id_field,
        }

    def _items(self) -> Iterator[Document | _Skip]:
        for path, rel in self.files:
            opener = gzip.open if path.name.endswith(".gz") else open
            try:
                with opener(path, "rb") as fh:
                    yield from self._lines(fh, rel)
            except (OSError, EOFError) as err:  # truncated gzip, unreadable file
                yield _Skip(f"{self.name}/{rel}", "unreadable", str(err))

    def _lines(self, fh: Iterable[bytes], rel: str) -> Iterator[Document | _Skip]:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{self.name}/{rel}:{lineno}"
            if not raw.strip():
                continue
            try:
                record = json.loads(_decode(raw))
            except UnicodeDecodeError:
                yield _Skip(where, "non_utf8")
                continue
            except json.JSONDecodeError as err:
                yield _Skip(where, "bad_json", err.msg)
                continue
            try:
                text = _lookup(record, self.text_field)
            except KeyError:
                yield _Skip(where, "missing_field", self.text_field)
                continue
            if not isinstance(text, str):
                yield _Skip(where, "not_text", type(text).__name__)
                continue
            doc_id = where
            if self.id_field:
                try:
                    doc_id = f"{self.name}/{_lookup(record, self.id_field)}"
                except KeyError:
                    pass
            meta: dict[str, Any] = {"path": rel, "line": lineno}
            for key in self.metadata_fields:
                try:
                    meta[key] = _lookup(record, key)
                except KeyError:
                    pass
            yield Document(doc_id, text, self.name, meta)


class ParquetSource(DocumentSource):
    """Parquet files read with pyarrow in record batches. A file that pyarrow cannot open or
    read counts once as `corrupt_parquet` (rows already read are kept); a file without the text
    column counts as `missing_column`; null / non-string values as `not_text`."""

    kind = "parquet"

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        text_column: str = "text",
        id_column: str | None = None,
        pattern: str = "**/*.parquet",
        batch_size: int = 1024,
        name: str | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.paths = _as_list(paths)
        self.files = _discover(self.paths, pattern, "parquet")
        self.text_column, self.id_column = text_column, id_column
        self.pattern, self.batch_size = pattern, batch_size
        super().__init__(name or (self.paths[0].stem if self.paths else "parquet"))

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "paths": [str(p) for p in self.paths],
            "pattern": self.pattern,
            "text_column": self.text_column,
            "id_column": self.id_column,
        }

    def _items(self) -> Iterator[Document | _Skip]:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as err:  # pragma: no cover - pyarrow is in the [data] extra
            raise ImportError("ParquetSource needs pyarrow: pip install 'hybridlm[data]'") from err
        for path, rel in self.files:
            where = f"{self.name}/{rel}"
            try:
                pf = pq.ParquetFile(path)
                names = pf.schema_arrow.names
            except (pa.ArrowException, OSError, ValueError) as err:
                yield _Skip(where, "corrupt_parquet", str(err).splitlines()[0][:120])
                continue
            if self.text_column not in names:
                yield _Skip(where, "missing_column", f"{self.text_column!r} not in {names}")
                continue
            columns = [self.text_column]
            if self.id_column and self.id_column in names:
                columns.append(self.id_column)
            row = 0
            try:
                for batch in pf.iter_batches(batch_size=self.batch_size, columns=columns):
                    texts = batch.column(self.text_column).to_pylist()
                    ids = (
                        batch.column(self.id_column).to_pylist()
                        if len(columns) > 1
                        else [None] * len(texts)
                    )
                    for text, ident in zip(texts, ids, strict=True):
                        doc_id = f"{self.name}/{ident}" if ident is not None else f"{where}:{row}"
                        if not isinstance(text, str):
                            yield _Skip(doc_id, "not_text", type(text).__name__)
                        else:
                            yield Document(doc_id, text, self.name, {"path": rel, "row": row})
                        row += 1
            except (pa.ArrowException, OSError, ValueError) as err:
                yield _Skip(where, "corrupt_parquet", f"at row {row}: {str(err)[:120]}")


class HFDatasetSource(DocumentSource):
    """A Hugging Face `datasets` dataset: `datasets.load_dataset(path, name, split=split,
    data_files=..., streaming=..., cache_dir=..., **load_kwargs)` (hub names, or builders like
    `"json"` / `"parquet"` over local files). `datasets` is imported lazily."""

    kind = "hf"

    def __init__(
        self,
        path: str,
        *,
        config_name: str | None = None,
        split: str = "train",
        text_field: str = "text",
        id_field: str | None = None,
        data_files: str | Sequence[str] | Mapping[str, Any] | None = None,
        streaming: bool = False,
        cache_dir: str | Path | None = None,
        name: str | None = None,
        **load_kwargs: Any,
    ) -> None:
        if not path:
            raise ValueError("HFDatasetSource needs a dataset path, e.g. 'roneneldan/TinyStories'")
        self.path, self.config_name, self.split = path, config_name, split
        self.text_field, self.id_field = text_field, id_field
        self.data_files = list(data_files) if isinstance(data_files, (list, tuple)) else data_files
        self.streaming, self.cache_dir, self.load_kwargs = streaming, cache_dir, load_kwargs
        default = Path(path).name.replace(".", "_") or "hf"
        super().__init__(name or default)

    def describe(self) -> dict[str, Any]:
        files = self.data_files
        return {
            **super().describe(),
            "path": self.path,
            "config_name": self.config_name,
            "split": self.split,
            "text_field": self.text_field,
            "data_files": files if isinstance(files, (str, list, type(None))) else dict(files),
        }

    def load(self) -> Any:
        try:
            import datasets
        except ImportError as err:
            raise ImportError(
                "HFDatasetSource needs the datasets library: pip install 'hybridlm[data]'"
            ) from err
        return datasets.load_dataset(
            self.path,
            self.config_name,
            split=self.split,
            data_files=self.data_files,
            streaming=self.streaming,
            cache_dir=str(self.cache_dir) if self.cache_dir is not None else None,
            **self.load_kwargs,
        )

    def _items(self) -> Iterator[Document | _Skip]:
        dataset = self.load()
        for row, record in enumerate(dataset):
            ident = record.get(self.id_field) if self.id_field else None
            doc_id = f"{self.name}/{ident if ident is not None else row}"
            try:
                text = _lookup(record, self.text_field)
            except KeyError:
                yield _Skip(doc_id, "missing_field", self.text_field)
                continue
            if not isinstance(text, str):
                yield _Skip(doc_id, "not_text", type(text).__name__)
                continue
            yield Document(doc_id, text, self.name, {"row": row})


# Folders of the standard library that are not prose-like source: test suites, vendored or
# generated code, GUI demos, codec tables (`encodings/cp*.py` are 256-entry tables).
STDLIB_EXCLUDE_DIRS = (
    "test",
    "tests",
    "idle_test",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "ensurepip",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "encodings",
    "pydoc_data",
)


class StdlibSource(DocumentSource):
    """The embedded default corpus: the `.py` files of the running interpreter's standard
    library (`sysconfig.get_paths()["stdlib"]`), one document per file, sorted by relative path.
    Test suites, site-packages, idlelib, lib2to3, codec tables etc. are excluded
    (`STDLIB_EXCLUDE_DIRS`, plus files named `test_*.py`). `docstrings_only=True` keeps the
    module, class and function docstrings (English prose) instead of the source; a file that
    does not parse then counts as `syntax_error`. CPython 3.11.7 gives 453 files (451 documents,
    8.8 MB of source)."""

    kind = "stdlib"

    def __init__(
        self,
        *,
        docstrings_only: bool = False,
        exclude_dirs: Sequence[str] = STDLIB_EXCLUDE_DIRS,
        max_files: int | None = None,
        root: str | Path | None = None,
        name: str = "stdlib",
    ) -> None:
        self.root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
        if not self.root.is_dir():
            raise ValueError(f"standard library folder not found: {self.root}")
        if max_files is not None and max_files <= 0:
            raise ValueError(f"max_files must be positive or None, got {max_files}")
        self.docstrings_only, self.max_files = docstrings_only, max_files
        self.exclude_dirs = tuple(exclude_dirs)
        excluded = set(self.exclude_dirs)
        files = []
        for folder, dirs, names in os.walk(self.root):  # prune excluded folders while walking
            dirs[:] = [d for d in dirs if d not in excluded]
            for fname in names:
                if fname.endswith(".py") and not fname.startswith("test_"):
                    path = Path(folder) / fname
                    files.append((path, path.relative_to(self.root).as_posix()))
        files.sort(key=lambda item: item[1])
        self.files = files[:max_files] if max_files is not None else files
        super().__init__(name)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "python": sys.version.split()[0],
            "docstrings_only": self.docstrings_only,
            "exclude_dirs": list(self.exclude_dirs),
            "max_files": self.max_files,
        }

    def _items(self) -> Iterator[Document | _Skip]:
        for path, rel in self.files:
            where = f"{self.name}/{rel}"
            try:
                text = _decode(path.read_bytes())
            except UnicodeDecodeError as err:
                yield _Skip(where, "non_utf8", f"byte {err.start}")
                continue
            except OSError as err:
                yield _Skip(where, "unreadable", str(err))
                continue
            if self.docstrings_only:
                try:
                    text = _docstrings(text)
                except (SyntaxError, ValueError) as err:
                    yield _Skip(where, "syntax_error", str(err)[:120])
                    continue
            yield Document(where, text, self.name, {"path": rel})


def _docstrings(source: str) -> str:
    """Module, class and function docstrings of a Python source, in source order."""
    tree = ast.parse(source)
    nodes = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    docs = (ast.get_docstring(n, clean=True) for n in nodes)
    return "\n\n".join(d for d in docs if d)


class IterableSource(DocumentSource):
    """Documents or plain strings already in memory (ids `<name>/<index>` for strings).
    The iterable must be re-iterable (a list), since sharding may read it more than once."""

    kind = "memory"

    def __init__(self, items: Iterable[Document | str], *, name: str = "memory") -> None:
        self.items = items if isinstance(items, Sequence) else list(items)
        super().__init__(name)

    def _items(self) -> Iterator[Document | _Skip]:
        for k, item in enumerate(self.items):
            if isinstance(item, Document):
                yield item
            elif isinstance(item, str):
                yield Document(f"{self.name}/{k}", item, self.name, {})
            else:
                yield _Skip(f"{self.name}/{k}", "not_text", type(item).__name__)
