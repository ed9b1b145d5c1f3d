"""MTP healing / boosting: the loss matches the pretraining MTP loss, only the head learns,
hidden-state mixing feeds the true backbone hidden, and a short boost of a random model's head
on its own generations raises draft agreement and acceptance."""

from __future__ import annotations

import json

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.presets import get_preset
from hybridlm.train.mtp_boost import (
    MTPBoostConfig,
    _shift_left,
    mtp_boost_loss,
    run_mtp_boost,
)


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
        ref = model(ids, labels=ids, mtp_depth=3).losses
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
            out.hidden, model.embeddings(_shift_left(ids, 1)), positions_L=torch.arange(16)
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
            _shift_left(out.hidden, 1),
            model.embeddings(_shift_left(ids, 2)),
            positions_L=torch.arange(16),
        )
        logp2 = torch.log_softmax(model.lm_head(h2)[0], -1)
    ref2 = -logp2[torch.arange(7, 13), ids[0, 10:16]].mean()
    assert m2["nll_2"] == pytest.approx(ref2.item(), abs=1e-10)


def test_a_short_boost_of_a_random_head_raises_agreement_and_acceptance(tmp_path, one_thread):
    torch.manual_seed(0)
    model = _model().float()
    tok = ByteTokenizer()
    g = torch.Generator().manual_seed(0)
    prompts = [[tok.bos_id, *torch.randint(32, 127, (7,), generator=g).tolist()] for _ in range(12)]
    cfg = MTPBoostConfig(
        steps=40,
        batch_size=8,
        lr=3e-3,
        warmup_steps=5,
        num_sequences=16,
        gen_len=40,
        gen_temperature=0.0,
        eval_prompts=4,
        eval_new_tokens=24,
        draft_len=2,
        eval_temperatures=[0.0],
        log_interval=5,
    )
    res = run_mtp_boost(model, tok, prompts[:8], prompts[8:], cfg, tmp_path, progress=False)
    assert res["last"]["agree_1"] > res["first"]["agree_1"] + 0.3, (res["first"], res["last"])
    before, after = res["before"][0], res["after"][0]
    assert after["acceptance_length"] > before["acceptance_length"] + 0.2, (before, after)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"train", "acceptance"}
    assert (tmp_path / "acceptance.png").stat().st_size > 0
    boosted = HybridLM.from_pretrained(tmp_path / "model")
    for a, b in zip(boosted.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
