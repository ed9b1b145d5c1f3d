"""Config round-trips, dotted overrides and validation messages."""

import pytest

from hybridlm import ModelConfig, MoEConfig, apply_overrides
from hybridlm.config import AttentionConfig
from hybridlm.data.config import DataConfig
from hybridlm.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_round_trip(name, suffix, tmp_path):
    cfg = get_preset(name)
    cfg.save(tmp_path / f"c{suffix}")
    assert ModelConfig.load(tmp_path / f"c{suffix}") == cfg


def test_dotted_overrides():
    cfg = apply_overrides(
        get_preset("tiny-super"), ["moe.top_k=8", "d_model=128", "attention.qk_norm=true"]
    )
    assert cfg.moe.top_k == 8 and cfg.d_model == 128 and cfg.attention.qk_norm is True
    cfg = apply_overrides(
        get_preset("tiny-super"), ["attention.rope_theta=10000", "attention.yarn.factor=2"]
    )
    assert cfg.attention.rope_theta == 10000.0 and cfg.attention.yarn.factor == 2.0
    cfg = apply_overrides(get_preset("tiny-olmo"), ["attention.yarn=null"])
    assert cfg.attention.yarn is None


@pytest.mark.parametrize(
    "override,match",
    [
        ("moe.topk=8", "unknown key"),
        ("moe.top_k=many", "must be an integer"),
        ("moe.top_k=99", "exceeds"),
        ("nope", "key=value"),
        ("d_model.x=1", "not a config section"),
        ("norm_placement=middle", "must be one of"),
    ],
)
def test_bad_overrides(override, match):
    with pytest.raises(ValueError, match=match):
        apply_overrides(get_preset("tiny-super"), [override])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pattern="MXE"), "unknown letter"),
        (dict(pattern=""), "must not be empty"),
        (dict(pattern="*", attention=AttentionConfig(num_heads=6, num_kv_heads=4)), "divisible"),
        (dict(pattern="E", d_model=64, moe=MoEConfig(latent_size=128)), "latent_size"),
        (dict(pattern="E", moe=MoEConfig(num_experts=4, top_k=5)), "exceeds"),
        (
            dict(pattern="**", attention=AttentionConfig(sliding_window=8, window_pattern="S")),
            "2 attention",
        ),
        (
            dict(pattern="*", attention=AttentionConfig(yarn={"factor": 2})),
            "needs attention.rope_theta",
        ),
    ],
)
def test_validation_messages(kwargs, match):
    if isinstance(kwargs.get("attention"), AttentionConfig) and isinstance(
        kwargs["attention"].yarn, dict
    ):
        from hybridlm.config import YarnConfig

        kwargs["attention"].yarn = YarnConfig(**kwargs["attention"].yarn)
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_unknown_file_keys_and_missing_files(tmp_path):
    (tmp_path / "c.yaml").write_text("d_model: 64\nmoe:\n  experts: 8\n")
    with pytest.raises(ValueError, match=r"moe\.experts"):
        ModelConfig.load(tmp_path / "c.yaml")
    with pytest.raises(ValueError, match="not found"):
        ModelConfig.load(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("gpt-5")


def test_a_missing_required_key_is_named():
    """A source without its `name` (e.g. a chat source read as a pretraining one) is a
    ValueError naming the key, not the constructor's TypeError."""
    with pytest.raises(ValueError, match=r"missing key\(s\) \['data\.sources\[0\]\.name'\]"):
        DataConfig.from_dict({"sources": [{"kind": "hf", "path": "x/y"}]})


def test_sliding_layout_follows_olmo3():
    cfg = get_preset("olmo-3-7b")
    sliding = cfg.attention_is_sliding()
    assert len(sliding) == 32 and sum(sliding) == 24
    assert [i for i, s in enumerate(sliding) if not s] == list(range(3, 32, 4))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_shipped_yaml_configs_match_presets(name):
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "configs" / "models" / f"{name}.yaml"
    assert ModelConfig.load(path) == get_preset(name), f"regenerate {path} with `hybridlm config`"
