"""Activation checkpointing per block: same loss, gradients and MoE routing counts as without
it (the recomputation has no side effects), and fewer bytes kept for the backward."""

import pytest
import torch

from _memory import LiveBytes
from _tiny import tiny_train_model
from hybridlm.model.model import build_model
from hybridlm.train.activation_checkpointing import apply_activation_checkpointing

pytestmark = pytest.mark.usefixtures("one_thread")


def _step(mode: str, ids: torch.Tensor):
    cfg = tiny_train_model()
    model = build_model(cfg, seed=0, device=torch.device("cpu")).train()
    assert apply_activation_checkpointing(model, mode) == (0 if mode == "none" else 5)
    with LiveBytes() as meter:
        out = model(ids, mtp_depth=cfg.mtp.depth, return_logits=False)
        loss = sum(h.square().mean() for h in [out.hidden, *out.mtp_hidden])
        loss = loss + out.aux["moe_aux"]
    kept = meter.alive()  # what the forward left for the backward
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    loads = [m.load_E.clone() for m in model.modules() if hasattr(m, "load_E")]
    return float(loss), grads, loads, kept


def test_checkpointing_is_exact_and_keeps_less():
    ids = torch.randint(0, 258, (2, 48), generator=torch.Generator().manual_seed(0))
    ref = _step("none", ids)
    kept = {"none": ref[3]}
    for mode in ("selective", "full"):
        loss, grads, loads, kept[mode] = _step(mode, ids)
        assert loss == ref[0]
        assert grads.keys() == ref[1].keys()
        for k in grads:
            torch.testing.assert_close(grads[k], ref[1][k], rtol=0, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(loads, ref[2], strict=True))
    # `full` keeps each block's input (plus the checkpoint's bookkeeping), `selective` the
    # matrix products' outputs too
    print("bytes kept for the backward:", kept)
    assert kept["full"] < kept["selective"] < kept["none"], kept


def test_unknown_mode_is_a_clear_error():
    model = build_model(tiny_train_model(), seed=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="activation_checkpointing must be one of"):
        apply_activation_checkpointing(model, "some")


def test_parallel_gpu_benchmark_smoke_run(tmp_path):
    """benchmarks/parallel_gpu.py (FSDP2 on a one-rank group, every checkpointing mode) runs on
    the CPU at the tests' shape; the modes train to the same loss."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_train_parallel import _free_port

    port = _free_port()
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "parallel_gpu.py"
    env = dict(os.environ, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    res = subprocess.run(
        [sys.executable, str(script), "--tiny", "--steps", "2", "--warmup", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    modes = {r["activation_checkpointing"]: r for r in lines[1:]}
    assert set(modes) == {"none", "selective", "full"}
    assert all(r["tokens_per_s"] > 0 for r in modes.values())
    assert len({tuple(r["losses"]) for r in modes.values()}) == 1
