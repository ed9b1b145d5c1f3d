"""GRPO objective: every function against numbers computed by hand (arithmetic in comments),
and the loss gradient against autograd of a straightforward per-token reference."""

import math

import pytest
import torch

from _tiny import tiny_train_model
from hybridlm import HybridLM
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.generate import generate
from hybridlm.rl.environments import InstructionFollowingEnvironment
from hybridlm.rl.grpo import (
    ActiveSampler,
    Group,
    GRPOConfig,
    aggregate,
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    k3_kl,
    nonzero_variance_groups,
    truncated_importance_weights,
)

# Two completions, three positions. Ratios r = π/π_old chosen so each clipping case appears:
#   seq 0 (A = +1): r = [1.0, 1.5, 0.5], all 3 tokens count
#   seq 1 (A = -1): r = [1.0, 0.7, 1.2], the last token is padding
RATIO = torch.tensor([[1.0, 1.5, 0.5], [1.0, 0.7, 1.2]], dtype=torch.float64)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -2.5]], dtype=torch.float64)
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)


def _logp() -> torch.Tensor:
    return (OLD + RATIO.log()).clone().requires_grad_(True)


def test_group_advantages_centred_and_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # means 0.5 and 0.75 -> A = R - mean
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]])
    torch.testing.assert_close(group_advantages(rewards), expected)
    # std variant, sample std: group 0: Σd² = 4·0.25 = 1, var = 1/3, std = 0.57735 -> ±0.866025
    # group 1: Σd² = 3·0.0625 + 0.5625 = 0.75, var = 0.25, std = 0.5 -> 0.5, 0.5, 0.5, -1.5
    # (each divided by std + eps, eps = 1e-6); relative 1e-6, ~8 fp32 ulps
    std = torch.tensor([[math.sqrt(1 / 3)], [0.5]], dtype=torch.float64) + 1e-6
    expected_std = (expected.double() / std).float()
    torch.testing.assert_close(
        group_advantages(rewards, std_normalize=True), expected_std, rtol=1e-6, atol=0
    )
    # an all-equal group has zero advantage in both variants (eps keeps std division finite)
    flat = torch.tensor([[1.0, 1.0, 1.0]])
    assert group_advantages(flat).abs().sum() == 0
    assert group_advantages(flat, std_normalize=True).abs().sum() == 0
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.ones(4))


def test_nonzero_variance_groups():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    assert nonzero_variance_groups(rewards).tolist() == [False, False, True, False]


def test_clipped_surrogate_hand_values():
    obj, ratio = clipped_surrogate(_logp(), OLD, ADV, 0.2, 0.28)
    torch.testing.assert_close(ratio, RATIO)
    # clip range [0.8, 1.28]
    # seq 0, A=+1: min(1, 1) = 1; min(1.5, 1.28) = 1.28; min(0.5, 0.8) = 0.5
    # seq 1, A=-1: min(-1, -1) = -1; min(-0.7, -0.8) = -0.8; min(-1.2, -1.2) = -1.2
    expected = torch.tensor([[1.0, 1.28, 0.5], [-1.0, -0.8, -1.2]], dtype=torch.float64)
    torch.testing.assert_close(obj, expected)


def test_token_and_sequence_aggregation():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # token: (1 + 2 + 3 + 4) / 4 = 2.5 ; with a global count of 8 tokens: 10 / 8 = 1.25
    assert aggregate(x, m, "token").item() == pytest.approx(2.5)
    assert aggregate(x, m, "token", num_tokens=8).item() == pytest.approx(1.25)
    # sequence: mean(2, 4) = 3 ; over 4 sequences globally: (2 + 4) / 4 = 1.5
    assert aggregate(x, m, "sequence").item() == pytest.approx(3.0)
    assert aggregate(x, m, "sequence", num_sequences=4).item() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="mode"):
        aggregate(x, m, "batch")


