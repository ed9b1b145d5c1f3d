"""Low-precision number formats: FP4 E2M1, FP8 E4M3, E8M0 scales, and the block formats built
from them (NVFP4, MXFP8, block/tensor-scaled FP8). Pure torch, vectorised, fp32 arithmetic.

Nemotron 3 Super §2.2 (NVFP4 pretraining) and §5 (ModelOpt PTQ) use:

    NVFP4  E2M1 elements {0, .5, 1, 1.5, 2, 3, 4, 6} x sign, one E4M3 block scale per 16
           elements (1-D along the last dim, or 16x16 tiles of a weight), one fp32 per-tensor
           scale amax / (6 * 448) (ModelOpt `weight_scale_2`).
    MXFP8  E4M3 elements, one E8M0 (power-of-two) scale per 32 elements along the last dim
           (OCP Microscaling spec v1.0 §5.2, scale exponent floor(log2 amax) - emax_elem).
    FP8    E4M3 elements with fp32 scales per tensor, per channel (row), per 1 x block group,
           or per block x block tile (DeepSeek-V3-style 128x128 weights).

Shape legend: K the last (quantised) dim, G = K_padded / block groups along it, R rows.

Conventions (documented once, tested in tests/test_precision_formats.py):
* Scales are *decode* scales: value = element * block_scale * global_scale.
* Rounding: "rne" round-to-nearest-even; "sr" stochastic rounding, up with probability equal to
  the distance from the lower neighbour over the gap (unbiased), draws from `generator`.
  Stochastic rounding applies to elements; scales are always computed with RNE.
* Saturation: magnitudes above the element max clamp to it (E2M1 6, E4M3 448); +-inf saturate.
* NaN: the block quantisers raise ValueError on non-finite input (a NaN/inf amax would poison a
  whole block's scale); `fp4_e2m1_encode` raises on NaN; `e4m3_round` propagates NaN.
* Shapes that are not a multiple of the block are zero-padded internally (zeros change no
  block amax); the stored `shape` is the original one and dequantisation crops the padding.
* Zeros and all-zero blocks: a zero-amax tensor gets NVFP4 global scale 1; an all-zero block
  gets a zero E4M3 block scale (NVFP4), the smallest E8M0 scale (MXFP8) or scale 1 (FP8), and
  dequantises to zeros. An NVFP4 block whose scale rounds to zero in E4M3 (block amax below
  ~2**-10 / 448 of the tensor amax) is flushed to zero; torchao instead clamps block scales up
  to 2**-6, so the two agree bit for bit whenever no block scale is below 2**-6.
  Negative zero is kept as FP4 code 8.
* Tiny tensors: per-tensor fp32 scales (NVFP4 amax / 2688, FP8 amax / 448) are floored at the
  smallest fp32 subnormal 2**-149, so a nonzero amax never gets a zero scale (which would give
  0 / 0 = NaN). NVFP4 multiplies by the reciprocal (1 / s_g) / s_b, which overflows fp32 once
  s_g < ~2**-119 (E4M3 block scales reach 2**-9); below `NVFP4_RESCALE_BELOW` the encoder
  therefore works on x * 2**96 and s_g * 2**96, both exact power-of-two products, so codes and
  block scales are those of an fp32 with unbounded exponent range (bit-identical to the
  unscaled path wherever that one neither overflows nor meets subnormals). Below an amax of
  ~3.2e-35 the stored s_g is itself subnormal and keeps only log2(s_g / 2**-149) significant
  bits; block scales are computed against the stored s_g, so encode and decode agree, and the
  largest block can saturate by at most that rounding (~0.6% at amax 3e-40).
  MXFP8 has no reciprocal: its E8M0 scale bottoms out at 2**-127, so elements at or below
  2**-137 (half the smallest MXFP8 value, 2**-136) flush to zero, a limit of the format.
* Packing: two FP4 codes per byte, the even element in the low nibble (as torchao `pack_uint4`
  and vLLM's `break_fp4_bytes`, which load ModelOpt NVFP4 checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Tensor = torch.Tensor
Rounding = Literal["rne", "sr"]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_EMAX = 8  # 448 = 1.75 * 2**8
E8M0_BIAS = 127
NVFP4_BLOCK = 16
MXFP8_BLOCK = 32
F32_TINY = 2.0**-149  # smallest positive fp32 (subnormal): the floor for per-tensor scales
# NVFP4 encodes with the reciprocal (1 / s_g) / s_b, and s_b >= 2**-9 (E4M3's smallest
# subnormal), so it stays below fp32's 2**128 only for s_g > 2**-119; below this threshold
# (amax < ~3.4e-26, 23 binades of margin) the encoder shifts x and s_g up by NVFP4_RESCALE
# (exact for powers of two) first, which maps s_g in [2**-149, 2**-96) to [2**-53, 1).
NVFP4_RESCALE_BELOW = 2.0**-96
NVFP4_RESCALE = 2.0**96

# The 8 E2M1 magnitudes in code order (code = 2 exponent bits, 1 mantissa bit; bit 3 = sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _check_rounding(rounding: str) -> None:
    if rounding not in ("rne", "sr"):
        raise ValueError(f"rounding must be 'rne' or 'sr', got {rounding!r}")


def _uniform(like: Tensor, generator: torch.Generator | None) -> Tensor:
    return torch.rand(like.shape, generator=generator, device=like.device, dtype=torch.float32)


def _check_finite_amax(amax: Tensor, what: str) -> None:
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"{what}: input has NaN or inf values, which this format cannot encode")


# ----------------------------------------------------------------------------- FP4 E2M1


def e2m1_round(
    x: Tensor, *, rounding: Rounding = "rne", generator: torch.Generator | None = None
) -> Tensor:
    """Round already-scaled fp32 values to E2M1 values (saturating at +-6, sign kept).

    The grid is uniform within [0, 2), [2, 4), [4, 6] with steps 0.5, 1, 2, so rounding is
    round(|x| / step) * step there: torch.round is half-to-even, and an even multiple of the
    step is exactly an even E2M1 code (mantissa bit 0). SR: floor(|x| / step + u) * step."""
    _check_rounding(rounding)
    mag = x.float().abs().clamp(max=E2M1_MAX)
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    if rounding == "rne":
        q = torch.round(mag / step) * step
    else:
        q = torch.floor(mag / step + _uniform(mag, generator)) * step
    return torch.copysign(q, x.float())


def _e2m1_codes(q: Tensor) -> Tensor:
    """E2M1 values (from `e2m1_round`) -> uint8 codes: 2|v| on [0, 2], |v| + 2 at 3, |v|/2 + 4
    on [4, 6]; bit 3 = sign (negative zero included)."""
    mag = q.abs()
    code = torch.where(mag <= 2.0, 2 * mag, torch.where(mag < 4.0, mag + 2, mag / 2 + 4))
    code = code.to(torch.uint8)
    return torch.where(torch.signbit(q), code | 8, code)


def fp4_e2m1_encode(
    x: Tensor, *, rounding: Rounding = "rne", generator: torch.Generator | None = None
) -> Tensor:
    """Round already-scaled values to E2M1 and return uint8 codes 0..15 (bit 3 = sign).

    Magnitudes above 6 saturate to 6; RNE ties go to the even code (even mantissa bit)."""
    if bool(torch.isnan(x).any()):
        raise ValueError("fp4_e2m1_encode: NaN has no E2M1 encoding")
    return _e2m1_codes(e2m1_round(x, rounding=rounding, generator=generator))


def fp4_e2m1_decode(codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """uint8 E2M1 codes 0..15 -> values (code 8 is -0.0)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"fp4_e2m1_decode expects uint8 codes, got {codes.dtype}")
    mags = torch.tensor(E2M1_VALUES, device=codes.device)
    table = torch.cat([mags, -mags])
    return table[codes.long() & 15].to(dtype)


