"""Distillation: the offline loss equals `distill_loss` / the skew reverse KL on the same logits,
a tiny student distilled from a tiny teacher closes the KL, on-policy routing scores each
prompt's samples with its domain's teacher, actionable config errors, the CLI end to end."""

import argparse
import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from _tiny import tiny_train_model
from hybridlm.cli.train import register
from hybridlm.config import apply_overrides
from hybridlm.io.checkpoint import save_checkpoint
from hybridlm.model.model import build_model
from hybridlm.report.plot import read_metrics
from hybridlm.train.config import TrainConfig
from hybridlm.train.distillation import (
    DistillConfig,
    DistillRunConfig,
    PromptSource,
    offline_distill_loss,
)
from hybridlm.train.objectives import distill_loss, skew_reverse_kl
from hybridlm.train.post_training import ChatSource, SFTDataConfig
from hybridlm.train.stages.distill import distill_trainer, run_distill

pytestmark = pytest.mark.usefixtures("one_thread")


def save_teacher(tmp, name, cfg, *, seed, sharpen=1.0):
    """A hybridlm training checkpoint of a freshly initialised `cfg` (weights from `seed`);
    `sharpen` scales the LM head so that the teacher's distributions are far from uniform."""
    model = build_model(cfg, seed=seed, device=torch.device("cpu"))
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    meta = {"run_config": {"model": cfg.to_dict(), "data": {"tokenizer": "byte"}}}
    return str(save_checkpoint(tmp / name, step=1, model=model, optimizer=None, meta=meta))


def small_student():
    """A smaller student than `tiny_train_model` (one Mamba + one attention layer, no MTP)."""
    m = tiny_train_model(mtp=False)
    m.pattern = "M*"
    m.validate()
    return m


def offline_run(tmp, teacher, *, steps=6, **distill) -> DistillRunConfig:
    return DistillRunConfig(
        model=small_student(),
        data=SFTDataConfig(
            sources=[ChatSource(kind="arithmetic", max_rows=80, digits=1, seed=3)],
            seq_len=128,
            batch_size=4,
            held_out=8,
        ),
        train=TrainConfig(
            lr=3e-3,
            min_lr=3e-4,
            schedule="linear",
            warmup_steps=1,
            weight_decay=0.0,
            max_steps=steps,
            eval_interval=0,
            log_interval=1,
            checkpoint_interval=0,
            keep_last_n=0,
            out_dir=str(tmp / "out"),
            device="cpu",
            progress=False,
            plot=False,
        ),
        distill=DistillConfig(teacher=teacher, eval_generate=2, eval_max_new_tokens=4, **distill),
    )


# ---------------------------------------------------------------------------- the loss
def test_offline_loss_equals_distill_loss_on_the_same_logits():
    torch.manual_seed(0)
    B, L, V = 2, 7, 11
    s_BLV = torch.randn(B, L, V, dtype=torch.float64, requires_grad=True)
    t_BLV = torch.randn(B, L, V, dtype=torch.float64)
    labels_BL = torch.randint(0, V, (B, L))
    labels_BL[0, :3] = -100  # prompt tokens
    labels_BL[1, 5:] = -100
    denom = 13  # the step's global token count (other micro-batches hold the rest)
    cfg = DistillConfig(teacher="t", top_k=4)
    loss, parts = offline_distill_loss(s_BLV, t_BLV, labels_BL, cfg, denom=denom)
    # reference: logits at t predict labels[t + 1]; keep the valid positions by hand
    rows = [(b, t) for b in range(B) for t in range(L - 1) if labels_BL[b, t + 1] != -100]
    s_TV = torch.stack([s_BLV[b, t] for b, t in rows])
    t_TV = torch.stack([t_BLV[b, t] for b, t in rows])
    tgt_T = torch.stack([labels_BL[b, t + 1] for b, t in rows])
    top_TK, ids_TK = t_TV.topk(4, dim=-1)
    ref, ref_parts = distill_loss(s_TV, tgt_T, top_TK, ids_TK, denom=denom)
    torch.testing.assert_close(loss, ref)
    assert parts["kl"] == pytest.approx(float(ref_parts["kl"]))
    # top_k above the vocabulary is clamped: the full-vocabulary forward KL
    full, _ = offline_distill_loss(
        s_BLV, t_BLV, labels_BL, DistillConfig(teacher="t", top_k=128), denom=denom
    )
    ref_full, _ = distill_loss(s_TV, tgt_T, *t_TV.topk(V, dim=-1), denom=denom)
    torch.testing.assert_close(full, ref_full)
    # skew reverse KL + CE
    skew_cfg = DistillConfig(teacher="t", objective="skew_reverse_kl", skew_alpha=0.1)
    skew, _ = offline_distill_loss(s_BLV, t_BLV, labels_BL, skew_cfg, denom=denom)
    ce = F.cross_entropy(s_TV, tgt_T, reduction="sum") / denom
    ref_skew = 0.9 * skew_reverse_kl(s_TV, t_TV, alpha=0.1, denom=denom) + 0.1 * ce
    torch.testing.assert_close(skew, ref_skew)


