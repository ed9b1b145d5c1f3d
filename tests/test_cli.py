"""The command line: every command runs; user mistakes give a message, not a traceback."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridlm.cli import build_parser, main


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
        (["generate", "--checkpoint", "/nonexistent"], "'/nonexistent': no such model"),
        (["generate", "--preset", "tiny-super", "--max-new-tokens", "-1"], "max_new_tokens"),
        (["generate", "--preset", "tiny-olmo", "--speculative", "3"], "MTP"),
        (
            ["generate", "--preset", "tiny-super", "--speculative", "3", "--ssm-precision", "fp16"],
            "fp32 state cache",
        ),
        (["quality-train", "--out", "/tmp/unused-quality"], "give --pos and --neg"),
        (["upsample-curve", "--target", "web"], "--target web"),
        (["decon", "--input", "/dev/null", "--benchmark", "bad"], "NAME=FILE.jsonl"),
    ],
)
def test_user_mistakes_are_reported(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["sft", "dpo", "rm", "distill", "qad"])
def test_a_training_command_names_itself_in_its_errors(command, capsys):
    """The run-config commands (one table, `cli.train.RUN_COMMANDS`) say which command failed
    and why, in one line."""
    assert main([command, "--config", "/nonexistent.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"hybridlm {command}: error: ") and "not found" in err, err


def test_a_quantised_kv_cache_without_scales_names_a_command_that_parses(capsys):
    """The FP8 KV-cache error names the quantize command that makes the scales; it parses as
    written (there is no `quantize --set kv_cache=...` to suggest in its place)."""
    argv = ["generate", "--preset", "tiny-super", "--kv-cache-dtype", "fp8"]
    assert main([*argv, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hybridlm generate: error: kv_cache_dtype fp8 needs"), err
    suggested = err.split("`")[1].split()
    assert suggested[:2] == ["hybridlm", "quantize"], suggested
    assert build_parser().parse_args(suggested[1:]).kv_cache == "fp8"


def test_generate_help_names_the_checkpoints_own_tokenizer(capsys):
    for argv in (["--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = " ".join(capsys.readouterr().out.split())
        assert "(byte tokenizer)" not in out
    assert "the tokenizer the checkpoint was trained with" in out


# `hybridlm` with a module made unimportable, as in an install without the extra providing it
_WITHOUT = """
import sys
sys.modules[sys.argv.pop(1)] = None  # `import` of it raises ImportError
from hybridlm.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "missing,argv",
    [
        ("fastapi", ["serve", "--preset", "tiny-super", "--port", "0"]),
        ("uvicorn", ["serve", "--preset", "tiny-super", "--port", "0"]),
        ("uvicorn", ["env-serve", "--env", "calculator", "--port", "0"]),
    ],
)
def test_a_server_without_the_serve_extra_names_it(missing, argv, tmp_path):
    """One line naming the [serve] extra, before any model is loaded (uvicorn is imported only
    when the server starts: without the check it failed with a traceback after loading)."""
    res = subprocess.run(
        [sys.executable, "-c", _WITHOUT, missing, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    want = f"hybridlm {argv[0]}: error: `hybridlm {argv[0]}` needs {missing}, which the [serve]"
    assert last.startswith(want) and 'pip install -e ".[serve]"' in last, last


def test_default_outputs_of_the_readme_rows_stay_out_of_git(tmp_path, monkeypatch, capsys):
    """`hybridlm upsample-curve` writes under runs/ by default, and the README's `export-hf
    --out hf/` lands in an ignored folder: neither leaves untracked files in a checkout."""
    monkeypatch.chdir(tmp_path)
    assert main(["upsample-curve", "--target", "web=1.0", "--drop-below", "0.4"]) == 0
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["runs/upsample/curves.jsonl", "runs/upsample/curves.png"], written
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    paths = [*written, "hf/config.json"]
    res = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths], cwd=root, capture_output=True, text=True
    )
    assert sorted(res.stdout.split()) == sorted(paths), res.stdout


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


