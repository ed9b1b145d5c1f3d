"""Quantisation-aware distillation (precision/ptq.py QAT modules, train/stages/qad.py, `hybridlm
qad`): QAT modules compute the PTQ inference modules' forward bit for bit (train and eval, before
and after an update) and convert into them exactly; the clipped straight-through gradient; a tiny
QAD run lowers the held-out KL to its unquantised teacher, resumes exactly with its calibration
scales, and exports a ModelOpt checkpoint that loads back to the trained model's logits; a `hybridlm
quantize` plan is taken as it is; config errors."""

import copy
import dataclasses
import json

import pytest
import torch

from _tiny import tiny_train_model
from hybridlm.io import load_model
from hybridlm.io.checkpoint import load_checkpoint
from hybridlm.model.model import HybridLM
from hybridlm.precision import ptq
from hybridlm.report.plot import read_metrics
from hybridlm.train.distillation import DistillConfig
from hybridlm.train.objectives import hidden_mse
from hybridlm.train.stages.qad import QADConfig, QADRunConfig, qad_trainer, run_qad
from test_distill import offline_run, save_teacher

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed: int = 0) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(tiny_train_model(), seed=seed).eval()


def ids(seed: int = 1, n: int = 2, L: int = 48) -> torch.Tensor:
    return torch.randint(0, 256, (n, L), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- QAT modules
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_qat_modules_compute_the_ptq_forward_and_convert_exactly(fmt):
    model = tiny_model()
    stats = ptq.calibrate(model, [{"input_ids": ids()}])
    plan = ptq.recipe_plan(model, fmt)
    inference = copy.deepcopy(model)
    ptq.quantize_model(inference, plan, stats)
    qat = copy.deepcopy(model)
    applied = ptq.quantize_model(qat, plan, stats, qat=True)
    kinds = {type(m).__name__ for m in ptq.qat_modules(qat).values()}
    assert kinds == {"QATLinear", "QATExperts"} and set(applied) == set(plan)
    x = ids(2)
    with torch.no_grad():
        want = inference(x).logits
        assert torch.equal(qat(x).logits, want)
    qat.train()
    out = qat(x).logits  # the training forward (straight-through graph) has the same value
    assert torch.equal(out.detach(), want)
    # an update moves the master weights; the quantised weights follow (no stale cache)
    out.float().logsumexp(-1).mean().backward()
    with torch.no_grad():
        for p in qat.parameters():
            if p.grad is not None:
                p.add_(p.grad.sign(), alpha=1e-2)
    qat.eval()
    converted = ptq.to_inference(copy.deepcopy(qat))
    assert not ptq.qat_modules(converted)
    with torch.no_grad():
        after = qat(x).logits
        assert not torch.equal(after, want)
        assert torch.equal(converted(x).logits, after)


def test_straight_through_gradient_is_clipped_where_the_format_saturates():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 32))
    scale = torch.tensor(0.5 / 448)  # FP8 inputs saturate beyond |x| = 0.5
    lin = ptq.QATLinear(
        w, "fp8", weight_amax=float(w.detach().abs().max()), input_scale=scale, search="mse"
    )
    x = (torch.randn(4, 32) * 0.5).requires_grad_()
    g = torch.randn(4, 8)
    lin(x).backward(g)
    wq = lin.quantized_weight()
    xq = ptq.fake_quant_input(x.detach(), "fp8", scale)
    inside = x.detach().abs() <= 0.5
    assert 0 < int(inside.sum()) < x.numel()  # both cases occur
    torch.testing.assert_close(x.grad, (g @ wq) * inside)
    torch.testing.assert_close(w.grad, g.t() @ xq)  # weights inside their amax: all pass


