"""PTQ (precision/ptq.py, `hybridlm quantize`): NVFP4 MSE block-scale search never worse than
amax scaling, fake-quant modules == the dequantised reference GEMM (decoded here from the packed
nibbles), hand-computed NVFP4 / FP8 values, the converter's exclusions and fused-group scales,
calibration amax, and the CLI end to end on a tiny random model."""

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _tiny import tiny_sft_run, tiny_train_model
from hybridlm.cli import main
from hybridlm.cli.precision import register
from hybridlm.data.config import DataConfig, SourceConfig
from hybridlm.interop.hf import save_pretrained
from hybridlm.interop.modelopt import export_modelopt, load_modelopt
from hybridlm.io.checkpoint import save_checkpoint
from hybridlm.model.mlp import relu2
from hybridlm.model.model import HybridLM
from hybridlm.precision import ptq
from hybridlm.precision.formats import NVFP4Tensor, nvfp4_fake_quant, nvfp4_quantize
from hybridlm.train.config import RunConfig, TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def decode_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, s_g) -> torch.Tensor:
    """Reference decode written from the format definition: low nibble = even element, bit 3 =
    sign, value = E2M1[code & 7] * block scale (e4m3) * per-tensor scale."""
    lo, hi = (packed & 15).long(), (packed >> 4).long()
    codes = torch.stack([lo, hi], -1).flatten(-2)
    table = torch.tensor(E2M1 + [-v for v in E2M1])
    vals = table[codes]
    scale = block_scale.float().repeat_interleave(16, dim=-1)
    return vals * scale * float(s_g)


def tiny_model(seed: int = 0) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(tiny_train_model(), seed=seed).eval()


def batch(n: int = 2, L: int = 48, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, L), generator=g)
    return {"input_ids": ids, "labels": ids}


# ----------------------------------------------------------------------------- weight scales
def test_nvfp4_hand_computed_block():
    """One block with global scale 1 and amax 6: block scale 1, values on the grid exact; 2.4
    rounds to 2, the tie 2.5 to the even code (2.0), 5.5 to 6, 0.2 to 0 and 0.3 to 0.5."""
    w = torch.tensor([[6.0, -3.0, 1.5, -0.5, 2.4, 2.5, 5.5, 0.2, 0.3] + [0.0] * 7])
    q = ptq.nvfp4_quantize_weight(w, global_scale=1.0, search="max")
    assert q.block_scale.float().tolist() == [[1.0]]
    got = decode_nvfp4(q.packed, q.block_scale, q.global_scale)
    want = torch.tensor([[6.0, -3.0, 1.5, -0.5, 2.0, 2.0, 6.0, 0.0, 0.5] + [0.0] * 7])
    assert torch.equal(got, want)
    # first byte: element 0 (6.0 -> code 7) low nibble, element 1 (-3.0 -> 8|5 = 13) high
    assert int(q.packed[0, 0]) == 7 | (13 << 4)


def test_fp8_hand_computed():
    """FP8 per-tensor: scale amax/448; 448*s decodes exactly, 1.0 (E4M3 spacing 2^-3 at
    [1, 2)) stays 1.0, 1.0625 ties to even 1.0, and the static input scale saturates at 448."""
    s = ptq.fp8_weight_scale(torch.tensor(896.0))
    assert float(s) == 2.0
    w = torch.tensor([[896.0, 2.0, 2.125, -2.0 * 1.0625, 0.0]])
    got = ptq.fp8_quantize_weight(w, scale=s).float() * s
    assert got.tolist() == [[896.0, 2.0, 2.0, -2.0, 0.0]]
    x = torch.tensor([1000.0, -5.0])
    assert ptq.fake_quant_input(x, "fp8", s).tolist() == [896.0, -5.0]


