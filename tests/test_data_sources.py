"""Document sources: text / JSONL / Parquet / HF datasets / stdlib / tinyshakespeare; bad input is
counted under a reason and skipped, never a crash; missing paths are clear ValueErrors."""

import gzip
import json
import sysconfig

import pytest

from hybridlm.data import builtin
from hybridlm.data.sources import (
    Document,
    IterableSource,
    JsonlSource,
    ParquetSource,
    StdlibSource,
    TextFileSource,
    tinyshakespeare,
)


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


def test_text_folder_glob_and_split_modes(tmp_path):
    _write(tmp_path / "b.txt", "beta one\n\nbeta two\n \n\nbeta three")
    _write(tmp_path / "a.txt", "alpha")
    _write(tmp_path / "sub" / "c.txt", "gamma<|endoftext|>delta")
    _write(tmp_path / "skip.md", "not matched")

    docs = list(TextFileSource(tmp_path, name="t"))
    assert [d.id for d in docs] == ["t/a.txt", "t/b.txt", "t/sub/c.txt"]  # sorted, recursive
    assert docs[0] == Document("t/a.txt", "alpha", "t", {"path": "a.txt", "part": 0})

    paras = list(TextFileSource(tmp_path / "b.txt", split="blank_line", name="t"))
    assert [d.text for d in paras] == ["beta one", "beta two", "beta three"]
    assert [d.id for d in paras] == ["t/b.txt#0", "t/b.txt#1", "t/b.txt#2"]

    grouped = list(TextFileSource(tmp_path / "b.txt", split="blank_line", group_chars=12))
    assert [d.text for d in grouped] == ["beta one\n\nbeta two", "beta three"]

    sep = TextFileSource(tmp_path / "sub", split="separator", separator="<|endoftext|>")
    assert [d.text for d in sep] == ["gamma", "delta"]
    assert [d.text for d in TextFileSource(str(tmp_path / "*.txt"))] == [
        "alpha",
        "beta one\n\nbeta two\n \n\nbeta three",
    ]


def test_text_bad_input_is_counted_not_fatal(tmp_path):
    _write(tmp_path / "good.txt", "\ufeffhello")  # a BOM is dropped
    _write(tmp_path / "latin1.txt", "café".encode("latin-1"))
    _write(tmp_path / "empty.txt", "  \n\t\n")
    _write(tmp_path / "nul.txt", b"abc\x00def")
    src = TextFileSource(tmp_path, name="t")
    docs = list(src)
    assert [d.text for d in docs] == ["hello"]
    assert src.stats.documents == 1 and src.stats.chars == 5
    assert src.stats.skipped == {"binary": 1, "empty": 1, "non_utf8": 1}
    assert any("latin1.txt: non_utf8" in e for e in src.stats.examples)
    # a second pass starts fresh statistics
    list(src)
    assert src.stats.num_skipped == 3

    with pytest.raises(ValueError, match="path not found"):
        TextFileSource(tmp_path / "missing")
    with pytest.raises(ValueError, match="separator"):
        TextFileSource(tmp_path, split="separator")
    with pytest.raises(ValueError, match="split must be"):
        TextFileSource(tmp_path, split="lines")


