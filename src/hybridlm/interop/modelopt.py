"""ModelOpt-format quantised checkpoints (the layout vLLM and TensorRT-LLM load for NVIDIA
Model-Optimizer NVFP4 / FP8 exports), both directions.

`export_modelopt(qmodel, dir)` writes a transformers directory for a model converted by
`hybridlm.precision.ptq.quantize_model`; `load_modelopt(dir)` reads one back into a `HybridLM`
whose quantised operators are the same fake-quant modules (dequantised weights bit-identical,
same logits).

Tensor names are those of the transformers export (`interop.hf`: `backbone.layers.{i}.mixer.*`,
one tensor set per routed expert `experts.{e}.up_proj`, MTP under vLLM's names); a quantised
linear `<prefix>.weight` gets its companions next to it:

    NVFP4  <prefix>.weight          uint8 [N, K/2]   two E2M1 codes per byte, even element low
           <prefix>.weight_scale    float8_e4m3fn [N, K/16]  block decode scales
           <prefix>.weight_scale_2  fp32 []          per-tensor decode scale amax / (6 * 448)
           <prefix>.input_scale     fp32 []          activation per-tensor scale (static)
    FP8    <prefix>.weight          float8_e4m3fn [N, K]
           <prefix>.weight_scale    fp32 []          amax / 448
           <prefix>.input_scale     fp32 []          calibrated activation amax / 448

(decoded weight = code value * weight_scale * weight_scale_2; vLLM quantises activations with
1 / input_scale and rescales the GEMM by input_scale * weight_scale_2.) Unquantised tensors keep
the names and layout of the plain export, in `dtype`.

A model whose `kv_cache_quant` declares a format (`precision.kv_cache`: FP8 or NVFP4 KV cache)
gets `kv_cache_quant_algo` "FP8" / "NVFP4" and one fp32 scalar per attention layer and tensor:
`<attention>.k_scale` / `.v_scale` (FP8: amax / 448; NVFP4: the per-tensor scale amax / (6 * 448)),
next to the attention's projections: `backbone.layers.{i}.mixer.k_scale` for NemotronH (vLLM
loads it into the layer's `mixer.attn`), `model.layers.{i}.self_attn.k_proj.k_scale` /
`v_proj.v_scale` for Olmo 3 (ModelOpt's names, which vLLM remaps the same way).

Quantisation metadata, as ModelOpt writes it and vLLM's `ModelOptNvFp4Config` /
`ModelOptFp8Config` / `ModelOptMixedPrecisionConfig` read it:

    hf_quant_config.json  {"producer": {"name": "modelopt", ...},
                           "quantization": {"quant_algo": "NVFP4" | "FP8" | "MIXED_PRECISION",
                                            "kv_cache_quant_algo": null, "group_size": 16,
                                            "exclude_modules": [unquantised linears],
                                            "quantized_layers": {prefix: {"quant_algo": ...}}}}
    config.json           "quantization_config": {"quant_method": "modelopt", "quant_algo": ...,
                           "group_size": 16, "exclude_modules": [...], "ignore": [...], ...}

`quantized_layers` is written for MIXED_PRECISION (one entry per quantised linear and per
expert projection); a single-format export lists the unquantised linears in `exclude_modules`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..model.model import HybridLM
from ..model.moe import Experts
from ..precision.kv_cache import KV_FORMATS, KVCacheQuant
from ..precision.ptq import QuantExperts, QuantLinear, saturation_bound
from .hf import (
    _DTYPES,
    from_hf_config,
    from_hf_state_dict,
    read_safetensors_dir,
    to_hf_config,
    to_hf_state_dict,
    write_model_dir,
)

FIELDS = ("weight_scale", "weight_scale_2", "input_scale")
QUANT_ALGO = {"nvfp4": "NVFP4", "fp8": "FP8"}
GROUP_SIZE = 16
PRODUCER = {"name": "modelopt", "version": "hybridlm"}  # vLLM detects the format by this name


@dataclass
class _TensorView:
    """A config + state dict standing in for a model, to run `interop.hf`'s name mapping over
    tensors that are not a model's parameters (quantised weights and their scales)."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors


