"""Quantised KV caches (precision/kv_cache.py, model/cache.py codecs): FP8 / NVFP4 codecs equal
the formats' reference fake quantisation; the cache stores codes (bytes per token) and keeps
them through row selection, batching, padding, compaction and forks; cached decoding with a
quantised cache equals re-prefilling through one; calibration reads the stored keys' amax;
ModelOpt export writes kv_cache_quant_algo + k_scale / v_scale under vLLM's names and reads them
back; the engine's `kv_cache_dtype` and its errors."""

import json

import pytest
import torch

from hybridlm.infer.generate import generate
from hybridlm.interop.modelopt import export_modelopt, load_modelopt
from hybridlm.model.cache import HybridCache, KVState
from hybridlm.precision import kv_cache as kvq
from hybridlm.precision import ptq
from hybridlm.precision.formats import e4m3_round, nvfp4_fake_quant
from test_qad import ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- codecs
def test_codecs_equal_the_reference_fake_quantisation():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 32) * torch.tensor([0.5, 2.0, 8.0]).reshape(1, 3, 1, 1)
    s = torch.tensor(3.0 / 448)  # saturates the larger heads
    fp8 = kvq.FP8KV(s)
    parts = fp8.encode(x)
    assert parts[0].dtype == torch.float8_e4m3fn and parts[0].shape == x.shape
    assert torch.equal(fp8.decode(parts, torch.float32), e4m3_round(x / s) * s)
    heads = torch.tensor([0.5, 2.0, 8.0]) * 4 / 448  # per KV head
    per_head = kvq.FP8KV(heads).decode(kvq.FP8KV(heads).encode(x), torch.float32)
    assert torch.equal(
        per_head, e4m3_round(x / heads.reshape(1, 3, 1, 1)) * heads.reshape(1, 3, 1, 1)
    )
    g = ptq.per_tensor_scale("nvfp4", x.abs().amax())
    nv = kvq.NVFP4KV(g)
    packed, block = nv.encode(x)
    assert packed.shape == (2, 3, 5, 16) and block.shape == (2, 3, 5, 2)
    assert torch.equal(
        nv.decode((packed, block), torch.float32), nvfp4_fake_quant(x, global_scale=g)
    )
    with pytest.raises(ValueError, match="divisible by 16"):
        nv.encode(torch.randn(1, 1, 1, 24))


def test_cache_operations_keep_the_stored_codes():
    """Rows selected, batched with padding, compacted, forked: every decoded value is the
    decoded value of the same stored code (no requantisation)."""
    torch.manual_seed(0)
    codec = (kvq.NVFP4KV(torch.tensor(0.01)), kvq.NVFP4KV(torch.tensor(0.01)))
    a, b = KVState(codec=codec), KVState(codec=codec)
    ka, va = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    kb, vb = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    a.update(ka, va)
    b.update(kb, vb)
    assert a.nbytes() == 2 * 2 * 2 * 5 * (8 + 1)  # 16 values: 8 bytes of codes + 1 scale byte
    ref_a = a.k_BKSE.clone()
    assert torch.equal(a.select(torch.tensor([1])).k_BKSE, ref_a[1:])
    assert torch.equal(a.copy().k_BKSE, ref_a) and torch.equal(a.view().v_BKSE, a.v_BKSE)
    kp, _ = b.padded_left(2)
    padded = a.like(
        tuple(torch.cat(p) for p in zip(a.parts()[0], kp, strict=True)),
        tuple(torch.cat(p) for p in zip(a.parts()[1], b.padded_left(2)[1], strict=True)),
    )
    k = padded.k_BKSE
    assert torch.equal(k[:2], ref_a) and torch.equal(k[2:, :, 2:], b.k_BKSE)
    assert not k[2:, :, :2].any()  # zero codes decode to 0
    src = torch.tensor([[4, 3, 2, 1, 0], [0, 1, 2, 3, 4], [2, 3, 4, 4, 4]])
    padded.gather_columns(src)
    assert torch.equal(padded.k_BKSE[0], k[0][:, [4, 3, 2, 1, 0]])


# ----------------------------------------------------------------------------- in the model
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_decoding_through_a_quantised_cache_equals_reprefilling(fmt):
    model = tiny_model()
    prompt = ids(3, 1, 16)
    spec = kvq.calibrate_kv(model, [{"input_ids": ids(1)}])
    spec.fmt = fmt
    model.kv_cache_quant = spec
    got = generate(model, prompt, 6)  # "auto": the declared format
    seq = prompt
    codecs = kvq.kv_codecs(model, fmt)
    assert set(codecs) == {2}  # the attention block of ME*
    with torch.no_grad():
        for _ in range(6):
            cache = HybridCache.for_pattern(model.config.pattern, kv_codecs=codecs)
            logits = model(seq, cache=cache).logits
            assert cache.layers[2].parts()[0][0].dtype == (
                torch.float8_e4m3fn if fmt == "fp8" else torch.uint8
            )
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got[:, -6:], seq[:, -6:])
    # the quantised cache changes the logits, a little
    with torch.no_grad():
        plain = model(seq).logits
        cache = HybridCache.for_pattern(model.config.pattern, kv_codecs=codecs)
        quant = model(seq, cache=cache).logits
    assert not torch.equal(plain, quant)
    assert (plain - quant).abs().max() < 0.1 * plain.abs().max()


def test_calibration_reads_the_stored_keys_amax():
    model = tiny_model()
    rows = ids(5)
    spec = kvq.calibrate_kv(model, [{"input_ids": rows}])
    cache = HybridCache.for_pattern(model.config.pattern)
    with torch.no_grad():
        model(rows, cache=cache)
    k = cache.layers[2].k_BKSE
    assert torch.equal(spec.k_amax[2], k.abs().amax(dim=(0, 2, 3)))
    assert spec.tokens == rows.numel()
    scales = spec.scales("fp8")[2]
    assert float(scales[0]) == pytest.approx(float(k.abs().max()) / 448)


