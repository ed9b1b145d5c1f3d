"""LR schedules (hand-computed values), AdamW param groups, TrainConfig / RunConfig round trip."""

import math

import pytest

from hybridlm.config import apply_overrides
from hybridlm.model.model import HybridLM
from hybridlm.presets import get_preset
from hybridlm.train.config import RunConfig, TrainConfig
from hybridlm.train.optim import build_optimizer, param_groups
from hybridlm.train.schedule import lr_at, lr_for


def _lr(step, kind, **kw):
    base = dict(kind=kind, peak_lr=1.0, total_steps=10, warmup_steps=2, min_lr=0.0)
    return lr_at(step, **{**base, **kw})


def test_warmup_is_linear_from_the_first_step():
    for kind in ("wsd", "cosine", "linear", "constant"):
        assert _lr(0, kind) == pytest.approx(0.5)
        assert _lr(1, kind) == pytest.approx(1.0)


def test_wsd_minus_sqrt_hand_values():
    # decay over the last 40% of 10 steps: t_decay = 6, T_decay = 4
    kw = dict(decay_fraction=0.4)
    assert [_lr(s, "wsd", **kw) for s in (2, 5, 6)] == [1.0, 1.0, 1.0]
    assert _lr(7, "wsd", **kw) == pytest.approx(1 - math.sqrt(1 / 4))  # 0.5
    assert _lr(8, "wsd", **kw) == pytest.approx(0.2928932188)
    assert _lr(9, "wsd", **kw) == pytest.approx(0.1339745962)
    assert _lr(7, "wsd", min_lr=0.1, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert _lr(8, "wsd", decay_shape="linear", **kw) == pytest.approx(0.5)
    assert _lr(8, "wsd", decay_shape="cosine", **kw) == pytest.approx(0.5)
    assert _lr(9, "wsd", decay_fraction=0.0) == 1.0  # no decay window


def test_cosine_and_linear_hand_values():
    # after 2 warmup steps, progress p = (step - 2) / 8
    assert _lr(2, "cosine") == pytest.approx(1.0)
    assert _lr(4, "cosine") == pytest.approx(0.8535533906)
    assert _lr(6, "cosine") == pytest.approx(0.5)
    assert _lr(9, "cosine") == pytest.approx(0.0380602337)
    assert _lr(4, "linear") == pytest.approx(0.75)
    assert _lr(6, "linear") == pytest.approx(0.5)
    assert _lr(6, "linear", min_lr=0.2) == pytest.approx(0.6)
    assert _lr(5, "constant") == 1.0


def test_lr_for_uses_the_config_and_bad_values_raise():
    cfg = TrainConfig(lr=2.0, min_lr=0.0, warmup_steps=0, schedule="linear")
    assert lr_for(cfg, 5, 10) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_at(0, kind="step", peak_lr=1.0, total_steps=10)
    with pytest.raises(ValueError, match="total_steps"):
        lr_at(0, kind="wsd", peak_lr=1.0, total_steps=0)
    with pytest.raises(ValueError, match="train.min_lr"):
        TrainConfig(lr=1e-3, min_lr=1e-2)
    with pytest.raises(ValueError, match="train.schedule"):
        TrainConfig(schedule="exp")
    with pytest.raises(ValueError, match="max_steps or train.total_tokens"):
        TrainConfig().num_steps(100)
    assert TrainConfig(total_tokens=1001).num_steps(100) == 11


def test_param_groups_by_name_and_ndim():
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.d_model, cfg.pattern = 258, 64, "ME*"
    model = HybridLM(cfg, seed=0)
    groups = {
        g["name"]: g for g in param_groups(model, weight_decay=0.1, no_decay=TrainConfig().no_decay)
    }
    no_decay, decay = set(groups["no_decay"]["names"]), set(groups["decay"]["names"])
    for name in (
        "embeddings.weight",
        "norm_f.weight",
        "layers.0.norm.weight",
        "layers.0.mixer.A_log",
        "layers.0.mixer.D",
        "layers.0.mixer.dt_bias",
        "layers.0.mixer.conv1d.bias",
        "mtp.enorm.weight",
    ):
        assert name in no_decay, name
    for name in (
        "lm_head.weight",
        "layers.0.mixer.in_proj.weight",
        "layers.1.mixer.gate.weight",
        "layers.1.mixer.experts.up_proj",
        "mtp.eh_proj.weight",
    ):
        assert name in decay, name
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.1
    assert len(no_decay) + len(decay) == len(list(model.parameters()))
    # embeddings decay when not listed; tied weights are counted once
    cfg.tie_embeddings = True
    tied = HybridLM(cfg, seed=0)
    g = param_groups(tied, weight_decay=0.1, no_decay=["*norm*"], no_decay_1d=False)
    names = [n for grp in g for n in grp["names"]]
    assert "embeddings.weight" in names and "lm_head.weight" not in names
    opt = build_optimizer(model, TrainConfig(beta1=0.8))
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)


def test_run_config_yaml_round_trip_and_overrides(tmp_path):
    run = RunConfig(model="tiny-super", train=TrainConfig(lr=1e-3, max_steps=5))
    run.save(tmp_path / "run.yaml")
    assert RunConfig.load(tmp_path / "run.yaml") == run
    new = apply_overrides(
        run,
        [
            "train.lr=3e-4",
            "model.d_model=128",
            "data.sources.0.max_files=7",
            "train.schedule=cosine",
        ],
    )
    assert new.train.lr == 3e-4 and new.train.schedule == "cosine"
    assert new.model.d_model == 128 and new.model.pattern == get_preset("tiny-super").pattern
    assert new.data.sources[0].max_files == 7
    new.save(tmp_path / "run.json")
    assert RunConfig.load(tmp_path / "run.json") == new
    assert apply_overrides(run, ["model=tiny-olmo"]).model == "tiny-olmo"
    with pytest.raises(ValueError, match="unknown key"):
        apply_overrides(run, ["train.learning_rate=1"])
    with pytest.raises(ValueError, match="not a preset"):
        apply_overrides(run, ["model=gpt5"])
    with pytest.raises(ValueError, match="must be a number"):
        apply_overrides(run, ["train.lr=fast"])
    with pytest.raises(ValueError, match="index"):
        apply_overrides(run, ["data.sources.3.max_files=1"])
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['train.lrr'\]"):
        RunConfig.from_dict({"train": {"lrr": 1}})
