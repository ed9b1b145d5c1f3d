"""The Triton kernels (`ops.fused`) against autograd of their pure-torch references, forward
and backward, in fp32 and bf16, with ragged lengths, packed documents and initial states.

On a machine without CUDA the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`,
set here before the kernel modules are imported; they are imported on first use only), so
the default CPU suite checks the very kernel code a GPU compiles. With CUDA the same tests
run the compiled kernels on the device.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """Max error relative to the reference's scale (outputs and gradients span magnitudes)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    scale = max(float(want.abs().max()), 1e-6)
    err = float((got - want).abs().max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} on scale {scale:.3g}"


# ---------------------------------------------------------------------------------------------
# SSD scan


def _ssd_inputs(seed, Bsz, L, H, P, G, N, *, init=False, docs=None):
    g = _gen(seed)
    x = torch.randn(Bsz, L, H, P, generator=g)
    dt = torch.rand(Bsz, L, H, generator=g) * 0.3 + 0.01
    A = -(torch.rand(H, generator=g) + 0.3)
    Bm = torch.randn(Bsz, L, G, N, generator=g) * 0.5
    Cm = torch.randn(Bsz, L, G, N, generator=g) * 0.5
    D = torch.randn(H, generator=g)
    s0 = torch.randn(Bsz, H, P, N, generator=g) if init else None
    dy = torch.randn(Bsz, L, H, P, generator=g)
    dfinal = torch.randn(Bsz, H, P, N, generator=g)
    return [x, dt, A, Bm, Cm, D, s0], docs, dy, dfinal


def _ssd_run(fn, tensors, docs, dy, dfinal, chunk, dtype, device):
    leaves = []
    for t in tensors:
        if t is None:
            leaves.append(None)
            continue
        half = dtype if t.dim() >= 3 and t is not tensors[6] else t.dtype  # x, dt, B, C
        leaves.append(t.to(device=device, dtype=half).requires_grad_(True))
    x, dt, A, Bm, Cm, D, s0 = leaves
    d = None if docs is None else docs.to(device)
    y, final = fn(x, dt, A, Bm, Cm, D, chunk, s0, d)
    loss = (y.double() * dy.to(device).double()).sum() + (
        final.double() * dfinal.to(device).double()
    ).sum()
    loss.backward()
    grads = [None if t is None else t.grad for t in leaves]
    return y, final, grads


_NAMES = ("x", "dt", "A", "B", "C", "D", "initial state")


def _check_ssd(tensors, docs, dy, dfinal, chunk, dtype=torch.float32, rel=2e-5):
    from hybridlm.ops.fused.ssd import ssd_chunked_fused
    from hybridlm.ops.ssd import ssd_chunked

    ref64 = [None if t is None else t.double() for t in tensors]
    y_r, f_r, g_r = _ssd_run(ssd_chunked, ref64, docs, dy, dfinal, chunk, torch.float64, "cpu")
    y_f, f_f, g_f = _ssd_run(ssd_chunked_fused, tensors, docs, dy, dfinal, chunk, dtype, DEV)
    assert y_f.dtype == torch.float32 and f_f.dtype == torch.float32
    _assert_close(y_f, y_r, rel, "y")
    _assert_close(f_f, f_r, rel, "final state")
    for name, gf, gr in zip(_NAMES, g_f, g_r, strict=True):
        if gr is not None:
            _assert_close(gf, gr, rel, f"d{name}")


@pytest.mark.parametrize(
    "shape",
    [
        # Bsz, L, H, P, G, N, chunk: ragged L, P and N below and off the 16-wide tile
        (2, 50, 4, 16, 2, 16, 16),
        (1, 37, 2, 12, 1, 8, 64),
        (1, 70, 6, 16, 3, 24, 32),
        (1, 40, 2, 48, 1, 16, 16),  # P over two forward programs, the second one part-masked
    ],
)
def test_ssd_fused_matches_reference_fp32(shape):
    Bsz, L, H, P, G, N, chunk = shape
    tensors, _, dy, dfinal = _ssd_inputs(1, Bsz, L, H, P, G, N)
    _check_ssd(tensors, None, dy, dfinal, chunk)