def test_mse_search_never_worse_than_amax():
    g = torch.Generator().manual_seed(0)
    # gaussian rows plus heavy-tailed rows (outliers are where the search pays off)
    w = torch.cat([torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g) ** 3])
    s_g = ptq.nvfp4_weight_global_scale(w.abs().amax())
    q_max = ptq.nvfp4_quantize_weight(w, global_scale=s_g, search="max")
    q_mse = ptq.nvfp4_quantize_weight(w, global_scale=s_g, search="mse")
    err_max = (decode_nvfp4(q_max.packed, q_max.block_scale, s_g) - w).square()
    err_mse = (decode_nvfp4(q_mse.packed, q_mse.block_scale, s_g) - w).square()
    per_block_max = err_max.view(128, 16, 16).sum(-1)
    per_block_mse = err_mse.view(128, 16, 16).sum(-1)
    assert bool((per_block_mse <= per_block_max).all())  # block by block, never worse
    assert float(per_block_mse.sum()) < 0.9 * float(per_block_max.sum())  # and clearly better
    changed = (q_mse.block_scale.float() != q_max.block_scale.float()).float().mean()
    assert 0.05 < float(changed) < 1.0


def test_max_search_equals_formats_quantizer():
    w = torch.randn(32, 64)
    s_g = ptq.nvfp4_weight_global_scale(w.abs().amax())
    mine = ptq.nvfp4_quantize_weight(w, global_scale=s_g, search="max")
    ref: NVFP4Tensor = nvfp4_quantize(w, global_scale=s_g)
    assert torch.equal(mine.packed, ref.packed)
    assert torch.equal(mine.block_scale.view(torch.uint8), ref.block_scale.view(torch.uint8))


def test_quantize_weight_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 16"):
        ptq.nvfp4_quantize_weight(torch.randn(4, 24), global_scale=1.0)
    with pytest.raises(ValueError, match="search"):
        ptq.nvfp4_quantize_weight(torch.randn(4, 32), global_scale=1.0, search="l1")


