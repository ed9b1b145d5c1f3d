"""The README's commands work as a user runs them.

Every command of the README (the stage table's command cells and the ```bash blocks) is listed
here with how it is exercised: run by `test_stage_table_after_the_speedrun` (slow) against a
tiny speedrun made in a fresh directory, as written apart from `--set` overrides that shorten
the run (the README's rows show `--set` for exactly that), or by the test that covers it
(benchmarks, servers, multi-process jobs). `test_every_readme_command_is_accounted_for` keeps
the list and the README equal, so a new row comes with its check.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from test_speedrun import TINY

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_commands(text: str | None = None) -> list[str]:
    """The README's commands: backticked spans of the table cells that start like a command,
    and the non-comment lines of ```bash blocks (continuations joined)."""
    text = README.read_text() if text is None else text
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith("|") and "`" in line:
            last = re.split(r"(?<!\\)\|", line.rstrip().rstrip("|"))[-1]  # `\|` is a pipe
            for span in re.findall(r"`([^`]+)`", last.replace("\\|", "|")):
                if re.match(r"(hybridlm |python |torchrun |pip |pytest |[A-Z_]+=)", span):
                    out.append(span)
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = re.sub(r"\s+", " ", cmd.strip())
            if cmd and not cmd.startswith("#"):
                out.append(cmd)
    return out


# ---------------------------------------------------------------------------- the chain
# A tiny speedrun (tests/test_speedrun.py's sizes; that test holds the whole flow to its
# figures): here only the stages that make the models the rows start from.
TINY_SPEEDRUN = [s for s in TINY if s.split(".")[0] in ("tokenizer", "pretrain", "sft")]

# shortening overrides of the post-training configs' sizes (steps, rows, generation lengths)
SHORT_CHAT = [
    "train.max_steps=2",
    "train.warmup_steps=1",
    "train.eval_interval=2",
    "train.checkpoint_interval=0",
    "data.seq_len=256",
    "data.held_out=4",
]
SHORT_SFT = [*SHORT_CHAT, "data.sources.0.max_rows=200", "sft.eval_generate=2"]
SHORT_SFT += ["sft.max_new_tokens=16"]
SHORT_DISTILL = [*SHORT_CHAT, "data.sources.0.max_rows=200", "distill.eval_generate=2"]
SHORT_DISTILL += ["distill.eval_max_new_tokens=16"]
SHORT_PAIRS = [
    "train.max_steps=2",
    "train.warmup_steps=1",
    "train.eval_interval=2",
    "data.held_out=2",
    "data.max_len=256",
]
SHORT_BOOST = [
    "train.max_steps=2",
    "data.num_sequences=4",
    "data.eval_prompts=2",
    "data.gen_len=12",
    "mtp_boost.eval_new_tokens=8",
]

SHORT_RL = [
    "train.max_steps=2",
    "rl.executor=inline",
    "data.eval_problems=4",
    "rl.groups_per_step=2",
    "rl.group_size=2",
    "rl.max_draws=2",
    "train.eval_interval=1",
    "rl.max_new_tokens=16",
]

