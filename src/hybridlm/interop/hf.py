"""Hugging Face interop: transformers `NemotronH` and `Olmo3` checkpoints, both directions.

`load_pretrained(dir)` reads a directory with `config.json` and safetensors (one file or a sharded
`model.safetensors.index.json`), written by transformers, by NVIDIA (`backbone.*`, one tensor per
expert) or by hybridlm. `save_pretrained(model, dir, tokenizer=tok)` writes one that
`transformers.AutoModelForCausalLM.from_pretrained` loads, and with the model's tokenizer one that
serves alone: tokenizer files with the chat template of `data.chat`, `generation_config.json`
(stopping at EOS and at the end-of-turn token) and the tokenizer's BOS / EOS / PAD ids in
`config.json`. `write_model_dir` is the one writer of model directories (plain and ModelOpt).

Key mapping, hybridlm -> NemotronH checkpoint (the layout of NVIDIA's released checkpoints, which
transformers converts on load and vLLM reads directly):

    embeddings.weight                       backbone.embeddings.weight
    layers.{i}.norm.weight                  backbone.layers.{i}.norm.weight
    layers.{i}.mixer.<param>                backbone.layers.{i}.mixer.<param>
    layers.{i}.mixer.experts.up_proj[e]     backbone.layers.{i}.mixer.experts.{e}.up_proj.weight
    layers.{i}.mixer.experts.down_proj[e]   backbone.layers.{i}.mixer.experts.{e}.down_proj.weight
    norm_f.weight                           backbone.norm_f.weight
    lm_head.weight                          lm_head.weight

MTP, under the names vLLM's `NemotronHMTP.load_weights` reads (vllm/model_executor/models/
nemotron_h_mtp.py: the first MTP layer owns the fusion, the last the closing norm; transformers
ignores `mtp.*` on load):

    mtp.enorm.weight / mtp.hnorm.weight     mtp.layers.0.enorm.weight / mtp.layers.0.hnorm.weight
    mtp.eh_proj.weight                      mtp.layers.0.eh_proj.weight   ([emb; hidden] order)
    mtp.layers.{j}.<as backbone layers>     mtp.layers.{j}.<same, experts split per expert>
    mtp.final_layernorm.weight              mtp.layers.{last}.final_layernorm.weight

Olmo3: one transformers decoder layer i is our blocks 2i (attention) and 2i+1 (SwiGLU MLP):

    layers.{2i}.mixer.{q,k,v,o}_proj        model.layers.{i}.self_attn.{q,k,v,o}_proj
    layers.{2i}.mixer.{q,k}_norm            model.layers.{i}.self_attn.{q,k}_norm
    layers.{2i}.norm                        model.layers.{i}.post_attention_layernorm
    layers.{2i+1}.mixer.{gate,up,down}_proj model.layers.{i}.mlp.{gate,up,down}_proj
    layers.{2i+1}.norm                      model.layers.{i}.post_feedforward_layernorm
    embeddings / norm_f / lm_head           model.embed_tokens / model.norm / lm_head
"""

from __future__ import annotations

import json
import math
import re
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..config import (
    AttentionConfig,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    YarnConfig,
)
from ..data.chat import STOP
from ..model.model import HybridLM