# ----------------------------------------------------------------------------- modules
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_quant_linear_equals_dequantised_reference_gemm(fmt):
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g) * 0.05)
    x = torch.randn(3, 5, 64, generator=g)
    x_amax = float(x.abs().amax()) * 0.8  # runtime activations beyond calibration saturate
    q = ptq.QuantLinear.from_linear(
        lin,
        fmt,
        weight_amax=float(lin.weight.detach().abs().amax()),
        input_amax=x_amax,
        search="mse",
    )
    t = q.checkpoint_tensors()
    if fmt == "nvfp4":
        assert t["weight"].dtype == torch.uint8 and t["weight"].shape == (48, 32)
        assert t["weight_scale"].dtype == torch.float8_e4m3fn and t["weight_scale"].shape == (48, 4)
        w_ref = decode_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])
        assert float(t["input_scale"]) == pytest.approx(x_amax / (6 * 448))
        x_ref = nvfp4_fake_quant(x, global_scale=t["input_scale"])
    else:
        assert t["weight"].dtype == torch.float8_e4m3fn and t["weight_scale"].dim() == 0
        w_ref = t["weight"].float() * t["weight_scale"]
        s = t["input_scale"]
        assert float(s) == pytest.approx(x_amax / 448)
        x_ref = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    torch.testing.assert_close(q(x), F.linear(x_ref, w_ref), rtol=1e-6, atol=1e-7)
    w = lin.weight.detach()
    assert float((w_ref - w).abs().max()) < 0.25 * float(w.abs().max())


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_quant_experts_equal_per_token_reference(fmt):
    model = tiny_model()
    moe = model.layers[1].mixer
    T, K = 20, moe.cfg.top_k
    g = torch.Generator().manual_seed(3)
    z = torch.randn(T, moe.experts.up_proj.shape[2], generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    amax = {"up_proj": 2.0, "down_proj": 0.01}
    qe = ptq.QuantExperts.from_experts(moe.experts, fmt, input_amax=amax, search="mse")
    t = qe.checkpoint_tensors()
    want = torch.zeros_like(z)
    for tok in range(T):
        for k in range(K):
            e = int(idx[tok, k])
            if fmt == "nvfp4":
                up = decode_nvfp4(
                    t["up_proj"]["weight"][e],
                    t["up_proj"]["weight_scale"][e],
                    t["up_proj"]["weight_scale_2"][e],
                )
                down = decode_nvfp4(
                    t["down_proj"]["weight"][e],
                    t["down_proj"]["weight_scale"][e],
                    t["down_proj"]["weight_scale_2"][e],
                )
            else:
                up = t["up_proj"]["weight"][e].float() * t["up_proj"]["weight_scale"][e]
                down = t["down_proj"]["weight"][e].float() * t["down_proj"]["weight_scale"][e]
            zq = ptq.fake_quant_input(z[tok : tok + 1], fmt, t["up_proj"]["input_scale"][e])
            h = ptq.fake_quant_input(relu2(zq @ up.T), fmt, t["down_proj"]["input_scale"][e])
            want[tok] += w[tok, k] * (h @ down.T)[0]
    torch.testing.assert_close(qe(z, idx, w), want, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- converter
def test_converter_exclusions_and_fused_scales():
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = ptq.calibrate(model, [batch()])
    q = ptq.clone_model(model)
    applied = ptq.quantize_model(q, ptq.recipe_plan(q, "nvfp4"), stats)
    assert set(applied.values()) == {"nvfp4"}
    # not linears, or excluded: untouched
    assert isinstance(q.lm_head, nn.Linear) and isinstance(q.mtp.eh_proj, nn.Linear)
    assert isinstance(q.mtp.layers[0].mixer.q_proj, nn.Linear)
    sd = q.state_dict()
    for key in (
        "embeddings.weight",
        "lm_head.weight",
        "layers.0.mixer.A_log",
        "layers.0.mixer.D",
        "layers.0.mixer.conv1d.weight",
        "layers.0.mixer.dt_bias",
        "layers.1.mixer.gate.weight",
        "layers.1.mixer.gate.e_score_correction_bias",
        "layers.2.norm.weight",
    ):
        assert torch.equal(sd[key], before[key]), key
    mixer = q.layers[1].mixer
    assert isinstance(mixer.experts, ptq.QuantExperts)
    assert isinstance(mixer.fc1_latent_proj, ptq.QuantLinear)
    attn = q.layers[2].mixer
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    assert all(isinstance(m, ptq.QuantLinear) for m in qkv)
    # vLLM fuses Q/K/V into one GEMM: one per-tensor weight scale and one input scale
    assert len({float(m.weight_scale_2) for m in qkv}) == 1
    assert len({float(m.input_scale) for m in qkv}) == 1
    w_amax = max(
        float(before[f"layers.2.mixer.{p}.weight"].abs().amax())
        for p in ("q_proj", "k_proj", "v_proj")
    )
    assert float(attn.q_proj.weight_scale_2) == pytest.approx(w_amax / (6 * 448))
    # fused decode paths would bypass the quantised modules: the layers see they are converted
    from hybridlm.model.stock import is_stock

    assert not is_stock(q.layers[0].mixer) and not is_stock(mixer)
    # a dtype cast moves the compute copies only; the stored tensors keep their formats
    stored = {k: (v.dtype, v.clone()) for k, v in q.state_dict().items() if "in_proj" in k}
    q.to(torch.bfloat16)
    assert q.layers[0].mixer.in_proj.weight_dq.dtype == torch.bfloat16
    for k, (dt, v) in stored.items():
        assert q.state_dict()[k].dtype == dt and torch.equal(q.state_dict()[k], v), k


def test_converter_module_filter_and_errors():
    model = tiny_model()
    stats = ptq.calibrate(model, [batch()])
    q = ptq.clone_model(model)
    plan = ptq.recipe_plan(q, "fp8", exclude=ptq.DEFAULT_EXCLUDE + ("*out_proj", "*.experts"))
    ptq.quantize_model(q, plan, stats, exclude=ptq.DEFAULT_EXCLUDE + ("*out_proj", "*.experts"))
    assert isinstance(q.layers[0].mixer.out_proj, nn.Linear)
    assert isinstance(q.layers[1].mixer.experts, type(model.layers[1].mixer.experts))
    assert isinstance(q.layers[0].mixer.in_proj, ptq.QuantLinear)
    bad = ptq.recipe_plan(model, "nvfp4")
    bad["layers.2.mixer.k_proj"] = "fp8"
    with pytest.raises(ValueError, match="one format"):
        ptq.quantize_model(ptq.clone_model(model), bad, stats)
    with pytest.raises(ValueError, match="not quantisable"):
        ptq.quantize_model(ptq.clone_model(model), {"lm_head": "fp8"}, stats)
    with pytest.raises(ValueError, match="unknown format"):
        ptq.quantize_model(ptq.clone_model(model), {"layers.0.mixer.in_proj": "int4"}, stats)
    partial = ptq.calibrate(model, [batch()], exclude=ptq.DEFAULT_EXCLUDE + ("*.o_proj",))
    with pytest.raises(ValueError, match="no calibration statistics"):
        ptq.quantize_model(ptq.clone_model(model), {"layers.2.mixer.o_proj": "fp8"}, partial)


def test_calibration_amax_matches_direct_computation():
    model = tiny_model()
    b = batch()
    stats = ptq.calibrate(model, [b])
    with torch.no_grad():
        x0 = model.layers[0].norm(model.embeddings(b["input_ids"]))
    assert stats.input_amax["layers.0.mixer.in_proj"] == pytest.approx(float(x0.abs().amax()))
    assert stats.batches == 1 and stats.tokens == b["input_ids"].numel()
    assert {"layers.1.mixer.experts.up_proj", "layers.1.mixer.experts.down_proj"} <= set(
        stats.input_amax
    )
    assert not any(k.startswith("mtp.") or k == "lm_head" for k in stats.input_amax)


def test_ptq_recipes_track_the_unquantised_logits():
    model = tiny_model()
    b = batch()
    stats = ptq.calibrate(model, [b])
    with torch.no_grad():
        ref = model(b["input_ids"]).logits
    err = {}
    for rec in ("fp8", "nvfp4"):
        q = ptq.clone_model(model)
        ptq.quantize_model(q, ptq.recipe_plan(q, rec), stats)
        with torch.no_grad():
            err[rec] = float((q(b["input_ids"]).logits - ref).square().mean())
    assert 0 < err["fp8"] < err["nvfp4"] < float(ref.square().mean())


# ----------------------------------------------------------------------------- CLI
def test_cli_quantize_end_to_end(tmp_path: Path):
    """Training checkpoint of a tiny random model + a small text corpus -> `quantize` with
    autoquant: reports written, and the exported directory evaluates to the reported loss."""
    txt = tmp_path / "txt"
    txt.mkdir()
    for i in range(16):
        (txt / f"{i:02d}.txt").write_text(f"Note {i}: " + "the cat sat on the mat. " * (i % 4 + 3))
    data = DataConfig(
        sources=[SourceConfig(name="t", kind="text", path=str(txt))],
        shards_dir=str(tmp_path / "shards"),
        seq_len=48,
        batch_size=2,
        eval_split="hash",
        eval_fraction=0.25,
        eval_docs=4,
    )
    run = RunConfig(model=tiny_train_model(), data=data, train=TrainConfig(out_dir=str(tmp_path)))
    model = HybridLM(run.model_config(), seed=0)
    ckpt = save_checkpoint(
        tmp_path / "run", step=1, model=model, optimizer=None, meta={"run_config": run.to_dict()}
    )
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    out = tmp_path / "q"
    args = parser.parse_args(
        [
            "quantize",
            str(ckpt),
            str(out),
            "--recipe",
            "autoquant",
            "--budget",
            "6",
            "--calib-samples",
            "4",
            "--eval-batches",
            "2",
            "--dtype",
            "float32",
        ]
    )
    args.fn(args)
    summary = json.loads((out / "quantize.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["model"] == "unquantized" and rows[1]["model"] == "autoquant"
    assert summary["quantized"]["effective_bits"] <= 6.0 + 1e-9
    groups = {r["group"]: r for r in summary["groups"]}
    assert "layers.2.mixer.qkv_proj" in groups and "layers.1.mixer.experts" in groups
    assert all("loss_delta" in r for r in summary["groups"])
    loaded = load_modelopt(out)
    from hybridlm.data.bpb import token_byte_lengths
    from hybridlm.data.pipeline import build_loaders, prepare_shards

    held = ptq.take(build_loaders(data, prepare_shards(data))[1], 2)
    got = ptq.evaluate(loaded, held, token_byte_lengths(None, 258))
    assert got["loss"] == pytest.approx(summary["quantized"]["loss"], rel=1e-6)
    # a run's transformers export (`<run>/hf` next to run.yaml): the run's data, fp8 recipe
    save_pretrained(model, tmp_path / "run" / "hf")
    run.save(tmp_path / "run" / "run.yaml")
    out2 = tmp_path / "q2"
    args = parser.parse_args(
        [
            "quantize",
            str(tmp_path / "run" / "hf"),
            str(out2),
            "--recipe",
            "fp8",
            "--calib-samples",
            "2",
            "--eval-batches",
            "1",
            "--no-per-layer",
        ]
    )
    args.fn(args)
    s2 = json.loads((out2 / "quantize.json").read_text())
    assert set(s2["plan"].values()) == {"fp8"} and "data of" in s2["source"]
    with pytest.raises(ValueError, match="budget"):
        args = parser.parse_args(
            ["quantize", str(ckpt), str(out), "--recipe", "autoquant", "--budget", "3"]
        )
        args.fn(args)


def test_cli_quantize_takes_a_model_of_any_stage_with_set_overrides(tmp_path: Path, capsys):
    """A model with an SFT run config beside it (the run directory, its transformers export) is
    quantised on the stdlib corpus in its own tokenizer, calibrated on the run's chat rows;
    `--set` sets `QuantizeConfig` fields after the flags; a ModelOpt export (quantised already)
    is quantised anew from its dequantised weights."""
    sft = tiny_sft_run(tmp_path)
    small = ["calib_samples=2", "eval_batches=1", "per_layer=false", "progress=false"]
    sets = [a for s in small for a in ("--set", s)]
    for name, path in (("run", sft), ("hf", sft / "hf")):
        out = tmp_path / name
        assert main(["quantize", str(path), str(out), "--recipe", "nvfp4", *sets]) == 0
        s = json.loads((out / "quantize.json").read_text())
        assert s["calibration"]["data"] == "its run's chat data", s["calibration"]
        assert "stdlib corpus" in s["source"] and s["settings"]["calib_samples"] == 2
        assert s["settings"]["per_layer"] is False and "loss_delta" not in s["groups"][0]
    out = tmp_path / "again"
    argv = ["quantize", str(tmp_path / "hf"), str(out), *sets, "--set", "recipe=fp8"]
    assert main([*argv, "--set", "kv_cache=fp8"]) == 0
    s = json.loads((out / "quantize.json").read_text())
    assert "(dequantised)" in s["source"] and set(s["plan"].values()) == {"fp8"}
    assert s["kv_cache"]["format"] == "fp8"
    assert main(["quantize", str(sft), str(tmp_path / "x"), "--set", "colour=red"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "hybridlm quantize: error: override 'colour=red': unknown key 'colour'", err


def test_dequantize_model_gives_plain_modules_with_the_weights_computed_with(tmp_path: Path):
    model = tiny_model()
    b = batch(2, 24)
    stats = ptq.calibrate(model, [b])
    ptq.quantize_model(model, ptq.recipe_plan(model, "nvfp4"), stats)
    export_modelopt(model, tmp_path, dtype=torch.float32)
    loaded = load_modelopt(tmp_path)
    dq = {n: m for n, m in loaded.named_modules() if isinstance(m, ptq.QuantLinear)}
    dq_experts = {n: m for n, m in loaded.named_modules() if isinstance(m, ptq.QuantExperts)}
    assert dq and dq_experts
    ptq.dequantize_model(loaded)
    for name, mod in dq.items():
        plain = loaded.get_submodule(name)
        assert type(plain) is nn.Linear and torch.equal(plain.weight, mod.weight_dq)
    for name, mod in dq_experts.items():
        plain = loaded.get_submodule(name)
        assert not isinstance(plain, ptq.QuantExperts)
        assert torch.equal(plain.up_proj, mod.up_proj_dq)
        assert torch.equal(plain.down_proj, mod.down_proj_dq)
    assert loaded.kv_cache_quant is None and ptq.find_ops(loaded)


def test_quantised_model_decodes_through_the_cache():
    """Token-wise activation quantisation (1-D blocks within a row, static per-tensor scales)
    makes cached decoding equal the full forward: greedy generation == argmax re-forwarding."""
    from hybridlm.infer.generate import generate

    model = tiny_model()
    b = batch(1, 24)
    stats = ptq.calibrate(model, [b])
    q = ptq.clone_model(model)
    ptq.quantize_model(q, ptq.recipe_plan(q, "nvfp4"), stats)
    got = generate(q, b["input_ids"], 6)
    seq = b["input_ids"]
    with torch.no_grad():
        for _ in range(6):
            nxt = q(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(got[:, -6:], seq[:, -6:])
