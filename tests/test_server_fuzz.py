"""The OpenAI-compatible server under hostile input, bounded in requests and time: malformed
bodies (truncated JSON, invalid UTF-8, lone surrogates, deep nesting, huge and empty bodies,
non-object JSON), every request field with values of the wrong type, huge values, clients that
disconnect mid-stream and 40 concurrent clients. No response may be a 5xx, every error is
OpenAI-shaped with `param` naming the field, the server answers normally afterwards, seeded
sampling is the same with and without load, and the process RSS stays bounded.

Same tiny model and server fixture as tests/test_server.py (a fresh server for this module),
on 127.0.0.1 only.
"""

from __future__ import annotations

import gc
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

import test_server as base
from hybridlm.cli import build_parser
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer import responses as responses_module
from hybridlm.infer import server as server_module
from hybridlm.infer.engine import Engine
from hybridlm.infer.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    MAX_STOP,
    ChatCompletionRequest,
    CompletionRequest,
)
from hybridlm.infer.server import serve_in_background
from hybridlm.model.model import HybridLM
from hybridlm.presets import get_preset

srv = base.srv  # the tiny-model server fixture of tests/test_server.py
# batch-1 decoding of a tiny model: extra threads only add synchronisation (see conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")
MODEL, MAX_LEN = base.MODEL, base.MAX_LEN
TIMEOUT = 30.0
CLIENTS = 40
# The server runs in this process, so its RSS is ours; the model, torch's allocator and the
# engine thread are warm before the first reading. The growth measured over a run is 60-90 MB
# and one-time: malloc arenas and stacks of the 40 client threads (~35-45 MB) and the heap's
# high-water mark from parsing and tokenising a 4 MiB body (~15-30 MB); running the phases a
# second time adds ~0 MB. 200 MB leaves room for a loaded machine and other allocators; it
# catches gross leaks (over ~120 KB kept per request across the ~1000), not small ones.
RSS_BOUND_MB = 200


class Tally:
    """Every status the fuzz run got, thread-safe."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.bytes_sent = 0
        self.hangups = 0  # requests whose client left before any answer
        self._lock = threading.Lock()

    def add(self, status: int, sent: int = 0) -> int:
        with self._lock:
            self.statuses.append(status)
            self.bytes_sent += sent
        return status

    @property
    def server_errors(self) -> list[int]:
        return [s for s in self.statuses if s >= 500]


def _addr(srv) -> tuple[str, int]:
    parts = urlsplit(srv.url)
    return parts.hostname, parts.port


def _post(srv, tally: Tally, path: str, body, headers: dict | None = None, **kw):
    """POST bytes (sent as they are) or an object (as JSON); the response is read in full."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    res = srv.http.post(srv.url + path, content=content, headers=headers, **kw)
    tally.add(res.status_code, len(content))
    return res


def _error(res) -> dict:
    """The OpenAI error object of a 4xx response, checked for shape."""
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], res.text
    assert err["type"] == "invalid_request_error", res.text
    return err