def test_ssd_fused_initial_state_and_packed_documents():
    """Documents that start mid-chunk, exactly at a chunk start and in the first chunk, a
    one-token document, and an initial state that reaches only the first document."""
    Bsz, L, H, P, G, N = 2, 53, 4, 16, 2, 16
    starts = [[0, 5, 16, 17, 40], [0, 32, 33, 52]]
    docs = torch.zeros(Bsz, L, dtype=torch.long)
    for b, row in enumerate(starts):
        for i, s in enumerate(row):
            docs[b, s:] = i
    tensors, _, dy, dfinal = _ssd_inputs(2, Bsz, L, H, P, G, N, init=True, docs=docs)
    _check_ssd(tensors, docs, dy, dfinal, 16)
    tensors, _, dy, dfinal = _ssd_inputs(3, Bsz, L, H, P, G, N, init=True)
    _check_ssd(tensors, None, dy, dfinal, 16)


def test_ssd_fused_bf16_inputs():
    """bf16 x, dt, B and C (what autocast hands the scan): the kernel computes in fp32 (TF32
    products on a GPU) and returns their gradients in bf16; compared with the fp64 reference
    on the same bf16 values."""
    Bsz, L, H, P, G, N = 1, 40, 4, 16, 2, 16
    tensors, _, dy, dfinal = _ssd_inputs(4, Bsz, L, H, P, G, N, init=True)
    tensors = [
        t if t is None or i in (2, 5, 6) else t.to(torch.bfloat16).float()
        for i, t in enumerate(tensors)
    ]
    _check_ssd(tensors, None, dy, dfinal, 16, dtype=torch.bfloat16, rel=1e-2)


# ---------------------------------------------------------------------------------------------
# causal conv1d + SiLU


def _conv_ref(x, w, b, state, docs):
    from hybridlm.ops.conv1d import causal_conv1d, causal_conv1d_docs

    if docs is not None:
        return torch.nn.functional.silu(causal_conv1d_docs(x, w, b, docs)), None
    y, new_state = causal_conv1d(x, w, b, state)
    return torch.nn.functional.silu(y), new_state


def _check_conv(Bsz, L, D, K, *, bias=True, state=False, docs=None, dtype=torch.float32, rel=2e-5):
    from hybridlm.ops.fused.conv1d import causal_conv1d_silu_fused

    g = _gen(L * 7 + D)
    x = torch.randn(Bsz, L, D, generator=g)
    w = torch.randn(D, K, generator=g) * 0.5
    b = torch.randn(D, generator=g) if bias else None
    s = torch.randn(Bsz, K - 1, D, generator=g) if state else None
    dy = torch.randn(Bsz, L, D, generator=g)
    if dtype != torch.float32:
        x = x.to(dtype).float()
        s = None if s is None else s.to(dtype).float()

    def run(fn, dt, device, wdt):
        leaves = [
            None if t is None else t.to(device=device, dtype=d).requires_grad_(True)
            for t, d in ((x, dt), (w, wdt), (b, wdt), (s, dt))
        ]
        d = None if docs is None else docs.to(device)
        y, new_state = fn(*leaves, d)
        (y.double() * dy.to(device).double()).sum().backward()
        return y, new_state, [None if t is None else t.grad for t in leaves]

    y_r, s_r, g_r = run(_conv_ref, torch.float64, "cpu", torch.float64)
    y_f, s_f, g_f = run(causal_conv1d_silu_fused, dtype, DEV, torch.float32)
    assert y_f.dtype == torch.float32
    _assert_close(y_f, y_r, rel, "y")
    if s_r is not None:
        _assert_close(s_f, s_r, 0.0, "new state")
    for name, gf, gr in zip(("x", "w", "b", "state"), g_f, g_r, strict=True):
        if gr is not None:
            _assert_close(gf, gr, rel, f"d{name}")


@pytest.mark.parametrize(
    "shape", [(2, 50, 24, 4), (1, 3, 130, 4), (2, 70, 16, 2), (1, 129, 200, 4)]
)
def test_conv_silu_fused_matches_reference(shape):
    _check_conv(*shape)


