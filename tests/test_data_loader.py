"""Packed loader: row layout (labels, targets, doc_ids, position_ids), best-fit and greedy packing,
mixtures and phases, exact resume from any step, data-parallel equivalence, held-out loaders."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from hybridlm.data.loader import IGNORE_INDEX, PackedLoader, Phase, best_fit_decreasing
from hybridlm.data.shards import ShardSet, write_shards
from hybridlm.data.sources import Document, IterableSource
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.train.objectives import causal_lm_loss

L = 32  # seq_len


def _make(tmp_path, name, lengths, letter="a", seed=0):
    """A ShardSet of byte-token documents with the given text lengths (+BOS +EOS)."""
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(list(letter + "xyz "), size=n)) for n in lengths]
    docs = [Document(f"{name}/{i}", t, name) for i, t in enumerate(texts)]
    write_shards(IterableSource(docs, name=name), ByteTokenizer(), tmp_path / name, shard_docs=37)
    return ShardSet(tmp_path / name)


@pytest.fixture
def web(tmp_path):
    lengths = np.random.default_rng(1).integers(1, 90, size=300)  # some longer than a row
    return _make(tmp_path, "web", lengths, "a")


@pytest.fixture
def code(tmp_path):
    lengths = np.random.default_rng(2).integers(20, 200, size=120)
    return _make(tmp_path, "code", lengths, "b", seed=3)


def _check_rows(batch):
    """Layout invariants that hold for every row of every batch."""
    ids, labels, targets = batch["input_ids"], batch["labels"], batch["targets"]
    doc, pos = batch["doc_ids"], batch["position_ids"]
    B, Lb = ids.shape
    assert labels.shape == targets.shape == doc.shape == pos.shape == (B, Lb)
    assert all(t.dtype == torch.int64 for t in (ids, labels, targets, doc, pos))
    keep = labels != IGNORE_INDEX
    assert torch.equal(labels[keep], ids[keep])  # the model's convention: unshifted
    assert (labels[:, 0] == IGNORE_INDEX).all()
    # targets are labels shifted by one, plus the window's last token
    assert torch.equal(targets[:, :-1], labels[:, 1:])
    for b in range(B):
        d = doc[b]
        assert d[0] == 0 and (d[1:] - d[:-1] >= 0).all() and (d[1:] - d[:-1] <= 1).all()
        starts = torch.cat([torch.tensor([True]), d[1:] != d[:-1]])
        assert (pos[b][starts] == 0).all()
        assert torch.equal(pos[b][~starts], pos[b][:-1][~starts[1:]] + 1)
        # a segment's first token is never a target; other real tokens always are
        assert (labels[b][starts] == IGNORE_INDEX).all()
        real = batch["source_ids"][b] >= 0
        assert (labels[b][~starts & real] != IGNORE_INDEX).all()
    n_labels = int((labels[:, 1:] != IGNORE_INDEX).sum())
    return n_labels


@pytest.mark.parametrize("packing", ["best_fit", "greedy"])
def test_row_layout(web, packing):
    loader = PackedLoader(web, seq_len=L, batch_size=4, packing=packing, buffer_docs=64)
    for _ in range(10):
        batch = next(loader)
        n_labels = _check_rows(batch)
        assert int(batch["num_valid_tokens"]) == n_labels  # world 1: global == local
        assert int(batch["num_valid_targets"]) == int((batch["targets"] != IGNORE_INDEX).sum())
    if packing == "greedy":  # no padding, rows overlap by one token
        assert (batch["source_ids"] >= 0).all()


def test_best_fit_rows_are_bos_aligned_and_pad_little(web):
    short = web.subset(np.flatnonzero(web.lengths <= L + 1))  # no document needs splitting
    loader = PackedLoader(short, seq_len=L, batch_size=8, buffer_docs=200)
    pads = total = 0
    for _ in range(20):
        batch = next(loader)
        ids, doc, src = batch["input_ids"], batch["doc_ids"], batch["source_ids"]
        starts = torch.cat([torch.ones(8, 1, dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], 1)
        assert (ids[:, 0] == 256).all()  # every row starts with a document's BOS
        assert (ids[starts & (src >= 0)] == 256).all()  # and so does every segment
        pads += int((src == -1).sum())
        total += ids.numel()
        assert (ids[src == -1] == web.pad_id).all()
    assert pads / total < 0.05


def test_best_fit_decreasing_bins():
    pieces = [(0, i, 0, n) for i, n in enumerate([9, 2, 7, 3, 5, 5, 1, 8])]
    bins = best_fit_decreasing(pieces, 10)
    assert all(sum(p[3] for p in b) <= 10 for b in bins)
    assert sorted(p for b in bins for p in b) == sorted(pieces)
    assert len(bins) == 4  # 40 tokens in 4 bins of 10: a perfect fit
    assert [[p[3] for p in b] for b in bins] == [[9, 1], [8, 2], [7, 3], [5, 5]]


@pytest.mark.parametrize("packing", ["best_fit", "greedy"])
def test_one_pass_covers_every_target_exactly_once(web, packing):
    """Held-out mode reads every document once; every token but a document's first is a target
    exactly once (split documents share one token between neighbouring pieces)."""
    loader = PackedLoader(web, seq_len=L, batch_size=3, packing=packing, sequential=True)
    got, n_batches = Counter(), 0
    for batch in loader:
        n_batches += 1
        got.update(batch["targets"][batch["targets"] != IGNORE_INDEX].tolist())
        _check_rows(batch)
    want = Counter(t for doc in web for t in doc[1:].tolist())
    assert got == want
    assert n_batches >= web.num_tokens / (3 * (L + 1))
    with pytest.raises(StopIteration):
        next(loader)


def _run(loader, steps):
    return [next(loader) for _ in range(steps)]


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("packing", ["best_fit", "greedy"])
def test_resume_from_any_step_is_exact(web, code, packing):
    kw = dict(
        seq_len=L,
        batch_size=3,
        packing=packing,
        buffer_docs=40,
        phases=[
            Phase(fraction=0.5, weights={"web": 1, "code": 1}),
            Phase(fraction=0.5, weights={"code": 1}),
        ],
        total_tokens=14 * 3 * L,
        seed=7,
    )
    sets = {"web": web, "code": code.subset(range(5))}  # the small source wraps around
    reference = PackedLoader(sets, **kw)
    states, batches = [reference.state_dict()], []
    for _ in range(16):  # several buffers, both phases, epochs of the small source
        batches.append(next(reference))
        states.append(json.loads(json.dumps(reference.state_dict())))  # as in meta.json
    assert reference.stream.state["epoch"][1] >= 2
    assert {0, 1} <= set(torch.cat([b["source_ids"] for b in batches[:6]]).flatten().tolist())
    assert set(batches[-1]["source_ids"].flatten().tolist()) <= {1, -1}  # phase 2: code only
    for step in range(len(states)):  # every step, including the end of the run
        resumed = PackedLoader(sets, **kw)
        resumed.load_state_dict(states[step])
        assert resumed.step == step
        for want in batches[step:]:
            _same(next(resumed), want)


def test_data_parallel_ranks_split_the_global_batch(web, code):
    sets = {"web": web, "code": code}
    kw = dict(seq_len=L, buffer_docs=50, weights={"web": 2, "code": 1}, seed=3)
    single = PackedLoader(sets, batch_size=4, **kw)
    ranks = [PackedLoader(sets, batch_size=2, rank=r, world_size=2, **kw) for r in range(2)]
    seen = set()
    for _ in range(8):
        whole, parts = next(single), [next(r) for r in ranks]
        for key in ("input_ids", "labels", "targets", "doc_ids", "position_ids", "source_ids"):
            assert torch.equal(torch.cat([p[key] for p in parts]), whole[key]), key
        # every rank knows the global count of targets for the loss normaliser
        assert int(parts[0]["num_valid_tokens"]) == int(parts[1]["num_valid_tokens"])
        assert int(parts[0]["num_valid_tokens"]) == int(whole["num_valid_tokens"])
        rows = [tuple(p["input_ids"][i].tolist()) for p in parts for i in range(2)]
        assert not seen.intersection(rows)
        seen.update(rows)
    # a world-2 state resumes on world 1 (same global batch)
    state = ranks[0].state_dict()
    again = PackedLoader(sets, batch_size=4, **kw)
    again.load_state_dict(state)
    for r in ranks:
        r_next = next(r)
        assert r_next["input_ids"].shape == (2, L)
    single_next = next(single)
    _same(next(again), single_next)


def test_mixture_weights_are_token_fractions(web, code):
    sets = {"web": web, "code": code}
    loader = PackedLoader(sets, seq_len=L, batch_size=16, weights={"web": 0.75, "code": 0.25})
    counts = Counter()
    for _ in range(40):
        counts.update(next(loader)["source_ids"].flatten().tolist())
    frac_web = counts[0] / (counts[0] + counts[1])
    assert abs(frac_web - 0.75) < 0.05
    # deterministic given the seed, different across seeds
    a = next(PackedLoader(sets, seq_len=L, batch_size=4, seed=1))
    b = next(PackedLoader(sets, seq_len=L, batch_size=4, seed=1))
    c = next(PackedLoader(sets, seq_len=L, batch_size=4, seed=2))
    _same(a, b)
    assert not torch.equal(a["input_ids"], c["input_ids"])
    only_code = next(PackedLoader(sets, seq_len=L, batch_size=4, weights={"code": 1.0}))
    assert set(only_code["source_ids"].flatten().tolist()) <= {1, -1}


def test_phases_switch_the_blend(web, code):
    steps, B = 20, 4
    loader = PackedLoader(
        {"web": web, "code": code},
        seq_len=L,
        batch_size=B,
        packing="greedy",
        phases=[
            Phase(fraction=0.8, weights={"web": 1.0}),
            Phase(fraction=0.2, weights={"code": 1.0}),
        ],
        total_tokens=steps * B * L,
    )
    sources = [set(next(loader)["source_ids"].flatten().tolist()) for _ in range(steps)]
    assert all(s == {0} for s in sources[:16])
    assert all(s == {1} for s in sources[17:])  # one boundary row may hold both


def test_held_out_loader_and_split(web):
    train, held = web.split(eval_fraction=0.1)
    assert len(held) > 0 and not set(held.keys.tolist()) & set(train.keys.tolist())
    loader = PackedLoader(held, seq_len=L, batch_size=2, sequential=True, packing="greedy")
    batches = list(loader)
    n = sum(int((b["targets"] != IGNORE_INDEX).sum()) for b in batches)
    assert n == int((held.lengths - 1).sum())
    assert batches[-1]["input_ids"].shape == (2, L)  # the tail is padded to full batches


def test_state_and_argument_errors(web, code, tmp_path):
    loader = PackedLoader(web, seq_len=L, batch_size=2)
    next(loader)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="seq_len: saved 32 vs now 16"):
        PackedLoader(web, seq_len=16, batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        loader.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="rank"):
        PackedLoader(web, seq_len=L, batch_size=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="unknown sources"):
        PackedLoader({"web": web}, seq_len=L, batch_size=2, weights={"news": 1.0})
    with pytest.raises(ValueError, match="total_tokens"):
        PackedLoader(
            {"web": web, "code": code},
            seq_len=L,
            batch_size=2,
            phases=[
                Phase(fraction=0.5, weights={"web": 1}),
                Phase(fraction=0.5, weights={"code": 1}),
            ],
        )
    with pytest.raises(ValueError, match="sum to 1"):
        PackedLoader(web, seq_len=L, batch_size=2, phases=[Phase(fraction=0.5, weights={"web": 1})])
    with pytest.raises(ValueError, match="no documents"):
        PackedLoader(web.subset([]), seq_len=L, batch_size=2)
    with pytest.raises(ValueError, match="packing"):
        PackedLoader(web, seq_len=L, batch_size=2, packing="random")

    # shards made with another tokenizer cannot be mixed
    class Shifted(ByteTokenizer):
        vocab_size = 300

    write_shards(IterableSource(["other tokenizer"], name="big"), Shifted(), tmp_path / "big")
    with pytest.raises(ValueError, match="different tokenizers"):
        PackedLoader([web, ShardSet(tmp_path / "big")], seq_len=L, batch_size=2)


def test_batch_trains_the_model(web):
    """The batch plugs into HybridLM as is: labels in its convention, the global count."""
    from hybridlm import HybridLM
    from hybridlm.presets import get_preset

    cfg = get_preset("tiny-olmo")
    with torch.device("meta"):
        model = HybridLM(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    batch = next(PackedLoader(web, seq_len=L, batch_size=2))
    out = model(batch["input_ids"], mtp_depth=model.train_mtp_depth)
    n = batch["num_valid_tokens"]
    loss, parts = causal_lm_loss(model, out, batch["labels"], num_valid_tokens=n)
    assert torch.isfinite(loss)
    _, ref = causal_lm_loss(model, out, batch["labels"])
    torch.testing.assert_close(parts["ce"], ref["ce"])


@pytest.mark.parametrize("packing", ["best_fit", "greedy"])
def test_token_index_addresses_the_shard_token_stream(web, code, packing):
    """token_index: each position's entry in its source's shards back to back (held-out views
    of a set keep the whole set's addresses), -1 on padding."""
    train, held = web.split(eval_fraction=0.2)
    sets = {"web": train, "code": code}
    loader = PackedLoader(sets, seq_len=L, batch_size=4, packing=packing, seed=1)
    streams = [
        np.concatenate([s._load(k, "tokens") for k in range(len(s.shard_token_starts) - 1)])
        for s in (web, code)
    ]
    assert len(web.shard_token_starts) > 2  # several shards
    for _ in range(5):
        b = next(loader)
        real = b["source_ids"] >= 0
        assert ((b["token_index"] >= 0) == real).all()
        for src, stream in enumerate(streams):
            sel = b["source_ids"] == src
            want = torch.from_numpy(stream[b["token_index"][sel].numpy()].astype(np.int64))
            assert torch.equal(b["input_ids"][sel], want)
    assert np.array_equal(held.token_starts, web.token_starts[held.index])
