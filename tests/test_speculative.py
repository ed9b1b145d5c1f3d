"""MTP speculative decoding: greedy output == plain greedy output, token for token."""

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.infer.generate import generate
from hybridlm.infer.speculative import SpecStats, speculative_generate
from hybridlm.presets import get_preset

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(name, seed):
    cfg = get_preset(name)
    cfg.vocab_size = 300
    cfg.mamba.chunk_size = 8
    # fp64 so that one-token and multi-token forwards agree far below any argmax margin
    return HybridLM(cfg, seed=seed).double().eval()


def _check(name, draft_len, seeds, prompt_lens, n_new=24, rollbacks=("history", "recompute")):
    for seed in seeds:
        model = _model(name, seed)
        g = torch.Generator().manual_seed(100 + seed)
        for prompt_len in prompt_lens:
            x = torch.randint(0, 300, (1, prompt_len), generator=g)
            ref = generate(model, x, n_new)
            for rollback in rollbacks:
                out, stats = speculative_generate(
                    model, x, n_new, draft_len=draft_len, rollback=rollback
                )
                assert torch.equal(out, ref), (name, draft_len, seed, prompt_len, rollback)
                assert stats.steps >= 1 and 1.0 <= stats.acceptance_length <= draft_len + 1


@pytest.mark.parametrize("name,draft_len", [("tiny-super", 3), ("tiny-lightning", 7)])
def test_speculative_greedy_equals_greedy(name, draft_len):
    _check(name, draft_len, seeds=[0], prompt_lens=[1, 17], n_new=16)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-super", "tiny-lightning"])
@pytest.mark.parametrize("draft_len", [1, 2, 5, 7])  # 3 (and 7) in the default suite too
def test_speculative_greedy_equals_greedy_many_prompts_and_seeds(name, draft_len):
    _check(name, draft_len, seeds=[0, 1], prompt_lens=[1, 5, 17, 40])


def test_drafts_are_accepted_when_the_head_agrees():
    """With the final norms' gains zeroed, backbone and MTP both emit all-zero hiddens, so both
    always choose token 0: every draft is accepted, which exercises the acceptance bookkeeping
    and the all-accepted path (bonus token, no rollback)."""
    model = _model("tiny-super", 0)
    with torch.no_grad():
        model.norm_f.weight.zero_()
        model.mtp.final_layernorm.weight.zero_()
    x = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(0))
    out, stats = speculative_generate(model, x, 20, draft_len=4)
    assert torch.equal(out, generate(model, x, 20))
    assert stats.acceptance_length > 4.0 and stats.acceptance_by_position()[0] == 1.0


def test_stats_and_errors():
    s = SpecStats(3)
    s.record(3, 2)
    s.record(3, 0)
    assert s.acceptance_length == 2.0 and s.acceptance_by_position() == [0.5, 0.5, 0.0]
    assert s.to_dict() == {
        "draft_len": 3,
        "steps": 2,
        "acceptance_length": 2.0,
        "acceptance_by_position": [0.5, 0.5, 0.0],
        "accepted_tokens": 2,
    }
    assert SpecStats(2).acceptance_by_position() == [0.0, 0.0]
    model = _model("tiny-olmo", 0)
    with pytest.raises(ValueError, match="MTP"):
        speculative_generate(model, torch.zeros(1, 3, dtype=torch.long), 4)
    model = _model("tiny-super", 0)
    with pytest.raises(ValueError, match="one non-empty prompt"):
        speculative_generate(model, torch.zeros(2, 3, dtype=torch.long), 4)


def test_draft_vocab_greedy_equals_greedy_and_drafts_only_its_ids(monkeypatch):
    """A reduced draft vocabulary (FR-Spec) changes what is drafted, never the output: greedy
    speculative == plain greedy, every draft is one of its ids, and with every id it drafts
    exactly as the full head."""
    from hybridlm.infer.speculative import DraftVocab, SpeculativeDecoder

    model = _model("tiny-super", 0)
    x = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(3))
    ref = generate(model, x, 24)
    _, full = speculative_generate(model, x, 24, draft_len=3)
    every = DraftVocab(model, range(300))
    out, same = speculative_generate(model, x, 24, draft_len=3, draft_vocab=every)
    assert torch.equal(out, ref) and same.to_dict() == full.to_dict()
    top = DraftVocab.from_tokens(model, [ref[0].tolist()], 40)  # the 40 ids emitted most
    assert set(ref[0].tolist()) <= set(top.ids_N.tolist()) and len(top) == 40
    drafted: list[int] = []

    def spy(h_BLD, _logits=top.logits):  # every draft is scored by the reduced head
        logits = _logits(h_BLD)
        assert logits.shape[-1] == len(top)
        drafted.append(int(top.ids_N[logits[0, -1].argmax()]))
        return logits

    monkeypatch.setattr(top, "logits", spy)
    dec = SpeculativeDecoder(model, x, draft_len=3, max_new_tokens=24, draft_vocab=top)
    while not dec.finished:
        dec.step()
    assert dec.tokens == ref[0].tolist()
    assert len(drafted) >= 24 and set(drafted) <= set(top.ids_N.tolist())


