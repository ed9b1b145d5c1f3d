"""Fused LM-head + CE == logits then F.cross_entropy (loss and both gradients)."""

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from hybridlm.presets import get_preset
from hybridlm.train.objectives import causal_lm_loss


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
    depth = model.train_mtp_depth
    a_loss, a = causal_lm_loss(model, model(x, mtp_depth=depth), x)
    out_b = model(x, mtp_depth=depth, return_logits=False)
    assert out_b.logits is None and not out_b.mtp_logits
    b_loss, b = causal_lm_loss(model, out_b, x)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    ga = torch.autograd.grad(a_loss, list(model.parameters()))
    gb = torch.autograd.grad(b_loss, list(model.parameters()))
    for x1, x2 in zip(ga, gb, strict=True):
        torch.testing.assert_close(x1, x2, rtol=1e-4, atol=1e-6)
