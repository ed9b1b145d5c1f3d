"""Named model configurations: the papers' models and CPU-sized `tiny-*` versions of each family.

Sources (see shared notes): Nemotron 3 Super from the report + NVIDIA's public NemotronH
config (notes §1.1-1.6); Nemotron 3.5 Lightning 30B-A3B has the Nemotron 3 Nano 30B-A3B shape
(public NemotronH config.json: d 2688, 52 layers, 128 experts top-6, no latent projection);
Olmo 3 7B / 32B from the Olmo 3 report and `Olmo3Config` (olmo3 notes §1).
"""

from __future__ import annotations

from .config import (
    AttentionConfig,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    YarnConfig,
)

SUPER_PATTERN = (
    "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
)
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def nemotron_3_super() -> ModelConfig:
    """120.6B total / 12.7B active; 88 layers (40 M, 40 E, 8 *), LatentMoE 512 experts top-22."""
    return ModelConfig(
        vocab_size=131072,
        d_model=4096,
        pattern=SUPER_PATTERN,
        max_seq_len=1048576,
        mamba=MambaConfig(
            num_heads=128, head_dim=64, state_size=128, n_groups=8, conv_kernel=4, chunk_size=128
        ),
        attention=AttentionConfig(num_heads=32, num_kv_heads=2, head_dim=128),
        moe=MoEConfig(
            num_experts=512,
            top_k=22,
            expert_hidden=2688,
            shared_expert_hidden=5376,
            latent_size=1024,
            routed_scaling_factor=5.0,
        ),
        mtp=MTPConfig(pattern="*E", depth=2, loss_weight=0.3),
    )


def nemotron_3_5_lightning() -> ModelConfig:
    """Nemotron 3.5 Lightning 30B-A3B: the Nemotron 3 Nano 30B-A3B shape (31.6B / 3.2B active),
    52 layers (23 M, 23 E, 6 *), standard MoE (no latent) 128 experts top-6, scaling 2.5, one
    shared-weight `*E` MTP layer as in the released Nemotron 3.5 checkpoints."""
    return ModelConfig(
        vocab_size=131072,
        d_model=2688,
        pattern=NANO_PATTERN,
        max_seq_len=1048576,
        mamba=MambaConfig(
            num_heads=64, head_dim=64, state_size=128, n_groups=8, conv_kernel=4, chunk_size=128
        ),
        attention=AttentionConfig(num_heads=32, num_kv_heads=2, head_dim=128),
        moe=MoEConfig(
            num_experts=128,
            top_k=6,
            expert_hidden=1856,
            shared_expert_hidden=3712,
            latent_size=None,
            routed_scaling_factor=2.5,
        ),
        mtp=MTPConfig(pattern="*E", depth=2, loss_weight=0.3),
    )


def _olmo3(layers: int, d: int, heads: int, kv_heads: int, hidden: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=100352,  # 100278 padded to a multiple of 128 (OLMo-core)
        d_model=d,
        pattern="*-" * layers,  # one Olmo3 decoder layer = attention block + SwiGLU block
        norm_eps=1e-6,
        norm_placement="post",
        max_seq_len=65536,
        attention=AttentionConfig(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=d // heads,
            rope_theta=500000.0,
            yarn=YarnConfig(
                factor=8.0,
                original_max_position_embeddings=8192,
                beta_fast=32,
                beta_slow=1,
                attention_factor=1.2079441541679836,
            ),
            qk_norm=True,
            sliding_window=4096,
            full_every=4,
        ),
        mlp=MLPConfig(hidden=hidden, activation="swiglu"),
    )


def olmo_3_7b() -> ModelConfig:
    return _olmo3(32, 4096, 32, 32, 11008)


def olmo_3_32b() -> ModelConfig:
    return _olmo3(64, 5120, 40, 8, 27648)


def tiny_super() -> ModelConfig:
    """Super's shape at ~10M parameters: Mamba-2 with 2d inner width, state 128 and chunk 128;
    GQA NoPE attention every 7th block; LatentMoE with latent d/4, many small relu^2 experts
    (expert hidden 2 x latent) and a full-width shared expert; MTP `*E`."""
    return ModelConfig(
        vocab_size=4096,
        d_model=256,
        pattern="MEMEM*EMEMEM*E",
        max_seq_len=4096,
        mamba=MambaConfig(num_heads=8, head_dim=64, state_size=128, n_groups=2, chunk_size=128),
        attention=AttentionConfig(num_heads=8, num_kv_heads=2, head_dim=32),
        moe=MoEConfig(
            num_experts=32,
            top_k=8,
            expert_hidden=128,
            shared_expert_hidden=384,
            latent_size=64,
            routed_scaling_factor=2.5,
        ),
        mtp=MTPConfig(pattern="*E", depth=2),
    )


def tiny_lightning() -> ModelConfig:
    """Lightning / Nano structure at CPU size: standard (non-latent) MoE, top-2 of 8."""
    return ModelConfig(
        vocab_size=4096,
        d_model=192,
        pattern="MEM*EMEME",
        max_seq_len=2048,
        mamba=MambaConfig(num_heads=6, head_dim=64, state_size=32, n_groups=2, chunk_size=64),
        attention=AttentionConfig(num_heads=6, num_kv_heads=2, head_dim=32),
        moe=MoEConfig(
            num_experts=8,
            top_k=2,
            expert_hidden=192,
            shared_expert_hidden=384,
            routed_scaling_factor=2.5,
        ),
        mtp=MTPConfig(pattern="*E", depth=2),
    )


def tiny_olmo() -> ModelConfig:
    """Olmo 3 at CPU size: SWA on 3 of 4 layers, YaRN on full layers, QK-norm, post-norm."""
    cfg = _olmo3(4, 256, 8, 4, 688)
    cfg.vocab_size = 4096
    cfg.max_seq_len = 2048
    cfg.attention.sliding_window = 64
    cfg.attention.yarn = YarnConfig(factor=4.0, original_max_position_embeddings=256)
    return cfg


PRESETS = {
    "nemotron-3-super-120b-a12b": nemotron_3_super,
    "nemotron-3.5-lightning-30b-a3b": nemotron_3_5_lightning,
    "olmo-3-7b": olmo_3_7b,
    "olmo-3-32b": olmo_3_32b,
    "tiny-super": tiny_super,
    "tiny-lightning": tiny_lightning,
    "tiny-olmo": tiny_olmo,
}


def get_preset(name: str) -> ModelConfig:
    """A fresh config for `name` (a new object every call, safe to modify)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