def pack_fp4(codes: Tensor) -> Tensor:
    """[..., K] uint8 codes -> [..., K/2] bytes; element 2i in the low nibble, 2i+1 in the high."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_fp4 expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got shape {tuple(codes.shape)}")
    return (codes[..., 0::2] & 15) | ((codes[..., 1::2] & 15) << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """[..., K2] bytes -> [..., 2*K2] codes (inverse of `pack_fp4`)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4 expects uint8, got {packed.dtype}")
    lo, hi = packed & 15, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- FP8 E4M3 / E8M0


def e4m3_round(
    x: Tensor, *, rounding: Rounding = "rne", generator: torch.Generator | None = None
) -> Tensor:
    """fp32 values representable in float8_e4m3fn (saturating at +-448; NaN propagates)."""
    _check_rounding(rounding)
    xc = x.float().clamp(-E4M3_MAX, E4M3_MAX)
    if rounding == "rne":
        return xc.to(torch.float8_e4m3fn).float()  # torch's cast is RNE, subnormals included
    # ulp of E4M3 at |x|: 2**(floor(log2|x|) - 3), fixed at 2**-9 in the subnormal range.
    _, exp = torch.frexp(xc)  # xc = m * 2**exp with |m| in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(xc), (exp - 1).clamp(min=-6) - 3)
    lo = torch.floor(xc / ulp) * ulp  # exact: ulp is a power of two
    p_up = (xc - lo) / ulp
    return lo + ulp * (_uniform(xc, generator) < p_up).float()