def test_engine_kv_cache_dtype_and_errors():
    from hybridlm.data.bpe import load_tokenizer
    from hybridlm.infer.engine import Engine

    model = tiny_model()
    tok = load_tokenizer("byte")
    with pytest.raises(ValueError, match="needs the KV scales"):
        Engine(model, tok, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kvq.kv_codecs(model, "int4")
    model.kv_cache_quant = kvq.calibrate_kv(model, [{"input_ids": ids(1)}])
    assert kvq.kv_codecs(model, "auto") == {}  # calibrated, but no format declared
    engine = Engine(model, tok, kv_cache_dtype="nvfp4")
    assert isinstance(engine.kv_codecs[2][0], kvq.NVFP4KV)
    with pytest.raises(ValueError, match="FP8 option"):
        model.kv_cache_quant.codecs("nvfp4", "head")


def test_modelopt_export_declares_and_reads_back_the_kv_cache(tmp_path):
    model = tiny_model()
    calib = [{"input_ids": ids(1)}]
    stats = ptq.calibrate(model, calib)
    q = ptq.clone_model(model)
    ptq.quantize_model(q, ptq.recipe_plan(q, "nvfp4"), stats)
    spec = kvq.calibrate_kv(q, calib)
    spec.fmt = "fp8"
    q.kv_cache_quant = spec
    export_modelopt(q, tmp_path, dtype=torch.float32)
    meta = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert meta["kv_cache_quant_algo"] == "FP8"
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["kv_cache_quant_algo"] == "FP8"
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    k_scale = tensors["backbone.layers.2.mixer.k_scale"]
    assert k_scale.dtype == torch.float32 and k_scale.shape == ()
    assert float(k_scale) == pytest.approx(float(spec.k_amax[2].max()) / 448)
    loaded = load_modelopt(tmp_path)
    assert loaded.kv_cache_quant.fmt == "fp8"
    got = loaded.kv_cache_quant.scales("fp8")[2]
    assert torch.equal(got[0], spec.scales("fp8")[2][0])
    assert torch.equal(got[1], spec.scales("fp8")[2][1])
    prompt = ids(3, 1, 12)
    assert torch.equal(generate(loaded, prompt, 5), generate(q, prompt, 5))
    # ModelOpt's projection-level names are read too
    from safetensors.torch import save_file

    renamed = {
        k.replace("mixer.k_scale", "mixer.k_proj.k_scale").replace(
            "mixer.v_scale", "mixer.v_proj.v_scale"
        ): v
        for k, v in tensors.items()
    }
    save_file(renamed, str(tmp_path / "model.safetensors"))
    again = load_modelopt(tmp_path)
    assert torch.equal(again.kv_cache_quant.scales("fp8")[2][0], spec.scales("fp8")[2][0])


def test_kv_scale_names_follow_vllms_loaders():
    """NemotronH: on the attention mixer (vLLM loads `mixer.k_scale` into `mixer.attn`); Olmo 3:
    ModelOpt's `self_attn.k_proj.k_scale` / `v_proj.v_scale`."""
    from hybridlm.interop.modelopt import _kv_scale_names
    from hybridlm.presets import get_preset

    assert _kv_scale_names(get_preset("tiny-super"), 5) == (
        "backbone.layers.5.mixer.k_scale",
        "backbone.layers.5.mixer.v_scale",
    )
    assert _kv_scale_names(get_preset("tiny-olmo"), 0) == (
        "model.layers.0.self_attn.k_proj.k_scale",
        "model.layers.0.self_attn.v_proj.v_scale",
    )


def test_the_study_runs_and_its_unquantised_cache_equals_the_plain_forward(tmp_path):
    """benchmarks/kv_cache_quant.py on a tiny model: every configuration decodes, the
    unquantised cache reproduces the forward's bpb, FP8 / NVFP4 KV shrink the cache, the plot
    renders."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kv_cache_quant as study_mod

    model = tiny_model()
    docs = ids(7, 3, 41).tolist()
    spec = kvq.calibrate_kv(model, [{"input_ids": ids(1)}])
    s = study_mod.study(model, docs, None, spec, length=40, bucket=16, chunk=3)
    r = s["results"]
    assert set(r) == {name for name, *_ in study_mod.CONFIGS}
    assert r["unquantised"]["bpb_all"] == pytest.approx(s["plain_forward_bpb"], rel=1e-5)
    assert (
        r["KV nvfp4"]["cache_bytes"] < r["KV fp8"]["cache_bytes"] < r["unquantised"]["cache_bytes"]
    )
    assert r["KV nvfp4"]["bpb_all"] != r["unquantised"]["bpb_all"]
    study_mod.plot(s, tmp_path / "kv.png")
    assert (tmp_path / "kv.png").stat().st_size > 5000


def test_speculative_greedy_equals_plain_greedy_with_a_quantised_kv_cache():
    """The speculative decoder stores the backbone's KV as plain decoding does (the declared
    format), so its greedy output is plain greedy's."""
    from hybridlm.infer.speculative import speculative_generate

    model = tiny_model()
    spec = kvq.calibrate_kv(model, [{"input_ids": ids(1)}])
    spec.fmt = "nvfp4"
    model.kv_cache_quant = spec
    prompt = ids(4, 1, 10)
    plain = generate(model, prompt, 12)
    fast, _ = speculative_generate(model, prompt, 12, draft_len=3)
    assert torch.equal(fast[:, : plain.shape[1]], plain)
