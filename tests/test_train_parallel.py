"""Data-parallel training on CPU (DESIGN habit 8): world=2 over gloo on 127.0.0.1, each rank a
subprocess with the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT). Per-rank batch b at
world 2 must give the losses, gradient norms and final weights of one process with batch 2b (same
global batch), under DDP and FSDP2, for pretraining and for the post-training stages on the same
Trainer (SFT, DPO, distillation, GRPO, MTP boosting); a checkpoint written at world 2 resumes at
world 1 like an uninterrupted world-1 run. The workers install a deliberately broken collective
when asked (tests/_broken.py), to show that these comparisons fail then."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from _tiny import tiny_run as _tiny_run
from hybridlm.io import load_model
from hybridlm.report.plot import read_metrics
from hybridlm.train.config import RunConfig
from hybridlm.train.stages.pretrain import run_pretrain

REL_TOL = 1e-5  # fp32; only the reduction order of the gradient sums differs
# Weights at the end of a run, per tensor in norm (|a - b| / |b|; buffers such as the router's
# bias included): AdamW turns a gradient's last-bit differences (another summation order) into
# update differences of up to lr on elements whose gradient is ~0, so the weights differ more
# than the losses. Measured after 3 steps at world 2: tiny-super <= 5.6e-7 under DDP, FSDP2,
# EP 2, CP 2 and TP 2; tiny-olmo 1.1e-5 (q_proj, CP 2) and 2.3e-5 (the last SwiGLU up_proj,
# TP 2). A broken collective (tests/_broken.py) moves some tensor by 0.1 to 0.7, including
# breaks the losses miss (EP's all-to-all with two chunks swapped: losses within 2.1e-7).
WEIGHT_TOL = 3e-5
# what the parity tests compare per logged row: grad_norm catches a wrong gradient that the
# next losses show only weakly (measured <= 2.2e-7 relative across the world-2 layouts)
PRETRAIN_KEYS = ("loss", "ce", "eval_loss", "grad_norm")
TIMEOUT_S = 120

WORKER = textwrap.dedent(
    """
    import os, sys, torch
    torch.set_num_threads(1)
    if os.environ.get("HYBRIDLM_TEST_BREAK_COLLECTIVE"):  # a deliberate break, tests/_broken.py
        sys.path.insert(0, sys.argv[5])
        import _broken
        _broken.install_from_env()
    from hybridlm.train.distributed.parallel import destroy
    stage = sys.argv[4]
    if stage == "pretrain":
        from hybridlm.train.config import RunConfig as Config
        from hybridlm.train.stages.pretrain import run_pretrain as run
    elif stage == "sft":
        from hybridlm.train.stages.sft import SFTRunConfig as Config, run_sft as run
    elif stage == "dpo":
        from hybridlm.train.stages.dpo import DPORunConfig as Config, run_dpo as run
    elif stage == "rl":
        sys.path.insert(0, sys.argv[5])
        from _tiny import lowercase_first_env
        from hybridlm.rl.environments import MixtureEnvironment
        from hybridlm.rl.learner import RLRunConfig as Config, run_rl

        def run(cfg, **kw):
            env = MixtureEnvironment([lowercase_first_env()])
            held = MixtureEnvironment([lowercase_first_env(name="held")])
            return run_rl(cfg, env=env, eval_env=held, progress=False, **kw)
    elif stage == "mtp_boost":
        from hybridlm.rl.env_config import environment_prompts
        from hybridlm.train.mtp_boost import MTPBoostRunConfig as Config, boost_checkpoint

        def run(cfg, until_step=None, resume=False):
            boost_checkpoint(
                cfg, progress=False, resume=resume, environment_prompts=environment_prompts
            )
    else:
        from hybridlm.train.stages.distill import DistillRunConfig as Config, run_distill as run
    cfg = Config.load(sys.argv[1])
    until = int(sys.argv[2]) or None
    run(cfg, until_step=until, resume=sys.argv[3] == "1")
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


def torchrun_cmd(*args: str) -> list[str]:
    """`torchrun --nproc_per_node=2 ARGS` on this machine's loopback, at a free port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        *args,
    ]


def run_world2(
    tmp: Path,
    run: Any,
    until_step: int = 0,
    resume: bool = False,
    stage: str = "pretrain",
    world: int = 2,
) -> None:
    """Run `run` as `world` torchrun-style processes over gloo (2 unless given)."""
    out_dir = run.train.out_dir
    cfg = Path(out_dir + ".yaml")
    run.save(cfg)
    args = [str(cfg), str(until_step), str(int(resume)), stage, str(Path(__file__).parent)]
    launch(tmp, WORKER, args, world=world)


def launch(tmp: Path, source: str, args: list[str], world: int = 2) -> list[str]:
    """Run the script `source` with `args` as `world` torchrun-style processes over gloo on
    127.0.0.1; fails with every rank's log tail unless all exit 0; returns their logs."""
    script = tmp / "worker.py"
    script.write_text(source)
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
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
    assert codes == [0] * world, "\n".join(
        f"--- rank {r}:\n{log[-3000:]}" for r, log in enumerate(logs)
    )
    return logs


