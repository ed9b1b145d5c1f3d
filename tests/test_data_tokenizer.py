"""Byte-level BPE: reserved special tokens, lossless round trip, deterministic training, save/load,
and transformers' AutoTokenizer loading the saved directory and encoding identically."""

import json

import pytest

from hybridlm.data import builtin
from hybridlm.data.bpe import (
    BOS,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    BPETokenizer,
    load_tokenizer,
    tokenizer_sha256,
    train_bpe,
)
from hybridlm.data.sources import StdlibSource, tinyshakespeare
from hybridlm.data.tokenizer import ByteTokenizer

SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n",
    "Héllo, wörld! 你好，世界。 Ωμέγα — “quotes” 🤖🚀",
    "  leading spaces\t\ttabs\r\nwindows\n\n\nnewlines  ",
    "numbers 1234567890 3.14159 -42 1e-5",
    "\x00\x01 control \x7f chars\u200b zero-width",
    "",
]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(StdlibSource(max_files=25), vocab_size=600)


def test_special_tokens_are_reserved_first(bpe):
    assert [bpe.id_to_token(i) for i in range(len(SPECIAL_TOKENS))] == list(SPECIAL_TOKENS)
    assert (bpe.bos_id, bpe.eos_id, bpe.pad_id) == (0, 1, 2)
    assert bpe.vocab_size == 600
    assert bpe.special_tokens == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    assert bpe.bos_token == BOS and bpe.eos_token == EOS and bpe.pad_token == PAD


def test_round_trip_is_lossless(bpe):
    for text in SAMPLES:
        ids = bpe.encode(text)
        assert ids[0] == bpe.bos_id and bpe.encode(text, add_bos=False) == ids[1:]
        assert bpe.decode(ids) == text
        assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.encode_batch(SAMPLES, add_bos=False) == [
        bpe.encode(t, add_bos=False) for t in SAMPLES
    ]
    # merges were learned: Python source compresses
    code = "import os\nimport sys\n\n\ndef main():\n    return self.value\n"
    assert len(bpe.encode(code, add_bos=False)) < len(code.encode()) / 2


def test_chat_tokens_are_single_ids_and_survive_decode(bpe):
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n<tool_call>{}</tool_call><|im_end|>"
    ids = bpe.encode(text, add_bos=False)
    for token in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>"):
        assert bpe.token_to_id(token) in ids
    assert bpe.decode(ids) == text
    # BOS / EOS / PAD / FIM are special: dropped by decode unless asked
    ids = bpe.encode("<|fim_prefix|>a<|fim_suffix|>b") + [bpe.eos_id, bpe.pad_id]
    assert bpe.decode(ids) == "ab"
    assert bpe.decode(ids, skip_special_tokens=False).startswith("<|bos|><|fim_prefix|>a")


def test_training_is_deterministic_and_validated():
    a = train_bpe(StdlibSource(max_files=8), vocab_size=400)
    b = train_bpe(StdlibSource(max_files=8), vocab_size=400)
    assert a.tokenizer.to_str() == b.tokenizer.to_str() and a.sha256 == b.sha256
    c = train_bpe(StdlibSource(max_files=8), vocab_size=420)
    assert c.sha256 != a.sha256
    with pytest.raises(ValueError, match="at least 268"):
        train_bpe(["abc"], vocab_size=100)
    with pytest.raises(ValueError, match="no merges"):
        train_bpe([""], vocab_size=300)


def test_save_load_and_transformers_parity(bpe, tmp_path):
    bpe.save(tmp_path / "tok", model_max_length=4096)
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == BOS and cfg["eos_token"] == EOS
    again = BPETokenizer.load(tmp_path / "tok")
    assert again.sha256 == bpe.sha256 and again.vocab_size == bpe.vocab_size
    assert load_tokenizer(tmp_path / "tok").encode(SAMPLES[1]) == bpe.encode(SAMPLES[1])

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert isinstance(hf, transformers.PreTrainedTokenizerFast)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    assert len(hf) == bpe.vocab_size and hf.model_max_length == 4096
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nok\n</think>\n"
    for text in [*SAMPLES, chat]:
        assert hf(text)["input_ids"] == bpe.encode(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == bpe.encode(text, add_bos=False)
        assert hf.decode(bpe.encode(text), skip_special_tokens=True) == bpe.decode(bpe.encode(text))


def test_load_other_hf_tokenizers(bpe, tmp_path):
    # a directory with other special-token names, declared in tokenizer_config.json
    data = json.loads(bpe.tokenizer.to_str())
    renames = {BOS: "<s>", EOS: "</s>"}
    for entry in data["added_tokens"]:
        entry["content"] = renames.get(entry["content"], entry["content"])
    vocab = data["model"]["vocab"]
    for old, new in renames.items():
        vocab[new] = vocab.pop(old)
    data["post_processor"] = None
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "llama" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": None})
    )
    other = BPETokenizer.load(tmp_path / "llama")
    assert (other.bos_id, other.eos_id, other.pad_id) == (0, 1, None)
    assert other.encode("x = 1") == bpe.encode("x = 1")

    # GPT-2 style: no BOS token and no tokenizer_config.json -> EOS doubles as BOS
    data = json.loads(bpe.tokenizer.to_str())
    for entry in data["added_tokens"]:
        if entry["content"] == BOS:
            entry["content"] = "<|unused|>"
    data["model"]["vocab"]["<|unused|>"] = data["model"]["vocab"].pop(BOS)
    data["post_processor"] = None
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "tokenizer.json").write_text(json.dumps(data))
    gpt2 = BPETokenizer.load(tmp_path / "gpt2")
    assert gpt2.bos_id == gpt2.eos_id == 1 and gpt2.encode("a")[0] == 1

    with pytest.raises(ValueError, match="no tokenizer.json"):
        BPETokenizer.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        BPETokenizer(bpe.tokenizer, bos_token="<nope>")


def test_byte_tokenizer_fingerprint():
    byte = load_tokenizer("byte")
    assert isinstance(byte, ByteTokenizer)
    assert tokenizer_sha256(byte) == tokenizer_sha256(ByteTokenizer())
    assert len(tokenizer_sha256(byte)) == 64


def test_tinyshakespeare_bpe():
    tok = train_bpe(tinyshakespeare(), vocab_size=1024)  # the packaged copy
    text = builtin.read_text(builtin.path(builtin.TINYSHAKESPEARE))[:200_000]
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    assert len(text) / len(ids) > 2.4  # ~2.6 characters per token at this vocabulary


def test_split_digits_gives_one_token_per_digit():
    docs = [f"{i} + {i * 7} = {i * 8}." for i in range(3000)]
    grouped = train_bpe(docs, vocab_size=400)
    digits = train_bpe(docs, vocab_size=400, split_digits=True)
    text = "12345 + 678 = 13023"
    assert digits.decode(digits.encode(text)) == text
    pieces = [digits.decode([i]) for i in digits.encode(text, add_bos=False)]
    assert "".join(pieces) == text
    # GPT-4 grouping learns multi-digit tokens on the same text
    grouped_pieces = [grouped.decode([i]) for i in grouped.encode(text, add_bos=False)]
    assert any(len(p.strip()) > 1 and p.strip().isdigit() for p in grouped_pieces)
    assert not any(len(p.strip()) > 1 and p.strip().isdigit() for p in pieces)
