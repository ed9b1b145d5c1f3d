"""Tiny model configurations shared by the training tests."""

from hybridlm.config import ModelConfig
from hybridlm.presets import get_preset


def tiny_train_model(*, mtp: bool = True) -> ModelConfig:
    """tiny-super shrunk to d_model 64 and pattern `ME*` (Mamba, LatentMoE, attention): a
    training step takes milliseconds on one core."""
    m = get_preset("tiny-super")
    m.vocab_size, m.d_model, m.pattern = 258, 64, "ME*"
    m.mamba.num_heads, m.mamba.head_dim, m.mamba.state_size, m.mamba.chunk_size = 4, 32, 16, 16
    m.attention.num_heads, m.attention.num_kv_heads, m.attention.head_dim = 4, 2, 16
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 8, 2, 32
    m.moe.latent_size, m.moe.shared_expert_hidden = 32, 64
    if not mtp:
        m.mtp.pattern = ""
    m.validate()
    return m