def rows(out_dir) -> list[dict]:
    return [r for r in read_metrics(Path(out_dir) / "metrics.jsonl") if r["kind"] != "skip"]


def assert_same_losses(
    a: list[dict],
    b: list[dict],
    keys=("loss", "ce", "eval_loss"),
    *,
    rel_tol: float = REL_TOL,
    floors: dict[str, float] | None = None,
) -> float:
    """Equal steps and kinds; every value of `keys` within `rel_tol` relatively, or within its
    absolute floor (`floors[key]`, 0 by default: only for values that are differences of O(1)
    terms, ~0 in exact arithmetic); returns the worst relative error outside the floors."""
    assert [(r["kind"], r["step"]) for r in a] == [(r["kind"], r["step"]) for r in b]
    floors = floors or {}
    worst = 0.0
    for ra, rb in zip(a, b, strict=True):
        for k in keys:
            if isinstance(ra.get(k), (int, float)):  # the data row's `loss` names the kind
                diff, floor = abs(ra[k] - rb[k]), floors.get(k, 0.0)
                rel = diff / max(abs(rb[k]), 1e-12)
                worst = max(worst, rel if diff > floor else 0.0)
                assert rel <= rel_tol or diff <= floor, (ra["kind"], ra["step"], k, ra[k], rb[k])
    return worst


def assert_same_weights(a_dir: str | Path, b_dir: str | Path, rel_tol: float = WEIGHT_TOL) -> float:
    """Every tensor of the two runs' final checkpoints (the unsharded model, whatever the
    layout that wrote it) within `rel_tol` in norm; returns the worst."""
    a, b = load_model(a_dir).state_dict(), load_model(b_dir).state_dict()
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        scale = float(torch.linalg.vector_norm(b[k].double())) or 1.0
        err = float(torch.linalg.vector_norm((a[k] - b[k]).double())) / scale
        assert err <= rel_tol, f"weights: {k} differs by {err:.2e} in norm (tolerance {rel_tol})"
        worst = max(worst, err)
    return worst


def _parity(tmp_path: Path, parallel: str) -> None:
    ref = tiny_run(tmp_path, "w1", batch_size=4)
    run_pretrain(ref)
    dp = tiny_run(tmp_path, f"w2_{parallel}", batch_size=2, parallel=parallel)
    run_world2(tmp_path, dp)
    a, b = rows(dp.train.out_dir), rows(ref.train.out_dir)
    assert sum(r["kind"] == "train" for r in a) == 3
    worst = assert_same_losses(a, b, PRETRAIN_KEYS)
    weights = assert_same_weights(dp.train.out_dir, ref.train.out_dir)
    print(f"{parallel}: worst relative loss difference {worst:.2e}, weights {weights:.2e}")


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
    worst = assert_same_losses(rows(resumed.train.out_dir), rows(full.train.out_dir), PRETRAIN_KEYS)
    weights = assert_same_weights(resumed.train.out_dir, full.train.out_dir)
    print(
        f"{parallel} world2 -> world1 resume: worst relative difference {worst:.2e}, {weights:.2e}"
    )


# FSDP2 world 2 -> world 2 also in tests/test_train_dcp.py (sharded checkpoints)
@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_world2_checkpoint_resumes_at_world2(tmp_path, parallel):
    """Kill-free restart at the same world size: the gathered checkpoint is loaded back into
    the (sharded, under FSDP) model and optimizer of every rank."""
    full = tiny_run(tmp_path, "full", batch_size=4, max_steps=4, eval_interval=2)
    run_pretrain(full)
    kw = dict(batch_size=2, max_steps=4, eval_interval=2, checkpoint_interval=2, parallel=parallel)
    part = tiny_run(tmp_path, "part", **kw)
    run_world2(tmp_path, part, until_step=2)
    run_world2(tmp_path, part, resume=True)
    worst = assert_same_losses(rows(part.train.out_dir), rows(full.train.out_dir), PRETRAIN_KEYS)
    weights = assert_same_weights(part.train.out_dir, full.train.out_dir)
    print(
        f"{parallel} world2 -> world2 resume: worst relative difference {worst:.2e}, {weights:.2e}"
    )


