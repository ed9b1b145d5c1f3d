"""Long-context data: long-document selection, CWE / REX synthetic tasks, and long and short
sequences alternating in one loader with exact resume."""

import random
import re

import pytest
import torch

from hybridlm.data.config import AlternateConfig, DataConfig, SourceConfig
from hybridlm.data.longcontext import (
    LONGCONTEXT_TASKS,
    REX_SCENARIOS,
    LongContextTaskSource,
    LongDocumentSource,
    cwe_example,
    gzip_ratio,
    recall_example,
    records_example,
    repeat_example,
    rex_example,
    segment_idf,
    segment_text,
)
from hybridlm.data.pipeline import build_loaders, prepare_shards
from hybridlm.data.sources import IterableSource

_THINGS = ["river", "castle", "lantern"]
PROSE = [
    " ".join(
        f"Line {i} of document {d}: the {random.Random(d * 100 + i).choice(_THINGS)}"
        f" stands near the {['bridge', 'meadow', 'harbor', 'tower'][i % 4]} number {i * d}.\n"
        for i in range(20 + 15 * d)
    )
    for d in range(6)
]


def test_gzip_ratio_orders_repetition():
    assert gzip_ratio("abc " * 500) < gzip_ratio(PROSE[3]) < 1.0


def test_long_documents_by_length_and_gzip_band():
    noise = "".join(random.Random(0).choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(4000))
    docs = [*PROSE, "the same line\n" * 300, noise]
    src = LongDocumentSource(IterableSource(docs, name="base"), min_chars=1500, name="long")
    kept = list(src)
    assert all(len(d.text) >= 1500 for d in kept) and src.stats.skipped["too_short"] > 0
    banded = LongDocumentSource(
        IterableSource(docs, name="base"), min_chars=1500, gzip_band=[0.2, 0.8], name="long"
    )
    texts = [d.text for d in banded]
    # the most repetitive and the least compressible documents are dropped
    assert docs[-2] not in texts and docs[-1] not in texts
    assert banded.stats.skipped["gzip_ratio"] >= 2 and texts
    with pytest.raises(ValueError, match="gzip_band"):
        LongDocumentSource(IterableSource(docs), gzip_band=[0.8, 0.2])


def test_segments_cut_at_line_breaks_within_bounds():
    segs = segment_text(PROSE[5], 400, 700)
    assert len(segs) >= 3
    assert all(400 <= len(s) <= 700 for s in segs)
    assert all(s.endswith(".") for s in segs)  # cut at a line end, never inside a line


def test_cwe_answer_is_the_exact_counts():
    seg = "apple banana apple cherry apple banana date elder fig apple banana grape"
    text = cwe_example(seg, random.Random(0))
    answer = text.split("\n")[-1]
    pairs = dict((w, int(n)) for w, n in re.findall(r"(\w+) \((\d+)\)", answer))
    assert pairs == {"apple": 4, "banana": 3, "cherry": 1, "date": 1, "elder": 1}
    assert cwe_example("one two", random.Random(0)) is None


def test_records_answers_are_computed_from_the_records():
    seg = segment_text(PROSE[5], 800, 1200)[0]
    for i in range(20):
        text = records_example(seg, random.Random(i), num_questions=4)
        rows = re.findall(
            r"^(\w+ \w+) lives in (\w+), works as a (\w+), and has the id (\d+)\.$",
            text,
            flags=re.M,
        )
        assert rows and all(ln in text for ln in seg.splitlines())  # the segment is all there
        ids = {n: i for n, _, _, i in rows}
        for name, idn in re.findall(r"The id of (\w+ \w+) is (\d+)\.", text):
            assert ids[name] == idn
        for city, who in re.findall(r"Who lives in (\w+)\? Answer: (.+)\.", text):
            assert who.split(", ") == [n for n, c, _, _ in rows if c == city]
        for job, k in re.findall(r"How many people work as a (\w+)\? Answer: (\d+)\.", text):
            assert int(k) == sum(j == job for _, _, j, _ in rows)


def test_recall_quotes_continue_a_cue_verbatim():
    seg = segment_text(PROSE[3], 600, 1200)[0]
    lines = [ln.strip() for ln in seg.splitlines() if len(ln.strip()) >= 12]
    for i in range(20):
        text = recall_example(seg, random.Random(i))
        assert text.startswith(seg)
        quotes = text[len(seg) :].strip().split("\n\n")
        assert len(quotes) == 3
        for q in quotes:
            cue, copied = re.match(r'Quote the text above from "(.+?)": (.+)$', q, re.S).groups()
            run = copied.split("\n")
            assert run[0].startswith(cue + " ") and run[0] in lines
            start = lines.index(run[0])
            assert run == lines[start : start + len(run)]  # consecutive lines, in order
    assert recall_example("one short line only", random.Random(0)) is None


def test_repeat_is_one_random_word_sequence_over_and_over():
    seg = segment_text(PROSE[2], 600, 1200)[0]
    for i in range(10):
        words = repeat_example(seg, random.Random(i), words=100).split(" ")
        assert len(words) == 100 and set(words) <= set(re.findall(r"[A-Za-z]{3,}", seg))
        period = next(k for k in range(4, 17) if words[k:] == words[:-k])
        assert words == (words[:period] * 100)[:100]
    assert repeat_example("a b", random.Random(0)) is None


