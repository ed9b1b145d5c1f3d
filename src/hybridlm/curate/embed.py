"""Embedding-similarity decontamination of code (Olmo 3 §4.4 / §7.1: a code document is
contaminated when the cosine similarity of a code embedding to a benchmark solution's exceeds
0.8).

Shape legend: N texts, R reference chunks, C document chunks, D embedding dimensions, F hashed
features of one text.

    1. chunking: a document is cut into functions (`function_chunks`: `ast` when the document
       parses, an indentation scan otherwise), top-level functions and methods with their
       decorators; nested functions stay inside their parent;
    2. normalisation (`normalize_code`): `none`; `format` (docstrings and comments dropped,
       layout canonicalised by `ast.unparse`: indentation, quotes, spacing, parentheses);
       `canonical` (also every non-builtin identifier becomes the placeholder `v`, as clone
       detectors such as CCFinder do: a renamed copy normalises to the same text, and an
       inserted statement does not shift the names of the rest, as numbered names v0, v1, ...
       would);
    3. embedding (`EmbeddingBackend.encode -> [N, D]` unit rows), two backends:
       - `HashedTfidfEmbedder`: deterministic, dependency-free: code tokens, n-grams of several
         sizes hashed with a sign into D buckets (feature hashing), sublinear tf x idf, with idf
         fitted on the reference set (n-grams every benchmark solution has weigh little);
       - `MiniLMEmbedder`: all-MiniLM-L6-v2 through sentence-transformers (the `[embed]`
         extra; mean pooling, L2 normalised), loaded from a local directory or the Hugging
         Face cache, never downloaded at run time;
    4. detection (`CodeEmbeddingDetector`): references are the functions of every benchmark
       item's prompt + canonical solution (HumanEval); a document chunk is flagged when its
       maximum cosine against the references is >= `threshold` (0.8). Chunks (and references)
       with fewer than `min_tokens` normalised tokens are not compared: one-line functions
       (`return len(s)`) match unrelated code at any threshold.

`measure_code_decon` plants renamed / reformatted HumanEval solutions and measures recall, and
the false-positive rate on Python standard-library functions (`hybridlm decon-code-eval`, on the
packaged HumanEval, or `--data-dir DIR`).
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import keyword
import random
import re
import sysconfig
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from .benchmarks import BenchmarkRegistry, EvalItem, Match

Normalize = Literal["none", "format", "canonical"]
BackendName = Literal["hashed", "minilm"]

_TOKEN_RE = re.compile(r"[A-Za-z_]\w*|\d+(?:\.\d*)?|\S")
_IDENT_RE = re.compile(r"[A-Za-z_]\w*")
_DEF_RE = re.compile(r"^(\s*)(?:async\s+)?def\s+\w+\s*\(")
_KEEP_NAMES = frozenset(dir(builtins)) | frozenset(keyword.kwlist) | {"self", "cls"}
# the `minilm` backend's default model (the [embed] extra)
MINILM_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


# ---------------------------------------------------------------------------- chunking
@dataclass(frozen=True)
class CodeChunk:
    """One function of a document: its name and lines [start, end) (0-based)."""

    name: str
    start: int
    end: int
    text: str


def function_chunks(text: str) -> list[CodeChunk]:
    """Top-level functions and methods of `text` (with decorators), in source order."""
    lines = text.splitlines()
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):  # not a whole module: scan indentation instead
        return _scan_chunks(lines)
    out: list[CodeChunk] = []

    def visit(body: Sequence[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
                end = node.end_lineno or node.lineno
                out.append(CodeChunk(node.name, start, end, "\n".join(lines[start:end])))
            elif isinstance(node, ast.ClassDef):
                visit(node.body)

    visit(tree.body)
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _scan_chunks(lines: list[str]) -> list[CodeChunk]:
    """Functions of text that does not parse (code in prose, fragments): a chunk starts at a
    `def` line and runs until the first non-blank line indented no deeper than the `def`, after
    the signature (whose brackets may span lines)."""
    out: list[CodeChunk] = []
    k = 0
    while k < len(lines):
        m = _DEF_RE.match(lines[k])
        if not m:
            k += 1
            continue
        start, indent, depth, j = k, len(m.group(1)), 0, k
        while j < len(lines):  # the signature: until brackets balance and a line ends in ':'
            depth += sum(lines[j].count(c) for c in "([{") - sum(lines[j].count(c) for c in ")]}")
            j += 1
            if depth <= 0 and lines[j - 1].rstrip().endswith(":"):
                break
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > indent):
            j += 1
        end = j
        while end > start + 1 and not lines[end - 1].strip():
            end -= 1
        name = lines[start].split("def", 1)[1].split("(", 1)[0].strip()
        out.append(CodeChunk(name, start, end, "\n".join(lines[start:end])))
        k = max(j, k + 1)
    return out


# ---------------------------------------------------------------------------- normalisation
class _StripDocstrings(ast.NodeTransformer):
    def _strip(self, node: Any) -> Any:
        body = node.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
        self.generic_visit(node)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Module = _strip


class _Rename(ast.NodeTransformer):
    """Consistent renaming of non-builtin identifiers (`mapping(old) -> new`, in order of first
    use in a depth-first walk); attributes and keyword-argument names are kept."""

    def __init__(self, mapping: Any) -> None:
        self.mapping = mapping

    def visit_FunctionDef(self, node: Any) -> Any:
        node.name = self.mapping(node.name)
        self.generic_visit(node)
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> Any:
        node.name = self.mapping(node.name)
        self.generic_visit(node)
        return node

    def visit_Name(self, node: ast.Name) -> Any:
        node.id = self.mapping(node.id)
        return node

    def visit_arg(self, node: ast.arg) -> Any:
        node.arg = self.mapping(node.arg)
        self.generic_visit(node)
        return node


def _canonical_names() -> Any:
    def mapping(name: str) -> str:
        return name if name in _KEEP_NAMES else "v"

    return mapping


def normalize_code(code: str, mode: Normalize = "canonical") -> str:
    """`code` in the normal form `mode` names (see the module docstring). Code that does not
    parse falls back to a textual form: comments dropped, whitespace collapsed and, for
    `canonical`, identifiers replaced by the same rule."""
    if mode == "none":
        return code
    if mode not in ("format", "canonical"):
        raise ValueError(f"normalize must be none, format or canonical, got {mode!r}")
    try:
        tree = ast.parse(textwrap.dedent(code))
    except (SyntaxError, ValueError):
        text = " ".join(re.sub(r"#[^\n]*", "", code).split())
        if mode == "canonical":
            mapping = _canonical_names()
            text = _IDENT_RE.sub(lambda m: mapping(m.group()), text)
        return text
    tree = _StripDocstrings().visit(tree)
    if mode == "canonical":
        tree = _Rename(_canonical_names()).visit(tree)
    return ast.unparse(tree)


def code_tokens(code: str) -> list[str]:
    """Identifier, number and single-symbol tokens."""
    return _TOKEN_RE.findall(code)


# ---------------------------------------------------------------------------- backends
@runtime_checkable
class EmbeddingBackend(Protocol):
    """Texts -> [N, D] float32 rows of unit L2 norm (cosine similarity = dot product)."""

    name: str

    def fit(self, references: Sequence[str]) -> None:
        """See the reference corpus once before encoding (idf); may do nothing."""

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...

    def describe(self) -> dict[str, Any]: ...


def _unit_rows(x_ND: np.ndarray) -> np.ndarray:
    norm_N1 = np.linalg.norm(x_ND, axis=1, keepdims=True)
    return (x_ND / np.where(norm_N1 > 0, norm_N1, 1.0)).astype(np.float32)


@dataclass(kw_only=True)
class HashedTfidfEmbedder:
    """Hashed code-token n-gram TF-IDF (dependency-free, deterministic): each n-gram of sizes
    `ngram_sizes` goes to bucket blake2b(n-gram) mod `dim` with a sign from the same hash (the
    signed feature hashing of Weinberger et al. 2009 keeps inner products unbiased); weight
    (1 + log tf) x idf, idf = 1 + log((1 + R) / (1 + df)) over the `fit` references (features
    absent from them get the largest idf); rows L2-normalised."""

    dim: int = 1 << 14
    ngram_sizes: tuple[int, ...] = (1, 2, 3, 4)
    name: str = "hashed"
    _idf: dict[int, float] = field(default_factory=dict, init=False, repr=False)
    _idf_default: float = field(default=1.0, init=False, repr=False)  # 1 before `fit`: plain tf

    def __post_init__(self) -> None:
        if self.dim < 16:
            raise ValueError(f"dim must be >= 16, got {self.dim}")
        if not self.ngram_sizes or min(self.ngram_sizes) < 1:
            raise ValueError(f"ngram_sizes must be positive, got {self.ngram_sizes}")

    def _features(self, text: str) -> dict[int, int]:
        """Signed feature id (bucket + 1, negated for a negative sign) -> count."""
        toks = code_tokens(text)
        counts: dict[int, int] = {}
        for n in self.ngram_sizes:
            for i in range(len(toks) - n + 1):
                h = hashlib.blake2b("\x1f".join(toks[i : i + n]).encode(), digest_size=8).digest()
                v = int.from_bytes(h, "little")
                f = (v % self.dim) + 1
                f = -f if (v >> 63) & 1 else f
                counts[f] = counts.get(f, 0) + 1
        return counts

    def fit(self, references: Sequence[str]) -> None:
        df: dict[int, int] = {}
        for text in references:
            for f in self._features(text):
                df[abs(f)] = df.get(abs(f), 0) + 1
        r = len(references)
        self._idf = {f: 1.0 + float(np.log((1 + r) / (1 + c))) for f, c in df.items()}
        self._idf_default = 1.0 + float(np.log(1 + r))

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        x_ND = np.zeros((len(texts), self.dim), dtype=np.float64)
        for i, text in enumerate(texts):
            for f, c in self._features(text).items():
                b = abs(f) - 1
                w = (1.0 + np.log(c)) * self._idf.get(abs(f), self._idf_default)
                x_ND[i, b] += w if f > 0 else -w
        return _unit_rows(x_ND)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "dim": self.dim, "ngram_sizes": list(self.ngram_sizes)}


def minilm_available(model: str = MINILM_MODEL) -> bool:
    """Whether `sentence-transformers` (the `[embed]` extra) is installed and `model` is on this
    machine: a local directory, or a Hugging Face Hub id already in the Hub cache."""
    import importlib.util

    if importlib.util.find_spec("sentence_transformers") is None:
        return False
    if Path(model).is_dir():
        return True
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(model, "modules.json"), str)
    except ValueError:  # not a valid Hub id (a path that does not exist)
        return False


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings (384 dims) through `sentence-transformers`, the
    library the model is published for: the pipeline its `modules.json` declares (Transformer
    -> mean Pooling over non-padding tokens -> Normalize), inputs truncated to `max_length`
    (256, the model's `max_seq_length`), L2-normalised rows.

    `model` is a Hub id or a local directory in the sentence-transformers layout. Loading never
    downloads (`local_files_only=True`): fetch the weights once with `hf download
    sentence-transformers/all-MiniLM-L6-v2` (about 90 MB, into the Hub cache), or pass the
    directory a copy lives in; every later run is offline."""

    name = "minilm"

    def __init__(
        self,
        *,
        model: str = MINILM_MODEL,
        batch_size: int = 32,
        max_length: int = 256,
        device: str = "cpu",
    ):
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise ValueError(
                "the minilm embedding backend needs sentence-transformers "
                "(pip install 'hybridlm[embed]'); or use the 'hashed' backend"
            ) from None
        try:
            self.model = SentenceTransformer(model, device=device, local_files_only=True)
        except (OSError, ValueError) as err:  # not cached / not a directory nor a Hub id
            raise ValueError(
                f"embedding model {model!r} is not on this machine ({type(err).__name__}); "
                f"fetch it once with `hf download {model}` or pass a local directory"
            ) from None
        self.model.max_seq_length = max_length
        self.model_name = model
        self.dim = int(self.model.get_sentence_embedding_dimension())
        self.batch_size, self.max_length, self.device = batch_size, max_length, device

    def fit(self, references: Sequence[str]) -> None:
        """Nothing to fit: the model is pretrained."""

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        e_ND = self.model.encode(
            list(texts),
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(e_ND, dtype=np.float32)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": self.model_name, "max_length": self.max_length}


def make_backend(name: BackendName, *, model: str = MINILM_MODEL, **kw: Any) -> EmbeddingBackend:
    """A backend by name: `hashed` (default, no dependencies) or `minilm` (`model`: a Hub id in
    the local cache or a directory)."""
    if name == "hashed":
        return HashedTfidfEmbedder(**kw)
    if name == "minilm":
        return MiniLMEmbedder(model=model, **kw)
    raise ValueError(f"embedding backend must be 'hashed' or 'minilm', got {name!r}")


# ---------------------------------------------------------------------------- detector
@dataclass(kw_only=True)
class EmbedDeconConfig:
    """Olmo 3 §4.4: cosine > 0.8 against benchmark code. `benchmarks`: the registry's code
    benchmarks used as references; `normalize`: see `normalize_code`; `model`: the `minilm`
    backend's sentence-transformers model (a Hub id in the local cache, or a directory).

    Measured on HumanEval (147 functions of >= 24 tokens) with planted renamed + reformatted
    copies and 766 standard-library functions as negatives (`measure_code_decon`): `hashed` +
    `canonical` finds 100% of them (99.3% with an inserted statement) with no false positive
    (largest negative cosine 0.40); `minilm` + `canonical` also finds 100% but flags 8.7% of
    the stdlib functions (cosines up to 0.93: identifier-free code looks alike to a sentence
    model), and `minilm` + `format` misses 98.6% of renamed copies (names dominate it)."""

    backend: BackendName = "hashed"
    threshold: float = 0.8
    normalize: Normalize = "canonical"
    min_tokens: int = 24
    benchmarks: tuple[str, ...] = ("humaneval",)
    model: str = MINILM_MODEL

    def __post_init__(self) -> None:
        if self.backend not in ("hashed", "minilm"):
            raise ValueError(f"embedding backend must be hashed or minilm, got {self.backend!r}")
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"embedding threshold must be in [-1, 1], got {self.threshold}")
        if self.normalize not in ("none", "format", "canonical"):
            raise ValueError(f"normalize must be none, format or canonical: {self.normalize!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")


