"""Shard-level executors: the same task function runs in-process or as Ray Data tasks.

A curation run is a few phases, each a map of a top-level function over shard tasks (read ->
per-document stages -> observe for the next global stage; apply -> stages -> ...). Tasks read
and write their shard files themselves and return small, picklable summaries, so an executor only
has to map a function over a list and give the results back *in input order*:

    LocalExecutor   in-process, one shard after another (default; deterministic and debuggable)
    RayExecutor     Ray Data: `ray.data.from_items(tasks).map(fn)` with `num_workers` concurrent
                    one-CPU tasks. `ray.init()` starts a local Ray instance unless `address` names
                    a cluster ("auto" or "ray://host:10001"); on a cluster the output folder must
                    be on storage every node sees. Task payloads and results cross Ray as pickled
                    bytes, so rows stay plain Arrow binary columns whatever a stage returns.

Ray Data is used (rather than bare `ray.remote`) because it is the project's data scale-out
engine: it schedules the shard tasks over the cluster's CPUs, bounds concurrency and retries
failed tasks, with the stage code unchanged.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Executor:
    """Maps a picklable function over a list of shard tasks, returning results in order."""

    name = "executor"

    def map(self, fn: Callable[[T], R], items: Sequence[T], desc: str = "") -> list[R]:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources the executor started."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


class LocalExecutor(Executor):
    """In-process, sequential; a progress bar per phase when `progress`."""

    name = "local"

    def __init__(self, *, progress: bool = False) -> None:
        self.progress = progress

    def map(self, fn: Callable[[T], R], items: Sequence[T], desc: str = "") -> list[R]:
        if self.progress and len(items) > 1:
            from rich.progress import track

            return [fn(item) for item in track(items, description=desc or "shards")]
        return [fn(item) for item in items]


def _run_pickled(fn: Callable[[Any], Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def task(row: dict[str, Any]) -> dict[str, Any]:
        result = fn(pickle.loads(row["payload"]))
        return {"index": row["index"], "result": pickle.dumps(result)}

    return task


class RayExecutor(Executor):
    """Ray Data executor. `num_cpus` sizes a local instance (None: all cores); `num_workers`
    bounds concurrent shard tasks (0: the cluster's CPU count)."""

    name = "ray"

    def __init__(
        self,
        *,
        address: str | None = None,
        num_cpus: int | None = None,
        num_workers: int = 0,
        progress: bool = False,
    ) -> None:
        try:
            import ray
            import ray.data  # noqa: F401  (its own imports: pandas, pyarrow)
        except ImportError as err:
            # `ray` alone (the [rl] / [speedrun] extras) lacks what Ray Data imports
            install = 'pip install -e ".[data]"'
            raise ValueError(
                f"executor ray needs Ray Data, which the [data] extra installs: {install} ({err})"
            ) from None
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self._started = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": False,
                "configure_logging": False,
            }
            if address:
                kwargs["address"] = address
            elif num_cpus:
                kwargs["num_cpus"] = num_cpus
            ray.init(**kwargs)
            self._started = True
        self.address = address
        self.num_workers = num_workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.progress = progress

    def map(self, fn: Callable[[T], R], items: Sequence[T], desc: str = "") -> list[R]:
        if not items:
            return []
        import ray

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = self.progress
        ctx.verbose_progress = False
        if not self.progress:  # Ray Data logs every execution at INFO level
            logging.getLogger("ray.data").setLevel(logging.WARNING)
        rows = [{"index": k, "payload": pickle.dumps(item)} for k, item in enumerate(items)]
        ds = ray.data.from_items(rows, override_num_blocks=len(rows))
        size = min(self.num_workers, len(rows))
        ds = ds.map(_run_pickled(fn), num_cpus=1, compute=ray.data.TaskPoolStrategy(size=size))
        out = sorted(ds.take_all(), key=lambda r: r["index"])
        if len(out) != len(items):
            raise RuntimeError(f"ray executor returned {len(out)} results for {len(items)} tasks")
        return [pickle.loads(r["result"]) for r in out]

    def close(self) -> None:
        if self._started:
            import ray

            ray.shutdown()
            self._started = False

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "address": self.address or "local",
            "num_workers": self.num_workers,
        }


def make_executor(
    kind: str,
    *,
    address: str = "",
    num_cpus: int = 0,
    num_workers: int = 0,
    progress: bool = False,
) -> Executor:
    """`"local"` or `"ray"`; a ValueError for anything else."""
    if kind == "local":
        return LocalExecutor(progress=progress)
    if kind == "ray":
        return RayExecutor(
            address=address or None,
            num_cpus=num_cpus or None,
            num_workers=num_workers,
            progress=progress,
        )
    raise ValueError(f"executor must be 'local' or 'ray', got {kind!r}")
