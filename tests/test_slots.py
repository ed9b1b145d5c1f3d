"""Static decode slots (`model.slots`) and the captured-step runner (`infer.graphs`): every
call through a `SlotCache` equals the same call through the growing `HybridCache`, on the CPU
where the steps run eagerly (the CUDA capture itself: `tests/test_gpu.py`)."""

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.engine import Engine
from hybridlm.infer.graphs import DecodeGraphs, decode_graphs
from hybridlm.infer.sampling import SamplingParams
from hybridlm.model.cache import HybridCache
from hybridlm.model.slots import SlotCache
from hybridlm.precision.kv_cache import calibrate_kv, kv_codecs
from hybridlm.presets import get_preset

PRESETS = ["tiny-super", "tiny-lightning", "tiny-olmo"]


def _model(name: str, window: int | None = None) -> HybridLM:
    cfg = get_preset(name)
    cfg.vocab_size = 300
    if cfg.mamba is not None and "M" in cfg.pattern:
        cfg.mamba.chunk_size = 8
    if window is not None:
        cfg.attention.sliding_window = window  # windows bind within the rows
    return HybridLM(cfg, seed=0).double().eval()


def _prefilled(model, prompt, **kw) -> HybridCache:
    cache = HybridCache.for_pattern(model.config.pattern, **kw)
    model(torch.tensor([prompt]), cache=cache)
    return cache


def _rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", PRESETS)
def test_slot_steps_equal_each_row_alone(name):
    """Rows of different lengths decode together over slots; every step's logits equal the
    row's own through a HybridCache, while rows leave and a new one joins."""
    model = _model(name, window=6 if name == "tiny-olmo" else None)
    prompts = _rows([9, 3, 14])
    refs = [_prefilled(model, p) for p in prompts]
    graphs = decode_graphs(model, 4, 300, cuda_graphs=True)  # column buckets 256 and 300
    assert isinstance(graphs, DecodeGraphs) and not graphs.capture
    assert graphs.col_buckets == [256, 300] and graphs.row_buckets == [1, 2, 4]
    for r, c in enumerate(refs):
        graphs.slots.put(r, c)
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        if step == 3:  # row 1 leaves, a new row joins
            graphs.slots.keep([0, 2])
            refs = [refs[0], refs[2], _prefilled(model, _rows([5], seed=2)[0])]
            graphs.slots.put(2, refs[2])
        ids = torch.randint(0, 256, (len(refs), 1), generator=g)
        logits, hidden = graphs.forward(ids)
        for r, c in enumerate(refs):
            out = model(ids[r : r + 1], cache=c, return_hidden=True)
            torch.testing.assert_close(logits[r], out.logits[0], atol=1e-10, rtol=0)
            torch.testing.assert_close(hidden[r], out.hidden[0], atol=1e-10, rtol=0)
    assert graphs.slots.host_len[:3] == graphs.slots.length_R[:3].tolist()


@pytest.mark.parametrize("name", PRESETS)
def test_verify_and_per_row_rewind_equal_the_kept_rows(name):
    """A J-token verification with per-row keep counts, then a step: each row equals the row
    alone fed only the tokens it kept."""
    model = _model(name, window=4 if name == "tiny-olmo" else None)
    prompts = _rows([7, 12, 2])
    graphs = decode_graphs(model, 3, 40, cuda_graphs=True)
    for r, p in enumerate(prompts):
        graphs.slots.put(r, _prefilled(model, p))
    g = torch.Generator().manual_seed(3)
    J = 4
    for keep in ([1, 3, 4], [4, 1, 2], [2, 2, 1]):
        ids = torch.randint(0, 256, (3, J), generator=g)
        logits, _ = graphs.forward(ids, history=True)
        for r, p in enumerate(prompts):  # the verify logits are the row's own
            ref = model(torch.tensor([p + ids[r].tolist()])).logits[0, -J:]
            torch.testing.assert_close(logits[r], ref, atol=1e-10, rtol=0)
        graphs.rewind(keep)
        prompts = [
            p + ids[r, :k].tolist() for r, (p, k) in enumerate(zip(prompts, keep, strict=True))
        ]
    assert graphs.slots.host_len[:3] == [len(p) for p in prompts]
    nxt = torch.tensor([[5], [6], [7]])
    logits, _ = graphs.forward(nxt)
    for r, p in enumerate(prompts):
        ref = model(torch.tensor([p + [5 + r]])).logits[0, -1]
        torch.testing.assert_close(logits[r, -1], ref, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="history=True"):
        graphs.rewind([1, 1, 1])


