"""The pretraining loop: exact resume (in-process and after SIGKILL, past damaged checkpoints),
an earlier run kept unless resumed or overwritten, NaN guard, accumulation equivalence, eval bits
per byte, and a tiny tinyshakespeare run whose loss falls."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _tiny import tiny_run
from hybridlm.data.bpb import token_byte_lengths
from hybridlm.data.config import DataConfig, SourceConfig
from hybridlm.io import load_model
from hybridlm.io.checkpoint import latest_checkpoint, list_checkpoints, read_meta
from hybridlm.report.plot import read_metrics
from hybridlm.train.config import RunConfig
from hybridlm.train.stages.pretrain import run_pretrain
from hybridlm.train.text_training import pretrain_trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def losses(out_dir) -> list[tuple]:
    rows = read_metrics(Path(out_dir) / "metrics.jsonl")
    return [
        (r["kind"], r["step"], r.get("loss"), r.get("ce"), r.get("eval_loss"), r.get("lr"))
        for r in rows
        if r["kind"] in ("train", "eval")
    ]


def test_exact_resume_in_process(tmp_path):
    full = run_pretrain(tiny_run(tmp_path, "full", plot=True))
    assert full["step"] == 8 and Path(full["plot"]).is_file()
    assert Path(full["checkpoint"]).name == "step_00000008"
    # a run that dies after step 4 (checkpoint at 3; step 4 logged, never saved) and resumes
    cfg = tiny_run(tmp_path, "crash")
    run_pretrain(cfg, until_step=4)
    assert latest_checkpoint(cfg.train.out_dir).name == "step_00000003"
    resumed = run_pretrain(cfg, resume=True)
    assert resumed["step"] == 8
    assert losses(tmp_path / "crash") == losses(tmp_path / "full")
    assert len([r for r in losses(tmp_path / "full") if r[0] == "train"]) == 8
    # keep_last_n=3 (default) over saves at 3, 6, 8
    names = [p.name for p in list_checkpoints(cfg.train.out_dir)]
    assert names == ["step_00000003", "step_00000006", "step_00000008"]


def test_long_and_short_sequences_alternate_and_resume_exactly(tmp_path):
    """`data.alternate` (Nemotron 3 Super §2.6 LC-2): rows of 64 and 16 tokens in turn from a
    warm-started model with YaRN; a run killed after step 4 resumes to the same losses."""
    from hybridlm.config import YarnConfig
    from hybridlm.data.config import AlternateConfig

    base = tiny_run(tmp_path, "base", max_steps=2, eval_interval=0, checkpoint_interval=2)
    base.model.attention.rope_theta = 10_000.0
    run_pretrain(base)

    def long_run(out):
        cfg = tiny_run(tmp_path, out, seq_len=64, init_from=str(tmp_path / "base"))
        cfg.data.alternate = AlternateConfig(seq_len=16, batch_size=4, batches=1)
        cfg.train.yarn = YarnConfig(factor=2.0, original_max_position_embeddings=32)
        return cfg

    full = run_pretrain(long_run("full"))
    cfg = long_run("crash")
    run_pretrain(cfg, until_step=4)
    run_pretrain(cfg, resume=True)
    assert losses(tmp_path / "crash") == losses(tmp_path / "full")
    rows = [r for r in read_metrics(tmp_path / "full" / "metrics.jsonl") if r["kind"] == "train"]
    # 2 x 64 and 4 x 16 tokens in turn
    assert min(r["valid_tokens"] for r in rows[::2]) > max(r["valid_tokens"] for r in rows[1::2])
    saved = read_meta(Path(full["checkpoint"]))["run_config"]["model"]["attention"]["yarn"]
    assert saved["factor"] == 2.0 and saved["original_max_position_embeddings"] == 32


def test_resume_falls_back_past_damaged_checkpoints(tmp_path, capsys):
    cfg = tiny_run(tmp_path, "run", checkpoint_interval=2, eval_interval=0)
    run_pretrain(cfg, until_step=7)  # checkpoints at 2, 4, 6; step 7 logged, never saved
    ckpts = list_checkpoints(cfg.train.out_dir)
    assert [p.name for p in ckpts] == ["step_00000002", "step_00000004", "step_00000006"]
    weights = ckpts[2] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # the newest truncated (a full disk)
    capsys.readouterr()
    trainer = pretrain_trainer(cfg, resume=True)
    assert trainer.step == 4 and trainer.resumed_from == ckpts[1]
    printed = capsys.readouterr().out.splitlines()
    skipped = [line for line in printed if "skipped damaged checkpoint" in line]
    assert len(skipped) == 1 and str(ckpts[2]) in skipped[0] and "bytes" in skipped[0]
    assert f"resumed from {ckpts[1]} at step 4" in printed[-1]
    assert max(r[1] for r in losses(cfg.train.out_dir)) == 4  # rows after step 4 dropped
    # a checkpoint whose bytes changed at the same size: only its checksum tells
    opt = ckpts[1] / "optimizer.pt"
    data = bytearray(opt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    opt.write_bytes(bytes(data))
    trainer = pretrain_trainer(cfg, resume=True)
    assert trainer.step == 2 and trainer.resumed_from == ckpts[0]
    assert "optimizer.pt does not match its SHA-256" in capsys.readouterr().out
    trainer.train()  # and the run goes on to its end from there
    assert [p.name for p in list_checkpoints(cfg.train.out_dir)][-1] == "step_00000008"
    assert [r[1] for r in losses(cfg.train.out_dir) if r[0] == "train"] == list(range(1, 9))


def test_a_new_run_keeps_an_earlier_one_unless_resumed_or_overwritten(tmp_path):
    cfg = tiny_run(tmp_path, "run", max_steps=4, eval_interval=0)
    run_pretrain(cfg, until_step=3)
    metrics = Path(cfg.train.out_dir) / "metrics.jsonl"
    before = metrics.read_bytes()
    with pytest.raises(ValueError, match="already holds a run"):
        run_pretrain(cfg)
    assert metrics.read_bytes() == before and latest_checkpoint(cfg.train.out_dir) is not None
    run_pretrain(cfg, resume=True)  # from the checkpoint at 3: rows up to 3 kept, 4 appended
    assert metrics.read_bytes().startswith(before)
    assert [r[1] for r in losses(cfg.train.out_dir) if r[0] == "train"] == [1, 2, 3, 4]
    run_pretrain(cfg, overwrite=True)
    assert [r[1] for r in losses(cfg.train.out_dir) if r[0] == "train"] == [1, 2, 3, 4]


def test_nan_gradient_step_is_skipped_and_reported(tmp_path):
    trainer = pretrain_trainer(tiny_run(tmp_path, "nan", max_steps=4, eval_interval=0))
    w = trainer.model.lm_head.weight

    def poison(grad):
        return grad * math.nan if trainer.step == 1 else grad

    handle = w.register_hook(poison)
    trainer.train_step()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    bias_before = trainer.model.moe_layers()[0].gate.e_score_correction_bias.clone()
    m = trainer.train_step()
    assert m["skipped"] and trainer.skipped_steps == 1 and not math.isfinite(m["grad_norm"])
    for n, p in trainer.model.named_parameters():  # no update at all
        assert torch.equal(p, before[n]), n
    assert torch.equal(trainer.model.moe_layers()[0].gate.e_score_correction_bias, bias_before)
    handle.remove()
    assert not trainer.train_step()["skipped"]
    # through the loop: the skip is reported in metrics.jsonl
    trainer2 = pretrain_trainer(tiny_run(tmp_path, "nan2", max_steps=3, eval_interval=0))
    h = trainer2.model.lm_head.weight.register_hook(
        lambda g: g * math.nan if trainer2.step == 1 else g
    )
    result = trainer2.train()
    h.remove()
    rows = read_metrics(trainer2.metrics_path)
    assert [r["step"] for r in rows if r["kind"] == "skip"] == [2]
    assert [r["skipped_steps"] for r in rows if r["kind"] == "train"] == [0, 1, 1]
    assert result["skipped_steps"] == 1
    state = trainer2.optimizer.state[trainer2.model.lm_head.weight]
    assert int(state["step"]) == 2  # 3 steps, one skipped


def test_accumulation_matches_a_larger_batch(tmp_path):
    def one_step(batch_size, accum):
        cfg = tiny_run(tmp_path, f"acc{batch_size}", grad_accum=accum, grad_clip=0.0)
        cfg.data.batch_size = batch_size
        trainer = pretrain_trainer(cfg)
        grads = {}
        step = trainer.optimizer.step

        def capture(*a, **kw):
            grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
            return step(*a, **kw)

        trainer.optimizer.step = capture
        m = trainer.train_step()
        return m, grads

    m2, g2 = one_step(2, 1)
    m1, g1 = one_step(1, 2)
    assert m1["valid_tokens"] == m2["valid_tokens"]
    # relative, none of them is ~0 (moe_aux ~3e-4, where an absolute 1e-7 allowed 3e-4 of it);
    # measured <= 2.1e-7 (ce), moe_aux 1e-7
    for key in ("loss", "ce", "mtp", "moe_aux"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-6), key
    for n in g2:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=n)


def test_z_loss_and_bf16_run(tmp_path):
    cfg = tiny_run(tmp_path, "z", max_steps=2, z_loss=1e-4, precision="bf16", eval_interval=0)
    trainer = pretrain_trainer(cfg)
    m = trainer.train_step()
    assert m["z_loss"] > 0 and math.isfinite(m["loss"])


def test_tensorboard_mirrors_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_pretrain(tiny_run(tmp_path, "tb", max_steps=4, eval_interval=2, tensorboard=True))
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard")).Reload()
    tags = events.Tags()["scalars"]
    assert "train/loss" in tags and "eval/eval_bpb" in tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]


def test_eval_bits_per_byte_byte_tokenizer(tmp_path):
    from hybridlm.data.tokenizer import ByteTokenizer

    table = token_byte_lengths(ByteTokenizer(), 260)
    assert table[:256].sum() == 256 and table[256:].sum() == 0
    trainer = pretrain_trainer(tiny_run(tmp_path, "eval"))
    ev = trainer.module.evaluate()
    # byte tokenizer: every target is one byte except EOS, so bpb ~ nats/token / ln 2
    assert ev["eval_bpb"] >= ev["eval_loss"] / math.log(2)
    assert ev["eval_loss"] == pytest.approx(math.log(258), rel=0.1)  # untrained


def test_tiny_tinyshakespeare_run_loss_falls(tmp_path):
    cfg = tiny_run(
        tmp_path,
        "ts",
        max_steps=40,
        lr=3e-3,
        warmup_steps=5,
        log_interval=1,
        eval_interval=20,
        checkpoint_interval=0,
    )
    cfg.data = DataConfig(
        sources=[
            SourceConfig(name="ts", kind="tinyshakespeare", group_chars=2000)  # packaged
        ],
        shards_dir=str(tmp_path / "ts_shards"),
        seq_len=64,
        batch_size=4,
        eval_docs=8,
        eval_split="last",
        num_workers=0,
    )
    result = run_pretrain(cfg)
    rows = [r for r in read_metrics(result["metrics"]) if r["kind"] == "train"]
    evals = [r for r in read_metrics(result["metrics"]) if r["kind"] == "eval"]
    first, last = rows[0]["ce"], sum(r["ce"] for r in rows[-5:]) / 5
    assert last < first - 1.5, (first, last)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] and evals[-1]["eval_bpb"] < 4.5


SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from hybridlm.train.config import RunConfig
from hybridlm.train.stages.pretrain import run_pretrain
run_pretrain(RunConfig.load(sys.argv[1]), resume=sys.argv[2] == "1")
"""


