"""Number formats of hybridlm.precision.formats: exact round trips, RNE ties, stochastic
rounding statistics, block error bounds, packing order and bit-exact torchao cross-checks."""

import math

import pytest
import torch

from hybridlm.precision.formats import (
    E2M1_MAX,
    E2M1_VALUES,
    F32_TINY,
    NVFP4_RESCALE_BELOW,
    e2m1_round,
    e4m3_round,
    e8m0_decode,
    e8m0_encode,
    fp4_e2m1_decode,
    fp4_e2m1_encode,
    fp8_dequantize,
    fp8_fake_quant,
    fp8_quantize,
    mxfp8_dequantize,
    mxfp8_fake_quant,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_fake_quant,
    nvfp4_quantize,
    pack_fp4,
    unpack_fp4,
)
from hybridlm.precision.ptq import nvfp4_quantize_weight

F32_MIN_NORMAL = torch.finfo(torch.float32).tiny  # 2**-126 = 1.17549435e-38


def _all_e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value (254 bit patterns; 0x7f/0xff are NaN)."""
    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    return bits.view(torch.float8_e4m3fn).float()


# ----------------------------------------------------------------------------- FP4 E2M1


def test_fp4_every_code_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = fp4_e2m1_decode(codes)
    assert vals[:8].tolist() == list(E2M1_VALUES)
    assert vals[8:].tolist() == [-v for v in E2M1_VALUES]
    assert torch.signbit(vals[8])  # code 8 is -0.0
    for rounding in ("rne", "sr"):
        assert torch.equal(fp4_e2m1_encode(vals, rounding=rounding), codes)


def test_fp4_rne_ties_to_even_and_saturates():
    # Hand-computed: each midpoint goes to the neighbour whose mantissa bit is 0.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert fp4_e2m1_decode(fp4_e2m1_encode(mids)).tolist() == expect
    assert fp4_e2m1_decode(fp4_e2m1_encode(-mids)).tolist() == [-v for v in expect]
    # Off-tie values go to the nearest; overflow and inf saturate to +-6.
    x = torch.tensor([0.26, 0.74, 5.01, 4.99, 6.5, 1e9, float("inf"), -float("inf")])
    assert fp4_e2m1_decode(fp4_e2m1_encode(x)).tolist() == [0.5, 0.5, 6, 4, 6, 6, 6, -6]
    with pytest.raises(ValueError, match="NaN"):
        fp4_e2m1_encode(torch.tensor([float("nan")]))


def test_fp4_rne_equals_brute_force_nearest():
    x = torch.linspace(-7, 7, 28001)  # step 5e-4: hits every midpoint exactly
    grid = torch.tensor(E2M1_VALUES)
    dist = (x.abs().clamp(max=6)[:, None] - grid[None]).abs()
    best = dist.min(dim=1, keepdim=True).values
    # among equally near grid points prefer the even code (index)
    cand = (dist == best) * (1 + (torch.arange(8) % 2 == 0).float())
    nearest = grid[cand.argmax(dim=1)] * torch.where(x < 0, -1.0, 1.0)
    assert torch.equal(fp4_e2m1_decode(fp4_e2m1_encode(x)), nearest)


def test_pack_unpack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (3, 5, 32), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 16)
    assert torch.equal(unpack_fp4(packed), codes)
    # even element in the low nibble: [1, 2] -> 0x21 (vLLM break_fp4_bytes reads low first)
    assert pack_fp4(torch.tensor([1, 2], dtype=torch.uint8)).tolist() == [0x21]
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


# ----------------------------------------------------------------------------- E4M3 / E8M0


def test_e4m3_every_value_round_trips_and_matches_torch_cast():
    vals = _all_e4m3_values()
    for rounding in ("rne", "sr"):
        assert torch.equal(e4m3_round(vals, rounding=rounding), vals)
    x = torch.randn(20000) * torch.exp2(torch.randint(-12, 9, (20000,)).float())
    x = x.clamp(-448, 448)
    assert torch.equal(e4m3_round(x), x.to(torch.float8_e4m3fn).float())


def test_e4m3_rne_ties_and_saturation():
    # 1.0625 is halfway between 1.0 (mantissa 000) and 1.125 (001): goes to 1.0;
    # 1.1875 between 1.125 (001) and 1.25 (010): goes to 1.25; subnormal tie 3 * 2**-10
    # between 2**-9 (001) and 2**-8 (010): goes to 2**-8.
    x = torch.tensor([1.0625, 1.1875, 3 * 2.0**-10, 1000.0, -1e9, float("inf"), 2.0**-11])
    assert e4m3_round(x).tolist() == [1.0, 1.25, 2.0**-8, 448.0, -448.0, 448.0, 0.0]
    assert torch.isnan(e4m3_round(torch.tensor([float("nan")]))).all()


def test_e8m0_every_code_round_trips():
    codes = torch.arange(255, dtype=torch.uint8)
    vals = e8m0_decode(codes)
    assert vals[127] == 1.0 and vals[0] == 2.0**-127 and vals[254] == 2.0**127
    for rounding in ("floor", "ceil"):
        assert torch.equal(e8m0_encode(vals, rounding=rounding), codes)
    assert torch.isnan(e8m0_decode(torch.tensor([255], dtype=torch.uint8))).all()
    s = torch.tensor([3.0, 0.3, 0.0])
    assert e8m0_decode(e8m0_encode(s, rounding="ceil")).tolist() == [4.0, 0.5, 2.0**-127]
    assert e8m0_decode(e8m0_encode(s, rounding="floor")).tolist() == [2.0, 0.25, 2.0**-127]
    with pytest.raises(ValueError):
        e8m0_encode(torch.tensor([-1.0]))


# ----------------------------------------------------------------------------- stochastic rounding


@pytest.mark.parametrize("fmt", ["fp4", "e4m3"])
def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours(fmt):
    n_draws = 4000
    if fmt == "fp4":
        x = torch.tensor([0.1, 0.3, 0.9, 1.3, 1.9, 2.2, 3.7, 4.5, 5.9, -2.6])
        grid = torch.tensor(E2M1_VALUES)
        mag = x.abs()
        lo = grid[(torch.bucketize(mag, grid, right=True) - 1)]
        hi = grid[torch.bucketize(mag, grid, right=True)]
        lo, hi = torch.where(x < 0, -hi, lo), torch.where(x < 0, -lo, hi)

        def q(v, g):
            return fp4_e2m1_decode(fp4_e2m1_encode(v, rounding="sr", generator=g))
    else:
        x = torch.tensor([0.1, 1.03, -1.03, 3.3e-3, 300.0, -447.0, 17.7, 2.0**-8 * 1.3])
        near = e4m3_round(x)
        # the other neighbour: one E4M3 step beyond the nearest, on x's side
        bits = near.to(torch.float8_e4m3fn).view(torch.uint8).int()
        step = torch.where((near < x) ^ (near < 0), 1, -1)
        other = (bits + step).to(torch.uint8).view(torch.float8_e4m3fn).float()
        lo, hi = torch.minimum(near, other), torch.maximum(near, other)

        def q(v, g):
            return e4m3_round(v, rounding="sr", generator=g)

    g = torch.Generator().manual_seed(1234)
    draws = q(x.expand(n_draws, -1).contiguous(), g)
    assert ((draws == lo) | (draws == hi)).all(), "SR must land on one of the two neighbours"
    assert (draws == lo).any(0).all() and (draws == hi).any(0).all()
    # Each draw is lo + gap * Bernoulli(p): std of the mean <= gap / (2 sqrt(n)). A 5-sigma
    # tolerance fails a correct implementation with probability < 1e-6 per value.
    tol = 5 * (hi - lo) / (2 * math.sqrt(n_draws))
    assert ((draws.mean(0) - x).abs() <= tol).all()
    # RNE instead is biased at these points by up to half a gap; SR is reproducible.
    assert torch.equal(draws, q(x.expand(n_draws, -1).contiguous(), g.manual_seed(1234)))


def test_rounding_argument_is_checked():
    with pytest.raises(ValueError, match="rounding"):
        nvfp4_quantize(torch.randn(4, 16), rounding="nearest")


# ----------------------------------------------------------------------------- NVFP4


@pytest.mark.parametrize("block", ["1d", "2d"])
def test_nvfp4_round_trip_layout_and_error_bound(block):
    x = torch.randn(48, 80) * torch.rand(48, 1) * 3
    q = nvfp4_quantize(x, block=block)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (48, 40)
    assert q.block_scale.dtype == torch.float8_e4m3fn
    assert q.block_scale.shape == ((48, 5) if block == "1d" else (3, 5))
    assert torch.allclose(q.global_scale, x.abs().max() / (6 * 448))
    deq = nvfp4_dequantize(q)
    assert torch.equal(deq, nvfp4_fake_quant(x, block=block))
    # Per-element bound: within one block scale unit s_b * s_g (half the widest E2M1 gap,
    # plus saturation from rounding s_b down by at most 2**-4 relative, which is < 0.4 unit).
    s = q.block_scale.float() * q.global_scale
    s_el = s.repeat_interleave(16, -1) if block == "1d" else s.repeat_interleave(16, 0)
    if block == "2d":
        s_el = s_el.repeat_interleave(16, -1)
    assert ((deq - x).abs() <= s_el).all()
    # hence overall: s <= amax / 6 * (1 + 2**-4)
    assert (deq - x).abs().amax() <= x.abs().max() / 6 * (1 + 2**-4)
    # RMS error on unit Gaussians (measured ~0.09 in either layout; 2d tiles here span rows of
    # different magnitude above, which is why the paper keeps sensitive layers out of NVFP4)
    y = torch.randn(64, 64)
    assert (nvfp4_fake_quant(y, block=block) - y).norm() / y.norm() < 0.12


def test_nvfp4_2d_blocks_share_scale_across_rows_and_transpose():
    w = torch.randn(32, 64)
    wq = nvfp4_fake_quant(w, block="2d")
    # a 16x16 tile quantises identically whichever dim is the reduction dim: Q(W)^T == Q(W^T)
    assert torch.equal(wq.T, nvfp4_fake_quant(w.T.contiguous(), block="2d"))


def test_nvfp4_padding_zero_blocks_and_nonfinite():
    x = torch.randn(3, 20)
    q = nvfp4_quantize(x)
    assert q.packed.shape == (3, 16) and nvfp4_dequantize(q).shape == (3, 20)
    padded = torch.nn.functional.pad(x, (0, 12))
    assert torch.equal(nvfp4_fake_quant(x), nvfp4_fake_quant(padded)[:, :20])
    x2 = torch.randn(20, 30)
    assert torch.equal(
        nvfp4_fake_quant(x2, block="2d"),
        nvfp4_fake_quant(torch.nn.functional.pad(x2, (0, 2, 0, 12)), block="2d")[:20, :30],
    )
    z = torch.zeros(4, 32)
    z[0, :16] = torch.randn(16)
    qz = nvfp4_quantize(z)
    assert (qz.block_scale.float()[1:] == 0).all()
    assert torch.equal(nvfp4_dequantize(qz)[1:], z[1:])
    allzero = nvfp4_quantize(torch.zeros(2, 16))
    assert allzero.global_scale == 1.0 and (nvfp4_dequantize(allzero) == 0).all()
    with pytest.raises(ValueError, match="NaN or inf"):
        nvfp4_quantize(torch.tensor([[1.0, float("nan")] * 8]))
    with pytest.raises(ValueError, match="2d"):
        nvfp4_quantize(torch.randn(16), block="2d")


def test_nvfp4_explicit_global_scale_and_dtype():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    out = nvfp4_fake_quant(x, global_scale=0.01)
    assert out.dtype == torch.bfloat16
    q = nvfp4_quantize(x, global_scale=torch.tensor(0.01))
    assert float(q.global_scale) == pytest.approx(0.01)
    assert torch.equal(nvfp4_dequantize(q, torch.bfloat16), out)


def test_nvfp4_hand_computed_block():
    # Global scale 2**-8, block amax 12 -> s_b = e4m3(12 / 6 / 2**-8) = e4m3(512) saturates to
    # 448, so elements are x * 2**8 / 448 = x / 1.75.
    x = torch.tensor([[12.0, -7.0, 3.5, 0.875, 1.3125, 2.625, 4.375, 8.75] + [0.0] * 8])
    got = nvfp4_fake_quant(x, global_scale=2.0**-8)
    # x / 1.75 = [6.857, -4, 2, .5, .75, 1.5, 2.5, 5]: saturate 6, exact, exact, exact,
    # tie .75 -> 1 (even), exact, tie 2.5 -> 2 (even), tie 5 -> 4 (even); then * 1.75.
    expect = [10.5, -7.0, 3.5, 0.875, 1.75, 2.625, 3.5, 7.0] + [0.0] * 8
    assert got.flatten().tolist() == expect
    # amax 6 with s_g = 2**-8: s_b = 256 exactly, elements are x itself (ties to even).
    y = torch.tensor([[6.0, -4.0, 3.0, 0.25, 0.75, 1.25, 1.75, 5.0] + [0.0] * 8])
    expect = [6.0, -4.0, 3.0, 0.0, 1.0, 1.0, 2.0, 4.0] + [0.0] * 8
    assert nvfp4_fake_quant(y, global_scale=2.0**-8).flatten().tolist() == expect


def _rel_err(y: torch.Tensor, x: torch.Tensor) -> float:
    return float((y.double() - x.double()).norm() / x.double().norm())


@pytest.mark.parametrize("block", ["1d", "2d"])
def test_nvfp4_tiny_tensors_keep_their_accuracy(block):
    # (1 / s_g) / s_b overflowed fp32 for amax below ~7.9e-36 (relative error ~1.6 here);
    # the encoder now shifts x and s_g up by 2**96 first (formats module docstring).
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    err_1 = _rel_err(nvfp4_fake_quant(x, block=block), x)  # ~0.09 (1d), ~0.12 (2d)
    for s in (1e-36, F32_MIN_NORMAL, 1e-40):  # 1e-40 is subnormal: x itself has fewer bits
        q = nvfp4_quantize(x * s, block=block)
        deq = nvfp4_dequantize(q)
        assert torch.isfinite(deq).all() and q.global_scale > 0
        assert torch.equal(deq, nvfp4_fake_quant(x * s, block=block))
        assert _rel_err(deq, x * s) <= 1.5 * err_1, s
    # amax / 2688 underflows to 0 below ~1.9e-42: the scale is floored at 2**-149 instead
    tiny = x * 1e-44
    q = nvfp4_quantize(tiny, block=block)
    assert float(q.global_scale) == F32_TINY
    assert torch.isfinite(nvfp4_dequantize(q)).all()
    assert _rel_err(nvfp4_dequantize(q), tiny) <= 1.5 * err_1


@pytest.mark.parametrize("block", ["1d", "2d"])
def test_nvfp4_power_of_two_shifts_are_exact_across_the_rescale(block):
    # Shifting x by 2**-j keeps codes and block scales and shifts s_g exactly while s_g stays
    # normal, whether or not the encoder rescales (s_g < NVFP4_RESCALE_BELOW).
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 96, generator=g) * torch.exp2(
        torch.randint(-6, 6, (32, 1), generator=g).float()
    )
    ref = nvfp4_quantize(x, block=block)
    shifts = (30, 64, 90, 94, 100, 115)
    s_gs = [float(ref.global_scale) * 2.0**-j for j in shifts]
    assert min(s_gs) >= F32_MIN_NORMAL
    assert any(v < NVFP4_RESCALE_BELOW for v in s_gs) and any(v > NVFP4_RESCALE_BELOW for v in s_gs)
    for j in shifts:
        q = nvfp4_quantize(x * 2.0**-j, block=block)
        assert torch.equal(q.packed, ref.packed), j
        assert torch.equal(q.block_scale.view(torch.uint8), ref.block_scale.view(torch.uint8))
        assert float(q.global_scale) == float(ref.global_scale) * 2.0**-j
        # stochastic rounding draws the same uniforms, so it shifts exactly too
        sr = [
            nvfp4_quantize(
                v, block=block, rounding="sr", generator=torch.Generator().manual_seed(3)
            )
            for v in (x, x * 2.0**-j)
        ]
        assert torch.equal(sr[0].packed, sr[1].packed)


def test_nvfp4_matches_the_reciprocal_formula_on_ordinary_scales():
    # The torchao/TE formula e2m1(x * ((1 / s_g) / s_b)), s_b = e4m3(block_amax / 6 / s_g),
    # evaluated directly: bit-identical for amaxes where it neither overflows nor underflows.
    g = torch.Generator().manual_seed(2)
    for trial in range(40):
        e = float(torch.randint(-105, 60, (1,), generator=g))  # s_g down to ~2**-110
        per_block = torch.exp2(torch.randint(-8, 8, (8, 4), generator=g).float())
        x = torch.randn(8, 64, generator=g) * per_block.repeat_interleave(16, -1) * 2.0**e
        if trial % 5 == 0:
            x[:, :16] = 0
        q = nvfp4_quantize(x)
        s_g = x.abs().amax() / (6 * 448)
        blocks = x.reshape(8, 4, 16)
        s_b = e4m3_round((blocks.abs().amax(-1, keepdim=True) / E2M1_MAX) / s_g)
        recip = torch.where(s_b > 0, (1.0 / s_g) / s_b, torch.zeros_like(s_b))
        want = (e2m1_round(blocks * recip) * s_b) * s_g
        assert float(q.global_scale) == float(s_g)
        assert torch.equal(q.block_scale.float(), s_b.squeeze(-1))
        assert torch.equal(nvfp4_dequantize(q), want.reshape(8, 64)), e


def test_nvfp4_tiny_and_zero_blocks_give_zeros_without_nan():
    z = torch.zeros(4, 32)
    z[0, :16] = torch.randn(16) * 1e-39
    q = nvfp4_quantize(z)
    deq = nvfp4_dequantize(q)
    assert torch.isfinite(deq).all() and torch.equal(deq[1:], z[1:])
    assert (q.block_scale.float()[1:] == 0).all()
    for gs in (None, 1e-40, F32_TINY):  # all-zero input, also under tiny explicit scales
        assert torch.equal(
            nvfp4_fake_quant(torch.zeros(2, 32), global_scale=gs), torch.zeros(2, 32)
        )
    assert float(nvfp4_quantize(torch.zeros(2, 16)).global_scale) == 1.0
    # an explicit subnormal global scale quantises like the automatic one
    x = torch.randn(4, 64) * 1e-40
    q = nvfp4_quantize(x)
    assert torch.equal(nvfp4_fake_quant(x, global_scale=q.global_scale), nvfp4_dequantize(q))


def test_nvfp4_weight_quantiser_handles_tiny_weights():
    # ptq.nvfp4_quantize_weight shares the rescaled encoding: "max" equals nvfp4_quantize and
    # "mse" stays no worse than it, also where errors would underflow unshifted.
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)) * 1e-38
    ref = nvfp4_quantize(w)
    q_max = nvfp4_quantize_weight(w, global_scale=ref.global_scale, search="max")
    assert torch.equal(q_max.packed, ref.packed)
    assert torch.equal(q_max.block_scale.view(torch.uint8), ref.block_scale.view(torch.uint8))
    q_mse = nvfp4_quantize_weight(w, global_scale=ref.global_scale, search="mse")
    assert not torch.equal(q_mse.block_scale.view(torch.uint8), ref.block_scale.view(torch.uint8))
    assert _rel_err(nvfp4_dequantize(q_mse), w) <= _rel_err(nvfp4_dequantize(ref), w)


# ----------------------------------------------------------------------------- MXFP8 / FP8


def test_mxfp8_round_trip_and_error_bound():
    x = torch.randn(8, 100) * torch.exp2(torch.randint(-10, 10, (8, 1)).float())
    for mode in ("floor", "rceil"):
        q = mxfp8_quantize(x, scale_mode=mode)
        assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.uint8
        assert q.data.shape == (8, 128) and q.scale.shape == (8, 4)
        deq = mxfp8_dequantize(q)
        assert torch.equal(deq, mxfp8_fake_quant(x, scale_mode=mode))
    # rceil never saturates: relative error <= 2**-4 (half an E4M3 ulp) for normal elements,
    # absolute <= half the subnormal step 2**-10 * scale below.
    q = mxfp8_quantize(x, scale_mode="rceil")
    deq = mxfp8_dequantize(q)
    scale = e8m0_decode(q.scale).repeat_interleave(32, -1)[:, :100]
    assert ((deq - x).abs() <= torch.maximum(x.abs() * 2**-4, scale * 2**-10)).all()
    # floor (OCP) scales put block maxima in [256, 512) * scale: the part above 448 clips
    blk = torch.tensor([[500.0] + [1.0] * 31])
    assert mxfp8_fake_quant(blk)[0, 0] == 448.0
    assert mxfp8_fake_quant(blk, scale_mode="rceil")[0, 0] == 512.0


@pytest.mark.parametrize("granularity", ["tensor", "channel", "group", "block"])
def test_fp8_round_trip_and_error_bound(granularity):
    x = torch.randn(40, 72) * torch.exp2(torch.randint(-4, 4, (40, 1)).float())
    q = fp8_quantize(x, granularity=granularity, block_size=16)
    deq = fp8_dequantize(q)
    assert deq.shape == x.shape and q.data.dtype == torch.float8_e4m3fn
    assert torch.equal(deq, fp8_fake_quant(x, granularity=granularity, block_size=16))
    shapes = {"tensor": (), "channel": (40, 1), "group": (40, 5), "block": (3, 5)}
    assert tuple(q.scale.shape) == shapes[granularity]
    # amax / 448 scales: relative error <= 2**-4 above the subnormal range, else <= 2**-10 s
    s = q.scale.max()
    assert ((deq - x).abs() <= torch.maximum(x.abs() * 2**-4, s * 2**-10 + 0 * x)).all()
    if granularity == "block":
        assert torch.equal(q.scale[0, 0], x[:16, :16].abs().max() / 448)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "group", "block"])
def test_fp8_tiny_tensors(granularity):
    # FP8 divides by its scale (no reciprocal to overflow); the scale amax / 448 underflowed to
    # 0 for amax below ~3.1e-43 (0 / 0 = NaN) and is now floored at 2**-149.
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    kw = {"granularity": granularity, "block_size": 16}
    err_1 = _rel_err(fp8_fake_quant(x, **kw), x)  # ~0.027
    for s in (1e-36, F32_MIN_NORMAL, 1e-40, 1e-44):
        deq = fp8_dequantize(fp8_quantize(x * s, **kw))
        assert torch.isfinite(deq).all()
        if s >= F32_MIN_NORMAL:
            assert _rel_err(deq, x * s) <= 1.5 * err_1, s
    # 1e-44 is ~7 units of 2**-149: with that scale the integers mostly round trip exactly
    deq = fp8_dequantize(fp8_quantize(x * 1e-44, **kw))
    assert _rel_err(deq, x * 1e-44) <= 2**-4
    assert torch.equal(fp8_fake_quant(torch.zeros(4, 32), **kw), torch.zeros(4, 32))


def test_mxfp8_tiny_tensors():
    # No reciprocal either; E8M0 stops at 2**-127, so below ~2**-127 * 2**-6 elements become
    # E4M3 subnormals and below 2**-137 they flush to zero, a limit of the format.
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    for mode in ("floor", "rceil"):
        err_1 = _rel_err(mxfp8_fake_quant(x, scale_mode=mode), x)  # ~0.03
        for s in (1e-36, F32_MIN_NORMAL, 1e-40):
            deq = mxfp8_dequantize(mxfp8_quantize(x * s, scale_mode=mode))
            assert torch.isfinite(deq).all()
            if s >= F32_MIN_NORMAL:
                assert _rel_err(deq, x * s) <= 1.5 * err_1, (mode, s)
        assert torch.equal(mxfp8_fake_quant(x * 2.0**-140, scale_mode=mode), torch.zeros(4, 64))


def test_fp8_rejects_bad_granularity():
    with pytest.raises(ValueError, match="granularity"):
        fp8_quantize(torch.randn(4, 4), granularity="row")


# ----------------------------------------------------------------------------- torchao parity


def _torchao_mx():
    pytest.importorskip("torchao")
    try:
        from torchao.prototype.mx_formats import kernels, mx_tensor, nvfp4_tensor
    except ImportError as exc:  # layout moved between torchao versions
        pytest.skip(f"torchao mx_formats reference not importable: {exc}")
    return kernels, mx_tensor, nvfp4_tensor


def test_torchao_fp4_encode_and_pack_bit_exact():
    kernels, _, _ = _torchao_mx()
    x = torch.cat([torch.linspace(-7, 7, 4001), torch.tensor([0.25, 0.75, 2.5, 5.0, -0.0])])
    x = x[: x.numel() // 2 * 2]
    ref = kernels.f32_to_f4_unpacked(x)
    assert torch.equal(fp4_e2m1_encode(x), ref)
    assert torch.equal(pack_fp4(ref), kernels.pack_uint4(ref))
    assert torch.equal(fp4_e2m1_decode(ref), kernels.f4_unpacked_to_f32(ref))


def test_torchao_nvfp4_bit_exact():
    _, _, nv = _torchao_mx()
    # Conventions agree when no block scale falls below E4M3's smallest normal 2**-6 (torchao
    # clamps block scales up to it; we keep subnormal scales): keep block amaxes within 2**5.
    x = torch.randn(32, 128) * torch.exp2(torch.randint(0, 5, (32, 8)).float()).repeat_interleave(
        16, -1
    )
    ours = nvfp4_quantize(x)
    scale_ref, packed_ref = nv.nvfp4_quantize(x, per_tensor_scale=ours.global_scale)
    assert (scale_ref.float() >= 2**-6).all()
    assert torch.equal(ours.block_scale.view(torch.uint8), scale_ref.view(torch.uint8))
    assert torch.equal(ours.packed, packed_ref)


def test_torchao_mxfp8_floor_bit_exact():
    _, mx, _ = _torchao_mx()
    x = torch.randn(16, 256) * torch.exp2(
        torch.randint(-20, 20, (16, 8)).float()
    ).repeat_interleave(32, -1)
    scale_ref, data_ref = mx.to_mx(x, torch.float8_e4m3fn, 32)
    ours = mxfp8_quantize(x)
    assert torch.equal(ours.scale, scale_ref.view(torch.uint8))
    assert torch.equal(ours.data.view(torch.uint8), data_ref.view(torch.uint8))
