"""FP8 training (`precision.fp8`, torchao Float8Linear): which layers convert, that the
conversion keeps the model's parameters, and that training in FP8 follows training in fp32.
On a CPU torch emulates the FP8 GEMMs, so the numerics are checked here; speed is measured on
a GPU (`benchmarks/gpu_check.py --only train`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _tiny import tiny_run, tiny_train_model

pytest.importorskip("torchao.float8")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_fp8_plan_follows_the_super_recipe():
    from hybridlm import HybridLM
    from hybridlm.precision.fp8 import convert_for_fp8_training
    from hybridlm.presets import get_preset

    cfg = get_preset("nemotron-3-super-120b-a12b")
    with torch.device("meta"):
        model = HybridLM(cfg)
    keys_before = list(model.state_dict().keys())
    report = convert_for_fp8_training(model)
    by = report.by_format()
    head = cfg.pattern[:74]  # the last 14 of 88 layers stay BF16 (§2.2)
    # Mamba in_proj and out_proj (NVFP4 / MXFP8 in the recipe) and the shared expert's two
    # linears: FP8; attention, latent projections, routed experts, MTP and LM head: BF16
    mamba = [i for i, c in enumerate(head) if c == "M"]
    want = {f"layers.{i}.mixer.{p}" for i in mamba for p in ("in_proj", "out_proj")}
    want |= {n for n in by["fp8"] if n.startswith("layers.") and ".shared_experts." in n}
    assert set(by["fp8"]) == want
    assert len(want) == 2 * head.count("M") + 2 * head.count("E")
    reasons = {r.name: r.reason for r in report.rows}
    experts = [
        n
        for n in reasons
        if n.startswith("layers.") and n.endswith(".experts") and int(n.split(".")[1]) < 74
    ]
    assert experts and all("grouped" in reasons[n] for n in experts)
    assert all(r.format == "bf16" for r in report.rows if r.name.startswith(("mtp", "lm_head")))
    assert list(model.state_dict().keys()) == keys_before
    assert "fp8" in report.table()


def test_fp8_conversion_keeps_parameters_and_skips_odd_shapes():
    from torchao.float8.float8_linear import Float8Linear

    from hybridlm import HybridLM
    from hybridlm.precision.fp8 import convert_for_fp8_training

    cfg = tiny_train_model()
    model = HybridLM(cfg, seed=0)
    params = dict(model.named_parameters())
    report = convert_for_fp8_training(model)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    fp8 = report.by_format()["fp8"]
    assert "layers.0.mixer.out_proj" in fp8 and "layers.1.mixer.shared_experts.up_proj" in fp8
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in fp8)
    # the conversion is idempotent
    assert convert_for_fp8_training(model).by_format()["fp8"] == fp8

    # in_proj's out_features 2 * 128 + 2 * 16 + 4 heads: not a multiple of 16
    row = next(r for r in report.rows if r.name == "layers.0.mixer.in_proj")
    assert row.format == "bf16" and "16" in row.reason


def test_fp8_training_follows_fp32(tmp_path: Path):
    """The same 12 pretraining steps in fp32 and with `train.low_precision=fp8`: the loss
    curves agree within 2% at every logged step (e4m3 products carry ~3 significant bits less
    than bf16), and the FP8 run learns."""
    from hybridlm.report.plot import read_metrics
    from hybridlm.train.stages.pretrain import run_pretrain

    base = dict(
        max_steps=12, warmup_steps=2, log_interval=2, eval_interval=0, checkpoint_interval=0
    )
    curves = {}
    for lp in ("none", "fp8"):
        out = run_pretrain(tiny_run(tmp_path, lp, docs=20, low_precision=lp, **base))
        rows = [r for r in read_metrics(Path(out["metrics"])) if r["kind"] == "train"]
        curves[lp] = [r["loss"] for r in rows]
    assert len(curves["fp8"]) == len(curves["none"]) == 6
    assert curves["fp8"] != curves["none"]  # the FP8 GEMMs ran (e4m3 rounding shows)
    for a, b in zip(curves["fp8"], curves["none"], strict=True):
        assert abs(a - b) <= 0.02 * b, curves
    assert curves["fp8"][-1] < curves["fp8"][0] - 0.3, curves
