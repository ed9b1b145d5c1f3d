"""The OpenAI-compatible server, driven by the official `openai` client against a real uvicorn
server on 127.0.0.1: both endpoints streamed and not, usage, stop, max_tokens, seeds, n,
speculative stats, OpenAI-shaped 4xx errors, engine failures, disconnects, concurrent clients;
and `hybridlm chat` with piped stdin.

The model is tiny-super with a 4-layer pattern (Mamba, attention, MoE; MTP head) and a
258-token vocabulary, so that every generated id is a byte and the texts are not empty.
"""

from __future__ import annotations

import io
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hybridlm.cli import main  # noqa: E402
from hybridlm.data.chat import render  # noqa: E402
from hybridlm.data.tokenizer import ByteTokenizer  # noqa: E402
from hybridlm.infer.engine import Engine  # noqa: E402
from hybridlm.infer.protocol import SPEC_HEADER  # noqa: E402
from hybridlm.infer.responses import spec_stats_dict  # noqa: E402
from hybridlm.infer.server import serve_in_background  # noqa: E402
from hybridlm.model.model import HybridLM  # noqa: E402
from hybridlm.presets import get_preset  # noqa: E402

MODEL = "tiny"
MAX_LEN = 128
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def srv():
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.pattern = 258, "M*ME"
    tok = ByteTokenizer()
    engine = Engine(HybridLM(cfg, seed=0), tok, max_batch_size=8, max_model_len=MAX_LEN)
    with serve_in_background(engine, MODEL) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=TIMEOUT)
        http = httpx.Client(timeout=TIMEOUT)
        yield SimpleNamespace(url=url, engine=engine, tok=tok, client=client, http=http)
        http.close()


def _complete(srv, prompt: str, **kw):
    kw = {"max_tokens": 8, "temperature": 0.0, **kw}
    return srv.client.completions.create(model=MODEL, prompt=prompt, **kw)


def _stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def test_models(srv):
    models = srv.client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert srv.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        srv.client.models.retrieve("other")


def test_completion_streamed_equals_plain_and_counts_usage(srv):
    prompt = "The quick brown fox"
    res = _complete(srv, prompt)
    choice = res.choices[0]
    assert res.model == MODEL and res.object == "text_completion" and choice.text
    n_prompt = len(srv.tok.encode(prompt))
    assert res.usage.prompt_tokens == n_prompt
    assert res.usage.completion_tokens == 8 and choice.finish_reason == "length"
    assert res.usage.total_tokens == n_prompt + 8
    stream = _complete(srv, prompt, stream=True, stream_options={"include_usage": True})
    text, chunks = _stream_text(stream)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == res.usage.model_dump()
    # without include_usage no chunk carries usage
    assert all(c.usage is None for c in _complete(srv, prompt, stream=True))


