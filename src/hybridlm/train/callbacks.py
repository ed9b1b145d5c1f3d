"""Callbacks: what the loop does around the optimizer steps that is not a step (OLMo-core's
callbacks). A `TrainModule` says what a step does (data, loss, evaluation, its checkpoint
state); its `callbacks()` add the rest — the rows logged before the first step and after the
last, fields of the train rows (throughput, the work after an update), the progress text, and
the outputs of a finished run (export, plot, result fields). The `Trainer` appends its own
`Evaluate` and `Checkpoint` and calls them all, in order, at these points:

    on_start      a fresh run, before the first step (every rank): data row, reference rows,
                  the evaluation at step 0
    after_update  after every optimizer step (every rank): fields of the step's row, e.g. the
                  time to hand new weights to rollout workers
    log_fields    each logged train row: throughput over the steps since the last row
    progress      the progress bar's text for a logged row (the first callback that has one)
    on_step       after the step's row is logged: periodic evaluation and checkpoints
    close         the loop ended, finished or not: release workers
    on_end        then (every rank, in order): when the run reached its last step
                  (`trainer.finished`), rows measured on the final model and on rank 0 the
                  export and the plot; on rank 0 the fields of `Trainer.train`'s result

Rows go through `Trainer.log` (rank 0 writes `metrics.jsonl`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..report.plot import plot_post_training
from .distributed.parallel import is_main

if TYPE_CHECKING:  # the Trainer imports this module
    from .optim import StepOutcome
    from .trainer import Step, Trainer

Row = dict[str, Any]


class Callback:
    """A no-op at every point of the loop (module docstring); subclasses override some."""

    def on_start(self, trainer: Trainer) -> None:
        """A fresh run, before the first step."""

    def after_update(self, trainer: Trainer, step: Step, outcome: StepOutcome | None) -> Row:
        """After every step (`outcome` None: the step had no micro-batches); fields of its row."""
        return {}

    def log_fields(self, trainer: Trainer, steps: int, seconds: float) -> Row:
        """Fields of a logged train row, over the `steps` steps since the last one, which took
        `seconds` of training."""
        return {}

    def progress(self, row: Row) -> str | None:
        """The progress bar's text for a logged train row (None: the next callback's)."""
        return None

    def on_step(self, trainer: Trainer) -> None:
        """After every step and its row."""

    def on_end(self, trainer: Trainer, result: Row) -> None:
        """The loop ended (after `close`; `trainer.finished`: at the last step); `result` is
        what `Trainer.train` returns (add fields on rank 0)."""

    def close(self, trainer: Trainer) -> None:
        """The loop ended (finished, stopped early or failed), before `on_end`."""


# ---------------------------------------------------------------------------- the Trainer's
class Evaluate(Callback):
    """The module's evaluation as an "eval" row: at step 0 (when the module evaluates at the
    start), every `train.eval_interval` steps and after the last step."""

    def on_start(self, trainer: Trainer) -> None:
        if trainer.module.eval_at_start:
            trainer.evaluate_and_log()

    def on_step(self, trainer: Trainer) -> None:
        if _due(trainer, trainer.cfg.eval_interval):
            trainer.evaluate_and_log()


class Checkpoint(Callback):
    """A checkpoint every `train.checkpoint_interval` steps and after the last step."""

    def on_step(self, trainer: Trainer) -> None:
        if _due(trainer, trainer.cfg.checkpoint_interval):
            trainer.last_checkpoint = trainer.save()


def _due(trainer: Trainer, every: int) -> bool:
    """Every `every` steps (0: never) and after the last step."""
    return bool(every and trainer.step % every == 0) or trainer.step == trainer.total_steps


# ---------------------------------------------------------------------------- rows
class DataRow(Callback):
    """The run's data (what was read, kept, dropped, held out) as the "data" row before the
    first step and as the result's `data`."""

    def __init__(self, summary: Callable[[], Row]) -> None:
        self.summary = summary

    def on_start(self, trainer: Trainer) -> None:
        trainer.log({"kind": "data", "step": 0, **self.summary()})

    def on_end(self, trainer: Trainer, result: Row) -> None:
        if is_main():
            result["data"] = self.summary()


