"""Checkpoint merging of a run (train/stages/merge.py, `hybridlm merge`): the merged weights are the
hand-computed weighted average, the lowest-eval-loss candidate is exported, and a window larger
than the run's checkpoints is an actionable error."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _tiny import tiny_train_model
from hybridlm.cli import main as cli_main
from hybridlm.data.config import DataConfig, SourceConfig
from hybridlm.io import load_model
from hybridlm.io.checkpoint import list_checkpoints
from hybridlm.train.checkpoint import merge_checkpoints
from hybridlm.train.config import RunConfig, TrainConfig
from hybridlm.train.stages.merge import checkpoints_kept, merge_run, soup_runs
from hybridlm.train.stages.pretrain import run_pretrain

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_run(tmp: Path, out: str, seed: int = 0) -> Path:
    """A 5-step tiny run, a checkpoint every step, the last 4 kept."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    txt = tmp / "txt"
    if not txt.is_dir():
        txt.mkdir()
        for i in range(12):
            (txt / f"{i:02d}.txt").write_text(f"Story {i}. " + "A fox met a crow. " * (i % 5 + 2))
    m = tiny_train_model(mtp=False)
    data = DataConfig(
        sources=[SourceConfig(name="t", kind="text", path=str(txt), max_files=6)],
        shards_dir=str(tmp / "shards"),
        seq_len=64,
        batch_size=2,
        eval_fraction=0.2,
        num_workers=0,
    )
    train = TrainConfig(
        max_steps=5,
        warmup_steps=1,
        lr=3e-3,
        log_interval=1,
        eval_interval=0,
        checkpoint_interval=1,
        keep_last_n=4,
        out_dir=str(tmp / out),
        seed=seed,
        peak_flops=1e11,
        progress=False,
        plot=False,
    )
    run_pretrain(RunConfig(model=m, data=data, train=train))
    torch.set_num_threads(before)
    return tmp / out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return _tiny_run(tmp_path_factory.mktemp("merge"), "run")


def test_merged_weights_are_the_weighted_average(run_dir):
    ckpts = list_checkpoints(run_dir)
    assert [p.name for p in ckpts] == [f"step_0000000{i}" for i in (2, 3, 4, 5)]
    states = [load_file(str(p / "model.safetensors")) for p in ckpts[-3:]]
    c = [(math.sqrt(j) - math.sqrt(j - 1)) / math.sqrt(3) for j in (1, 2, 3)]  # minus-sqrt
    merged = merge_checkpoints(ckpts[-3:], "minus_sqrt")
    for key, ref in states[0].items():
        if not ref.is_floating_point():
            continue
        want = sum(w * s[key].double() for w, s in zip(c, states, strict=True))
        torch.testing.assert_close(merged[key].double(), want, rtol=1e-6, atol=1e-7)
    # the weights differ between checkpoints, so this is not a trivial average
    assert any(not torch.equal(states[0][k], states[-1][k]) for k in states[0])