def test_draft_vocab_without_the_target_token_is_never_accepted():
    """Final norm gains zeroed: backbone and MTP both always choose token 0 (every full-head
    draft is accepted). A draft vocabulary that holds 0 keeps that; one without it drafts
    other ids, all rejected, and the output is still the greedy one."""
    from hybridlm.infer.speculative import DraftVocab

    model = _model("tiny-super", 0)
    with torch.no_grad():
        model.norm_f.weight.zero_()
        model.mtp.final_layernorm.weight.zero_()
    x = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(0))
    ref = generate(model, x, 20)
    for ids, rate in (([0, 5, 9], 1.0), ([5, 9], 0.0)):
        out, st = speculative_generate(
            model, x, 20, draft_len=4, draft_vocab=DraftVocab(model, ids)
        )
        assert torch.equal(out, ref) and st.acceptance_by_position()[0] == rate


def test_draft_vocab_construction_refresh_and_errors():
    from hybridlm.infer.speculative import DraftVocab

    model = _model("tiny-super", 0)
    counts = torch.zeros(300, dtype=torch.long)
    counts[[7, 3, 250]] = torch.tensor([5, 9, 5])
    dv = DraftVocab.from_counts(model, counts, 3, always=[1])
    assert dv.ids_N.tolist() == [1, 3, 7, 250] and len(dv) == 4  # ties by id, sorted
    assert torch.equal(dv.head.weight, model.lm_head.weight[dv.ids_N])
    h = torch.randn(2, 1, model.config.d_model, dtype=torch.float64)
    assert torch.allclose(dv.logits(h), model.lm_head(h)[..., dv.ids_N])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    full = dv.full_probs(q)
    assert full.shape == (1, 300) and full[0, [1, 3, 7, 250]].tolist() == q[0].tolist()
    assert float(full.sum()) == pytest.approx(1.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    dv.refresh()
    assert torch.equal(dv.head.weight, model.lm_head.weight[dv.ids_N])
    with pytest.raises(ValueError, match="at least one"):
        DraftVocab(model, [])
    with pytest.raises(ValueError, match=r"in \[0, 300\)"):
        DraftVocab(model, [0, 300])
    with pytest.raises(ValueError, match="size"):
        DraftVocab.from_counts(model, counts, 0)
    with pytest.raises(ValueError, match="one entry per token"):
        DraftVocab.from_counts(model, counts[:10], 3)
    with pytest.raises(ValueError, match="different model"):
        speculative_generate(
            _model("tiny-lightning", 0), torch.zeros(1, 3, dtype=torch.long), 4, draft_vocab=dv
        )


def test_batched_mtp_drafts_equal_each_row_alone():
    """`draft_batch` over rows whose MTP caches and queues have different lengths (one empty
    cache), after `consume_batch` ran all but the last queued pair, drafts what each row drafts
    alone (`SpeculativeDecoder.draft`: an unpadded one-row batch on the row's own MTP cache);
    the batch cache's valid columns equal each row's own cache."""
    from hybridlm.infer.speculative import (
        MTPDrafter,
        SpeculativeDecoder,
        consume_batch,
        draft_batch,
    )
    from hybridlm.model.cache import HybridCache

    cfg = get_preset("tiny-super")
    cfg.vocab_size = 300
    model = HybridLM(cfg, seed=0).double().eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    D = cfg.d_model
    decs, alone = [], []
    for cached, queued in ((0, 1), (7, 5), (3, 2)):
        dec = SpeculativeDecoder(model, [1, 2], draft_len=4)
        if cached:
            dec.drafter.feed(
                torch.randn(1, cached, D, generator=g, dtype=torch.float64),
                torch.randint(0, 256, (1, cached), generator=g),
            )
            dec.drafter.consume()
        dec.drafter.feed(
            torch.randn(1, queued, D, generator=g, dtype=torch.float64),
            torch.randint(0, 256, (1, queued), generator=g),
        )
        ref = SpeculativeDecoder(model, [1, 2], draft_len=4)
        ref.drafter = MTPDrafter(model, cache=dec.drafter.cache.fork())
        ref.drafter.feed(dec.drafter._h_BLD, dec.drafter._tok_BL)
        alone.append(ref)
        decs.append(dec)
    cache = HybridCache.cat([d.drafter.cache for d in decs])
    with torch.no_grad():
        consume_batch(decs, cache)
        assert [d.drafter.queued() for d in decs] == [1, 1, 1]
        for b, ref in enumerate(alone):
            n = ref.drafter.queued()
            solo = MTPDrafter(model, cache=ref.drafter.cache.fork())
            solo.feed(ref.drafter._h_BLD[:, : n - 1], ref.drafter._tok_BL[:, : n - 1])
            solo.consume()
            valid = cache.key_mask_BS[b]
            for got, want in zip(cache.layers, solo.cache.layers, strict=True):
                if got is not None and want.k_BKSE is None:  # nothing has run for row b
                    assert not bool(valid.any())
                elif got is not None:
                    torch.testing.assert_close(
                        got.k_BKSE[b][:, valid], want.k_BKSE[0], atol=1e-10, rtol=0
                    )
        batched = draft_batch(decs, cache)
    for (drafts, q), ref in zip(batched, alone, strict=True):
        assert q is None and len(drafts) == 4
        assert drafts == ref.draft()[0]
    assert cache.positions_B.tolist() == [1 + 0, 7 + 5, 3 + 2]  # drafts dropped again