def test_hidden_mse_is_the_token_mean_of_the_squared_distance():
    s = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 1.0]])
    t = torch.tensor([[1.0, 0.0], [5.0, 5.0], [1.0, 1.0]])
    mask = torch.tensor([True, False, True])
    assert float(hidden_mse(s, t, mask, denom=2)) == pytest.approx((2.0 + 2.0) / 2)
    with pytest.raises(ValueError, match="equal shapes"):
        hidden_mse(s, t[:, :1])


# ----------------------------------------------------------------------------- the stage
def qad_run(tmp, teacher, *, steps=6, recipe="nvfp4", **qad) -> QADRunConfig:
    """test_distill's offline run (arithmetic chats, tiny batches) as a QAD run of `teacher`."""
    base = offline_run(tmp, teacher, steps=steps)
    train = dataclasses.replace(
        base.train,
        lr=3e-5,  # QAD moves weights by little more than their quantisation steps
        min_lr=3e-6,
        eval_interval=steps,
        checkpoint_interval=3,
        init_from=teacher,
    )
    return QADRunConfig(
        data=base.data,
        train=train,
        distill=DistillConfig(kl_weight=1.0, ce_weight=0.0, eval_generate=2, eval_max_new_tokens=4),
        qad=QADConfig(recipe=recipe, calib_samples=8, export_dtype="float32", **qad),
    )


def test_qad_closes_the_kl_resumes_exactly_and_exports_what_it_trained(tmp_path):
    teacher = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=5, sharpen=30.0)
    run = qad_run(tmp_path, teacher, steps=6)
    result = run_qad(run)
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 6]
    assert evals[-1]["eval_kl"] < 0.7 * evals[0]["eval_kl"]  # step 0: the PTQ model
    assert any(r["kind"] == "teacher" for r in rows)
    figures = json.loads((tmp_path / "out" / "qad.json").read_text())["figures"]
    assert figures["ptq"]["kl"] == evals[0]["eval_kl"] and figures["qad"]["step"] == 6
    # the ModelOpt export is the trained quantised model: same logits
    exported = load_model(result["hf"])
    assert ptq.qat_modules(exported) == {}
    meta = json.loads(
        (tmp_path / "out" / "checkpoints" / "step_00000006" / "meta.json").read_text()
    )
    trained = load_model(teacher).float()  # the master weights of the last checkpoint, QAT
    stats = ptq.calibrate(trained, [{"input_ids": ids()}])
    ptq.quantize_model(trained, ptq.recipe_plan(trained, "nvfp4"), stats, qat=True)
    load_checkpoint(tmp_path / "out" / "checkpoints" / "step_00000006", trained)
    ptq.load_qat_scales(trained, meta["qat_scales"])
    x = ids(4)
    with torch.no_grad():
        assert torch.equal(exported.eval()(x).logits, trained.eval()(x).logits)

    # killed after step 3 and resumed: the same losses as the uninterrupted run
    run2 = qad_run(tmp_path / "b", teacher, steps=6)
    (tmp_path / "b").mkdir()
    run_qad(run2, until_step=3)
    run_qad(run2, resume=True)
    again = read_metrics(tmp_path / "b" / "out" / "metrics.jsonl")
    losses = [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]
    assert [(r["step"], r["loss"]) for r in again if r["kind"] == "train"] == losses
    # resumed under other formats: its scales are the other formats', refused
    run2.qad.formats = {"*.mixer.out_proj": "fp8"}
    with pytest.raises(ValueError, match="other formats"):
        run_qad(run2, resume=True)


