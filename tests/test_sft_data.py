"""Chat data for SFT: assistant-only masks (byte and BPE), template round trip, readers with
counted bad rows, reasoning-mode transforms, best-fit packing with per-conversation segments."""

import json

import numpy as np
import pytest
import torch

from hybridlm.data import builtin
from hybridlm.data.bpe import train_bpe
from hybridlm.data.chat import STOP, THINK_CLOSE, parse_assistant, render_with_spans
from hybridlm.data.loader import IGNORE_INDEX
from hybridlm.data.sft import (
    BUDGET_TEMPLATE,
    LOW_EFFORT_TAG,
    REASONING_OFF_TAG,
    ReadReport,
    ReasoningModes,
    SFTLoader,
    apply_reasoning_modes,
    arithmetic_conversations,
    budget_truncate,
    collate_rows,
    encode_chat,
    gsm8k_conversations,
    pack_best_fit,
    read_conversations,
    tokenize_conversations,
)
from hybridlm.data.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Add them.\nTwo and two."},
    {"role": "user", "content": "Weather in Oslo? ½ → ü"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}],
    },
    {"role": "tool", "content": "-3 °C"},
    {"role": "assistant", "content": "Cold: −3 °C."},
]


@pytest.fixture(scope="module")
def bpe():
    texts = [json.dumps(c) for c in arithmetic_conversations(300, seed=1)] + [
        "What is the weather in Oslo? It is cold. Add them. Two and two." * 3
    ] * 20
    return train_bpe(texts, vocab_size=400)


def _assistant_messages(conv):
    return [
        {k: v for k, v in m.items() if k in ("role", "content", "reasoning_content")}
        for m in conv
        if m["role"] == "assistant"
    ]


@pytest.mark.parametrize("tok_name", ["byte", "bpe"])
def test_mask_is_exactly_the_assistant_bodies_plus_stop(tok_name, bpe):
    tok = ByteTokenizer() if tok_name == "byte" else bpe
    text, char_spans = render_with_spans(CONVO)
    ex = encode_chat(CONVO, tok)
    assert ex.input_ids[0] == tok.bos_id and not ex.loss_mask[0]
    assert len(ex.spans) == len(char_spans) == 3
    # every masked token belongs to one span, every span is masked, nothing else is
    mask = np.zeros(len(ex), dtype=bool)
    for (a, b), (ca, cb) in zip(ex.spans, char_spans, strict=True):
        mask[a:b] = True
        assert tok.decode(ex.input_ids[a:b]) == text[ca:cb]  # the exact characters
        assert text[ca:cb].endswith(STOP)
    assert mask.tolist() == ex.loss_mask
    # the tokens decode to the rendered text (segment-wise encoding loses nothing)
    assert tok.decode(ex.input_ids) == text
    if tok_name == "byte":  # identical to encoding the whole text
        assert ex.input_ids == tok.encode(text)
        assert sum(ex.loss_mask) == sum(len(text[a:b].encode()) for a, b in char_spans)
    else:  # <|im_end|> is one token, the last of each span
        stop_id = bpe.token_to_id(STOP)
        assert all(ex.input_ids[b - 1] == stop_id for _, b in ex.spans)


@pytest.mark.parametrize("tok_name", ["byte", "bpe"])
def test_template_round_trip_parses_back_the_assistant_turns(tok_name, bpe):
    tok = ByteTokenizer() if tok_name == "byte" else bpe
    convs = [CONVO, *arithmetic_conversations(20, seed=3)]
    for conv in convs:
        ex = encode_chat(conv, tok)
        parsed = [parse_assistant(tok.decode(ex.input_ids[a:b])) for a, b in ex.spans]
        want = _assistant_messages(conv)
        full_msgs = [m for m in conv if m["role"] == "assistant"]
        for got, ref, full in zip(parsed, want, full_msgs, strict=True):
            assert got.get("content") == ref.get("content")
            assert got.get("reasoning_content") == ref.get("reasoning_content")
            if full.get("tool_calls"):
                fn = got["tool_calls"][0]["function"]
                assert fn["name"] == "weather" and json.loads(fn["arguments"]) == {"city": "Oslo"}


def test_loss_from_char_masks_only_the_completion():
    tok = ByteTokenizer()
    prompt = CONVO[:4]
    prompt_text, _ = render_with_spans(prompt)
    ex = encode_chat(
        [*prompt, {"role": "assistant", "content": "Sunny."}], tok, loss_from_char=len(prompt_text)
    )
    assert len(ex.spans) == 1
    a, b = ex.spans[0]
    assert tok.decode(ex.input_ids[a:b]) == "Sunny." + STOP and sum(ex.loss_mask) == b - a


