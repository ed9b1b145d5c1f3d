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


def test_training_step_on_the_fused_path_follows_the_torch_path():
    """A tiny hybrid's training step on CUDA with the Triton kernels and regional compile
    (bf16 autocast, as `train.precision: bf16`) against the same step on the pure-torch
    chains: loss within bf16 rounding, every gradient close in norm."""
    from hybridlm.ops import fused
    from hybridlm.train.compile import apply_compile

    cfg = get_preset("tiny-super")
    x = torch.randint(0, cfg.vocab_size, (2, 300), generator=torch.Generator().manual_seed(0))
    x = x.cuda()
    runs = {}
    for name, on in (("torch", False), ("fused", True)):
        model = HybridLM(cfg, seed=0).cuda()
        if on:
            apply_compile(model)
        with fused.enabled(on), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = causal_lm_loss(model, model(x, mtp_depth=model.train_mtp_depth), x)[0]
        with fused.enabled(on):
            loss.backward()
        runs[name] = (float(loss), {n: p.grad.float() for n, p in model.named_parameters()})
    (lt, gt), (lf, gf) = runs["torch"], runs["fused"]
    assert abs(lf - lt) <= 2e-2 * abs(lt), (lf, lt)
    for n, g in gt.items():
        rel = float((gf[n] - g).norm() / g.norm().clamp(min=1e-12))
        assert rel < 5e-2, (n, rel)


def test_greedy_decoding_with_the_fused_step_on_cuda():
    """fp32 greedy decoding on CUDA with the Mamba-2 step kernel equals the torch step's."""
    from hybridlm.infer.generate import generate
    from hybridlm.ops import fused

    cfg = get_preset("tiny-super")
    model = HybridLM(cfg, seed=0).cuda().eval()
    x = torch.randint(0, cfg.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    out = {}
    for on in (True, False):
        with fused.enabled(on):
            out[on] = generate(model, x.cuda(), 16)
    assert torch.equal(out[True], out[False])


def test_pretraining_on_cuda_with_compile_bf16_and_fp8(tmp_path):
    """The trainer on CUDA with every GPU option at once (`train.compile`, bf16, FP8 linears):
    the run finishes and its loss falls like the plain fp32 run's."""
    pytest.importorskip("torchao.float8")
    from pathlib import Path

    from _tiny import tiny_run
    from hybridlm.report.plot import read_metrics
    from hybridlm.train.stages.pretrain import run_pretrain

    curves = {}
    for name, train in (
        ("fp32", {}),
        ("fast", {"compile": True, "precision": "bf16", "low_precision": "fp8"}),
    ):
        run = tiny_run(tmp_path, name, max_steps=12, eval_interval=0, checkpoint_interval=0,
                       device="cuda", **train)  # fmt: skip
        out = run_pretrain(run)
        rows = read_metrics(Path(out["metrics"]))
        curves[name] = [r["loss"] for r in rows if r["kind"] == "train"]
    assert curves["fast"][-1] < curves["fast"][0] - 0.3, curves
    assert abs(curves["fast"][-1] - curves["fp32"][-1]) <= 0.05 * curves["fp32"][-1], curves


def test_fsdp2_bf16_gathers_on_cuda_follow_autocast():
    """One rank of NCCL: FSDP2 with bf16 parameter gathers (routers fp32) and the Triton
    kernels gives the loss and gradients of plain bf16 autocast on the same model."""
    import copy

    import torch.distributed as dist

    from hybridlm.train.distributed.parallel import apply_fsdp2
    from test_train_parallel import _free_port

    port = _free_port()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        cfg = get_preset("tiny-super")
        ref = HybridLM(cfg, seed=0).cuda()
        model = apply_fsdp2(copy.deepcopy(ref), param_dtype=torch.bfloat16)
        x = torch.randint(0, cfg.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
        x = x.cuda()
        losses = []
        for m in (ref, model):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = causal_lm_loss(m, m(x, mtp_depth=m.train_mtp_depth), x)[0]
            loss.backward()
            losses.append(float(loss.detach()))
        assert abs(losses[1] - losses[0]) <= 2e-2 * losses[0], losses
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            g, want = p.grad.full_tensor().float(), q.grad.float()
            assert float((g - want).norm() / want.norm().clamp(min=1e-12)) < 5e-2, name
    finally:
        dist.destroy_process_group()


def test_cuda_graph_decoding_equals_eager_slots_and_the_growing_cache():
    """Captured decode steps (`infer.graphs`) replay what the eager slot steps compute: greedy
    `generate` and an engine with speculative rows (verify and rewind graphs) give the same
    tokens with and without capture, in fp32 (argmax margins far above rounding)."""
    from hybridlm.data.tokenizer import ByteTokenizer
    from hybridlm.infer.engine import Engine
    from hybridlm.infer.generate import generate
    from hybridlm.infer.sampling import SamplingParams

    cfg = get_preset("tiny-super")
    model = HybridLM(cfg, seed=0).cuda().eval()
    ids = torch.randint(0, 256, (3, 12), device="cuda")
    want = generate(model, ids, 24, cuda_graphs=False)
    assert torch.equal(generate(model, ids, 24), want)  # captured by default on CUDA
    prompts = [ids[i, : 4 + 3 * i].tolist() for i in range(3)]
    params = [SamplingParams(max_tokens=20, speculative=k) for k in (0, 3, 2)]
    outs = {}
    for graphs in (False, True):
        eng = Engine(model, ByteTokenizer(), max_batch_size=4, cuda_graphs=graphs)
        outs[graphs] = [o.token_ids for o in eng.generate(prompts, params)]
        if graphs:
            assert eng._graphs.capture and eng._graphs.stats["replayed"] > 0
            assert eng.stats["verify_steps"] > 0
    assert outs[True] == outs[False]
