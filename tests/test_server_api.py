"""The OpenAI API's breadth on `hybridlm serve`, driven by the official `openai` client (and
httpx for vLLM's `/tokenize` / `/detokenize`): log-probs (chat and completions, streamed and
not, echo), penalties, logit_bias, min_p, min_tokens, stop_token_ids and the other vLLM extras,
each checked against a pure-torch computation on the served model's own logits; bad values are
400s naming the field.

Same tiny model and server fixture as tests/test_server.py (a fresh server for this module),
on 127.0.0.1 only.
"""

from __future__ import annotations

import json

import pytest
import torch

import test_server as base
from _tiny import reference_greedy
from hybridlm.data.chat import render
from hybridlm.eval.loglik import loglikelihood

openai = base.openai
srv = base.srv
MODEL = base.MODEL
pytestmark = pytest.mark.usefixtures("one_thread")
LOGPROB_ATOL = 1e-5  # fp32: the engine's cached decode vs a full forward of the same tokens


def _complete(srv, prompt, **kw):
    kw = {"max_tokens": 8, "temperature": 0.0, **kw}
    return srv.client.completions.create(model=MODEL, prompt=prompt, **kw)


def _chat(srv, content: str, **kw):
    kw = {"max_tokens": 8, "temperature": 0.0, **kw}
    messages = [{"role": "user", "content": content}]
    return srv.client.chat.completions.create(model=MODEL, messages=messages, **kw)


@torch.no_grad()
def _logp(srv, seq: list[int]) -> torch.Tensor:
    """log_softmax of the served model's logits over `seq`, row t predicting seq[t + 1]."""
    return torch.log_softmax(srv.engine.model(torch.tensor([seq])).logits[0].float(), -1)


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _name(i: int) -> str:
    """The log-probs' token string of a byte-tokenizer id."""
    if i >= 256:
        return ["<|bos|>", "<|endoftext|>"][i - 256]
    return chr(i) if i < 128 else f"bytes:\\x{i:02x}"


def test_completion_logprobs_are_log_softmax_of_the_logits(srv, capsys):
    prompt = "The quick brown fox"
    kw = {"max_tokens": 10, "logprobs": 3, "ignore_eos": True}
    res = _complete(
        srv,
        prompt,
        **{k: v for k, v in kw.items() if k != "ignore_eos"},
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    lp = res.choices[0].logprobs
    gen = _ids(lp.tokens)
    p_ids = srv.tok.encode(prompt)
    ref = _logp(srv, p_ids + gen)[len(p_ids) - 1 : -1]
    err = max(
        abs(a - float(ref[t, i]))
        for t, (a, i) in enumerate(zip(lp.token_logprobs, gen, strict=True))
    )
    assert err < LOGPROB_ATOL
    for t, top in enumerate(lp.top_logprobs):
        vals, ids = ref[t].topk(3)
        want = {f"token_id:{gen[t]}": float(ref[t, gen[t]])}
        want.update(
            {f"token_id:{i}": float(v) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)}
        )
        assert top.keys() == want.keys()
        assert max(abs(top[k] - want[k]) for k in want) < LOGPROB_ATOL
    # the same request with token strings: bytes, text offsets into the text
    named = _complete(srv, prompt, max_tokens=10, logprobs=3, extra_body={"ignore_eos": True})
    nl = named.choices[0].logprobs
    assert nl.tokens == [_name(i) for i in gen] and nl.token_logprobs == lp.token_logprobs
    text = named.choices[0].text
    assert text == srv.tok.decode(gen) and len(nl.text_offset) == len(gen)
    for t in range(len(gen)):  # the characters before a token are those its prefix completes
        assert nl.text_offset[t] == _completed_chars(gen[:t], gen)
    with capsys.disabled():
        print(f"\ncompletions logprob max abs error vs log_softmax: {err:.2e}")


