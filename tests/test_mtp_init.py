"""Per-depth MTP heads and the initialisations of the one shared head (Nemotron 3.5 §1, §2.1)."""

from __future__ import annotations

import json

import pytest
import torch

from _tiny import boost_run
from hybridlm import HybridLM
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.speculative import speculative_generate
from hybridlm.interop.hf import save_pretrained
from hybridlm.io import load_model
from hybridlm.presets import get_preset
from hybridlm.train.mtp_boost import (
    MTPBoostConfig,
    MTPBoostRunConfig,
    mtp_boost_loss,
    mtp_boost_trainer,
    run_mtp_boost,
)
from hybridlm.train.mtp_init import (
    consolidate_heads,
    fuse_head,
    head_agreement,
    init_head,
    tail_blocks,
)
from hybridlm.train.objectives import causal_lm_loss


def _model(shared: bool = False, seed: int = 0, pattern: str = "M*EM-") -> HybridLM:
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.d_model, cfg.pattern = 258, 64, pattern
    cfg.mamba.num_heads, cfg.mamba.head_dim, cfg.mamba.chunk_size = 2, 32, 16
    cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim = 2, 1, 32
    cfg.moe.latent_size, cfg.moe.shared_expert_hidden = 32, 64
    cfg.mtp.pattern, cfg.mtp.depth, cfg.mtp.shared = "*E", 2, shared
    return HybridLM(cfg, seed=seed)


def _ids(n: int = 3, L: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, L), generator=torch.Generator().manual_seed(seed))


def test_per_depth_heads_start_equal_run_their_own_depth_and_cannot_draft(one_thread, tmp_path):
    model = _model().double()
    assert len(model.mtp_heads()) == 2 and model.mtp_head(2) is model.mtp_depths[0]
    first, second = model.mtp.state_dict(), model.mtp_depths[0].state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    # the backbone and the first head are drawn as in a shared-head model of the same seed
    shared = _model(shared=True).double()
    for k, v in shared.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    cfg = model.config
    assert cfg.num_params().mtp_total == 2 * shared.config.num_params().mtp_total
    ids = _ids()
    with torch.no_grad():
        model.mtp_depths[0].eh_proj.weight.mul_(2.0)
        out = model(ids, mtp_depth=2)
        ref = shared(ids, mtp_depth=2)
    assert torch.equal(out.mtp_logits[0], ref.mtp_logits[0])  # depth 1: the first head
    assert not torch.allclose(out.mtp_logits[1], ref.mtp_logits[1])  # depth 2: its own head
    # the MTP loss trains every head
    loss, _ = causal_lm_loss(model, model(ids, mtp_depth=2), ids)
    loss.backward()
    assert all(p.grad is not None for h in model.mtp_heads() for p in h.parameters())
    with pytest.raises(ValueError, match="per-depth MTP heads for depths 1..2"):
        model(ids, mtp_depth=3)
    with pytest.raises(ValueError, match="consolidate them first"):
        speculative_generate(model, ids[:1, :8], 4, draft_len=2)
    with pytest.raises(ValueError, match="consolidate the per-depth heads first"):
        save_pretrained(model, tmp_path / "hf")


@pytest.mark.parametrize("how", ["average", "first"])
def test_consolidation_gives_one_shared_head_that_drafts_and_exports(how, one_thread, tmp_path):
    model = _model().double()
    with torch.no_grad():
        for p in model.mtp_depths[0].parameters():
            p.add_(torch.randn_like(p) * 0.01)
    heads = [{k: v.clone() for k, v in h.state_dict().items()} for h in model.mtp_heads()]
    consolidate_heads(model, how)
    assert model.mtp_depths is None and model.config.mtp.shared
    for k, v in model.mtp.state_dict().items():
        if how == "first" or not v.is_floating_point():
            assert torch.equal(v, heads[0][k]), k
        else:
            assert torch.allclose(v, (heads[0][k] + heads[1][k]) / 2, atol=1e-12), k
    out, _ = speculative_generate(model.float(), _ids(1, 8), 6, draft_len=3)
    assert out.shape[-1] == 6
    save_pretrained(model, tmp_path / "hf", tokenizer=ByteTokenizer())
    again = load_model(tmp_path / "hf")
    for k, v in model.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_tail_blocks_match_the_mtp_pattern_onto_the_backbone_tail():
    assert tail_blocks("MEM*EME", "*E") == [3, 6]
    assert tail_blocks("MEM*EME", "E*E") == [1, 3, 6]
    assert tail_blocks("M*EM-", "*E") == [1, 2]
    with pytest.raises(ValueError, match="no '\\*' block to copy"):
        tail_blocks("MEME", "*E")