def test_grpo_loss_token_level_hand_values_and_gradient():
    logp = _logp()
    loss, stats = grpo_loss(logp, OLD, ADV, MASK, config=GRPOConfig(tis_cap=None))
    # counted objectives: 1 + 1.28 + 0.5 - 1 - 0.8 = 0.98 over 5 tokens -> J = 0.196, loss = -J
    assert loss.item() == pytest.approx(-0.196)
    loss.backward()
    # d(-r·A/N)/dlogp = -r·A/N where unclipped, 0 where clipped or padded:
    # seq 0: -1·1/5 = -0.2, clipped -> 0, -0.5·1/5 = -0.1 ; seq 1: +1/5 = 0.2, clipped -> 0, pad 0
    expected = torch.tensor([[-0.2, 0.0, -0.1], [0.2, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)
    # clipped tokens: seq 0 pos 1 (A>0, r=1.5>1.28) high; seq 1 pos 1 (A<0, r=0.7<0.8) low: 1/5 each
    assert stats["clip_frac_high"].item() == pytest.approx(0.2)
    assert stats["clip_frac_low"].item() == pytest.approx(0.2)
    assert stats["clip_frac"].item() == pytest.approx(0.4)
    # ratio mean over counted tokens: (1 + 1.5 + 0.5 + 1 + 0.7) / 5 = 0.94
    assert stats["ratio_mean"].item() == pytest.approx(0.94)
    assert "tis_truncated_frac" not in stats


def test_grpo_loss_sequence_mean_variant():
    loss, _ = grpo_loss(_logp(), OLD, ADV, MASK, config=GRPOConfig(loss_agg="sequence"))
    # seq 0: (1 + 1.28 + 0.5) / 3 = 0.926667 ; seq 1: (-1 - 0.8) / 2 = -0.9
    # J = (0.926667 - 0.9) / 2 = 0.0133333
    assert loss.item() == pytest.approx(-(2.78 / 3 - 0.9) / 2)


def test_symmetric_clip_differs_from_clip_higher():
    # with ε_high = 0.2 the r = 1.2 token of an A>0 sequence would be clipped; check on seq 0:
    # A=+1, r=[1, 1.5, 0.5]: clip at 1.2 gives 1 + 1.2 + 0.5 = 2.7 vs 2.78 with 1.28
    m = torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.float64)
    sym, _ = grpo_loss(_logp(), OLD, ADV, m, config=GRPOConfig(eps_high=0.2))
    high, _ = grpo_loss(_logp(), OLD, ADV, m)
    assert sym.item() == pytest.approx(-2.7 / 3) and high.item() == pytest.approx(-2.78 / 3)


def test_truncated_importance_sampling_hand_values():
    # raw engine->trainer ratios π_old/π_rollout = [[1, 3, 0.5], [2.5, 1, 1]]
    raw = torch.tensor([[1.0, 3.0, 0.5], [2.5, 1.0, 1.0]], dtype=torch.float64)
    rollout = OLD - raw.log()
    w, over = truncated_importance_weights(OLD, rollout, 2.0)
    torch.testing.assert_close(
        w, torch.tensor([[1.0, 2.0, 0.5], [2.0, 1.0, 1.0]], dtype=torch.float64)
    )
    assert over.tolist() == [[False, True, False], [True, False, False]]
    w_mask, _ = truncated_importance_weights(OLD, rollout, 2.0, mode="mask")
    torch.testing.assert_close(
        w_mask, torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, 1.0]], dtype=torch.float64)
    )

    logp = _logp()
    loss, stats = grpo_loss(logp, OLD, ADV, MASK, rollout_logp_BT=rollout)
    # Σ w·obj = 1·1 + 2·1.28 + 0.5·0.5 + 2·(-1) + 1·(-0.8) = 1.01 over 5 tokens -> loss -0.202
    assert loss.item() == pytest.approx(-0.202)
    loss.backward()
    # the weight is a detached factor: grads -w·r·A/5 = [-0.2, 0, -0.05], [0.4, 0, 0]
    expected = torch.tensor([[-0.2, 0.0, -0.05], [0.4, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)
    # truncated: the ratios 3 and 2.5 (2 of 5 counted tokens); the padded 1.0 does not count
    assert stats["tis_truncated_frac"].item() == pytest.approx(0.4)
    # mean |old - rollout| = (0 + ln 3 + ln 2 + ln 2.5 + 0) / 5 = 2.708050 / 5 = 0.541610
    assert stats["logprob_diff_mean"].item() == pytest.approx(
        (math.log(3) + math.log(2) + math.log(2.5)) / 5
    )
    # mean weight over counted tokens: (1 + 2 + 0.5 + 2 + 1) / 5 = 1.3
    assert stats["tis_weight_mean"].item() == pytest.approx(1.3)


def test_k3_kl_hand_values_and_penalty():
    logp = torch.tensor([[0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64)
    # d = ref - logp = ln 2: e^d - d - 1 = 2 - 0.693147 - 1 = 0.306853 ; d = 0: 0
    torch.testing.assert_close(
        k3_kl(logp, ref), torch.tensor([[2 - math.log(2) - 1, 0.0]], dtype=torch.float64)
    )
    mask = torch.ones(1, 2, dtype=torch.float64)
    adv = torch.zeros(1, dtype=torch.float64)  # no policy term: the loss is β·KL alone
    loss, stats = grpo_loss(logp, None, adv, mask, ref_logp_BT=ref, config=GRPOConfig(kl_coef=0.5))
    # 0.5 · (0.306853 + 0) / 2 = 0.0767132
    assert loss.item() == pytest.approx(0.5 * (1 - math.log(2)) / 2)
    assert stats["kl"].item() == pytest.approx((1 - math.log(2)) / 2)
    loss.backward()
    # d/dlogp (e^{ref-logp} - (ref-logp) - 1) = -e^{ref-logp} + 1 -> (-2 + 1) = -1 and 0;
    # times β / N = 0.5 / 2 -> [-0.25, 0]
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, 0.0]], dtype=torch.float64))