def _completed_chars(prefix: list[int], whole: list[int]) -> int:
    """Characters of decode(whole) that decode(prefix) already has (a reference for
    text_offset: a partial character is not counted until its last byte arrives)."""
    a, b = bytes(prefix).decode("utf-8", "replace"), bytes(whole).decode("utf-8", "replace")
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def test_chat_logprobs_top_logprobs_and_bytes(srv):
    res = _chat(srv, "Name a colour.", max_tokens=8, logprobs=True, top_logprobs=5)
    content = res.choices[0].logprobs.content
    msg_ids = srv.tok.encode(render([{"role": "user", "content": "Name a colour."}]))
    assert res.usage.prompt_tokens == len(msg_ids)
    gen = [next(i for i in range(258) if _name(i) == c.token) for c in content]
    assert bytes(b for c in content for b in c.bytes) == bytes(gen)  # raw bytes, partial too
    ref = _logp(srv, msg_ids + gen)[len(msg_ids) - 1 : -1]
    for t, c in enumerate(content):
        assert abs(c.logprob - float(ref[t, gen[t]])) < LOGPROB_ATOL
        vals, ids = ref[t].topk(5)
        assert [x.token for x in c.top_logprobs] == [_name(i) for i in ids.tolist()]
        assert (
            max(abs(x.logprob - float(v)) for x, v in zip(c.top_logprobs, vals, strict=True)) < 1e-5
        )
        assert [x.bytes for x in c.top_logprobs] == [[i] for i in ids.tolist()]
    none = _chat(srv, "Name a colour.", max_tokens=4, logprobs=True)
    assert all(c.top_logprobs == [] for c in none.choices[0].logprobs.content)
    assert _chat(srv, "Name a colour.", max_tokens=2).choices[0].logprobs is None


def test_streamed_logprobs_concatenate_to_the_plain_ones(srv):
    kw = {"max_tokens": 24, "logprobs": 2, "echo": True, "extra_body": {"ignore_eos": True}}
    plain = _complete(srv, "Once upon", **kw).choices[0]
    # a stop string that trims the text mid-way (tokens held back until then never stream)
    stop = next(c for c in plain.text[12:] if c.isprintable() and c != "\ufffd")
    for extra in ({}, {"stop": [stop]}):
        ref = _complete(srv, "Once upon", **kw, **extra).choices[0]
        chunks = [c.choices[0] for c in _complete(srv, "Once upon", stream=True, **kw, **extra)]
        got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in chunks:
            if c.logprobs is not None:
                for key in got:
                    got[key] += getattr(c.logprobs, key)
        assert got == {key: getattr(ref.logprobs, key) for key in got}, extra
        assert "".join(c.text for c in chunks) == ref.text
    chat_kw = {"max_tokens": 16, "logprobs": True, "top_logprobs": 2, "stop": [stop]}
    ref = _chat(srv, "Tell me", **chat_kw).choices[0]
    streamed = []
    for c in _chat(srv, "Tell me", stream=True, **chat_kw):
        if c.choices and c.choices[0].logprobs is not None:
            streamed += c.choices[0].logprobs.content
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in ref.logprobs.content]


def test_echo_logprobs_equal_loglik(srv):
    """Completions echo + logprobs (what lm-eval's local-completions sends for log-likelihood
    tasks) score the prompt as `eval.loglik` does; lm-eval's sum over the continuation and its
    is_greedy test give loglik's numbers."""
    ctx, cont = "The capital of France is", " Paris, of course."
    ids = srv.tok.encode(ctx + cont)
    n_ctx = len(srv.tok.encode(ctx))
    for max_tokens in (0, 1):  # vLLM-style scoring only, and lm-eval's max_tokens 1
        res = _complete(srv, ids, max_tokens=max_tokens, logprobs=1, echo=True)
        lp = res.choices[0].logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) == len(ids) + max_tokens and lp.text_offset[: len(ids)][:2] == [0, 0]
        scored = lp.token_logprobs[n_ctx : len(ids)]
        greedy = all(
            v == max(top.values())
            for v, top in zip(scored, lp.top_logprobs[n_ctx : len(ids)], strict=True)
        )
        (ref,) = loglikelihood(srv.engine.model, [(ids[:n_ctx], ids[n_ctx:])])
        assert abs(sum(scored) - ref.logprob) < 1e-4 and greedy == ref.is_greedy
        per_token = loglikelihood(
            srv.engine.model, [(ids[:i], ids[i : i + 1]) for i in range(1, len(ids))]
        )
        err = max(
            abs(a - r.logprob)
            for a, r in zip(lp.token_logprobs[1 : len(ids)], per_token, strict=True)
        )
        assert err < LOGPROB_ATOL
        assert res.choices[0].text.startswith(ctx + cont)
        assert res.usage.completion_tokens == max_tokens


