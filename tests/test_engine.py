"""Padded batches, continuous batching, prefix reuse, sampling and stop conditions: every row and
request gets exactly what it would get alone."""

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.engine import Engine
from hybridlm.infer.generate import generate, left_align
from hybridlm.infer.sampling import SamplingParams, filtered_probs
from hybridlm.model.cache import HybridCache
from hybridlm.presets import get_preset

PRESETS = ["tiny-super", "tiny-lightning", "tiny-olmo"]


def _model(name: str, seed: int = 0) -> HybridLM:
    cfg = get_preset(name)
    cfg.vocab_size = 300
    if cfg.mamba is not None and "M" in cfg.pattern:
        cfg.mamba.chunk_size = 8  # prompts span several chunks
    if name == "tiny-olmo":
        cfg.attention.sliding_window = 6  # windows bind inside the prompts
    # fp64: batched and single-row forwards agree far below any argmax margin
    return HybridLM(cfg, seed=seed).double().eval()


def _prompts(n_tokens: list[int], seed: int = 0, prefix: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(0, 256, (n,), generator=g).tolist() for n in n_tokens]


def _padded(prompts, side):
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        s = side if side != "mixed" else ("left" if i % 2 else "right")
        sl = slice(L - len(p), L) if s == "left" else slice(0, len(p))
        ids[i, sl] = torch.tensor(p)
        mask[i, sl] = 1
    return ids, mask


@pytest.mark.parametrize("name", PRESETS)
def test_padded_forward_equals_each_row_alone(name):
    model = _model(name)
    prompts = _prompts([13, 4, 1, 20])
    ids, mask = left_align(*_padded(prompts, "right"))
    cache = HybridCache.for_pattern(model.config.pattern)
    logits = model(ids, attention_mask=mask, cache=cache).logits
    step = model(torch.tensor([[7]] * 4), cache=cache).logits[:, -1]
    for i, p in enumerate(prompts):
        c1 = HybridCache.for_pattern(model.config.pattern)
        ref = model(torch.tensor([p]), cache=c1).logits[0]
        torch.testing.assert_close(logits[i, -len(p) :], ref, atol=1e-10, rtol=0)
        ref_step = model(torch.tensor([[7]]), cache=c1).logits[0, -1]
        torch.testing.assert_close(step[i], ref_step, atol=1e-10, rtol=0)


def _check_padded_generate(name, side):
    model = _model(name)
    prompts = _prompts([5, 17, 1, 9])
    ids, mask = _padded(prompts, side)
    out = generate(model, ids, 6, attention_mask=mask)
    for i, p in enumerate(prompts):
        assert torch.equal(out[i : i + 1], generate(model, torch.tensor([p]), 6)), (side, i)


@pytest.mark.parametrize("name", PRESETS)
def test_padded_generate_equals_each_prompt_alone(name):
    _check_padded_generate(name, "mixed")  # rows padded on the left and on the right


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_generate_one_side(name, side):
    _check_padded_generate(name, side)


