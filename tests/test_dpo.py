"""DPO: pair reading (bad rows counted), completion-only masks, length-gap filter, padding-free
log-probs, the on-disk reference cache, delta-learning pairs, accumulation == big batch, and a
tiny run whose preference loss falls."""

import argparse
import json
import math

import pytest
import torch

from _tiny import arithmetic_pairs, tiny_train_model
from hybridlm.cli.train import register
from hybridlm.data.chat import STOP
from hybridlm.data.sft import ReadReport, arithmetic_conversations
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.model.model import build_model
from hybridlm.train.config import TrainConfig
from hybridlm.train.pairs import (
    PairDataConfig,
    PreferencePair,
    build_delta_pairs,
    collate_pairs,
    filter_pairs,
    model_generator,
    read_pairs,
    tokenize_pair,
    write_pairs,
)
from hybridlm.train.stages.dpo import (
    DPOConfig,
    DPORunConfig,
    dpo_trainer,
    policy_logps,
    reference_logps,
    run_dpo,
)

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = ByteTokenizer()


def tiny_model(seed=0):
    return build_model(tiny_train_model(), seed=seed, device=torch.device("cpu"))


def test_read_pairs_counts_bad_rows_and_masks_only_the_completion(tmp_path):
    rows = [
        json.dumps({"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go away."}),
        json.dumps({"prompt": "Hi?", "chosen": "Hello."}),
        "not json",
        json.dumps(
            {"prompt": "Hi?", "chosen": "a", "rejected": [{"role": "user", "content": "x"}]}
        ),
        json.dumps(arithmetic_pairs(1)[0]),
    ]
    path = tmp_path / "pairs.jsonl"
    bad_utf8 = b'{"prompt": "Hi\xff?", "chosen": "Hello.", "rejected": "No."}'
    path.write_bytes("\n".join(rows).encode() + b"\n" + bad_utf8 + b"\n")
    report = ReadReport()
    pairs = read_pairs(path, report=report)
    assert len(pairs) == 2 and report.rows == 6
    assert report.skipped == {
        "invalid preference row": 2,
        "invalid JSON line": 1,
        "invalid UTF-8": 1,
    }
    tp = tokenize_pair(pairs[0], TOK)
    for ex, text in ((tp.chosen, "Hello."), (tp.rejected, "Go away.")):
        ((a, b),) = ex.spans
        assert TOK.decode(ex.input_ids[a:b]) == text + STOP
        assert sum(ex.loss_mask) == len(text) + len(STOP)
    # write -> read round trip
    again = read_pairs(write_pairs(pairs, tmp_path / "again.jsonl"))
    assert again == pairs


def test_length_gap_filter():
    # chosen 5 chars + <|im_end|> (10 bytes) = 15 tokens; rejected 110 + 10 = 120: gap 105
    pair = PreferencePair(
        prompt=[{"role": "user", "content": "q"}],
        chosen=[{"role": "assistant", "content": "x" * 5}],
        rejected=[{"role": "assistant", "content": "y" * 110}],
    )
    tp = tokenize_pair(pair, TOK)
    assert tp.length_gap == 105
    keep, dropped = filter_pairs([tp], max_len=512, max_len_gap=100)
    assert keep == [] and dropped == {"length gap > 100 tokens": 1}
    keep, _ = filter_pairs([tp], max_len=512, max_len_gap=105)
    assert keep == [0]
    keep, dropped = filter_pairs([tp], max_len=100, max_len_gap=-1)
    assert keep == [] and dropped == {"longer than 100 tokens": 1}
    same = tokenize_pair(PreferencePair(pair.prompt, pair.chosen, pair.chosen), TOK)
    assert filter_pairs([same], max_len=512, max_len_gap=100)[1] == {"chosen == rejected": 1}


