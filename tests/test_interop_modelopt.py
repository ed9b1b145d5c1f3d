"""ModelOpt-format export / import (interop/modelopt.py): the layout vLLM loads (names, dtypes,
shapes, scalar scales, config keys), tensor names equal to the plain transformers export, and the
round trip: dequantised weights bit-identical, logits equal."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from _tiny import tiny_train_model
from hybridlm.interop.hf import save_pretrained
from hybridlm.interop.modelopt import export_modelopt, load_modelopt
from hybridlm.io import load_model
from hybridlm.model.model import HybridLM
from hybridlm.precision import ptq

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = HybridLM(tiny_train_model(), seed=0).eval()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(4))
    stats = ptq.calibrate(model, [{"input_ids": ids}])
    torch.set_num_threads(before)
    return model, ids, stats


def quantised(base, kind: str):
    model, _, stats = base
    q = ptq.clone_model(model)
    if kind == "mixed":
        plan = ptq.recipe_plan(q, "nvfp4")
        for p in ("q_proj", "k_proj", "v_proj"):
            plan[f"layers.2.mixer.{p}"] = "fp8"
        plan["layers.1.mixer.experts"] = "fp8"
        del plan["layers.0.mixer.out_proj"]  # stays unquantised (BF16 choice)
    else:
        plan = ptq.recipe_plan(q, kind)
    ptq.quantize_model(q, plan, stats)
    return q.eval()


def read(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("kind", ["nvfp4", "fp8", "mixed"])
def test_round_trip_bit_exact(base, kind, tmp_path):
    q = quantised(base, kind)
    export_modelopt(q, tmp_path)
    r = load_modelopt(tmp_path).eval()
    mods_q = {
        n: m for n, m in q.named_modules() if isinstance(m, ptq.QuantLinear | ptq.QuantExperts)
    }
    mods_r = {
        n: m for n, m in r.named_modules() if isinstance(m, ptq.QuantLinear | ptq.QuantExperts)
    }
    assert mods_q.keys() == mods_r.keys()
    for name, mq in mods_q.items():
        mr = mods_r[name]
        assert mq.fmt == mr.fmt, name
        for buf in ("weight_dq", "up_proj_dq", "down_proj_dq"):
            if hasattr(mq, buf):
                assert torch.equal(getattr(mq, buf), getattr(mr, buf)), (name, buf)
    for key, t in q.state_dict().items():  # every stored tensor, quantised or not
        assert torch.equal(
            t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
            r.state_dict()[key].view(torch.uint8)
            if t.dtype == torch.float8_e4m3fn
            else r.state_dict()[key],
        ), key
    ids = base[1]
    assert torch.equal(q(ids).logits, r(ids).logits)
    # every loader of the project (eval, generate, serve) reads it through hybridlm.io
    assert torch.equal(load_model(tmp_path).eval()(ids).logits, r(ids).logits)


def test_nvfp4_layout_as_vllm_expects(base, tmp_path):
    q = quantised(base, "nvfp4")
    export_modelopt(q, tmp_path, dtype=torch.bfloat16)
    t = read(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    hq = json.loads((tmp_path / "hf_quant_config.json").read_text())
    p = "backbone.layers.0.mixer.in_proj"
    N, K = q.layers[0].mixer.in_proj.weight_dq.shape
    assert t[f"{p}.weight"].dtype == torch.uint8 and t[f"{p}.weight"].shape == (N, K // 2)
    assert t[f"{p}.weight_scale"].dtype == torch.float8_e4m3fn
    assert t[f"{p}.weight_scale"].shape == (N, K // 16)
    for s in ("weight_scale_2", "input_scale"):
        assert t[f"{p}.{s}"].dtype == torch.float32 and t[f"{p}.{s}"].shape == ()
    # fused QKV (vLLM's QKVParallelLinear) share the per-tensor scales
    qkv = [f"backbone.layers.2.mixer.{n}_proj" for n in "qkv"]
    assert len({float(t[f"{n}.weight_scale_2"]) for n in qkv}) == 1
    assert len({float(t[f"{n}.input_scale"]) for n in qkv}) == 1
    # routed experts: one tensor set per expert, as the plain export splits them
    E = 8
    for e in range(E):
        for proj in ("up_proj", "down_proj"):
            n = f"backbone.layers.1.mixer.experts.{e}.{proj}"
            assert t[f"{n}.weight"].dtype == torch.uint8 and t[f"{n}.weight_scale_2"].shape == ()
    # unquantised tensors in the requested dtype; router fp32
    assert t["backbone.embeddings.weight"].dtype == torch.bfloat16
    assert t["lm_head.weight"].dtype == torch.bfloat16
    assert t["backbone.layers.1.mixer.gate.weight"].dtype == torch.float32
    assert cfg["dtype"] == "bfloat16"
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["group_size"] == 16
    assert "lm_head" in qc["exclude_modules"] and qc["ignore"] == qc["exclude_modules"]
    assert "mtp.layers.0.eh_proj" in qc["exclude_modules"]
    assert hq["producer"]["name"] == "modelopt"
    assert hq["quantization"]["quant_algo"] == "NVFP4"
    assert hq["quantization"]["exclude_modules"] == qc["exclude_modules"]
    # the bf16 export loads and serves the same model up to the bf16 rounding of its
    # unquantised tensors, which moves the logits far less than NVFP4 itself does
    r = load_modelopt(tmp_path, dtype=torch.float32).eval()
    assert torch.equal(r.layers[0].mixer.in_proj.weight_dq, q.layers[0].mixer.in_proj.weight_dq)
    ids = base[1]
    with torch.no_grad():
        a, b, ref = r(ids).logits, q(ids).logits, base[0](ids).logits
    assert float((a - b).abs().mean()) < 0.5 * float((b - ref).abs().mean())


def test_names_are_the_plain_export_names(base, tmp_path):
    q = quantised(base, "mixed")
    export_modelopt(q, tmp_path / "q")
    save_pretrained(base[0], tmp_path / "plain")
    plain = set(read(tmp_path / "plain"))
    names = set(read(tmp_path / "q"))
    fields = (".weight_scale", ".weight_scale_2", ".input_scale")
    assert {n for n in names if not n.endswith(fields)} == plain
    for n in names - plain:
        assert n.rsplit(".", 1)[0] + ".weight" in plain


def test_mixed_precision_config(base, tmp_path):
    q = quantised(base, "mixed")
    export_modelopt(q, tmp_path)
    t = read(tmp_path)
    hq = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "MIXED_PRECISION"
    layers = hq["quantized_layers"]
    assert layers["backbone.layers.0.mixer.in_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert layers["backbone.layers.2.mixer.q_proj"] == {"quant_algo": "FP8"}
    assert layers["backbone.layers.1.mixer.experts.3.up_proj"] == {"quant_algo": "FP8"}
    assert "backbone.layers.0.mixer.out_proj" not in layers
    assert "backbone.layers.0.mixer.out_proj" in hq["exclude_modules"]
    fp8 = "backbone.layers.2.mixer.q_proj"
    assert t[f"{fp8}.weight"].dtype == torch.float8_e4m3fn
    assert t[f"{fp8}.weight_scale"].shape == () and f"{fp8}.weight_scale_2" not in t
    assert t["backbone.layers.0.mixer.out_proj.weight"].dtype == torch.float32
    # every tensor of a quantised layer is listed, nothing else is
    for name in layers:
        assert f"{name}.weight_scale" in t
    assert {n.removesuffix(".weight_scale") for n in t if n.endswith(".weight_scale")} == set(
        layers
    )


def test_errors(base, tmp_path):
    with pytest.raises(ValueError, match="no quantised operators"):
        export_modelopt(base[0], tmp_path / "none")
    save_pretrained(base[0], tmp_path / "plain")
    with pytest.raises(ValueError, match="not a ModelOpt"):
        load_modelopt(tmp_path / "plain")
    q = quantised(base, "fp8")
    export_modelopt(q, tmp_path / "q")
    f = tmp_path / "q" / "hf_quant_config.json"
    cfg = json.loads(f.read_text())
    cfg["quantization"]["quant_algo"] = "NVFP4"
    f.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_algo NVFP4 but the tensors are"):
        load_modelopt(tmp_path / "q")
    cfg["quantization"]["quant_algo"] = "INT4_AWQ"
    f.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hybridlm reads"):
        load_modelopt(tmp_path / "q")
