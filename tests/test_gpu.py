"""CUDA fast paths against their CPU references (run with `pytest -m gpu` on a GPU machine)."""

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.model.moe import _experts_grouped, _experts_loop
from hybridlm.presets import get_preset
from hybridlm.train.objectives import causal_lm_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_grouped_mm_forward_backward_equals_loop(dtype, tol):
    g = torch.Generator().manual_seed(0)
    counts = [5, 0, 17, 3, 8, 0, 1, 30]
    z = torch.randn(sum(counts), 64, generator=g).cuda().to(dtype)
    up = (torch.randn(8, 96, 64, generator=g) * 0.1).cuda().to(dtype)
    down = (torch.randn(8, 64, 96, generator=g) * 0.1).cuda().to(dtype)
    outs = []
    for fn in (_experts_grouped, _experts_loop):
        leaves = [t.clone().requires_grad_() for t in (z, up, down)]
        y = fn(leaves[0], counts, leaves[1], leaves[2])
        y.float().square().sum().backward()
        outs.append([y] + [t.grad for t in leaves])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_model_on_cuda_equals_cpu():
    cfg = get_preset("tiny-super")
    model = HybridLM(cfg, seed=0).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        depth = model.train_mtp_depth
        ref = causal_lm_loss(model, model(x, mtp_depth=depth), x)[0]
        out = causal_lm_loss(model, model.cuda()(x.cuda(), mtp_depth=depth), x.cuda())[0]
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_grouped_mm_experts_under_bf16_autocast():
    """bf16 training: grouped_mm is not on autocast's lists, so the experts cast their fp32
    master weights (and relu^2's fp32 output) to the activations' dtype themselves."""
    cfg = get_preset("tiny-super")
    model = HybridLM(cfg, seed=0).cuda().train()
    x = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x, return_logits=False)
        loss = causal_lm_loss(model, out, x)[0]
    loss.backward()
    assert torch.isfinite(loss) and model.layers[1].mixer.experts.up_proj.grad is not None
