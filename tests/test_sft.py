"""The SFT loop: packed per-conversation loss == unpacked reference, two-stage switch, a tiny
run whose assistant-token loss falls, exact resume, init from a checkpoint, config + CLI."""

import argparse
import json
import math

import pytest
import torch

from _tiny import tiny_train_model
from hybridlm.cli.train import register
from hybridlm.config import apply_overrides
from hybridlm.data.sft import arithmetic_conversations, collate_rows, encode_chat
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.io import load_model
from hybridlm.report.plot import read_metrics
from hybridlm.train.config import TrainConfig
from hybridlm.train.objectives import causal_lm_loss
from hybridlm.train.post_training import ChatSource, SFTDataConfig, prompt_key, split_held_out
from hybridlm.train.stages.sft import SFTConfig, SFTRunConfig, run_sft, sft_trainer
from hybridlm.train.trainer import Step

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_sft(out, *, steps=12, rows=120, **sft) -> SFTRunConfig:
    return SFTRunConfig(
        model=tiny_train_model(),
        data=SFTDataConfig(
            sources=[ChatSource(kind="arithmetic", max_rows=rows, digits=1, seed=3)],
            seq_len=256,
            batch_size=4,
            held_out=8,
        ),
        train=TrainConfig(
            lr=3e-3,
            warmup_steps=2,
            max_steps=steps,
            schedule="constant",
            eval_interval=0,
            log_interval=1,
            checkpoint_interval=4,
            keep_last_n=0,
            out_dir=str(out),
            progress=False,
            plot=False,
        ),
        sft=SFTConfig(eval_generate=0, **sft),
    )


def test_packed_sample_loss_equals_unpacked_per_conversation_mean(tmp_path):
    """The per-conversation mean over a packed row equals, conversation by conversation, the
    losses of unpacked forwards: packing leaks nothing across conversations (attention, Mamba
    state, MTP targets), and the sample normalisation is (1/|C|) sum_c mean_t l_t."""
    tr = sft_trainer(tiny_sft(tmp_path)).module
    tr.model.eval()
    ex = tr.loader.examples
    rows = [r for r in tr.loader._epoch_rows(0) if len(r) >= 2][:2]
    batch = collate_rows(ex, rows, 256)
    n_tok, n_conv = int(batch["num_loss_tokens"]), int(batch["num_conversations"])
    with torch.no_grad():
        ctx = {"norm": "sample", "num_tokens": n_tok, "num_convs": n_conv}
        packed = tr.loss(batch, Step([batch], ctx=ctx)).metrics
        ce_means, mtp_means = [], []
        for i in [i for r in rows for i in r]:
            ids = torch.tensor([ex[i].input_ids])
            mask = torch.tensor([ex[i].loss_mask])
            mask[0, 0] = False
            labels = torch.where(mask, ids, -100)
            out = tr.model(ids, mtp_depth=tr.mtp_depth)
            _, parts = causal_lm_loss(tr.model, out, labels)  # means over this conversation
            ce_means.append(float(parts["ce"]))
            mtp_means.append(float(parts["mtp"]))
    assert len(ce_means) == n_conv >= 4
    assert packed["ce"] == pytest.approx(sum(ce_means) / n_conv, rel=1e-5)
    # MTP depth k: targets within the conversation, each depth a per-conversation mean over
    # the targets that exist (the model's own per-conversation mean has the same count)
    assert packed["mtp"] == pytest.approx(sum(mtp_means) / n_conv, rel=1e-4)


def test_two_stage_switch_and_tiny_run_learns(tmp_path):
    cfg = tiny_sft(tmp_path, steps=24, loss_norm="two_stage", stage2_start=0.5)
    cfg.train.eval_interval = 24
    result = run_sft(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["norm"] for r in train] == ["token"] * 12 + ["sample"] * 12
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 24]
    # held-out assistant-token NLL falls by more than half (from ~ln 258 at init)
    assert evals[0]["eval_loss"] > 4.0 and evals[-1]["eval_loss"] < 0.5 * evals[0]["eval_loss"]
    first = sum(r["nll_token"] for r in train[:3]) / 3
    last = sum(r["nll_token"] for r in train[-3:]) / 3
    assert last < 0.5 * first
    assert all(r["mtp"] > 0 and math.isfinite(r["loss"]) for r in train)
    data = [r for r in rows if r["kind"] == "data"][0]
    removed = data["dropped"].get("prompt of a held-out conversation", 0)
    assert data["train_conversations"] + data["held_out"] + removed == 120
    assert result["checkpoint"].endswith("step_00000024")
    assert (tmp_path / "run.yaml").is_file()


