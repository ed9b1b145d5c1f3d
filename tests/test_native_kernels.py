"""The native inference kernels (`ops.native`) against their pure-torch references."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridlm import HybridLM
from hybridlm.infer.generate import generate
from hybridlm.infer.speculative import speculative_generate
from hybridlm.model.mamba2 import mamba2_decode_step, mamba2_decode_step_torch
from hybridlm.model.moe import experts_gathered, moe_decode_step, moe_decode_step_torch
from hybridlm.ops import native
from hybridlm.presets import get_preset

pytestmark = pytest.mark.skipif(not native.available(), reason=native.status())


def _close(a, b, scale=None):
    scale = float(b.detach().abs().max()) if scale is None else scale
    torch.testing.assert_close(a, b, atol=2e-6 * max(scale, 1.0), rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 16])
@pytest.mark.parametrize("shape", [(37, 53), (256, 1024), (129, 16), (8, 5)])
def test_linear_equals_f_linear(rows, shape):
    g = torch.Generator().manual_seed(rows)
    O, I = shape
    x = torch.randn(rows, I, generator=g)
    w = torch.randn(O, I, generator=g)
    b = torch.randn(O, generator=g)
    _close(native.linear(x, w), F.linear(x, w))
    _close(native.linear(x, w, b), F.linear(x, w, b))
    x3 = x.view(1, rows, I)  # leading dims kept
    assert native.linear(x3, w).shape == (1, rows, O)


@pytest.mark.parametrize("rows,D", [(1, 192), (4, 1024), (3, 7)])
def test_rms_norm_equals_torch(rows, D):
    g = torch.Generator().manual_seed(D)
    x, w = torch.randn(rows, D, generator=g) * 3, torch.rand(D, generator=g) + 0.5
    _close(native.rms_norm(x, w, 1e-5), F.rms_norm(x, (D,), w, 1e-5))


@pytest.mark.parametrize("L,window", [(1, None), (4, None), (3, 5), (1, 2)])
def test_attention_equals_sdpa_against_a_cache(L, window):
    """Queries = the last L of S positions, keys read in place from a KVState's buffer."""
    from hybridlm.model.cache import KVState
    from hybridlm.ops.attention import attention

    g = torch.Generator().manual_seed(L)
    B, H, Kh, E, S0 = 2, 6, 2, 16, 9
    st = KVState(capacity=32)
    st.update(torch.randn(B, Kh, S0, E, generator=g), torch.randn(B, Kh, S0, E, generator=g))
    k, v = st.update(torch.randn(B, Kh, L, E, generator=g), torch.randn(B, Kh, L, E, generator=g))
    q = torch.randn(B, H, L, E, generator=g)
    assert native.attention_usable(q, k, v) and not k.is_contiguous()
    ref = attention(q, k.contiguous(), v.contiguous(), q_offset=S0, window=window)
    _close(native.attention(q, k, v, window=window), ref)


@pytest.mark.parametrize("norm", [True, False])
def test_route_equals_sigmoid_topk(norm):
    from hybridlm.model.moe import sigmoid_topk_route

    g = torch.Generator().manual_seed(int(norm))
    x, w = torch.randn(5, 24, generator=g), torch.randn(16, 24, generator=g)
    bias = torch.randn(16, generator=g) / 10
    kw = dict(top_k=4, norm_topk_prob=norm, scaling=2.5)
    _, idx_ref, gate_ref = sigmoid_topk_route(x, w, bias, n_group=1, topk_group=1, **kw)
    logits_ET = F.linear(x, w).t().contiguous()  # a non-contiguous view of [T, E] goes in
    idx, gate = native.route(logits_ET.t(), bias, **kw)
    order_ref, order = idx_ref.sort(-1).indices, idx.sort(-1).indices
    assert torch.equal(idx_ref.gather(1, order_ref), idx.gather(1, order))
    _close(gate.gather(1, order), gate_ref.gather(1, order_ref))


