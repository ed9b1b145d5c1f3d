"""Parity with transformers' NemotronH and Olmo3, both directions, on random tiny configs (fp32).

"theirs -> ours": build a random transformers model, save it, load with hybridlm.io.load_model.
"ours -> theirs": build a random HybridLM, save_pretrained, load with AutoModelForCausalLM.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402  # noqa: E402
    AutoModelForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
)

from hybridlm import HybridLM  # noqa: E402
from hybridlm.interop.hf import family, save_pretrained, to_hf_config  # noqa: E402
from hybridlm.io import load_model  # noqa: E402
from hybridlm.train.objectives import causal_lm_loss  # noqa: E402

ATOL = 1e-5

NEMOTRON_BASE = dict(
    vocab_size=257,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=8,
    ssm_state_size=16,
    n_groups=2,
    chunk_size=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    intermediate_size=96,
    use_cache=False,
)
NEMOTRON_CASES = {
    "dense-mlp": dict(hybrid_override_pattern="M*M-"),
    "moe": dict(hybrid_override_pattern="ME*E", routed_scaling_factor=2.5),
    "moe-group-limited": dict(
        hybrid_override_pattern="E*ME", n_group=2, topk_group=1, num_experts_per_tok=3
    ),
    "latent-moe": dict(
        hybrid_override_pattern="MEM*E",
        moe_latent_size=32,
        routed_scaling_factor=5.0,
        num_experts_per_tok=3,
    ),
    "gqa-4-to-1": dict(hybrid_override_pattern="*-*E", num_key_value_heads=1),
    "mha-one-group": dict(
        hybrid_override_pattern="M*", num_key_value_heads=4, n_groups=1, chunk_size=16
    ),
    "mamba-no-conv-bias": dict(hybrid_override_pattern="MMM", use_conv_bias=False, n_groups=4),
    # a dt clamp that binds on both sides (time_step_limit; mamba-ssm's dt_limit)
    "dt-limit": dict(hybrid_override_pattern="M*M", time_step_limit=(0.05, 0.3)),
}

OLMO_BASE = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    use_cache=False,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
OLMO_CASES = {
    "swa-yarn": dict(
        num_hidden_layers=4,
        sliding_window=5,
        rope_parameters={
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "swa-6-layers-gqa": dict(
        num_hidden_layers=6, sliding_window=3, num_attention_heads=8, num_key_value_heads=2
    ),
    "full-mha-tied": dict(
        num_hidden_layers=2,
        sliding_window=4,
        num_key_value_heads=4,
        layer_types=["full_attention", "full_attention"],
        tie_word_embeddings=True,
    ),
}


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Randomise what default inits leave constant (norms, A_log, D, dt_bias, correction bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", ".D", "dt_bias", "conv1d.bias")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _tokens(vocab: int, L: int = 37, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, L), generator=torch.Generator().manual_seed(seed))


def _theirs_to_ours(hf_model, tmp_path):
    hf_model.eval()
    hf_model.save_pretrained(tmp_path / "theirs")
    ours = load_model(tmp_path / "theirs").eval()
    x = _tokens(hf_model.config.vocab_size)
    with torch.no_grad():
        ref = hf_model(x, use_cache=False).logits
        out = ours(x).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    return ours


def _ours_to_theirs(ours, tmp_path, **save_kw):
    ours.eval()
    save_pretrained(ours, tmp_path / "ours", **save_kw)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    x = _tokens(ours.config.vocab_size, seed=1)
    with torch.no_grad():
        ref = theirs(x, use_cache=False).logits
        out = ours(x).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    return theirs


@pytest.mark.parametrize("case", sorted(NEMOTRON_CASES))
def test_nemotron_h_parity_both_directions(case, tmp_path):
    torch.manual_seed(0)
    hf_cfg = NemotronHConfig(**{**NEMOTRON_BASE, **NEMOTRON_CASES[case]})
    hf_model = NemotronHForCausalLM(hf_cfg)
    _perturb(hf_model, 0)
    ours = _theirs_to_ours(hf_model, tmp_path)
    assert ours.config.pattern == NEMOTRON_CASES[case]["hybrid_override_pattern"]
    # and back: a fresh random HybridLM of the same config, saved by us, loaded by transformers
    fresh = HybridLM(ours.config, seed=1)
    _perturb(fresh, 1)
    _ours_to_theirs(fresh, tmp_path)


@pytest.mark.parametrize("case", sorted(OLMO_CASES))
def test_olmo3_parity_both_directions(case, tmp_path):
    torch.manual_seed(0)
    hf_model = Olmo3ForCausalLM(Olmo3Config(**{**OLMO_BASE, **OLMO_CASES[case]}))
    _perturb(hf_model, 0)
    ours = _theirs_to_ours(hf_model, tmp_path)
    assert family(ours.config) == "olmo3"
    fresh = HybridLM(ours.config, seed=2)
    _perturb(fresh, 2)
    _ours_to_theirs(fresh, tmp_path)


def test_sharded_checkpoint_round_trip(tmp_path):
    from hybridlm.presets import get_preset

    ours = HybridLM(get_preset("tiny-super"), seed=0)
    _perturb(ours, 3)
    _ours_to_theirs(ours, tmp_path, max_shard_bytes=2**20)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    again = load_model(tmp_path / "ours")
    for (n1, a), (n2, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(a, b), n1


def test_mtp_weights_use_vllm_names_and_round_trip(tmp_path):
    from safetensors import safe_open

    from hybridlm.presets import get_preset

    cfg = get_preset("tiny-super")
    ours = HybridLM(cfg, seed=0)
    save_pretrained(ours, tmp_path / "ckpt")
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    mtp = {k for k in keys if k.startswith("mtp.")}
    for name in (
        "mtp.layers.0.enorm.weight",
        "mtp.layers.0.hnorm.weight",
        "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.norm.weight",
        "mtp.layers.0.mixer.q_proj.weight",
        "mtp.layers.1.mixer.gate.weight",
        "mtp.layers.1.mixer.gate.e_score_correction_bias",
        "mtp.layers.1.mixer.experts.0.up_proj.weight",
        "mtp.layers.1.mixer.fc1_latent_proj.weight",
        "mtp.layers.1.final_layernorm.weight",
    ):
        assert name in mtp, name
    hf_cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert hf_cfg["num_nextn_predict_layers"] == 1 and hf_cfg["mtp_hybrid_override_pattern"] == "*E"
    again = load_model(tmp_path / "ckpt")
    x = _tokens(cfg.vocab_size)
    with torch.no_grad():
        out_a = ours.eval()(x, mtp_depth=ours.train_mtp_depth)
        a = causal_lm_loss(ours, out_a, x)[1]
        b = causal_lm_loss(again, again.eval()(x, mtp_depth=again.train_mtp_depth), x)[1]
    torch.testing.assert_close(a["mtp"], b["mtp"], rtol=0, atol=0)
    # transformers ignores mtp.* and loads the backbone
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            theirs(x, use_cache=False).logits, out_a.logits, rtol=0, atol=ATOL
        )


def test_unexportable_configs_raise_clear_errors():
    from hybridlm import ModelConfig

    cfg = ModelConfig(pattern="M*", norm_placement="post")
    with pytest.raises(ValueError, match="pre-norm"):
        to_hf_config(cfg)


def test_bad_checkpoint_dirs_raise_value_errors(tmp_path):
    with pytest.raises(ValueError, match=r"neither a transformers directory \(config.json\)"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError):
        load_model(tmp_path)


def test_failed_export_leaves_the_old_checkpoint(tmp_path):
    from hybridlm import ModelConfig
    from hybridlm.presets import get_preset

    good = HybridLM(get_preset("tiny-lightning"), seed=0)
    save_pretrained(good, tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    bad = HybridLM(ModelConfig(pattern="M*", norm_placement="post"), seed=0)  # not exportable
    with pytest.raises(ValueError):
        save_pretrained(bad, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    load_model(tmp_path)  # still loads
