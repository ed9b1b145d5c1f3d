"""Parameter counts: the papers' numbers, and num_params() == the built module for every preset."""

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.presets import PRESETS, get_preset


def test_super_matches_report():
    cfg = get_preset("nemotron-3-super-120b-a12b")
    assert (cfg.pattern.count("M"), cfg.pattern.count("E"), cfg.pattern.count("*")) == (40, 40, 8)
    assert [i for i, c in enumerate(cfg.pattern) if c == "*"] == [7, 16, 25, 36, 47, 58, 69, 78]
    n = cfg.num_params()
    assert abs(n.total - 120.6e9) / 120.6e9 < 0.005
    # The report's "120.6B / 12.7B" are these counts truncated to one decimal (active is 12.77B,
    # 0.55% above 12.7B, so a +-0.5% band around the rounded figure would not hold).
    assert 120.6e9 <= n.total < 120.7e9 and 12.7e9 <= n.active < 12.8e9
    assert cfg.kv_cache_bytes_per_token(2) == 8 * 1024  # "8 KiB per token in BF16" (notes §1.4)


def test_lightning_matches_nano_shape():
    n = get_preset("nemotron-3.5-lightning-30b-a3b").num_params()
    assert abs(n.total - 31.6e9) / 31.6e9 < 0.005
    assert abs(n.active - 3.6e9) / 3.6e9 < 0.01  # "3.6B including embeddings"


@pytest.mark.parametrize("name,total", [("olmo-3-7b", 7.3e9), ("olmo-3-32b", 32.2e9)])
def test_olmo3_counts(name, total):
    n = get_preset(name).num_params()
    assert n.total == n.active and abs(n.total - total) / total < 0.005


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_params_equals_built_module(name):
    cfg = get_preset(name)
    with torch.device("meta"):  # no memory, even for 120B
        model = HybridLM(cfg)
    counts = cfg.num_params()
    assert model.count_params() == counts.total + counts.mtp_total
    mtp = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    assert mtp == counts.mtp_total
    # active = everything except the routed experts, plus top_k / num_experts of them
    e = cfg.moe
    routed = sum(
        p.numel()
        for n, p in model.named_parameters()
        if ".experts." in n and not n.startswith("mtp.")
    )
    assert counts.active == model.count_params() - mtp - routed + routed * e.top_k // e.num_experts


def test_flops_and_state_sizes_are_positive_and_scale():
    cfg = get_preset("nemotron-3-super-120b-a12b")
    assert cfg.flops_per_token(8192, training=True) == 3 * cfg.flops_per_token(8192)
    assert cfg.flops_per_token(65536) > cfg.flops_per_token(8192)
    # 40 Mamba layers x (128 x 64 x 128 SSM + 10240 x 3 conv) fp32
    assert cfg.mamba_state_bytes_per_sequence(4) == 40 * (128 * 64 * 128 + 10240 * 3) * 4