def _quantised(model: torch.nn.Module) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """{our weight name: (format, {ModelOpt field: tensor})}; experts' tensors are [E, ...]."""
    out: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            out[f"{name}.weight"] = (mod.fmt, mod.checkpoint_tensors())
        elif isinstance(mod, QuantExperts):
            for proj, t in mod.checkpoint_tensors().items():
                out[f"{name}.{proj}"] = (mod.fmt, t)
    return out


def _hf_names(cfg: ModelConfig, tensors: dict[str, torch.Tensor], field: str) -> dict:
    """Map our weight names to transformers names (experts split per expert), then rename the
    `weight` suffix to `field`."""
    hf = to_hf_state_dict(_TensorView(cfg, tensors))
    if field == "weight":
        return hf
    return {k.removesuffix("weight") + field: v for k, v in hf.items()}


def _linear_prefixes(cfg: ModelConfig, model: torch.nn.Module, quantised: set[str]) -> list[str]:
    """transformers prefixes of the linears (and expert projections) left unquantised."""
    names = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and f"{name}.weight" not in quantised:
            names[f"{name}.weight"] = mod.weight
        elif isinstance(mod, Experts):
            for proj in ("up_proj", "down_proj"):
                names[f"{name}.{proj}"] = getattr(mod, proj)
    if cfg.tie_embeddings:
        names.pop("lm_head.weight", None)
    hf = to_hf_state_dict(_TensorView(cfg, {k: v.detach()[..., :0] for k, v in names.items()}))
    prefixes = sorted(k.removesuffix(".weight") for k in hf)
    return prefixes + (["lm_head"] if cfg.tie_embeddings else [])


def quantization_metadata(
    cfg: ModelConfig, model: torch.nn.Module
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hf_quant_config.json content, config.json `quantization_config`)."""
    quant = _quantised(model)
    if not quant:
        raise ValueError("the model has no quantised operators; run ptq.quantize_model first")
    formats = sorted({fmt for fmt, _ in quant.values()})
    exclude = _linear_prefixes(cfg, model, set(quant))
    kv = _kv_format(model)
    q: dict[str, Any] = {"kv_cache_quant_algo": kv.upper() if kv else None}
    if len(formats) == 1:
        q["quant_algo"] = QUANT_ALGO[formats[0]]
        if formats[0] == "nvfp4":
            q["group_size"] = GROUP_SIZE
        q["exclude_modules"] = exclude
    else:
        q["quant_algo"] = "MIXED_PRECISION"
        layers: dict[str, Any] = {}
        for name, (fmt, t) in quant.items():
            entry = {"quant_algo": QUANT_ALGO[fmt]}
            if fmt == "nvfp4":
                entry["group_size"] = GROUP_SIZE
            for hf_name in _hf_names(cfg, {name: t["weight"][..., :0]}, "weight"):
                layers[hf_name.removesuffix(".weight")] = dict(entry)
        q["quantized_layers"] = dict(sorted(layers.items()))
        q["exclude_modules"] = exclude
    hf_quant = {"producer": PRODUCER, "quantization": q}
    config_q = {
        "quant_method": "modelopt",
        **q,
        "ignore": exclude,  # the key vLLM reads from config.json for the excluded modules
        "producer": PRODUCER,
    }
    return hf_quant, config_q


def export_modelopt(
    model: torch.nn.Module,
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write a ModelOpt-format directory (config.json, hf_quant_config.json, model.safetensors)
    for a model converted by `ptq.quantize_model`, with the model's `tokenizer`, chat template
    and generation config when given (`interop.hf.write_model_dir`). `dtype`: the unquantised
    tensors' dtype (default: the model's; bfloat16 is what vLLM serves); the router stays
    fp32."""
    cfg: ModelConfig = model.config
    dtype = dtype or model.embeddings.weight.dtype
    quant = _quantised(model)
    hf_quant, config_q = quantization_metadata(cfg, model)
    hf_cfg = to_hf_config(cfg, dtype)
    hf_cfg["quantization_config"] = config_q

    quant_modules = {n.removesuffix(".weight") for n in quant if n.endswith(".weight")}
    quant_modules |= {n.rpartition(".")[0] for n in quant if not n.endswith(".weight")}
    base = {}
    for name, t in model.state_dict().items():
        if name.rpartition(".")[0] in quant_modules:
            continue
        router = name.endswith(("gate.weight", "e_score_correction_bias"))
        base[name] = t.detach().to(torch.float32 if router else dtype)
    tensors = _hf_names(cfg, base | {n: t["weight"] for n, (_, t) in quant.items()}, "weight")
    for field in FIELDS:
        part = {n: t[field] for n, (_, t) in quant.items() if field in t}
        if part:
            tensors.update(_hf_names(cfg, part, field))
    tensors.update(_kv_scale_tensors(model))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    return write_model_dir(
        path,
        tensors,
        hf_cfg,
        tokenizer=tokenizer,
        extra_files={"hf_quant_config.json": hf_quant},
    )


