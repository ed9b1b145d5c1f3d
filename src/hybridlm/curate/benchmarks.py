"""Benchmark items a decontamination detector looks for, and what it reports when it finds one.

`BenchmarkRegistry` holds the items: GSM8K (all splits) and HumanEval from a data folder (the
packaged copies by default), and any JSON Lines benchmark a user adds (`add_jsonl`). A detector
(`decon.SampledNgramDetector`, `decon.NgramOverlapDetector`, `embed.CodeEmbeddingDetector`)
returns one `Match` per contaminated region of a document.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..data import builtin


@dataclass(frozen=True)
class EvalItem:
    """One benchmark item: what a contaminated document would contain."""

    benchmark: str
    id: str
    question: str
    answer: str = ""


class BenchmarkRegistry:
    """Benchmark items by benchmark name."""

    def __init__(self) -> None:
        self.items: list[EvalItem] = []

    @property
    def benchmarks(self) -> list[str]:
        return sorted({it.benchmark for it in self.items})

    def add(self, items: Iterable[EvalItem]) -> BenchmarkRegistry:
        self.items.extend(items)
        return self

    def add_jsonl(
        self,
        path: str | Path,
        name: str,
        *,
        question_field: str = "question",
        answer_field: str = "answer",
        id_field: str = "",
    ) -> BenchmarkRegistry:
        """Items of a JSON Lines file (`.gz` ok); fields are dotted keys; `answer_field=""`
        for question-only benchmarks."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"benchmark file not found: {path}")
        with builtin.open_text(path) as f:
            for k, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{k + 1}: not JSON ({err})") from None
                question = _field(row, question_field)
                if not isinstance(question, str):
                    raise ValueError(f"{path}:{k + 1}: no string field {question_field!r}")
                answer = _field(row, answer_field) if answer_field else ""
                item_id = (
                    str(_field(row, id_field))
                    if id_field
                    else f"{path.name.removesuffix('.gz')}:{k}"  # same ids for a gzipped copy
                )
                self.items.append(EvalItem(name, item_id, question, str(answer or "")))
        return self

    @classmethod
    def from_data_dir(cls, data_dir: str | Path | None = None) -> BenchmarkRegistry:
        """GSM8K (train and test: Olmo 3 decontaminates all splits) and HumanEval: the packaged
        copies when `data_dir` is None or "", else from a folder laid out as
        `gsm8k/{train,test}.jsonl`, `humaneval/HumanEval.jsonl.gz` (`.gz` ok; what is there)."""
        reg = cls()
        for name in (builtin.GSM8K_TRAIN, builtin.GSM8K_TEST):
            f = builtin.path(name, data_dir)
            if f.is_file():
                reg.add_jsonl(f, "gsm8k")
        he = builtin.path(builtin.HUMANEVAL, data_dir)
        if he.is_file():
            reg.add_jsonl(
                he,
                "humaneval",
                question_field="prompt",
                answer_field="canonical_solution",
                id_field="task_id",
            )
        if not reg.items:
            raise ValueError(f"no GSM8K or HumanEval files under {data_dir or builtin.ROOT}")
        return reg

    @classmethod
    def build(
        cls, data_dir: str | Path | None = None, benchmarks: Sequence[Mapping[str, Any]] = ()
    ) -> BenchmarkRegistry:
        """`from_data_dir(data_dir)` (the packaged GSM8K + HumanEval when neither `data_dir` nor
        `benchmarks` is given) plus each JSON Lines benchmark `{name, path, question_field,
        answer_field, id_field}` (the last three optional, as in `add_jsonl`)."""
        reg = cls.from_data_dir(data_dir) if data_dir or not benchmarks else cls()
        for spec in benchmarks:
            spec = dict(spec)
            if "name" not in spec or "path" not in spec:
                raise ValueError(f"decontaminate: a benchmark needs 'name' and 'path', got {spec}")
            reg.add_jsonl(spec.pop("path"), spec.pop("name"), **spec)
        return reg


def _field(row: Mapping[str, Any], dotted: str) -> Any:
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


@dataclass(frozen=True)
class Match:
    """A contaminated region of a document: the item, its scores and token span."""

    benchmark: str
    item_id: str
    question_score: float
    answer_score: float
    score: float
    threshold: float
    span: tuple[int, int]  # [start, end): the n-gram cluster's tokens, a code chunk's lines

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