def test_usable_only_for_plain_inference_calls():
    x, w = torch.randn(2, 8), torch.randn(4, 8, requires_grad=True)
    assert not native.usable(x, w)  # autograd would be bypassed
    with torch.no_grad():
        assert native.usable(x, w)
        assert not native.usable(torch.randn(native.MAX_ROWS + 1, 8), w)
        assert not native.usable(x.double(), w)
        assert not native.usable(x, w.t())  # not contiguous
        assert not native.usable(torch.randn(0, 8), w)  # nothing to compute
        with native.enabled(False):
            assert not native.usable(x, w)


@pytest.mark.parametrize("T,K,E", [(1, 4, 32), (4, 4, 32), (5, 8, 8), (16, 2, 4)])
def test_experts_equal_the_gathered_reference(T, K, E):
    g = torch.Generator().manual_seed(T * K)
    W, Fh = 24, 40
    z = torch.randn(T, W, generator=g)
    up = torch.randn(E, Fh, W, generator=g) / 5
    down = torch.randn(E, W, Fh, generator=g) / 5
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    ref = experts_gathered(z, idx, w, up, down)
    _close(native.experts(z, idx, w, up, down), ref)
    with pytest.raises(ValueError, match="out of range"):
        native.experts(z, torch.full_like(idx, E), w, up, down)


def _mamba_args(Bsz, conv_bias, g):
    H, P, G, N, S = 6, 8, 2, 16, 3
    I, X = H * P, H * P + 2 * G * N
    D = 20
    return (
        torch.randn(Bsz, D, generator=g),
        torch.randn(Bsz, S, X, generator=g),
        torch.randn(Bsz, H, P, N, generator=g),
        torch.randn(I + X + H, D, generator=g) / 4,
        torch.randn(X, S + 1, generator=g) / 2,
        torch.randn(X, generator=g) if conv_bias else None,
        torch.randn(H, generator=g),
        torch.rand(H, generator=g) * 2,
        torch.randn(H, generator=g),
        torch.rand(I, generator=g) + 0.5,
        torch.randn(D, I, generator=g) / 4,
    ), {"heads": H, "head_dim": P, "groups": G, "state_size": N, "eps": 1e-5}


@pytest.mark.parametrize("Bsz", [1, 3])
@pytest.mark.parametrize("conv_bias", [True, False])
@pytest.mark.parametrize("dt_clamp", [(0.0, None), (1e-3, 0.5)])
def test_mamba_step_equals_the_torch_step(Bsz, conv_bias, dt_clamp):
    """The fused step (in_proj GEMV, conv tap .. gated norm, out_proj GEMV) == the pure-torch
    decode step, outputs and both new states; the old states are left untouched."""
    args, kw = _mamba_args(Bsz, conv_bias, torch.Generator().manual_seed(Bsz))
    kw.update(dt_clamp_min=dt_clamp[0], dt_clamp_max=dt_clamp[1])
    conv0, ssm0 = args[1].clone(), args[2].clone()
    with torch.no_grad():
        ref = mamba2_decode_step_torch(*args, **kw)
        got = mamba2_decode_step(*args, **kw)
    for a, b in zip(got, ref, strict=True):
        _close(a, b)
    assert torch.equal(args[1], conv0) and torch.equal(args[2], ssm0)


def test_moe_decode_step_equals_the_torch_step():
    model = HybridLM(get_preset("tiny-super"), seed=0).eval()
    moe = model.layers[1].mixer
    c = moe.cfg
    x = torch.randn(5, model.config.d_model)
    weights = (
        moe.gate.weight, moe.gate.e_score_correction_bias, moe.experts.up_proj,
        moe.experts.down_proj, moe.fc1_latent_proj.weight, moe.fc2_latent_proj.weight,
        moe.shared_experts.up_proj.weight, moe.shared_experts.down_proj.weight,
    )  # fmt: skip
    route = dict(
        top_k=c.top_k,
        n_group=c.n_group,
        topk_group=c.topk_group,
        norm_topk_prob=c.norm_topk_prob,
        scaling=c.routed_scaling_factor,
    )
    with torch.no_grad():
        _close(moe_decode_step(x, *weights, **route), moe_decode_step_torch(x, *weights, **route))


