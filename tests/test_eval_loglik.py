"""Batched, padded log-likelihoods equal one-at-a-time full-sequence computations (fp64)."""

import math

import pytest
import torch

from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.eval.loglik import (
    bits_per_byte,
    encode_pair,
    loglikelihood,
    loglikelihood_rolling,
    rolling_windows,
)
from hybridlm.model.model import HybridLM
from hybridlm.presets import get_preset


@pytest.fixture(scope="module", params=["tiny-super", "tiny-olmo"])
def model64(request):
    torch.manual_seed(0)
    return HybridLM(get_preset(request.param), seed=0).double().eval()


def _reference(model, ctx, cont):
    """Sum log p(cont | ctx) and greedy flag from one unpadded forward of ctx + cont[:-1]."""
    full = torch.tensor([[*ctx, *cont]])
    with torch.no_grad():
        logp = torch.log_softmax(model(full[:, :-1]).logits[0], dim=-1)
    rows = torch.arange(len(ctx) - 1, len(ctx) - 1 + len(cont))
    tgt = torch.tensor(cont)
    return float(logp[rows, tgt].sum()), bool((logp[rows].argmax(-1) == tgt).all())


def _requests(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = int(torch.randint(1, 24, (1,), generator=g))
        b = int(torch.randint(1, 6, (1,), generator=g))
        ids = torch.randint(0, vocab, (a + b,), generator=g).tolist()
        out.append((ids[:a], ids[a:]))
    return out


def test_batched_padded_equals_one_at_a_time(model64, one_thread):
    reqs = _requests(8, model64.config.vocab_size)
    reqs.append(reqs[0])  # a duplicate lands next to its twin
    # 90 tokens per batch: several batches of 2-4 right-padded rows of different lengths
    got = loglikelihood(model64, reqs, max_batch_tokens=90)
    for (ctx, cont), r in zip(reqs, got, strict=True):
        ref, greedy = _reference(model64, ctx, cont)
        assert r.num_tokens == len(cont)
        assert r.logprob == pytest.approx(ref, abs=1e-10, rel=1e-12)
        assert r.is_greedy == greedy


def test_is_greedy_on_the_argmax_continuation(model64, one_thread):
    ctx = [1, 2, 3, 4]
    cont = []
    seq = list(ctx)
    for _ in range(3):  # the model's own greedy continuation
        with torch.no_grad():
            nxt = int(model64(torch.tensor([seq])).logits[0, -1].argmax())
        cont.append(nxt)
        seq.append(nxt)
    other = [(cont[0] + 1) % model64.config.vocab_size, *cont[1:]]
    res = loglikelihood(model64, [(ctx, cont), (ctx, other), ([5, 6], [7])])
    assert res[0].is_greedy and not res[1].is_greedy
    assert res[0].logprob > res[1].logprob


def test_left_truncation_keeps_the_continuation(model64, one_thread):
    ctx, cont = list(range(10, 40)), [5, 6, 7]
    got = loglikelihood(model64, [(ctx, cont)], max_len=12)[0]
    ref, _ = _reference(model64, ctx[-(12 + 1 - 3) :], cont)  # 12 inputs = 10 ctx + 2 cont
    assert got.logprob == pytest.approx(ref, abs=1e-10)
    with pytest.raises(ValueError, match="rolling"):
        loglikelihood(model64, [([1], list(range(20)))], max_len=12)


def test_rolling_windows_tile_each_token_once():
    toks = list(range(100, 123))  # 23 tokens
    wins = rolling_windows(toks, prefix_id=0, max_len=8, stride=3)
    predicted = [t for _, cont in wins for t in cont]
    assert predicted == toks
    for ctx, cont in wins:
        assert len(ctx) + len(cont) - 1 <= 8  # model inputs fit max_len
        assert len(ctx) >= 1
        seq = [0, *toks]
        start = seq.index(cont[0])
        assert seq[start - len(ctx) : start] == ctx  # the context is what precedes
    assert wins[0][0] == [0] and len(wins[0][1]) == 8
    assert all(len(c) == 8 - 3 + 1 or c[0] == 0 for c, _ in wins[1:])  # full context after
    # disjoint default windows: the last window still gets a full context (lm-eval semantics)
    last_ctx, last_cont = rolling_windows(toks, prefix_id=0, max_len=8)[-1]
    assert len(last_ctx) + len(last_cont) == 9


def test_rolling_equals_full_sequence_when_it_fits(model64, one_thread):
    doc = list(range(30, 50))
    full, _ = _reference(model64, [7], doc)  # prefix 7, whole doc in one window
    got = loglikelihood_rolling(model64, [doc], prefix_id=7, max_len=64)[0]
    assert got == pytest.approx(full, abs=1e-10)
    # short windows: the sum of each window's reference computation
    wins = rolling_windows(doc, prefix_id=7, max_len=6, stride=4)
    expected = sum(_reference(model64, c, x)[0] for c, x in wins)
    got = loglikelihood_rolling(model64, [doc, doc[:5]], prefix_id=7, max_len=6, stride=4)
    assert got[0] == pytest.approx(expected, abs=1e-10)
    assert got[1] == pytest.approx(_reference(model64, [7], doc[:5])[0], abs=1e-10)


def test_encode_pair_moves_trailing_space():
    tok = ByteTokenizer()
    ctx, cont = encode_pair(tok, "Answer: ", "42")
    assert ctx == [tok.bos_id, *b"Answer:"] and cont == list(b" 42")
    ctx, cont = encode_pair(tok, "", "hi")
    assert ctx == [tok.bos_id] and cont == list(b"hi")


def test_bits_per_byte_hand_computed():
    # 3 bytes, NLL 3 * ln 2 nats -> exactly 1 bit per byte
    assert bits_per_byte(3 * math.log(2), 3) == pytest.approx(1.0)
    assert bits_per_byte(2.0, 4) == pytest.approx(2.0 / (4 * math.log(2)))
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 0)


def test_batches_keep_question_groups_together_within_budget():
    from hybridlm.eval.loglik import _batches

    lengths = [10, 9, 8, 10, 3, 3, 3, 3, 3, 3, 40]
    groups = [[10], [0, 1, 2], [3], [4, 5, 6, 7, 8, 9]]
    batches = _batches(lengths, groups, max_tokens=40, max_rows=4)
    assert sorted(i for b in batches for i in b) == list(range(11))
    for b in batches:
        assert len(b) <= 4 and len(b) * max(lengths[i] for i in b) <= 40
    # [0, 1, 2] fits one batch and is not split; the 6-row group exceeds max_rows alone
    assert any({0, 1, 2} <= set(b) for b in batches)
    assert [4, 5, 6, 7] in batches and [8, 9] in batches
