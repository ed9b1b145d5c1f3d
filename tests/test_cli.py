"""The command line: every command runs; user mistakes give a message, not a traceback."""

import subprocess
import sys

import pytest

from hybridlm.cli import main


def test_info_prints_counts(capsys):
    assert main(["info", "--preset", "nemotron-3-super-120b-a12b"]) == 0
    out = capsys.readouterr().out
    assert "120.67B" in out and "12.77B" in out and "8.00 KiB" in out


def test_config_round_trips_through_yaml(capsys, tmp_path):
    assert main(["config", "--preset", "tiny-super", "--set", "moe.top_k=4"]) == 0
    path = tmp_path / "c.yaml"
    path.write_text(capsys.readouterr().out)
    assert main(["info", "--config", str(path)]) == 0


def test_generate_and_export(tmp_path, capsys):
    assert (
        main(["generate", "--preset", "tiny-olmo", "--prompt", "Hi", "--max-new-tokens", "4"]) == 0
    )
    assert capsys.readouterr().out.startswith("Hi")
    assert main(["export-hf", "--preset", "tiny-lightning", "--out", str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "config.json").is_file()
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    argv = ["generate", "--preset", "tiny-super", "--prompt", "Hi", "--max-new-tokens", "6"]
    assert main(argv + ["--speculative", "3"]) == 0
    spec = capsys.readouterr()
    assert "acceptance length" in spec.err
    assert main(argv) == 0
    assert capsys.readouterr().out == spec.out  # greedy with and without drafts


@pytest.mark.parametrize(
    "argv,message",
    [
        (["info", "--preset", "tiny-super", "--set", "moe.top_k=99"], "exceeds"),
        (["info", "--config", "/nonexistent.yaml"], "not found"),
        (["generate", "--checkpoint", "/nonexistent"], "neither a transformers directory"),
        (["generate", "--preset", "tiny-super", "--max-new-tokens", "-1"], "max_new_tokens"),
        (["generate", "--preset", "tiny-olmo", "--speculative", "3"], "MTP"),
        (
            ["generate", "--preset", "tiny-super", "--speculative", "3", "--ssm-precision", "fp16"],
            "fp32 state cache",
        ),
    ],
)
def test_user_mistakes_are_reported(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_console_entry_point_runs():
    res = subprocess.run(
        [sys.executable, "-m", "hybridlm.cli", "info", "--preset", "tiny-super"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and "params total" in res.stdout


def test_pretrain_runs_samples_and_exports(tmp_path, capsys):
    """`hybridlm pretrain` on a slice of the embedded corpus: trains, evaluates, exports."""
    out = tmp_path / "run"
    argv = ["pretrain", "--sample-tokens", "8"]
    for kv in (
        "train.max_steps=4",
        f"train.out_dir={out}",
        f"data.shards_dir={out / 'shards'}",
        "data.sources.0.max_files=12",
        "train.eval_interval=4",
        "train.checkpoint_interval=4",
        "train.progress=false",
    ):
        argv += ["--set", kv]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "step 4/4" in printed and "eval_bpb" in printed
    assert (out / "loss.png").is_file() and (out / "hf" / "config.json").is_file()
    assert main(["pretrain", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_every_sub_command_dispatches():
    """Stage modules add their own sub-commands; each must name the function `main` calls."""
    import argparse

    from hybridlm.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [name for name, p in sub.choices.items() if not callable(p.get_default("fn"))]
    assert len(sub.choices) >= 20 and not missing, missing