def test_readers_count_and_skip_bad_rows(tmp_path):
    good = {"messages": CONVO[:3]}
    rows = [
        json.dumps(good),
        "{not json",
        json.dumps({"text": "no messages here"}),
        json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        "",
        json.dumps({"messages": json.dumps(CONVO)}),  # messages as a JSON string: accepted
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(rows) + "\n")
    report = ReadReport()
    convs = list(read_conversations(path, report=report))
    assert len(convs) == 2 and report.rows == 6 and report.kept == 2
    assert report.skipped == {
        "invalid JSON line": 1,
        "no 'messages' field": 1,
        "invalid messages": 1,
        "no assistant turn": 1,
    }
    summary = report.summary()
    assert "2/6 rows kept" in summary and "first at row 1" in summary
    assert "first at row 3: messages[0]: unknown role 'wizard'" in summary

    # Parquet (nested list<struct>) gives the same conversations
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([good, {"messages": CONVO[:2]}])
    pq.write_table(table, tmp_path / "chat.parquet")
    report = ReadReport()
    got = list(read_conversations(tmp_path / "chat.parquet", report=report))
    assert got == [CONVO[:3]] and report.skipped == {"no assistant turn": 1}
    with pytest.raises(ValueError, match="not found"):
        list(read_conversations(tmp_path / "missing.jsonl"))


def test_a_bad_byte_or_line_skips_one_row_not_the_file(tmp_path):
    import gzip

    good = json.dumps({"messages": CONVO[:3]}, ensure_ascii=False).encode()
    bad_utf8 = good.replace(b"Add them.", b"Add \xff them.")  # one invalid byte
    surrogate = json.dumps({"messages": [CONVO[1], {"role": "assistant", "content": "\ud800"}]})
    lines = [good, bad_utf8, b"{not json", surrogate.encode(), b"\xef\xbb\xbf" + good]
    body = b"\n".join(lines) + b"\n"
    for name, data in (("chat.jsonl", body), ("chat.jsonl.gz", gzip.compress(body))):
        (tmp_path / name).write_bytes(data)
        report = ReadReport()
        convs = list(read_conversations(tmp_path / name, report=report))
        assert convs == [CONVO[:3]] * 2  # the rows before and after the bad ones are used
        assert report.rows == 5 and report.kept == 2
        assert report.skipped == {
            "invalid UTF-8": 1,
            "invalid JSON line": 1,
            "invalid messages": 1,
        }
        summary = report.summary()
        assert "1 skipped: invalid UTF-8 (first at row 1)" in summary
        assert "messages[1]: text is not valid UTF-8 (a lone surrogate" in summary
    # a truncated .gz: the rows before the damage are used, the rest counted as unreadable
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(body)[:-30])
    report = ReadReport()
    assert len(list(read_conversations(tmp_path / "cut.jsonl.gz", report=report))) >= 1
    assert report.skipped["unreadable rest of file (truncated or corrupt gzip)"] == 1


def test_read_saved_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    good = {"messages": CONVO[:3]}
    datasets.Dataset.from_list([good, good, {"messages": CONVO[:2]}]).save_to_disk(
        str(tmp_path / "hf")
    )
    report = ReadReport()
    assert list(read_conversations(tmp_path / "hf", report=report)) == [CONVO[:3]] * 2
    assert report.skipped == {"no assistant turn": 1}
    assert list(read_conversations(tmp_path / "hf", max_rows=1)) == [CONVO[:3]]


def test_reasoning_modes_are_seeded_exclusive_and_correct():
    tok = ByteTokenizer()
    convs = arithmetic_conversations(2000, seed=0)
    modes = ReasoningModes(reasoning_off=0.03, low_effort=0.02, budget=0.12, seed=7)
    out, counts = apply_reasoning_modes(convs, modes, tok)
    again, counts2 = apply_reasoning_modes(convs, modes, tok)
    assert out == again and counts == counts2  # a pure function of the seed
    assert sum(counts.values()) == 2000
    # fractions within 4 sigma of the binomial expectation
    for name, p in (("reasoning_off", 0.03), ("low_effort", 0.02), ("budget", 0.12)):
        assert abs(counts[name] - 2000 * p) < 4 * (2000 * p * (1 - p)) ** 0.5, (name, counts)
    for src, conv in zip(convs, out, strict=True):
        sys_text = conv[0]["content"] if conv[0]["role"] == "system" else ""
        answer = conv[-1]
        assert answer["content"] == src[-1]["content"]  # the answer always survives
        if REASONING_OFF_TAG in sys_text:
            assert "reasoning_content" not in answer
        elif LOW_EFFORT_TAG in sys_text:
            assert answer["reasoning_content"] == src[-1]["reasoning_content"]
        elif sys_text.startswith("Reasoning budget"):
            budget = int(sys_text.split()[2])
            trace = answer["reasoning_content"]
            assert len(tok.encode(trace, add_bos=False)) <= budget
            assert src[-1]["reasoning_content"].startswith(trace)
            assert len(trace) < len(src[-1]["reasoning_content"])
        else:
            assert conv == src
    # budget truncation by hand: budget 5 bytes keeps "7+8+0", closed by </think>
    conv = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "15", "reasoning_content": "7+8+0=15, write 5"},
    ]
    cut = budget_truncate(conv, 5, lambda s: len(s.encode()))
    assert cut[0] == {"role": "system", "content": BUDGET_TEMPLATE.format(budget=5)}
    text, _ = render_with_spans(cut)
    assert f"<think>\n7+8+0\n{THINK_CLOSE}\n15{STOP}" in text
    with pytest.raises(ValueError, match="<= 1"):
        ReasoningModes(reasoning_off=0.5, low_effort=0.4, budget=0.2)