# (README command, the overrides that shorten it); optional `[...]` parts are left out
CHAIN: list[tuple[str, list[str]]] = [
    (
        "hybridlm speedrun [--skip rl] [--only eval,report] [--force sft] "
        "[--set sft.train.max_steps=200]",
        ["--skip=rl,mtp_heal,quantize,qad,eval", *TINY_SPEEDRUN],
    ),
    ("hybridlm report runs/speedrun", []),
    (
        "hybridlm sft [--config configs/sft.yaml] [--set train.max_steps=100] "
        "[--resume | --overwrite]",
        SHORT_SFT,
    ),
    (
        "hybridlm dpo [--config configs/dpo.yaml] [--set dpo.loss=dpo] [--resume | --overwrite]",
        [
            *SHORT_PAIRS,
            "data.delta.prompts.max_rows=24",
            "data.delta.max_new_tokens=16",
            # models of a few steps are rarely right, and greedy replies of both are often
            # the same empty one: sample, and keep every chosen reply
            "data.delta.filter_chosen=none",
            "data.delta.temperature=1.0",
            "dpo.eval_source.max_rows=8",
            "dpo.eval_generate=2",
            "dpo.max_new_tokens=16",
        ],
    ),
    (
        "hybridlm distill [--config configs/distill.yaml] [--set train.max_steps=50] "
        "[--resume | --overwrite]",
        SHORT_DISTILL,
    ),
    (
        "hybridlm distill-cache --set distill.teacher_cache=runs/distill_cache",
        ["data.sources.0.max_rows=200", "data.held_out=4", "data.seq_len=256"],
    ),
    (
        "hybridlm distill --set distill.teacher_cache=runs/distill_cache",
        [*SHORT_DISTILL, "train.out_dir=runs/distill_cached"],
    ),
    (
        "hybridlm qad --config configs/qad.yaml --set train.init_from=runs/sft",
        [
            *SHORT_DISTILL,
            "qad.teacher_replies=8",
            "qad.correct_only=false",
            "qad.calib_samples=4",
        ],
    ),
    (
        "hybridlm rl --checkpoint runs/sft [--set train.max_steps=60] [--resume | --overwrite]",
        SHORT_RL,
    ),
    (
        "hybridlm mtp-boost --checkpoint runs/sft [--set data.prompts=sft_arithmetic] "
        "[--set train.max_steps=300]",
        SHORT_BOOST,
    ),
]

SHORT_PRETRAIN = [
    "data.sources.0.max_files=40",
    "data.batch_size=2",
    "train.max_steps=6",
    "train.warmup_steps=1",
    "train.eval_interval=3",
    "train.checkpoint_interval=2",
    "--sample-tokens=8",
]
CHAIN += [
    (
        "hybridlm pretrain [--config configs/quickstart.yaml] [--set train.max_steps=200] "
        "[--resume | --overwrite]",
        SHORT_PRETRAIN,
    ),
    ("hybridlm merge --run runs/quickstart --windows 2,3", []),
    ("hybridlm export-hf --checkpoint runs/quickstart --out hf/", []),
    (
        "hybridlm quantize --recipe autoquant --budget 4.75 runs/quickstart out/qs-aq",
        ["calib_samples=4", "eval_batches=1", "per_layer=false"],
    ),
    (
        "hybridlm eval --checkpoint runs/quickstart --tasks spec_bench --limit 8 "
        "--max-new-tokens 64",
        ["--limit=1", "--max-new-tokens=8"],
    ),
]

SHORT_GEN = ["--max-new-tokens=8"]
CHAIN += [
    ("hybridlm info --preset nemotron-3-super-120b-a12b", []),
    ("hybridlm config --preset tiny-super --set moe.top_k=8 > my.yaml", []),
    (
        "hybridlm plan --preset nemotron-3-super-120b-a12b --gpus 512 --tp 2 --ep 64 "
        "--seq 8192 --micro-batch 1",
        [],
    ),
    ("hybridlm precision-plan --preset nemotron-3-super-120b-a12b", []),
    (
        'hybridlm generate --checkpoint runs/speedrun/pretrain --prompt "def " --temperature 0.7',
        SHORT_GEN,
    ),
    ("hybridlm generate --preset tiny-super --speculative 3 [--temperature 0.8]", SHORT_GEN),
    ("hybridlm generate --preset tiny-super --ssm-precision fp16-sr", SHORT_GEN),
    (
        "hybridlm eval --checkpoint runs/speedrun/sft --tasks "
        "base_easy,mc,gsm8k,humaneval,ifeval,ruler --limit 50",
        ["--limit=1", *SHORT_GEN],
    ),
    ("hybridlm upsample-curve --target web=1.0 --drop-below 0.4", []),
    ("hybridlm speedrun --only curate,tokenizer,pretrain", TINY_SPEEDRUN),
    (
        "hybridlm tool-demos --out runs/tool_demos.jsonl && hybridlm sft --config "
        "configs/sft_tools.yaml && hybridlm rl --config configs/rl_tools.yaml",
        [
            ["--num=40"],
            [*SHORT_CHAT[:4], "data.held_out=4", "sft.eval_generate=0"],
            [*SHORT_RL, "rl.max_new_tokens=48"],
        ],
    ),
    (
        "hybridlm rm --config configs/rm.yaml && hybridlm rl --config configs/rlhf.yaml",
        [
            # a few-step SFT model answers no question right, so its verifier-labelled pairs
            # are empty (a one-line error): the DPO row's pairs instead (tests/test_rm.py
            # builds verified pairs from a model that is sometimes right)
            [*SHORT_PAIRS, "data.verified=null", "data.path=runs/dpo/pairs.jsonl"],
            SHORT_RL,
        ],
    ),
]