def test_exact_resume_after_sigkill(tmp_path):
    """~10 s on 2 cores (under the 20 s bar for `slow`)."""
    cfg = tiny_run(tmp_path, "killed", max_steps=40, checkpoint_interval=5, eval_interval=10)
    cfg.save(tmp_path / "run.yaml")
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(tmp_path / "script.py"), str(tmp_path / "run.yaml")]
    proc = subprocess.Popen([*cmd, "0"], env=env)
    deadline = time.time() + 120
    while latest_checkpoint(cfg.train.out_dir) is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = latest_checkpoint(cfg.train.out_dir)
    assert killed_at is not None and killed_at.name != "step_00000040", "killed too late"
    subprocess.run([*cmd, "1"], env=env, check=True)
    ref = tiny_run(tmp_path, "ref", max_steps=40, checkpoint_interval=5, eval_interval=10)
    torch.set_num_threads(1)
    run_pretrain(ref)
    assert losses(tmp_path / "killed") == losses(tmp_path / "ref")
    meta = json.loads((latest_checkpoint(cfg.train.out_dir) / "meta.json").read_text())
    assert meta["step"] == 40


def test_intra_doc_masking_passes_doc_ids(tmp_path):
    runs = [tiny_run(tmp_path, "mask_on", intra_doc_masking=True), tiny_run(tmp_path, "mask_off")]
    for cfg in runs:  # long rows: several documents per row
        cfg.data.seq_len = 256
        cfg.data.shards_dir = str(tmp_path / "shards256")
    on, off = pretrain_trainer(runs[0]), pretrain_trainer(runs[1])
    if not on.module.accepts_doc_ids:
        pytest.skip("HybridLM.forward takes no doc_ids yet")
    m_on, m_off = on.train_step(), off.train_step()
    assert math.isfinite(m_on["loss"]) and m_on["valid_tokens"] == m_off["valid_tokens"]
    assert m_on["ce"] != m_off["ce"]  # packed rows hold several documents


