"""FIM transform (round trip, rates, PSM/SPM layouts, determinism, tokenisation) and chat
rendered as plain text."""

import math

import pytest

from hybridlm.data.bpe import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, train_bpe
from hybridlm.data.fim import (
    FIMConfig,
    chat_to_text,
    encode_fim,
    fim_transform,
    parse_fim,
    psm,
    spm,
    undo_fim,
)
from hybridlm.data.tokenizer import ByteTokenizer

CODE = 'def add(a, b):\n    """Sum of a and b."""\n    return a + b\n\nprint(add(1, 2))\n'


def test_layouts_by_hand():
    assert psm("ab", "cd", "ef") == "<|fim_prefix|>ab<|fim_suffix|>ef<|fim_middle|>cd"
    assert spm("ab", "cd", "ef") == "<|fim_prefix|><|fim_suffix|>ef<|fim_middle|>abcd"
    assert parse_fim(psm("ab", "cd", "ef")) == ("ab", "cd", "ef")
    assert parse_fim(spm("ab", "cd", "ef")) == ("abcd", "", "ef")
    assert parse_fim("plain text") is None


def test_round_trip_and_split_consistency():
    texts = [CODE, "x", "", "héllo wörld ✓ — unicode", "a\nb\nc" * 50]
    modes = set()
    for i in range(400):
        text = texts[i % len(texts)]
        res = fim_transform(text, key=i, cfg=FIMConfig(rate=1.0, seed=3))
        modes.add(res.mode)
        assert undo_fim(res.text) == text
        lo, hi = res.split
        assert 0 <= lo <= hi <= len(text)
        prefix, middle, suffix = text[:lo], text[lo:hi], text[hi:]
        expected = (psm if res.mode == "psm" else spm)(prefix, middle, suffix)
        assert res.text == expected
    assert modes == {"psm", "spm"}


def test_rates_and_orders():
    cfg = FIMConfig(rate=0.5, spm_rate=0.5, seed=7)
    n = 4000
    modes = [fim_transform(CODE, key=f"doc{i}", cfg=cfg).mode for i in range(n)]
    fim = sum(m in ("psm", "spm") for m in modes)
    spm_n = modes.count("spm")
    # binomial: within 4 standard deviations
    assert abs(fim - n * 0.5) < 4 * math.sqrt(n * 0.25)
    assert abs(spm_n - fim * 0.5) < 4 * math.sqrt(fim * 0.25)
    # SPM texts start with both sentinels; PSM with the prefix sentinel then the prefix text
    for i in range(50):
        res = fim_transform(CODE, key=f"doc{i}", cfg=cfg)
        if res.mode == "spm":
            assert res.text.startswith(FIM_PREFIX + FIM_SUFFIX)
        elif res.mode == "psm":
            # (with an empty prefix PSM and SPM are the same string)
            assert res.text.startswith(FIM_PREFIX + CODE[: res.split[0]] + FIM_SUFFIX)
            assert res.text.endswith(FIM_MIDDLE + CODE[res.split[0] : res.split[1]])
        else:
            assert res.text == CODE
    assert all(fim_transform(CODE, i, FIMConfig(rate=0.0)).mode == "none" for i in range(100))
    only_psm = FIMConfig(rate=1.0, spm_rate=0.0)
    assert {fim_transform(CODE, i, only_psm).mode for i in range(100)} == {"psm"}


def test_split_points_uniform_over_characters():
    text = "abcdefghij"  # 11 cut positions 0..10
    counts = [0] * 11
    cfg = FIMConfig(rate=1.0, seed=1)
    for i in range(5500):
        lo, hi = fim_transform(text, key=i, cfg=cfg).split
        counts[lo] += 1
        counts[hi] += 1
    # two sorted uniform draws: the positions together are uniform (1000 per position)
    assert min(counts) > 800 and max(counts) < 1200


def test_deterministic_and_order_free():
    cfg = FIMConfig(seed=11)
    a = [fim_transform(CODE, key=k, cfg=cfg) for k in ("x", "y", "z")]
    b = [fim_transform(CODE, key=k, cfg=cfg) for k in ("z", "y", "x")][::-1]
    assert a == b
    other = [fim_transform(CODE, key=k, cfg=FIMConfig(seed=12)) for k in ("x", "y", "z")]
    many = {fim_transform(CODE, key=k, cfg=cfg).text for k in range(30)}
    assert len(many) > 10 and a != other


def test_sentinel_in_text_is_left_alone():
    text = f"the token {FIM_MIDDLE} appears here"
    res = fim_transform(text, key=0, cfg=FIMConfig(rate=1.0))
    assert res.mode == "has_sentinel" and res.text == text


def test_config_errors():
    with pytest.raises(ValueError, match="rate"):
        FIMConfig(rate=1.5)
    with pytest.raises(ValueError, match="spm_rate"):
        FIMConfig(spm_rate=-0.1)


def test_encode_byte_and_bpe():
    cfg = FIMConfig(rate=1.0, seed=0)
    byte = ByteTokenizer()
    for k in range(20):
        res = fim_transform(CODE, key=k, cfg=cfg)
        assert encode_fim(res, CODE, byte) == byte.encode(res.text, add_bos=False)
    bpe = train_bpe([CODE * 20, "def f(x):\n    return x * 2\n" * 50], vocab_size=320)
    ids = {s: bpe.token_to_id(s) for s in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)}
    assert sorted(ids.values()) == [9, 10, 11]
    for k in range(20):
        res = fim_transform(CODE, key=k, cfg=cfg)
        toks = encode_fim(res, CODE, bpe)
        for tid in ids.values():
            assert toks.count(tid) == 1
        p, s, m = (toks.index(ids[x]) for x in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE))
        lo, hi = res.split
        assert p < s < m and (s == p + 1) == (res.mode == "spm" or lo == 0)
        # parts are encoded separately: the middle's tokens decode to exactly the middle
        if res.mode == "psm":
            assert bpe.decode(toks[m + 1 :]) == CODE[lo:hi]
        else:
            assert bpe.decode(toks[m + 1 :]) == CODE[:hi]


def test_chat_to_text():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "calc", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "content": "1"},
    ]
    text = chat_to_text(msgs)
    assert text == (
        'Be brief.\n\nWhat is 2 + 2?\n\nAdd them.\n4\n\n{"name": "calc", "arguments": {"x": 1}}'
        "\n\n1"
    )
    assert "<|im_start|>" not in text and "<think>" not in text
    labelled = chat_to_text(msgs[:3], role_labels=True, include_system=False)
    assert labelled == "User: What is 2 + 2?\n\nAssistant: Add them.\n4"
    with pytest.raises(ValueError, match="unknown role"):
        chat_to_text([{"role": "robot", "content": "hi"}])


def test_fim_stage():
    from hybridlm.curate.core import CurateDoc, StageStats, build_stage

    stage = build_stage({"stage": "fim", "rate": 1.0, "seed": 2})
    docs = [CurateDoc(id=f"d{i}", text=CODE) for i in range(40)]
    stats = StageStats(stage="fim")
    out = list(stage.run(docs, stats))
    assert len(out) == 40 and stats.modified == 40
    for d in out:
        assert d.metadata["fim"] in ("psm", "spm") and undo_fim(d.text) == CODE
        assert d.text == fim_transform(CODE, d.id, FIMConfig(rate=1.0, seed=2)).text
        assert d.provenance[-1].scores == {"fim": d.metadata["fim"]}