def test_chat_completion_both_ways(srv):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    kw = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0.0}
    res = srv.client.chat.completions.create(**kw)
    msg = res.choices[0].message
    assert res.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert "<|im_end|>" not in msg.content
    assert res.usage.prompt_tokens == len(srv.tok.encode(render(messages)))
    assert res.usage.completion_tokens == 8
    chunks = list(srv.client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == res.choices[0].finish_reason


def test_stop_and_max_tokens(srv):
    full = _complete(srv, "Once upon a time", max_tokens=12).choices[0].text
    stop = next(c for c in full[2:] if c != "\ufffd")
    expected = full[: full.index(stop)]
    res = _complete(srv, "Once upon a time", max_tokens=12, stop=[stop, "never-there"])
    assert res.choices[0].text == expected and res.choices[0].finish_reason == "stop"
    assert res.usage.completion_tokens < 12
    streamed, _ = _stream_text(
        _complete(srv, "Once upon a time", max_tokens=12, stop=stop, stream=True)
    )
    assert streamed == expected
    short = _complete(srv, "Once upon a time", max_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    none = _complete(srv, "Once upon a time", max_tokens=0)
    assert none.choices[0].text == "" and none.usage.completion_tokens == 0


def test_seed_n_echo_and_prompt_lists(srv):
    kw = {"temperature": 1.0, "max_tokens": 6}
    a = _complete(srv, "Roll:", seed=7, **kw).choices[0].text
    assert _complete(srv, "Roll:", seed=7, **kw).choices[0].text == a
    b = _complete(srv, "Roll:", seed=8, **kw).choices[0].text
    assert b != a
    both = _complete(srv, "Roll:", seed=7, n=2, **kw).choices
    assert [c.index for c in both] == [0, 1] and [c.text for c in both] == [a, b]
    many = _complete(srv, ["Roll:", "Hi"], max_tokens=2)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.usage.prompt_tokens == len(srv.tok.encode("Roll:")) + len(srv.tok.encode("Hi"))
    echo = _complete(srv, "Roll:", max_tokens=2, echo=True).choices[0].text
    assert echo.startswith("Roll:") and echo[5:] == many.choices[0].text


def test_speculative_returns_stats_and_greedy_text(srv):
    plain = _complete(srv, "Draft me", max_tokens=8)
    assert "speculative" not in (plain.model_extra or {})
    res = _complete(srv, "Draft me", max_tokens=8, extra_body={"speculative": 2})
    assert res.choices[0].text == plain.choices[0].text
    stats = res.model_extra["speculative"]
    assert stats["draft_len"] == 2 and stats["steps"] >= 1
    assert stats["acceptance_length"] >= 1 and len(stats["acceptance_by_position"]) == 2
    via_header = _complete(srv, "Draft me", max_tokens=8, extra_headers={SPEC_HEADER: "3"})
    assert via_header.choices[0].text == plain.choices[0].text
    assert via_header.model_extra["speculative"]["draft_len"] == 3
    kw = {"max_tokens": 4, "extra_body": {"speculative": 2}}
    _, chunks = _stream_text(_complete(srv, "Draft me", stream=True, **kw))
    one = chunks[-1].model_extra["speculative"]
    assert one["draft_len"] == 2
    pair = _complete(srv, "Draft me", n=2, **kw).model_extra["speculative"]
    assert pair["steps"] == 2 * one["steps"]  # summed over the two (greedy, equal) choices


def test_spec_stats_without_to_dict():
    stats = SimpleNamespace(
        draft_len=2, steps=4, acceptance_length=1.5, acceptance_by_position=lambda: [0.5, 0.0]
    )
    assert spec_stats_dict(stats) == {
        "draft_len": 2,
        "steps": 4,
        "acceptance_length": 1.5,
        "acceptance_by_position": [0.5, 0.0],
    }


BAD_REQUESTS = [
    # (path, body, status, param)
    ("/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/completions", {"prompt": "x" * MAX_LEN}, 400, "prompt"),
    ("/completions", {"prompt": "x", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("/completions", {"prompt": [100000]}, 400, "prompt"),  # beyond the vocabulary
    ("/completions", {"prompt": []}, 400, "prompt"),
    ("/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/completions", {"prompt": 3}, 400, "prompt"),
    ("/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/completions", {"prompt": "x", "speculative": 99}, 400, "speculative"),
    ("/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("/completions", ["not", "an", "object"], 400, None),
    ("/chat/completions", {"model": "gpt-4", "messages": []}, 404, "model"),
    ("/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/chat/completions", {"messages": "hi"}, 400, "messages"),
    (
        "/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_p": -1},
        400,
        "top_p",
    ),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(srv, path, body, status, param):
    res = srv.http.post(srv.url + path, json=body)
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_malformed_requests(srv):
    for raw in (b"{", b"", b"\xff\xfe", b"null"):
        res = srv.http.post(srv.url + "/completions", content=raw)
        assert res.status_code == 400 and res.json()["error"]["code"] == "invalid_json"
    res = srv.http.post(srv.url + "/completions", json={"prompt": "x"}, headers={SPEC_HEADER: "a"})
    assert res.status_code == 400 and res.json()["error"]["param"] == SPEC_HEADER
    for method, path in (("GET", "/nope"), ("GET", "/completions"), ("DELETE", "/models")):
        res = srv.http.request(method, srv.url + path)
        assert res.status_code in (404, 405) and res.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        _complete(srv, "x", temperature=9)


def test_engine_failure_fails_the_request_not_the_server(srv, monkeypatch):
    real, calls = srv.engine.step, []

    def flaky():
        calls.append(1)
        if len(calls) in (1, 4):  # the first call of a request, and mid-stream
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(srv.engine, "step", flaky)
    res = srv.http.post(srv.url + "/completions", json={"prompt": "x", "max_tokens": 2})
    assert res.status_code == 500
    assert (
        res.json()["error"]["type"] == "server_error" and "boom" in res.json()["error"]["message"]
    )
    with pytest.raises(openai.APIError, match="boom"):
        _stream_text(_complete(srv, "x", max_tokens=8, stream=True))
    assert _complete(srv, "x", max_tokens=2).usage.completion_tokens == 2


REPLY = (
    "<think>\nThe user wants the weather.\n</think>\nLet me check.\n"
    '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
)


@pytest.mark.parametrize("stop_reason", ["stop", "length"])
def test_chat_reply_is_parsed_into_reasoning_and_tool_calls(srv, monkeypatch, stop_reason):
    """The engine's text is replaced by a scripted reply that grows with the generated tokens
    (a random tiny model does not write tags); the server must split it into OpenAI fields,
    streamed and not, and both ways must agree."""
    real = srv.engine.step

    def scripted():
        outs = real()
        for out in outs:
            n = len(out.token_ids)
            text = REPLY if out.finished else REPLY[: 7 * n]
            out.delta_text, out.text = text[len(out.text) :], text
            if out.finished:
                out.finish_reason = stop_reason
        return outs

    monkeypatch.setattr(srv.engine, "step", scripted)
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "max_tokens": 24,
        "temperature": 0.0,
    }
    res = srv.client.chat.completions.create(**kw)
    msg, choice = res.choices[0].message, res.choices[0]
    assert msg.reasoning_content == "The user wants the weather."
    assert msg.content == "Let me check."
    (call,) = msg.tool_calls
    assert call.function.name == "weather" and json.loads(call.function.arguments) == {
        "city": "Oslo"
    }
    assert choice.finish_reason == ("tool_calls" if stop_reason == "stop" else "length")
    chunks = list(srv.client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    # no tag is ever streamed, and the deltas add up to the non-streamed fields
    streamed = "".join(d.content or "" for d in deltas)
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed == msg.content and thought == msg.reasoning_content
    assert sum(1 for d in deltas if getattr(d, "reasoning_content", None)) > 1  # incremental
    (streamed_calls,) = [d.tool_calls for d in deltas if d.tool_calls]
    assert streamed_calls[0].index == 0 and streamed_calls[0].function.name == "weather"
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_client_disconnect_aborts(srv, monkeypatch):
    aborted: list[str] = []
    real = srv.engine.abort
    monkeypatch.setattr(srv.engine, "abort", lambda rid: (aborted.append(rid), real(rid)))
    real_step = srv.engine.step

    def slow_step():  # >= 2 s for 110 tokens however fast decoding is, so the client times out
        time.sleep(0.02)
        return real_step()

    monkeypatch.setattr(srv.engine, "step", slow_step)
    body = {"prompt": "a long one", "max_tokens": 110, "temperature": 0, "ignore_eos": True}
    with srv.http.stream("POST", srv.url + "/completions", json={**body, "stream": True}) as res:
        assert next(res.iter_lines()).startswith("data: ")
    with pytest.raises(httpx.ReadTimeout):
        srv.http.post(srv.url + "/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + TIMEOUT
    while (len(aborted) < 2 or srv.engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(aborted) == 2 and aborted[0].startswith("cmpl-")
    assert not srv.engine.has_unfinished()


def test_concurrent_clients_match_sequential(srv):
    prompts = [f"Client {i} says" for i in range(8)]
    sequential = [_complete(srv, p, max_tokens=4).choices[0].text for p in prompts]

    def client(i: int) -> list[str]:
        plain = _complete(srv, prompts[i], max_tokens=4).choices[0].text
        streamed, _ = _stream_text(_complete(srv, prompts[i], max_tokens=4, stream=True))
        return [plain, streamed]

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client, i) for i in range(8)]
        results = [f.result(timeout=TIMEOUT) for f in futures]
    assert results == [[s, s] for s in sequential]


def test_chat_cli_with_piped_stdin(monkeypatch, capsys):
    lines = "Hello\n\n/reset\nHello\n/bogus\nAnd you?\n/exit\nnot read\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    argv = ["chat", "--preset", "tiny-super", "--set", "vocab_size=258", "--set", "pattern='M*ME'"]
    assert main(argv + ["--max-tokens", "5", "--temperature", "0", "--system", "Hi"]) == 0
    out, err = capsys.readouterr()
    replies = out.split("\n")
    assert len(replies) == 4 and replies[3] == ""  # three replies, each ending in a newline
    assert replies[0] == replies[1]  # /reset: the same first turn again, greedy
    assert "[conversation reset]" in err and "unknown command /bogus" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n"))
    assert main(argv + ["--max-tokens", "5", "--temperature", "0", "--speculative", "2"]) == 0
    assert "acceptance length" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["chat", "--preset", "tiny-olmo", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["chat", "--preset", "tiny-olmo", "--max-thinking-tokens", "-1"]) == 2
    assert "max_thinking_tokens" in capsys.readouterr().err
    # serve's engine flags are checked before anything listens
    assert main(["serve", "--preset", "tiny-super", "--spec-max-batch", "0"]) == 2
    assert "spec_max_batch must be >= 1" in capsys.readouterr().err


def test_json_error_body_is_parseable_by_clients(srv):
    res = srv.http.post(srv.url + "/chat/completions", json={"messages": [{"role": "user"}]})
    assert json.loads(res.text)["error"]["message"].startswith("messages[0]")
