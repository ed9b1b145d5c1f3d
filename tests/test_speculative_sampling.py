"""Speculative sampling (temperature > 0): the output distribution equals the target's.

The statistical tests use fixed seeds, so they are deterministic; the stated false-failure
probability is the chance that a correct implementation fails for a random choice of seeds.
"""

from collections import Counter

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.infer.generate import generate
from hybridlm.infer.sampling import SamplingParams, filtered_probs
from hybridlm.infer.speculative import (
    DraftVocab,
    SpeculativeDecoder,
    rejection_verify,
    residual_probs,
    speculative_generate,
)
from hybridlm.presets import get_preset

PROMPT = [3, 1, 4, 1, 5]
ALPHA = 1e-3  # false-failure probability of each chi-square test


pytestmark = pytest.mark.usefixtures("one_thread")


def _small_model(seed: int = 0, draft_like_target: bool = True) -> HybridLM:
    """tiny-super's mixers (Mamba-2, attention, LatentMoE; MTP `*E`) at a size where one request
    takes milliseconds, vocab 12 so the joint of a few tokens can be enumerated; fp64 so cached
    and uncached forwards agree far below any probability we test.

    `draft_like_target`: the MTP input projection reads only the next token's embedding
    ([I | 0]); in this random model the backbone's prediction is also dominated by the last
    token, so drafts are often accepted (a random head is almost always rejected, leaving the
    accept path and the bonus token untested)."""
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.d_model, cfg.pattern = 12, 32, "M*E"
    m, a, e = cfg.mamba, cfg.attention, cfg.moe
    m.num_heads, m.head_dim, m.state_size, m.chunk_size = 2, 16, 8, 4
    a.num_heads, a.num_kv_heads, a.head_dim = 2, 1, 16
    e.num_experts, e.top_k, e.expert_hidden, e.shared_expert_hidden, e.latent_size = (
        4,
        2,
        16,
        32,
        16,
    )
    cfg.validate()
    model = HybridLM(cfg, seed=seed).double().eval()
    if draft_like_target:
        d = cfg.d_model
        with torch.no_grad():
            model.mtp.eh_proj.weight.zero_()
            model.mtp.eh_proj.weight[:, :d] = torch.eye(d)
    return model


def _exact_joint(model: HybridLM, prompt: list[int], n: int, **filt) -> dict[tuple, float]:
    """p(x_1..x_n) = prod_i p(x_i | prompt, x_<i) under `filtered_probs`, by plain (uncached)
    forwards over every prefix in the support."""
    dist = {(): 1.0}
    for _ in range(n):
        prefixes = list(dist)
        x_BL = torch.tensor([prompt + list(p) for p in prefixes])
        with torch.no_grad():
            probs_BV = filtered_probs(model(x_BL).logits[:, -1], **filt)
        dist = {
            p + (v,): dist[p] * float(row[v])
            for p, row in zip(prefixes, probs_BV, strict=True)
            for v in row.nonzero()[:, 0].tolist()
        }
    return dist


def _chi2(dist: dict, counts: Counter) -> tuple[float, int]:
    """Pearson's chi-square goodness of fit of `counts` to `dist`: (p-value, cells). Cells with
    expected count < 5 are pooled so the chi-square approximation holds; the survival function
    is sf(x; k) = Q(k/2, x/2), the regularised upper incomplete gamma."""
    assert set(counts) <= set(dist), "a sample outside the target's support"
    n = sum(counts.values())
    cells, pool_e, pool_o = [], 0.0, 0
    for key, p in dist.items():
        if n * p < 5:
            pool_e, pool_o = pool_e + n * p, pool_o + counts[key]
        else:
            cells.append((n * p, counts[key]))
    if pool_e > 0:
        cells.append((pool_e, pool_o))
    stat = sum((o - e) ** 2 / e for e, o in cells)
    df = torch.tensor((len(cells) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64))), len(
        cells
    )


