"""The optimizer step every training stage takes: a step whose loss or gradient is not finite
changes nothing, and the routing counts it gathered do not reach the next MoE bias update
(Nemotron 3 Super §2.1.1: the aux-loss-free bias follows the load of the steps it updates on)."""

import math

import pytest
import torch

import test_distill
import test_dpo
import test_sft
from _tiny import tiny_run, tiny_train_model
from hybridlm.train.stages.distill import distill_trainer
from hybridlm.train.stages.dpo import dpo_trainer
from hybridlm.train.stages.sft import sft_trainer
from hybridlm.train.text_training import pretrain_trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _pretrain(tmp_path):
    return pretrain_trainer(tiny_run(tmp_path, "pre", max_steps=4, eval_interval=0))


def _sft(tmp_path):
    return sft_trainer(test_sft.tiny_sft(tmp_path / "sft", steps=4))


def _dpo(tmp_path):
    return dpo_trainer(test_dpo._dpo_run(tmp_path, "dpo", steps=4))


def _on_policy_distill(tmp_path):
    teacher = test_distill.save_teacher(tmp_path, "t", tiny_train_model(mtp=False), seed=4)
    run = test_distill.on_policy_run(tmp_path, {"t": teacher}, {"add": "t", "more": "t"}, steps=4)
    return distill_trainer(run)


@pytest.mark.parametrize(
    "make", [_pretrain, _sft, _dpo, _on_policy_distill], ids=["pretrain", "sft", "dpo", "distill"]
)
def test_a_skipped_step_changes_nothing_and_leaks_no_routing_counts(tmp_path, make):
    trainer = make(tmp_path)
    model = trainer.model
    assert model.moe_layers(), "the stage's model must have MoE layers for this test"
    poisoned = {"on": False}

    def poison(grad):
        return grad * math.nan if poisoned["on"] else grad

    handle = model.lm_head.weight.register_hook(poison)
    try:
        assert not trainer.train_step()["skipped"]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        biases = [m.gate.e_score_correction_bias.clone() for m in model.moe_layers()]
        poisoned["on"] = True
        m = trainer.train_step()
        poisoned["on"] = False
        assert m["skipped"] and not math.isfinite(m["grad_norm"])
        for n, p in model.named_parameters():  # no update at all
            assert torch.equal(p, before[n]), n
        for layer, bias in zip(model.moe_layers(), biases, strict=True):
            assert torch.equal(layer.gate.e_score_correction_bias, bias)
            # the skipped step's routing counts are dropped, not carried into the next update
            assert not layer.load_E.any(), "routing counts of a skipped step leaked"
        assert not trainer.train_step()["skipped"]
    finally:
        handle.remove()
        pool = getattr(trainer.module, "pool", None)
        if pool is not None:
            pool.shutdown()
