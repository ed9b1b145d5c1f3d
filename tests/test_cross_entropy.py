"""Fused LM-head + CE == logits then F.cross_entropy (loss and both gradients)."""

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from hybridlm.presets import get_preset


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_fused_equals_reference(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(50, 16, generator=g, dtype=torch.float64)
    W = torch.randn(33, 16, generator=g, dtype=torch.float64)
    t = torch.randint(0, 33, (50,), generator=g)
    t[::7] = -100
    grads = []
    for fn in (linear_cross_entropy_ref, lambda *a: linear_cross_entropy(*a, chunk=chunk)):
        hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
        loss = fn(hh, WW, t, 41)
        (2.5 * loss).backward()
        grads.append((loss.detach(), hh.grad, WW.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_model_fused_loss_equals_logits_loss():
    cfg = get_preset("tiny-super")
    cfg.vocab_size = 300
    model = HybridLM(cfg, seed=0)
    x = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(1))
    a = model(x, labels=x)
    b = model(x, labels=x, return_logits=False)
    assert b.logits is None and not b.mtp_logits
    for k in a.losses:
        torch.testing.assert_close(a.losses[k], b.losses[k], rtol=1e-5, atol=1e-6)
    ga = torch.autograd.grad(a.loss, list(model.parameters()))
    gb = torch.autograd.grad(b.loss, list(model.parameters()))
    for x1, x2 in zip(ga, gb, strict=True):
        torch.testing.assert_close(x1, x2, rtol=1e-4, atol=1e-6)