def test_residual_distribution_hand_computed():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.6, 0.1, 0.1])
    # p - q = [0.3, -0.3, 0.1, -0.1] -> max(0, .) = [0.3, 0, 0.1, 0] -> / 0.4
    torch.testing.assert_close(residual_probs(p, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))
    # rows independently; p == q (a rejection had probability 0) falls back to p
    both = residual_probs(torch.stack([p, p]), torch.stack([q, p]))
    torch.testing.assert_close(both, torch.stack([torch.tensor([0.75, 0.0, 0.25, 0.0]), p]))


def test_rejection_verify_hand_cases():
    g = torch.Generator().manual_seed(0)
    p_JV = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    # a draft the target gives probability 0 is always rejected; the next token is then drawn
    # from norm(max(0, p - q)) = token 1
    q_KV = torch.tensor([[0.5, 0.0, 0.5]])
    for d in (0, 2):
        assert rejection_verify(p_JV, q_KV, torch.tensor([d]), g) == (0, 1)
    # q == p is always accepted, followed by the bonus token from the last target row
    assert rejection_verify(p_JV, p_JV[:1], torch.tensor([1]), g)[0] == 1
    with pytest.raises(ValueError, match="K \\+ 1 target"):
        rejection_verify(p_JV, q_KV, torch.tensor([0, 1]), g)


def test_rejection_step_emits_target_distribution():
    """One verify step with two drafts on fixed distributions: the first emitted token is
    distributed as p_1, and given that d_1 was accepted the second as p_2."""
    p_JV = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q_KV = torch.tensor([[0.2, 0.6, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1]])
    g = torch.Generator().manual_seed(0)
    first, second, n, outcomes = Counter(), Counter(), 4000, Counter()
    for _ in range(n):
        drafts_K = torch.multinomial(q_KV, 1, generator=g)[:, 0]
        m, nxt = rejection_verify(p_JV, q_KV, drafts_K, g)
        emitted = drafts_K[:m].tolist() + [nxt]
        first[(emitted[0],)] += 1
        if len(emitted) > 1:
            second[(emitted[1],)] += 1
        outcomes[min(m, 2)] += 1
    assert all(outcomes[m] > 100 for m in (0, 1, 2))  # rejections at 1 and 2, and bonus draws
    for counts, p_V in ((first, p_JV[0]), (second, p_JV[1])):
        dist = {(v,): float(pv) for v, pv in enumerate(p_V) if pv > 0}
        assert _chi2(dist, counts)[0] > ALPHA


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "draft-vocab"])
def test_speculative_sampling_matches_the_target_distribution(reduced):
    """The joint of the first 5 tokens over 300 seeded requests against the exact target joint
    p(x_1)·p(x_2|x_1)···p(x_5|x_<5), temperature 0.05 with top-k 3 and top-p 0.8 (21 outcomes).
    draft_len 3 and 5 tokens: the first round drafts 3 (4 tokens left: 3 drafts + the bonus),
    later rounds 1 or 2 (the cap), so the test covers acceptance at draft positions 1-3, rejection
    and the residual draw, the bonus token and rollback. Chi-square at ALPHA = 1e-3. Power,
    checked by hand with these seeds: drawing the token after a rejection from p instead of the
    residual gives a p-value ~1e-32; accepting every draft, inverting the ratio, drawing the bonus
    from the previous row or the token after a rejection from q put samples outside the support.
    With a reduced draft vocabulary (`DraftVocab`, 9 of the 12 ids, some of the target's support
    outside it) the output distribution is the same: q is zero outside the ids and the residual
    covers them.
    """
    filt = dict(temperature=0.05, top_k=3, top_p=0.8)
    model = _small_model()
    dv = DraftVocab(model, [1, 3, 4, 5, 7, 8, 9, 10, 11]) if reduced else None
    dist = _exact_joint(model, PROMPT, 5, **filt)
    counts, n = Counter(), 300
    accepted = rejected = all_accepted = 0
    for seed in range(n):
        dec = SpeculativeDecoder(
            model, PROMPT, draft_len=3, max_new_tokens=5, seed=seed, draft_vocab=dv, **filt
        )
        while not dec.finished:
            assert 1 <= len(dec.step()) <= 4
        counts[tuple(dec.tokens)] += 1
        st = dec.stats
        accepted += st.accepted
        rejected += sum(st.drafted_at) - st.accepted
        all_accepted += st.accepted_at[2]  # all 3 drafts of the first round, then a bonus
    assert accepted > 100 and rejected > 100 and all_accepted > 10, (accepted, rejected)
    if reduced:  # some emitted tokens were only reachable through the residual
        assert any(set(k) & {0, 2, 6} for k in counts)
    pvalue, cells = _chi2(dist, counts)
    assert cells >= 8 and pvalue > ALPHA, (cells, pvalue)


