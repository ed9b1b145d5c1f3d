"""The reasoning budget (`SamplingParams.max_thinking_tokens`, Nemotron 3 Super §4.4): at most N
tokens inside the reply's `<think>` block, then the engine forces the closing tag on its own line
and the answer continues from it. The cut-off is exact for plain, speculative (rounds that would
run past it end early) and sampled requests; replies that do not reason are untouched."""

import pytest

from _tiny import ForcedTokens
from hybridlm import HybridLM
from hybridlm.data.chat import THINK_CLOSE
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.engine import Engine
from hybridlm.infer.sampling import SamplingParams
from hybridlm.presets import get_preset

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = ByteTokenizer()
THINKING = TOK.encode("<|im_start|>assistant\n<think>\n")  # the prompt ends inside the block


def _model() -> HybridLM:
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.mamba.chunk_size = 300, 8
    return HybridLM(cfg, seed=0).double().eval()


def _close(reasoning: list[int], lead: str = "\n") -> list[int]:
    """The forced closing tag after `reasoning` (the block's text before it starts `lead`)."""
    text = lead + TOK.decode(reasoning)
    close = THINK_CLOSE + "\n" if text.endswith("\n") else f"\n{THINK_CLOSE}\n"
    return TOK.encode(close, add_bos=False)


def _greedy(model, prompt, n, **kw):
    sp = SamplingParams(max_tokens=n, ignore_eos=True, **kw)
    return Engine(model, TOK).generate([prompt], sp)[0].token_ids


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_budget_cuts_the_reasoning_and_the_answer_follows(budget):
    model = _model()
    out = _greedy(model, THINKING, 30, max_thinking_tokens=budget)
    plain = _greedy(model, THINKING, 30)
    assert THINK_CLOSE not in TOK.decode(plain)  # the model would not close it by itself
    assert out[:budget] == plain[:budget]
    close = _close(out[:budget])
    assert out[budget : budget + len(close)] == close
    head = out[: budget + len(close)]
    assert out[len(head) :] == _greedy(model, THINKING + head, 30 - len(head))


def test_budget_counts_from_the_block_the_reply_opens():
    model = _model()
    prompt = TOK.encode("<|im_start|>assistant\n")
    opener = TOK.encode("<think>", add_bos=False)
    force = lambda: ForcedTokens(opener, 300, then_free=True)  # noqa: E731
    out = _greedy(model, prompt, 24, max_thinking_tokens=4, constraint=force)
    n = len(opener) + 4
    assert out[: len(opener)] == opener
    close = _close(out[len(opener) : n], lead="")
    assert out[n : n + len(close)] == close
    # a reply that opens no block is untouched by a budget
    free = _greedy(model, prompt, 24, max_thinking_tokens=0)
    assert free == _greedy(model, prompt, 24) and THINK_CLOSE not in TOK.decode(free)


def test_speculative_rounds_stop_at_the_budget(monkeypatch):
    """Speculative rows whose drafts run past the budget take only the tokens before the cut
    (the batch cache keeps that prefix), then verify the forced closing tag as known drafts."""
    from test_engine import _oracle_drafts

    model = _model()
    prompts = [THINKING, THINKING[:-1] + TOK.encode("x\n", add_bos=False)]
    budget = SamplingParams(max_tokens=26, ignore_eos=True, max_thinking_tokens=9)
    refs = {tuple(p): Engine(model, TOK).generate([p], budget)[0].token_ids for p in prompts}
    _oracle_drafts(monkeypatch, refs)
    cuts, real_cut = [], Engine._thinking_cut

    def spy(self, req, new):
        c = real_cut(self, req, new)
        cuts.append(c < len(new))
        return c

    monkeypatch.setattr(Engine, "_thinking_cut", spy)
    eng = Engine(model, TOK, max_batch_size=2)
    spec = SamplingParams(max_tokens=26, ignore_eos=True, max_thinking_tokens=9, speculative=4)
    outs = eng.generate(prompts, [spec, spec])
    for out, p in zip(outs, prompts, strict=True):
        assert out.token_ids == refs[tuple(p)]
    assert eng.stats["verify_steps"] < 26  # rounds emitted several tokens
    assert any(cuts)  # a round that ran past the budget was cut


def test_sampled_speculative_budget_is_exact():
    model = _model()
    for seed in range(4):
        sp = SamplingParams(
            max_tokens=20, temperature=1.0, seed=seed, max_thinking_tokens=5, speculative=3
        )
        out = Engine(model, TOK).generate([THINKING], sp)[0].token_ids
        close = _close(out[:5])
        assert out[5 : 5 + len(close)] == close and THINK_CLOSE not in TOK.decode(out[:5])


def test_budget_validation():
    with pytest.raises(ValueError, match="max_thinking_tokens"):
        SamplingParams(max_thinking_tokens=-1).validate()
    with pytest.raises(ValueError, match="max_thinking_tokens"):
        SamplingParams(max_thinking_tokens=1.5).validate()