@pytest.mark.parametrize("ssm_precision", ["fp16", "int16-block"])
def test_stored_ssm_precisions_match_the_dynamic_cache(ssm_precision):
    model = _model("tiny-super")
    prompts = _rows([6, 10])
    refs = [_prefilled(model, p, ssm_precision=ssm_precision) for p in prompts]
    graphs = decode_graphs(model, 2, 32, ssm_precision=ssm_precision, cuda_graphs=True)
    for r, c in enumerate(refs):
        graphs.slots.put(r, c)
    for t in range(4):
        ids = torch.tensor([[t + 1], [t + 7]])
        logits, _ = graphs.forward(ids)
        for r, c in enumerate(refs):
            torch.testing.assert_close(
                logits[r], model(ids[r : r + 1], cache=c).logits[0], atol=1e-10, rtol=0
            )


def test_fp8_kv_cache_in_slots_matches_the_dynamic_cache():
    model = _model("tiny-super").float()
    rows = [{"input_ids": torch.randint(0, 256, (2, 24))}]
    model.kv_cache_quant = calibrate_kv(model, rows)
    codecs = kv_codecs(model, "fp8")
    prompts = _rows([8, 5])
    refs = [_prefilled(model, p, kv_codecs=codecs) for p in prompts]
    graphs = decode_graphs(model, 2, 32, kv_codecs=codecs, cuda_graphs=True)
    for r, c in enumerate(refs):
        graphs.slots.put(r, c)
    assert graphs.slots.layers[model.config.pattern.index("*")]._k[0].dtype == torch.float8_e4m3fn
    for t in range(3):
        ids = torch.tensor([[t + 3], [t + 9]])
        logits, _ = graphs.forward(ids)
        for r, c in enumerate(refs):
            want = model(ids[r : r + 1], cache=c).logits[0]
            torch.testing.assert_close(logits[r], want, atol=1e-5, rtol=1e-5)


def test_slot_errors_and_the_default_choice():
    model = _model("tiny-super")
    assert decode_graphs(model, 2, 16) is None  # the CPU keeps the growing cache by default
    assert decode_graphs(model, 2, 16, cuda_graphs=False) is None
    with pytest.raises(ValueError, match="fp16-sr"):
        decode_graphs(model, 2, 16, ssm_precision="fp16-sr", cuda_graphs=True)
    with pytest.raises(ValueError, match="CPU"):
        DecodeGraphs(model, SlotCache(model, 1, 8), capture=True)
    graphs = decode_graphs(model, 2, 12, cuda_graphs=True)
    graphs.slots.put(0, _prefilled(model, list(range(10))))
    with pytest.raises(ValueError, match="12"):
        graphs.forward(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="do not fit"):
        graphs.forward(torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="fit"):
        graphs.slots.put(1, _prefilled(model, list(range(12))))
    assert SlotCache.planned_nbytes(model, 2, 12) == graphs.slots.nbytes()


def _engine_outputs(model, cuda_graphs, prompts, params):
    eng = Engine(model, ByteTokenizer(), max_batch_size=3, prefix_block=4, cuda_graphs=cuda_graphs)
    outs = eng.generate(prompts, params)
    return [o.token_ids for o in outs], eng