SANDBOX = (
    "python -c \"from hybridlm.rl import Sandbox; print(Sandbox().run('def f(): return 1', "
    "['assert f() == 1']))\""
)
# the stages that continue the speedrun's pretrained model, and the rows after them
SHORT_MID = [
    "data.sources.1.max_files=40",
    "train.max_steps=2",
    "train.warmup_steps=1",
    "train.eval_interval=2",
    "train.checkpoint_interval=2",
]
SHORT_TWO_STEPS = [*SHORT_PRETRAIN[:2], *SHORT_MID[1:]]
# the cached teacher covers every token of the data: fewer files (the same for both commands)
SHORT_CACHE = ["data.sources.0.max_files=8", "data.batch_size=2"]
# a server command runs until it is stopped: it is started, answers a completion and a chat
# request of the official `openai` client, and is stopped (`_serve`)
SERVE = ["--max-model-len=512"]
CHAIN += [
    ("hybridlm pretrain --config configs/midtrain.yaml", SHORT_MID),
    (
        "hybridlm pretrain --config configs/long_context.yaml",
        [*SHORT_MID, "data.sources.3.max_files=40", "train.eval_batches=1"],
    ),
    ("hybridlm curate [--config configs/curate.yaml] [--executor ray] [--output DIR]", []),
    ("hybridlm quality-train --example --out runs/quality", ["--per-source=300"]),
    (
        "hybridlm decon --input runs/curate/data --report runs/decon.json [--benchmark NAME=FILE]",
        [],
    ),
    (
        "hybridlm pretrain --set train.low_precision=nvfp4 "
        "--set train.out_dir=runs/quickstart_nvfp4",
        SHORT_TWO_STEPS,
    ),
    (
        "hybridlm quantize --recipe fp8 --kv-cache fp8 runs/speedrun/sft runs/sft_fp8",
        ["calib_samples=4", "eval_batches=1", "per_layer=false"],
    ),
    ("hybridlm serve --checkpoint runs/sft_fp8 --kv-cache-dtype fp8", SERVE),
    ("hybridlm serve --preset tiny-super --port 8000 [--max-body-bytes 4194304]", SERVE),
    (
        "hybridlm pretrain --set distill.teacher=runs/quickstart "
        "--set train.intra_doc_masking=true --set train.out_dir=runs/distilled",
        SHORT_TWO_STEPS,
    ),
    (
        "hybridlm distill-cache --pretraining --set distill.teacher=runs/quickstart "
        "--set train.intra_doc_masking=true --set distill.teacher_cache=runs/text_cache",
        SHORT_CACHE,
    ),
    (
        "hybridlm pretrain --set distill.teacher_cache=runs/text_cache "
        "--set train.intra_doc_masking=true --set train.out_dir=runs/distilled_cached",
        [*SHORT_CACHE, *SHORT_MID[1:]],
    ),
    (
        "hybridlm pretrain --config runs/speedrun/pretrain/run.yaml --set model.mtp.shared=false "
        "--set train.out_dir=runs/mtp_init/pretrain_per_depth",
        ["data.sources.1.max_files=40", *SHORT_MID[1:]],
    ),
    (
        "hybridlm mtp-boost --checkpoint runs/mtp_init/pretrain_per_depth "
        "--set mtp_boost.init=consolidate --set data.kind=text",
        SHORT_BOOST,
    ),
    (SANDBOX, []),
    ("hybridlm generate --preset tiny-super --compile", SHORT_GEN),
    # the benchmarks, on the models above, shortened by their own flags
    ("python benchmarks/gpu_check.py [--profile]", []),  # one line on a machine without CUDA
    ("python benchmarks/decode_profile.py", ["--models=tiny-super", "--tokens=4"]),
    ("python benchmarks/decon_recall.py", ["--items=20", "--clean=20", "--near=50"]),
    (
        "python benchmarks/ptq_accuracy.py",
        ["--checkpoint=runs/quickstart", "--calib-samples=4"],
    ),
    (
        "python benchmarks/long_context.py",
        [
            "--no-twin",
            "--samples=1",
            *(f"--midtrain-set={o}" for o in SHORT_MID),
            *(f"--extension-set={o}" for o in SHORT_MID[:2]),
            "--extension-set=data.sources.3.max_files=40",
            "--extension-set=train.warmup_steps=1",
            "--extension-set=train.max_steps=3",
            "--extension-set=train.checkpoint_interval=1",
            "--extension-set=train.eval_interval=3",
            "--extension-set=train.eval_batches=1",
        ],
    ),
    ("python benchmarks/mtp_init.py", ["--steps=2", "--eval-prompts=2"]),
    (
        "python benchmarks/rl_learns.py [--base runs/speedrun/sft]",
        [
            "--executor=inline",
            "--steps=1",
            "--tool-rl-steps=1",
            "--groups=2",
            "--group-size=2",
            "--max-new-tokens=16",
            "--max-episode-tokens=96",
            "--problems=4",
            "--samples=1",
            "--curve-problems=2",
            "--eval-interval=1",
            "--tool-demos=40",
            "--mode-chats=40",
            "--mode-steps=2",
            "--tool-steps=2",
        ],
    ),
]

