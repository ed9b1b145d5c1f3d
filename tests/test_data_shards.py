"""Shards: layout and contents, identical bytes for 1 and 2 workers, resume by content hash,
held-out splits, corruption detection, and bad input counted in the manifest."""

import json

import numpy as np
import pytest

from hybridlm.data.bpe import train_bpe
from hybridlm.data.shards import ShardSet, doc_key, token_dtype, write_shards
from hybridlm.data.sources import Document, IterableSource, StdlibSource, TextFileSource
from hybridlm.data.tokenizer import ByteTokenizer

TEXTS = [f"document {i}: " + "lorem ipsum " * (i % 7) + "é" * (i % 3) for i in range(40)]


def _docs(texts=TEXTS, name="mem"):
    return IterableSource(
        [Document(f"{name}/{i}", t, name) for i, t in enumerate(texts)], name=name
    )


def _shard_bytes(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_layout_contents_and_manifest(tmp_path):
    tok = ByteTokenizer()
    report = write_shards(_docs(), tok, tmp_path, shard_docs=16)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest == report.manifest
    assert [s["documents"] for s in manifest["shards"]] == [16, 16, 8]
    assert manifest["num_documents"] == 40 and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["eos_id"] == 257 and manifest["add_bos"] is True
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])
    assert report.shards_written == 3 and report.shards_reused == 0

    shards = ShardSet(tmp_path, verify=True)
    assert len(shards) == 40 and shards.num_tokens == manifest["num_tokens"]
    for i, text in enumerate(TEXTS):
        doc = shards.document(i)
        assert isinstance(doc, np.memmap) and doc.dtype == np.uint16
        assert doc.tolist() == [256, *text.encode(), 257]
        assert shards.lengths[i] == len(text.encode()) + 2
        assert shards.keys[i] == doc_key(f"mem/{i}")
    assert shards.document(3, 1, 4).tolist() == list(TEXTS[3].encode()[:3])
    assert [len(d) for d in shards][:3] == shards.lengths[:3].tolist()

    no_bos = write_shards(_docs(TEXTS[:2]), tok, tmp_path / "nobos", add_bos=False, add_eos=False)
    assert no_bos.num_tokens == sum(len(t.encode()) for t in TEXTS[:2])


class _BigVocab:
    """A tokenizer with ids above 65535 (uint32 shards)."""

    vocab_size, bos_id, eos_id = 70_000, 69_998, 69_999

    def encode(self, text, *, add_bos=True):
        ids = [60_000 + ord(c) % 9000 for c in text]
        return [self.bos_id, *ids] if add_bos else ids


def test_dtype_follows_vocab(tmp_path):
    assert token_dtype(258) == np.uint16 and token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.uint32
    write_shards(_docs(TEXTS[:3]), _BigVocab(), tmp_path)
    shards = ShardSet(tmp_path)
    assert shards.dtype == np.uint32
    assert shards.document(0).tolist()[:2] == [69_998, 60_000 + ord("d") % 9000]


def test_one_and_two_workers_write_identical_bytes(tmp_path):
    tok = train_bpe(StdlibSource(max_files=10), vocab_size=500)
    src = StdlibSource(max_files=30)
    one = write_shards(src, tok, tmp_path / "w1", num_workers=1, shard_chars=60_000, chunk_docs=3)
    write_shards(src, tok, tmp_path / "w2", num_workers=2, shard_chars=60_000, chunk_docs=3)
    assert one.manifest["num_documents"] == 30 and len(one.manifest["shards"]) > 3
    assert _shard_bytes(tmp_path / "w1") == _shard_bytes(tmp_path / "w2")
    shards = ShardSet(tmp_path / "w2")
    first = next(iter(StdlibSource(max_files=1)))
    assert tok.decode(shards.document(0).tolist()) == first.text
    assert shards.manifest["tokenizer"]["sha256"] == tok.sha256


def test_resume_rewrites_only_what_changed(tmp_path):
    tok = ByteTokenizer()
    write_shards(_docs(), tok, tmp_path, shard_docs=10)
    before = _shard_bytes(tmp_path)
    again = write_shards(_docs(), tok, tmp_path, shard_docs=10)
    assert (again.shards_written, again.shards_reused) == (0, 4)
    assert _shard_bytes(tmp_path) == before

    # a damaged shard (e.g. a crash mid-write, or bit rot) is detected and rewritten alone
    tokens = tmp_path / "shard_00002.tokens.npy"
    tokens.write_bytes(tokens.read_bytes()[:-5])
    with pytest.raises(ValueError, match="shard 2"):
        ShardSet(tmp_path).verify()
    fixed = write_shards(_docs(), tok, tmp_path, shard_docs=10)
    assert (fixed.shards_written, fixed.shards_reused) == (1, 3)
    assert _shard_bytes(tmp_path) == before

    # appending documents keeps the full shards and adds new ones
    grown = write_shards(_docs(TEXTS + ["more"] * 12), tok, tmp_path, shard_docs=10)
    assert (grown.shards_written, grown.shards_reused) == (2, 4)
    # a different tokenizer / setting changes every input hash
    nobos = write_shards(_docs(), tok, tmp_path, shard_docs=10, add_bos=False)
    assert nobos.shards_reused == 0
    # fewer documents: stale shards beyond the end are removed
    write_shards(_docs(TEXTS[:5]), tok, tmp_path, shard_docs=10)
    assert sorted(p.name for p in tmp_path.glob("shard_*.json")) == ["shard_00000.json"]
    assert len(ShardSet(tmp_path)) == 5