@pytest.mark.parametrize("name", ["tiny-super", "tiny-olmo"])
def test_engine_on_slots_equals_the_growing_cache(name):
    """Continuous batching (more prompts than rows), sampled and greedy rows, and speculative
    rows (MTP drafts verified and rewound per row): the same tokens on slots as without."""
    model = _model(name, window=5 if name == "tiny-olmo" else None)
    prompts = _rows([5, 11, 3, 8, 13])
    params = [
        SamplingParams(max_tokens=9, temperature=0.0),
        SamplingParams(max_tokens=6, temperature=0.8, seed=4),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.0, top_k=20, seed=5),
        SamplingParams(max_tokens=10, temperature=0.0),
    ]
    if model.mtp is not None:  # greedy drafts (one captured call on CUDA) and sampled ones
        params[0].speculative = 3
        params[4].speculative = 2
        params[1].speculative = 2
    want, _ = _engine_outputs(model, False, prompts, params)
    got, eng = _engine_outputs(model, True, prompts, params)
    assert got == want
    assert eng._cache is None and eng._graphs.stats["eager"] > 0
    if model.mtp is not None:
        assert eng.stats["verify_steps"] > 0 and eng._mtp_graphs.stats["eager"] > 0


def test_speculative_rows_on_slots_with_a_draft_vocab_pauses_and_one_token_prompts():
    """Speculative rows over slots (backbone and MTP caches): a draft vocabulary, one-token
    prompts (an MTP cache with no position yet), and speculation paused above
    `spec_max_batch` (queued MTP inputs consumed on the slots): still the plain greedy tokens."""
    from hybridlm.infer.speculative import DraftVocab

    model = _model("tiny-super")
    prompts = [[5], *_rows([9, 3, 12], seed=2)]
    lengths, ks = [10, 16, 5, 16], [2, 3, 0, 2]
    refs = [
        Engine(model, ByteTokenizer()).generate([p], SamplingParams(max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, lengths, strict=True)
    ]
    dv = DraftVocab(model, range(0, 300, 2))
    eng = Engine(
        model, ByteTokenizer(), max_batch_size=4, spec_max_batch=2, draft_vocab=dv, cuda_graphs=True
    )
    eng.mtp_queue_limit = 2
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, speculative=k)
        for n, k in zip(lengths, ks, strict=True)
    ]
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r[0].token_ids for r in refs]
    st = eng.stats
    assert 0 < st["verify_steps"] < st["decode_steps"], st
    assert not any(eng._mtp_graphs.slots.active_R.tolist())  # every row left


def test_generate_reuses_its_slots_and_frees_them_with_the_model():
    import gc
    import weakref

    from hybridlm.infer.generate import generate
    from hybridlm.infer.graphs import _KEPT

    model = _model("tiny-super")
    ids = torch.randint(0, 256, (2, 7))
    a = generate(model, ids, 5, cuda_graphs=True)
    (graphs,) = _KEPT[model].values()
    b = generate(model, ids[:, :5], 9, cuda_graphs=True)  # same rows, same column bucket
    assert list(_KEPT[model].values()) == [graphs] and torch.equal(a, generate(model, ids, 5))
    assert torch.equal(b, generate(model, ids[:, :5], 9))
    ref = weakref.ref(model)
    del model, graphs
    gc.collect()
    assert ref() is None  # the kept graphs did not keep the model alive


def test_what_blocks_capture_and_eager_calls_never_replay(monkeypatch):
    from hybridlm.infer.graphs import capture_blocker

    monkeypatch.setenv("HYBRIDLM_FUSED", "1")  # the Triton kernels interpreted on the CPU
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in PRESETS:
        assert capture_blocker(_model(name).float()) is None, name

    class Converted(torch.nn.Module):  # what a quantisation from outside swaps in
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    model = _model("tiny-super").float()
    model.lm_head = Converted(model.lm_head)
    assert "Converted" in capture_blocker(model)
    monkeypatch.setenv("HYBRIDLM_FUSED", "0")
    assert "Triton" in capture_blocker(_model("tiny-super").float())
    assert capture_blocker(_model("tiny-olmo").float()) is None  # no routed experts

    # a key captured for greedy drafts is not replayed by a call that must run eagerly
    graphs = decode_graphs(_model("tiny-super"), 1, 8, cuda_graphs=True)
    calls = []

    class Replayed:
        def replay(self):
            calls.append("replayed")

    graphs._graphs["k"] = (Replayed(), (torch.zeros(1),), ("static",))
    assert graphs.run("k", (1, 8), lambda x: ("eager",), (torch.ones(1),)) == ("static",)
    out = graphs.run("k", (1, 8), lambda x: ("eager",), (torch.ones(1),), capture=False)
    assert out == ("eager",) and calls == ["replayed"]
