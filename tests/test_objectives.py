"""Post-training losses: exact values computed by hand, gradients against straightforward
references (and finite differences), SFT normalisation across micro-batches == one big batch."""

import math

import pytest
import torch
import torch.nn.functional as F

from hybridlm.train.objectives import (
    IGNORE_INDEX,
    distill_loss,
    dpo_loss,
    on_policy_distill_loss,
    reverse_kl,
    sequence_logps,
    sft_token_weights,
    skew_reverse_kl,
    topk_forward_kl,
    weighted_nll,
)

pytestmark = pytest.mark.usefixtures("one_thread")
LN3 = math.log(3.0)
I = IGNORE_INDEX


# ---------------------------------------------------------------------------- SFT weights
def test_sft_weights_by_hand():
    # micro-batch 1: conv 0 has 3 assistant tokens, conv 1 has 1; micro-batch 2: conv 2 has 2.
    # global: 6 tokens, 3 conversations.
    labels1 = torch.tensor([[I, 5, 6, 7, I, I, 9]])
    conv1 = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    labels2 = torch.tensor([[I, 4, 4, -100]])
    conv2 = torch.tensor([[2, 2, 2, -1]])
    kw = {"num_tokens": 6, "num_conversations": 3}
    tok1 = sft_token_weights(labels1, conv1, mode="token", **kw)
    torch.testing.assert_close(tok1, torch.tensor([[0, 1 / 6, 1 / 6, 1 / 6, 0, 0, 1 / 6]]))
    s1 = sft_token_weights(labels1, conv1, mode="sample", **kw)
    s2 = sft_token_weights(labels2, conv2, mode="sample", **kw)
    # conv 0: 1 / (|O_0| * |C|) = 1 / (3 * 3) = 1/9; conv 1: 1 / (1 * 3) = 1/3;
    # conv 2: 1 / (2 * 3) = 1/6; all weights sum to 3 * 1/9 + 1/3 + 2 * 1/6 = 1
    torch.testing.assert_close(s1, torch.tensor([[0, 1 / 9, 1 / 9, 1 / 9, 0, 0, 1 / 3]]))
    torch.testing.assert_close(s2, torch.tensor([[0, 1 / 6, 1 / 6, 0]]))
    assert abs(float(s1.sum() + s2.sum()) - 1) < 1e-6
    with pytest.raises(ValueError, match="token' or 'sample"):
        sft_token_weights(labels1, conv1, mode="mean", **kw)


def test_weighted_nll_by_hand_and_doc_boundaries():
    # V = 2, logits [0, ln 3]: p = [1/4, 3/4]; NLL(1) = ln(4/3), NLL(0) = ln 4.
    logits = torch.tensor([[[0.0, LN3]] * 4])
    labels = torch.tensor([[I, 1, 0, 1]])
    w = torch.tensor([[0.0, 0.5, 0.25, 1.0]])
    # shift 1: position t scores labels[t + 1]: 0.5 ln(4/3) + 0.25 ln 4 + 1.0 ln(4/3)
    want = 1.5 * math.log(4 / 3) + 0.25 * math.log(4)
    assert abs(float(weighted_nll(logits, labels, w)) - want) < 1e-6
    # shift 2 (MTP depth 1): position t scores labels[t + 2] = 0 (w .25) and 1 (w 1):
    # 0.25 ln 4 + ln(4/3); with doc ids [0, 0, 1, 1] the pair (0 -> 2) crosses: only (1 -> 3)
    assert (
        abs(
            float(weighted_nll(logits, labels, w, shift=2)) - (0.25 * math.log(4) + math.log(4 / 3))
        )
        < 1e-6
    )
    doc = torch.tensor([[0, 0, 1, 1]])
    got = weighted_nll(logits, labels, w, shift=2, doc_ids_BL=doc)
    assert abs(float(got) - 0.0) < 1e-6  # (1 -> 3) crosses too: doc 0 -> doc 1
    doc = torch.tensor([[0, 1, 1, 1]])
    got = weighted_nll(logits, labels, w, shift=2, doc_ids_BL=doc)
    assert abs(float(got) - math.log(4 / 3)) < 1e-6