def test_penalties_match_the_reference(srv):
    """A bias makes "A" the greedy choice again and again; each penalty breaks the run exactly
    where the reference computation says."""
    prompt, bias = "ab ab ab ab", {ord("A"): 3.0}
    p_ids = srv.tok.encode(prompt)
    base_kw = {"max_tokens": 12, "logprobs": 0, "logit_bias": {"65": 3.0}}
    plain = _complete(srv, prompt, **base_kw, extra_body={"ignore_eos": True}).choices[0].text
    assert plain.startswith("AAAAAA")
    cases = [
        ({"frequency_penalty": 1.2}, {}),
        ({"presence_penalty": 2.0}, {}),
        ({}, {"repetition_penalty": 3.0}),
        ({"frequency_penalty": 0.4, "presence_penalty": 0.5}, {"repetition_penalty": 1.3}),
    ]
    for kw, extra in cases:
        body = {"return_tokens_as_token_ids": True, "ignore_eos": True, **extra}
        res = _complete(srv, prompt, **base_kw, **kw, extra_body=body)
        got = _ids(res.choices[0].logprobs.tokens)
        ref = reference_greedy(
            srv.engine.model,
            p_ids,
            12,
            bias=bias,
            rep=extra.get("repetition_penalty", 1.0),
            freq=kw.get("frequency_penalty", 0.0),
            pres=kw.get("presence_penalty", 0.0),
        )
        assert got == ref and res.choices[0].text != plain, (kw, extra)