def _error_line(err: str) -> str:
    """The one line a failed command prints: no traceback, nothing after it."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and err.splitlines()[-1] == lines[0], err
    return lines[0]


def test_pretrain_rerun_needs_resume_or_overwrite_and_resume_skips_damage(tmp_path, capsys):
    from _tiny import tiny_run
    from hybridlm.io.checkpoint import list_checkpoints
    from hybridlm.report.plot import read_metrics
    from hybridlm.train.stages.pretrain import run_pretrain

    cfg = tiny_run(tmp_path, "run", max_steps=4, checkpoint_interval=2, eval_interval=0)
    cfg.save(tmp_path / "run.yaml")
    out = tmp_path / "run"
    argv = ["pretrain", "--config", str(tmp_path / "run.yaml"), "--sample-tokens", "2"]
    run_pretrain(cfg, until_step=3)  # a run that died after step 3 (checkpoint at 2)
    metrics = out / "metrics.jsonl"
    before = metrics.read_bytes()
    capsys.readouterr()
    assert main(argv) == 2  # neither --resume nor --overwrite: the earlier run is kept
    line = _error_line(capsys.readouterr().err)
    assert "already holds a run (metrics.jsonl, checkpoints/)" in line and "--overwrite" in line
    assert metrics.read_bytes() == before and len(list_checkpoints(out)) == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--resume", "--overwrite"])
    assert main([*argv, "--resume"]) == 0  # rows up to step 2 kept, 3 and 4 appended
    assert "resumed from" in capsys.readouterr().out
    assert metrics.read_bytes().startswith(before.splitlines(keepends=True)[0])
    steps = [r["step"] for r in read_metrics(metrics) if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4]
    assert main([*argv, "--overwrite"]) == 0
    assert f"overwrite: removed metrics.jsonl, checkpoints/ of the earlier run in {out}" in (
        capsys.readouterr().out
    )
    assert [r["step"] for r in read_metrics(metrics) if r["kind"] == "train"] == [1, 2, 3, 4]
    # every checkpoint damaged: resuming fails in one line naming each
    ckpts = list_checkpoints(out)
    for ckpt in ckpts:
        weights = ckpt / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    assert main([*argv, "--resume"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith("hybridlm pretrain: error: no intact checkpoint under")
    assert all(f"{c.name}: model.safetensors has" in line for c in ckpts) and len(ckpts) == 2
    assert main(["merge", "--run", str(out), "--windows", "2"]) == 2
    assert "model.safetensors cannot be read" in _error_line(capsys.readouterr().err)


def test_io_errors_and_corrupt_files_are_one_line(tmp_path, capsys):
    import gzip
    import zipfile

    from safetensors import SafetensorError

    from hybridlm.cli import _exit_status, _one_line

    (tmp_path / "file").write_text("")
    argv = ["quantize", str(tmp_path), str(tmp_path / "file" / "out"), "--device", "cpu"]
    assert main(argv) == 1
    assert "Not a directory" in _error_line(capsys.readouterr().err)
    # what readers of corrupt files raise: status 1, one line naming the kind of failure
    for err in (
        SafetensorError("Error while deserializing header:\ninvalid header length"),
        zipfile.BadZipFile("File is not a zip file"),
        gzip.BadGzipFile("Not a gzipped file"),
        EOFError("Compressed file ended before the end-of-stream marker was reached"),
    ):
        assert _exit_status(err) == 1 and "\n" not in _one_line(err)
    assert _one_line(SafetensorError("a\nb")) == "SafetensorError: a b"
    assert _exit_status(ValueError("bad")) == 2 and _exit_status(RuntimeError("bug")) is None


def _sub_commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_sub_command_dispatches():
    """The stage groups' modules (cli/*.py) add the sub-commands; each names the function `main`
    calls, a handler of the command line (the library modules hold no argument parsing)."""
    commands = _sub_commands()
    missing = [name for name, p in commands.items() if not callable(p.get_default("fn"))]
    assert len(commands) >= 20 and not missing, missing
    outside = {
        name: p.get_default("fn").__module__
        for name, p in commands.items()
        if not p.get_default("fn").__module__.startswith("hybridlm.cli.")
    }
    assert not outside, outside


@pytest.mark.parametrize("command", sorted(_sub_commands()))
def test_every_sub_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hybridlm {command}") and "--threads N" in out


# Parsing in a fresh interpreter: import the CLI, parse, and report the seconds it took, the exit
# code and whether torch was imported (`hybridlm.cli` imports the library only in handlers).
_PARSE = """
import json, sys, time
t0 = time.perf_counter()
from hybridlm.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"s": time.perf_counter() - t0, "code": code, "torch": "torch" in sys.modules}),
      file=sys.stderr)
"""


@pytest.mark.parametrize(
    "argv,code",
    [
        (["--help"], 0),
        (["pretrain", "--help"], 0),
        (["pretrain", "--bogus"], 2),
        (["nosuch"], 2),
        (["info", "--preset", "tiny-super"], 0),
        (["config", "--preset", "tiny-super"], 0),
    ],
)
def test_parsing_is_fast_and_never_imports_torch(argv, code):
    """`hybridlm --help`, a sub-command's help, a mistyped flag or command, and the commands that
    only read configs (info, config) answer without importing torch, within a second (import +
    parse, the best of 3 runs: robust to a loaded machine; the interpreter's own start is not
    counted)."""
    seconds = []
    for _ in range(3):
        res = subprocess.run(
            [sys.executable, "-c", _PARSE, *argv], capture_output=True, text=True, timeout=60
        )
        report = json.loads(res.stderr.strip().splitlines()[-1])
        assert not report["torch"], f"hybridlm {' '.join(argv)} imported torch"
        assert report["code"] == code, res.stderr
        seconds.append(report["s"])
    if code == 2:
        assert "Traceback" not in res.stderr and "usage: hybridlm" in res.stderr
    assert min(seconds) < 1.0, seconds


def test_import_hybridlm_is_lazy():
    """`import hybridlm` (and its configs) leaves torch alone; the model names still import."""
    code = (
        "import sys, hybridlm\n"
        "assert 'torch' not in sys.modules\n"
        "from hybridlm import ModelConfig, apply_overrides\n"
        "assert 'torch' not in sys.modules\n"
        "from hybridlm import HybridLM, ModelOutput\n"
        "import hybridlm.model.model as m\n"
        "assert HybridLM is m.HybridLM and ModelOutput is m.ModelOutput\n"
        "assert set(hybridlm.__all__) <= set(dir(hybridlm))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_threads_option_on_every_sub_command():
    parser = build_parser()
    assert parser.parse_args(["speedrun", "--threads", "1"]).threads == 1
    assert parser.parse_args(["pretrain", "--threads", "2"]).threads == 2
    assert parser.parse_args(["--threads", "2", "info"]).threads == 2  # before the command too
    assert parser.parse_args(["info"]).threads is None  # automatic
    for bad in ("0", "two"):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["info", "--threads", bad])
        assert exit_.value.code == 2


def test_main_configures_threads_before_the_handler(monkeypatch, capsys):
    import hybridlm.threads

    calls = []

    def fake(requested=None):
        calls.append(requested)
        return {"threads": requested}

    monkeypatch.setattr(hybridlm.threads, "configure_threads", fake)
    assert main(["config", "--preset", "tiny-super", "--threads", "3"]) == 0
    assert calls == [3]
    assert "vocab_size" in capsys.readouterr().out