def test_left_align_and_bad_mask():
    ids = torch.tensor([[1, 2, 0], [0, 3, 4]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    out, m = left_align(ids, mask)
    assert out.tolist() == [[0, 1, 2], [0, 3, 4]] and m.tolist() == [[0, 1, 1], [0, 1, 1]]
    with pytest.raises(ValueError, match="at least one token"):
        left_align(ids, torch.tensor([[0, 0, 0], [1, 1, 1]]))


@pytest.mark.parametrize("name", PRESETS)
def test_continuous_batching_with_prefix_reuse_equals_greedy(name):
    """Requests of different lengths join and leave a batch of at most 3; half share a 20-token
    prefix, so later ones start from a kept prefix cache. Each equals plain greedy alone."""
    model = _model(name)
    shared = _prompts([20], seed=1)[0]
    prompts = _prompts([3, 30, 1, 11], prefix=shared) + _prompts([6, 25], seed=2)
    max_tokens = [5, 12, 3, 9, 14, 6]
    eng = Engine(model, ByteTokenizer(), max_batch_size=3, prefix_block=8)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = eng.generate(prompts, params)
    for p, o, n in zip(prompts, outs, max_tokens, strict=True):
        assert o.token_ids == generate(model, torch.tensor([p]), n)[0].tolist()
        assert o.finish_reason == "length" and o.finished
    assert eng.stats["max_running"] == 3
    assert eng.stats["prefix_hit_tokens"] >= 3 * 16  # three requests reused >= 16 prefix tokens
    assert not eng.has_unfinished()


def test_prefix_cache_entry_equals_full_prefill():
    model = _model("tiny-super")
    prompt = _prompts([40])[0]
    eng = Engine(model, ByteTokenizer(), prefix_block=16)
    cache, logits, _, _ = eng._prefill(prompt)
    assert eng.stats["prefix_hit_tokens"] == 0
    cache2, logits2, _, _ = eng._prefill(prompt[:32] + [5, 6, 7])
    assert eng.stats["prefix_hit_tokens"] == 32
    ref = model(torch.tensor([prompt[:32] + [5, 6, 7]])).logits[0, -1]
    torch.testing.assert_close(logits2, ref, atol=1e-10, rtol=0)
    # the first request's cache is untouched by the fork
    nxt = model(torch.tensor([[9]]), cache=cache).logits[0, -1]
    torch.testing.assert_close(nxt, model(torch.tensor([prompt + [9]])).logits[0, -1])


def test_prefix_cache_keeps_the_mtp_cache_for_speculative_prefills():
    """A speculative prefill runs the MTP module over the prompt as it goes and keeps its cache
    in the prefix entries; entries kept by plain prefills do not serve it (no MTP part), and a
    hit continues exactly as an MTP pass over the whole prompt's hidden states."""
    from hybridlm.infer.speculative import MTPDrafter

    model = _model("tiny-super")
    prompt = _prompts([40])[0]
    eng = Engine(model, ByteTokenizer(), prefix_block=16)
    eng._prefill(prompt)  # plain: entries without the MTP part
    d1 = MTPDrafter(model)
    eng._prefill(prompt, drafter=d1)
    assert eng.stats["prefix_hit_tokens"] == 0  # the plain entries could not serve it
    eng._prefill(prompt)  # plain again: hits, and keeps the entries that have the MTP part
    assert eng.stats["prefix_hit_tokens"] == 32
    short = prompt[:32] + [5, 6, 7]
    d2 = MTPDrafter(model)
    _, _, _, h_11D = eng._prefill(short, drafter=d2)
    assert eng.stats["prefix_hit_tokens"] == 64 and d2.cache.seen_tokens == len(short) - 1
    full = model(torch.tensor([short]), return_hidden=True).hidden
    torch.testing.assert_close(h_11D, full[:, -1:], atol=1e-10, rtol=0)
    ref = MTPDrafter(model)
    ref.feed(full[:, :-1], torch.tensor([short[1:]]))
    ref.consume()
    for got, want in zip(d2.cache.layers, ref.cache.layers, strict=True):
        if got is not None:
            torch.testing.assert_close(got.k_BKSE, want.k_BKSE, atol=1e-10, rtol=0)
            torch.testing.assert_close(got.v_BKSE, want.v_BKSE, atol=1e-10, rtol=0)


def test_sampling_is_per_request_and_reproducible():
    """A request's samples depend on its seed only, not on the batch it shares."""
    model = _model("tiny-lightning")
    prompts = _prompts([4, 9, 2])
    sp = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    together = Engine(model, ByteTokenizer()).generate(prompts, [sp[0], greedy, sp[1]])
    alone = [
        Engine(model, ByteTokenizer()).generate([prompts[i]], [p])[0]
        for i, p in ((0, sp[0]), (2, sp[1]))
    ]
    assert together[0].token_ids == alone[0].token_ids
    assert together[2].token_ids == alone[1].token_ids
    assert together[0].token_ids != together[2].token_ids


def test_filtered_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = filtered_probs(logits, temperature=1.0, top_p=0.8)
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = filtered_probs(logits, temperature=1.0, top_p=0.81)
    assert (p > 0).sum() == 3
    p = filtered_probs(logits, temperature=1.0, top_k=1)
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    hot = filtered_probs(logits, temperature=100.0)
    assert float(hot.max() - hot.min()) < 0.01


def test_stop_strings_eos_and_streaming():
    model = _model("tiny-super")
    tok = ByteTokenizer()
    prompt = _prompts([6])[0]
    free = Engine(model, tok).generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop = free.text[5:8]
    assert len(stop) == 3
    eng = Engine(model, tok)
    rid = eng.add_request(prompt, SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True))
    deltas, final = [], None
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == rid
            deltas.append(out.delta_text)
            final = out
    cut = free.text.find(stop)
    assert final.finish_reason == "stop" and final.text == free.text[:cut]
    assert "".join(deltas) == final.text
    assert tok.decode(final.token_ids).startswith(final.text)
    # include_stop_str_in_output (RL trains on the end-of-turn string): text and tokens keep it
    kept = Engine(model, tok).generate(
        [prompt],
        SamplingParams(
            max_tokens=24, stop=[stop], ignore_eos=True, include_stop_str_in_output=True
        ),
    )[0]
    assert kept.text == free.text[: cut + len(stop)] and kept.finish_reason == "stop"
    assert kept.token_ids == free.token_ids[: len(kept.token_ids)]
    assert tok.decode(kept.token_ids) == kept.text
    # stop token ids: the 4th greedy token ends the request
    out = Engine(model, tok).generate(
        [prompt], SamplingParams(max_tokens=24, stop_token_ids=[free.token_ids[3]])
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:3]


def test_streamed_text_never_splits_a_character():
    model = _model("tiny-lightning")
    eng = Engine(model, ByteTokenizer())
    eng.add_request(_prompts([3])[0], SamplingParams(max_tokens=40, ignore_eos=True))
    text, final = "", None
    while eng.has_unfinished():
        for out in eng.step():
            text += out.delta_text
            final = out
    assert text == final.text == ByteTokenizer().decode(final.token_ids)


def test_abort_max_model_len_and_errors():
    model = _model("tiny-super")
    tok = ByteTokenizer()
    eng = Engine(model, tok, max_model_len=12)
    a = eng.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    b = eng.add_request([4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.abort(a)
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert final[a].finish_reason == "abort"
    assert final[b].finish_reason == "length" and len(final[b].token_ids) == 10
    with pytest.raises(ValueError, match="at most 11 prompt tokens"):
        eng.add_request(list(range(12)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request([1], SamplingParams(max_tokens=-1))
    with pytest.raises(ValueError, match="top_p"):
        eng.add_request([1], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request([1, 999], SamplingParams())
    assert Engine(model, tok).generate([[1, 2]], SamplingParams(max_tokens=0))[0].token_ids == []


@pytest.mark.parametrize("name", ["tiny-super", "tiny-lightning"])
@pytest.mark.parametrize("keep", [1, 3, 5])
def test_rewind_to_a_recorded_position_equals_the_shorter_sequence(name, keep):
    """Speculative rollback without recompute: after a 5-token call with history recording,
    keeping `keep` positions leaves the cache of the prompt + those tokens."""
    model = _model(name)
    prompt = torch.tensor([_prompts([11])[0]])
    seq = torch.tensor([[5, 6, 7, 8, 9]])
    cache = HybridCache.for_pattern(model.config.pattern)
    model(prompt, cache=cache)
    cache.record_history(True)
    model(seq, cache=cache)
    cache.record_history(False)
    cache.rewind(5 - keep)
    assert cache.seen_tokens == 11 + keep
    got = model(torch.tensor([[42]]), cache=cache).logits[0, -1]
    ref = model(torch.cat([prompt, seq[:, :keep], torch.tensor([[42]])], 1)).logits[0, -1]
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)


def _decode_logits(model, prompt, steps=4):
    cache = HybridCache.for_pattern(model.config.pattern)
    with torch.no_grad():
        out = [model(prompt, cache=cache).logits[:, -1]]
        for t in range(steps):
            out.append(model(torch.full((prompt.shape[0], 1), 3 + t), cache=cache).logits[:, -1])
    return torch.stack(out)


def _set_decode_fn(model, fn):
    for module in model.modules():
        if hasattr(module, "decode_fn"):
            module.decode_fn = fn


@pytest.mark.parametrize("name", ["tiny-super", "tiny-lightning", "tiny-super-grouped"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_decode_steps_equal_the_generic_path(name, dtype):
    """`mamba2_decode_step` / `moe_decode_step` (the functions `compile_decode` compiles) ==
    the generic mixer forwards (conv, `ssd_step`, sorted expert dispatch), with group-limited
    routing too."""
    if name.endswith("-grouped"):
        model = _model(name.removesuffix("-grouped"))
        for module in model.modules():
            if hasattr(module, "gate"):
                module.cfg.n_group, module.cfg.topk_group = 4, 2
                module.gate.cfg = module.cfg
        model = model.to(dtype)
    else:
        model = _model(name).to(dtype)
    prompt = torch.tensor(_prompts([7, 7]))
    fused = _decode_logits(model, prompt)
    _set_decode_fn(model, None)
    generic = _decode_logits(model, prompt)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(fused, generic, atol=tol, rtol=0)


class _Doubled(torch.nn.Linear):
    """A stand-in for a converter's module (e.g. fake-quant): not a plain GEMM on `.weight`."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_fused_decode_steps_yield_to_converted_modules():
    """The fused steps read weights directly, so a swapped-in module must turn them off: decoding
    then calls the module, exactly like the generic path."""
    model = _model("tiny-super")
    for module in list(model.modules()):
        for name in ("out_proj", "fc1_latent_proj"):
            old = getattr(module, name, None)
            if type(old) is torch.nn.Linear:
                new = _Doubled(old.in_features, old.out_features, bias=False).double()
                new.weight = old.weight
                setattr(module, name, new)
    prompt = torch.tensor(_prompts([7]))
    converted = _decode_logits(model, prompt)
    _set_decode_fn(model, None)
    torch.testing.assert_close(converted, _decode_logits(model, prompt), atol=1e-12, rtol=0)


@pytest.mark.slow
def test_compiled_decode_equals_eager():
    model = _model("tiny-super").float()
    prompt = torch.tensor(_prompts([9]))
    eager = _decode_logits(model, prompt, steps=6)
    model.compile_decode()
    try:
        compiled = _decode_logits(model, prompt, steps=6)
    finally:
        model.compile_decode(False)
    torch.testing.assert_close(compiled, eager, atol=2e-5, rtol=0)


def _teacher_forced_logprobs(model, prompt, out, temperature):
    ids = torch.tensor([prompt + out.token_ids + [out.stop_token_id]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_the_trainers_recomputation(temperature):
    """The rollout log-probs (RL's behaviour policy) equal a teacher-forced forward over the
    whole sequence, the EOS token that ended the request included."""
    model = _model("tiny-super").float()
    eng = Engine(model, ByteTokenizer(), max_batch_size=4)
    prompts = _prompts([6, 9, 4])
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=3, logprobs=True)
    # the 5th token of the first row becomes a stop token, so that row ends on it
    params.stop_token_ids = [eng.generate(prompts[:1], params)[0].token_ids[4]]
    outs = eng.generate(prompts, params)
    assert outs[0].finish_reason == "stop" and outs[0].stop_token_id is not None
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.logprobs) == len(out.token_ids) == len(out.token_versions)
        got = out.logprobs + ([out.stop_token_logprob] if out.stop_token_id is not None else [])
        if out.stop_token_id is None:
            out.stop_token_id = 0  # a dummy next token; its log-prob is not compared
        ref = _teacher_forced_logprobs(model, prompt, out, temperature)[: len(got)]
        torch.testing.assert_close(torch.tensor(got), ref, atol=2e-5, rtol=0)
    plain = eng.generate(prompts[:1], SamplingParams(max_tokens=4))[0]
    assert plain.logprobs is None


def test_update_weights_in_flight_tags_tokens_and_drops_stale_prefixes():
    model, other = _model("tiny-super"), _model("tiny-super", seed=1)
    eng = Engine(model, ByteTokenizer(), max_batch_size=2, prefix_block=4)
    prompt = _prompts([9])[0]
    rid = eng.add_request(prompt, SamplingParams(max_tokens=6))
    outs = [o for _ in range(3) for o in eng.step() if o.request_id == rid]
    n_old = len(outs[-1].token_ids)  # sampled with version 0
    assert eng.update_weights(other.state_dict()) == 1
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    assert 0 < n_old < 6 and outs[-1].token_versions == [0] * n_old + [1] * (6 - n_old)
    # the prefix cache held the old weights' states: a new request must match a fresh engine
    fresh = Engine(other, ByteTokenizer(), prefix_block=4).generate([prompt], SamplingParams())
    again = eng.generate([prompt], SamplingParams())
    assert again[0].token_ids == fresh[0].token_ids and again[0].token_versions == [1] * 64
    with pytest.raises(ValueError, match="older"):
        eng.update_weights(other.state_dict(), version=0)
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(logprobs=True, speculative=2).validate()


def test_speculative_requests_with_a_draft_vocab_and_weight_updates():
    """`Engine(draft_vocab=)`: speculative requests draft from its ids and still emit the plain
    greedy tokens; `update_weights` re-gathers its LM-head rows (in place, so decoders in
    flight draft with the new head)."""
    from hybridlm.infer.speculative import DraftVocab

    model = _model("tiny-super")
    prompts = _prompts([5, 11])
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = Engine(model, ByteTokenizer()).generate(prompts, [greedy, greedy])
    dv = DraftVocab(model, range(0, 300, 2))
    eng = Engine(model, ByteTokenizer(), draft_vocab=dv)
    spec = SamplingParams(max_tokens=10, ignore_eos=True, speculative=3)
    out = eng.generate(prompts, [spec, spec])
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert all(o.spec_stats.steps >= 1 for o in out)
    other = _model("tiny-super", seed=1)
    eng.update_weights(other.state_dict())
    assert torch.equal(dv.head.weight, other.lm_head.weight[dv.ids_N])


def _windowed_super(window: int = 3) -> HybridLM:
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.mamba.chunk_size = 300, 8
    cfg.attention.sliding_window = window
    cfg.attention.window_pattern = "S" * cfg.pattern.count("*")
    return HybridLM(cfg, seed=0).double().eval()


@pytest.mark.parametrize(
    "name,compact",
    [
        ("tiny-super", False),
        ("tiny-super", True),
        ("tiny-lightning", False),
        ("sliding-window", True),  # windows count columns: only exact once compacted
    ],
)
def test_rewind_rows_keeps_each_rows_prefix(name, compact):
    """A batch whose rows verified different numbers of tokens in one call: after
    `rewind_rows` (and `compact`, which closes the holes it leaves) each row continues exactly
    as its prompt + kept tokens alone."""
    model = _windowed_super() if name == "sliding-window" else _model(name)
    prompts = _prompts([11, 4, 7])
    caches = []
    for p in prompts:
        caches.append(HybridCache.for_pattern(model.config.pattern))
        model(torch.tensor([p]), cache=caches[-1])
    cache = HybridCache.cat(caches)
    seq = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    keep = torch.tensor([4, 1, 2])  # the longest row keeps all: only the others have holes
    cache.record_history(True)
    model(seq, cache=cache)
    cache.record_history(False)
    cache.rewind_rows(keep, 4)
    lengths = [len(p) + k for p, k in zip(prompts, keep.tolist(), strict=True)]
    assert cache.positions_B.tolist() == lengths
    if compact:
        cache.compact()
        assert cache.seen_tokens == max(lengths)
    for _ in range(2):  # the step after, and one after that (holes stay masked)
        got = model(torch.tensor([[42], [43], [44]]), cache=cache).logits[:, -1]
    for i, (p, k) in enumerate(zip(prompts, keep.tolist(), strict=True)):
        ids = torch.tensor([p + seq[i, :k].tolist() + [42 + i, 42 + i]])
        torch.testing.assert_close(got[i], model(ids).logits[0, -1], atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="keep one count"):
        cache.rewind_rows(torch.tensor([0, 1, 1]), 1)


def _oracle_drafts(monkeypatch, refs: dict[tuple[int, ...], list[int]]):
    """Let speculative rows draft the true greedy continuation (`refs`: prompt -> tokens) with
    a wrong token at a varying position, so that rows accept 0..k drafts. The batched MTP
    drafter still runs; only its tokens are replaced. Returns the accepted counts planned."""
    from hybridlm.infer import engine as engine_mod

    real, seen = engine_mod.draft_batch, []

    def draft_batch(decoders, cache, limits=None):
        out = []
        for dec, (drafts, q) in zip(decoders, real(decoders, cache, limits), strict=True):
            ref = refs[tuple(dec.prompt_BL[0].tolist())]
            n = len(dec.tokens)
            wrong = (n * 7 + len(ref) + len(dec.prompt_BL[0])) % (len(drafts) + 2)
            true = (ref + [0] * 32)[n : n + len(drafts)]
            out.append(([(t + 1) % 256 if j == wrong else t for j, t in enumerate(true)], q))
            seen.append(min(wrong, len(drafts)))
        return out

    monkeypatch.setattr(engine_mod, "draft_batch", draft_batch)
    return seen


@pytest.mark.parametrize("windowed", [False, True], ids=["full", "sliding-window"])
def test_speculative_rows_join_the_batch_and_the_prefix_cache(monkeypatch, windowed):
    """Speculative requests of different draft lengths share the running batch with plain
    requests (one verify forward per step) and the prefix cache (their prefill keeps and
    reuses the MTP cache too); each emits exactly its plain greedy tokens whatever it accepts.
    With a sliding window the batch is compacted every step (windows count columns)."""
    model = _windowed_super(6) if windowed else _model("tiny-super")
    prefix = _prompts([9], seed=1)[0]
    prompts = _prompts([3, 12, 1, 7, 20, 5], prefix=prefix)
    greedy = SamplingParams(max_tokens=14, ignore_eos=True)
    refs = {}
    for p in prompts:
        refs[tuple(p)] = (
            Engine(model, ByteTokenizer(), prefix_cache_size=0).generate([p], greedy)[0].token_ids
        )
    accepted = _oracle_drafts(monkeypatch, refs)
    compacted = []
    real_compact = HybridCache.compact
    monkeypatch.setattr(HybridCache, "compact", lambda c: compacted.append(1) or real_compact(c))
    eng = Engine(model, ByteTokenizer(), max_batch_size=4, prefix_block=4)
    ks = [3, 0, 5, 1, 0, 2]
    params = [SamplingParams(max_tokens=14, ignore_eos=True, speculative=k) for k in ks]
    outs = eng.generate(prompts, params)
    for out, p, k in zip(outs, prompts, ks, strict=True):
        assert out.token_ids == refs[tuple(p)], k
        assert (out.spec_stats is not None) == (k > 0)
    assert set(accepted) >= {0, 1, 2, 3}  # rejections at several positions and full accepts
    assert sum(o.spec_stats.steps for o in outs if o.spec_stats) < 13 * 4  # it paid
    assert eng.stats["verify_steps"] > 0 and eng.stats["max_running"] == 4
    assert eng.stats["prefix_hit_tokens"] >= 8 * 3  # later prompts reuse the shared prefix
    assert compacted if windowed else True
    # a later speculative request hits the entries its predecessors kept, MTP cache included
    again = eng.generate([prompts[0]], params[0])[0]
    assert again.token_ids == refs[tuple(prompts[0])]


class _SmallTokenizer:
    """Token ids 0..11 as text, EOS 11: for a model with a 12-token vocabulary."""

    vocab_size, eos_id = 12, 11

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


@pytest.mark.parametrize("compact_slack", [64, 0], ids=["holes", "compacted"])
def test_sampled_speculative_rows_equal_the_decoder_alone(compact_slack):
    """Sampled speculative requests in a batch (with plain requests beside them) draw from
    their own seeded generators in the decoder's order, so each equals `SpeculativeDecoder`
    alone with the same seed token for token; that decoder's output distribution is the
    target's (test_speculative_sampling), so the batched one is too."""
    from hybridlm.infer.speculative import SpeculativeDecoder
    from test_speculative_sampling import PROMPT, _small_model

    model = _small_model()
    filt = dict(temperature=0.7, top_k=6, top_p=0.95)
    eng = Engine(model, _SmallTokenizer(), max_batch_size=6, prefix_block=2)
    eng.compact_slack = compact_slack  # 0: the caches are compacted after every step
    n = 24
    params = [
        SamplingParams(max_tokens=9, ignore_eos=True, seed=s, speculative=1 + s % 4, **filt)
        if s % 3
        else SamplingParams(max_tokens=9, ignore_eos=True, seed=s, **filt)
        for s in range(n)
    ]
    prompts = [(PROMPT + [s % 5] * (s % 3))[: 1 + s % 7] for s in range(n)]  # 1-token ones too
    outs = eng.generate(prompts, params)
    steps = 0
    for p, sp, out in zip(prompts, params, outs, strict=True):
        if not sp.speculative:
            continue
        dec = SpeculativeDecoder(
            model, p, draft_len=sp.speculative, max_new_tokens=9, seed=sp.seed, **filt
        )
        while not dec.finished:
            dec.step()
        assert out.token_ids == dec.tokens
        assert out.spec_stats.to_dict() == dec.stats.to_dict()
        steps += dec.stats.steps
    assert steps < 16 * 9 and eng.stats["verify_steps"] > 0


def test_speculation_pauses_above_spec_max_batch(monkeypatch):
    """`spec_max_batch=2`: while more than 2 requests run, speculative rows decode one token
    per step like plain ones (their MTP inputs queued, and run once `mtp_queue_limit` pile up),
    and speculate again once the batch shrinks; every output is still plain greedy."""
    model = _model("tiny-super")
    prompts = _prompts([5, 9, 3, 12], seed=2)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    refs = {}
    for p in prompts:
        refs[tuple(p)] = Engine(model, ByteTokenizer()).generate([p], greedy)[0].token_ids
    _oracle_drafts(monkeypatch, refs)
    from hybridlm.infer import engine as engine_mod

    consumed = []
    real_consume = engine_mod.consume_batch
    monkeypatch.setattr(
        engine_mod, "consume_batch", lambda d, c: consumed.append(len(d)) or real_consume(d, c)
    )
    eng = Engine(model, ByteTokenizer(), max_batch_size=4, spec_max_batch=2)
    eng.mtp_queue_limit = 2
    ks, lengths = [3, 0, 2, 0], [16, 5, 16, 7]
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, speculative=k)
        for k, n in zip(ks, lengths, strict=True)
    ]
    outs = eng.generate(prompts, params)
    for out, p, n in zip(outs, prompts, lengths, strict=True):
        assert out.token_ids == refs[tuple(p)][:n]
    st = eng.stats
    assert 0 < st["verify_steps"] < st["decode_steps"] and consumed, (st, consumed)
    assert all(o.spec_stats.steps > 0 for o, k in zip(outs, ks, strict=True) if k)
    with pytest.raises(ValueError, match="spec_max_batch"):
        Engine(model, ByteTokenizer(), spec_max_batch=0)


def test_speculative_one_token_prompts_admitted_together():
    """Speculative requests whose prompts are one token (an MTP cache with no positions yet)
    join the batch in the same step: each is a row of the batched MTP cache."""
    model = _model("tiny-super")
    prompts = [[5], [7], [9], [11, 12]]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    refs = [Engine(model, ByteTokenizer()).generate([p], greedy)[0].token_ids for p in prompts]
    eng = Engine(model, ByteTokenizer(), max_batch_size=4)
    spec = SamplingParams(max_tokens=6, ignore_eos=True, speculative=2)
    outs = eng.generate(prompts, spec)
    assert [o.token_ids for o in outs] == refs and eng.stats["verify_steps"] > 0
    empty = [HybridCache.for_pattern(model.config.mtp.pattern) for _ in range(3)]
    both = HybridCache.cat([HybridCache.cat(empty[:2]), empty[2]])
    assert both.batch_size() == 3 and both.positions_B.tolist() == [0, 0, 0]