@pytest.mark.parametrize("scenario", REX_SCENARIOS)
def test_rex_copies_lines_of_the_segment(scenario):
    seg = segment_text(PROSE[4], 600, 1200)[0]
    idf = segment_idf(segment_text(PROSE[4], 600, 1200))
    text = rex_example(
        seg, random.Random(1), idf, distractors=["a line that is not there"], scenario=scenario
    )
    assert text.startswith(seg)
    body = text[len(seg) :]
    lines = [ln.strip() for ln in seg.splitlines() if len(ln.strip()) >= 12]
    if scenario in ("quiz", "game_show"):
        # each line is split into a key and its continuation, both verbatim
        pat = r"\d+\. (.+) \.\.\. Answer: (.+)" if scenario == "quiz" else r'"(.+) \.\.\." .*"(.+)"'
        pairs = re.findall(pat, body)
        assert pairs and all(f"{k} {v}" in lines for k, v in pairs)
    else:
        assert any(ln in body for ln in lines)


def test_task_source_is_deterministic_and_keeps_parents_split_side():
    base = IterableSource(PROSE, name="base")
    a = list(LongContextTaskSource(base, segment_chars=[500, 900], seed=3, name="t"))
    b = list(LongContextTaskSource(base, segment_chars=[500, 900], seed=3, name="t"))
    c = list(LongContextTaskSource(base, segment_chars=[500, 900], seed=4, name="t"))
    assert [d.text for d in a] == [d.text for d in b] != [d.text for d in c]
    assert {d.metadata["task"] for d in a} == set(LONGCONTEXT_TASKS)
    assert all(d.metadata["split_id"] == d.id.split("#")[0] for d in a)


def test_config_builds_long_sources_and_validates(tmp_path):
    cfg = DataConfig(
        sources=[
            SourceConfig(name="code", kind="stdlib", max_files=30, weight=0.5),
            SourceConfig(name="long", kind="stdlib", max_files=30, min_chars=4000, weight=0.2),
            SourceConfig(
                name="tasks",
                kind="stdlib",
                max_files=30,
                docstrings_only=True,
                longcontext_tasks=["cwe", "rex"],
                segment_chars=[400, 800],
                weight=0.3,
            ),
        ],
        shards_dir=str(tmp_path / "shards"),
        seq_len=512,
        batch_size=2,
        eval_fraction=0.2,
    )
    sets = prepare_shards(cfg)
    assert min(sets["long"].lengths) >= 4000 // 4  # bytes: >= 4000 tokens of the byte tokenizer
    train, held = build_loaders(cfg, sets)
    held_keys = set(held.sets[held.names.index("tasks")].keys.tolist())
    # a held-out synthetic example's parent document is held out for every task of it
    assert held_keys and held_keys.isdisjoint(train.sets[train.names.index("tasks")].keys.tolist())
    with pytest.raises(ValueError, match="longcontext_tasks"):
        SourceConfig(name="x", longcontext_tasks=["nope"]) and DataConfig(
            sources=[SourceConfig(name="x", longcontext_tasks=["nope"])]
        )
    with pytest.raises(ValueError, match="segment_chars"):
        DataConfig(sources=[SourceConfig(name="x", segment_chars=[10, 5])])


def _alternating_config(tmp_path):
    return DataConfig(
        sources=[
            SourceConfig(name="code", kind="stdlib", max_files=40, weight=0.7),
            SourceConfig(
                name="docs", kind="stdlib", max_files=40, docstrings_only=True, weight=0.3
            ),
        ],
        shards_dir=str(tmp_path / "shards"),
        seq_len=256,
        batch_size=1,
        alternate=AlternateConfig(seq_len=64, batch_size=4, batches=2, weights={"docs": 1.0}),
    )


def test_alternating_lengths_cycle_and_resume_exactly(tmp_path):
    cfg = _alternating_config(tmp_path)
    sets = prepare_shards(cfg)
    train, _ = build_loaders(cfg, sets)
    assert train.tokens_per_step == round((256 + 2 * 4 * 64) / 3)
    batches = [next(train) for _ in range(9)]
    assert [tuple(b["input_ids"].shape) for b in batches[:3]] == [(1, 256), (4, 64), (4, 64)]
    docs = sets["docs"]
    assert (
        all(
            (b["source_ids"][b["source_ids"] >= 0] == 0).all()
            for b in batches
            if b["input_ids"].shape[1] == 64
        )
        and docs
    )  # short batches draw from their own weights (docs only: index 0 of its loader)
    for cut in (1, 2, 4):
        again, _ = build_loaders(cfg, sets)
        for _ in range(cut):
            next(again)
        state = again.state_dict()
        fresh, _ = build_loaders(cfg, sets)
        fresh.load_state_dict(state)
        for want in batches[cut:]:
            got = next(fresh)
            assert all(torch.equal(got[k], want[k]) for k in want)
    other = _alternating_config(tmp_path)
    other.alternate.batches = 3
    wrong, _ = build_loaders(other, sets)
    with pytest.raises(ValueError, match="alternates"):
        wrong.load_state_dict(state)


def test_alternate_config_errors():
    with pytest.raises(ValueError, match="unknown sources"):
        DataConfig(alternate=AlternateConfig(weights={"nope": 1.0}))
    with pytest.raises(ValueError, match="must be >= 1"):
        DataConfig(alternate=AlternateConfig(batches=0))