def test_padding_does_not_change_logps_and_reference_cache(tmp_path):
    model = tiny_model().eval()
    pairs = [tokenize_pair(PreferencePair(**_as_pair(r)), TOK) for r in arithmetic_pairs(4)]
    pairs[1] = tokenize_pair(
        PreferencePair(
            prompt=[{"role": "user", "content": "A much longer question, padded by others?"}],
            chosen=[{"role": "assistant", "content": "Yes, it is."}],
            rejected=[{"role": "assistant", "content": "No."}],
        ),
        TOK,
    )
    with torch.no_grad():
        lp, n = policy_logps(model, collate_pairs(pairs), torch.device("cpu"))
        for i, p in enumerate(pairs):
            alone, n1 = policy_logps(model, collate_pairs([p]), torch.device("cpu"))
            torch.testing.assert_close(lp[[i, i + 4]], alone, rtol=1e-5, atol=1e-5)
            assert n[[i, i + 4]].tolist() == n1.tolist()
    c, r, cached = reference_logps(model, pairs, cache_dir=tmp_path, batch_size=4)
    assert not cached and len(list(tmp_path.glob("ref_logps-*.pt"))) == 1
    torch.testing.assert_close(c, lp[:4].double(), rtol=1e-5, atol=1e-5)
    c2, r2, cached = reference_logps(model, pairs, cache_dir=tmp_path, batch_size=4)
    assert cached and torch.equal(c, c2) and torch.equal(r, r2)
    # other weights or other pairs: another key, recomputed
    _, _, cached = reference_logps(tiny_model(seed=1), pairs, cache_dir=tmp_path)
    assert not cached
    _, _, cached = reference_logps(model, pairs[:2], cache_dir=tmp_path)
    assert not cached and len(list(tmp_path.glob("ref_logps-*.pt"))) == 3


def _as_pair(row):
    return {
        "prompt": row["prompt"],
        "chosen": [row["chosen"]],
        "rejected": [row["rejected"]],
    }


def test_delta_pairs_from_two_generators_and_models():
    prompts = [c[:-1] for c in arithmetic_conversations(4, seed=1, digits=1)]
    answers = [c[-1]["content"] for c in arithmetic_conversations(4, seed=1, digits=1)]
    strong_replies = [f"<think>\nadd\n</think>\n{a}" for a in answers]
    weak_replies = ["0", "y" * 300, strong_replies[2], "1"]

    def strong(ps):
        return [strong_replies[prompts.index(p)] for p in ps]

    def weak(ps):
        return [weak_replies[prompts.index(p)] for p in ps]

    def keep(prompt, reply):  # only the chosen side is filtered (Olmo 3 delta learning)
        return prompts.index(prompt) != 3

    pairs, dropped = build_delta_pairs(prompts, strong, weak, TOK, keep_chosen=keep)
    assert dropped == {
        "length gap > 100 tokens": 1,
        "chosen == rejected": 1,
        "chosen filtered": 1,
    }
    (pair,) = pairs
    assert pair.chosen == [{"role": "assistant", "content": answers[0], "reasoning_content": "add"}]
    assert pair.rejected == [{"role": "assistant", "content": "0"}]
    # generation functions backed by checkpoints (two differently initialised tiny models)
    gen_a = model_generator(tiny_model(0), TOK, max_new_tokens=6)
    gen_b = model_generator(tiny_model(1), TOK, max_new_tokens=6)
    pairs, dropped = build_delta_pairs(prompts[:2], gen_a, gen_b, TOK)
    assert len(pairs) + sum(dropped.values()) == 2


def _dpo_run(tmp_path, out, *, steps, batch_size=4, grad_accum=1, loss="dpo_norm", lr=3e-3):
    path = tmp_path / "pairs.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_pairs(40, seed=2)))
    init = tmp_path / "init"
    if not (init / "checkpoints").exists():
        from hybridlm.io.checkpoint import save_checkpoint

        model = tiny_model()
        meta = {"run_config": {"model": model.config.to_dict()}}
        save_checkpoint(init, step=0, model=model, optimizer=None, meta=meta)
    return DPORunConfig(
        data=PairDataConfig(path=str(path), max_len=256, batch_size=batch_size, held_out=8),
        train=TrainConfig(
            lr=lr,
            warmup_steps=1,
            schedule="constant",
            weight_decay=0.0,
            max_steps=steps,
            grad_accum=grad_accum,
            eval_interval=0,
            log_interval=1,
            checkpoint_interval=0,
            out_dir=str(tmp_path / out),
            init_from=str(init / "checkpoints" / "step_00000000"),
            progress=False,
            plot=False,
        ),
        dpo=DPOConfig(loss=loss),
    )