# ---------------------------------------------------------------------------- offline run
def test_tiny_student_distilled_from_tiny_teacher_closes_the_kl(tmp_path):
    teacher = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=5, sharpen=30.0)
    run = offline_run(tmp_path, teacher, steps=8)
    run.train.lr = 1e-2
    result = run_distill(run)
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 8]
    # a fresh student is far from a (differently initialised, larger) teacher; 8 steps close it
    assert evals[-1]["eval_kl"] < 0.7 * evals[0]["eval_kl"], evals
    train = [r for r in rows if r["kind"] == "train"]
    assert train[-1]["kl"] < train[0]["kl"]
    teacher_row = next(r for r in rows if r["kind"] == "teacher")
    assert set(teacher_row) >= {"teacher_loss", "teacher_accuracy"}
    meta = json.loads((tmp_path / "out/checkpoints/step_00000008/meta.json").read_text())
    assert meta["stage"] == "distill" and meta["run_config"]["distill"]["teacher"] == teacher
    assert result["checkpoint"].endswith("step_00000008")


def test_vocabulary_mismatch_is_a_clear_error(tmp_path):
    big = tiny_train_model()
    big.vocab_size = 300
    teacher = save_teacher(tmp_path, "teacher", big, seed=1)
    with pytest.raises(ValueError, match="vocab_size 258 != teacher"):
        run_distill(offline_run(tmp_path, teacher, steps=1))


# ---------------------------------------------------------------------------- on-policy
def on_policy_run(tmp, teachers, routes, *, steps=1, loss="full") -> DistillRunConfig:
    run = offline_run(tmp, "", steps=steps)
    run.model = tiny_train_model(mtp=False)
    run.data.held_out = 2
    run.distill = DistillConfig(
        mode="on_policy",
        teachers=teachers,
        routes=routes,
        prompts=[
            PromptSource(domain="add", kind="arithmetic", max_rows=20, digits=1, seed=1),
            PromptSource(domain="more", kind="arithmetic", max_rows=20, digits=2, seed=2),
        ],
        prompts_per_step=4,
        max_new_tokens=6,
        on_policy_loss=loss,
        eval_generate=2,
        eval_max_new_tokens=4,
    )
    return run