class StartRows(Callback):
    """Rows measured before the first step (e.g. the teacher's own held-out metrics)."""

    def __init__(self, rows: Callable[[], list[Row]]) -> None:
        self.rows = rows

    def on_start(self, trainer: Trainer) -> None:
        for row in self.rows():
            trainer.log(row)


class EndRows(Callback):
    """Rows measured on the final model after the last step (e.g. MTP acceptance)."""

    def __init__(self, rows: Callable[[], list[Row]]) -> None:
        self.rows = rows

    def on_end(self, trainer: Trainer, result: Row) -> None:
        if trainer.finished:
            for row in self.rows():
                trainer.log(row)


# ---------------------------------------------------------------------------- during the run
class Throughput(Callback):
    """`key` of every train row: `units` (tokens, pairs; 1 for steps) per second of training."""

    def __init__(self, key: str = "steps_per_s", units: int = 1) -> None:
        self.key, self.units = key, units

    def log_fields(self, trainer: Trainer, steps: int, seconds: float) -> Row:
        return {self.key: steps * self.units / max(seconds, 1e-9)}


class Progress(Callback):
    """The progress text of a train row: `text(row)`, or with `keys` those of its fields."""

    def __init__(self, text: Callable[[Row], str] | None = None, *, keys: tuple[str, ...] = ()):
        self.text, self.keys = text, keys

    def progress(self, row: Row) -> str | None:
        if self.text is not None:
            return self.text(row)
        shown = (
            f"{k} {row[k]:.4f}" if isinstance(row[k], float) else f"{row[k]}"
            for k in self.keys
            if k in row
        )
        return " ".join(shown)


class AfterUpdate(Callback):
    """`work(step, outcome)` after every step; returns fields of the step's row."""

    def __init__(self, work: Callable[[Step, StepOutcome | None], Row]) -> None:
        self.work = work

    def after_update(self, trainer: Trainer, step: Step, outcome: StepOutcome | None) -> Row:
        return self.work(step, outcome)


class Close(Callback):
    """`release()` when the loop ends (rollout workers, frozen flags)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self.release = release

    def close(self, trainer: Trainer) -> None:
        self.release()


# ---------------------------------------------------------------------------- outputs
class Export(Callback):
    """The finished model written once by rank 0 (`write()` returns its path: a transformers
    or ModelOpt directory), as the result's `hf`."""

    def __init__(self, write: Callable[[], Path | None]) -> None:
        self.write = write

    def on_end(self, trainer: Trainer, result: Row) -> None:
        if trainer.finished and is_main():
            path = self.write()
            result["hf"] = str(path) if path else None


class Plot(Callback):
    """The run's PNG rendered from metrics.jsonl by rank 0 at the end (`train.plot`), as the
    result's `plot`: `render(metrics_path)` returns its path."""

    def __init__(self, render: Callable[[Path], Path | None]) -> None:
        self.render = render

    def on_end(self, trainer: Trainer, result: Row) -> None:
        if trainer.finished and is_main() and trainer.cfg.plot and trainer.metrics_path.exists():
            path = self.render(trainer.metrics_path)
            result["plot"] = str(path) if path else None


def curves(out: Path, stage: str, train: tuple[str, ...], evals: tuple[str, ...] | None) -> Plot:
    """The post-training PNG `<out>/<stage>.png`: the train rows' `train` keys and the eval
    rows' `evals` keys (None: every one) against the step."""
    return Plot(lambda metrics: plot_post_training(metrics, out / f"{stage}.png", train, evals))


class Summary(Callback):
    """Fields of the result computed on rank 0 at the end (`fields()`, e.g. a stage's figures
    file), after the export and the plot."""

    def __init__(self, fields: Callable[[], Row]) -> None:
        self.fields = fields

    def on_end(self, trainer: Trainer, result: Row) -> None:
        if is_main():
            result.update(self.fields())
