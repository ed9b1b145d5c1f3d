"""MTP healing / boosting: the loss matches the pretraining MTP loss, only the head learns,
hidden-state mixing feeds the true backbone hidden, a short boost of a random model's head on its
own generations raises draft agreement and acceptance (the backbone, its router biases included,
unchanged), a resumed boost repeats the uninterrupted one, and an SFT run's chat prompts are the
default prompts of a model it trained."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from _tiny import boost_run, tiny_sft_run
from hybridlm import HybridLM
from hybridlm.cli import main
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.interop.hf import save_pretrained
from hybridlm.io import load, load_model
from hybridlm.model.model import shift_left
from hybridlm.presets import get_preset
from hybridlm.train.mtp_boost import (
    MTPBoostRunConfig,
    mtp_boost_loss,
    mtp_boost_trainer,
    prompts_from_checkpoint,
    run_mtp_boost,
)
from hybridlm.train.objectives import causal_lm_loss


def _model(seed: int = 0) -> HybridLM:
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.d_model, cfg.pattern = 258, 64, "M*E"
    cfg.mamba.num_heads, cfg.mamba.head_dim, cfg.mamba.chunk_size = 2, 32, 16
    cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim = 2, 1, 32
    cfg.moe.latent_size, cfg.moe.shared_expert_hidden = 32, 64
    cfg.mtp.pattern, cfg.mtp.depth = "*E", 3
    return HybridLM(cfg, seed=seed)


def test_nll_equals_the_pretraining_mtp_loss_and_only_the_head_gets_gradients(one_thread):
    model = _model().double()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    _, m = mtp_boost_loss(model, ids, mask, depth=3, mix_true=0.0, distill_weight=0.0)
    with torch.no_grad():
        ref = causal_lm_loss(model, model(ids, mtp_depth=3), ids)[1]
    for k in (1, 2, 3):
        assert m[f"nll_{k}"] == pytest.approx(ref[f"mtp_{k}"].item(), abs=1e-10)
    model.requires_grad_(False)
    model.mtp.requires_grad_(True)
    loss, _ = mtp_boost_loss(model, ids, mask, depth=2, mix_true=0.5, distill_weight=0.5)
    loss.backward()
    assert all(p.grad is not None for p in model.mtp.parameters())
    assert model.lm_head.weight.grad is None and model.embeddings.weight.grad is None


def test_targets_are_only_the_masked_tokens_and_mixing_feeds_the_true_hidden(one_thread):
    model = _model().double()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, 10:] = True  # prompt 10 tokens, 6 generated
    _, m = mtp_boost_loss(model, ids, mask, depth=1, mix_true=0.0, distill_weight=0.0)
    with torch.no_grad():
        out = model(ids, return_hidden=True)
        h1 = model.mtp(
            out.hidden, model.embeddings(shift_left(ids, 1)), positions_L=torch.arange(16)
        )
        logp = torch.log_softmax(model.lm_head(h1)[0], -1)
    # depth 1 predicts token t+2 from position t: targets 10..15 come from positions 8..13
    ref = -logp[torch.arange(8, 14), ids[0, 10:16]].mean()
    assert m["nll_1"] == pytest.approx(ref.item(), abs=1e-10)
    # hidden-state mixing with P(true) = 1 at depth 2: the input is the backbone's hidden of
    # position t+1, so depth 2 is depth 1 evaluated one position later
    _, m2 = mtp_boost_loss(model, ids, mask, depth=2, mix_true=1.0, distill_weight=0.0)
    with torch.no_grad():
        h2 = model.mtp(
            shift_left(out.hidden, 1),
            model.embeddings(shift_left(ids, 2)),
            positions_L=torch.arange(16),
        )
        logp2 = torch.log_softmax(model.lm_head(h2)[0], -1)
    ref2 = -logp2[torch.arange(7, 13), ids[0, 10:16]].mean()
    assert m2["nll_2"] == pytest.approx(ref2.item(), abs=1e-10)


def _prompts(n: int) -> list[list[int]]:
    tok = ByteTokenizer()
    g = torch.Generator().manual_seed(0)
    return [[tok.bos_id, *torch.randint(32, 127, (7,), generator=g).tolist()] for _ in range(n)]


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def test_a_short_boost_of_a_random_head_raises_agreement_and_acceptance(tmp_path, one_thread):
    torch.manual_seed(0)
    model = _model().float()
    head = {f"mtp.{k}" for k in model.mtp.state_dict()}
    frozen = {k: v.clone() for k, v in model.state_dict().items() if k not in head}
    head_bias = [k for k in head if k.endswith("e_score_correction_bias")]
    assert head_bias and any(k.endswith("e_score_correction_bias") for k in frozen)
    start = {k: model.state_dict()[k].clone() for k in head_bias}
    tok = ByteTokenizer()
    prompts = _prompts(12)
    cfg = boost_run(
        out_dir=str(tmp_path),
        steps=40,
        batch_size=8,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=5,
        num_sequences=16,
        gen_len=40,
        gen_temperature=0.0,
        eval_prompts=4,
        eval_new_tokens=24,
        draft_len=2,
        eval_temperatures=[0.0],
        log_interval=1,
    )
    res = run_mtp_boost(model, tok, prompts[:8], prompts[8:], cfg, progress=False)
    assert res["last"]["agree_1"] > res["first"]["agree_1"] + 0.3, (res["first"], res["last"])
    before, after = res["before"][0], res["after"][0]
    assert after["acceptance_length"] > before["acceptance_length"] + 0.2, (before, after)
    rows = _rows(tmp_path / "metrics.jsonl")
    assert {r["kind"] for r in rows} == {"train", "acceptance", "agreement"}
    agree = [r for r in rows if r["kind"] == "agreement"]
    assert [r["when"] for r in agree] == ["source", "after"]  # init "keep": no "init" row
    assert agree[1]["chain_length"] > agree[0]["chain_length"]
    # the Trainer's rows: `step` counts the optimizer steps done; acceptance before and after
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 41))
    assert [(r["when"], r["step"]) for r in rows if r["kind"] == "acceptance"] == [
        ("before", 0),
        ("after", 40),
    ]
    assert res["last"]["skipped_steps"] == 0 and res["first"]["lr"] == pytest.approx(3e-3 / 5)
    assert (tmp_path / "acceptance.png").stat().st_size > 0
    boosted = load_model(tmp_path / "model")
    for a, b in zip(boosted.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # only the head trained: the frozen backbone's routers took no bias step (Nemotron 3 Super
    # §4.7), the head's own router did
    state = model.state_dict()
    for k, v in frozen.items():
        assert torch.equal(state[k], v), k
    assert any(not torch.equal(state[k], start[k]) for k in head_bias)
    assert all(p.requires_grad for p in model.parameters())  # handed back trainable


def test_a_resumed_boost_repeats_the_uninterrupted_one(tmp_path, one_thread):
    tok, prompts = ByteTokenizer(), _prompts(10)
    cfg = boost_run(
        steps=6,
        batch_size=4,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=2,
        num_sequences=5,  # a pass over the sequences is 1.25 batches: resumed mid-pass
        gen_len=12,
        eval_new_tokens=4,
        draft_len=2,
        eval_temperatures=[0.0],
        log_interval=1,
        checkpoint_interval=3,
    )

    def trainer(out, **kw):
        model, run = _model().float(), copy.deepcopy(cfg)
        run.train.out_dir = str(out)
        return model, mtp_boost_trainer(
            model, tok, prompts[:8], prompts[8:], run, progress=False, **kw
        )

    full, t = trainer(tmp_path / "full")
    t.train()
    _, t = trainer(tmp_path / "cut")
    t.train(until_step=3)
    resumed, t = trainer(tmp_path / "cut", resume=True)
    assert t.step == 3
    t.train()
    a, b = _rows(tmp_path / "full" / "metrics.jsonl"), _rows(tmp_path / "cut" / "metrics.jsonl")
    assert [r["kind"] for r in a] == [r["kind"] for r in b]
    for x, y in zip(a, b, strict=True):
        if x["kind"] == "train":
            assert (x["step"], x["loss"], x["nll_2"]) == (y["step"], y["loss"], y["nll_2"])
    for k, v in full.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    # resuming a finished run measures nothing again
    _, t = trainer(tmp_path / "full", resume=True)
    t.train()
    assert _rows(tmp_path / "full" / "metrics.jsonl") == a
    # the run directory is a model path of the one loader: its final checkpoint, its tokenizer
    loaded = load(tmp_path / "full")
    assert loaded.kind == "checkpoint" and isinstance(loaded.tokenizer, ByteTokenizer)
    for k, v in loaded.model.state_dict().items():
        assert torch.equal(v, full.state_dict()[k]), k


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    return tiny_sft_run(tmp_path_factory.mktemp("sft"))


def test_the_prompts_of_an_sft_model_are_its_runs_chat_prompts(sft_run, one_thread):
    """The run directory, its checkpoint and its transformers export (run.yaml beside it) all
    give the SFT run's conversations up to the assistant turn, as the model is prompted when
    served; no prompt is both a boosting and a held-out one."""
    tok = ByteTokenizer()
    ckpt = next((sft_run / "checkpoints").iterdir())
    for path in (sft_run, ckpt, sft_run / "hf"):
        train, held = prompts_from_checkpoint(
            str(path), tok, n_train=6, n_eval=2, prompt_len=64, seed=0
        )
        assert (len(train), len(held)) == (6, 2)
        for ids in train + held:
            text = tok.decode(ids)
            assert text.startswith("<|im_start|>user\nWhat is "), text
            assert text.endswith("<|im_end|>\n<|im_start|>assistant\n"), text
        assert not {tuple(p) for p in train} & {tuple(p) for p in held}


def test_mtp_boost_of_an_sft_run_from_the_command_line(sft_run, tmp_path, capsys, one_thread):
    argv = ["mtp-boost", "--checkpoint", str(sft_run), "--out", str(tmp_path / "boost")]
    short = ("train.max_steps=1", "data.num_sequences=2", "data.eval_prompts=1", "data.gen_len=8")
    for s in (*short, "mtp_boost.eval_new_tokens=4"):
        argv += ["--set", s]
    assert main(argv) == 0
    assert "[mtp-boost] 2 self-generated sequences" in capsys.readouterr().out


def test_a_run_whose_data_is_neither_text_nor_chat_is_a_one_line_error(tmp_path, capsys):
    save_pretrained(_model(), tmp_path / "run" / "hf", tokenizer=ByteTokenizer())
    (tmp_path / "run" / "run.yaml").write_text(
        "data:\n  sources:\n    - {kind: arithmetic, max_rows: 3, colour: red}\n"
    )
    argv = ["mtp-boost", "--checkpoint", str(tmp_path / "run" / "hf"), "--set", "train.max_steps=1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hybridlm mtp-boost: error: the data section of "), err
    assert "neither pretraining text nor chat sources" in err
    assert err.endswith("--set data.prompts=sft_arithmetic"), err


def test_the_keys_of_the_flat_config_say_where_they_went():
    with pytest.raises(ValueError, match=r"steps is now train.max_steps"):
        MTPBoostRunConfig().override(["steps=3"])
    with pytest.raises(ValueError, match=r"draft_len is now mtp_boost.draft_len"):
        MTPBoostRunConfig().override(["draft_len=3"])
    with pytest.raises(ValueError, match=r"data is a section now: data: text is data.kind"):
        MTPBoostRunConfig().override(["data=text"])
    with pytest.raises(ValueError, match=r"train.z_loss has no effect in the MTP boost"):
        MTPBoostRunConfig().override(["train.z_loss=0.1"])
