"""`hybridlm speedrun`: the whole model flow on one machine, in one run directory.

    hybridlm speedrun [--config configs/speedrun.yaml] [--out runs/speedrun] [--skip rl,quantize]
                      [--only eval,report] [--set pretrain.train.max_steps=300]

The flow is the registry of stages, `hybridlm.stages.STAGES` (SPEC §5: curate, tokenizer,
pretrain, midtrain, long_context, sft, rl, mtp_heal, quantize, qad, eval, report): each `Stage`
(`hybridlm.stage`) names the stages whose outputs it reads, its section of the speedrun config
(same name), how the run wires that section (`settings`) and the call that runs it (`run`);
`Speedrun.run` goes down the registry, each stage writing `<run>/<stage>/`.

Each stage writes `<run>/<stage>/stage.json` when it finishes, with a fingerprint of its settings
and of its inputs' fingerprints. `<run>/provenance.json` records the run itself (command line,
settings that differ from configs/speedrun.yaml, git commit, library versions, threads, CPU,
and each stage's status and wall time), for the report. A rerun skips every finished stage whose
fingerprint is unchanged and reruns the others (and, through the fingerprints, everything
downstream of them). An input enters a fingerprint with the time its outputs were made, so a
stage rerun with `--force` (same settings, new outputs) reruns everything downstream too.
`--set skip=[]` runs the long-context variant (midtrain and long_context between pretrain and
SFT). Pretraining, midtraining, the extension and SFT continue from their newest checkpoint when
interrupted; the other stages take
minutes and restart. `--skip` leaves stages out: the model chain then continues from the newest
model before the skipped stage (e.g. `--skip rl` heals the SFT model's MTP head), and a skipped
tokenizer means the byte tokenizer. Paths inside the config may use `{run}` for the run directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from dataclasses import field
from pathlib import Path
from typing import Any

from rich.console import Console

from .config import Config
from .data.bpe import load_tokenizer
from .io.checkpoint import CheckpointError, latest_checkpoint
from .provenance import collect, now_iso
from .stage import Stage
from .stages import BY_NAME, MODEL_STAGES, STAGE_NAMES, STAGES

# the reference settings a run's provenance is compared with (present in a source checkout)
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "speedrun.yaml"


# ---------------------------------------------------------------------------- config
def _validate(self: Any) -> Any:
    unknown = sorted(set(self.skip) - set(STAGE_NAMES))
    if unknown:
        raise ValueError(f"skip: unknown stages {unknown}; stages are {list(STAGE_NAMES)}")
    for s in STAGES:
        if s.check is not None:
            s.check(getattr(self, s.name), self, STAGES)
    return self


# The flow's settings: the run directory, the time budget, the stages left out, and one section
# per stage of the registry that has a config (same name, that stage's config class).
SpeedrunConfig = dataclasses.make_dataclass(
    "SpeedrunConfig",
    [
        ("out_dir", str, field(default="runs/speedrun")),
        ("budget_minutes", float, field(default=30.0)),  # reported against the wall time
        ("skip", list[str], field(default_factory=list)),
        *[(s.name, s.config, field(default_factory=s.config)) for s in STAGES if s.config],
    ],
    bases=(Config,),
    kw_only=True,
    namespace={
        "WHAT": "speedrun config",
        "validate": _validate,
        "__doc__": "The flow's settings: one section per stage of `hybridlm.stages.STAGES` that "
        "has a config (same name), plus `out_dir`, `budget_minutes` and `skip`.",
        "__module__": __name__,
    },
)


# ---------------------------------------------------------------------------- helpers
def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _format_paths(obj: Any, run: str) -> Any:
    """`{run}` in every string of a plain config tree -> the run directory."""
    if isinstance(obj, str):
        return obj.replace("{run}", run)
    if isinstance(obj, list):
        return [_format_paths(x, run) for x in obj]
    if isinstance(obj, dict):
        return {k: _format_paths(v, run) for k, v in obj.items()}
    return obj


# a stage's outcome as metrics.jsonl names it (provenance.json keeps the finer status)
_LOG_STATUS = {
    "run": "done",
    "reused": "reused",
    "skipped": "skipped",
    "kept": "skipped",
    "not run": "skipped",
}


def _log(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


# ---------------------------------------------------------------------------- the flow
class Speedrun:
    """Runs the stages of a `SpeedrunConfig` in `cfg.out_dir` (see the module docstring)."""

    def __init__(
        self,
        cfg: SpeedrunConfig,
        *,
        only: list[str] | None = None,
        force: list[str] | None = None,
        progress: bool = True,
        threads: dict[str, Any] | None = None,
        argv: list[str] | None = None,
    ) -> None:
        """`threads`: what `hybridlm.threads.configure_threads` returned, when it was called;
        `argv`: the command line to record (default `sys.argv`). Both go to provenance.json."""
        self.cfg = cfg.validate()
        self.stages: tuple[Stage, ...] = STAGES
        self.run_dir = Path(cfg.out_dir)
        self.only = set(only) if only else None
        self.force = set(force or ())
        for name in (self.only or set()) | self.force:
            if name not in BY_NAME:
                raise ValueError(f"unknown stage {name!r}; stages are {list(STAGE_NAMES)}")
        self.progress = progress
        self.console = Console(quiet=not progress)
        self.summaries: dict[str, dict[str, Any]] = {}
        self.threads = threads
        self.argv = argv
        self.provenance: dict[str, Any] = {}

    # -------------------------------------------------------------- bookkeeping
    def stage_dir(self, name: str) -> Path:
        return self.run_dir / name

    def record(self, name: str) -> dict[str, Any] | None:
        """The stage's finished record; None when it has not finished or is skipped (a skipped
        stage's outputs from an earlier run are left out of the chain as well)."""
        path = self.stage_dir(name) / "stage.json"
        if name in self.cfg.skip or not path.is_file():
            return None
        return json.loads(path.read_text())

    def done(self, name: str) -> bool:
        return self.record(name) is not None

    def model_before(self, name: str) -> tuple[str, str] | None:
        """(stage, path) of the newest model produced before stage `name` (finished stages)."""
        order = MODEL_STAGES[: MODEL_STAGES.index(name)] if name in MODEL_STAGES else MODEL_STAGES
        for stage in reversed(order):
            if BY_NAME[stage].model == "variants":  # a quantised model is evaluated, not trained
                continue
            rec = self.record(stage)
            if rec is not None:
                return stage, rec["summary"]["model"]
        return None

    def model_path(self, name: str) -> str:
        """The model stage `name` starts from (ValueError when no earlier one has finished)."""
        found = self.model_before(name)
        if found is None:
            raise ValueError(
                f"stage {name} needs a model from an earlier stage (pretrain, midtrain, "
                "long_context, sft, rl, mtp_heal); "
                "none has finished in this run directory"
            )
        return found[1]

    def models(self) -> list[tuple[str, str, str]]:
        """(stage, name, path) of every finished model, in chain order; variants (the quantised
        checkpoints) are named by their recipe."""
        out = []
        for s in MODEL_STAGES:
            rec = self.record(s)
            if rec is None:
                continue
            if BY_NAME[s].model == "variants":
                out += [(s, r, p) for r, p in rec["summary"]["models"].items()]
            else:
                out.append((s, s, rec["summary"]["model"]))
        return out

    def tokenizer_spec(self) -> str:
        rec = self.record("tokenizer")
        return rec["summary"]["path"] if rec is not None else "byte"

    def tokenizer(self) -> Any:
        return load_tokenizer(self.tokenizer_spec())

    def format_paths(self, obj: Any) -> Any:
        """`{run}` in every string of a plain config tree -> the run directory."""
        return _format_paths(obj, str(self.run_dir))

    def settings(self, name: str) -> dict[str, Any]:
        """The stage's section with the run's wiring applied (what its fingerprint covers)."""
        return BY_NAME[name].settings(self)

    def inputs(self, name: str) -> list[str]:
        """The stages whose outputs stage `name` reads (their fingerprints enter its own)."""
        stage = BY_NAME[name]
        upstream = list(stage.inputs)
        found = self.model_before(name) if stage.model else None
        if found is not None:
            upstream.append(found[0])
        return [s for s in dict.fromkeys(upstream) if self.done(s)]

    def fingerprint(self, name: str) -> str:
        ins = {}
        for s in self.inputs(name):
            rec = self.record(s)
            assert rec is not None  # inputs() keeps finished stages only
            # which outputs, not only which settings: a forced rerun makes new ones
            ins[s] = [rec["fingerprint"], rec.get("made_at")]
        return _fingerprint({"stage": name, "settings": self.settings(name), "inputs": ins})

    def continue_or_start(self, stage: str, run: Any) -> Any:
        """`run(resume=, overwrite=)` for a checkpointed stage. `Speedrun.run` removed the stage
        dir unless an interrupted attempt with the same settings left it: continue from its
        checkpoints, or replace what it logged before the first one. When none of them is
        intact, the error says how to start the stage again here (`--force`)."""
        resume = latest_checkpoint(self.stage_dir(stage)) is not None
        try:
            return run(resume=resume, overwrite=not resume)
        except CheckpointError as err:
            how = f"start the stage again with `hybridlm speedrun --force {stage}`"
            raise CheckpointError(str(err).replace("start again with --overwrite", how)) from None

    # -------------------------------------------------------------- driver
    def start_provenance(self) -> dict[str, Any]:
        """Write `<run>/provenance.json` for this invocation (see `hybridlm.provenance`); the
        stages' statuses and times are added to it as they finish."""
        defaults = None
        if DEFAULT_CONFIG.is_file():
            try:
                defaults = SpeedrunConfig.load(DEFAULT_CONFIG).to_dict()
            except ValueError:  # an edited default that no longer parses: no reference
                defaults = None
        self.provenance = collect(
            argv=self.argv,
            config=self.cfg.to_dict(),
            defaults=defaults,
            defaults_path=DEFAULT_CONFIG if defaults is not None else None,
            threads=self.threads,
        )
        self.provenance |= {
            "run_dir": str(self.run_dir),
            "only": sorted(self.only) if self.only else None,
            "force": sorted(self.force),
            "skip": list(self.cfg.skip),
            "budget_minutes": self.cfg.budget_minutes,
            "stages": {},
        }
        self._write_provenance()
        return self.provenance

    def _write_provenance(self) -> None:
        path = self.run_dir / "provenance.json"
        path.write_text(json.dumps(self.provenance, indent=1, default=str))

    def _stage_status(self, name: str, status: str, seconds: float | None = None) -> None:
        """Record a stage's outcome in both places the report reads: a `stage` row of
        metrics.jsonl (done / reused / skipped) and provenance.json's `stages` (run / reused /
        skipped / kept / not run, with when a reused output was made)."""
        row: dict[str, Any] = {"kind": "stage", "stage": name, "status": _LOG_STATUS[status]}
        entry: dict[str, Any] = {"status": status}
        if seconds is not None:
            row["seconds"] = entry["seconds"] = seconds
        _log(self.run_dir / "metrics.jsonl", row)
        rec = self.record(name) if status != "run" else None
        if rec is not None:  # reused / kept: when and by what it was produced
            entry["seconds_when_run"] = rec.get("seconds")
            entry["produced_by"] = rec.get("run")
        self.provenance.setdefault("stages", {})[name] = entry
        self._write_provenance()

    def _finish(self, t_start: float) -> None:
        self.provenance["finished"] = now_iso()
        self.provenance["wall_seconds"] = time.time() - t_start
        self._write_provenance()

    def run(self) -> dict[str, Any]:
        """Go down the registry: skip what `--skip` / `--only` leave out, reuse every finished stage
        whose fingerprint is unchanged, run the others; derived stages (the report) always run,
        after the flow's finish is recorded."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg.save(self.run_dir / "speedrun.yaml")
        self.start_provenance()
        made_by = {
            "started": self.provenance["started"],
            "command": self.provenance["command"],
            "commit": self.provenance["git"].get("commit"),
            "dirty": self.provenance["git"].get("dirty"),
        }
        t_start = time.time()
        for i, stage in enumerate(self.stages, 1):
            name = stage.name
            selected = (self.only is None or name in self.only) and name not in self.cfg.skip
            header = f"[bold]speedrun {i}/{len(self.stages)}: {name}[/]"
            if stage.derived:
                self.console.print(header)
                self._finish(t_start)  # the report shows the flow's finish and wall time
                t0 = time.time()
                summary = stage.run(self)
                self._stage_status(name, "run", time.time() - t0)
                self.summaries[name] = summary
                continue
            if not selected:
                self.console.print(f"{header} [dim]skipped[/]")
                if name in self.cfg.skip:
                    self._stage_status(name, "skipped")
                else:  # left out by --only: an earlier run's outputs, if any, are still used
                    self._stage_status(name, "kept" if self.done(name) else "not run")
                continue
            fp = self.fingerprint(name)
            rec = self.record(name)
            if rec is not None and rec["fingerprint"] == fp and name not in self.force:
                self.console.print(f"{header} [dim]done before ({rec['seconds']:.0f} s), reused[/]")
                self._stage_status(name, "reused")
                self.summaries[name] = rec["summary"]
                continue
            out = self.stage_dir(name)
            started = out / "started.json"
            same_start = started.is_file() and json.loads(started.read_text())["fingerprint"] == fp
            if out.exists() and (not same_start or name in self.force):
                shutil.rmtree(out)  # stale outputs of other settings or inputs
            out.mkdir(parents=True, exist_ok=True)
            (out / "stage.json").unlink(missing_ok=True)
            started.write_text(json.dumps({"fingerprint": fp, "time": time.time()}))
            self.console.print(f"{header} -> {out}")
            t0 = time.time()
            summary = stage.run(self)
            seconds = time.time() - t0
            record = {
                "stage": name,
                "fingerprint": fp,
                "seconds": seconds,
                "made_at": time.time(),
                "summary": summary,
                "run": made_by,  # not in the fingerprint: provenance, not settings
            }
            (out / "stage.json").write_text(json.dumps(record, indent=1, default=str))
            self._stage_status(name, "run", seconds)
            self.summaries[name] = summary
            self.console.print(f"[green]{name} done[/] in {seconds:.0f} s")
        total = time.time() - t_start
        self._finish(t_start)
        self.console.print(
            f"[bold]speedrun finished[/] in {total / 60:.1f} min: "
            f"{self.run_dir / 'report.md'}, {self.run_dir / 'report.html'}"
        )
        return {"seconds": total, "stages": self.summaries, "run_dir": str(self.run_dir)}


# ---------------------------------------------------------------------------- loading
def load_config(path: str, overrides: list[str], out: str = "", skip: str = "") -> SpeedrunConfig:
    cfg = SpeedrunConfig.load(path)
    if overrides:
        cfg = cfg.override(overrides)
    if out:
        cfg = dataclasses.replace(cfg, out_dir=out)
    if skip:
        cfg = dataclasses.replace(cfg, skip=[*cfg.skip, *(s for s in skip.split(",") if s)])
    return cfg.validate()