def test_on_policy_routes_each_prompt_to_its_teacher(tmp_path):
    cfg = tiny_train_model(mtp=False)
    # "twin" has the student's exact initial weights (same config and seed): its reverse KL on
    # the student's first samples is 0, so a non-zero value would mean another teacher scored them
    twin = save_teacher(tmp_path, "twin", cfg, seed=0)
    other = save_teacher(tmp_path, "other", cfg, seed=9)
    run = on_policy_run(tmp_path, {"twin": twin, "other": other}, {"add": "twin", "more": "other"})
    trainer = distill_trainer(copy.deepcopy(run))
    items = trainer.module.draw(0)
    assert [it.domain for it in items] == ["add", "more", "add", "more"]  # even over domains
    assert [trainer.module.route(it) for it in items] == ["twin", "other", "twin", "other"]
    m = trainer.train_step()
    assert m["kl/twin"] == pytest.approx(0.0, abs=1e-6)
    assert m["kl/other"] > 0.01
    assert m["tokens/twin"] + m["tokens/other"] == m["sampled_tokens"] > 0
    # the learner's log-probs of the sampled tokens are the engine's: the samples are on-policy
    assert m["logprob_gap"] < 1e-4
    trainer.module.close()
    # routing both domains to "other" scores every sample with it
    run2 = on_policy_run(
        tmp_path, {"twin": twin, "other": other}, {"add": "other", "more": "other"}
    )
    trainer2 = distill_trainer(run2)
    assert set(trainer2.module.teachers) == {"other"}  # unrouted teachers are not loaded
    m2 = trainer2.train_step()
    assert "kl/twin" not in m2 and m2["tokens/other"] == m2["sampled_tokens"]
    assert m2["kl/other"] > 0.01 and math.isfinite(m2["loss"])
    trainer2.module.close()