NEMOTRON_LETTERS = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
HF_LAYER_TYPES = {
    "mamba": "M",
    "linear_attention": "M",
    "moe": "E",
    "attention": "*",
    "full_attention": "*",
    "mlp": "-",
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ====================================================================== configs
def family(cfg: ModelConfig) -> str:
    """'olmo3' for reordered-norm SwiGLU stacks of (attention, MLP) pairs, else 'nemotron_h'."""
    pairs = len(cfg.pattern) % 2 == 0 and cfg.pattern == "*-" * (len(cfg.pattern) // 2)
    if pairs and cfg.norm_placement == "post" and cfg.mlp.activation == "swiglu":
        return "olmo3"
    return "nemotron_h"


def to_hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    dtype_name = str(dtype).removeprefix("torch.")
    if cfg.num_labels:
        raise ValueError(
            "cannot export a reward model (num_labels > 0) to transformers: NemotronH has no "
            "sequence-classification class; load it from its run directory"
        )
    if family(cfg) == "olmo3":
        return _olmo3_config(cfg, dtype_name)
    return _nemotron_config(cfg, dtype_name)


def _unsupported(what: str, fam: str) -> ValueError:
    return ValueError(f"cannot export to transformers {fam}: {what}")


def _nemotron_config(cfg: ModelConfig, dtype_name: str) -> dict[str, Any]:
    a, m, e = cfg.attention, cfg.mamba, cfg.moe
    letters = set(cfg.pattern) | set(cfg.mtp.pattern)
    if cfg.norm_placement != "pre":
        raise _unsupported("NemotronH uses pre-norm blocks (norm_placement='pre')", "NemotronH")
    if "*" in letters and (a.rope_theta is not None or a.qk_norm or a.sliding_window is not None):
        raise _unsupported(
            "NemotronH attention has no RoPE, QK-norm or sliding window", "NemotronH"
        )
    if "-" in letters and cfg.mlp.activation != "relu2":
        raise _unsupported("NemotronH dense MLPs are relu2", "NemotronH")
    if "E" in letters and e.shared_expert_hidden == 0:
        raise _unsupported("transformers' NemotronHMoE always has a shared expert", "NemotronH")
    if cfg.mtp.pattern and cfg.mtp.heads > 1:
        raise _unsupported(
            "vLLM's NemotronH MTP is one shared head; consolidate the per-depth heads first "
            "(hybridlm mtp-boost --set mtp_boost.init=consolidate)",
            "NemotronH",
        )
    if cfg.mtp.pattern and set(cfg.mtp.pattern) - {"*", "E"}:
        raise _unsupported(
            "vLLM's NemotronH MTP layers are attention and MoE blocks only", "NemotronH"
        )
    out = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "dtype": dtype_name,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "hybrid_override_pattern": cfg.pattern,
        "layers_block_type": [NEMOTRON_LETTERS[c] for c in cfg.pattern],
        "num_hidden_layers": len(cfg.pattern),
        "tie_word_embeddings": cfg.tie_embeddings,
        "layer_norm_epsilon": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "attention_bias": False,
        "mamba_num_heads": m.num_heads,
        "mamba_head_dim": m.head_dim,
        "ssm_state_size": m.state_size,
        "n_groups": m.n_groups,
        "conv_kernel": m.conv_kernel,
        "use_conv_bias": m.conv_bias,
        "chunk_size": m.chunk_size,
        "expand": max(1, m.d_inner // cfg.d_model),
        "time_step_min": m.dt_min,
        "time_step_max": m.dt_max,
        "time_step_floor": m.dt_init_floor,
        "mamba_hidden_act": "silu",
        "mamba_proj_bias": False,
        "use_bias": False,
        "intermediate_size": cfg.mlp.hidden,
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "n_routed_experts": e.num_experts,
        "num_experts_per_tok": e.top_k,
        "moe_intermediate_size": e.expert_hidden,
        "moe_shared_expert_intermediate_size": e.shared_expert_hidden,
        "n_shared_experts": 1,
        "moe_latent_size": e.latent_size,
        "routed_scaling_factor": e.routed_scaling_factor,
        "norm_topk_prob": e.norm_topk_prob,
        "n_group": e.n_group,
        "topk_group": e.topk_group,
        "num_nextn_predict_layers": 1 if cfg.mtp.pattern else 0,
        "hybridlm": {
            "mtp_depth": cfg.mtp.depth,
            "mtp_loss_weight": cfg.mtp.loss_weight,
            "moe_bias_update_rate": e.bias_update_rate,
            "moe_aux_loss_coef": e.aux_loss_coef,
        },
    }
    if cfg.mtp.pattern:
        out["mtp_hybrid_override_pattern"] = cfg.mtp.pattern
        out["mtp_layers_block_type"] = [NEMOTRON_LETTERS[c] for c in cfg.mtp.pattern]
    if m.dt_clamp_min != 0.0 or m.dt_clamp_max is not None:
        # the dt clamp, read by transformers >= 5.25 and mamba-ssm (older transformers clamped
        # at time_step_min); the default (0, inf) is left out, which keeps config.json plain JSON
        hi = m.dt_clamp_max if m.dt_clamp_max is not None else torch.finfo(torch.float32).max
        out["time_step_limit"] = [m.dt_clamp_min, hi]
    return out


def _olmo3_config(cfg: ModelConfig, dtype_name: str) -> dict[str, Any]:
    a = cfg.attention
    if a.head_dim * a.num_heads != cfg.d_model:
        raise _unsupported("Olmo3 needs attention.head_dim * num_heads == d_model", "Olmo3")
    if a.rope_theta is None or not a.qk_norm:
        raise _unsupported("Olmo3 attention uses RoPE and QK-norm", "Olmo3")
    if cfg.mtp.pattern:
        raise _unsupported("Olmo3 has no MTP module", "Olmo3")
    out = {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "dtype": dtype_name,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp.hidden,
        "num_hidden_layers": len(cfg.pattern) // 2,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "rope_theta": a.rope_theta,
        "sliding_window": a.sliding_window,
        "layer_types": [
            "sliding_attention" if s else "full_attention" for s in cfg.attention_is_sliding()
        ],
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    # Per layer type, as transformers v5 reads it; rope_theta / rope_scaling for older readers.
    full = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.yarn is not None:
        y = a.yarn
        full = {
            "rope_type": "yarn",
            "rope_theta": a.rope_theta,
            "factor": y.factor,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "attention_factor": y.attention_factor,
        }
        out["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    out["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": a.rope_theta},
    }
    return out


def from_hf_config(hf: dict[str, Any], *, has_mtp: bool | None = None) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type == "nemotron_h":
        return _from_nemotron(hf, has_mtp)
    if model_type == "olmo3":
        return _from_olmo3(hf)
    raise ValueError(
        f"unsupported model_type {model_type!r}: hybridlm reads 'nemotron_h' and 'olmo3'"
    )


def _pattern_from(value: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return "".join(HF_LAYER_TYPES[t] for t in value)
    except (KeyError, TypeError):
        raise ValueError(f"config.json {key} has an unknown layer type: {value!r}") from None


def _json_float(value: Any) -> float:
    """A float from config.json: a number, "inf" / "Infinity", or transformers' (>= 5.25)
    `{"__float__": "Infinity"}` encoding of the non-JSON floats."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def _from_nemotron(hf: dict[str, Any], has_mtp: bool | None) -> ModelConfig:
    if hf.get("layers_block_type") is not None:
        pattern = _pattern_from(hf["layers_block_type"], "layers_block_type")
    elif hf.get("hybrid_override_pattern"):
        pattern = hf["hybrid_override_pattern"]
    else:
        raise ValueError(
            "NemotronH config.json has neither layers_block_type nor hybrid_override_pattern"
        )
    mtp_pattern = ""
    if hf.get("num_nextn_predict_layers", 0) and has_mtp is not False:
        if hf.get("num_nextn_predict_layers") != 1:
            raise ValueError(
                "hybridlm reads one shared-weight MTP layer (num_nextn_predict_layers=1)"
            )
        raw = hf.get("mtp_layers_block_type") or hf.get("mtp_hybrid_override_pattern") or "*E"
        mtp_pattern = _pattern_from(raw, "mtp_layers_block_type")
    extra = hf.get("hybridlm", {})
    lo, hi = (
        _json_float(v) for v in hf.get("time_step_limit", hf.get("mamba_dt_limit", (0, "inf")))
    )
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        pattern=pattern,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
        max_seq_len=hf.get("max_position_embeddings", 4096),
        mamba=MambaConfig(
            num_heads=hf.get("mamba_num_heads", 128),
            head_dim=hf.get("mamba_head_dim", 64),
            state_size=hf.get("ssm_state_size", 128),
            n_groups=hf.get("n_groups", 8),
            conv_kernel=hf.get("conv_kernel", 4),
            conv_bias=hf.get("use_conv_bias", True),
            chunk_size=hf.get("chunk_size", 128),
            dt_min=hf.get("time_step_min", 1e-3),
            dt_max=hf.get("time_step_max", 0.1),
            dt_init_floor=hf.get("time_step_floor", 1e-4),
            dt_clamp_min=float(lo),
            dt_clamp_max=None if math.isinf(hi) else float(hi),
        ),
        attention=AttentionConfig(
            num_heads=hf.get("num_attention_heads", 32),
            num_kv_heads=hf.get("num_key_value_heads") or hf.get("num_attention_heads", 32),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf.get("num_attention_heads", 32),
        ),
        moe=MoEConfig(
            num_experts=hf.get("n_routed_experts", 8),
            top_k=hf.get("num_experts_per_tok", 2),
            expert_hidden=hf.get("moe_intermediate_size", 7688),
            shared_expert_hidden=hf.get("moe_shared_expert_intermediate_size", 7688),
            latent_size=hf.get("moe_latent_size"),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=hf.get("norm_topk_prob", True),
            n_group=hf.get("n_group", 1) or 1,
            topk_group=hf.get("topk_group", 1) or 1,
            bias_update_rate=extra.get("moe_bias_update_rate", 1e-3),
            aux_loss_coef=extra.get("moe_aux_loss_coef", 1e-4),
        ),
        mlp=MLPConfig(hidden=hf.get("intermediate_size", 21504), activation="relu2"),
        mtp=MTPConfig(
            pattern=mtp_pattern,
            depth=extra.get("mtp_depth", 2),
            loss_weight=extra.get("mtp_loss_weight", 0.3),
        ),
    )


def _olmo3_rope(hf: dict[str, Any]) -> tuple[float, YarnConfig | None]:
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if sliding.get("rope_type", "default") != "default":
            raise ValueError(
                "hybridlm applies RoPE scaling to full-attention layers only (Olmo 3 recipe)"
            )
        theta = float(
            full.get("rope_theta", sliding.get("rope_theta", hf.get("rope_theta", 500000.0)))
        )
        if float(sliding.get("rope_theta", theta)) != theta:
            raise ValueError(
                f"Olmo3 config has rope_theta {sliding['rope_theta']} on sliding layers but "
                f"{theta} on full "
                "layers; hybridlm uses one base frequency for both"
            )
        scaling = full if full.get("rope_type", "default") != "default" else None
    else:
        flat = params if isinstance(params, dict) else {}
        theta = float(flat.get("rope_theta", hf.get("rope_theta", 500000.0)))
        scaling = hf.get("rope_scaling") or (
            flat if flat.get("rope_type", "default") != "default" else None
        )
    if scaling is None:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise ValueError(f"unsupported Olmo3 rope scaling {kind!r}; hybridlm implements YaRN")
    return theta, YarnConfig(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        attention_factor=scaling.get("attention_factor"),
    )


def _from_olmo3(hf: dict[str, Any]) -> ModelConfig:
    n = hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    theta, yarn = _olmo3_rope(hf)
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)
    ]
    window = hf.get("sliding_window")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        pattern="*-" * n,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        norm_placement="post",
        tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
        max_seq_len=hf.get("max_position_embeddings", 4096),
        attention=AttentionConfig(
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf["hidden_size"] // heads,
            rope_theta=theta,
            yarn=yarn,
            qk_norm=True,
            sliding_window=window,
            window_pattern="".join("S" if t == "sliding_attention" else "F" for t in types)
            if window
            else "",
        ),
        mlp=MLPConfig(hidden=hf["intermediate_size"], activation="swiglu"),
    )


# ====================================================================== state dicts
_OLMO_ATTN = re.compile(
    r"^layers\.(\d+)\.mixer\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight$"
)
_OLMO_MLP = re.compile(r"^layers\.(\d+)\.mixer\.(gate_proj|up_proj|down_proj)\.weight$")
_OLMO_NORM = re.compile(r"^layers\.(\d+)\.norm\.weight$")


def to_hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    cfg: ModelConfig = model.config
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        out.update(to_hf_tensors(cfg, name, t))
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_tensors(cfg: ModelConfig, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One tensor of our state dict under its transformers name(s), as `to_hf_state_dict` maps
    it: a 3-D expert tensor becomes one 2-D view per expert, a tied `lm_head.weight` nothing.
    Works on meta tensors too (names and shapes without the data)."""
    if cfg.tie_embeddings and name == "lm_head.weight":
        return []
    if family(cfg) == "olmo3":
        return [(_ours_to_olmo3(name), t)]
    hf_name = _ours_to_nemotron(name, len(cfg.mtp.pattern))
    m = re.match(r"^(.*\.mixer\.experts)\.(up_proj|down_proj)$", hf_name)
    if m:  # 3-D expert tensor -> one 2-D tensor per expert
        return [(f"{m.group(1)}.{e}.{m.group(2)}.weight", t[e]) for e in range(t.shape[0])]
    return [(hf_name, t)]


def _ours_to_nemotron(name: str, n_mtp: int) -> str:
    if name.startswith(("embeddings.", "layers.", "norm_f.")):
        return "backbone." + name
    m = re.match(r"^mtp\.(enorm|hnorm|eh_proj)\.(.*)$", name)
    if m:
        return f"mtp.layers.0.{m.group(1)}.{m.group(2)}"
    if name.startswith("mtp.final_layernorm."):
        return name.replace("mtp.final_layernorm.", f"mtp.layers.{n_mtp - 1}.final_layernorm.")
    return name


def _ours_to_olmo3(name: str) -> str:
    if name == "embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm_f.weight":
        return "model.norm.weight"
    if name == "lm_head.weight":
        return name
    if m := _OLMO_ATTN.match(name):
        return f"model.layers.{int(m.group(1)) // 2}.self_attn.{m.group(2)}.weight"
    if m := _OLMO_MLP.match(name):
        return f"model.layers.{int(m.group(1)) // 2}.mlp.{m.group(2)}.weight"
    if m := _OLMO_NORM.match(name):
        i = int(m.group(1))
        which = "post_attention_layernorm" if i % 2 == 0 else "post_feedforward_layernorm"
        return f"model.layers.{i // 2}.{which}.weight"
    raise ValueError(f"no Olmo3 name for parameter {name!r}")


def from_hf_state_dict(cfg: ModelConfig, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if family(cfg) == "olmo3":
        return _from_olmo3_sd(hf_sd)
    return _from_nemotron_sd(cfg, hf_sd)


def _from_nemotron_sd(cfg: ModelConfig, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}
    last_mtp = len(cfg.mtp.pattern) - 1
    for name, t in hf_sd.items():
        name = name.removeprefix("language_model.")
        for prefix in ("backbone.", "model."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
        if name.startswith("mtp."):
            if not cfg.mtp.pattern:
                continue
            name = re.sub(r"^mtp\.layers\.0\.(enorm|hnorm|eh_proj)\.", r"mtp.\1.", name)
            name = name.replace(f"mtp.layers.{last_mtp}.final_layernorm.", "mtp.final_layernorm.")
        m = re.match(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$", name)
        if m:
            per_expert.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue
        out[name] = t
    for name, experts in per_expert.items():
        missing = sorted(set(range(cfg.moe.num_experts)) - set(experts))
        if missing:
            raise ValueError(f"checkpoint lacks experts {missing[:8]} of {name}")
        out[name] = torch.stack([experts[e] for e in range(cfg.moe.num_experts)])
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _from_olmo3_sd(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in hf_sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "model.embed_tokens.weight":
            out["embeddings.weight"] = t
        elif name == "model.norm.weight":
            out["norm_f.weight"] = t
        elif name == "lm_head.weight":
            out[name] = t
        elif m := re.match(r"^model\.layers\.(\d+)\.self_attn\.(\w+)\.weight$", name):
            out[f"layers.{2 * int(m.group(1))}.mixer.{m.group(2)}.weight"] = t
        elif m := re.match(r"^model\.layers\.(\d+)\.mlp\.(\w+)\.weight$", name):
            out[f"layers.{2 * int(m.group(1)) + 1}.mixer.{m.group(2)}.weight"] = t
        elif m := re.match(
            r"^model\.layers\.(\d+)\.(post_attention_layernorm|post_feedforward_layernorm)\.weight$",
            name,
        ):
            i = 2 * int(m.group(1)) + (m.group(2) == "post_feedforward_layernorm")
            out[f"layers.{i}.norm.weight"] = t
        else:
            raise ValueError(f"unexpected tensor {name!r} in an Olmo3 checkpoint")
    return out


# ====================================================================== files
def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise ValueError(f"{index} names shard {shard}, which is missing")
            tensors.update(_load_file(path / shard))
        return tensors
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {path}")
    tensors = {}
    for f in files:
        tensors.update(_load_file(f))
    return tensors


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except Exception as err:  # safetensors raises its own error type for corrupt files
        raise ValueError(f"cannot read safetensors file {file}: {err}") from None


def load_pretrained(path: str | Path, *, dtype: torch.dtype | None = None) -> HybridLM:
    """A `HybridLM` from a transformers NemotronH / Olmo3 directory (`hybridlm.io.load` picks
    this reader for such directories); `dtype` defaults to the directory's own."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} is not a checkpoint directory (no config.json)")
    try:
        hf_cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from None
    if hf_cfg.get("model_type") not in ("nemotron_h", "olmo3"):
        raise ValueError(
            f"unsupported model_type {hf_cfg.get('model_type')!r} in {config_file}: "
            "hybridlm reads 'nemotron_h' and 'olmo3'"
        )
    tensors = read_safetensors_dir(path)
    has_mtp = any(k.removeprefix("language_model.").startswith("mtp.") for k in tensors)
    cfg = from_hf_config(hf_cfg, has_mtp=has_mtp)
    sd = from_hf_state_dict(cfg, tensors)
    if dtype is None:
        dtype = _DTYPES.get(
            hf_cfg.get("dtype") or hf_cfg.get("torch_dtype") or "float32", torch.float32
        )
    for name, t in sd.items():
        keep_fp32 = name.endswith(("gate.weight", "e_score_correction_bias"))  # router stays fp32
        sd[name] = t.to(torch.float32 if keep_fp32 else dtype)
    return HybridLM.from_state_dict(cfg, sd, what=f"checkpoint {path}")


# ====================================================================== model directories
def special_token_ids(tokenizer: Any) -> dict[str, int | None]:
    """`bos_token_id` / `eos_token_id` / `pad_token_id` as transformers reads them from the saved
    tokenizer: the ids of the token names its `tokenizer_config.json` gets from `tokenizer`."""
    ids: dict[str, int | None] = {}
    for key in ("bos", "eos", "pad"):
        name = getattr(tokenizer, f"{key}_token")
        ids[f"{key}_token_id"] = None if name is None else tokenizer.token_to_id(name)
    return ids


def generation_config(tokenizer: Any, ids: dict[str, int | None]) -> dict[str, Any]:
    """generation_config.json: the tokenizer's ids; generation also stops at the end-of-turn
    token of the chat template (`<|im_end|>`) where the tokenizer has it as one token."""
    eos = ids["eos_token_id"]
    stop = tokenizer.token_to_id(STOP)
    return {
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": [eos, stop] if stop is not None and stop != eos else eos,
        "pad_token_id": eos if ids["pad_token_id"] is None else ids["pad_token_id"],
    }


# safetensors' dtype codes (the format's README)
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorStream:
    """Tensors that arrive one at a time (e.g. read from a sharded training checkpoint), for
    `write_model_dir`: `specs` holds each one's dtype and shape in write order, `read()` yields
    `(name, tensor)` in that order. Only one tensor needs to be in memory at a time."""

    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    read: Callable[[], Iterator[tuple[str, torch.Tensor]]]


def write_safetensors(
    file: str | Path,
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> None:
    """A safetensors file written tensor by tensor: the header from `specs` (name -> dtype,
    shape; the layout of the format's README: u64 header size, JSON header padded to 8 bytes,
    then each tensor's bytes at its `data_offsets`), then the next `len(specs)` items of
    `tensors` in `specs` order, each written and dropped."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in specs.items():
        if dtype not in _ST_DTYPES:
            raise ValueError(f"safetensors has no dtype for {name} ({dtype})")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, (dtype, shape) in specs.items():
            got, t = next(tensors)
            assert (got, t.dtype, tuple(t.shape)) == (name, dtype, tuple(shape)), (got, name)
            # the bytes of the tensor itself (a view, no copy when contiguous)
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            del t


def write_model_dir(
    path: str | Path,
    tensors: dict[str, torch.Tensor] | TensorStream,
    hf_cfg: dict[str, Any],
    *,
    tokenizer: Any = None,
    extra_files: dict[str, Any] | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """The one writer of transformers model directories (`save_pretrained`, ModelOpt exports):
    safetensors (sharded past `max_shard_bytes`, with an index), `config.json`, the JSON
    `extra_files`, and with a `tokenizer` (`ByteTokenizer` / `BPETokenizer`) its files with the
    chat template, `generation_config.json` and the tokenizer's BOS / EOS / PAD ids in
    `config.json`, so the directory alone serves `AutoTokenizer` / `AutoModelForCausalLM` /
    `generate`. Everything is written into a staging folder first, so a failure leaves an
    earlier checkpoint intact. `tensors` may be a `TensorStream`: each tensor is then written
    as it arrives (`write_safetensors`), so memory holds one tensor, not the model."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    if tokenizer is not None:
        if not hasattr(tokenizer, "save") or not hasattr(tokenizer, "token_to_id"):
            raise TypeError(
                f"cannot save a {type(tokenizer).__name__} with a model: pass a ByteTokenizer "
                "or BPETokenizer (hybridlm.data.bpe.load_tokenizer)"
            )
        if tokenizer.vocab_size > hf_cfg["vocab_size"]:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                f"{hf_cfg['vocab_size']}"
            )
    hf_cfg = dict(hf_cfg)
    stream = tensors if isinstance(tensors, TensorStream) else None
    if stream is not None:
        specs = stream.specs
    else:
        specs = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    shards: list[list[str]] = [[]]
    size = total = 0
    for name, (dtype, shape) in specs.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
        total += nbytes
    items = stream.read() if stream is not None else None

    def write(names: list[str], file: Path) -> None:
        if items is not None:
            write_safetensors(file, {k: specs[k] for k in names}, items)
        else:
            save_file({k: tensors[k] for k in names}, file, metadata={"format": "pt"})

    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path, prefix=".staging-") as tmp:
        staging = Path(tmp)
        if tokenizer is not None:
            tokenizer.save(staging, model_max_length=hf_cfg.get("max_position_embeddings"))
            ids = special_token_ids(tokenizer)
            hf_cfg.update(ids)
            gen = generation_config(tokenizer, ids)
            (staging / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if len(shards) == 1:
            write(shards[0], staging / "model.safetensors")
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                write(shard, staging / fname)
                weight_map.update({k: fname for k in shard})
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (staging / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        for name, content in (extra_files or {}).items():
            (staging / name).write_text(json.dumps(content, indent=2))
        for old in path.glob("model*.safetensors*"):  # shards of an earlier save would be stale
            old.unlink()
        for f in staging.iterdir():
            f.replace(path / f.name)
    return path


def save_pretrained(
    model: HybridLM, path: str | Path, *, tokenizer: Any = None, max_shard_bytes: int = 5 * 2**30
) -> Path:
    """Write `model` as a transformers NemotronH / Olmo3 directory (`write_model_dir`) that
    `AutoModelForCausalLM.from_pretrained` loads; MTP weights use vLLM's key names. With the
    model's `tokenizer` (`ByteTokenizer` / `BPETokenizer`) the directory also holds its files,
    the chat template and generation_config.json, and config.json its special ids."""
    hf_cfg = to_hf_config(model.config, model.embeddings.weight.dtype)  # raises before writing
    return write_model_dir(
        path,
        to_hf_state_dict(model),
        hf_cfg,
        tokenizer=tokenizer,
        max_shard_bytes=max_shard_bytes,
    )