def test_overflow_drop_and_truncate():
    tok = ByteTokenizer()
    convs = arithmetic_conversations(5, seed=0)
    n = [len(encode_chat(c, tok)) for c in convs]
    limit = sorted(n)[2]
    dropped = tokenize_conversations(convs, tok, max_len=limit)
    assert len(dropped.examples) == sum(x <= limit for x in n)
    assert sum(dropped.dropped.values()) == sum(x > limit for x in n)
    cut = tokenize_conversations(convs, tok, max_len=limit, overflow="truncate")
    assert len(cut.examples) == 5 and all(len(e) <= limit for e in cut.examples)
    assert cut.truncated == sum(x > limit for x in n)


def test_packing_keeps_conversations_whole_and_separate():
    tok = ByteTokenizer()
    examples = tokenize_conversations(arithmetic_conversations(40, seed=2), tok, max_len=256)
    ex = examples.examples
    rows = pack_best_fit([len(e) for e in ex], 256)
    assert sorted(i for r in rows for i in r) == list(range(len(ex)))  # each exactly once
    assert all(sum(len(ex[i]) for i in r) <= 256 for r in rows)
    batch = collate_rows(ex, rows, 256, pad_id=0)
    ids, labels, doc, pos, conv = (
        batch[k] for k in ("input_ids", "labels", "doc_ids", "position_ids", "conv_ids")
    )
    for b, row in enumerate(rows):
        a = 0
        for k, i in enumerate(row):
            n = len(ex[i])
            assert ids[b, a : a + n].tolist() == ex[i].input_ids
            assert (doc[b, a : a + n] == k).all() and (conv[b, a : a + n] == i).all()
            assert pos[b, a : a + n].tolist() == list(range(n))
            want = [
                t if m else IGNORE_INDEX
                for t, m in zip(ex[i].input_ids, ex[i].loss_mask, strict=True)
            ]
            assert labels[b, a : a + n].tolist() == want
            assert labels[b, a] == IGNORE_INDEX  # BOS: no target crosses into a conversation
            a += n
        assert (labels[b, a:] == IGNORE_INDEX).all() and (conv[b, a:] == -1).all()
        assert (doc[b, a:] == len(row)).all()
    assert int(batch["num_loss_tokens"]) == sum(e.num_loss_tokens for e in ex)
    assert int(batch["num_conversations"]) == len(ex)
    # doc_ids are non-decreasing per row, as HybridLM.forward requires
    assert (doc[:, 1:] >= doc[:, :-1]).all()


def test_loader_epochs_and_exact_resume():
    tok = ByteTokenizer()
    ex = tokenize_conversations(arithmetic_conversations(30, seed=4), tok, max_len=256).examples
    a = SFTLoader(ex, seq_len=256, batch_size=3, seed=1)
    per_epoch = a.rows_per_epoch
    epoch0 = [next(a) for _ in range(-(-per_epoch // 3))]
    # one epoch visits every conversation exactly once (the last batch may start epoch 1)
    ids = torch.cat([b["conv_ids"] for b in epoch0])[:per_epoch]
    seen = [i for i in ids.flatten().tolist() if i >= 0]
    first_of_row = ids[:, 0].tolist()
    assert sorted(set(seen)) == list(range(len(ex))) and len(first_of_row) == per_epoch
    state = a.state_dict()
    rest = [next(a) for _ in range(6)]  # continues into the next epoch
    assert int(rest[-1]["epoch"]) >= 1
    b = SFTLoader(ex, seq_len=256, batch_size=3, seed=1)
    b.load_state_dict(json.loads(json.dumps(state)))
    for x, y in zip(rest, [next(b) for _ in range(6)], strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["conv_ids"], y["conv_ids"])
    seq = SFTLoader(ex, seq_len=256, batch_size=4, sequential=True)
    ids = torch.cat([x["conv_ids"].flatten() for x in seq])
    assert sorted(i for i in ids.tolist() if i >= 0) == sorted(
        i for i in range(len(ex)) for _ in range(len(ex[i]))
    )
    c = SFTLoader(ex, seq_len=256, batch_size=4, seed=1)
    with pytest.raises(ValueError, match="other data or settings"):
        c.load_state_dict(state)


def test_gsm8k_conversations():
    convs = gsm8k_conversations(builtin.path(builtin.GSM8K_TEST), max_rows=5)
    assert len(convs) == 5
    assert gsm8k_conversations(max_rows=2)[0][0]["content"].startswith("Natalia sold clips")
    assert convs[0][1]["content"].strip().lstrip("-").isdigit()
    assert "<<" not in convs[0][1]["reasoning_content"]
    ex = encode_chat(convs[0], ByteTokenizer())
    assert ex.num_loss_tokens > 20