def _reference_loss(logp, old, rollout, adv, mask, eps_low, eps_high, cap, beta, ref):
    """Per-token loop, the objective written out term by term."""
    total, count = 0.0, 0.0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[b, t] == 0:
                continue
            r = torch.exp(logp[b, t] - old[b, t])
            a = adv[b]
            if a >= 0:
                surrogate = torch.minimum(r, torch.tensor(1.0 + eps_high, dtype=r.dtype)) * a
            else:
                surrogate = torch.maximum(r, torch.tensor(1.0 - eps_low, dtype=r.dtype)) * a
            w = min(math.exp(float(old[b, t] - rollout[b, t])), cap)
            d = ref[b, t] - logp[b, t]
            total = total - w * surrogate + beta * (torch.exp(d) - d - 1)
            count += 1
    return total / count


def test_gradient_matches_reference_autograd():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp0 = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.25).double()
    cfg = GRPOConfig(kl_coef=0.05)
    a = logp0.clone().requires_grad_(True)
    loss, stats = grpo_loss(a, old, adv, mask, rollout_logp_BT=rollout, ref_logp_BT=ref, config=cfg)
    loss.backward()
    b = logp0.clone().requires_grad_(True)
    ref_loss = _reference_loss(b, old, rollout, adv, mask, 0.2, 0.28, 2.0, 0.05, ref)
    ref_loss.backward()
    # fp64 both ways, so 1e-10 relative (measured: loss 3e-16, gradients equal); the gradient
    # of a masked position is exactly 0, hence the tiny absolute floor
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=0)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-15)
    assert 0 < stats["clip_frac"].item() < 1 and 0 < stats["tis_truncated_frac"].item() < 1
    # and against finite differences of the loss itself (fp64), where no token sits on a kink:
    # relative 1e-6 (measured <= 1e-8; gradients here are 1e-4 .. 0.1); the absolute 1e-9 is the
    # round-off of a central difference, 2.2e-16 · |loss| (~1) / step (1e-6) ~ 2e-10, and the
    # floor of masked positions (exactly 0)
    eps = 1e-6
    flat = logp0.flatten()
    for i in range(0, flat.numel(), 7):
        up, dn = flat.clone(), flat.clone()
        up[i] += eps
        dn[i] -= eps
        f = lambda x: grpo_loss(  # noqa: E731
            x.view(B, T), old, adv, mask, rollout_logp_BT=rollout, ref_logp_BT=ref, config=cfg
        )[0].item()
        fd = (f(up) - f(dn)) / (2 * eps)
        assert fd == pytest.approx(a.grad.flatten()[i].item(), rel=1e-6, abs=1e-9)


