"""The engine's logits processors and API log-probs against pure-torch references computed here
from a tiny model's own logits: logit_bias, min_tokens, repetition / frequency / presence
penalties, min-p, stop_token_ids, a `TokenConstraint`, top-k log-probs of generated and prompt
tokens (the latter equal to `eval.loglik`'s numbers).

The model is tiny-super in fp64, so that the engine's cached decode and the references' full
forwards agree far below any argmax margin; the references are written token by token in
Python, independent of `infer.sampling`'s batched code."""

from __future__ import annotations

import pytest
import torch

from _tiny import reference_greedy
from hybridlm import HybridLM
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.eval.loglik import loglikelihood
from hybridlm.infer.engine import Engine
from hybridlm.infer.sampling import SamplingParams, TokenConstraint, filtered_probs
from hybridlm.presets import get_preset

pytestmark = pytest.mark.usefixtures("one_thread")
EOS = ByteTokenizer.eos_id


@pytest.fixture(scope="module")
def model() -> HybridLM:
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.pattern = 258, "M*ME"
    return HybridLM(cfg, seed=0).double().eval()


def _engine(model, **kw) -> Engine:
    return Engine(model, ByteTokenizer(), max_batch_size=4, **kw)


PROMPT = list(b"The cat sat on the")


@torch.no_grad()
def _next_logits(model, seq: list[int]) -> torch.Tensor:
    return model(torch.tensor([seq])).logits[0, -1]


@pytest.mark.parametrize(
    "kw",
    [
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 1.8},
        {"frequency_penalty": -0.5, "presence_penalty": 0.7, "repetition_penalty": 0.6},
        {"logit_bias": {ord("q"): 3.0, ord(" "): -2.0}, "frequency_penalty": 0.8},
    ],
)
def test_penalties_and_bias_change_greedy_output_as_the_reference(model, kw):
    n = 16
    plain = _engine(model).generate([PROMPT], SamplingParams(max_tokens=n, ignore_eos=True))[0]
    params = SamplingParams(max_tokens=n, ignore_eos=True, **kw)
    got = _engine(model).generate([PROMPT], params)[0]
    ref = reference_greedy(
        model,
        PROMPT,
        n,
        rep=kw.get("repetition_penalty", 1.0),
        freq=kw.get("frequency_penalty", 0.0),
        pres=kw.get("presence_penalty", 0.0),
        bias=kw.get("logit_bias"),
    )
    assert got.token_ids == ref
    assert got.token_ids != plain.token_ids  # the setting mattered


def test_penalty_rows_batch_with_plain_rows(model):
    """A batch mixing penalised, biased and plain requests gives each what it gets alone."""
    prompts = [PROMPT, list(b"Once upon"), list(b"1, 2, 3,")]
    params = [
        SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(max_tokens=10, ignore_eos=True),
        SamplingParams(max_tokens=10, ignore_eos=True, logit_bias={ord("7"): 5.0}),
    ]
    together = _engine(model).generate(prompts, params)
    for p, sp, out in zip(prompts, params, together, strict=True):
        assert out.token_ids == _engine(model).generate([p], sp)[0].token_ids