def _raw(srv, data: bytes, *, close_after: bytes | None = None) -> bytes:
    """Send raw bytes on a fresh connection; read the whole response (or, with `close_after`,
    until that marker arrives, then hang up). Returns what was read."""
    sock = socket.create_connection(_addr(srv), timeout=TIMEOUT)
    try:
        sock.sendall(data)
        got = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return got
            got += chunk
            if close_after is not None and close_after in got:
                return got
            head, sep, rest = got.partition(b"\r\n\r\n")
            length = [h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
            if sep and length and len(rest) >= int(length[0].split(b":")[1]):
                return got
    finally:
        sock.close()


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def _request(path: str, body: bytes) -> bytes:
    head = f"POST /v1{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _rss_mb() -> float | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    line = next(x for x in status.read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _alive(srv) -> None:
    res = srv.client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert res.usage.completion_tokens == 2


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
COMPLETION = {"prompt": "Hi", "max_tokens": 1}
ENDPOINTS = [("/completions", COMPLETION), ("/chat/completions", CHAT)]
# the type table's requests go through the engine but generate nothing (max_tokens 0), so
# that the ~1000 of them take seconds; `"max_tokens": null` falls back to max_completion_tokens
TABLE = [
    ("/completions", {"prompt": "Hi", "max_tokens": 0}),
    ("/chat/completions", {**CHAT, "max_tokens": 0, "max_completion_tokens": 0}),
]


# ---------------------------------------------------------------------- phases of the fuzz run
def _malformed_bodies(srv, tally: Tally) -> None:
    valid = json.dumps({**COMPLETION, "stop": ["\n"], "temperature": 0.5}).encode()
    cases: list[tuple[bytes, str | None, str | None]] = [  # (body, code, param)
        (b"", "invalid_json", None),
        (b" ", "invalid_json", None),
        (b"\xff\xfe", "invalid_json", None),
        (b'{"prompt": "ab\xff", "max_tokens": 1}', "invalid_json", None),
        (b'{"prompt": "\xed\xa0\x80"}', "invalid_json", None),  # a surrogate as UTF-8 bytes
        (b'\xef\xbb\xbf{"prompt": "x"}', "invalid_json", None),  # a byte-order mark
        ('{"prompt": "x"}'.encode("utf-16"), "invalid_json", None),
        (b"null", "invalid_json", None),
        (b"[]", "invalid_json", None),
        (b'"a string"', "invalid_json", None),
        (b"1e999", "invalid_json", None),
        (b"NaN", "invalid_json", None),
        (b'{"prompt": "x", "temperature": NaN}', "invalid_json", None),
        (b'{"prompt": "x", "temperature": -Infinity}', "invalid_json", None),
        (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json", None),
        (b'{"prompt": "x"} trailing', "invalid_json", None),
        (b"[" * 50_000, "invalid_json", None),
        (b"{" * 50_000, "invalid_json", None),
        (b'{"a": ' * 10_000, "invalid_json", None),
        (
            b'{"prompt": "x", "extra": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}",
            "invalid_json",
            None,
        ),
        (b"\\" * 100_000, "invalid_json", None),
        (b'"' * 100_000, "invalid_json", None),
        (b'{"prompt": "ab\\ud800", "max_tokens": 1}', "invalid_unicode", "prompt"),
        (b'{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "invalid_unicode", "prompt"),
        (b'{"prompt": "x", "stop": ["\\ud83d"]}', "invalid_unicode", "stop"),
        (b'{"prompt": "x", "user": "\\udc00x"}', "invalid_unicode", "user"),
        (b'{"prompt": "x", "ignored": {"deep": ["\\ud800"]}}', "invalid_unicode", "ignored"),
        (b'{"prompt": "x", "\\ud800": 1}', "invalid_unicode", None),
    ]
    # every proper prefix of a valid body is truncated JSON
    cases += [(valid[:cut], "invalid_json", None) for cut in range(0, len(valid), 3)]
    for path, _ in ENDPOINTS:
        for body, code, param in cases:
            res = _post(srv, tally, path, body)
            assert res.status_code == 400, (body[:60], res.text)
            err = _error(res)
            assert (err["code"], err["param"]) == (code, param), (body[:60], err)
    chat_cases = [
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        (b'{"messages": [{"role": "user\\udfff", "content": "x"}]}', "messages"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
            "messages",
        ),
    ]
    for body, param in chat_cases:
        res = _post(srv, tally, "/chat/completions", body)
        assert res.status_code == 400 and _error(res)["param"] == param, res.text
    # a valid surrogate pair is one character, not an error
    res = _post(srv, tally, "/completions", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert res.status_code == 200, res.text
    # nesting up to the limit is fine: the body itself is level 1
    inner = b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1)
    res = _post(
        srv, tally, "/completions", b'{"prompt": "x", "max_tokens": 1, "x": ' + inner + b"}"
    )
    assert res.status_code == 200, res.text


def _huge_bodies(srv, tally: Tally) -> None:
    limit = DEFAULT_MAX_BODY_BYTES
    prefix, suffix = b'{"max_tokens": 1, "prompt": "', b'"}'
    at_limit = prefix + b"x" * (limit - len(prefix) - len(suffix)) + suffix
    res = _post(srv, tally, "/completions", at_limit)  # fits: refused for its length in tokens
    assert res.status_code == 400 and _error(res)["code"] == "context_length_exceeded"
    del at_limit
    # over the limit, declared: refused before it is read, on a connection that stays usable
    host, port = _addr(srv)
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    for size in (limit + 1, 10_000_000):
        conn.request("POST", "/v1/completions", body=b"x" * size)
        res = conn.getresponse()
        body = res.read()
        tally.add(res.status, size)
        assert res.status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        sock = conn.sock
        conn.request("POST", "/v1/completions", body=json.dumps(COMPLETION))
        res = conn.getresponse()
        res.read()
        assert tally.add(res.status) == 200 and conn.sock is sock  # the same connection
    conn.close()

    # over the limit, chunked (no Content-Length): refused once too much has arrived
    def chunks():
        for _ in range(80):  # 5 MiB
            yield b" " * 65536

    res = srv.http.post(srv.url + "/completions", content=chunks())
    assert tally.add(res.status_code, 80 * 65536) == 413
    # within the limit, chunked: read in full
    res = srv.http.post(srv.url + "/completions", content=iter([json.dumps(COMPLETION).encode()]))
    assert tally.add(res.status_code) == 200, res.text
    # Content-Length absent (and not chunked): 411; malformed: uvicorn's own 400
    raw = _raw(srv, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert tally.add(_status(raw)) == 411 and b'"length_required"' in raw
    for bad in (b"abc", b"-1", b"1e3", b"9" * 5000, b"1, 2"):
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + bad
        raw = _raw(srv, head + b"\r\nConnection: close\r\n\r\n{}")
        assert tally.add(_status(raw)) == 400, raw


INF, NAN = "__inf__", "__nan__"  # spelled in the JSON text as 1e999 and NaN
WRONG = [None, [], {}, "x", True, 10**30, -1, -(10**30), 1.5, INF, NAN, [1, "a", None]]


def _dumps(body: dict) -> bytes:
    return json.dumps(body).replace(f'"{INF}"', "1e999").replace(f'"{NAN}"', "NaN").encode("utf-8")


def _wrong_types(srv, tally: Tally) -> None:
    """Every field of both request schemas, with values of every JSON type: a 200 (a value the
    field takes, null included), or a 4xx whose param is that field; NaN is not JSON at all."""
    schemas = (CompletionRequest, ChatCompletionRequest)
    for (path, good), schema in zip(TABLE, schemas, strict=True):
        for field in schema.model_fields:
            for value in WRONG:
                body = _dumps({**good, field: value})
                res = _post(srv, tally, path, body)
                where = f"{path} {field}={value!r}: {res.text[:300]}"
                assert res.status_code in (200, 400, 404), where
                if res.status_code == 200:
                    continue
                err = _error(res)
                if value == NAN:
                    assert err["code"] == "invalid_json" and err["param"] is None, where
                else:
                    assert err["param"] == field, where
                    assert res.status_code == 400 or (field, value) == ("model", "x"), where
    # the inside of messages: every key of a message, and of a tool call
    messages = [
        lambda v: [{"role": v, "content": "x"}],
        lambda v: [{"role": "user", "content": v}],
        lambda v: [{"role": "user", "content": [v]}],
        lambda v: [{"role": "user", "content": [{"type": "text", "text": v}]}],
        lambda v: [{"role": "user", "content": "x", "name": v, "tool_call_id": v}],
        lambda v: [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": v}],
        lambda v: [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [v]}],
        lambda v: [{"role": "assistant", "tool_calls": [{"function": {"name": v}}]}],
        lambda v: [
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": v}}]}
        ],
        lambda v: [{"role": "assistant", "content": "x", "reasoning_content": v}],
        lambda v: [v],
    ]
    # ... and of a prompt
    prompts = [lambda v: [v], lambda v: [[v]], lambda v: [1, v], lambda v: ["x", v]]
    inner = [(TABLE[1], "messages", make) for make in messages]
    inner += [(TABLE[0], "prompt", make) for make in prompts]
    for (path, good), field, make in inner:
        for value in WRONG:
            res = _post(srv, tally, path, _dumps({**good, field: make(value)}))
            where = f"{field}={make(value)!r}: {res.text[:300]}"
            assert res.status_code in (200, 400), where
            if res.status_code == 400:
                assert _error(res)["param"] == (field if value != NAN else None), where


def _huge_values(srv, tally: Tally) -> None:
    ids = list(range(1, 200)) * 600
    cases = [  # (path, overrides, status, param)
        ("/completions", {"max_tokens": 10**12}, 400, "max_tokens"),
        (
            "/chat/completions",
            {"max_tokens": None, "max_completion_tokens": 10**12},
            400,
            "max_completion_tokens",
        ),
        ("/completions", {"n": 10**6}, 400, "n"),
        ("/completions", {"n": 129}, 400, "n"),
        ("/chat/completions", {"n": 10**6}, 400, "n"),
        ("/completions", {"stop": [f"s{i}" for i in range(10_000)]}, 400, "stop"),
        ("/completions", {"stop": ["s"] * (MAX_STOP + 1)}, 400, "stop"),
        ("/completions", {"stop": ["x" * 100_000]}, 200, None),
        ("/completions", {"prompt": ["Hi"] * 10_000}, 400, "prompt"),
        ("/completions", {"prompt": ids}, 400, "prompt"),
        ("/completions", {"prompt": [ids[:50]] * 200}, 400, "prompt"),
        ("/completions", {"prompt": "x" * 500_000}, 400, "prompt"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "x"}] * 20_000},
            400,
            "messages",
        ),
        ("/completions", {"top_k": 10**18}, 200, None),
        ("/completions", {"speculative": 10**9}, 400, "speculative"),
        ("/completions", {"seed": 2**63}, 400, "seed"),
        ("/completions", {"seed": 2**64}, 400, "seed"),
        ("/completions", {"seed": -(2**63) - 1}, 400, "seed"),
        ("/completions", {"seed": 2**63 - 1, "n": 3, "temperature": 1.0}, 200, None),
        ("/completions", {"seed": -(2**63), "temperature": 1.0}, 200, None),
        ("/completions", {"logit_bias": {str(i): 1.0 for i in range(10_000)}}, 400, "logit_bias"),
        ("/completions", {"model": "m" * 100_000}, 404, "model"),
        ("/completions", {"temperature": 1e308}, 400, "temperature"),
        # exactly the room the prompt leaves (1 + 120 prompt tokens)
        ("/completions", {"prompt": "x" * 120, "max_tokens": MAX_LEN - 121, "n": 2}, 200, None),
        ("/completions", {"prompt": "x" * 120, "max_tokens": MAX_LEN - 120}, 400, "max_tokens"),
        (
            "/chat/completions",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}],
                    }
                ]
            },
            400,
            "messages",
        ),
        (
            "/chat/completions",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "1" * 10_000}}],
                    }
                ]
            },
            400,
            "messages",
        ),
    ]
    for path, overrides, status, param in cases:
        good = COMPLETION if path == "/completions" else CHAT
        res = _post(srv, tally, path, {**good, **overrides})
        where = f"{path} {str(overrides)[:80]}: {res.text[:300]}"
        assert res.status_code == status, where
        if status != 200:
            err = _error(res)
            assert err["param"] == param and len(err["message"]) < 1000, where
    for value in ("99999999999999999999", "1" * 5000, "-1", "x", "٣".encode()):
        res = _post(srv, tally, "/completions", COMPLETION, headers={base.SPEC_HEADER: value})
        assert res.status_code == 400 and _error(res)["param"] == base.SPEC_HEADER, res.text