def test_qad_takes_a_quantize_plan(tmp_path):
    """`qad.plan` reads a `hybridlm quantize` output's per-operator formats and exclusions."""
    teacher = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=5)
    model = load_model(teacher)
    ops = ptq.find_ops(model, ptq.DEFAULT_EXCLUDE + ("*.q_proj", "*.k_proj", "*.v_proj"))
    plan = {op.name: ("fp8" if op.kind == "experts" else "nvfp4") for op in ops}
    qdir = tmp_path / "quantize"
    qdir.mkdir()
    settings = {
        "exclude": list(ptq.DEFAULT_EXCLUDE) + ["*.q_proj", "*.k_proj", "*.v_proj"],
        "weight_scale": "max",
    }
    (qdir / "quantize.json").write_text(json.dumps({"plan": plan, "settings": settings}))
    result = run_qad(qad_run(tmp_path, teacher, steps=2, plan=str(qdir)))
    assert result["plan"] == plan
    exported = load_model(result["hf"])
    fmts = {n: m.fmt for n, m in exported.named_modules() if isinstance(m, ptq.QuantLinear)}
    assert not any(n.endswith("q_proj") for n in fmts)
    routed = [
        m for n, m in exported.named_modules() if n.endswith(".experts") and n.startswith("layers")
    ]
    assert routed and all(isinstance(m, ptq.QuantExperts) and m.fmt == "fp8" for m in routed)
    assert fmts and set(fmts.values()) == {"nvfp4"}


def test_qad_formats_override_operators_by_glob(tmp_path):
    """`qad.formats` puts the operators matching a glob in another format (Nemotron 3.5's FP8
    Mamba projections over NVFP4 experts); the export holds those formats."""
    teacher = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=5)
    ops = [op.name for op in ptq.find_ops(load_model(teacher))]
    mamba = [n for n in ops if n.endswith((".mixer.in_proj", ".mixer.out_proj"))]
    assert mamba and len(mamba) < len(ops)
    formats = {"*.mixer.in_proj": "fp8", "*.mixer.out_proj": "fp8"}
    result = run_qad(qad_run(tmp_path, teacher, steps=1, formats=formats))
    assert result["plan"] == {n: "fp8" if n in mamba else "nvfp4" for n in ops}
    exported = load_model(result["hf"])
    fmts = {n: m.fmt for n, m in exported.named_modules() if isinstance(m, ptq.QuantLinear)}
    assert {n: f for n, f in fmts.items() if f == "fp8"}.keys() == set(mamba)
    with pytest.raises(ValueError, match="matches no quantised operator"):
        ptq.override_formats(result["plan"], {"*.nothing": "fp8"})
    model = tiny_model()  # attention Q/K/V are one fused operator: one format for the three
    plan, ops = ptq.recipe_plan(model, "nvfp4"), ptq.find_ops(model)
    with pytest.raises(ValueError, match="fused operators of layers.2.mixer.qkv_proj need one"):
        ptq.plan_groups(ptq.override_formats(plan, {"*.q_proj": "fp8"}), ops)
    qkv = ptq.override_formats(plan, {"*.[qkv]_proj": "bf16", "*_proj": "fp8"})  # first match
    ptq.plan_groups(qkv, ops)
    assert {qkv[f"layers.2.mixer.{p}_proj"] for p in "qkv"} == {"bf16"}
    with pytest.raises(ValueError, match="qad.formats: unknown format"):
        QADConfig(formats={"*.mixer.in_proj": "int4"})


def test_qad_config_errors(tmp_path):
    teacher = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=5)
    run = qad_run(tmp_path, teacher)
    run.train.init_from = ""
    with pytest.raises(ValueError, match="train.init_from"):
        run_qad(run)
    with pytest.raises(ValueError, match="qad.recipe"):
        QADConfig(recipe="int4")
    with pytest.raises(ValueError, match="no quantize.json"):
        run_qad(qad_run(tmp_path / "c", teacher, plan=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="hidden_weight"):
        DistillConfig(hidden_weight=1.0, teacher_cache="x").check()
    ce_only = qad_run(tmp_path / "d", teacher, steps=1)  # chats alone: a CE-only QAD is valid
    ce_only.distill.kl_weight, ce_only.distill.ce_weight = 0.0, 1.0
    qad_trainer(ce_only)


def test_qad_on_the_teachers_replies_with_hidden_state_mse(tmp_path):
    """`teacher_replies`: the chats are the teacher's greedy replies to training prompts;
    `distill.hidden_weight` adds the hidden-state MSE to the loss."""
    teacher = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=5)
    run = qad_run(tmp_path, teacher, steps=2, recipe="fp8")
    run.distill.hidden_weight = 1.0
    run.qad.teacher_replies = 6
    result = run_qad(run)
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert all(r["hidden_mse"] > 0 for r in rows if r["kind"] == "train")
    data = next(r for r in rows if r["kind"] == "data")
    replies = result["teacher_replies"]
    assert (replies["prompts"], replies["kept"]) == (6, data["train_conversations"])
    assert 0 <= replies["correct"] <= 6
    assert 0 < data["train_conversations"] <= 6