@pytest.mark.parametrize("name", ["tiny-super", "tiny-olmo", "tiny-lightning"])
def test_greedy_decoding_is_unchanged(name):
    """Greedy tokens and every step's logits equal the pure-torch path."""
    cfg = get_preset(name)
    cfg.vocab_size = 512
    model = HybridLM(cfg, seed=1).eval()
    x = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(0))
    fast = generate(model, x, 24)
    with native.enabled(False):
        ref = generate(model, x, 24)
    assert torch.equal(fast, ref)


def test_speculative_greedy_equals_plain_greedy():
    """Verification (a few rows through the native GEMVs and grouped experts) keeps speculative
    greedy output equal to plain greedy output."""
    cfg = get_preset("tiny-super")
    cfg.vocab_size = 512
    model = HybridLM(cfg, seed=2).eval()
    x = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(3))
    plain = generate(model, x, 20)
    spec, _ = speculative_generate(model, x, 20, draft_len=3)
    assert torch.equal(spec, plain)


def test_disabled_by_environment(tmp_path):
    """HYBRIDLM_NATIVE=0 turns the kernels off; the model still decodes (references)."""
    code = (
        "from hybridlm.ops import native; import torch, hybridlm\n"
        "from hybridlm.presets import get_preset\n"
        "from hybridlm.infer.generate import generate\n"
        "assert not native.available(), native.status()\n"
        "print(native.status())\n"
        "m = hybridlm.HybridLM(get_preset('tiny-super'), seed=0).eval()\n"
        "print(generate(m, torch.tensor([[1, 2, 3]]), 3).tolist())\n"
    )
    env = dict(os.environ, HYBRIDLM_NATIVE="0", HYBRIDLM_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "disabled by HYBRIDLM_NATIVE=0" in out.stdout


def test_compiles_into_an_empty_cache(tmp_path):
    """A fresh cache directory gets the library built (what a new machine does on first use)."""
    code = "from hybridlm.ops import native; assert native.available(), native.status()"
    env = dict(os.environ, HYBRIDLM_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert list((tmp_path / "native").glob("kernels-*.so"))


def test_no_compiler_falls_back(tmp_path):
    """Without a C compiler the kernels are unavailable, with the reason, and decoding works."""
    code = (
        "from hybridlm.ops import native; import torch, hybridlm\n"
        "from hybridlm.presets import get_preset\n"
        "from hybridlm.infer.generate import generate\n"
        "assert not native.available()\n"
        "print(native.status())\n"
        "m = hybridlm.HybridLM(get_preset('tiny-super'), seed=0).eval()\n"
        "generate(m, torch.tensor([[1, 2, 3]]), 3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env.update(PATH=str(tmp_path), HYBRIDLM_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "no C compiler found" in out.stdout


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64")
    or "avx2" not in Path("/proc/cpuinfo").read_text(errors="ignore"),
    reason="needs an x86-64 CPU with AVX2",
)
def test_kernels_built_without_avx512_agree(tmp_path):
    """The register tiles are sized by vector width (4 input rows with AVX-512, 2 without): a
    build for AVX2 only (what a machine without AVX-512 compiles) computes the same linear and
    expert products for every row count."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "from hybridlm.ops import native\n"
        "native._FLAG_SETS = (['-O3', '-mavx2', '-mfma', '-fopenmp'], ['-O3', '-mavx2', '-mfma'])\n"
        "assert native.available(), native.status()\n"
        "assert '-mavx2' in native.status(), native.status()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for O, I in ((37, 53), (256, 1024), (8, 5)):\n"
        "    W, b = torch.randn(O, I, generator=g), torch.randn(O, generator=g)\n"
        "    for M in range(1, 17):\n"
        "        x = torch.randn(M, I, generator=g)\n"
        "        torch.testing.assert_close(native.linear(x, W, b), F.linear(x, W, b),"
        " rtol=1e-4, atol=1e-4)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, HYBRIDLM_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ---------------------------------------------------------------------- training kernels
@pytest.mark.parametrize("B,L,D,K", [(2, 37, 40, 4), (1, 5, 16, 4), (3, 64, 130, 2), (2, 9, 7, 3)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("state", [True, False])
def test_conv_silu_forward_and_backward_equal_autograd_of_the_reference(B, L, D, K, bias, state):
    """`causal_conv1d_silu` through the fused kernels == autograd of silu(F.conv1d reference),
    for the output, the new state and the gradients of x, weight, bias and the carried state."""
    from hybridlm.ops.conv1d import causal_conv1d_ref, causal_conv1d_silu

    g = torch.Generator().manual_seed(B * 1000 + L + D + K)

    def leaves():
        return [
            torch.randn(B, L, D, generator=g).requires_grad_(),
            (torch.randn(D, K, generator=g) / 2).requires_grad_(),
            torch.randn(D, generator=g).requires_grad_() if bias else None,
            torch.randn(B, K - 1, D, generator=g).requires_grad_() if state else None,
        ]

    ours = leaves()
    ref = [None if t is None else t.detach().clone().requires_grad_() for t in ours]
    assert native.trainable(*ours)
    y, st = causal_conv1d_silu(*ours)
    with native.enabled(False):
        y_ref, st_ref = causal_conv1d_ref(*ref)
        y_ref = F.silu(y_ref)
    _close(y, y_ref)
    _close(st, st_ref)
    gy = torch.randn(y.shape, generator=g)
    (y * gy).sum().backward()
    (y_ref * gy).sum().backward()
    for a, b in zip(ours, ref, strict=True):
        if a is not None:
            _close(a.grad, b.grad)


@pytest.mark.parametrize("shape,group", [((2, 33, 64), 32), ((3, 20), 20), ((1, 7, 96), 24)])
def test_gated_norm_forward_and_backward_equal_autograd_of_the_reference(shape, group):
    from hybridlm.model.norm import GatedRMSNorm, gated_rms_norm

    g = torch.Generator().manual_seed(shape[-1] + group)
    x = torch.randn(shape, generator=g).requires_grad_()
    z = (3 * torch.randn(shape, generator=g)).requires_grad_()  # both tails of the sigmoid
    norm = GatedRMSNorm(shape[-1], group)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    xr, zr = x.detach().clone().requires_grad_(), z.detach().clone().requires_grad_()
    wr = norm.weight.detach().clone().requires_grad_()
    y = norm(x, z)
    y_ref = gated_rms_norm(xr, zr, wr, group, norm.eps)
    _close(y, y_ref)
    gy = torch.randn(shape, generator=g)
    (y * gy).sum().backward()
    (y_ref * gy).sum().backward()
    for a, b in ((x.grad, xr.grad), (z.grad, zr.grad), (norm.weight.grad, wr.grad)):
        _close(a, b)


def test_training_kernels_leave_other_dtypes_and_compiled_code_to_the_reference():
    """fp64 (the parity references), bf16 (autocast) and tensor subclasses take the torch path."""
    x = torch.randn(2, 8, 16)
    assert native.trainable(x, torch.randn(16, 4))
    assert not native.trainable(x.double(), torch.randn(16, 4))
    assert not native.trainable(x.bfloat16())
    with native.enabled(False):
        assert not native.trainable(x)


def test_mamba_training_step_is_unchanged_by_the_training_kernels():
    """A Mamba-2 mixer's loss and every parameter gradient agree with and without the fused
    conv + SiLU and gated-norm kernels (fp32)."""
    cfg = get_preset("tiny-super")
    model = HybridLM(cfg, seed=0)
    x = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    grads = []
    for on in (True, False):
        model.zero_grad()
        with native.enabled(on):
            out = model(x)
            loss = out.logits.float().logsumexp(-1).mean()
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-6, msg=n)