def test_logit_bias_forces_and_bans(model):
    forced = ord("Z")
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            max_tokens=8, temperature=temperature, seed=1, logit_bias={forced: 100.0}
        )
        out = _engine(model).generate([PROMPT], params)[0]
        assert out.token_ids == [forced] * 8
    greedy = _engine(model).generate([PROMPT], SamplingParams(max_tokens=1))[0].token_ids[0]
    banned = SamplingParams(max_tokens=1, logit_bias={greedy: -100.0})
    assert _engine(model).generate([PROMPT], banned)[0].token_ids != [greedy]
    with pytest.raises(ValueError, match="logit_bias"):
        _engine(model).add_request(PROMPT, SamplingParams(logit_bias={258: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0}).validate()


def test_min_tokens_masks_eos_stop_ids_and_stop_strings(model):
    eos_now = SamplingParams(max_tokens=20, logit_bias={EOS: 100.0})
    assert _engine(model).generate([PROMPT], eos_now)[0].token_ids == []
    out = _engine(model).generate(
        [PROMPT], SamplingParams(max_tokens=20, logit_bias={EOS: 100.0}, min_tokens=5)
    )[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "stop" and out.stop_token_id == EOS
    # a stop token id, likewise: masked for 3 tokens, then the bias picks it
    a = ord("a")
    stop_id = SamplingParams(max_tokens=9, logit_bias={a: 100.0}, stop_token_ids=[a], min_tokens=3)
    out = _engine(model).generate([PROMPT], stop_id)[0]
    assert len(out.token_ids) == 3 and a not in out.token_ids and out.stop_token_id == a
    # a stop string counts only if it ends after the first min_tokens tokens' text (vLLM)
    stop_str = SamplingParams(max_tokens=9, logit_bias={a: 100.0}, stop=["a"], min_tokens=3)
    out = _engine(model).generate([PROMPT], stop_str)[0]
    assert out.text == "aaa" and out.finish_reason == "stop"
    early = SamplingParams(max_tokens=9, logit_bias={a: 100.0}, stop=["a"])
    assert _engine(model).generate([PROMPT], early)[0].text == ""
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3).validate()


def test_min_p_reference_and_extremes(model):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # min_p 0.4: drop p < 0.2 -> 0.5 and 0.3 remain, renormalised
    p = filtered_probs(logits, temperature=1.0, min_p=0.4)
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # after temperature (vLLM): at T = 2 the ratios flatten and 0.15 survives min_p 0.4
    hot = filtered_probs(logits, temperature=2.0, min_p=0.4)
    assert (hot > 0).sum() == 3
    # min_p 1 keeps only the most likely token: sampling equals greedy
    greedy = _engine(model).generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    sampled = SamplingParams(max_tokens=8, temperature=1.5, seed=3, min_p=1.0, ignore_eos=True)
    assert _engine(model).generate([PROMPT], sampled)[0].token_ids == greedy.token_ids
    free = SamplingParams(max_tokens=8, temperature=1.5, seed=3, ignore_eos=True)
    assert _engine(model).generate([PROMPT], free)[0].token_ids != greedy.token_ids


class Digits:
    """Allows digits only, finishes after `n` of them; records its tokens."""

    made = 0

    def __init__(self, n: int = 3) -> None:
        self.n, self.tokens = n, []
        Digits.made += 1

    def allowed(self) -> torch.Tensor:
        mask = torch.zeros(258, dtype=torch.bool)
        mask[ord("0") : ord("9") + 1] = True
        return mask

    def accept(self, token_id: int) -> None:
        assert chr(token_id).isdigit()
        self.tokens.append(token_id)

    def finished(self) -> bool:
        return len(self.tokens) >= self.n


class Broken(Digits):
    def accept(self, token_id: int) -> None:
        raise RuntimeError("grammar exploded")


class Nothing(Digits):
    def allowed(self) -> torch.Tensor:
        return torch.zeros(200, dtype=torch.bool)  # shorter than V: the rest is disallowed too


def test_constraint_masks_finishes_and_fails_alone(model):
    assert isinstance(Digits(), TokenConstraint)
    Digits.made = 0
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            max_tokens=20, temperature=temperature, seed=0, constraint=lambda: Digits(3)
        )
        eng = _engine(model)
        outs = eng.generate([PROMPT, PROMPT], params)  # two sequences: two constraints
        for out in outs:
            assert out.text.isdigit() and len(out.token_ids) == 3
            assert out.finish_reason == "stop" and out.error is None
    assert Digits.made == 4
    # greedy under the mask is the argmax over the allowed ids
    logits = _next_logits(model, PROMPT)
    first = int(logits[ord("0") : ord("9") + 1].argmax()) + ord("0")
    greedy = _engine(model).generate([PROMPT], SamplingParams(constraint=Digits))[0]
    assert greedy.token_ids[0] == first
    # a failing constraint ends its own request; the batch carries on
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    bad, ok = _engine(model).generate(
        [PROMPT, PROMPT], [SamplingParams(max_tokens=6, constraint=Broken), plain]
    )
    assert bad.finish_reason == "abort" and "grammar exploded" in bad.error
    assert len(bad.token_ids) == 1  # the token that failed to advance it stays
    assert ok.finish_reason == "length" and len(ok.token_ids) == 6
    empty = _engine(model).generate([PROMPT], SamplingParams(max_tokens=6, constraint=Nothing))
    assert empty[0].finish_reason == "stop" and empty[0].token_ids == []
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(constraint=Digits, speculative=2).validate()