def test_on_policy_run_lowers_the_reverse_kl(tmp_path):
    teacher = save_teacher(tmp_path, "t", tiny_train_model(mtp=False), seed=4, sharpen=10.0)
    # 16 steps: the reverse KL falls steadily but noisily (sampled completions), ~1.3 -> ~0.95
    run = on_policy_run(tmp_path, {"t": teacher}, {"add": "t", "more": "t"}, steps=16)
    run.distill.prompts_per_step = 8
    run.train.lr = 1e-2
    result = run_distill(run)
    train = [r for r in read_metrics(tmp_path / "out/metrics.jsonl") if r["kind"] == "train"]
    first = sum(r["kl/t"] for r in train[:3]) / 3
    last = sum(r["kl/t"] for r in train[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    assert result["step"] == 16 and "eval_accuracy/add" in result["eval"]


# ---------------------------------------------------------------------------- config + CLI
def test_config_errors_are_actionable(tmp_path):
    with pytest.raises(ValueError, match="needs distill.teacher"):
        run_distill(DistillRunConfig())
    with pytest.raises(ValueError, match=r"domain\(s\) \['more'\] have no teacher"):
        run_distill(on_policy_run(tmp_path, {"a": "x"}, {"add": "a"}))
    with pytest.raises(ValueError, match=r"teacher\(s\) \['b'\] that are not in"):
        run_distill(on_policy_run(tmp_path, {"a": "x"}, {"add": "a", "more": "b"}))
    with pytest.raises(ValueError, match=r"^distill.teacher=.*missing.: no such model; point"):
        run_distill(offline_run(tmp_path, str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="objective must be"):
        DistillConfig(objective="reverse")
    with pytest.raises(ValueError, match="skew_alpha"):
        DistillConfig(skew_alpha=0.0)
    with pytest.raises(ValueError, match="needs a 'distill' section"):
        DistillRunConfig.from_dict({"model": "tiny-super"})
    with pytest.raises(ValueError, match="distill.bogus"):
        DistillRunConfig.from_dict({"distill": {"bogus": 1}})
    with pytest.raises(ValueError, match="needs a domain"):
        PromptSource(domain="")


def test_cli_runs_end_to_end_with_overrides_and_resume(tmp_path, capsys):
    teacher = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=5)
    run = offline_run(tmp_path, teacher, steps=4)
    run.train.checkpoint_interval = 2
    run.train.plot = True
    path = tmp_path / "distill.yaml"
    run.save(path)
    loaded = DistillRunConfig.load(path)
    assert loaded.to_dict() == run.to_dict()
    assert apply_overrides(loaded, ["distill.top_k=8"]).distill.top_k == 8
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["distill", "--config", str(path), "--set", "distill.objective=skew_reverse_kl"]
    )
    args.fn(args)
    printed = capsys.readouterr().out
    out = json.loads(printed[printed.index("{\n") :])
    assert out["step"] == 4 and out["plot"].endswith("distill.png")
    assert (tmp_path / "out/distill.png").stat().st_size > 0
    # resume from the step-2 checkpoint replays steps 3-4 exactly (SFT's loader + RNG state)
    metrics = tmp_path / "out/metrics.jsonl"
    before = {r["step"]: r["loss"] for r in read_metrics(metrics) if r["kind"] == "train"}
    import shutil

    shutil.rmtree(tmp_path / "out/checkpoints/step_00000004")
    args = parser.parse_args(
        ["distill", "--config", str(path), "--resume", "--set", "distill.objective=skew_reverse_kl"]
    )
    args.fn(args)
    after = {r["step"]: r["loss"] for r in read_metrics(metrics) if r["kind"] == "train"}
    assert after == pytest.approx(before, rel=1e-6)


# ---------------------------------------------------------------------------- MOPD stage 2
def test_mopd_stage2_proximal_teacher(tmp_path):
    """Stage 2: the "add" teacher is retired (its prompts go to the proximal teacher, which
    starts as the student: KL 0 on the first step), "more" keeps its teacher mixed
    geometrically with the proximal one; after each step the proximal weights are the moving
    average of the student's; a retired teacher is not loaded."""
    cfg = tiny_train_model(mtp=False)
    other = save_teacher(tmp_path, "other", cfg, seed=9)
    retired = save_teacher(tmp_path, "retired", cfg, seed=3)
    run = on_policy_run(
        tmp_path,
        {"other": other, "retired": retired},
        {"add": "proximal", "more": "other"},
    )
    run.distill.proximal_decay = 0.5
    run.distill.proximal_teacher_weight = 0.25
    trainer = distill_trainer(copy.deepcopy(run))
    m = trainer.module
    assert set(m.teachers) == {"other"} and m.targets() == ["other", "proximal"]
    before = {n: p.detach().clone() for n, p in m.proximal.named_parameters()}
    # the target of "more" rows: normalised p_other^0.25 p_prox^0.75
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        prox = m.proximal(ids).logits.float()
        got = torch.log_softmax(m.target_logits("other", ids, prox), -1)
        t = m.teachers["other"](ids).logits.float()
    want = torch.log_softmax(0.25 * t.log_softmax(-1) + 0.75 * prox.log_softmax(-1), -1)
    torch.testing.assert_close(got, want)
    row = trainer.train_step()
    assert row["kl/proximal"] == pytest.approx(0.0, abs=1e-6) and row["kl/other"] > 1e-4
    student = dict(m.model.named_parameters())
    for n, p in m.proximal.named_parameters():
        torch.testing.assert_close(p, 0.5 * before[n] + 0.5 * student[n].detach())
    m.close()
    with pytest.raises(ValueError, match="proximal_decay"):
        DistillConfig(mode="on_policy", teachers={"a": other}, routes={"add": "proximal"}).check()


def test_mopd_stage2_runs_from_stage1(tmp_path):
    """The two stages in sequence: stage 1 distils both domains from their teachers; stage 2
    starts from its checkpoint, retires the "add" teacher (its prompts go to the proximal
    teacher, which begins as stage 1's student: KL 0 at the first step) and keeps "more"."""
    cfg = tiny_train_model(mtp=False)
    a = save_teacher(tmp_path, "a", cfg, seed=4, sharpen=10.0)
    b = save_teacher(tmp_path, "b", cfg, seed=9, sharpen=10.0)
    stage1 = on_policy_run(tmp_path / "s1", {"a": a, "b": b}, {"add": "a", "more": "b"}, steps=2)
    first = run_distill(stage1)
    stage2 = on_policy_run(tmp_path / "s2", {"a": a, "b": b}, {"add": "proximal", "more": "b"})
    stage2.train.max_steps = 2
    stage2.train.init_from = first["checkpoint"]
    stage2.distill.proximal_decay = 0.9
    run_distill(stage2)
    rows = [r for r in read_metrics(tmp_path / "s2/out/metrics.jsonl") if r["kind"] == "train"]
    assert rows[0]["kl/proximal"] == pytest.approx(0.0, abs=1e-6) and rows[0]["kl/b"] > 0
    assert "kl/a" not in rows[0]
    assert all(r["tokens/proximal"] > 0 for r in rows)