def test_fuse_copies_the_tail_and_solves_the_ridge_projection(one_thread):
    model = _model().double()
    ids, valid = _ids(4, 24), torch.ones(4, 24, dtype=torch.bool)
    valid[0, 15:] = False  # a shorter row
    fit = fuse_head(model, ids, valid, ridge=1e-3)
    assert model.mtp_depths is None and model.config.mtp.shared
    for mtp_block, i in zip(model.mtp.layers, (1, 2), strict=True):
        for k, v in model.layers[i].state_dict().items():
            assert torch.equal(v, mtp_block.state_dict()[k]), k
    assert torch.equal(model.mtp.final_layernorm.weight, model.norm_f.weight)
    # eh_proj satisfies the ridge normal equations: Z^T (Z W - R) + lam W = 0, with Z, R
    # gathered here independently (residual stream entering backbone block 1 at t + 1)
    inputs = []
    h = model.layers[1].register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
    with torch.no_grad():
        hidden = model(ids, return_hidden=True, return_logits=False).hidden
    h.remove()
    zs, rs = [], []
    for b in range(4):
        n = int(valid[b].sum())
        for t in range(n - 1):
            e = model.embeddings.weight[ids[b, t + 1]]
            z = torch.cat([model.mtp.enorm(e), model.mtp.hnorm(hidden[b, t])])
            zs.append(z)
            rs.append(inputs[0][b, t + 1])
    Z, R = torch.stack(zs), torch.stack(rs)
    assert fit["fuse_positions"] == len(Z) == 14 + 3 * 23
    W = model.mtp.eh_proj.weight.detach().T
    gram = Z.T @ Z
    lam = 1e-3 * gram.diagonal().mean()
    grad = Z.T @ (Z @ W - R) + lam * W
    assert grad.abs().max() < 1e-8 * (Z.T @ R).abs().max()
    rel = ((Z @ W - R).pow(2).sum() / (R - R.mean(0)).pow(2).sum()).detach()
    assert fit["fuse_relative_residual"] == pytest.approx(float(rel), rel=1e-9)
    assert 0 < fit["fuse_relative_residual"] < 1


def test_agreement_equals_the_boost_losss_greedy_agreement(one_thread):
    model = _model(shared=True).double()
    ids = _ids(2, 24, seed=3)
    valid = torch.ones_like(ids, dtype=torch.bool)
    # mtp_boost_loss's agree_k: the head's argmax at t vs the backbone's at t + k, over the
    # positions whose target t + k + 1 is marked. Marking 2.. and leaving the last token out of
    # `valid` makes both count t = 0 .. L - k - 2.
    mask = torch.zeros_like(valid)
    mask[:, 2:] = True
    _, m = mtp_boost_loss(model, ids, mask, depth=2, mix_true=0.0, distill_weight=0.0)
    valid[:, -1] = False
    for k in (1, 2):
        got = head_agreement(model, ids, valid, depth=k)
        assert got["agreement_by_depth"][k - 1] == pytest.approx(m[f"agree_{k}"], abs=1e-7)
    valid[:, -1] = True
    got = head_agreement(model, ids, valid, depth=2)
    assert got["positions"] == 2 * (24 - 2)
    assert 1.0 <= got["chain_length"] <= 1.0 + sum(got["agreement_by_depth"])
    # per-depth heads are measured too (they cannot draft)
    per_depth = head_agreement(_model().double(), ids, valid, depth=2)
    assert len(per_depth["agreement_by_depth"]) == 2


def test_init_head_errors():
    model = _model()
    ids, valid = _ids(), torch.ones(3, 20, dtype=torch.bool)
    with pytest.raises(ValueError, match="consolidate them first"):
        init_head(model, "keep", ids, valid)
    with pytest.raises(ValueError, match="init must be one of"):
        init_head(model, "merge", ids, valid)
    with pytest.raises(ValueError, match="needs per-depth MTP heads"):
        consolidate_heads(_model(shared=True))
    with pytest.raises(ValueError, match="consolidate must be one of"):
        MTPBoostConfig(consolidate="median").validate()
    with pytest.raises(ValueError, match="set mtp_boost.init to consolidate"):
        run_mtp_boost(model, ByteTokenizer(), [[1, 2]], [[1, 2]], MTPBoostRunConfig())


def test_a_warm_up_from_a_fused_head_logs_agreement_before_and_after(tmp_path, one_thread):
    torch.manual_seed(0)
    model = _model().float()
    tok = ByteTokenizer()
    prompts = [
        tok.encode(f"the number {i} is followed by {i + 1}. ", add_bos=True) for i in range(10)
    ]
    cfg = boost_run(
        out_dir=str(tmp_path),
        steps=4,
        batch_size=4,
        warmup_steps=1,
        num_sequences=8,
        gen_len=12,
        eval_prompts=2,
        eval_new_tokens=8,
        draft_len=2,
        eval_temperatures=[0.0],
        log_interval=1,
        init="fuse",
        kind="text",  # the warm-up: the windows themselves, every token after the first
    )
    res = run_mtp_boost(model, tok, prompts[:8], prompts[8:], cfg, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    agree = [r for r in rows if r.get("kind") == "agreement"]
    assert [r["when"] for r in agree] == ["source", "init", "after"]
    assert agree[1]["init"] == "fuse" and agree[1]["fuse_positions"] > 0
    assert all(len(r["agreement_by_depth"]) == 2 for r in agree)
    assert res["before"] and res["after"]
    exported = load_model(res["model"])
    assert exported.config.mtp.shared and exported.mtp_depths is None
    ids = _ids(1, 8)
    assert torch.equal(exported(ids).logits, model(ids).logits)


def test_the_text_warm_up_trains_on_the_windows_themselves(tmp_path, one_thread):
    tok = ByteTokenizer()
    windows = [tok.encode("ab" * (3 + i), add_bos=True) for i in range(6)]
    cfg = boost_run(
        out_dir=str(tmp_path),
        steps=1,
        num_sequences=4,
        eval_prompts=2,
        eval_new_tokens=4,
        draft_len=2,
        kind="text",
    )
    trainer = mtp_boost_trainer(
        _model(shared=True), tok, windows[:4], windows[4:], cfg, progress=False
    )
    m = trainer.module
    for i, w in enumerate(windows[:4]):
        assert m.ids_NL[i, : len(w)].tolist() == w
        assert m.mask_NL[i].nonzero().flatten().tolist() == list(range(1, len(w)))
    with pytest.raises(ValueError, match="data.kind: text trains on the training data"):
        boost_run(kind="text", prompts="arithmetic").validate()