@torch.no_grad()
def test_top_logprobs_are_the_raw_distribution(model):
    """Generated tokens' log-probs are log_softmax of the raw logits (before temperature and
    penalties, vLLM's default) and their top k is the top k of that."""
    k = 4
    params = SamplingParams(
        max_tokens=10, temperature=0.8, seed=5, top_logprobs=k, frequency_penalty=1.0
    )
    out = _engine(model).generate([PROMPT], params)[0]
    assert len(out.top_logprobs) == len(out.token_ids) == 10
    seq = torch.tensor([PROMPT + out.token_ids])
    logp = torch.log_softmax(model(seq).logits[0, len(PROMPT) - 1 : -1], -1)
    worst = 0.0
    for t, entry in enumerate(out.top_logprobs):
        assert entry.token_id == out.token_ids[t]
        worst = max(worst, abs(entry.logprob - float(logp[t, entry.token_id])))
        vals, ids = logp[t].topk(k)
        assert [i for i, _ in entry.top] == ids.tolist()
        top = torch.tensor([v for _, v in entry.top], dtype=torch.float64)
        torch.testing.assert_close(top, vals, rtol=0, atol=1e-9)
    assert worst < 1e-9
    zero = _engine(model).generate([PROMPT], SamplingParams(max_tokens=3, top_logprobs=0))[0]
    assert all(e.top == () for e in zero.top_logprobs)
    assert _engine(model).generate([PROMPT], SamplingParams(max_tokens=3))[0].top_logprobs is None


@pytest.mark.parametrize("prefix_block", [4, 64])
def test_prompt_logprobs_equal_loglik(model, prefix_block):
    """Echo's prompt log-probs (over several prefill segments, and after a prefix-cache entry
    exists) equal `eval.loglik.loglikelihood` token by token; max_tokens 0 only scores."""
    prompt = [ByteTokenizer.bos_id, *b"Paris is the capital of France."]
    eng = _engine(model, prefix_block=prefix_block)
    eng.generate([prompt], SamplingParams(max_tokens=2))  # leaves prefix-cache entries
    outs = eng.generate(
        [prompt, prompt],
        [SamplingParams(max_tokens=0, prompt_logprobs=2), SamplingParams(prompt_logprobs=1)],
    )
    ref = loglikelihood(model, [(prompt[:i], prompt[i : i + 1]) for i in range(1, len(prompt))])
    for out in outs:
        lps = out.prompt_logprobs
        assert lps[0] is None and len(lps) == len(prompt)
        assert [e.token_id for e in lps[1:]] == prompt[1:]
        got = torch.tensor([e.logprob for e in lps[1:]], dtype=torch.float64)
        want = torch.tensor([r.logprob for r in ref], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    assert outs[0].token_ids == [] and outs[0].finish_reason == "length"
    assert len(outs[1].token_ids) > 0 and all(len(e.top) == 1 for e in outs[1].prompt_logprobs[1:])


def test_speculative_refuses_what_it_cannot_honour():
    for kw in (
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"logit_bias": {1: 1.0}},
        {"min_p": 0.1},
        {"min_tokens": 1},
        {"top_logprobs": 0},
        {"prompt_logprobs": 0},
    ):
        with pytest.raises(ValueError, match="speculative"):
            SamplingParams(speculative=2, **kw).validate()
    for kw in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"min_p": 1.5},
        {"top_logprobs": 21},
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw).validate()
