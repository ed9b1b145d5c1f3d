"""SSD chunked scan == token-by-token recurrence == decode steps; causal conv fast == reference."""

import pytest
import torch

from hybridlm.ops.conv1d import causal_conv1d, causal_conv1d_ref
from hybridlm.ops.ssd import ssd_chunked, ssd_recurrent, ssd_states, ssd_step


def _inputs(L, dtype, B=2, H=6, P=5, G=3, N=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, H, P, generator=g, dtype=dtype)
    dt = torch.nn.functional.softplus(torch.randn(B, L, H, generator=g, dtype=dtype) - 1)
    A = -torch.rand(H, generator=g, dtype=dtype) * 4 - 0.1
    Bm = torch.randn(B, L, G, N, generator=g, dtype=dtype)
    Cm = torch.randn(B, L, G, N, generator=g, dtype=dtype)
    D = torch.randn(H, generator=g, dtype=dtype)
    h0 = torch.randn(B, H, P, N, generator=g, dtype=dtype)
    return x, dt, A, Bm, Cm, D, h0


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize(
    "L,chunk", [(1, 4), (7, 4), (16, 4), (33, 8), (50, 16), (64, 64), (45, 128)]
)
@pytest.mark.parametrize("with_init", [False, True])
def test_chunked_equals_recurrence(dtype, tol, L, chunk, with_init):
    x, dt, A, Bm, Cm, D, h0 = _inputs(L, dtype)
    init = h0 if with_init else None
    y_ref, s_ref = ssd_recurrent(x, dt, A, Bm, Cm, D, init)
    y, s = ssd_chunked(x, dt, A, Bm, Cm, D, chunk, init)
    scale = y_ref.abs().max().clamp(min=1)
    assert (y - y_ref).abs().max() / scale < tol
    assert (s - s_ref).abs().max() / s_ref.abs().max().clamp(min=1) < tol


def test_prefill_then_decode_steps_equal_full_scan():
    x, dt, A, Bm, Cm, D, _ = _inputs(40, torch.float64)
    y_full, s_full = ssd_chunked(x, dt, A, Bm, Cm, D, 16)
    y_pre, state = ssd_chunked(x[:, :29], dt[:, :29], A, Bm[:, :29], Cm[:, :29], D, 16)
    ys = [y_pre]
    for t in range(29, 40):
        y_t, state = ssd_step(state, x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], D)
        ys.append(y_t[:, None])
    torch.testing.assert_close(torch.cat(ys, 1), y_full, rtol=0, atol=1e-10)
    torch.testing.assert_close(state, s_full, rtol=0, atol=1e-10)


def test_chunked_gradients_match_recurrence():
    x, dt, A, Bm, Cm, D, h0 = _inputs(19, torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, dt, A, Bm, Cm, D, h0)]
    grads = []
    for fn in (lambda *a: ssd_chunked(*a[:6], 8, a[6]), lambda *a: ssd_recurrent(*a)):
        for t in leaves:
            t.grad = None
        y, s = fn(*leaves)
        (y.sin().sum() + s.cos().sum()).backward()
        grads.append([t.grad.clone() for t in leaves])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("K,L", [(4, 1), (4, 9), (2, 5), (1, 3)])
def test_causal_conv_fast_equals_reference(K, L):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, L, 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, K, generator=g, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64)
    state = torch.randn(2, K - 1, 6, generator=g, dtype=torch.float64)
    for st in (None, state):
        y, s = causal_conv1d(x, w, b, st)
        y_ref, s_ref = causal_conv1d_ref(x, w, b, st)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    # the hand-written backward against autograd through F.conv1d
    leaves = [t.clone().requires_grad_() for t in (x, w, b, state)]
    grads = []
    for fn in (causal_conv1d, causal_conv1d_ref):
        y, s = fn(*leaves)
        g_out = torch.autograd.grad((y.sin().sum() + s.cos().sum()), leaves)
        grads.append(g_out)
    for a, r in zip(*grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_conv_streaming_equals_full():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 12, 4, generator=g, dtype=torch.float64)
    w = torch.randn(4, 4, generator=g, dtype=torch.float64)
    y_full, _ = causal_conv1d(x, w, None)
    y_a, st = causal_conv1d(x[:, :5], w, None)
    outs = [y_a]
    for t in range(5, 12):
        y_t, st = causal_conv1d(x[:, t : t + 1], w, None, st)
        outs.append(y_t)
    torch.testing.assert_close(torch.cat(outs, 1), y_full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("with_state", [False, True])
def test_ssd_states_closed_form_equals_recurrence(with_state):
    """Per-position states of a short segment (speculative verification) == the recurrence."""
    g = torch.Generator().manual_seed(0)
    B, L, H, P, G, N = 2, 5, 4, 8, 2, 16

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x, Bm, Cm, D = r(B, L, H, P), r(B, L, G, N), r(B, L, G, N), r(H)
    s0 = r(B, H, P, N) if with_state else None
    dt = torch.rand(B, L, H, generator=g, dtype=torch.float64)
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 3
    y, states = ssd_states(x, dt, A, Bm, Cm, D, s0)
    y_ref, states_ref = ssd_recurrent(x, dt, A, Bm, Cm, D, s0, return_states=True)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(states, states_ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("L", [1, 7])
def test_conv_inference_path_equals_reference(L):
    """Under no_grad the tap sum runs without the autograd function (decode, verification)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, L, 10, generator=g, dtype=torch.float64)
    w, b = (
        torch.randn(10, 4, generator=g, dtype=torch.float64),
        torch.randn(10, dtype=torch.float64),
    )
    state = torch.randn(2, 3, 10, generator=g, dtype=torch.float64)
    with torch.no_grad():
        y, s = causal_conv1d(x, w, b, state)
    y_ref, s_ref = causal_conv1d_ref(x, w, b, state)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