def test_accumulation_equals_big_batch(tmp_path):
    cfgs = [
        _dpo_run(tmp_path, "big", steps=1, batch_size=4),
        _dpo_run(tmp_path, "acc", steps=1, batch_size=2, grad_accum=2),
    ]
    for cfg in cfgs:
        cfg.dpo.ref_cache_dir = str(tmp_path / "cache")
    big_trainer, acc_trainer = dpo_trainer(cfgs[0]), dpo_trainer(cfgs[1])
    big, acc = big_trainer.module, acc_trainer.module
    assert not big.ref_cached and acc.ref_cached  # same pairs and reference weights
    assert acc._next_indices() + acc._next_indices() == big._next_indices()  # same pairs
    idx = big._epoch_order(0)[:4].tolist()

    def grads(chunks):
        big.model.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in chunks:
            loss, _, _ = big._loss(chunk, big.train_pairs, big.ref_train, 4)
            loss.backward()
            total += float(loss.detach())
        return total, {
            n: p.grad.clone() for n, p in big.model.named_parameters() if p.grad is not None
        }

    loss_big, g_big = grads([idx])
    loss_acc, g_acc = grads([idx[:2], idx[2:]])
    assert loss_acc == pytest.approx(loss_big, rel=1e-6)
    assert g_big.keys() == g_acc.keys()
    for name in g_big:
        # fp32 summation order differs: tolerance relative to the tensor's scale
        scale = float(g_big[name].abs().max())
        torch.testing.assert_close(g_acc[name], g_big[name], rtol=1e-4, atol=1e-4 * scale)
    # and a full step of each trainer reports the same loss and reward accuracy
    acc.cursor = big.cursor = 0
    mb, ma = big_trainer.train_step(), acc_trainer.train_step()
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5)
    assert ma["reward_accuracy"] == pytest.approx(mb["reward_accuracy"])


@pytest.mark.parametrize("loss", ["dpo", "dpo_norm"])
def test_tiny_dpo_run_prefers_the_chosen(tmp_path, loss):
    cfg = _dpo_run(tmp_path, "run", steps=15, loss=loss, lr=1e-3)
    cfg.train.eval_interval = 15
    result = run_dpo(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    # step 1: policy == reference, so every implicit reward is 0 and the DPO loss is ln 2 (the
    # step's loss adds the MoE balancing term, Nemotron 3 Super §2.1.1)
    assert train[0]["loss"] - train[0]["moe_aux"] == pytest.approx(math.log(2), abs=1e-5)
    assert train[0]["reward_margin"] == pytest.approx(0, abs=1e-5)
    assert evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert sum(r["loss"] for r in train[-3:]) / 3 < 0.5 * math.log(2)
    assert evals[-1]["eval_reward_accuracy"] > 0.6 and evals[-1]["eval_reward_margin"] > 0
    for key in ("reward_chosen", "reward_rejected", "logp_chosen", "logp_rejected"):
        assert key in train[-1]
    data = result["data"]
    assert data["beta"] == (5.0 if loss == "dpo_norm" else 0.1)
    assert data["train_pairs"] == 32 and not data["ref_logps_from_cache"]
    # a second run over the same pairs and reference reads the cached reference log-probs
    cfg2 = _dpo_run(tmp_path, "run2", steps=1, loss=loss)
    cfg2.dpo.ref_cache_dir = str(tmp_path / "run" / "ref_cache")
    assert dpo_trainer(cfg2).module.ref_cached


def test_exact_resume(tmp_path):
    def losses(out):
        rows = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(r)["loss"] for r in rows if json.loads(r)["kind"] == "train"]

    for out in ("a", "b"):
        cfg = _dpo_run(tmp_path, out, steps=6, batch_size=4)
        cfg.train.checkpoint_interval = 3
        cfg.dpo.ref_cache_dir = str(tmp_path / "cache")
        if out == "a":
            run_dpo(cfg)
        else:
            run_dpo(cfg, until_step=3)
            run_dpo(cfg, resume=True)
    assert losses("a") == losses("b") and len(losses("a")) == 6


def test_config_cli_and_errors(tmp_path):
    cfg = _dpo_run(tmp_path, "cli", steps=2)
    path = tmp_path / "dpo.yaml"
    cfg.save(path)
    assert DPORunConfig.load(path).to_dict() == cfg.to_dict()
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["dpo", "--config", str(path), "--set", "dpo.beta=2.0"])
    args.fn(args)
    assert (tmp_path / "cli" / "checkpoints" / "step_00000002").is_dir()
    with pytest.raises(ValueError, match="exactly one of"):
        PairDataConfig()
    with pytest.raises(ValueError, match="dpo.loss"):
        DPOConfig(loss="ipo")
    with pytest.raises(ValueError, match="needs a 'dpo' section"):
        DPORunConfig.from_dict({"data": {"path": "x"}})


def test_shipped_config_loads():
    cfg = DPORunConfig.load("configs/dpo.yaml")
    assert cfg.dpo.loss == "dpo_norm" and cfg.dpo.effective_beta == 5.0
    assert cfg.data.max_len_gap == 100 and cfg.data.delta is not None