def test_conv_silu_fused_state_no_bias_and_bf16():
    _check_conv(2, 21, 40, 4, state=True)
    _check_conv(1, 33, 24, 4, bias=False)
    _check_conv(2, 37, 48, 4, state=True, dtype=torch.bfloat16, rel=1e-2)


def test_conv_silu_fused_packed_documents():
    L = 45
    docs = torch.zeros(2, L, dtype=torch.long)
    docs[0, 1:] = 1  # a one-token first document
    docs[0, 3:] = 2
    docs[0, 40:] = 3
    docs[1, 20:] = 1
    docs[1, 21:] = 2
    _check_conv(2, L, 24, 4, docs=docs)


# ---------------------------------------------------------------------------------------------
# gated RMSNorm


@pytest.mark.parametrize(
    "shape", [((2, 9, 48), 24), ((5, 64), 64), ((3, 7, 96), 32), ((1, 300, 40), 20)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_fused_matches_reference(shape, dtype):
    from hybridlm.model.norm import gated_rms_norm
    from hybridlm.ops.fused.gated_norm import gated_rms_norm_fused

    dims, group = shape
    g = _gen(group + len(dims))
    x = (torch.randn(*dims, generator=g) * 3).to(dtype)
    z = torch.randn(*dims, generator=g).to(dtype)
    w = torch.randn(dims[-1], generator=g)
    dy = torch.randn(*dims, generator=g)

    def run(fn, device, dt, wdt):
        leaves = [
            t.to(device=device, dtype=d).requires_grad_(True)
            for t, d in ((x, dt), (z, dt), (w, wdt))
        ]
        y = fn(*leaves, group, 1e-5)
        (y.double() * dy.to(device).double()).sum().backward()
        return y, [t.grad for t in leaves]

    y_r, g_r = run(gated_rms_norm, "cpu", torch.float64, torch.float64)
    y_f, g_f = run(gated_rms_norm_fused, DEV, dtype, torch.float32)
    assert y_f.dtype == torch.float32 and g_f[0].dtype == dtype
    rel = 2e-5 if dtype == torch.float32 else 1e-2
    _assert_close(y_f, y_r, rel, "y")
    for name, gf, gr in zip(("x", "z", "w"), g_f, g_r, strict=True):
        _assert_close(gf, gr, rel, f"d{name}")


# ---------------------------------------------------------------------------------------------
# the whole mixer through the kernels


@pytest.mark.parametrize("packed", [False, True])
def test_model_through_fused_kernels_matches_reference(monkeypatch, packed):
    """A tiny hybrid's forward and backward with every Mamba-2 chain on the kernels (scan,
    conv + SiLU, gated norm) equals the same model on the references: the mixer's real,
    non-contiguous views of in_proj's output, packed documents and chunk padding included."""
    from _tiny import tiny_train_model
    from hybridlm import HybridLM
    from hybridlm.ops import fused

    monkeypatch.setenv("HYBRIDLM_FUSED", "1")
    cfg = tiny_train_model(mtp=False)
    torch.manual_seed(0)
    model = HybridLM(cfg).to(DEV)
    g = _gen(5)
    ids = torch.randint(0, cfg.vocab_size, (2, 45), generator=g).to(DEV)
    docs = None
    if packed:
        docs = torch.zeros(2, 45, dtype=torch.long)
        docs[0, 10:], docs[0, 16:], docs[1, 31:] = 1, 2, 1
        docs = docs.to(DEV)

    def run(on: bool):
        model.zero_grad(set_to_none=True)
        with fused.enabled(on):
            logits = model(ids, doc_ids=docs).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    if DEV == "cpu":  # the native CPU kernels are the other path's fast path: compare with both
        from hybridlm.ops import native

        with native.enabled(False):
            ref_loss, ref_grads = run(False)
    else:
        ref_loss, ref_grads = run(False)
    loss, grads = run(True)
    _assert_close(loss, ref_loss, 1e-5, "loss")
    mamba = [n for n in grads if "mixer" in n and n.startswith("layers.0.")]
    assert mamba, list(grads)[:10]
    for name in grads:
        _assert_close(grads[name], ref_grads[name], 1e-4, f"grad {name}")


# ---------------------------------------------------------------------------------------------
# what the kernels keep for the backward (the planner's "fused" activations)


@pytest.mark.skipif(DEV == "cuda", reason="measures the interpreted kernels on CPU tensors")
def test_plan_activations_of_the_fused_mixer_match_measured(monkeypatch):
    """`activation_bytes(kernels="fused")` against the bytes a training forward of a Mamba-2 +
    MoE model leaves for the backward with the kernels on, and the saving over the reference
    path against the measured saving, within 20% (fp32, every checkpointing mode; measured here
    within 1%)."""
    from _memory import LiveBytes
    from _tiny import tiny_train_model
    from hybridlm.model.model import build_model
    from hybridlm.ops import fused, native
    from hybridlm.train.activation_checkpointing import apply_activation_checkpointing
    from hybridlm.train.distributed.plan import activation_bytes
    from hybridlm.train.objectives import causal_lm_loss

    monkeypatch.setenv("HYBRIDLM_FUSED", "1")
    cfg = tiny_train_model(mtp=False)
    cfg.pattern = "MEM"
    cfg.validate()
    batch, seq = 2, 96
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=_gen(0))

    def measure(mode: str, on: bool) -> int:
        """`on`: the kernels; off: the pure-torch chains (a GPU's path without them: the CPU's
        native conv and norm kernels, which keep less, off too)."""
        model = build_model(cfg, seed=0, device=torch.device("cpu")).train()
        apply_activation_checkpointing(model, mode)
        with fused.enabled(on), native.enabled(on), LiveBytes() as meter:
            out = model(ids, return_logits=False, head=lambda o: causal_lm_loss(model, o, ids))
        kept = meter.alive()
        del out
        return kept

    for mode in ("none", "selective", "full"):
        got = {k: measure(mode, k == "fused") for k in ("reference", "fused")}
        want = {
            k: activation_bytes(cfg, micro_batch=batch, seq=seq, mode=mode, precision="fp32",
                                kernels=k).total
            for k in got
        }  # fmt: skip
        assert 0.8 <= want["fused"] / got["fused"] <= 1.2, (mode, want, got)
        if mode == "none":
            saved = got["reference"] - got["fused"]
            planned = want["reference"] - want["fused"]
            assert saved > 0 and 0.8 <= planned / saved <= 1.2, (want, got)


@pytest.mark.slow
@pytest.mark.skipif(DEV == "cuda", reason="the CPU smoke run; a GPU runs the real check")
def test_gpu_check_script_runs_on_cpu_at_tiny_shapes():
    """`benchmarks/gpu_check.py --tiny`: every section of the GPU check runs end to end on the
    CPU (kernels interpreted, decode slots eager), every row without an error and the
    kernels' parity within bounds, so a GPU's limited time is not lost to the script."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from test_train_parallel import _free_port

    port = _free_port()
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    env = dict(os.environ, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    res = subprocess.run(
        [sys.executable, str(script), "--tiny", "--new-tokens", "8", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert not [r for r in rows if "error" in r], rows
    parity = [r for r in rows if r.get("section") == "parity" and "max_rel_err" in r]
    assert len(parity) == 8
    for r in parity:
        bound = 1e-5 if r["dtype"] == "float32" else 2e-2  # bf16: a few roundings of 2^-9
        assert max(r["max_rel_err"].values()) < bound, r
    kernels = [r for r in rows if r.get("section") == "kernels" and "ms" in r]
    assert {r["what"].split(" forward")[0] for r in kernels} == {
        "ssd scan",
        "ssd scan, chunk 32",
        "conv1d + SiLU",
        "gated RMSNorm",
        "routed experts",
    }
    train = {r["what"]: r for r in rows if r.get("section") == "train" and "what" in r}
    assert train["dense, compile, bf16 gathers"]["tokens_per_s"] > 0
    assert train["hybrid, + FP8 linears"]["fp8"] is True
    assert "rel_diff" in train["FP8 vs bf16 loss after 2 steps"]
    decode = [r for r in rows if r.get("section") == "decode" and "seconds" not in r]
    assert [r.get("batch", r.get("what")) for r in decode] == [
        "batch-1 limit", 1, 4, "engine, 32 concurrent requests",
        "MTP speculative decoding, batch 1, 3 drafts",
    ]  # fmt: skip
    assert decode[1]["graphs_equal_eager"] and decode[2]["graphs_equal_eager"]
    assert decode[4]["greedy_identical"] and decode[3]["cuda graphs"]["tok_s"] > 0


# ---------------------------------------------------------------------------------------------
# routed experts: grouped GEMMs with relu^2 fused


@pytest.mark.parametrize("on_device", [False, True])  # counts as a list, or a device tensor
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "counts",
    [[5, 0, 17, 3, 70, 0, 1, 30], [0, 0, 9], [129]],  # empty experts, > one row tile, one expert
)
def test_experts_fused_match_the_per_expert_loop(counts, dtype, on_device):
    from hybridlm.model.moe import _experts_loop
    from hybridlm.ops.fused.experts import experts_fused

    E, W, F = len(counts), 48, 80  # W, F off the 64-wide tiles
    g = _gen(sum(counts) + E)
    z = torch.randn(sum(counts), W, generator=g)
    up = torch.randn(E, F, W, generator=g) * 0.2
    down = torch.randn(E, W, F, generator=g) * 0.2
    dy = torch.randn(sum(counts), W, generator=g)
    if dtype != torch.float32:
        z = z.to(dtype).float()

    def run(fn, zdt, wdt, device):
        leaves = [
            t.to(device=device, dtype=d).requires_grad_(True)
            for t, d in ((z, zdt), (up, wdt), (down, wdt))
        ]
        y = fn(leaves[0], counts, leaves[1], leaves[2])
        (y.double() * dy.to(device).double()).sum().backward()
        return y, [t.grad for t in leaves]

    y_r, g_r = run(_experts_loop, torch.float64, torch.float64, "cpu")
    given = torch.tensor(counts, device=DEV) if on_device else counts
    y_f, g_f = run(lambda z, _c, u, d: experts_fused(z, given, u, d), dtype, torch.float32, DEV)
    assert y_f.dtype == dtype and g_f[1].dtype == torch.float32
    rel = 2e-5 if dtype == torch.float32 else 2e-2
    _assert_close(y_f, y_r, rel, "y")
    for name, gf, gr in zip(("z", "up", "down"), g_f, g_r, strict=True):
        _assert_close(gf, gr, rel, f"d{name}")
    with pytest.raises(ValueError, match="counts add up"):
        experts_fused(z.to(DEV), [1], up.to(DEV), down.to(DEV))
    with pytest.raises(ValueError, match="one per expert"):
        experts_fused(z.to(DEV), torch.ones(E + 1, dtype=torch.long), up.to(DEV), down.to(DEV))


# ---------------------------------------------------------------------------------------------
# one decode step of the Mamba-2 mixer


@pytest.mark.parametrize(
    "case",
    [
        # heads, head_dim, groups, state, conv taps, conv bias, dt max, batch, dtype, ssm dtype
        (4, 16, 2, 16, 4, True, None, 3, torch.float32, torch.float32),
        (6, 12, 3, 24, 4, False, 0.5, 2, torch.float32, torch.float32),
        (4, 32, 1, 16, 2, True, None, 1, torch.float32, torch.float16),
        (8, 16, 2, 32, 4, True, None, 2, torch.bfloat16, torch.float32),
    ],
)
def test_mamba_decode_step_fused_matches_the_torch_step(case):
    """Several steps in a row through the kernel equal the pure-torch step: outputs and both
    states, also with the outputs written in place over the input states."""
    from hybridlm.model.mamba2 import mamba2_decode_step_torch
    from hybridlm.ops.fused.mamba_step import mamba2_decode_step_fused, mamba_step_core

    H, P, G, N, K, bias, dt_max, Bsz, dtype, sdt = case
    I, D = H * P, 40
    X = I + 2 * G * N
    g = _gen(H * P + N)
    w = dict(
        in_w=torch.randn(2 * I + 2 * G * N + H, D, generator=g) * 0.2,
        conv_w_XK=torch.randn(X, K, generator=g) * 0.5,
        conv_b_X=torch.randn(X, generator=g) if bias else None,
        dt_bias_H=torch.randn(H, generator=g) * 0.5,
        A_log_H=torch.rand(H, generator=g),
        D_H=torch.randn(H, generator=g),
        norm_w_I=torch.randn(I, generator=g),
        out_w=torch.randn(D, I, generator=g) * 0.2,
    )
    w = {k: None if v is None else v.to(dtype) for k, v in w.items()}  # a model in `dtype`
    shape = dict(heads=H, head_dim=P, groups=G, state_size=N, dt_clamp_min=1e-3,
                 dt_clamp_max=dt_max, eps=1e-5)  # fmt: skip
    xs = [torch.randn(Bsz, D, generator=g).to(dtype) for _ in range(3)]
    conv0 = torch.randn(Bsz, K - 1, X, generator=g).to(dtype)
    ssm0 = torch.randn(Bsz, H, P, N, generator=g).to(sdt)

    def dev(t):
        return None if t is None else t.to(DEV)

    ref_c, ref_s = conv0, ssm0.float()
    got_c, got_s = dev(conv0), dev(ssm0)
    for x in xs:
        want, ref_c, ref_s = mamba2_decode_step_torch(x, ref_c, ref_s, **w, **shape)
        ref_s = ref_s.to(sdt).float()  # the state as the cache keeps it
        got, got_c, got_s = mamba2_decode_step_fused(
            dev(x), got_c, got_s, **{k: dev(v) for k, v in w.items()}, **shape
        )
        rel = 2e-5 if dtype == torch.float32 else 2e-2
        _assert_close(got, want, rel, "y")
        _assert_close(got_c, ref_c, rel, "conv state")
        # fp16 state: its rounding; bf16 activations: the reference rounds x, B, C to bf16
        srel = rel if dtype != torch.float32 else (2e-5 if sdt == torch.float32 else 1e-3)
        _assert_close(got_s, ref_s, srel, "ssm state")
        assert got_s.dtype == sdt and got_c.dtype == dtype

    # in place: the states passed as outputs too
    zx = torch.nn.functional.linear(dev(xs[0]), dev(w["in_w"]))
    c_in, s_in = dev(conv0).clone(), dev(ssm0).clone()
    params = [dev(w[k]) for k in ("conv_w_XK", "conv_b_X", "dt_bias_H", "A_log_H", "D_H",
                                  "norm_w_I")]  # fmt: skip
    y1, c1, s1 = mamba_step_core(zx, dev(conv0), dev(ssm0), *params, **shape)
    y2, c2, s2 = mamba_step_core(zx, c_in, s_in, *params, **shape, out_conv=c_in, out_ssm=s_in)
    assert c2 is c_in and s2 is s_in
    assert torch.equal(y1, y2) and torch.equal(c1, c2) and torch.equal(s1, s2)


def test_greedy_decoding_through_the_fused_step_matches(monkeypatch):
    """Decoding a tiny hybrid with every Mamba-2 decode step on the kernel (and the prefill on
    the scan kernels): the logits of each step follow the pure-torch path, and greedy tokens are
    the same."""
    from _tiny import tiny_train_model
    from hybridlm import HybridLM
    from hybridlm.infer.generate import generate
    from hybridlm.model.cache import HybridCache
    from hybridlm.ops import fused, native

    monkeypatch.setenv("HYBRIDLM_FUSED", "1")
    cfg = tiny_train_model(mtp=False)
    model = HybridLM(cfg, seed=0).to(DEV).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=_gen(9)).to(DEV)
    tokens, logits = {}, {}
    for on in (True, False):
        with fused.enabled(on), native.enabled(False), torch.no_grad():
            tokens[on] = generate(model, ids, 6)
            cache = HybridCache.for_pattern(cfg.pattern)
            steps = [model(ids[:, :5], cache=cache).logits[:, -1]]
            steps += [model(ids[:, t : t + 1], cache=cache).logits[:, -1] for t in range(5, 9)]
            logits[on] = torch.stack(steps)
    _assert_close(logits[True], logits[False], 2e-5, "logits")
    assert torch.equal(tokens[True], tokens[False])