def _kv_format(model: torch.nn.Module) -> str:
    """The KV-cache format the model declares ("" for none)."""
    spec = model.kv_cache_quant
    return spec.fmt if isinstance(spec, KVCacheQuant) else ""


def _kv_scale_names(cfg: ModelConfig, block: int) -> tuple[str, str]:
    """transformers names of attention block `block`'s k_scale / v_scale (module docstring)."""
    names = []
    for proj, field in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
        hf = next(iter(_hf_names(cfg, {f"layers.{block}.mixer.{proj}.weight": _EMPTY}, "weight")))
        prefix = hf.removesuffix(".weight")
        if ".self_attn." not in prefix:  # NemotronH: on the attention mixer itself
            prefix = prefix.rpartition(".")[0]
        names.append(f"{prefix}.{field}")
    return names[0], names[1]


_EMPTY = torch.empty(0)


def _kv_scale_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    fmt = _kv_format(model)
    if not fmt:
        return {}
    out = {}
    for i, (k, v) in model.kv_cache_quant.scales(fmt).items():
        kn, vn = _kv_scale_names(model.config, i)
        out[kn], out[vn] = k.float().reshape(()), v.float().reshape(())
    return out


def _read_kv_scales(
    cfg: ModelConfig, qcfg: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path
) -> KVCacheQuant | None:
    """The checkpoint's KV-cache format and scales (as amax per KV head), or None."""
    algo = qcfg.get("kv_cache_quant_algo")
    if not algo:
        return None
    fmt = str(algo).lower()
    if fmt not in KV_FORMATS:
        raise ValueError(f"{path}: kv_cache_quant_algo {algo!r}; hybridlm reads FP8 and NVFP4")
    spec = KVCacheQuant(fmt=fmt)
    heads = cfg.attention.num_kv_heads
    for i, letter in enumerate(cfg.pattern):
        if letter != "*":
            continue
        kn, vn = _kv_scale_names(cfg, i)
        # also ModelOpt's projection-level names (`...mixer.k_proj.k_scale`)
        kn = _first_present(tensors, kn, kn.replace(".k_scale", ".k_proj.k_scale"))
        vn = _first_present(tensors, vn, vn.replace(".v_scale", ".v_proj.v_scale"))
        if kn not in tensors or vn not in tensors:
            raise ValueError(f"{path} declares a {algo} KV cache but has no {kn} / {vn}")
        # the amax a per-tensor scale stands for, the same for every KV head
        for amax, name in ((spec.k_amax, kn), (spec.v_amax, vn)):
            amax[i] = saturation_bound(fmt, tensors[name].float()).reshape(()).expand(heads).clone()
    return spec


def _first_present(tensors: dict[str, torch.Tensor], name: str, alternative: str) -> str:
    return alternative if name not in tensors and alternative in tensors else name


# ============================================================================ import
def _format_of(t: torch.Tensor, name: str) -> str:
    if t.dtype == torch.uint8:
        return "nvfp4"
    if t.dtype == torch.float8_e4m3fn:
        return "fp8"
    raise ValueError(f"{name} has a weight_scale but dtype {t.dtype}: not NVFP4 or FP8")


def is_modelopt(path: str | Path) -> bool:
    """Whether a transformers directory holds a ModelOpt-quantised checkpoint
    (hf_quant_config.json, or config.json's `quantization_config` naming modelopt)."""
    path = Path(path)
    if (path / "hf_quant_config.json").is_file():
        return True
    q = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    return str(q.get("quant_method", "")).lower().startswith("modelopt")


