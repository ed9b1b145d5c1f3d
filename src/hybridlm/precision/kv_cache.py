"""Quantised KV caches for inference: FP8 and NVFP4 keys and values (Nemotron 3.5's released
checkpoints serve with an FP8 KV cache; notes: long-context damage of a quantised deployment is
driven by the KV cache), applied to the engine's caches from outside the model.

Shape legend: B batch, K KV heads, L / S positions, E head dim.

Per attention layer, keys and values separately (`KVState` stores the codes and decodes the
valid columns for attention, so a step reads exactly what a quantised cache holds):

    fp8    E4M3 codes under a static decode scale s: stored e4m3(x / s) (RNE, saturating at
           448), read code * s. s = calibrated amax / 448, one per tensor (ModelOpt / vLLM
           `k_scale`, `v_scale`) or, as an engine option, one per KV head ([K]).
    nvfp4  E2M1 codes in blocks of 16 along the head dim, E4M3 block scales computed when a
           token is stored (dynamic), under a static per-tensor scale s_g = amax / (6 * 448)
           (`k_scale`, `v_scale`): 4.5 bits per element with its block scale.

The amax is that of what the cache stores: the keys after RoPE and the values, per layer and
KV head, over calibration rows (`calibrate_kv`). A model carries its calibration as
`model.kv_cache_quant` (a `KVCacheQuant`: the format a checkpoint declares, the amax per layer);
`interop.modelopt` writes it as `kv_cache_quant_algo` with per-layer `k_scale` / `v_scale`
and reads it back. The Mamba layers' state has its own storage precisions
(`model.state_precision`); the MTP drafter's KV cache stays unquantised.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..choices import KV_CACHE_DTYPES
from ..model.cache import HybridCache, KVCodec, KVState
from .formats import NVFP4Tensor, e4m3_round, nvfp4_dequantize, nvfp4_quantize
from .ptq import per_tensor_scale

KV_FORMATS = ("fp8", "nvfp4")
Granularity = Literal["tensor", "head"]


class FP8KV:
    """E4M3 codes under a static decode scale ([] per tensor, or [K] per KV head)."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale.float()

    def _s(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale.device != x.device:  # moved once: no copy per step (CUDA graphs)
            self.scale = self.scale.to(x.device)
        s = self.scale
        return s.reshape(1, -1, 1, 1) if s.dim() else s

    def encode(self, x_BKLE: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (e4m3_round(x_BKLE.float() / self._s(x_BKLE)).to(torch.float8_e4m3fn),)

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return (parts[0].float() * self._s(parts[0])).to(dtype)


class NVFP4KV:
    """E2M1 codes (two per byte) with E4M3 block scales per 16 along the head dim, under a
    static per-tensor scale."""

    def __init__(self, global_scale: torch.Tensor) -> None:
        self.global_scale = global_scale.float().reshape(())

    def encode(self, x_BKLE: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x_BKLE.shape[-1] % 16:
            raise ValueError(
                f"an NVFP4 KV cache needs a head dim divisible by 16, got {x_BKLE.shape[-1]}"
            )
        if self.global_scale.device != x_BKLE.device:
            self.global_scale = self.global_scale.to(x_BKLE.device)
        q = nvfp4_quantize(x_BKLE, block="1d", global_scale=self.global_scale)
        return q.packed, q.block_scale

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        packed, block_scale = parts
        shape = torch.Size((*packed.shape[:-1], 2 * packed.shape[-1]))
        q = NVFP4Tensor(packed, block_scale, self.global_scale.to(packed.device), shape, "1d")
        return nvfp4_dequantize(q, dtype)


@dataclass
class KVCacheQuant:
    """A model's KV-cache quantisation: the format its checkpoint declares (`fmt`, "" for none
    declared: the calibration alone) and the calibrated amax per attention block index and KV
    head ([K]; a checkpoint's per-tensor scale gives the same amax for every head)."""

    fmt: str = ""
    k_amax: dict[int, torch.Tensor] = field(default_factory=dict)
    v_amax: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0  # calibration tokens (0: read from a checkpoint)

    def scales(self, fmt: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per-tensor decode scales (k_scale, v_scale) per attention block, as exported."""
        check_kv_format(fmt)
        return {
            i: (
                per_tensor_scale(fmt, self.k_amax[i].max()),
                per_tensor_scale(fmt, self.v_amax[i].max()),
            )
            for i in sorted(self.k_amax)
        }

    def codecs(
        self, fmt: str, granularity: Granularity = "tensor"
    ) -> dict[int, tuple[KVCodec, KVCodec]]:
        """{attention block index: (keys, values) codecs} of `fmt`; FP8 scales per tensor or
        per KV head, NVFP4 per tensor."""
        check_kv_format(fmt)
        if granularity not in ("tensor", "head"):
            raise ValueError(f"granularity must be tensor or head, got {granularity!r}")
        if granularity == "head" and fmt != "fp8":
            raise ValueError("per-head KV scales are an FP8 option (NVFP4 has block scales)")
        out: dict[int, tuple[KVCodec, KVCodec]] = {}
        for i in sorted(self.k_amax):
            k, v = self.k_amax[i], self.v_amax[i]
            if granularity == "tensor":
                k, v = k.max(), v.max()
            if fmt == "fp8":
                out[i] = (FP8KV(per_tensor_scale(fmt, k)), FP8KV(per_tensor_scale(fmt, v)))
            else:
                out[i] = (NVFP4KV(per_tensor_scale(fmt, k)), NVFP4KV(per_tensor_scale(fmt, v)))
        return out


@torch.no_grad()
def calibrate_kv(
    model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]]
) -> KVCacheQuant:
    """The amax per attention layer and KV head of the keys (after RoPE) and values the cache
    stores, over the rows of `batches` (`input_ids`, prefilled through a fresh cache)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    k_amax: dict[int, torch.Tensor] = {}
    v_amax: dict[int, torch.Tensor] = {}
    tokens = 0
    try:
        for batch in batches:
            ids = batch["input_ids"].to(device)
            cache = HybridCache.for_pattern(model.config.pattern)
            model(ids, cache=cache, return_logits=False)
            tokens += ids.numel()
            for i, st in enumerate(cache.layers):
                if isinstance(st, KVState) and st.length:
                    for store, x in ((k_amax, st.k_BKSE), (v_amax, st.v_BKSE)):
                        a = x.detach().abs().float().amax(dim=(0, 2, 3)).cpu()
                        store[i] = a if i not in store else torch.maximum(store[i], a)
    finally:
        model.train(was_training)
    if not k_amax:
        raise ValueError("KV calibration saw no attention layer (the model has none, or no rows)")
    return KVCacheQuant(k_amax=k_amax, v_amax=v_amax, tokens=tokens)


def check_kv_format(fmt: str) -> str:
    if fmt not in KV_FORMATS:
        raise ValueError(f"unknown KV cache format {fmt!r}; choose from {list(KV_FORMATS)}")
    return fmt


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {list(KV_CACHE_DTYPES)}"
        )
    return kv_cache_dtype


def kv_codecs(
    model: torch.nn.Module, kv_cache_dtype: str = "auto", granularity: Granularity = "tensor"
) -> dict[int, tuple[KVCodec, KVCodec]]:
    """The KV codecs an engine uses for `model` (vLLM's `kv_cache_dtype`): "auto" = the format
    its checkpoint declares (`model.kv_cache_quant.fmt`), else stored as given; "fp8" /
    "nvfp4" = that format with the model's calibration (an error without one)."""
    check_kv_cache_dtype(kv_cache_dtype)
    spec: KVCacheQuant | None = model.kv_cache_quant
    if kv_cache_dtype == "auto":
        if spec is None or not spec.fmt:
            return {}
        return spec.codecs(spec.fmt, granularity)
    if spec is None:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype} needs the KV scales of a checkpoint that declares "
            f"a quantised KV cache: make one with `hybridlm quantize MODEL OUT --kv-cache "
            f"{kv_cache_dtype}` and load OUT (or calibrate with precision.kv_cache.calibrate_kv)"
        )
    return spec.codecs(kv_cache_dtype, granularity)


def declare_kv_cache(model: torch.nn.Module, fmt: str, calib: list) -> dict[str, Any]:
    """Calibrate the quantised model's KV cache on `calib` and declare `fmt` for it (the
    export's kv_cache_quant_algo); returns what quantize.json records ({} for "none")."""
    if fmt == "none":
        return {}
    spec = calibrate_kv(model, calib)
    spec.fmt = fmt
    model.kv_cache_quant = spec
    return {
        "format": fmt,
        "tokens": spec.tokens,
        "k_scale": {str(i): float(k) for i, (k, _) in spec.scales(fmt).items()},
        "v_scale": {str(i): float(v) for i, (_, v) in spec.scales(fmt).items()},
    }