def test_qad_keeps_the_correct_replies_and_follows_text_by_kl_alone(tmp_path, monkeypatch):
    """`qad.correct_only`: only the teacher replies whose answer is the data's are trained on;
    `distill.ce_weight` is the chats' CE, while the pretraining text batches get the KL alone."""
    import re

    from _tiny import tiny_run
    from hybridlm.train.stages import qad as qad_module

    def replies(model, tokenizer, prompts, **_):  # right on every other prompt
        out = []
        for i, p in enumerate(prompts):
            a, op, b = re.search(r"(\d+) ([-+]) (\d+)", p[-1]["content"]).groups()
            value = int(a) + int(b) if op == "+" else int(a) - int(b)
            out.append(str(value + i % 2))
        return out

    monkeypatch.setattr(qad_module, "generate_replies", replies)
    teacher = save_teacher(tmp_path, "teacher", tiny_train_model(), seed=5)
    pre = tiny_run(tmp_path, "pre")
    (tmp_path / "pre").mkdir()
    pre.save(tmp_path / "pre" / "run.yaml")
    run = qad_run(tmp_path, teacher, steps=2, teacher_replies=8, correct_only=True)
    run.qad.text_data, run.qad.text_per_step = str(tmp_path / "pre"), 1
    run.distill.ce_weight = 0.5
    trainer = qad_module.qad_trainer(run)
    module = trainer.module
    assert module.replies == {"prompts": 8, "correct": 4, "kept": 4}
    chats = {tuple(e.input_ids) for e in module.loader.examples}
    assert len(chats) == 4
    step = module.prepare_step(0)
    chat, text = step.micro[0], step.micro[-1]
    assert "conv_ids" in chat and "conv_ids" not in text
    assert module.objective(chat) is module.dcfg
    assert (module.objective(text).ce_weight, module.objective(text).kl_weight) == (0.0, 1.0)
    kl_only, kept = module.loss(text, step), module.text_objective
    module.text_objective = module.dcfg  # what the text batch's loss would be with the CE
    with_ce = module.loss(text, step)
    module.text_objective = kept
    added = with_ce.value.item() - kl_only.value.item()
    text_ce = kl_only.metrics["text_ce"]  # logged apart from the chats' CE
    assert "ce" not in kl_only.metrics and text_ce > 0 and added == pytest.approx(0.5 * text_ce)
    trainer.train()
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert all(r["text_ce"] > 0 and r["ce"] > 0 for r in rows if r["kind"] == "train")
    with pytest.raises(ValueError, match="qad.correct_only"):
        QADConfig(correct_only=True)
    run.distill.kl_weight = 0.0
    with pytest.raises(ValueError, match="KL alone"):
        qad_module.qad_trainer(run)


def test_top_k_zero_is_the_whole_vocabulary():
    from hybridlm.train.teacher import teacher_topk_at

    t = torch.randn(2, 3, 11)
    mask = torch.tensor([[True, False, True], [False, True, True]])
    top, idx = teacher_topk_at(t, mask, 0, torch.device("cpu"))
    assert top.shape == (4, 11) and torch.equal(top, t[mask].sort(-1, descending=True).values)
    with pytest.raises(ValueError, match="top_k"):
        DistillConfig(top_k=-1)
