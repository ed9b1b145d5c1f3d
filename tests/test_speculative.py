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
@pytest.mark.parametrize("draft_len", [1, 2, 3, 5, 7])
def test_speculative_greedy_equals_greedy_many_prompts_and_seeds(name, draft_len):
    _check(name, draft_len, seeds=[0, 1, 2], prompt_lens=[1, 5, 17, 40])


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
