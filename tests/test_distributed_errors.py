"""How a torchrun job ends when it must stop (`hybridlm.cli`, `train.parallel`): rank 0's one
line is what the user sees and torchrun's summary names as the root cause; the other ranks exit
non-zero without a word (no traceback, nothing from gloo); a failure of one other rank alone is
that rank's one line; a bug keeps its traceback. Each torchrun job is 2 gloo processes on
127.0.0.1."""

import json
import os
import pickle
import subprocess
import textwrap
from pathlib import Path

import pytest

from hybridlm.train.distributed.parallel import MainFailed, lost_peer, on_main, record_failure
from hybridlm.train.stages.pretrain import run_pretrain
from test_train_parallel import TIMEOUT_S, tiny_run, torchrun_cmd

pytestmark = pytest.mark.usefixtures("one_thread")

ERROR = "hybridlm pretrain: error: "


def _torchrun(tmp: Path, *args: str) -> tuple[int, str]:
    """`torchrun --nproc_per_node=2 ARGS` on gloo: its exit status and everything it and its
    ranks printed (stdout and stderr, as a terminal shows them)."""
    cmd = torchrun_cmd(*args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(
        cmd,
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
    )
    return res.returncode, res.stdout


def _root_cause(out: str) -> str:
    """torchrun's summary from "Root Cause" on."""
    assert "Root Cause (first observed failure)" in out, out[-4000:]
    return out.split("Root Cause (first observed failure)", 1)[1]


def _assert_no_rank_traceback(out: str) -> None:
    """The one traceback is torchrun's own (it raises ChildFailedError when a rank fails);
    nothing from a rank's traceback (torch prefixes its lines `[rankN]:`) or from gloo."""
    assert out.count("Traceback (most recent call last)") == out.count("raise ChildFailedError(")
    assert out.count("raise ChildFailedError(") <= 1
    assert "[rank" not in out and "Connection closed by peer" not in out
    assert "gloo" not in out.lower(), out


def test_resume_with_every_checkpoint_damaged_is_one_line_from_rank_0(tmp_path):
    """A sharded run whose every checkpoint is damaged, resumed on 2 ranks: rank 0 finds it and
    every rank stops on its verdict: rank 0's line once, no rank's traceback, nothing from
    gloo, and torchrun's summary names that line as the root cause."""
    run = tiny_run(
        tmp_path,
        "run",
        batch_size=4,
        max_steps=2,
        checkpoint_interval=1,
        eval_interval=2,
        checkpoint_format="sharded",
    )
    run_pretrain(run)
    ckpts = Path(run.train.out_dir) / "checkpoints"
    # a disk failure: the newest's rank-0 shard cut short, the older's DCP index corrupted in
    # place (same size: only the checksum tells)
    shard = ckpts / "step_00000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:4096])
    index = ckpts / "step_00000001" / ".metadata"
    data = bytearray(index.read_bytes())
    data[100:200] = bytes(100)
    index.write_bytes(bytes(data))
    run.train.parallel = "fsdp"
    run.data.batch_size = 2
    cfg = tmp_path / "resume.yaml"
    run.save(cfg)

    code, out = _torchrun(
        tmp_path,
        "-m",
        "hybridlm.cli",
        "pretrain",
        "--config",
        str(cfg),
        "--resume",
        "--sample-tokens",
        "4",
    )

    assert code != 0, out[-4000:]
    lines = [line for line in out.splitlines() if line.startswith(ERROR)]
    assert len(lines) == 1, out[-4000:]
    assert "no intact checkpoint" in lines[0] and "start again with --overwrite" in lines[0]
    assert "step_00000002: __0_0.distcp has 4096 bytes" in lines[0]
    assert "step_00000001: .metadata does not match its SHA-256" in lines[0]
    _assert_no_rank_traceback(out)
    # torchrun's summary names rank 0's line, not "To enable traceback see: ..."
    root = _root_cause(out)
    assert "rank      : 0 " in root and f"traceback : {lines[0]}" in root, root


# the CLI's handler replaced by one failure on chosen ranks, after the process group started
SCRIPT = textwrap.dedent(
    """
    import sys

    import hybridlm.cli as cli
    from hybridlm.cli import train
    from hybridlm.train.distributed import parallel

    parallel.REPORT_WAIT_S = 2.0  # how long rank 1 waits for rank 0's verdict

    def fail(args):
        parallel.init_distributed("cpu")
        rank, case = parallel.get_rank(), sys.argv[1]
        if case == "rank1_io" and rank == 1:
            raise OSError("[Errno 28] No space left on device: 'cache/rank1'")
        if case == "every_rank":
            raise ValueError("train.parallel: 2 ranks do not split into groups of 4")
        if case == "rank1_bug" and rank == 1:
            {}["no such key"]
        parallel.barrier()  # the ranks without a failure wait for the others here

    train.cmd_pretrain = fail
    sys.exit(cli.main(["pretrain"]))
    """
)


@pytest.mark.slow  # three torchrun jobs; the damaged-checkpoint one runs by default
@pytest.mark.parametrize(
    "case, status, line",
    [
        ("rank1_io", 1, "rank 1: [Errno 28] No space left on device: 'cache/rank1'"),
        ("every_rank", 2, "train.parallel: 2 ranks do not split into groups of 4"),
        ("rank1_bug", 1, None),
    ],
)
def test_failures_of_other_ranks(tmp_path, case, status, line):
    """A failure of rank 1 alone is rank 1's line (rank 0, left in a collective, exits without
    a word); one every rank finds by itself is printed once, by rank 0; a bug keeps its
    traceback on the rank it happened on."""
    (tmp_path / "fail.py").write_text(SCRIPT)
    code, out = _torchrun(tmp_path, "fail.py", case)
    assert code != 0, out[-4000:]
    assert f"exitcode  : {status} " in _root_cause(out), out[-4000:]
    printed = [x for x in out.splitlines() if x.startswith(ERROR)]
    if line is None:
        assert not printed and "[rank0]" not in out and "Connection closed by peer" not in out
        assert "[rank1]: KeyError: 'no such key'" in out, out[-4000:]
        assert "KeyError: 'no such key'" in _root_cause(out)  # with its traceback
        return
    assert printed == [ERROR + line], out[-4000:]
    _assert_no_rank_traceback(out)
    assert f"traceback : {ERROR + line}" in _root_cause(out)


# ---------------------------------------------------------------------------- one process
def test_on_main_in_one_process_is_the_call():
    assert on_main(lambda: 3) == 3 and on_main(lambda: 3, share=False) == 3
    with pytest.raises(KeyError):
        on_main(lambda: {}["x"])
    err = pickle.loads(pickle.dumps(MainFailed(ValueError("bad"))))  # it crosses processes
    assert isinstance(err.cause, ValueError) and str(err) == "rank 0 failed: bad"


def test_lost_peer_knows_a_peers_exit_from_a_failure():
    import torch.distributed as dist

    gone = RuntimeError(
        "[third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
        "[127.0.0.1]:26541. This is typically caused by a remote worker crashing."
    )
    assert lost_peer(gone) and lost_peer(dist.DistBackendError("NCCL communicator aborted"))
    try:  # raised while handling it
        try:
            raise gone
        except RuntimeError as err:
            raise ValueError("checkpoint does not match") from err
    except ValueError as err:
        assert lost_peer(err)
    assert not lost_peer(RuntimeError("shape mismatch")) and not lost_peer(OSError("disk full"))


def test_the_error_file_is_what_torchrun_reads(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    record_failure("not written")  # no torchrun: nothing
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    record_failure(ERROR + "no intact checkpoint")
    assert json.loads(path.read_text())["message"]["message"] == ERROR + "no intact checkpoint"
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    summary = ChildFailedError("hybridlm.cli", {0: failure}).format_msg()
    assert f"traceback : {ERROR}no intact checkpoint" in summary