# what a command's output must hold, beyond its exit status 0
PRINTS: dict[str, str] = {
    SANDBOX: "status='ok'",
}

# README commands whose code another test runs, on reduced settings or through its library call
# (command -> "file::test"); `test_every_readme_command_is_accounted_for` checks the test exists
M = "tests/test_train_mesh.py::"
COVERED_BY: dict[str, str] = {
    "python benchmarks/decode.py": "tests/test_decode_benchmark.py::"
    "test_decode_section_reports_ratio_and_agreement",
    "python benchmarks/spec_speedup.py": "tests/test_spec_speedup_benchmark.py::"
    "test_spec_speedup_trains_heals_reuses_and_projects",
    "python benchmarks/ssm_state_precision.py": "tests/test_state_precision.py::"
    "test_drift_study_writes_metrics_and_plot",
    "python benchmarks/parallel_gpu.py": "tests/test_activation_checkpointing.py::"
    "test_parallel_gpu_benchmark_smoke_run",
    "python benchmarks/pretrain_throughput.py": "tests/test_pretrain_benchmark.py::"
    "test_pretrain_throughput_benchmark_prints_a_finite_ratio",
    "python benchmarks/curate_throughput.py [--out DIR]": "tests/test_curate_dedup.py::"
    "test_curate_benchmark_runs_and_checks",
    "python benchmarks/nvfp4_training.py": "tests/test_precision_training.py::"
    "test_nvfp4_study_tracks_the_baseline",
    "python benchmarks/kv_cache_quant.py": "tests/test_kv_cache_quant.py::"
    "test_the_study_runs_and_its_unquantised_cache_equals_the_plain_forward",
    "python benchmarks/spec_bench.py": "tests/test_eval_speculative.py::"
    "test_benchmark_script_prints_a_line_per_category_and_overall",
    "python benchmarks/contention.py [--rounds 3]": "tests/test_threads.py::"
    "test_contention_benchmark_ratio",
    "python benchmarks/train_step.py": "tests/test_benchmark.py::"
    "test_train_step_benchmark_reports_ratio",
    "hybridlm serve --preset tiny-super --port 8000 [--max-body-bytes 4194304]": (
        "tests/test_server.py::test_completion_streamed_equals_plain_and_counts_usage"
    ),
    'hybridlm chat --preset tiny-super --system "Be brief."': (
        "tests/test_server.py::test_chat_cli_with_piped_stdin"
    ),
    "hybridlm soup --runs runs/lc_a,runs/lc_b [--last 2]": "tests/test_train_merge.py::"
    "test_soup_of_two_seeds_evaluates_every_candidate_and_exports_the_best",
    "hybridlm mix --data data.yaml --out runs/mix [--proxy bigram|trainer]": (
        "tests/test_curate_followups.py::test_mix_command_writes_a_quality_weighted_phase_two"
    ),
    "hybridlm decon-code-eval [--backend hashed|minilm]": "tests/test_curate_followups.py::"
    "test_hashed_code_decon_recall_on_planted_solutions_and_stdlib_false_positives",
    "HYBRIDLM_ENV_TOKEN=... hybridlm env-serve --env calculator --port 8010": (
        "tests/test_env_server_hostile.py::test_env_serve_flags"
    ),
    "pytest tests/test_untrusted_text.py tests/test_env_server_hostile.py": (
        "tests/test_env_server_hostile.py::test_no_reply_holds_the_ground_truth"
    ),
    "torchrun --nproc_per_node=2 -m hybridlm.cli pretrain": (
        "tests/test_train_parallel.py::test_ddp_world2_matches_single_process"
    ),
    "torchrun --nproc_per_node=2 -m hybridlm.cli pretrain --set train.parallel=fsdp": (
        "tests/test_train_parallel.py::test_torchrun_cli_pretrain_fsdp"
    ),
    "torchrun --nproc_per_node=4 -m hybridlm.cli pretrain --set train.parallel.dp_replicate=2 "
    "--set train.parallel.dp_shard=2": M + "test_ep2_hsdp_world4_matches_single_process",
    "torchrun --nproc_per_node=2 -m hybridlm.cli pretrain --set train.parallel=fsdp "
    "--set train.parallel.ep=2": M + "test_ep2_world2_matches_single_process",
    "torchrun --nproc_per_node=4 -m hybridlm.cli pretrain --set train.parallel.tp=2 "
    "--set train.parallel.dp_shard=2 --set model.mamba.n_groups=2 "
    "--set train.out_dir=runs/quickstart_tp": M
    + "test_tp2_on_the_quickstart_model_names_the_setting_to_change",
    "torchrun --nproc_per_node=2 -m hybridlm.cli pretrain --set train.parallel.cp=2": M
    + "test_cp2_world2_matches_single_process",
    'pip install -e ".[speedrun]" && hybridlm speedrun': ".ci/run",
    "hybridlm speedrun --set 'skip=[]' --out runs/speedrun_long": "tests/test_speedrun.py::"
    "test_whole_flow_runs_and_writes_the_report",
    'pip install -e ".[test]" && pytest -q': ".ci/run",
    "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python -m hybridlm.eval.lm_eval_adapter run "
    "--model hybridlm --model_args path=runs/speedrun/rl/model --include_path examples/lm_eval "
    "--tasks gsm8k_local --limit 50": "tests/test_eval_lm_eval.py::"
    "test_documented_offline_gsm8k_commands",
    "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 lm_eval run --model hf --model_args "
    "pretrained=runs/speedrun/rl/model,dtype=float32 --include_path examples/lm_eval "
    "--tasks gsm8k_local --limit 50": "tests/test_eval_lm_eval.py::"
    "test_documented_offline_gsm8k_commands",
}