def test_torchrun_cli_pretrain_fsdp(tmp_path):
    """`torchrun --nproc_per_node=2 -m hybridlm.cli pretrain` end to end (sample + HF export
    from the unsharded model every rank holds after an FSDP run)."""
    run = tiny_run(tmp_path, "cli", batch_size=2, parallel="fsdp")
    cfg = tmp_path / "cli.yaml"
    run.save(cfg)
    cmd = torchrun_cmd(
        "-m", "hybridlm.cli", "pretrain", "--config", str(cfg), "--sample-tokens", "4"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    out = Path(run.train.out_dir)
    assert sum(r["kind"] == "train" for r in rows(out)) == 3
    # FSDP2 shards: each rank wrote its own shards ("auto" checkpoint format, train.distributed.dcp)
    assert (out / "checkpoints" / "step_00000003" / "__1_0.distcp").is_file()
    assert (out / "hf" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------- post-training
# FSDP2 variants of the post-training stages run with the slow tests (the default suite keeps
# DDP for each stage; the Trainer's FSDP2 path is the pretraining one, tested above)
FSDP_SLOW = pytest.param("fsdp", marks=pytest.mark.slow)


def _sft_run(tmp: Path, out: str, batch_size: int, parallel: str = "ddp"):
    from test_sft import tiny_sft

    cfg = tiny_sft(tmp / out, steps=3)
    cfg.data.batch_size = batch_size
    cfg.train.parallel = parallel
    cfg.train.checkpoint_interval = 0
    return cfg


def _dpo_run(tmp: Path, out: str, batch_size: int, parallel: str = "ddp"):
    from test_dpo import _dpo_run as dpo_run

    cfg = dpo_run(tmp, out, steps=3, batch_size=batch_size)
    cfg.train.parallel = parallel
    return cfg


def _distill_run(tmp: Path, out: str, batch_size: int, parallel: str = "ddp"):
    from _tiny import tiny_train_model
    from test_distill import offline_run, save_teacher

    teacher = tmp / "teacher"
    if not teacher.exists():
        save_teacher(tmp, "teacher", tiny_train_model(mtp=False), seed=4, sharpen=3.0)
    cfg = offline_run(tmp, str(teacher / "checkpoints" / "step_00000001"), steps=3)
    cfg.train.out_dir = str(tmp / out)
    cfg.data.batch_size = batch_size
    cfg.train.parallel = parallel
    return cfg


def _on_policy_run(tmp: Path, out: str, batch_size: int, parallel: str = "ddp"):
    from _tiny import tiny_train_model
    from test_distill import on_policy_run, save_teacher

    teacher = tmp / "teacher_op"
    if not teacher.exists():
        save_teacher(tmp, "teacher_op", tiny_train_model(mtp=False), seed=4)
    path = str(teacher / "checkpoints" / "step_00000001")
    cfg = on_policy_run(tmp, {"t": path}, {"add": "t", "more": "t"}, steps=3)
    cfg.train.out_dir = str(tmp / out)
    cfg.train.parallel = parallel
    return cfg  # rank 0 samples the step's prompts_per_step completions; batch_size is unused


POST_TRAINING = {
    "sft": (_sft_run, "run_sft", ("loss", "ce", "nll_token", "mtp", "eval_loss")),
    "dpo": (_dpo_run, "run_dpo", ("loss", "reward_accuracy", "reward_margin", "eval_loss")),
    "distill": (_distill_run, "run_distill", ("loss", "kl", "ce", "eval_loss", "eval_kl")),
    "on_policy": (_on_policy_run, "run_distill", ("loss", "kl/t", "tokens/t")),
}


@pytest.mark.parametrize("parallel", ["ddp", FSDP_SLOW])
@pytest.mark.parametrize("stage", sorted(POST_TRAINING))
def test_post_training_world2_matches_single_process(tmp_path, stage, parallel):
    """The Trainer's data parallelism for every post-training stage: each rank trains on its rows
    of the global batch (Runtime.shard), the loss normalised by global counts."""
    import importlib

    make, fn, keys = POST_TRAINING[stage]
    module = importlib.import_module(f"hybridlm.train.stages.{fn.removeprefix('run_')}")
    ref = make(tmp_path, "w1", 4)
    getattr(module, fn)(ref)
    dp = make(tmp_path, f"w2_{parallel}", 2, parallel)
    run_world2(tmp_path, dp, stage=fn.removeprefix("run_"))
    a, b = rows(dp.train.out_dir), rows(ref.train.out_dir)
    assert sum(r["kind"] == "train" for r in a) == 3
    worst = assert_same_losses(a, b, (*keys, "grad_norm"))
    weights = assert_same_weights(dp.train.out_dir, ref.train.out_dir)
    print(f"{stage} {parallel}: worst relative loss difference {worst:.2e}, weights {weights:.2e}")


@pytest.mark.parametrize("parallel", ["ddp", FSDP_SLOW])
def test_grpo_world2_matches_single_process(tmp_path, parallel):
    """GRPO's learner under DDP / FSDP2: rank 0 runs the (inline) rollouts and sends each batch
    to every rank, each trains on its half of the completions; rewards and losses equal one
    process's."""
    from hybridlm.rl.learner import run_rl
    from test_rl_learner import _cfg, _envs

    ref = _cfg(tmp_path, steps=3, eval_interval=3, eval_problems=8)
    ref.train.out_dir = str(tmp_path / "w1")
    env, held = _envs()
    run_rl(ref, env=env, eval_env=held, progress=False)
    dp = _cfg(tmp_path, steps=3, eval_interval=3, eval_problems=8, parallel=parallel)
    dp.train.out_dir = str(tmp_path / "w2")
    run_world2(tmp_path, dp, stage="rl")
    a, b = rows(dp.train.out_dir), rows(ref.train.out_dir)
    # Relative 2e-6 (measured under DDP and FSDP2: <= 4.4e-7, grad_norm 1e-7), so that a 1e-5
    # relative change fails. Two values are small differences of O(1) fp32 terms, which the other
    # reduction order moves by an absolute amount; they get a floor of a few ulps of those terms:
    # - loss, a token mean of A·ratio with centred advantages, ~1e-3: each rank's part can be
    #   up to ~adv_abs_mean / 2 = 0.18 (half the tokens), so the all-reduce moves the total by
    #   ulps of 0.18 (1.5e-8): 1.6e-8 at step 3, 1.6e-5 of that loss. Floor 5e-8: a 1e-5
    #   relative change of the losses still fails (8.5e-8 at step 2), and grad_norm holds the
    #   update itself to 2e-6;
    # - logprob_diff_mean, trainer vs engine log-probs of the same tokens: 0 in exact arithmetic
    #   at step 1 (6.8e-8 there, rounding of O(1) log-probs); floor 1e-7.
    keys = (
        "loss",
        "grad_norm",
        "logprob_diff_mean",
        "tis_weight_mean",
        "adv_abs_mean",
        "reward_mean",
        "all/solved",
    )
    floors = {"loss": 5e-8, "logprob_diff_mean": 1e-7}
    worst = assert_same_losses(a, b, keys, rel_tol=2e-6, floors=floors)
    weights = assert_same_weights(dp.train.out_dir, ref.train.out_dir)
    print(f"grpo {parallel}: worst relative difference {worst:.2e}, weights {weights:.2e}")


@pytest.mark.parametrize("parallel", ["ddp", FSDP_SLOW])
def test_mtp_boost_world2_matches_single_process(tmp_path, parallel):
    """MTP boosting under DDP / FSDP2: rank 0 generates the sequences, each rank trains the head
    on its half of every batch (the mixing draws and target counts of the whole batch)."""
    from _tiny import boost_run, tiny_train_model
    from hybridlm import HybridLM
    from hybridlm.interop.hf import save_pretrained
    from hybridlm.rl.env_config import environment_prompts
    from hybridlm.train.mtp_boost import MTPBoostRunConfig, boost_checkpoint

    ckpt = tmp_path / "hf"
    save_pretrained(HybridLM(tiny_train_model(), seed=0), ckpt)

    def boost(batch_size: int, out: str) -> MTPBoostRunConfig:
        return boost_run(
            init_from=str(ckpt),
            out_dir=str(tmp_path / out),
            steps=3,
            batch_size=batch_size,
            lr=3e-3,
            min_lr=3e-4,
            warmup_steps=1,
            num_sequences=8,
            prompt_len=8,
            gen_len=12,
            eval_prompts=2,
            eval_new_tokens=6,
            draft_len=2,
            eval_temperatures=[0.0],
            log_interval=1,
            prompts="arithmetic",
            parallel=parallel,
        )

    boost_checkpoint(boost(4, "w1"), progress=False, environment_prompts=environment_prompts)
    dp = boost(2, "w2")
    run_world2(tmp_path, dp, stage="mtp_boost")
    a, b = rows(dp.train.out_dir), rows(tmp_path / "w1")
    worst = assert_same_losses(a, b, ("loss", "nll_1", "nll_2", "kl_2", "acceptance_length"))
    weights = assert_same_weights(dp.train.out_dir, tmp_path / "w1")
    print(f"mtp_boost {parallel}: worst relative difference {worst:.2e}, weights {weights:.2e}")