def e8m0_encode(scale: Tensor, *, rounding: Literal["floor", "ceil"] = "ceil") -> Tensor:
    """Positive scales -> E8M0 uint8 (2**(u - 127), u in 0..254; 255 is NaN).

    Powers of two encode exactly; others round down ("floor") or up ("ceil", the default, so
    that x / decode(encode(s)) never exceeds x / s). Zero maps to the smallest code 0."""
    if rounding not in ("floor", "ceil"):
        raise ValueError(f"rounding must be 'floor' or 'ceil', got {rounding!r}")
    s = scale.float()
    if bool((s < 0).any()):
        raise ValueError("e8m0_encode: scales must be non-negative")
    mant, exp = torch.frexp(s)  # s = mant * 2**exp, mant in [0.5, 1)
    log2 = exp - 1
    if rounding == "ceil":
        log2 = log2 + (mant != 0.5).to(log2.dtype)
    u = (log2 + E8M0_BIAS).clamp(0, 254)
    u = torch.where(s == 0, torch.zeros_like(u), u)
    u = torch.where(torch.isinf(s), torch.full_like(u, 254), u)
    return torch.where(torch.isnan(s), torch.full_like(u, 255), u).to(torch.uint8)


def e8m0_decode(u8: Tensor) -> Tensor:
    """E8M0 uint8 -> fp32 power of two (255 -> NaN)."""
    if u8.dtype != torch.uint8:
        raise TypeError(f"e8m0_decode expects uint8, got {u8.dtype}")
    e = u8.to(torch.int32) - E8M0_BIAS
    val = torch.ldexp(torch.ones(u8.shape, device=u8.device), e)
    return torch.where(u8 == 255, torch.full_like(val, float("nan")), val)


# ----------------------------------------------------------------------------- block helpers


def _pad_last(x: Tensor, block: int) -> Tensor:
    pad = (-x.shape[-1]) % block
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _pad_last2(x: Tensor, block: int) -> Tensor:
    pad_r, pad_c = (-x.shape[-2]) % block, (-x.shape[-1]) % block
    return torch.nn.functional.pad(x, (0, pad_c, 0, pad_r)) if (pad_r or pad_c) else x


def _crop(x: Tensor, shape: torch.Size) -> Tensor:
    return x[tuple(slice(0, n) for n in shape)]