def test_plain_iterables_of_documents(tmp_path):
    docs = (Document(f"g/{i}", t, "g") for i, t in enumerate(TEXTS[:5]))  # a one-pass generator
    report = write_shards(docs, ByteTokenizer(), tmp_path)
    assert report.num_documents == 5 and report.manifest["name"] == "documents"


def test_bad_input_is_counted_in_the_manifest(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "ok.txt").write_text("fine text")
    (tmp_path / "in" / "bad.txt").write_bytes(b"\xff\xfe broken")
    (tmp_path / "in" / "blank.txt").write_text("\n\n")
    report = write_shards(
        TextFileSource(tmp_path / "in", name="txt"), ByteTokenizer(), tmp_path / "o"
    )
    assert report.num_documents == 1
    assert report.stats.skipped == {"empty": 1, "non_utf8": 1}
    assert report.manifest["sources"][0]["stats"]["skipped"] == {"empty": 1, "non_utf8": 1}
    with pytest.raises(ValueError, match="no documents to shard"):
        write_shards(TextFileSource(tmp_path / "in" / "bad.txt"), ByteTokenizer(), tmp_path / "x")
    with pytest.raises(ValueError, match="no manifest.json"):
        ShardSet(tmp_path / "x")
    with pytest.raises(ValueError, match="num_workers"):
        write_shards(_docs(), ByteTokenizer(), tmp_path / "y", num_workers=-1)


def test_held_out_splits(tmp_path):
    texts = [f"doc {i}" for i in range(200)]
    write_shards(_docs(texts), ByteTokenizer(), tmp_path / "a", shard_docs=7)
    write_shards(_docs(texts), ByteTokenizer(), tmp_path / "b", shard_docs=50)
    a, b = ShardSet(tmp_path / "a"), ShardSet(tmp_path / "b")

    train, held = a.split(eval_docs=10, method="last")
    assert len(train) == 190 and len(held) == 10
    assert held.document(0).tolist() == a.document(190).tolist()
    assert held.num_tokens + train.num_tokens == a.num_tokens

    ta, ha = a.split(eval_fraction=0.1)
    tb, hb = b.split(eval_fraction=0.1)
    assert 8 <= len(ha) <= 35 and len(ha) + len(ta) == 200
    # the hash split follows document ids, not shard layout
    assert ha.keys.tolist() == hb.keys.tolist()
    assert not set(ha.keys.tolist()) & set(ta.keys.tolist())
    assert [d.tolist() for d in ha] == [d.tolist() for d in hb]
    capped = a.split(eval_fraction=0.5, eval_docs=3)[1]
    assert len(capped) == 3
    sub = held.subset([9, 0])
    assert sub.document(0).tolist() == a.document(199).tolist()
    with pytest.raises(ValueError, match="eval_fraction"):
        a.split(eval_fraction=1.5)
    with pytest.raises(ValueError, match="method"):
        a.split(eval_fraction=0.1, method="random")


def test_tinyshakespeare_shards(tmp_path):
    from hybridlm.data.sources import tinyshakespeare

    report = write_shards(tinyshakespeare(), ByteTokenizer(), tmp_path, num_workers=2)
    shards = ShardSet(tmp_path)
    assert report.num_documents == len(shards) > 7000
    # byte tokens: the UTF-8 bytes of every passage plus BOS and EOS
    docs = list(tinyshakespeare())
    assert shards.num_tokens == sum(len(d.text.encode()) + 2 for d in docs)
    assert bytes(shards.document(7000)[1:-1].tolist()).decode() == docs[7000].text
    assert bytes(shards.document(0)[1:-1].tolist()).startswith(b"First Citizen:")


@pytest.mark.slow
def test_stdlib_corpus_with_an_8k_bpe(tmp_path):
    """The embedded default corpus end to end: BPE 8192, 1 vs 2 workers, throughput printed."""
    tok = train_bpe(StdlibSource(), vocab_size=8192)
    one = write_shards(StdlibSource(), tok, tmp_path / "w1", num_workers=1)
    two = write_shards(StdlibSource(), tok, tmp_path / "w2", num_workers=2)
    assert _shard_bytes(tmp_path / "w1") == _shard_bytes(tmp_path / "w2")
    assert one.num_documents > 300 and one.stats.chars / one.num_tokens > 3.5
    for n, r in ((1, one), (2, two)):
        print(f"{n} worker(s): {r.docs_per_second:.0f} docs/s, {r.tokens_per_second:.0f} tokens/s")