def _disconnects(srv, tally: Tally) -> None:
    """Clients that leave: mid-stream, before any output, mid-body and mid-headers."""
    body = json.dumps(
        {"prompt": "Leaving", "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    ).encode()
    streamed = json.dumps({**json.loads(body), "stream": True}).encode()
    for path in ("/completions", "/chat/completions"):
        data = (
            streamed
            if path == "/completions"
            else streamed.replace(
                b'"prompt": "Leaving"', b'"messages": [{"role": "user", "content": "Leaving"}]'
            )
        )
        for _ in range(4):  # hang up after the first chunk
            got = _raw(srv, _request(path, data), close_after=b"data: ")
            assert tally.add(_status(got)) == 200 and b"data: " in got
    partial = [
        _request("/completions", body),  # a non-streamed request, left while it generates
        _request("/completions", body)[: -len(body) // 2],  # left mid-body
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",  # left mid-headers
    ]
    for data in partial * 3:
        sock = socket.create_connection(_addr(srv), timeout=TIMEOUT)
        sock.sendall(data)
        time.sleep(0.02)
        sock.close()
        tally.hangups += 1
    deadline = time.monotonic() + TIMEOUT
    while srv.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not srv.engine.has_unfinished(), "aborted requests are still running"


SEEDED = [(f"Seeded prompt {i}:", 1000 + i) for i in range(4)]
SAMPLE = {"max_tokens": 6, "temperature": 0.9, "top_p": 0.95}
JUNK = [b"{", b"[" * 5000, b'{"prompt": "\\ud800"}', b'{"prompt": 1}', b"\xff", b"null"]


def _seeded(http, url: str, i: int) -> tuple[str, str]:
    """Seeded sampling for SEEDED[i]: a completion's text and a streamed chat's content."""
    prompt, seed = SEEDED[i]
    res = http.post(url + "/completions", json={"prompt": prompt, "seed": seed, **SAMPLE})
    assert res.status_code == 200, res.text
    text = res.json()["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": prompt}], "seed": seed, "stream": True}
    streamed = []
    with http.stream("POST", url + "/chat/completions", json={**chat, **SAMPLE}) as res:
        assert res.status_code == 200
        for line in res.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"]
                streamed += [c["delta"].get("content") or "" for c in delta]
    return text, "".join(streamed)


def _concurrent(srv, tally: Tally, alone: list[tuple[str, str]]) -> None:
    """CLIENTS threads at once, each: one seeded completion + one seeded streamed chat (must
    equal the results got alone) and one junk request."""
    start = threading.Barrier(CLIENTS, timeout=TIMEOUT)

    def client(k: int) -> tuple[str, str]:
        import httpx

        with httpx.Client(timeout=TIMEOUT) as http:
            start.wait()
            res = http.post(srv.url + "/completions", content=JUNK[k % len(JUNK)])
            tally.add(res.status_code)
            assert res.status_code == 400, res.text
            got = _seeded(http, srv.url, k % len(SEEDED))
            tally.add(200)
            tally.add(200)
            return got

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(client, range(CLIENTS), timeout=2 * TIMEOUT))
    assert results == [alone[k % len(SEEDED)] for k in range(CLIENTS)]


