"""The data a model was trained on, read from the run config that goes with a model path: what
`hybridlm quantize` calibrates and evaluates on and what `hybridlm mtp-boost` draws its prompts
from, for a model of any stage.

    data = training_data("runs/speedrun/sft")   # SFTDataConfig: the run's chat sources
    text = pretraining_data("runs/speedrun/pretrain")   # DataConfig of a pretraining run dir

A training checkpoint (a run directory stands for its newest) keeps its run config in
meta.json; a transformers or ModelOpt directory that a run exported (`<run>/hf`) has the run's
run.yaml beside it. The run config's `data` section is pretraining text (`DataConfig`: pretrain,
midtrain, long context), conversations (`SFTDataConfig`: SFT, distillation, QAD) or neither
(DPO / reward-model pairs, RL environments, a directory from elsewhere).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import from_dict, read_mapping
from ..data.config import DataConfig
from ..io import resolve
from ..io.checkpoint import read_meta
from .config import RunConfig
from .post_training import SFTDataConfig


def run_config_of(path: str | Path) -> tuple[dict[str, Any], str]:
    """The run config (plain data) a model path was trained under and the file it was read
    from; `({}, "")` for a directory no hybridlm run wrote."""
    where, kind = resolve(path)
    if kind == "checkpoint":
        return read_meta(where).get("run_config") or {}, str(where / "meta.json")
    beside = where.parent / "run.yaml"  # `<run>/hf` and the other exports inside a run
    if beside.is_file():
        return read_mapping(beside, "run config"), str(beside)
    return {}, ""


def training_data(path: str | Path, *, fix: str = "") -> DataConfig | SFTDataConfig | None:
    """The `data` section of the run a model path comes from (`run_config_of`): pretraining text
    or chat sources; None when the run has no data sources (or there is no run). A data section
    with sources that are neither is a ValueError ending in `fix` (what the caller can do)."""
    run, where = run_config_of(path)
    data = run.get("data")
    if not isinstance(data, dict) or "sources" not in data:
        return None
    try:
        return DataConfig.from_dict(data)
    except ValueError as text_err:
        try:
            return from_dict(SFTDataConfig, data, "data.")
        except ValueError as chat_err:
            # pretraining sources are named; chat sources are not: report the likelier reading
            named = any(isinstance(s, dict) and "name" in s for s in data.get("sources") or [])
            err = text_err if named else chat_err
            raise ValueError(
                f"the data section of {where} is neither pretraining text nor chat sources "
                f"({err}){': ' + fix if fix else ''}"
            ) from None


def pretraining_data(path: str | Path) -> DataConfig:
    """The `data` section of a pretraining run (its directory or its run.yaml)."""
    path = Path(path)
    if path.is_dir():
        path = path / "run.yaml"
    if not path.is_file():
        raise ValueError(f"no pretraining run config at {path} (data: a run dir or its run.yaml)")
    try:
        return RunConfig.load(path).data
    except ValueError as err:  # e.g. an SFT run, whose chat data calibrate with calib_data
        raise ValueError(
            f"data: {path} is not a pretraining run config ({err}); give a pretraining run "
            "(chat data: calib_data)"
        ) from None