# README commands no test runs yet (command -> why)
NOT_YET: dict[str, str] = {}


def _short(cmd: str) -> list[str]:
    """The command as written without its optional `[...]` parts, split like a shell."""
    return shlex.split(re.sub(r"\s*\[[^\]]*\]", "", cmd))


def _as_args(extra: list[str]) -> list[str]:
    return [a if a.startswith("-") else f"--set={a}" for a in extra]


def test_every_readme_command_is_accounted_for():
    listed = [c for c, _ in CHAIN] + list(COVERED_BY) + list(NOT_YET)
    missing = [c for c in readme_commands() if c not in listed]
    stale = [c for c in listed if c not in readme_commands()]
    assert not stale, f"listed here but not in the README: {stale}"
    assert not missing, f"README commands no test exercises: {missing}"
    for cmd, where in COVERED_BY.items():
        file, _, name = where.partition("::")
        assert (ROOT / file).is_file(), (cmd, where)
        assert not name or f"def {name}(" in (ROOT / file).read_text(), (cmd, where)


def _run(argv: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run a command as a shell would in `cwd`, with this interpreter's scripts first on PATH
    (`hybridlm`, `torchrun`); a redirect goes through the shell."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    shell = ">" in argv
    cmd: str | list[str] = shlex.join(argv).replace("'>'", ">") if shell else argv
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=env,
        shell=shell,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _serve(argv: list[str], cwd: Path, timeout: float = 300) -> None:
    """Start a server command on a free port, send it a completion and a chat request with the
    official `openai` client, and stop it (Ctrl-C)."""
    from openai import OpenAI

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    log = cwd / f"serve_{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*argv, f"--port={port}"], cwd=cwd, env=env, stdout=out, stderr=out)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + timeout
        while True:
            exited = proc.poll()
            assert exited is None, f"{argv} exited {exited}:\n{log.read_text()[-3000:]}"
            try:
                model = client.models.list().data[0].id
                break
            except Exception:
                assert time.monotonic() < deadline, f"{argv} not up in {timeout} s"
                time.sleep(1)
        done = client.completions.create(model=model, prompt="2+3=", max_tokens=4)
        assert done.usage.completion_tokens >= 1, done
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is 2+3?"}], max_tokens=4
        )
        assert chat.choices[0].message.role == "assistant", chat
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_stage_table_after_the_speedrun(tmp_path):
    """The stage table's rows, in order, in a directory where only `hybridlm speedrun` ran
    (shortened): each starts from what the README's earlier commands made."""
    for name in ("configs", "examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    commands = readme_commands()
    assert not [c for c, _ in CHAIN if c not in commands], "run only the README's commands"
    seconds: list[tuple[float, str]] = []
    for cmd, extra in CHAIN:
        parts = cmd.split(" && ")
        extras = extra if extra and isinstance(extra[0], list) else [extra] * len(parts)
        for part, more in zip(parts, extras, strict=True):
            argv = _short(part) + _as_args(more)
            t0 = time.perf_counter()
            if argv[:2] == ["hybridlm", "serve"]:
                _serve(argv, tmp_path)
            else:
                done = _run(argv, tmp_path)
                assert done.returncode == 0, (
                    f"{' '.join(argv)} exited {done.returncode}:\n"
                    f"{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
                )
                assert PRINTS.get(cmd, "") in done.stdout, (cmd, done.stdout[-1500:])
            seconds.append((time.perf_counter() - t0, part))
    print("\n".join(f"{t:6.1f} s  {cmd}" for t, cmd in sorted(seconds, reverse=True)))
    # every stage read the token ids of the speedrun's BPE tokenizer, the one its models carry
    for run in ("sft", "dpo", "distill", "distill_cached", "qad"):
        recorded = yaml.safe_load((tmp_path / "runs" / run / "run.yaml").read_text())
        assert recorded["data"]["tokenizer"] == "runs/speedrun/tokenizer", run
        assert (tmp_path / "runs" / run / "metrics.jsonl").is_file(), run
    assert (tmp_path / "runs" / "rl" / "model" / "tokenizer.json").is_file()


def test_the_python_examples_run(tmp_path):
    """The README's ```python blocks run as written, in order in one interpreter (a later block
    uses the `model` of an earlier one), in an empty directory (they write `ckpt/`)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    done = subprocess.run(
        [sys.executable, "-c", "\n".join(blocks)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
