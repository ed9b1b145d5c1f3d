"""The one loader: any model path -> the model, its tokenizer and what the path says about it.

    loaded = hybridlm.io.load("runs/quickstart")      # model, tokenizer, meta, kind, path
    model = hybridlm.io.load_model("ckpt/", dtype=torch.bfloat16)
    tokenizer = hybridlm.io.load_tokenizer_for("runs/sft")

A path is one of (`kind`):

    "transformers"  a transformers NemotronH / Olmo3 directory (config.json + safetensors)
    "modelopt"      a ModelOpt-quantised one (hf_quant_config.json, or config.json's
                    quantization_config): fake-quant modules for the quantised operators
    "checkpoint"    a hybridlm training checkpoint (`<run>/checkpoints/step_*`, meta.json), or a
                    run directory (checkpoints/), which stands for its newest checkpoint; a
                    sharded one (DCP, `hybridlm.io.sharded`) is consolidated into one model

The tokenizer is the one the model was trained with: a training checkpoint's run config names it
(`data.tokenizer`), a transformers directory holds its `tokenizer.json`, else the byte tokenizer
(the embedded default). The checkpoint file format is `hybridlm.io.checkpoint`; writing
transformers directories is `hybridlm.interop.hf.save_pretrained`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ..data.bpe import load_tokenizer
from ..interop.hf import load_pretrained
from ..interop.modelopt import is_modelopt, load_modelopt
from ..model.model import HybridLM
from .checkpoint import (
    checkpoint_model_config,
    is_sharded_checkpoint,
    load_checkpoint,
    read_meta,
    resolve_checkpoint,
)
from .sharded import load_sharded_model

Kind = Literal["transformers", "modelopt", "checkpoint"]

__all__ = [
    "Kind",
    "Loaded",
    "load",
    "load_model",
    "load_tokenizer_for",
    "resolve",
    "tokenizer_spec_for",
]


@dataclass(frozen=True)
class Loaded:
    """A loaded model path. `meta`: a checkpoint's meta.json (run config, step, ...) or a
    transformers directory's config.json; `path`: the directory read (a run directory resolves
    to its newest checkpoint)."""

    model: HybridLM
    tokenizer: Any
    meta: dict[str, Any]
    kind: Kind
    path: Path


def resolve(path: str | Path, *, setting: str = "") -> tuple[Path, Kind]:
    """The directory a model path stands for and its kind (see the module docstring).
    `setting` names the option the path came from (e.g. "train.init_from"), for the error."""
    p = Path(path)
    if not str(path) or not p.exists():
        kinds = "a run directory, training checkpoint, or transformers / ModelOpt directory"
        if setting:
            raise ValueError(
                f"{setting}={str(path)!r}: no such model; point {setting} at one "
                f"(--set {setting}=PATH: {kinds})"
            )
        raise ValueError(f"{str(path)!r}: no such model; give a model path ({kinds})")
    if (p / "config.json").is_file():
        return p, "modelopt" if is_modelopt(p) else "transformers"
    if (p / "meta.json").is_file() or (p / "checkpoints").is_dir():
        return resolve_checkpoint(p), "checkpoint"
    raise ValueError(
        f"{p} is neither a transformers directory (config.json), a training checkpoint "
        "(meta.json) nor a run directory (checkpoints/)"
    )


def load(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    tokenizer: str | Path | None = None,
    setting: str = "",
) -> Loaded:
    """The model, tokenizer and metadata of a model path. `dtype` casts the model (default: the
    checkpoint's own); `tokenizer` (a tokenizer spec, see `data.bpe.load_tokenizer`) replaces
    the one the path names; `setting`: the option the path came from, named by errors."""
    where, kind = resolve(path, setting=setting)
    model = _load_model(where, kind, dtype)
    tok = load_tokenizer(tokenizer) if tokenizer else load_tokenizer_for(where)
    if kind == "checkpoint":
        meta = read_meta(where)
    else:
        meta = json.loads((where / "config.json").read_text())
    return Loaded(model=model, tokenizer=tok, meta=meta, kind=kind, path=where)


def load_model(
    path: str | Path, *, dtype: torch.dtype | None = None, setting: str = ""
) -> HybridLM:
    """The model of a model path (training checkpoints come back in eval mode)."""
    return _load_model(*resolve(path, setting=setting), dtype)


def tokenizer_spec_for(path: str | Path, *, setting: str = "") -> str:
    """The spec (`data.tokenizer`, see `data.bpe.load_tokenizer`) of the tokenizer a model path
    was trained with: a directory holding `tokenizer.json` is its own spec; a training checkpoint
    or run directory names it in its run config (`data.tokenizer`); anything else loadable has
    the byte tokenizer (the embedded default)."""
    where, kind = resolve(path, setting=setting)
    if (Path(path) / "tokenizer.json").is_file():
        return str(path)
    if (where / "tokenizer.json").is_file():
        return str(where)
    if kind != "checkpoint":
        return "byte"
    data = read_meta(where)["run_config"].get("data") or {}
    spec = str(data.get("tokenizer") or "byte")
    if spec != "byte" and not Path(spec).exists():
        raise ValueError(
            f"{path} was trained with the tokenizer at {spec}, which does not exist here "
            "(run from the directory the model was trained in, or set data.tokenizer)"
        )
    return spec


def load_tokenizer_for(path: str | Path, *, setting: str = "") -> Any:
    """The tokenizer a model path was trained with (`tokenizer_spec_for`)."""
    return load_tokenizer(tokenizer_spec_for(path, setting=setting))


def _load_model(path: Path, kind: Kind, dtype: torch.dtype | None) -> HybridLM:
    if kind == "modelopt":
        return load_modelopt(path, dtype=dtype)
    if kind == "transformers":
        return load_pretrained(path, dtype=dtype)
    return _from_checkpoint(path, dtype)


def _from_checkpoint(path: Path, dtype: torch.dtype | None) -> HybridLM:
    """A training checkpoint's model, built from the run config in its meta.json, in eval mode
    (a sharded checkpoint's shards of every rank consolidated)."""
    model = HybridLM.empty(checkpoint_model_config(path), "cpu")
    if is_sharded_checkpoint(read_meta(path)):
        load_sharded_model(path, model)
    else:
        load_checkpoint(path, model, restore_rng=False)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
