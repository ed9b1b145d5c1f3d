"""The stage contract. Every stage of the model flow is one object, `STAGE`, in the module that
runs it (`curate.pipeline`, `data.bpe`, `train.stages.pretrain`, `rl.learner`, ...);
`hybridlm.stages` lists them in flow order, and the speedrun, the report and the CLI iterate
that registry: none of them names a stage. Adding a stage touches its module and one line of
the registry.

A stage has

    name       its directory in a flow run (`<run>/<name>/`) and its section of the speedrun
               config (`config`, the section's class; None: no section)
    settings   `settings(flow)`: its section with the run's wiring applied (the run directory for
               `{run}`, its output dir, the tokenizer, the model it starts from) — what its
               fingerprint covers
    run        `run(flow)`: runs it; returns the summary kept in its `stage.json`
    inputs     the stages whose outputs it reads (their fingerprints enter its own)
    model      its place in the model chain: "model" (it starts from the newest model before it,
               and later stages start from its model), "variants" (it starts from the newest
               model too and writes the models named in its summary's `models`, evaluated, not
               trained on), "" (no model)
    check      `check(section, config, stages)`: a config error found before anything runs
               (`stages`: the registry)
    headline   `headline(summary, report)`: the report's one line on it (metric: value)
    derived    rendered from the other stages' files on every run (the report): never
               skipped, fingerprinted or reused

`Flow` is what a stage reads of the run (`speedrun.Speedrun`); `Report` what a headline reads
of it (`report.card`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from .files import metric_rows

Summary = dict[str, Any]


class Flow(Protocol):
    """A flow run as its stages see it (`speedrun.Speedrun`)."""

    stages: tuple[Stage, ...]  # the registry
    cfg: Any  # the speedrun config: `cfg.<stage name>` is a stage's section
    run_dir: Path
    progress: bool
    console: Any  # rich Console (quiet without progress)

    def stage_dir(self, name: str) -> Path: ...

    def record(self, name: str) -> dict[str, Any] | None: ...

    def done(self, name: str) -> bool: ...

    def settings(self, name: str) -> dict[str, Any]: ...

    def model_path(self, name: str) -> str: ...

    def models(self) -> list[tuple[str, str, str]]: ...

    def tokenizer_spec(self) -> str: ...

    def tokenizer(self) -> Any: ...

    def format_paths(self, obj: Any) -> Any: ...

    def continue_or_start(self, stage: str, run: Callable[..., Any]) -> Any: ...


@dataclass(frozen=True)
class Report:
    """What a stage's headline may read besides its summary: the run directory, the speedrun
    config (plain data) and the report's names of its figures."""

    run: Path
    cfg: dict[str, Any]
    names: dict[str, str]

    def rows(self, stage: str, kind: str) -> list[dict[str, Any]]:
        """The `kind` rows of `<run>/<stage>/metrics.jsonl` (none when it is missing; a line
        that does not parse, e.g. the torn last line of a killed run, is skipped)."""
        return metric_rows(self.run / stage / "metrics.jsonl", kind)

    def get(self, dotted: str, default: Any = None) -> Any:
        """A value of the speedrun config by dotted path (`sft.data.held_out`)."""
        return dotted_get(self.cfg, dotted, default)


def dotted_get(tree: Any, dotted: str, default: Any = None) -> Any:
    """`pretrain.train.eval_batches` of a plain config tree (`default` when absent)."""
    for key in dotted.split("."):
        if isinstance(tree, dict) and key in tree:
            tree = tree[key]
        elif isinstance(tree, list) and key.isdigit() and int(key) < len(tree):
            tree = tree[int(key)]
        else:
            return default
    return tree


def no_settings(flow: Flow) -> dict[str, Any]:
    return {}


def no_headline(summary: Summary, report: Report) -> str:
    return "done"


@dataclass(frozen=True)
class Stage:
    """One stage of the flow (module docstring)."""

    name: str
    run: Callable[[Flow], Summary]
    settings: Callable[[Flow], dict[str, Any]] = no_settings
    inputs: tuple[str, ...] = ()
    config: type | None = None
    model: Literal["", "model", "variants"] = ""
    check: Callable[[Any, Any, tuple[Stage, ...]], None] | None = None
    headline: Callable[[Summary, Report], str] = no_headline
    derived: bool = False


def scalars(result: dict[str, Any]) -> dict[str, Any]:
    """The JSON-friendly scalars (and small dicts of scalars) of a stage's result, for its
    summary (NaN as None)."""
    out: dict[str, Any] = {}
    for k, v in result.items():
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v if not (isinstance(v, float) and v != v) else None
        elif isinstance(v, dict) and all(isinstance(x, (int, float, str)) for x in v.values()):
            out[k] = v
        elif isinstance(v, Path):
            out[k] = str(v)
    return out


def text_run_settings(flow: Flow, name: str, *, warm_start: bool = True) -> dict[str, Any]:
    """A training run on packed text (pretraining, midtraining, the long-context extension):
    its section with its output dir and shards and the run's tokenizer; with `warm_start`, the
    newest model before it as `train.init_from`."""
    data = flow.format_paths(getattr(flow.cfg, name).to_dict())
    out = flow.stage_dir(name)
    data["train"]["out_dir"] = str(out)
    if warm_start:
        data["train"]["init_from"] = flow.model_path(name)
    data["data"]["shards_dir"] = str(out / "shards")
    data["data"]["tokenizer"] = flow.tokenizer_spec()
    data["data"]["tokenizer_vocab_size"] = 0
    return data
