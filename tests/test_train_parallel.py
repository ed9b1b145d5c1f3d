"""Data-parallel pretraining on CPU (DESIGN habit 8): world=2 over gloo on 127.0.0.1, each rank a
subprocess with the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT). Per-rank batch b at
world 2 must give the losses of one process with batch 2b (same global batch), under DDP and
FSDP2; a checkpoint written at world 2 resumes at world 1 like an uninterrupted world-1 run."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _tiny import tiny_run as _tiny_run
from hybridlm.train.config import RunConfig
from hybridlm.train.plot import read_metrics
from hybridlm.train.pretrain import run_pretrain

REL_TOL = 1e-5  # fp32; only the reduction order of the gradient sums differs
TIMEOUT_S = 120

WORKER = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    from hybridlm.train.config import RunConfig
    from hybridlm.train.parallel import destroy
    from hybridlm.train.pretrain import run_pretrain
    run = RunConfig.load(sys.argv[1])
    until = int(sys.argv[2]) or None
    run_pretrain(run, until_step=until, resume=sys.argv[3] == "1")
    destroy()
    """
)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_run(tmp: Path, out: str, batch_size: int, **train) -> RunConfig:
    base = dict(max_steps=3, warmup_steps=1, eval_interval=3, eval_batches=2, checkpoint_interval=0)
    return _tiny_run(tmp, out, docs=24, seq_len=64, batch_size=batch_size, **{**base, **train})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world2(tmp: Path, run: RunConfig, until_step: int = 0, resume: bool = False) -> None:
    cfg = Path(run.train.out_dir + ".yaml")
    run.save(cfg)
    script = tmp / "worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(cfg), str(until_step), str(int(resume))],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], "\n".join(f"--- rank {r}:\n{log[-3000:]}" for r, log in enumerate(logs))


def rows(out_dir) -> list[dict]:
    return [r for r in read_metrics(Path(out_dir) / "metrics.jsonl") if r["kind"] != "skip"]


def assert_same_losses(a: list[dict], b: list[dict], keys=("loss", "ce", "eval_loss")) -> float:
    """Equal steps and kinds; every loss within REL_TOL; returns the worst relative error."""
    assert [(r["kind"], r["step"]) for r in a] == [(r["kind"], r["step"]) for r in b]
    worst = 0.0
    for ra, rb in zip(a, b, strict=True):
        for k in keys:
            if k in ra:
                rel = abs(ra[k] - rb[k]) / max(abs(rb[k]), 1e-12)
                worst = max(worst, rel)
                assert rel <= REL_TOL, (ra["kind"], ra["step"], k, ra[k], rb[k])
    return worst


def _parity(tmp_path: Path, parallel: str) -> None:
    ref = tiny_run(tmp_path, "w1", batch_size=4)
    run_pretrain(ref)
    dp = tiny_run(tmp_path, f"w2_{parallel}", batch_size=2, parallel=parallel)
    run_world2(tmp_path, dp)
    a, b = rows(dp.train.out_dir), rows(ref.train.out_dir)
    assert sum(r["kind"] == "train" for r in a) == 3
    worst = assert_same_losses(a, b)
    print(f"{parallel}: worst relative loss difference {worst:.2e}")


def test_ddp_world2_matches_single_process(tmp_path):
    _parity(tmp_path, "ddp")


def test_fsdp2_world2_matches_single_process(tmp_path):
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) is not in this torch build")
    _parity(tmp_path, "fsdp")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_world2_checkpoint_resumes_at_world1(tmp_path, parallel):
    full = tiny_run(tmp_path, "full", batch_size=4, max_steps=4, eval_interval=2)
    run_pretrain(full)
    part = tiny_run(
        tmp_path,
        "part",
        batch_size=2,
        max_steps=4,
        eval_interval=2,
        checkpoint_interval=2,
        parallel=parallel,
    )
    run_world2(tmp_path, part, until_step=2)
    resumed = tiny_run(tmp_path, "part", batch_size=4, max_steps=4, eval_interval=2)
    run_pretrain(resumed, resume=True)
    worst = assert_same_losses(rows(resumed.train.out_dir), rows(full.train.out_dir))
    print(f"{parallel} world2 -> world1 resume: worst relative difference {worst:.2e}")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_world2_checkpoint_resumes_at_world2(tmp_path, parallel):
    """Kill-free restart at the same world size: the gathered checkpoint is loaded back into
    the (sharded, under FSDP) model and optimizer of every rank."""
    full = tiny_run(tmp_path, "full", batch_size=4, max_steps=4, eval_interval=2)
    run_pretrain(full)
    kw = dict(batch_size=2, max_steps=4, eval_interval=2, checkpoint_interval=2, parallel=parallel)
    part = tiny_run(tmp_path, "part", **kw)
    run_world2(tmp_path, part, until_step=2)
    run_world2(tmp_path, part, resume=True)
    worst = assert_same_losses(rows(part.train.out_dir), rows(full.train.out_dir))
    print(f"{parallel} world2 -> world2 resume: worst relative difference {worst:.2e}")


def test_torchrun_cli_pretrain_fsdp(tmp_path):
    """`torchrun --nproc_per_node=2 -m hybridlm.cli pretrain` end to end (sample + HF export
    from the unsharded model every rank holds after an FSDP run)."""
    run = tiny_run(tmp_path, "cli", batch_size=2, parallel="fsdp")
    cfg = tmp_path / "cli.yaml"
    run.save(cfg)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        "-m",
        "hybridlm.cli",
        "pretrain",
        "--config",
        str(cfg),
        "--sample-tokens",
        "4",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    out = Path(run.train.out_dir)
    assert sum(r["kind"] == "train" for r in rows(out)) == 3
    assert (out / "checkpoints" / "step_00000003" / "model.safetensors").is_file()
    assert (out / "hf" / "model.safetensors").is_file()