# ---------------------------------------------------------------------- the tests
def test_internal_errors_are_500s_that_keep_the_connection(srv, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected \ud800 bug")  # a surrogate even, to render safely

    monkeypatch.setattr(responses_module, "_usage", broken)
    host, port = _addr(srv)
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", body=json.dumps(COMPLETION))
    res = conn.getresponse()
    err = json.loads(res.read())["error"]
    assert res.status == 500 and not res.will_close
    assert err["type"] == "server_error" and "injected" in err["message"]
    sock = conn.sock
    stream = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", body=json.dumps(stream))
    res = conn.getresponse()
    events = [e for e in res.read().decode().split("\n\n") if e]
    assert res.status == 200 and conn.sock is sock
    assert '"server_error"' in events[-1] and "injected" in events[-1]  # the stream ends in it
    monkeypatch.undo()
    conn.request("POST", "/v1/completions", body=json.dumps(COMPLETION))
    res = conn.getresponse()
    assert res.status == 200 and json.loads(res.read())["usage"]["completion_tokens"] == 1
    assert conn.sock is sock  # one connection throughout
    conn.close()


def test_body_limit_is_configurable():
    args = build_parser().parse_args(["serve", "--max-body-bytes", "512"])
    assert args.max_body_bytes == 512
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.pattern = 258, "M*ME"
    engine = Engine(HybridLM(cfg, seed=0), ByteTokenizer(), max_batch_size=2, max_model_len=64)
    with pytest.raises(ValueError, match="max_body_bytes"):
        server_module.create_app(engine, MODEL, max_body_bytes=0)
    import httpx

    with serve_in_background(engine, MODEL, max_body_bytes=512) as url, httpx.Client() as http:
        small = json.dumps({**COMPLETION, "stop": ["x" * 400]}).encode()
        assert len(small) <= 512 and http.post(url + "/completions", content=small).is_success
        res = http.post(url + "/completions", content=small + b" " * (513 - len(small)))
        assert res.status_code == 413 and "512 bytes" in res.json()["error"]["message"]


def test_fuzz_never_5xx_and_stays_bounded(srv):
    """The whole fuzz run; figures are printed (pytest -s shows them)."""
    _alive(srv)  # warm: the model, torch's allocator and the engine thread
    alone = [_seeded(srv.http, srv.url, i) for i in range(len(SEEDED))]
    gc.collect()
    rss0, t0, tally = _rss_mb(), time.monotonic(), Tally()
    _malformed_bodies(srv, tally)
    _huge_bodies(srv, tally)
    _wrong_types(srv, tally)
    _huge_values(srv, tally)
    _disconnects(srv, tally)
    _concurrent(srv, tally, alone)
    _alive(srv)
    assert [_seeded(srv.http, srv.url, i) for i in range(len(SEEDED))] == alone
    gc.collect()
    rss1, seconds = _rss_mb(), time.monotonic() - t0
    assert not tally.server_errors, f"{len(tally.server_errors)} responses >= 500"
    growth = None if rss0 is None or rss1 is None else rss1 - rss0
    print(
        f"\nfuzz: {len(tally.statuses)} responses + {tally.hangups} hang-ups "
        f"({tally.bytes_sent / 2**20:.0f} MiB of bodies), {len(tally.server_errors)} >= 500, "
        f"{seconds:.1f} s, RSS "
        f"{rss0 or 0:.0f} -> {rss1 or 0:.0f} MB (growth {growth or 0:+.1f} MB)"
    )
    if growth is not None:
        assert growth < RSS_BOUND_MB, f"RSS grew by {growth:.0f} MB over the fuzz run"


def test_tool_call_arguments_nested_deep_inside_a_string_are_a_400(srv):
    """The body's depth check counts brackets outside strings; JSON inside a string (an
    assistant turn's tool-call arguments) is read by the same bounded reader: a 400, not the
    RecursionError's 500."""
    deep = "[" * 100_000 + "]" * 100_000
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "1"},
        ],
    }
    out = srv.http.post(f"{srv.url}/chat/completions", json=body)
    assert out.status_code == 400, out.text[:300]
    assert "nests arrays/objects 100000 deep" in out.json()["error"]["message"]
    assert len(out.content) < 1000
    so = {"model": "tiny", "prompt": "x", "max_tokens": 1, "structured_outputs": {"json": deep}}
    out = srv.http.post(f"{srv.url}/completions", json=so)
    assert out.status_code == 400 and "deep" in out.json()["error"]["message"]


def test_an_api_key_is_required_when_set():
    import openai

    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.pattern = 258, "M*ME"
    engine = Engine(HybridLM(cfg, seed=0), ByteTokenizer(), max_batch_size=2, max_model_len=64)
    with serve_in_background(engine, "tiny", api_key="k3y") as url:
        bad = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=url, api_key="k3y", max_retries=0)
        assert [m.id for m in good.models.list().data] == ["tiny"]
        out = httpx.get(f"{url}/models")
        assert out.status_code == 401 and out.json()["error"]["code"] == "unauthorized"
        assert out.headers["x-request-id"]