def test_sft_loss_gradients_match_per_conversation_reference():
    """sum_t w_t l_t with sample weights == mean over conversations of each one's mean NLL
    (written with a loop and F.cross_entropy), in value and gradient; token weights == the
    global token mean."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.tensor([[I, 1, 2, I, 3, 4], [I, 0, 0, 1, I, I]])
    conv = torch.tensor([[0, 0, 0, 1, 1, 1], [2, 2, 2, 2, -1, -1]])
    # conversations: 0 -> targets at t=1,2; 1 -> t=4,5; 2 -> t=1,2,3 (7 tokens, 3 convs)
    w = sft_token_weights(labels, conv, mode="sample", num_tokens=7, num_conversations=3)

    def naive_sample(logits):
        means = []
        for b, ts in ((0, [1, 2]), (0, [4, 5]), (1, [1, 2, 3])):
            pred = logits[b, [t - 1 for t in ts]]
            means.append(F.cross_entropy(pred, labels[b, ts]))
        return sum(means) / 3

    def naive_token(logits):
        pred = logits[:, :-1].reshape(-1, 5)
        return F.cross_entropy(pred, labels[:, 1:].reshape(-1), ignore_index=I)

    ours = weighted_nll(logits, labels, w.double())
    (ga,) = torch.autograd.grad(ours, logits)
    ref = naive_sample(logits)
    (gb,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ga, gb)
    w_tok = sft_token_weights(labels, conv, mode="token", num_tokens=7, num_conversations=3)
    ours = weighted_nll(logits, labels, w_tok.double())
    (ga,) = torch.autograd.grad(ours, logits)
    (gb,) = torch.autograd.grad(naive_token(logits), logits)
    torch.testing.assert_close(ga, gb)
    assert torch.autograd.gradcheck(lambda x: weighted_nll(x, labels, w.double()), (logits,))


# ---------------------------------------------------------------------------- DPO
def test_dpo_by_hand():
    pc, pr = torch.tensor([-2.0]), torch.tensor([-5.0])
    rc, rr = torch.tensor([-3.0]), torch.tensor([-4.0])
    # dpo, beta 0.1: chosen (pc - rc) = 1, rejected (pr - rr) = -1, margin 2
    # loss = -log sigmoid(0.1 * 2) = log(1 + e^-0.2) = 0.5981388693
    losses, m = dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert abs(float(losses) - math.log1p(math.exp(-0.2))) < 1e-6
    assert abs(float(losses) - 0.5981388693) < 1e-6
    assert m["reward_chosen"].tolist() == pytest.approx([0.1])
    assert m["reward_rejected"].tolist() == pytest.approx([-0.1])
    assert m["reward_margin"].tolist() == pytest.approx([0.2])
    assert m["reward_accuracy"].tolist() == [1.0]
    # dpo_norm, beta 5, 2 chosen and 4 rejected tokens: chosen -2/2 - (-3/2) = 0.5,
    # rejected -5/4 - (-4/4) = -0.25, margin 0.75: loss = log(1 + e^-3.75) = 0.0232452...
    losses, m = dpo_loss(
        pc,
        pr,
        rc,
        rr,
        beta=5.0,
        kind="dpo_norm",
        chosen_tokens_B=torch.tensor([2]),
        rejected_tokens_B=torch.tensor([4]),
    )
    assert abs(float(losses) - math.log1p(math.exp(-3.75))) < 1e-6
    assert m["reward_margin"].tolist() == pytest.approx([3.75])
    with pytest.raises(ValueError, match="dpo_norm needs"):
        dpo_loss(pc, pr, rc, rr, beta=5.0, kind="dpo_norm")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)


def test_sequence_logps_by_hand():
    # p = [1/4, 3/4] everywhere; targets (after the shift) 1, 0: log(3/4) + log(1/4)
    logits = torch.tensor([[[0.0, LN3]] * 3])
    labels = torch.tensor([[I, 1, 0]])
    s, n = sequence_logps(logits, labels)
    assert n.tolist() == [2] and abs(float(s) - math.log(3 / 16)) < 1e-6


def test_dpo_gradient_matches_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True)
    ref = torch.randn(4, 2, dtype=torch.float64, generator=g)
    n = torch.tensor([3, 5, 2, 7])

    def ours(x):
        return dpo_loss(
            x[:, 0],
            x[:, 1],
            ref[:, 0],
            ref[:, 1],
            beta=5.0,
            kind="dpo_norm",
            chosen_tokens_B=n,
            rejected_tokens_B=n + 1,
        )[0].mean()

    def naive(x):
        total = 0.0
        for i in range(4):
            c = (x[i, 0] - ref[i, 0]) / n[i]
            r = (x[i, 1] - ref[i, 1]) / (n[i] + 1)
            total = total + torch.log(1 + torch.exp(-5.0 * (c - r)))
        return total / 4

    (ga,) = torch.autograd.grad(ours(x), x)
    (gb,) = torch.autograd.grad(naive(x), x)
    torch.testing.assert_close(ga, gb)
    assert torch.autograd.gradcheck(ours, (x,))


# ---------------------------------------------------------------------------- distillation
def test_topk_forward_kl_and_distill_loss_by_hand():
    # teacher top-2 logits [ln 3, 0] at ids [0, 1]: p = [3/4, 1/4] (renormalised over the 2);
    # student logits [ln 2, 0, 0]: q = [1/2, 1/4, 1/4]
    # KL = 3/4 ln((3/4)/(1/2)) + 1/4 ln((1/4)/(1/4)) = 3/4 ln 1.5 = 0.3040988
    s = torch.tensor([[math.log(2.0), 0.0, 0.0]])
    t_logits, t_ids = torch.tensor([[LN3, 0.0]]), torch.tensor([[0, 1]])
    kl = topk_forward_kl(s, t_logits, t_ids)
    assert abs(float(kl) - 0.75 * math.log(1.5)) < 1e-6
    # with CE on target 0 (NLL = ln 2): 0.9 * 3/4 ln 1.5 + 0.1 * ln 2
    loss, parts = distill_loss(s, torch.tensor([0]), t_logits, t_ids)
    assert abs(float(loss) - (0.9 * 0.75 * math.log(1.5) + 0.1 * math.log(2))) < 1e-6
    assert abs(float(parts["ce"]) - math.log(2)) < 1e-6
    # an ignored target drops the position from both terms
    loss, _ = distill_loss(
        s.repeat(2, 1), torch.tensor([0, I]), t_logits.repeat(2, 1), t_ids.repeat(2, 1)
    )
    assert abs(float(loss) - (0.9 * 0.75 * math.log(1.5) + 0.1 * math.log(2))) < 1e-6
    # the teacher's mass outside its top-k is dropped: a third teacher logit changes nothing
    # once the top-2 are renormalised
    assert float(topk_forward_kl(s, t_logits, t_ids)) >= 0


def test_skew_and_reverse_kl_by_hand():
    # student q = [1/2, 1/2], teacher p = [3/4, 1/4]
    s, t = torch.tensor([[0.0, 0.0]]), torch.tensor([[LN3, 0.0]])
    # reverse KL(q || p) = 1/2 ln((1/2)/(3/4)) + 1/2 ln((1/2)/(1/4)) = 1/2 ln(4/3)
    assert abs(float(reverse_kl(s, t)) - 0.5 * math.log(4 / 3)) < 1e-6
    # skew, alpha 0.5: m = 0.5 p + 0.5 q = [5/8, 3/8];
    # KL(q || m) = 1/2 ln((1/2)/(5/8)) + 1/2 ln((1/2)/(3/8)) = 1/2 ln(16/15)
    assert abs(float(skew_reverse_kl(s, t, alpha=0.5)) - 0.5 * math.log(16 / 15)) < 1e-6
    with pytest.raises(ValueError, match="alpha"):
        skew_reverse_kl(s, t, alpha=0.0)


def test_on_policy_distill_by_hand():
    # sampled token with log q = ln 1/2 and log p = ln 3/4: A = ln 1.5,
    # surrogate = -A log q = -ln(1.5) ln(0.5) = 0.2810...; reverse-KL estimate = -ln 1.5
    lq = torch.tensor([math.log(0.5)], requires_grad=True)
    loss, m = on_policy_distill_loss(lq, torch.tensor([math.log(0.75)]))
    assert abs(float(loss.detach()) - (-math.log(1.5) * math.log(0.5))) < 1e-6
    assert abs(float(m["reverse_kl"]) + math.log(1.5)) < 1e-6
    loss.backward()
    assert abs(float(lq.grad) + math.log(1.5)) < 1e-6  # d/dlogq = -A (A is stopped)


def _naive_forward_kl(s, tl, ti, mask):
    total = 0.0
    for i in range(s.shape[0]):
        if not mask[i]:
            continue
        p = torch.exp(tl[i]) / torch.exp(tl[i]).sum()
        q = torch.exp(s[i]) / torch.exp(s[i]).sum()
        for k in range(tl.shape[1]):
            total = total + p[k] * torch.log(p[k] / q[ti[i, k]])
    return total / mask.sum()


def _naive_skew(s, t, alpha, mask):
    total = 0.0
    for i in range(s.shape[0]):
        if not mask[i]:
            continue
        q = torch.exp(s[i]) / torch.exp(s[i]).sum()
        p = torch.exp(t[i]) / torch.exp(t[i]).sum()
        mix = alpha * p + (1 - alpha) * q
        total = total + (q * torch.log(q / mix)).sum()
    return total / mask.sum()


def test_distillation_gradients_match_references():
    g = torch.Generator().manual_seed(1)
    T, V, K = 5, 7, 3
    s = torch.randn(T, V, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randn(T, V, dtype=torch.float64, generator=g)
    tl, ti = t.topk(K, dim=-1)
    mask = torch.tensor([True, True, False, True, True])
    targets = torch.tensor([1, 4, I, 0, 6])

    def fkl(s):
        return topk_forward_kl(s, tl, ti, mask)

    (ga,) = torch.autograd.grad(fkl(s), s)
    (gb,) = torch.autograd.grad(_naive_forward_kl(s, tl, ti, mask), s)
    torch.testing.assert_close(ga, gb)
    assert torch.autograd.gradcheck(fkl, (s,))

    def dl(s):
        return distill_loss(s, targets, tl, ti)[0]

    def dl_naive(s):
        ce = F.cross_entropy(s, targets, ignore_index=I, reduction="sum") / 4
        return 0.9 * _naive_forward_kl(s, tl, ti, mask) + 0.1 * ce

    (ga,) = torch.autograd.grad(dl(s), s)
    (gb,) = torch.autograd.grad(dl_naive(s), s)
    torch.testing.assert_close(ga, gb)

    for alpha in (0.3, 0.9, 1.0):

        def sk(s, alpha=alpha):
            return skew_reverse_kl(s, t, mask, alpha=alpha)

        (ga,) = torch.autograd.grad(sk(s), s)
        (gb,) = torch.autograd.grad(_naive_skew(s, t, alpha, mask), s)
        torch.testing.assert_close(ga, gb)
        assert torch.autograd.gradcheck(sk, (s,))


def test_on_policy_estimator_is_unbiased_for_reverse_kl():
    # E_{y ~ q}[grad surrogate(y)] = grad KL(q || p), exactly, by enumerating y over V
    g = torch.Generator().manual_seed(2)
    V = 6
    s = torch.randn(1, V, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randn(1, V, dtype=torch.float64, generator=g)
    logq = torch.log_softmax(s, -1)[0]
    logp = torch.log_softmax(t, -1)[0]
    expected = torch.zeros_like(s)
    for y in range(V):
        loss, _ = on_policy_distill_loss(logq[y : y + 1], logp[y : y + 1])
        (gy,) = torch.autograd.grad(loss, s, retain_graph=True)
        expected += logq[y].exp().detach() * gy
    (exact,) = torch.autograd.grad(reverse_kl(s, t), s)
    torch.testing.assert_close(expected, exact)


# ---------------------------------------------------------------------------- SFT micro-batches
@pytest.mark.parametrize("mode", ["token", "sample"])
def test_sft_micro_batches_give_the_big_batch_gradient(mode, tmp_path):
    from _tiny import tiny_train_model
    from hybridlm.data.sft import collate_rows
    from hybridlm.train.config import TrainConfig
    from hybridlm.train.post_training import ChatSource, SFTDataConfig
    from hybridlm.train.stages.sft import SFTRunConfig, sft_trainer
    from hybridlm.train.trainer import Step

    run = SFTRunConfig(
        model=tiny_train_model(),
        data=SFTDataConfig(
            sources=[ChatSource(kind="arithmetic", max_rows=40, seed=5)],
            seq_len=192,
            batch_size=4,
            held_out=0,
        ),
        train=TrainConfig(max_steps=1, out_dir=str(tmp_path), progress=False, plot=False),
    )
    tr = sft_trainer(run).module
    ex = tr.loader.examples
    rows = tr.loader._epoch_rows(0)[:4]
    full = collate_rows(ex, rows, 192)
    halves = [collate_rows(ex, rows[:2], 192), collate_rows(ex, rows[2:], 192)]
    n_tok, n_conv = int(full["num_loss_tokens"]), int(full["num_conversations"])
    assert n_tok == sum(int(h["num_loss_tokens"]) for h in halves)

    def grads(batches):
        tr.model.zero_grad(set_to_none=True)
        tr.tc.grad_accum = len(batches)
        total = 0.0
        for b in batches:
            ctx = {"norm": mode, "num_tokens": n_tok, "num_convs": n_conv}
            out = tr.loss(b, Step(batches, ctx=ctx))
            loss = out.value if out.mean is None else out.value + out.mean / len(batches)
            loss.backward()
            total += float(loss.detach())
        return total, {
            n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None
        }

    loss_big, g_big = grads([full])
    loss_acc, g_acc = grads(halves)
    assert abs(loss_big - loss_acc) < 1e-5
    assert g_big.keys() == g_acc.keys()
    for name in g_big:
        torch.testing.assert_close(g_acc[name], g_big[name], rtol=1e-4, atol=1e-6, msg=name)
