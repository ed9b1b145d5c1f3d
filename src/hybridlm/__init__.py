"""hybridlm: the whole model flow for hybrid Mamba-2 / attention / LatentMoE models with MTP
(Nemotron 3 Super / 3.5) and dense Olmo-3-style transformers.

The configs are imported with the package; `HybridLM` and `ModelOutput` (and with them torch)
on first use (PEP 562), so `import hybridlm.<light module>` and the command line's argument
parsing stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import (
    AttentionConfig,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    YarnConfig,
    apply_overrides,
)

if TYPE_CHECKING:
    from .model.model import HybridLM, ModelOutput

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "HybridLM",
    "MLPConfig",
    "MambaConfig",
    "ModelConfig",
    "ModelOutput",
    "MoEConfig",
    "MTPConfig",
    "YarnConfig",
    "apply_overrides",
]

# public name -> the module that defines it, imported when the name is first used
_LAZY = {"HybridLM": ".model.model", "ModelOutput": ".model.model"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