def test_merge_command_picks_lowest_loss_and_exports_it(run_dir, tmp_path, capsys):
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    out = tmp_path / "merged"
    rc = cli_main(
        [
            "merge",
            "--run",
            str(run_dir),
            "--windows",
            "2,4",
            "--weights",
            "uniform,minus_sqrt",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "<- best" in printed and "delta vs last" in printed
    report = json.loads((out / "merge.json").read_text())
    rows = report["candidates"]
    assert [(r["window"], r["weights"]) for r in rows] == [
        (1, "last"),
        (2, "uniform"),
        (2, "minus_sqrt"),
        (4, "uniform"),
        (4, "minus_sqrt"),
    ]
    assert all(math.isfinite(r["eval_loss"]) and r["eval_bpb"] > 0 for r in rows)
    assert len({round(r["eval_loss"], 9) for r in rows}) > 1  # the merges really differ
    best = min(rows, key=lambda r: r["eval_loss"])
    assert report["best"] == best
    assert rows[0]["delta_vs_last"] == 0.0
    # the export holds exactly the best candidate's weights
    kind = "uniform" if best["weights"] == "last" else best["weights"]
    want = merge_checkpoints(list_checkpoints(run_dir)[-best["window"] :], kind)
    exported = load_model(out).state_dict()
    for key, value in want.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0)
    # the run's own log is untouched by the evaluation trainer
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before


def test_window_larger_than_the_run_is_an_actionable_error(run_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"has 4 checkpoint\(s\) but window 6 .*keep_last_n"):
        merge_run(run_dir, windows=[2, 6], out=tmp_path / "m")
    rc = cli_main(["merge", "--run", str(run_dir), "--windows", "5", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and "--windows up to 4" in err
    # the run saved 5 and kept 4: the setting to change, with its value
    assert "(train.keep_last_n: 4 keeps the last 4)" in err, err
    assert err.endswith("or train the run again with --set train.keep_last_n=5"), err
    with pytest.raises(ValueError, match=r"again with --set train.keep_last_n=7 .*max_steps=7$"):
        merge_run(run_dir, windows=[7], out=tmp_path / "m")  # 5 steps cannot save 7
    with pytest.raises(ValueError, match="unknown merge weighting"):
        merge_run(run_dir, windows=[2], weights=["ema"])


def test_the_quickstart_run_keeps_the_checkpoints_the_readmes_merge_row_averages():
    """README: `hybridlm merge --run runs/quickstart --windows 2,3` after `hybridlm pretrain`
    (configs/quickstart.yaml): the run must keep as many checkpoints as the largest window."""
    root = Path(__file__).resolve().parents[1]
    row = re.search(r"hybridlm merge --run runs/quickstart --windows ([\d,]+)", _readme(root))
    windows = [int(w) for w in row.group(1).split(",")] if row else [2, 3]
    tc = RunConfig.load(root / "configs" / "quickstart.yaml").train
    assert checkpoints_kept(tc) >= max(windows), (tc.keep_last_n, tc.checkpoint_interval)
    assert checkpoints_kept(TrainConfig(max_steps=10, checkpoint_interval=4, keep_last_n=0)) == 3
    assert checkpoints_kept(TrainConfig(max_steps=12, checkpoint_interval=4, keep_last_n=2)) == 2
    assert checkpoints_kept(TrainConfig(max_steps=12, checkpoint_interval=0)) == 1


def _readme(root: Path) -> str:
    path = root / "README.md"
    return path.read_text() if path.is_file() else ""


def test_soup_of_two_seeds_evaluates_every_candidate_and_exports_the_best(
    run_dir, tmp_path, capsys
):
    """`hybridlm soup` (Olmo 3 §4-5): each run's last checkpoint, each run's last-2 average and
    the uniform soup of all four are scored on the held-out split; the export is the best."""
    other = _tiny_run(run_dir.parent, "run_seed1", seed=1)
    out = tmp_path / "soup"
    rc = cli_main(["soup", "--runs", f"{run_dir},{other}", "--last", "2", "--out", str(out)])
    assert rc == 0 and "<- best" in capsys.readouterr().out
    report = json.loads((out / "soup.json").read_text())
    rows = report["candidates"]
    assert [r["candidate"] for r in rows] == [
        f"{run_dir}: last",
        f"{other}: last",
        f"{run_dir}: last 2",
        f"{other}: last 2",
        "soup of 4",
    ]
    assert all(math.isfinite(r["eval_loss"]) for r in rows)
    assert len({round(r["eval_loss"], 9) for r in rows}) == len(rows)
    best = min(rows, key=lambda r: r["eval_loss"])
    assert report["best"] == best
    want = merge_checkpoints(best["checkpoints"], "uniform")
    exported = load_model(out).state_dict()
    for key, value in want.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0)
    # the soup is the plain average of the four checkpoints
    soup = merge_checkpoints(rows[-1]["checkpoints"], "uniform")
    ckpts = [load_file(str(Path(p) / "model.safetensors")) for p in rows[-1]["checkpoints"]]
    key = next(iter(soup))
    torch.testing.assert_close(soup[key], sum(c[key] for c in ckpts) / 4)
    with pytest.raises(ValueError, match="soup of one checkpoint"):
        soup_runs([run_dir], last=1)
    with pytest.raises(ValueError, match="--last 9 needs 9"):
        soup_runs([run_dir, other], last=9)


def test_export_falls_back_to_a_checkpoint_for_architectures_transformers_lacks(tmp_path):
    """RoPE attention next to Mamba-2 has no transformers class: the best merge is written as a
    training checkpoint instead, which hybridlm.io loads with its config (YaRN included)."""
    from hybridlm.config import YarnConfig
    from hybridlm.data.tokenizer import ByteTokenizer
    from hybridlm.model.model import HybridLM
    from hybridlm.train.stages.merge import export

    cfg = tiny_train_model(mtp=False)
    cfg.attention.rope_theta = 10_000.0
    model = HybridLM(cfg, seed=0)
    model.extend_context(256, YarnConfig(factor=2.0, original_max_position_embeddings=32))
    run = RunConfig(model=cfg, data=DataConfig(), train=TrainConfig(max_steps=1))
    kind = export(model, tmp_path / "out", run, ByteTokenizer())
    assert kind.startswith("training checkpoint (cannot export to transformers")
    again = load_model(tmp_path / "out")
    assert again.config.attention.yarn == model.config.attention.yarn
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    plain = HybridLM(tiny_train_model(mtp=False), seed=0)
    assert export(plain, tmp_path / "hf", run, ByteTokenizer()) == "HF export"