def test_jsonl_fields_ids_and_bad_lines(tmp_path):
    lines = [
        json.dumps({"id": "x1", "text": "first", "lang": "en"}),
        json.dumps({"text": "second"}),
        "{not json",
        json.dumps({"body": "no text field"}),
        json.dumps({"text": 42}),
        json.dumps({"text": "   "}),
        "",
    ]
    data = "\n".join(lines).encode() + b"\n" + b'{"text": "caf\xe9"}\n'
    _write(tmp_path / "a.jsonl", data)
    src = JsonlSource(tmp_path, metadata_fields=["lang"], name="j")
    docs = list(src)
    assert [d.text for d in docs] == ["first", "second"]
    assert docs[0].id == "j/x1" and docs[0].metadata["lang"] == "en"
    assert docs[1].id == "j/a.jsonl:2" and docs[1].metadata == {"path": "a.jsonl", "line": 2}
    assert src.stats.skipped == {
        "bad_json": 1,
        "empty": 1,
        "missing_field": 1,
        "non_utf8": 1,
        "not_text": 1,
    }

    nested = tmp_path / "nested" / "b.jsonl.gz"
    nested.parent.mkdir()
    with gzip.open(nested, "wt") as fh:
        fh.write(json.dumps({"meta": {"body": "deep"}}) + "\n")
    assert [d.text for d in JsonlSource(nested, text_field="meta.body")] == ["deep"]
    blob = gzip.compress(b"".join(b'{"text": "line %d"}\n' % i for i in range(5000)))
    _write(tmp_path / "trunc" / "c.jsonl.gz", blob[: len(blob) // 2])  # a cut download
    trunc = JsonlSource(tmp_path / "trunc")
    kept = list(trunc)  # the lines before the cut are kept
    assert 0 < len(kept) < 5000 and trunc.stats.skipped == {"unreadable": 1}


def test_parquet_column_nulls_and_corrupt_files(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"content": ["one", None, "three", ""], "uid": ["a", "b", "c", "d"]})
    pq.write_table(table, tmp_path / "good.parquet", row_group_size=2)
    pq.write_table(pa.table({"other": ["x"]}), tmp_path / "nocol.parquet")
    _write(tmp_path / "corrupt.parquet", b"PAR1" + b"\x00garbage" * 50)
    src = ParquetSource(tmp_path, text_column="content", id_column="uid", batch_size=1, name="p")
    docs = list(src)
    assert [(d.id, d.text) for d in docs] == [("p/a", "one"), ("p/c", "three")]
    assert src.stats.skipped == {
        "corrupt_parquet": 1,
        "empty": 1,
        "missing_column": 1,
        "not_text": 1,
    }
    assert [d.id for d in ParquetSource(tmp_path / "good.parquet", text_column="content")] == [
        "good/good.parquet:0",
        "good/good.parquet:2",
    ]


def test_hf_datasets_on_local_files(tmp_path):
    pytest.importorskip("datasets")
    from hybridlm.data.sources import HFDatasetSource

    rows = [{"text": f"document number {i}", "idx": i} for i in range(5)] + [{"text": None}]
    _write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in rows))
    src = HFDatasetSource(
        "json",
        data_files=[str(tmp_path / "d.jsonl")],
        cache_dir=tmp_path / "cache",
        id_field="idx",
        name="hf",
    )
    docs = list(src)
    assert [d.text for d in docs] == [f"document number {i}" for i in range(5)]
    assert docs[3].id == "hf/3" and src.stats.skipped == {"not_text": 1}
    assert src.describe()["path"] == "json"


def test_stdlib_default_corpus_is_deterministic_and_filtered():
    src = StdlibSource(max_files=40)
    docs = list(src)
    again = [d.id for d in StdlibSource(max_files=40)]
    assert [d.id for d in docs] == again == sorted(again)
    assert len(docs) >= 30 and all(d.source == "stdlib" for d in docs)
    full = StdlibSource()
    rels = [rel for _, rel in full.files]
    assert len(rels) > 300  # ~450 on CPython 3.11
    assert not any(
        part in ("test", "tests", "idlelib", "site-packages")
        for rel in rels
        for part in rel.split("/")[:-1]
    )
    assert "os.py" in rels and "json/decoder.py" in rels
    root = sysconfig.get_paths()["stdlib"]
    for doc in docs[:5]:  # the source text itself, unchanged
        with open(f"{root}/{doc.metadata['path']}", encoding="utf-8") as fh:
            assert doc.text == fh.read()


def test_stdlib_docstrings_only_is_prose():
    src = StdlibSource(docstrings_only=True, max_files=60)
    docs = list(src)
    assert len(docs) > 20
    text = "\n".join(d.text for d in docs)
    assert "def " not in text.split("\n")[0] and "import " not in docs[0].text[:7]
    assert src.stats.skipped.get("empty", 0) >= 1  # files with no docstrings


def test_iterable_source_and_names():
    src = IterableSource(["a", "", Document("k", "b", "x"), 3], name="mem")
    assert [d.id for d in src] == ["mem/0", "k"]
    assert src.stats.skipped == {"empty": 1, "not_text": 1}
    with pytest.raises(ValueError, match="name"):
        IterableSource(["a"], name="a/b")


def test_tinyshakespeare_passages(tmp_path):
    src = tinyshakespeare()  # the packaged copy (gzip)
    docs = list(src)
    assert len(docs) > 7000 and src.stats.num_skipped == 0
    assert docs[0].text.startswith("First Citizen:\nBefore we proceed any further")
    assert docs[0].id == "tinyshakespeare/input.txt#0"  # the same ids as the plain file
    text = builtin.read_text(builtin.path(builtin.TINYSHAKESPEARE))
    assert "".join("".join(d.text for d in docs).split()) == "".join(text.split())
    plain = tmp_path / "input.txt"
    plain.write_text(text)
    assert [(d.id, d.text) for d in tinyshakespeare(plain)] == [(d.id, d.text) for d in docs]
    grouped = list(tinyshakespeare(group_chars=2000))
    assert 400 < len(grouped) < 700
    assert all(len(d.text) >= 2000 for d in grouped[:-1])