def test_warm_start_continues_a_pretrained_model_with_a_fresh_schedule(tmp_path):
    """`train.init_from` (midtraining, Olmo 3 §4): the run starts from the checkpoint's weights
    and architecture (the run's `model` section is not used), with a fresh optimizer and
    schedule (linear decay to zero), on another mixture; its first loss is the pretrained
    model's, far below a fresh model's."""
    base = tiny_run(tmp_path, "base", max_steps=6, eval_interval=0, checkpoint_interval=6)
    run_pretrain(base)
    mid = tiny_run(
        tmp_path,
        "mid",
        max_steps=4,
        warmup_steps=0,
        schedule="linear",
        min_lr=0.0,
        lr=1e-3,
        eval_interval=0,
        init_from=str(tmp_path / "base"),
    )
    mid.model = "tiny-super"  # ignored: the architecture comes from the checkpoint
    mid.data.sources.append(SourceConfig(name="bard", kind="tinyshakespeare", weight=0.5))
    mid.data.shards_dir = str(tmp_path / "shards_mid")
    trainer = pretrain_trainer(mid)
    loaded = load_model(tmp_path / "base")
    for (name, p), q in zip(
        trainer.model.state_dict().items(), loaded.state_dict().values(), strict=True
    ):
        assert torch.equal(p, q), name
    assert trainer.step == 0 and not trainer.optimizer.state  # fresh optimizer and schedule
    result = trainer.train()
    rows = [r for r in read_metrics(tmp_path / "mid" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["lr"] for r in rows] == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    fresh = [r for r in read_metrics(tmp_path / "base" / "metrics.jsonl") if r["kind"] == "train"]
    assert rows[0]["loss"] < fresh[0]["loss"] - 1.0  # continues the pretrained model
    ckpt = Path(result["checkpoint"])
    assert read_meta(ckpt)["run_config"]["model"] == loaded.config.to_dict()


def test_midtrain_and_long_context_configs_chain_warm_starts():
    configs = Path(__file__).parents[1] / "configs"
    mid = RunConfig.load(configs / "midtrain.yaml")
    assert mid.train.init_from == "runs/speedrun/pretrain" and mid.train.schedule == "linear"
    assert mid.train.min_lr == 0.0 and mid.data.seq_len == 256
    lc = RunConfig.load(configs / "long_context.yaml")
    assert lc.train.init_from == mid.train.out_dir and lc.data.seq_len == 4 * mid.data.seq_len
    assert lc.data.alternate.seq_len == mid.data.seq_len and lc.train.intra_doc_masking
    weights = {s.name: s.weight for s in lc.data.sources}
    assert weights["long_code"] + weights["long_tasks"] == pytest.approx(0.34)  # Olmo 3 §5