def test_sampling_is_reproducible_with_a_seed():
    model = _small_model()
    x = torch.tensor([PROMPT])
    kw = dict(draft_len=3, temperature=1.0, top_p=0.95)
    a, _ = speculative_generate(model, x, 12, seed=7, **kw)
    b, _ = speculative_generate(model, x, 12, seed=7, **kw)
    c, _ = speculative_generate(model, x, 12, seed=8, **kw)
    assert a.shape == (1, 12) and torch.equal(a, b) and not torch.equal(a, c)
    # an explicit generator is the same stream as its seed
    dec = SpeculativeDecoder(
        model, PROMPT, max_new_tokens=12, generator=torch.Generator().manual_seed(7), **kw
    )
    while not dec.finished:
        dec.step()
    assert dec.tokens == a[0].tolist()


@pytest.mark.parametrize("filt", [dict(top_k=1), dict(top_p=1e-6)], ids=["top_k=1", "top_p=0"])
def test_top_k_and_top_p_restrict_the_support(filt):
    """Filters that keep only the most likely token make sampling greedy, token for token."""
    model = _small_model()
    x = torch.tensor([PROMPT])
    out, stats = speculative_generate(model, x, 16, draft_len=3, temperature=1.0, seed=0, **filt)
    assert torch.equal(out, generate(model, x, 16))
    assert stats.accepted > 0


def test_decoder_steps_cap_and_stop():
    model = _small_model()
    ref = generate(model, torch.tensor([PROMPT]), 11)[0].tolist()
    dec = SpeculativeDecoder(model, torch.tensor(PROMPT), draft_len=4, max_new_tokens=11)
    steps = []
    while not dec.finished:
        steps.append(dec.step())
    assert len(steps[0]) == 1 and all(1 <= len(s) <= 5 for s in steps)
    assert sum(steps, []) == dec.tokens == ref and dec.step() == []
    assert dec.stats.accepted > 0
    stop = ref[4]
    dec = SpeculativeDecoder(model, PROMPT, draft_len=4, max_new_tokens=11, stop_token_ids=[stop])
    while not dec.finished:
        dec.step()
    assert dec.tokens == ref[: ref.index(stop) + 1]
    # sampled, with the limit falling inside a round
    for max_new in (0, 1, 2, 7):
        out, _ = speculative_generate(
            model, torch.tensor([PROMPT]), max_new, draft_len=4, temperature=1.0, seed=max_new
        )
        assert out.shape == (1, max_new)


def test_from_params_and_errors():
    model = _small_model()
    params = SamplingParams(max_tokens=6, temperature=0.7, top_k=4, seed=3, speculative=2)
    dec = SpeculativeDecoder.from_params(model, PROMPT, params, eos_id=11)
    assert (dec.draft_len, dec.max_new_tokens, dec.top_k, dec.stop_ids) == (2, 6, 4, {11})
    with pytest.raises(ValueError, match="speculative must be >= 1"):
        SpeculativeDecoder.from_params(model, PROMPT, SamplingParams())
    bad = [
        (dict(prompt_ids=[]), "non-empty prompt"),
        (dict(prompt_ids=[1, 12]), "must be in \\[0, 12\\)"),
        (dict(prompt_ids=torch.zeros(2, 3, dtype=torch.long)), "non-empty prompt"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(draft_len=0), "draft_len"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(seed=1, generator=torch.Generator()), "either seed or generator"),
    ]
    for kw, message in bad:
        kw = {"prompt_ids": PROMPT, **kw}
        with pytest.raises(ValueError, match=message):
            SpeculativeDecoder(model, **kw)
