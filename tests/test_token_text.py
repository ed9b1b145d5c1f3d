"""`infer.token_text`: what each token id stands for in the API's log-probs (text, `bytes:\\xNN`
pieces, special-token names, raw bytes), the vocabulary strings transformers shows, and
character offsets, for the byte tokenizer and a trained byte-level BPE."""

from __future__ import annotations

import pytest

from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.token_text import Offsets, TokenText

TEXTS = ["Grüße, 世界! 🙂 ok", "plain ascii\n\ttabs", "ééé 日本語 <|im_end|> x", ""]


@pytest.fixture(scope="module")
def bpe():
    pytest.importorskip("tokenizers")
    from hybridlm.data.bpe import train_bpe

    corpus = [t * 20 for t in TEXTS] * 10 + ["hello world, the cat sat on the mat. " * 40]
    return train_bpe(corpus, vocab_size=320)


def _char_ends(text: str) -> list[int]:
    """Byte offset where each character of a valid text ends."""
    out, pos = [], 0
    for ch in text:
        pos += len(ch.encode())
        out.append(pos)
    return out


def _check(tok, text):
    tt = TokenText(tok)
    ids = tok.encode(text)
    pieces = [tt.piece(i) for i in ids]
    assert b"".join(pieces).decode() == tok.decode(ids) == text
    starts, pos = [], 0
    for p in pieces:
        starts.append(pos)
        pos += len(p)
    ends = _char_ends(text)
    # a token's offset: the characters that end at or before its first byte
    assert tt.offsets(ids, 5) == [5 + sum(e <= s for e in ends) for s in starts]
    offs = Offsets(tt, 5)
    for k, tid in enumerate(ids):  # incremental == one shot, and never revised
        offs.extend([tid])
        assert [offs.offset(i) for i in range(k + 1)] == tt.offsets(ids[: k + 1], 5)
    for tid, p in zip(ids, pieces, strict=True):
        name = tt.token(tid)
        try:
            assert name == p.decode() or (p == b"" and name)
        except UnicodeDecodeError:
            assert name == "bytes:" + "".join(f"\\x{b:02x}" for b in p)
        assert tt.token_bytes(tid) == list(p or name.encode())
    return tt, ids


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer(text):
    tt, ids = _check(ByteTokenizer(), text)
    assert tt.token(256) == "<|bos|>" and tt.token_bytes(257) == list(b"<|endoftext|>")
    assert tt.token(0xC3) == "bytes:\\xc3" and tt.token_bytes(0xC3) == [0xC3]
    assert tt.piece(256) == b"" and tt.token(ord("a")) == "a"


@pytest.mark.parametrize("text", TEXTS)
def test_bpe(bpe, text):
    tt, ids = _check(bpe, text)
    im_end = bpe.token_to_id("<|im_end|>")
    assert tt.token(im_end) == "<|im_end|>" and tt.piece(im_end) == b"<|im_end|>"
    assert tt.token(bpe.bos_id) == "<|bos|>" and tt.piece(bpe.bos_id) == b""
    assert any(len(tt.piece(i)) > 1 for i in ids) or not text.strip()  # merges were exercised


def test_vocab_strings_are_transformers(bpe, tmp_path):
    transformers = pytest.importorskip("transformers")
    for tok in (ByteTokenizer(), bpe):
        path = tok.save(tmp_path / type(tok).__name__)
        hf = transformers.AutoTokenizer.from_pretrained(path)
        tt = TokenText(tok)
        ids = tok.encode(TEXTS[0] + TEXTS[2])
        assert [tt.vocab_token(i) for i in ids] == hf.convert_ids_to_tokens(ids)


def test_invalid_utf8_offsets_and_streaming_release():
    """Invalid bytes become one U+FFFD per maximal run (as `decode(errors="replace")`); each
    token's offset points at its own character, and `touched` holds back tokens whose character
    is not complete."""
    tok = ByteTokenizer()
    tt = TokenText(tok)
    ids = [*b"Hi", 0xD7, 0xCC, *b"h", 0xE6, 0x97, *b"A", 0xC3, 0xA9, 0xF0, 0x9F, 0x98]
    assert tok.decode(ids) == "Hi\ufffd\ufffdh\ufffdAé\ufffd"
    assert tt.offsets(ids) == [0, 1, 2, 3, 4, 5, 5, 6, 7, 7, 8, 8, 8]
    offs = Offsets(tt).extend(ids[:3])
    assert offs.touched(2) == 2 and offs.touched(3) is None  # 0xd7 may still become a letter
    offs.extend(ids[3:4])
    assert offs.touched(3) == 3 and offs.touched(4) is None
    offs.extend(ids[4:])
    assert offs.touched(10) == 8 and offs.touched(11) is None  # "é" done; 0xf0.. pending
