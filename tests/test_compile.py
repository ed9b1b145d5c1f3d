"""Regional compile for training (`train.compile`, `train/compile.py`): the compiled model's
loss and gradients equal the eager model's, and later steps, whose MoE routing differs, do not
recompile."""

from __future__ import annotations

import pytest

from _tiny import tiny_train_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "backend",
    # aot_eager: dynamo's capture, graph breaks and guards and AOT autograd, no code generation
    # (seconds); inductor: the kernels a training run compiles (40 s on 2 cores)
    ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)],
)
def test_regional_compile_matches_eager_and_does_not_recompile(backend):
    import torch._dynamo

    from hybridlm import HybridLM
    from hybridlm.train.compile import apply_compile
    from hybridlm.train.objectives import causal_lm_loss

    cfg = tiny_train_model()
    eager = HybridLM(cfg, seed=0)
    compiled = HybridLM(cfg, seed=0)
    names = apply_compile(compiled, backend)
    assert "layers.0.mixer" in names and "layers.2.mixer" in names  # Mamba-2, attention
    assert "layers.1.mixer.gate" in names and "layers.1.mixer.experts" not in names
    assert any(n.startswith("mtp.") for n in names)

    def step(model, seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=g)
        model.zero_grad(set_to_none=True)
        loss = causal_lm_loss(model, model(ids, mtp_depth=model.train_mtp_depth), ids)[0]
        loss.backward()
        return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        want, want_g = step(eager, 0)
        got, got_g = step(compiled, 0)
        assert abs(got - want) <= 1e-5 * abs(want)
        for n, g in want_g.items():
            torch.testing.assert_close(got_g[n], g, rtol=1e-4, atol=1e-6, msg=n)
        frames = counters["frames"]["total"]  # every frame compiled, recompiles included
        assert frames > 0
        for seed in (1, 2):  # other tokens, other expert counts: the same graphs
            want, _ = step(eager, seed)
            got, _ = step(compiled, seed)
            assert abs(got - want) <= 1e-5 * abs(want)
        assert counters["frames"]["total"] == frames  # nothing recompiled
    finally:
        torch._dynamo.reset()