def test_exact_resume(tmp_path):
    full = run_sft(tiny_sft(tmp_path / "a", steps=8))
    run_sft(tiny_sft(tmp_path / "b", steps=8), until_step=4)
    resumed = run_sft(tiny_sft(tmp_path / "b", steps=8), resume=True)
    la = [r["loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r["kind"] == "train"]
    lb = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if r["kind"] == "train"]
    assert la == lb and len(la) == 8
    assert full["step"] == resumed["step"] == 8


def test_bad_rows_of_a_chat_file_are_skipped_and_counted(tmp_path, capsys):
    convs = arithmetic_conversations(40, seed=3, digits=1)
    lines = [json.dumps({"messages": c}).encode() for c in convs]
    lines[5] = lines[5].replace(b'"user"', b'"us\xffer"')  # one invalid UTF-8 byte
    lines[9] = lines[9][:-3]  # a cut line: not JSON
    (tmp_path / "chat.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    cfg = tiny_sft(tmp_path / "run", steps=4)
    cfg.data.sources = [ChatSource(kind="file", path=str(tmp_path / "chat.jsonl"))]
    result = run_sft(cfg)
    read = result["data"]["read"]
    assert read.startswith("38/40 rows kept")
    assert "1 skipped: invalid UTF-8 (first at row 5)" in read
    assert "1 skipped: invalid JSON line (first at row 9)" in read
    data = result["data"]
    assert data["train_conversations"] + data["held_out"] <= 38 and result["step"] == 4
    # the same run again: an error, the log kept; --resume / --overwrite go on
    log = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match="already holds a run"):
        run_sft(cfg)
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == log
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
    (ckpt / "optimizer.pt").write_bytes(b"")  # damaged, and the only checkpoint
    with pytest.raises(ValueError, match="no intact checkpoint .*optimizer.pt has 0 bytes"):
        run_sft(cfg, resume=True)
    capsys.readouterr()
    assert run_sft(cfg, overwrite=True)["step"] == 4
    assert "overwrite: removed metrics.jsonl, checkpoints/" in capsys.readouterr().out


def test_init_from_checkpoint_and_errors(tmp_path):
    run_sft(tiny_sft(tmp_path / "a", steps=4))
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000004"
    model = load_model(str(ckpt))
    warm = tiny_sft(tmp_path / "b")
    warm.train.init_from = str(ckpt)
    trained = sft_trainer(warm).module
    for (n, p), (_, q) in zip(
        model.state_dict().items(), trained.model.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="neither a transformers directory"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="loss_norm"):
        SFTConfig(loss_norm="mean")
    with pytest.raises(ValueError, match="needs max_rows"):
        ChatSource(kind="arithmetic")
    with pytest.raises(ValueError, match="data.sources is empty"):
        cfg = tiny_sft(tmp_path / "c")
        cfg.data.sources = []
        sft_trainer(cfg)


def test_config_round_trip_overrides_and_cli(tmp_path):
    cfg = tiny_sft(tmp_path / "run", steps=2)
    path = tmp_path / "sft.yaml"
    cfg.save(path)
    again = SFTRunConfig.load(path)
    assert again.to_dict() == cfg.to_dict()
    new = apply_overrides(again, ["train.max_steps=3", "data.sources.0.max_rows=50"])
    assert new.train.max_steps == 3 and new.data.sources[0].max_rows == 50
    with pytest.raises(ValueError, match="unknown key"):
        apply_overrides(again, ["train.nope=1"])
    with pytest.raises(ValueError, match="unknown section"):
        apply_overrides(again, ["optim.lr=1"])
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sft", "--config", str(path), "--set", "train.max_steps=2"])
    args.fn(args)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert max(r["step"] for r in rows) == 2


def test_held_out_split_is_decontaminated():
    convs = arithmetic_conversations(50, seed=0, digits=1)  # 1-digit: questions repeat
    train, held, removed = split_held_out(convs, 10, seed=0)
    held_prompts = {prompt_key(c) for c in held}
    assert len(held) == 10 and removed > 0 and len(train) + removed + 10 == 50
    assert not any(prompt_key(c) in held_prompts for c in train)


def test_shipped_config_loads():
    cfg = SFTRunConfig.load("configs/sft.yaml")
    assert cfg.sft.loss_norm == "two_stage" and cfg.sft.mtp_weight == 0.3
    assert cfg.data.reasoning.reasoning_off == 0.03 and cfg.data.reasoning.budget == 0.12


@pytest.mark.slow
def test_gsm8k_sft_run(tmp_path):
    """A few steps on real GSM8K conversations (worked solutions as reasoning traces)."""
    cfg = tiny_sft(tmp_path, steps=16)
    cfg.data.sources = [ChatSource(kind="gsm8k", max_rows=200)]  # the packaged train split
    cfg.data.seq_len, cfg.data.overflow = 768, "truncate"
    cfg.train.eval_interval = 16
    run_sft(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    evals = [r["eval_loss"] for r in rows if r["kind"] == "eval"]
    assert evals[-1] < evals[0] - 1.0
    tok = ByteTokenizer()
    assert encode_chat(arithmetic_conversations(1)[0], tok).num_loss_tokens > 0
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["kind"] == "data"