def read_quant_config(path: Path) -> dict[str, Any]:
    """The `quantization` section (hf_quant_config.json, else config.json's)."""
    file = path / "hf_quant_config.json"
    if file.is_file():
        q = json.loads(file.read_text()).get("quantization", {})
    else:
        q = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
        if not str(q.get("quant_method", "")).lower().startswith("modelopt"):
            raise ValueError(f"{path} is not a ModelOpt-quantised checkpoint")
    algo = str(q.get("quant_algo", "")).upper()
    if algo not in ("NVFP4", "FP8", "MIXED_PRECISION"):
        raise ValueError(
            f"{path}: quant_algo {q.get('quant_algo')!r}; hybridlm reads NVFP4, FP8, "
            "MIXED_PRECISION"
        )
    return q


def load_modelopt(path: str | Path, *, dtype: torch.dtype | None = None) -> HybridLM:
    """Read a ModelOpt NVFP4 / FP8 / mixed directory into a `HybridLM` with fake-quant modules
    (`QuantLinear` / `QuantExperts`) for the quantised operators."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a checkpoint directory (no config.json)")
    hf_cfg = json.loads((path / "config.json").read_text())
    qcfg = read_quant_config(path)
    tensors = read_safetensors_dir(path)
    has_mtp = any(k.startswith("mtp.") for k in tensors)
    cfg = from_hf_config(hf_cfg, has_mtp=has_mtp)
    kv_spec = _read_kv_scales(cfg, qcfg, tensors, path)
    tensors = {k: v for k, v in tensors.items() if not k.endswith((".k_scale", ".v_scale"))}

    def is_field(k: str) -> bool:
        return k.rpartition(".")[2] in FIELDS

    sd = from_hf_state_dict(cfg, {k: v for k, v in tensors.items() if not is_field(k)})
    fields: dict[str, dict[str, torch.Tensor]] = {}
    for field in FIELDS:
        part = {
            k.removesuffix(field) + "weight": v
            for k, v in tensors.items()
            if k.endswith("." + field)
        }
        for name, t in from_hf_state_dict(cfg, part).items():
            fields.setdefault(name, {})[field] = t
    quantised = {n for n, f in fields.items() if "weight_scale" in f}
    if not quantised:
        raise ValueError(f"{path} declares {qcfg.get('quant_algo')} but holds no weight_scale")
    algo = str(qcfg["quant_algo"]).upper()
    found = {_format_of(sd[n], n) for n in quantised}
    if algo != "MIXED_PRECISION" and found != {algo.lower()}:
        raise ValueError(f"{path}: quant_algo {algo} but the tensors are {sorted(found)}")

    if dtype is None:
        dtype = _DTYPES.get(hf_cfg.get("dtype") or hf_cfg.get("torch_dtype"), torch.float32)
    rest = {}
    for name, t in sd.items():
        if name in quantised:
            continue
        router = name.endswith(("gate.weight", "e_score_correction_bias"))
        rest[name] = t.to(torch.float32 if router else dtype)
    # the quantised weights stay on the meta device until their modules are replaced below
    model = HybridLM.from_state_dict(cfg, rest, missing_ok=quantised, what=f"checkpoint {path}")
    experts: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for name in sorted(quantised):
        t = {"weight": sd[name], **fields[name]}
        fmt = _format_of(sd[name], name)
        if name.endswith(".weight"):
            module = name.removesuffix(".weight")
            lin = model.get_submodule(module)
            _set(model, module, QuantLinear(fmt, t, lin.in_features))
        else:  # 3-D experts: one input scale for all experts (vLLM takes their max)
            module, _, proj = name.rpartition(".")
            t["input_scale"] = t["input_scale"].float().amax()
            experts.setdefault(module, {})[proj] = t
    for module, projs in experts.items():
        if set(projs) != set(QuantExperts.PROJS):
            raise ValueError(f"{path}: {module} has quantised {sorted(projs)} only")
        fmts = {_format_of(t["weight"], module) for t in projs.values()}
        if len(fmts) != 1:
            raise ValueError(f"{path}: {module} mixes formats {sorted(fmts)} across projections")
        _set(model, module, QuantExperts(fmts.pop(), projs))
    model.kv_cache_quant = kv_spec
    meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if meta:
        raise ValueError(f"checkpoint {path} leaves tensors unset: {meta[:6]}")
    return model


def _set(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