def test_grpo_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(x, x, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(x, x, torch.zeros(2), torch.ones(2, 3), config=GRPOConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(x, x, torch.zeros(2), torch.ones(2, 4))
    with pytest.raises(ValueError, match="eps_low"):
        GRPOConfig(eps_low=1.0)
    with pytest.raises(ValueError, match="tis_cap"):
        GRPOConfig(tis_cap=0.0)


def test_active_sampler_fills_with_nonzero_variance_groups():
    stream = iter(
        [
            Group("a", [1, 1]),  # dropped: all correct
            Group("b", [0, 0]),  # dropped: all wrong
            Group("c", [1, 0]),  # kept
            Group("d", [1, 1]),  # dropped: all correct
            Group("e", [0, 1]),  # kept -> batch full after 5 draws
            Group("f", [0, 1]),
        ]
    )
    sampler = ActiveSampler(batch_groups=2, max_draws=10)
    batch = sampler.fill(lambda: next(stream))
    assert [g.prompt_id for g in batch] == ["c", "e"]
    s = sampler.stats.as_dict()
    assert (s["draws"], s["kept"], s["dropped_all_equal"]) == (5, 2, 3)
    assert (s["dropped_all_max"], s["dropped_all_min"], s["short_batches"]) == (2, 1, 0)
    # keep rate 2/5; mean drawn reward (2 + 0 + 1 + 2 + 1) / 10 = 0.6
    assert s["keep_rate"] == pytest.approx(0.4) and s["mean_reward_drawn"] == pytest.approx(0.6)


def test_active_sampler_stops_at_max_draws_and_buffers_pushed_groups():
    sampler = ActiveSampler(batch_groups=3, max_draws=4)
    draws = iter([Group(str(i), [1.0, 1.0] if i % 2 else [0.0, 1.0]) for i in range(100)])
    batch = sampler.fill(lambda: next(draws))
    # draws 0..3: kept 0 and 2, dropped 1 and 3; max_draws = 4 reached -> a short batch of 2
    assert [g.prompt_id for g in batch] == ["0", "2"]
    assert sampler.stats.short_batches == 1 and sampler.stats.draws == 4
    # push API (rollout workers): surplus groups stay buffered for the next batch
    for i in range(4):
        assert sampler.add(Group(f"p{i}", [0.0, 0.5])) is True
    assert sampler.ready
    assert [g.prompt_id for g in sampler.pop_batch()] == ["p0", "p1", "p2"]
    assert not sampler.ready
    assert [g.prompt_id for g in sampler.pop_batch()] == ["p3"]
    with pytest.raises(ValueError, match="max_draws"):
        ActiveSampler(batch_groups=4, max_draws=2)
    with pytest.raises(ValueError, match="at least 2"):
        sampler.add(Group("x", [1.0]))


def test_one_grpo_step_on_a_tiny_model(one_thread):
    """Generate a group from a tiny HybridLM, score it with a real verifier, and take GRPO steps:
    with ratio 1 and centred advantages the loss starts at 0 but its gradient does not, and a
    step raises the surrogate objective (the log-probs of better-than-average completions)."""
    model, tok = HybridLM(tiny_train_model(mtp=False), seed=0), ByteTokenizer()

    def env_with_bar(num_words: int) -> InstructionFollowingEnvironment:
        rec = {
            "prompt": "Say something.",
            "instruction_id_list": ["length_constraints:number_words"],
            "kwargs": [{"num_words": num_words, "relation": "at least"}],
        }
        return InstructionFollowingEnvironment([rec])

    G, T = 8, 24
    prompt_ids = tok.encode(env_with_bar(1)[0].prompt)
    out_GT = generate(model, torch.tensor([prompt_ids] * G), T, temperature=1.0, seed=0)
    texts = [tok.decode(r.tolist()) for r in out_GT]
    # the word-count bar that splits this group, so both outcomes occur whatever bytes the
    # untrained model sampled on this machine
    for bar in range(1, T + 1):
        env = env_with_bar(bar)
        rewards_1G = torch.tensor([[env.score(env[0], t).value for t in texts]])
        if nonzero_variance_groups(rewards_1G).item():
            break
    assert nonzero_variance_groups(rewards_1G).item(), texts
    adv_G = group_advantages(rewards_1G)[0]
    seq_GL = torch.cat([torch.tensor([prompt_ids] * G), out_GT], dim=1)
    P = len(prompt_ids)

    def completion_logp():
        logits = model(seq_GL).logits[:, P - 1 : -1].float()  # positions predicting the completion
        return torch.log_softmax(logits, -1).gather(-1, out_GT[..., None])[..., 0]

    mask_GT = torch.ones(G, out_GT.shape[1])
    model.train()
    logp_GT = completion_logp()
    old_GT = logp_GT.detach()
    loss, stats = grpo_loss(logp_GT, old_GT, adv_G, mask_GT)
    # Σ_i A_i · T / (G·T) = 0 since the advantages are centred and all lengths are equal
    assert abs(loss.item()) < 1e-6 and stats["clip_frac"].item() == 0.0
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))
    assert grad_norm > 0

    def surrogate() -> float:
        with torch.no_grad():
            return (adv_G[:, None] * completion_logp()).mean().item()

    before = surrogate()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        opt.step()
        opt.zero_grad()
        loss, stats = grpo_loss(completion_logp(), old_GT, adv_G, mask_GT)
        loss.backward()
    assert surrogate() > before
    assert loss.item() < 0 and 0.0 <= stats["clip_frac"].item() <= 1.0
