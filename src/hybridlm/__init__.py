"""hybridlm: the whole model flow for hybrid Mamba-2 / attention / LatentMoE models with MTP
(Nemotron 3 Super / 3.5) and dense Olmo-3-style transformers."""

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