def test_vllm_sampling_extras_round_trip(srv):
    forced = _complete(srv, "x", max_tokens=5, logit_bias={"90": 100})
    assert forced.choices[0].text == "ZZZZZ"
    sampled = _complete(srv, "x", max_tokens=5, temperature=1.0, seed=1, logit_bias={"90": 100})
    assert sampled.choices[0].text == "ZZZZZ"
    # min_tokens holds back an EOS that logit_bias forces
    eos = {"257": 100}
    assert _complete(srv, "x", max_tokens=9, logit_bias=eos).usage.completion_tokens == 0
    held = _complete(srv, "x", max_tokens=9, logit_bias=eos, extra_body={"min_tokens": 4})
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    # stop_token_ids end with "stop", the token not in the text
    free = _complete(srv, "Count", max_tokens=10, extra_body={"ignore_eos": True}).choices[0].text
    byte = free.encode()[3]
    cut = _complete(srv, "Count", max_tokens=10, extra_body={"stop_token_ids": [byte]}).choices[0]
    assert cut.finish_reason == "stop" and cut.text.encode() == free.encode()[:3]
    # min_p 1 keeps only the most likely token: sampling is greedy; top_k 1 likewise
    greedy = _complete(srv, "Count", max_tokens=6).choices[0].text
    for extra in ({"min_p": 1.0}, {"top_k": 1}):
        hot = _complete(srv, "Count", max_tokens=6, temperature=1.5, seed=4, extra_body=extra)
        assert hot.choices[0].text == greedy, extra
    # include_stop_str_in_output keeps the stop string
    stop = free[5]
    kept = _complete(
        srv,
        "Count",
        max_tokens=10,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True, "ignore_eos": True},
    )
    assert kept.choices[0].text == free[: free.index(stop) + 1]
    # chat takes them all too
    res = _chat(
        srv,
        "hi",
        max_tokens=4,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={"65": 100},
        extra_body={"min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "top_k": 5},
    )
    assert res.choices[0].message.content == "AAAA"


def test_tokenize_and_detokenize(srv):
    root = srv.url.removesuffix("/v1")
    text = "Grüße, 世界!"
    res = srv.http.post(root + "/tokenize", json={"prompt": text, "return_token_strs": True})
    body = res.json()
    assert res.status_code == 200 and body["tokens"] == srv.tok.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == base.MAX_LEN
    assert body["token_strs"][:2] == ["<|bos|>", "G"] and body["token_strs"][3] == "Ã"
    bare = srv.http.post(root + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert bare.json()["tokens"] == body["tokens"][1:] and bare.json()["token_strs"] is None
    back = srv.http.post(root + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = srv.http.post(root + "/tokenize", json={"messages": messages}).json()
    usage = srv.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens and chat["tokens"] == srv.tok.encode(
        render(messages)
    )
    no_prompt = {"messages": messages, "add_generation_prompt": False}
    assert srv.http.post(root + "/tokenize", json=no_prompt).json()["tokens"] == srv.tok.encode(
        render(messages, add_generation_prompt=False)
    )
    bad = [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": messages}, 400, "prompt"),
        ("/tokenize", {"prompt": 3}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 258]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ]
    for path, payload, status, param in bad:
        res = srv.http.post(root + path, json=payload)
        assert res.status_code == status and res.json()["error"]["param"] == param, (path, res.text)
    cases = [  # (path, body around the field, field)
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {}, "messages"),
        ("/tokenize", {"prompt": "x"}, "return_token_strs"),
        ("/tokenize", {"prompt": "x"}, "add_special_tokens"),
        ("/tokenize", {"messages": messages}, "add_generation_prompt"),
        ("/detokenize", {}, "tokens"),
    ]
    for value in base_wrong():
        for path, around, field in cases:
            res = srv.http.post(root + path, content=json.dumps({**around, field: value}))
            assert res.status_code in (200, 400), res.text
            if res.status_code == 400:
                absent = value is None and not around and path == "/tokenize"  # null is absent
                want = "prompt" if absent else field
                assert res.json()["error"]["param"] == want, (field, value, res.text)


def base_wrong() -> list:
    return [None, [], {}, "x", True, 10**30, -1, 1.5, [1, "a", None]]


BAD = [
    # (path, body, param)
    ("/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("/completions", {"prompt": "x", "frequency_penalty": -2.01}, "frequency_penalty"),
    ("/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/completions", {"prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
    ("/completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("/completions", {"prompt": "x", "min_p": -0.1}, "min_p"),
    ("/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ("/completions", {"prompt": "x", "logit_bias": {"258": 1}}, "logit_bias"),
    ("/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ("/completions", {"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ("/completions", {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
    ("/completions", {"prompt": "x", "logit_bias": {"1": "big"}}, "logit_bias"),
    ("/completions", {"prompt": "x", "stop_token_ids": [258]}, "stop_token_ids"),
    ("/completions", {"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids"),
    ("/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/completions", {"prompt": "x", "logprobs": 1, "max_tokens": 0}, "logprobs"),
    ("/completions", {"prompt": "x", "logprobs": 1, "speculative": 2}, "logprobs"),
    (
        "/completions",
        {"prompt": "x", "frequency_penalty": 1, "speculative": 2},
        "frequency_penalty",
    ),
    ("/completions", {"prompt": "x", "min_tokens": 1, "speculative": 2}, "min_tokens"),
    ("/completions", {"prompt": "x", "echo": 1}, "echo"),
    ("/completions", {"prompt": "x", "max_thinking_tokens": -1}, "max_thinking_tokens"),
    ("/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    (
        "/completions",
        {"prompt": "x", "return_tokens_as_token_ids": "yes"},
        "return_tokens_as_token_ids",
    ),
    ("/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("/chat/completions", {"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
    ("/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/chat/completions", {"logit_bias": {"300": 5}}, "logit_bias"),
    ("/chat/completions", {"presence_penalty": 9}, "presence_penalty"),
    ("/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/chat/completions", {"response_format": "json"}, "response_format"),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_bad_values_name_the_field(srv, path, body, param):
    if path == "/chat/completions":
        body = {"messages": [{"role": "user", "content": "x"}], **body}
    res = srv.http.post(srv.url + path, json=body)
    assert res.status_code == 400, res.text
    err = res.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", res.text


@pytest.mark.parametrize(
    "extra,budget",
    [({"max_thinking_tokens": 3}, 3), ({"reasoning_effort": "minimal"}, 0)],
)
def test_reasoning_budget_closes_the_think_block(srv, extra, budget):
    """`max_thinking_tokens` / `reasoning_effort`: a prompt that ends inside `<think>` gets
    exactly `budget` reasoning tokens, then the closing tag on its own line."""
    kw = {"max_tokens": 20, "ignore_eos": True, "return_tokens_as_token_ids": True}
    res = _complete(srv, "Q: 2+2?\n<think>\n", logprobs=0, extra_body={**kw, **extra})
    ids = _ids(res.choices[0].logprobs.tokens)
    text = "\n" + bytes(i for i in ids[:budget] if i < 256).decode("utf-8", "replace")
    close = "</think>\n" if text.endswith("\n") else "\n</think>\n"
    assert bytes(ids[budget : budget + len(close)]) == close.encode()