def _tiles(x_padded: Tensor, block: int) -> Tensor:
    """[..., R, K] (multiples of block) -> [..., R/b, K/b, b, b] tile view."""
    *lead, r, k = x_padded.shape
    return x_padded.reshape(*lead, r // block, block, k // block, block).transpose(-3, -2)


def _untile(t: Tensor) -> Tensor:
    *lead, rb, kb, b, _ = t.shape
    return t.transpose(-3, -2).reshape(*lead, rb * b, kb * b)


# ----------------------------------------------------------------------------- NVFP4


@dataclass
class NVFP4Tensor:
    """NVFP4 storage. 1d: packed [..., Kp/2], block_scale [..., Kp/16]; 2d: packed
    [..., Rp, Kp/2], block_scale [..., Rp/16, Kp/16] (Kp, Rp padded to multiples of 16)."""

    packed: Tensor
    block_scale: Tensor  # torch.float8_e4m3fn
    global_scale: Tensor  # fp32 scalar (decode scale, ModelOpt weight_scale_2)
    shape: torch.Size
    block: Literal["1d", "2d"]


def nvfp4_scale_from_amax(amax: Tensor) -> Tensor:
    """amax / (6 * 448) (ModelOpt `weight_scale_2`), floored at `F32_TINY` for a nonzero amax
    whose quotient underflows (amax < ~1.9e-42); 1 for a zero amax."""
    s = (amax / (E2M1_MAX * E4M3_MAX)).clamp(min=F32_TINY)
    return torch.where(amax > 0, s, torch.ones_like(amax))


def nvfp4_global_scale(x: Tensor) -> Tensor:
    """Per-tensor decode scale amax / (6 * 448) so the largest block scale lands on E4M3's max
    (ModelOpt `weight_scale_2`); 1 for an all-zero tensor."""
    amax = x.detach().abs().amax().float()
    _check_finite_amax(amax, "nvfp4")
    return nvfp4_scale_from_amax(amax)


def nvfp4_encode_domain(x: Tensor, s_g: Tensor) -> tuple[Tensor, Tensor]:
    """(x, s_g) to encode with: both times `NVFP4_RESCALE` when s_g < `NVFP4_RESCALE_BELOW`, so
    that (1 / s_g) / s_b stays finite; elements and block scales are invariant to the shift
    (the decode scale stays the caller's s_g). Larger s_g are returned as they are."""
    if bool(s_g < NVFP4_RESCALE_BELOW):
        return x * NVFP4_RESCALE, s_g * NVFP4_RESCALE
    return x, s_g


def _nvfp4_blocks(x: Tensor, block: str) -> Tensor:
    """View x (fp32) as [..., nblocks, 16] (1d) or [..., R/16, K/16, 16, 16] (2d), padded."""
    if block == "1d":
        xp = _pad_last(x, NVFP4_BLOCK)
        return xp.reshape(*xp.shape[:-1], xp.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    if block == "2d":
        if x.dim() < 2:
            raise ValueError(f"2d NVFP4 blocks need a >= 2-D tensor, got shape {tuple(x.shape)}")
        return _tiles(_pad_last2(x, NVFP4_BLOCK), NVFP4_BLOCK)
    raise ValueError(f"block must be '1d' or '2d', got {block!r}")


def _nvfp4_core(
    x: Tensor,
    block: str,
    rounding: Rounding,
    global_scale: Tensor | float | None,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (E2M1 element values in block layout, block scales fp32 [block layout, element dims
    kept as 1], global scale). Scale order follows torchao/TE kernels: x * ((1/s_g) / s_b)."""
    _check_rounding(rounding)
    x32 = x.float()
    if global_scale is None:
        s_g = nvfp4_global_scale(x32)
    else:
        s_g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
        _check_finite_amax(x32.abs().amax(), "nvfp4")
        if not bool(s_g > 0):
            raise ValueError(f"nvfp4 global_scale must be positive, got {float(s_g)}")
    blocks, s_q = nvfp4_encode_domain(_nvfp4_blocks(x32, block), s_g)
    elem_dims = (-1,) if block == "1d" else (-2, -1)
    amax_b = blocks.abs().amax(dim=elem_dims, keepdim=True)
    # Block decode scale = e4m3(block_amax / 6 / s_g), Nemotron 3 Super §2.2 / NVFP4 recipe.
    s_b = e4m3_round((amax_b / E2M1_MAX) / s_q)
    recip = torch.where(s_b > 0, (1.0 / s_q) / s_b, torch.zeros_like(s_b))
    elems = e2m1_round(blocks * recip, rounding=rounding, generator=generator)
    return elems, s_b, s_g


def _nvfp4_values(elems: Tensor, s_b: Tensor, s_g: Tensor, block: str, shape) -> Tensor:
    # (v * s_b) is exact in fp32 (2-bit x 4-bit mantissas); one rounding for * s_g.
    vals = (elems * s_b) * s_g
    flat = vals.flatten(-2) if block == "1d" else _untile(vals)
    return _crop(flat, shape)


def nvfp4_quantize(
    x: Tensor,
    *,
    block: Literal["1d", "2d"] = "1d",
    rounding: Rounding = "rne",
    global_scale: Tensor | float | None = None,
    generator: torch.Generator | None = None,
) -> NVFP4Tensor:
    """Quantise to NVFP4: 1d = 16 consecutive elements along the last dim; 2d = 16x16 tiles of
    the last two dims (weights: the same quantised W serves fprop and dgrad)."""
    elems, s_b, s_g = _nvfp4_core(x, block, rounding, global_scale, generator)
    codes = _e2m1_codes(elems)
    if block == "1d":
        codes_flat, scale = codes.flatten(-2), s_b.squeeze(-1)
    else:
        codes_flat, scale = _untile(codes), s_b.squeeze(-1).squeeze(-1)
    return NVFP4Tensor(
        packed=pack_fp4(codes_flat),
        block_scale=scale.to(torch.float8_e4m3fn),
        global_scale=s_g,
        shape=x.shape,
        block=block,
    )


def nvfp4_dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    codes_flat = unpack_fp4(q.packed)
    s_b = q.block_scale.float()
    if q.block == "1d":
        codes = codes_flat.reshape(*codes_flat.shape[:-1], -1, NVFP4_BLOCK)
        s_b = s_b.unsqueeze(-1)
    elif q.block == "2d":
        codes = _tiles(codes_flat, NVFP4_BLOCK)
        s_b = s_b[..., None, None]
    else:
        raise ValueError(f"block must be '1d' or '2d', got {q.block!r}")
    elems = fp4_e2m1_decode(codes)
    return _nvfp4_values(elems, s_b, q.global_scale, q.block, q.shape).to(dtype)


def nvfp4_fake_quant(
    x: Tensor,
    *,
    block: Literal["1d", "2d"] = "1d",
    rounding: Rounding = "rne",
    global_scale: Tensor | float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """dequantize(quantize(x)) without packing, in x's dtype: the training emulation path."""
    elems, s_b, s_g = _nvfp4_core(x, block, rounding, global_scale, generator)
    return _nvfp4_values(elems, s_b, s_g, block, x.shape).to(x.dtype)


# ----------------------------------------------------------------------------- MXFP8


@dataclass
class MXFP8Tensor:
    """data float8_e4m3fn [..., Kp]; scale uint8 E8M0 [..., Kp/32]; shape the original."""

    data: Tensor
    scale: Tensor
    shape: torch.Size


MXScaleMode = Literal["floor", "rceil"]


def _mxfp8_core(
    x: Tensor, rounding: Rounding, generator, scale_mode: MXScaleMode
) -> tuple[Tensor, Tensor]:
    _check_rounding(rounding)
    xp = _pad_last(x.float(), MXFP8_BLOCK)
    blocks = xp.reshape(*xp.shape[:-1], -1, MXFP8_BLOCK)
    amax_b = blocks.abs().amax(dim=-1, keepdim=True)
    _check_finite_amax(amax_b, "mxfp8")
    if scale_mode == "floor":
        # OCP MX v1.0 §6.3: shared exponent floor(log2 amax) - emax_elem. Block maxima in
        # [448, 512) * 2**shared saturate to 448 (up to 12.5% clipping of the largest element).
        _, exp = torch.frexp(amax_b)
        shared = exp - 1 - E4M3_EMAX
    elif scale_mode == "rceil":
        # cuBLAS / Transformer Engine MXFP8: 2**ceil(log2(amax / 448)), nothing saturates.
        shared = e8m0_encode(amax_b / E4M3_MAX, rounding="ceil").to(torch.int32) - E8M0_BIAS
    else:
        raise ValueError(f"scale_mode must be 'floor' or 'rceil', got {scale_mode!r}")
    shared = torch.where(amax_b > 0, shared, torch.full_like(shared, -E8M0_BIAS))
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)
    data = e4m3_round(torch.ldexp(blocks, -shared), rounding=rounding, generator=generator)
    return data, (shared + E8M0_BIAS).to(torch.uint8)


def mxfp8_quantize(
    x: Tensor,
    *,
    rounding: Rounding = "rne",
    generator: torch.Generator | None = None,
    scale_mode: MXScaleMode = "floor",
) -> MXFP8Tensor:
    """E4M3 elements, one E8M0 scale per 32 elements along the last dim (zero-padded).
    scale_mode "floor" is the OCP spec (and torchao's default); "rceil" never saturates."""
    data, u8 = _mxfp8_core(x, rounding, generator, scale_mode)
    return MXFP8Tensor(
        data=data.flatten(-2).to(torch.float8_e4m3fn), scale=u8.squeeze(-1), shape=x.shape
    )


def mxfp8_dequantize(q: MXFP8Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    data = q.data.float().reshape(*q.data.shape[:-1], -1, MXFP8_BLOCK)
    vals = torch.ldexp(data, q.scale.to(torch.int32).unsqueeze(-1) - E8M0_BIAS)
    return _crop(vals.flatten(-2), q.shape).to(dtype)


def mxfp8_fake_quant(
    x: Tensor,
    *,
    rounding: Rounding = "rne",
    generator: torch.Generator | None = None,
    scale_mode: MXScaleMode = "floor",
) -> Tensor:
    data, u8 = _mxfp8_core(x, rounding, generator, scale_mode)
    vals = torch.ldexp(data, u8.to(torch.int32) - E8M0_BIAS)
    return _crop(vals.flatten(-2), x.shape).to(x.dtype)


# ----------------------------------------------------------------------------- FP8 (scaled)

FP8Granularity = Literal["tensor", "channel", "group", "block"]


@dataclass
class FP8Tensor:
    """data float8_e4m3fn (padded for group/block); scale fp32 decode scale: [] per tensor,
    [..., R, 1] per channel, [..., R, Kp/b] per 1 x b group, [..., Rp/b, Kp/b] per b x b tile."""

    data: Tensor
    scale: Tensor
    shape: torch.Size
    granularity: FP8Granularity = "tensor"
    block_size: int = 128


def fp8_scale_from_amax(amax: Tensor) -> Tensor:
    """Decode scale amax / 448 (ModelOpt FP8 `weight_scale`), floored at `F32_TINY` for a
    nonzero amax whose quotient underflows (amax < ~3.1e-43; a zero scale gives 0 / 0 = NaN);
    1 for a zero amax."""
    return torch.where(amax > 0, (amax / E4M3_MAX).clamp(min=F32_TINY), torch.ones_like(amax))


def _fp8_core(x: Tensor, granularity: str, block_size: int, rounding: Rounding, generator):
    """-> (elements fp32 in a layout that broadcasts against scale, scale)."""
    _check_rounding(rounding)
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    x32 = x.float()
    if granularity == "tensor":
        view = x32
        amax = x32.abs().amax()
    elif granularity == "channel":
        view = x32
        amax = x32.abs().amax(dim=-1, keepdim=True)
    elif granularity == "group":
        xp = _pad_last(x32, block_size)
        view = xp.reshape(*xp.shape[:-1], -1, block_size)
        amax = view.abs().amax(dim=-1, keepdim=True)
    elif granularity == "block":
        if x.dim() < 2:
            raise ValueError(f"block FP8 scaling needs a >= 2-D tensor, got {tuple(x.shape)}")
        view = _tiles(_pad_last2(x32, block_size), block_size)
        amax = view.abs().amax(dim=(-2, -1), keepdim=True)
    else:
        raise ValueError(
            f"granularity must be 'tensor', 'channel', 'group' or 'block', got {granularity!r}"
        )
    _check_finite_amax(amax, "fp8")
    scale = fp8_scale_from_amax(amax)
    data = e4m3_round(view / scale, rounding=rounding, generator=generator)
    return data, scale


def _fp8_flat(data: Tensor, granularity: str) -> Tensor:
    if granularity == "group":
        return data.flatten(-2)
    if granularity == "block":
        return _untile(data)
    return data


def fp8_quantize(
    x: Tensor,
    *,
    granularity: FP8Granularity = "tensor",
    block_size: int = 128,
    rounding: Rounding = "rne",
    generator: torch.Generator | None = None,
) -> FP8Tensor:
    """E4M3 with fp32 decode scales amax / 448 per tensor / channel / group / tile."""
    data, scale = _fp8_core(x, granularity, block_size, rounding, generator)
    if granularity == "group":
        scale = scale.squeeze(-1)
    elif granularity == "block":
        scale = scale.squeeze(-1).squeeze(-1)
    return FP8Tensor(
        data=_fp8_flat(data, granularity).to(torch.float8_e4m3fn),
        scale=scale,
        shape=x.shape,
        granularity=granularity,
        block_size=block_size,
    )


def fp8_dequantize(q: FP8Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    data = q.data.float()
    if q.granularity == "group":
        vals = (data.reshape(*data.shape[:-1], -1, q.block_size) * q.scale[..., None]).flatten(-2)
    elif q.granularity == "block":
        vals = _untile(_tiles(data, q.block_size) * q.scale[..., None, None])
    else:
        vals = data * q.scale
    return _crop(vals, q.shape).to(dtype)


def fp8_fake_quant(
    x: Tensor,
    *,
    granularity: FP8Granularity = "tensor",
    block_size: int = 128,
    rounding: Rounding = "rne",
    generator: torch.Generator | None = None,
) -> Tensor:
    data, scale = _fp8_core(x, granularity, block_size, rounding, generator)
    return _crop(_fp8_flat(data * scale, granularity), x.shape).to(x.dtype)