def item_code(item: EvalItem) -> str:
    """A code benchmark item's code: the prompt (signature, docstring, helpers) + solution."""
    return item.question + item.answer


class CodeEmbeddingDetector:
    """Flags documents with a function whose embedding has cosine >= threshold against a
    benchmark function (see the module docstring). `Match.span` holds the chunk's lines
    [start, end)."""

    def __init__(
        self,
        registry: BenchmarkRegistry,
        cfg: EmbedDeconConfig | None = None,
        backend: EmbeddingBackend | None = None,
    ) -> None:
        self.cfg = cfg or EmbedDeconConfig()
        self.backend = backend or make_backend(self.cfg.backend, model=self.cfg.model)
        items = [it for it in registry.items if it.benchmark in self.cfg.benchmarks]
        if not items:
            raise ValueError(
                f"no items of the code benchmarks {list(self.cfg.benchmarks)} in the registry "
                f"(it has {registry.benchmarks})"
            )
        self.items: list[EvalItem] = []
        texts: list[str] = []
        self.ref_item: list[int] = []
        self.skipped_items = 0
        for it in items:
            chunks = [self._prepare(c.text) for c in function_chunks(item_code(it))]
            chunks = [c for c in chunks if c is not None]
            if not chunks:
                self.skipped_items += 1
                continue
            self.items.append(it)
            for text in chunks:
                texts.append(text)
                self.ref_item.append(len(self.items) - 1)
        if not texts:
            raise ValueError(f"every benchmark function is shorter than {self.cfg.min_tokens}")
        self.backend.fit(texts)
        self.ref_RD = self.backend.encode(texts)

    def _prepare(self, code: str) -> str | None:
        """The normalised chunk, or None when it is shorter than `min_tokens`."""
        norm = normalize_code(code, self.cfg.normalize)
        if len(code_tokens(normalize_code(code, "format"))) < self.cfg.min_tokens:
            return None
        return norm

    def max_similarity(self, codes: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """For every code snippet: max cosine over the references and the reference item index
        (-1 and -inf for snippets below `min_tokens`)."""
        prepared = [self._prepare(c) for c in codes]
        keep = [i for i, p in enumerate(prepared) if p is not None]
        best_N = np.full(len(codes), -np.inf)
        arg_N = np.full(len(codes), -1, dtype=np.int64)
        if keep:
            e_CD = self.backend.encode([prepared[i] for i in keep])
            s_CR = e_CD @ self.ref_RD.T
            best_N[keep] = s_CR.max(axis=1)
            arg_N[keep] = np.asarray(self.ref_item)[s_CR.argmax(axis=1)]
        return best_N, arg_N

    def detect(self, text: str) -> list[Match]:
        chunks = function_chunks(text)
        if not chunks:
            return []
        best_C, arg_C = self.max_similarity([c.text for c in chunks])
        out = []
        for chunk, s, a in zip(chunks, best_C, arg_C, strict=True):
            if a >= 0 and s >= self.cfg.threshold:
                item = self.items[int(a)]
                out.append(
                    Match(
                        benchmark=item.benchmark,
                        item_id=item.id,
                        question_score=float(s),
                        answer_score=float(s),
                        score=float(s),
                        threshold=self.cfg.threshold,
                        span=(chunk.start, chunk.end),
                    )
                )
        return out


# ---------------------------------------------------------------------------- measurement
_NAME_WORDS = (
    "alpha beta gamma delta item value data result acc node key count total tmp buf elem "
    "seq arr res out cur idx pos val num lst xs ys aux best"
).split()


def plant_variant(code: str, kind: str, seed: int = 0) -> str:
    """A contaminated copy of benchmark code: `rename` (every non-builtin identifier renamed
    consistently), `reformat` (docstrings dropped, 2-space indentation, blank lines and a
    comment added), `rename_reformat` (both), `rename_reformat_insert` (both, plus one extra
    statement at the top of every function body)."""
    kinds = ("rename", "reformat", "rename_reformat", "rename_reformat_insert")
    if kind not in kinds:
        raise ValueError(f"unknown variant {kind!r}; known: {kinds}")
    rng = random.Random(f"{seed}:{kind}:{code}")
    tree = ast.parse(code)
    if "rename" in kind:
        table: dict[str, str] = {}
        imported = {
            (a.asname or a.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for a in node.names
        }

        def mapping(name: str) -> str:
            if name in _KEEP_NAMES or name in imported:
                return name
            if name not in table:
                table[name] = f"{rng.choice(_NAME_WORDS)}_{len(table)}"
            return table[name]

        tree = _Rename(mapping).visit(tree)
    if "insert" in kind:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                extra = ast.parse(f"_checked_{rng.randrange(100)} = True").body[0]
                node.body.insert(1 if _has_docstring(node) else 0, extra)
        ast.fix_missing_locations(tree)
    if "reformat" not in kind:
        return ast.unparse(tree)
    tree = _StripDocstrings().visit(tree)
    lines = []
    for line in ast.unparse(tree).splitlines():
        depth = _indent(line) // 4
        lines.append("  " * depth + line.strip())
        if line.rstrip().endswith(":") and rng.random() < 0.5:
            lines.append("")
    return "# reference implementation\n" + "\n".join(lines) + "\n"


def _has_docstring(node: Any) -> bool:
    b = node.body
    return bool(b) and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant)


STDLIB_MODULES = (
    "textwrap.py statistics.py heapq.py bisect.py fractions.py colorsys.py difflib.py "
    "shlex.py fnmatch.py calendar.py string.py glob.py posixpath.py ntpath.py base64.py "
    "quopri.py random.py functools.py operator.py copy.py pprint.py reprlib.py csv.py "
    "json/decoder.py json/encoder.py html/__init__.py urllib/parse.py ipaddress.py "
    "datetime.py decimal.py"
).split()


def stdlib_functions(modules: Sequence[str] = STDLIB_MODULES) -> list[tuple[str, str]]:
    """(name, code) of every function of some pure-Python standard-library modules: code a
    detector should not flag (the false-positive set)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for mod in modules:
        path = root / mod
        if not path.is_file():
            continue
        for chunk in function_chunks(path.read_text(encoding="utf-8")):
            out.append((f"{mod}:{chunk.name}:{chunk.start + 1}", chunk.text))
    return out


def measure_code_decon(
    detector: CodeEmbeddingDetector,
    registry: BenchmarkRegistry,
    *,
    kinds: Sequence[str] = ("rename", "reformat", "rename_reformat", "rename_reformat_insert"),
    negatives: Sequence[tuple[str, str]] | None = None,
    max_items: int = 0,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Recall on planted variants of every benchmark solution the detector indexes (each
    planted function embedded in a document with unrelated code around it), and the
    false-positive rate on standard-library functions."""
    items = detector.items[:max_items] if max_items else detector.items
    filler = "import os\n\n\ndef _unrelated(path):\n    return os.path.basename(path)\n\n\n"
    out: dict[str, Any] = {"threshold": detector.cfg.threshold, **detector.backend.describe()}
    out["normalize"] = detector.cfg.normalize
    out["items"] = len(items)
    out["items_skipped_short"] = detector.skipped_items
    t0 = time.perf_counter()
    recall: dict[str, float] = {}
    from rich.progress import Progress

    with Progress(disable=not progress) as bar:
        task = bar.add_task(f"planted ({detector.backend.name})", total=len(kinds) * len(items))
        for kind in kinds:
            hits = 0
            for it in items:
                doc = filler + plant_variant(item_code(it), kind, seed)
                hits += any(m.item_id == it.id for m in detector.detect(doc))
                bar.update(task, advance=1)
            recall[kind] = hits / max(len(items), 1)
    out["recall"] = recall
    negatives = stdlib_functions() if negatives is None else negatives
    best_N, arg_N = detector.max_similarity([code for _, code in negatives])
    compared = arg_N >= 0
    flagged = compared & (best_N >= detector.cfg.threshold)
    out["negatives"] = int(compared.sum())
    out["false_positives"] = int(flagged.sum())
    out["fp_rate"] = float(flagged.sum() / max(int(compared.sum()), 1))
    order = np.argsort(-np.where(compared, best_N, -np.inf))[:5]
    out["top_negatives"] = [
        {
            "function": negatives[i][0],
            "cosine": round(float(best_N[i]), 4),
            "item": detector.items[int(arg_N[i])].id,
        }
        for i in order
        if compared[i]
    ]
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out
