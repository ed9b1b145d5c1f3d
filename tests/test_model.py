"""HybridLM behaviour: init, losses, causality, MTP alignment, MoE routing and balancing, caches."""

import pytest
import torch

from hybridlm import HybridLM, ModelConfig, MoEConfig, MTPConfig
from hybridlm.interop.hf import save_pretrained
from hybridlm.io import load_model
from hybridlm.model.cache import HybridCache
from hybridlm.model.moe import AuxSink, MoE, _experts_grouped, _experts_loop
from hybridlm.presets import PRESETS, get_preset
from hybridlm.train.objectives import causal_lm_loss

TINY = sorted(n for n in PRESETS if n.startswith("tiny-"))


def _small(name: str) -> ModelConfig:
    """The tiny preset, narrowed further so each test runs in well under a second."""
    cfg = get_preset(name)
    cfg.vocab_size = 300
    return cfg


def _ids(cfg, B=2, L=29, seed=0):
    return torch.randint(0, cfg.vocab_size, (B, L), generator=torch.Generator().manual_seed(seed))


def test_meta_build_then_init_equals_direct_build():
    cfg = _small("tiny-super")
    direct = HybridLM(cfg, seed=3)
    with torch.device("meta"):
        lazy = HybridLM(cfg)
    assert all(p.device.type == "meta" for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.init_weights(seed=3)
    for (n, a), b in zip(direct.state_dict().items(), lazy.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("tied", [False, True])
def test_build_paths_agree_tie_and_compute_buffers(tied):
    """`build_model`, `HybridLM.empty` + a copy and `HybridLM.from_state_dict` (assigned) give
    the directly built model: same logits, a tied head that is the embedding, and the RoPE
    buffers a meta build lacks recomputed."""
    from hybridlm.model.model import build_model

    cfg = _small("tiny-olmo")  # RoPE attention: non-persistent frequency buffers
    cfg.tie_embeddings = tied
    direct = HybridLM(cfg, seed=3).eval()
    x = _ids(cfg)
    with torch.no_grad():
        ref = direct(x).logits
    empty = HybridLM.empty(cfg)
    empty.load_state_dict(direct.state_dict())
    # a tied head is absent from a transformers checkpoint's tensors
    state = {k: v.clone() for k, v in direct.state_dict().items()}
    if tied:
        del state["lm_head.weight"]
    built = {
        "build_model": build_model(cfg, seed=3, device="cpu"),
        "empty": empty,
        "from_state_dict": HybridLM.from_state_dict(cfg, state),
    }
    for name, model in built.items():
        assert (model.lm_head.weight is model.embeddings.weight) == tied, name
        for (key, a), b in zip(direct.named_buffers(), model.buffers(), strict=True):
            assert torch.equal(a, b), (name, key)
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(x).logits, ref, atol=0, rtol=0, msg=name)


def test_from_state_dict_names_what_does_not_match():
    cfg = _small("tiny-super")
    state = HybridLM(cfg, seed=0).state_dict()
    norm = state.pop("norm_f.weight")
    with pytest.raises(ValueError, match=r"checkpoint X does not match .*missing \['norm_f"):
        HybridLM.from_state_dict(cfg, state, what="checkpoint X")
    partial = HybridLM.from_state_dict(cfg, state, missing_ok={"norm_f.weight"})
    assert partial.norm_f.weight.is_meta  # left for the caller to fill
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        HybridLM.from_state_dict(cfg, {**state, "norm_f.weight": norm, "extra": norm})


def test_init_laws():
    cfg = _small("tiny-super")
    model = HybridLM(cfg, seed=0)
    mamba = model.layers[0].mixer
    A = torch.exp(mamba.A_log)
    assert A.min() >= 1 and A.max() <= 16
    dt = torch.nn.functional.softplus(mamba.dt_bias)
    assert dt.min() >= cfg.mamba.dt_init_floor * 0.999 and dt.max() <= cfg.mamba.dt_max * 1.001
    assert torch.equal(mamba.D, torch.ones_like(mamba.D))
    out_std = cfg.init_std / (2 * len(cfg.pattern)) ** 0.5
    assert abs(mamba.out_proj.weight.std().item() - out_std) / out_std < 0.1


@pytest.mark.parametrize("name", TINY)
def test_loss_parts_and_backward(name):
    cfg = _small(name)
    model = HybridLM(cfg, seed=0)
    x = _ids(cfg)
    out = model(x, mtp_depth=model.train_mtp_depth)
    assert not hasattr(out, "loss") and not hasattr(out, "losses")  # the model returns values
    loss, parts = causal_lm_loss(model, out, x)
    expected = parts["ce"]
    if "mtp" in parts:
        assert len(out.mtp_logits) == cfg.mtp.depth
        expected = expected + cfg.mtp.loss_weight * parts["mtp"]
    if "moe_aux" in parts:
        expected = expected + parts["moe_aux"]
    torch.testing.assert_close(loss, expected)
    assert abs(parts["ce"].item() - torch.log(torch.tensor(300.0)).item()) < 0.5  # uniform init
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


@pytest.mark.parametrize("name", TINY)
def test_causality(name):
    cfg = _small(name)
    model = HybridLM(cfg, seed=0).eval()
    x = _ids(cfg, L=20)
    y = x.clone()
    y[:, 13] = (y[:, 13] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x, mtp_depth=model.train_mtp_depth), model(y, mtp_depth=model.train_mtp_depth)
    # (not bit-exact: expert GEMMs see other token counts and may round differently)
    torch.testing.assert_close(a.logits[:, :13], b.logits[:, :13], rtol=0, atol=1e-6)
    assert not torch.allclose(a.logits[:, 13:], b.logits[:, 13:])
    for k, (ma, mb) in enumerate(zip(a.mtp_logits, b.mtp_logits, strict=True), start=1):
        # depth k at position t reads tokens <= t + k, so positions < 13 - k are untouched
        torch.testing.assert_close(ma[:, : 13 - k], mb[:, : 13 - k], rtol=0, atol=1e-6)
        assert not torch.allclose(ma[:, 13 - k], mb[:, 13 - k])


def test_global_token_normalisation_makes_accumulation_exact():
    cfg = _small("tiny-lightning")
    cfg.moe.aux_loss_coef = 0.0
    model = HybridLM(cfg, seed=0)
    x = _ids(cfg, B=4)
    labels = x.clone()
    labels[0, :10] = -100

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    def lm(x, labels, **kw):
        return causal_lm_loss(model, model(x, mtp_depth=model.train_mtp_depth), labels, **kw)

    total, full = lm(x, labels)
    g_full = grads(total)
    n = (labels[:, 1:] != -100).sum()  # the global count of CE targets
    parts = [lm(x[i : i + 2], labels[i : i + 2], num_valid_tokens=n)[1] for i in (0, 2)]
    # with one global denominator the micro-batch CE parts add up to the full-batch CE, and so do
    # their gradients (a per-micro-batch mean would weight the masked row's tokens differently)
    acc = sum(p["ce"] for p in parts)
    torch.testing.assert_close(acc, full["ce"])
    g_acc = grads(acc)
    g_ce = grads(lm(x, labels)[1]["ce"])
    assert len(g_acc) == len(g_ce) and len(g_full) > len(g_ce)  # the total also trains MTP
    for a, b in zip(g_acc, g_ce, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _naive_moe(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Token-by-token reading of SPEC §1 LatentMoE, independent of the sorted dispatch."""
    c = moe.cfg
    out = []
    for x in x_TD:
        s = torch.sigmoid(moe.gate.weight.float() @ x.float())
        idx = torch.topk(s + moe.gate.e_score_correction_bias, c.top_k).indices
        g = s[idx] / s[idx].sum() * c.routed_scaling_factor
        z = moe.fc1_latent_proj(x) if c.latent_size else x
        y = sum(
            g[j] * (torch.relu(moe.experts.up_proj[e] @ z) ** 2 @ moe.experts.down_proj[e].T)
            for j, e in enumerate(idx.tolist())
        )
        y = moe.fc2_latent_proj(y) if c.latent_size else y
        out.append(y + moe.shared_experts(x))
    return torch.stack(out)


@pytest.mark.parametrize("latent", [None, 16])
def test_moe_dispatch_equals_naive_reference(latent):
    cfg = ModelConfig(
        d_model=32,
        pattern="E",
        moe=MoEConfig(
            num_experts=6,
            top_k=3,
            expert_hidden=24,
            shared_expert_hidden=40,
            latent_size=latent,
            routed_scaling_factor=2.5,
        ),
    )
    model = HybridLM(cfg, seed=0)
    moe = model.layers[0].mixer
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.randn(6) * 0.2)
        x = torch.randn(2, 11, 32)
        torch.testing.assert_close(
            moe(x).reshape(-1, 32), _naive_moe(moe, x.reshape(-1, 32)), rtol=1e-5, atol=1e-6
        )


def test_grouped_mm_path_equals_loop():
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("torch has no grouped_mm")
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1]
    z = torch.randn(9, 8, generator=g)
    up, down = torch.randn(4, 12, 8, generator=g), torch.randn(4, 8, 12, generator=g)
    try:
        fast = _experts_grouped(z, counts, up, down)
    except RuntimeError as err:  # some CPU builds lack the kernel
        pytest.skip(f"grouped_mm unavailable here: {err}")
    torch.testing.assert_close(fast, _experts_loop(z, counts, up, down), rtol=1e-5, atol=1e-5)


def test_correction_bias_steers_selection_not_weights():
    cfg = ModelConfig(
        d_model=16, pattern="E", moe=MoEConfig(num_experts=4, top_k=1, shared_expert_hidden=8)
    )
    router = HybridLM(cfg, seed=0).layers[0].mixer.gate
    x = torch.randn(5, 16)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.tensor([10.0, 0, 0, 0]))
        scores, idx, w = router(x)
    assert torch.all(idx[:, 0] == 0)  # the bias forces expert 0 ...
    torch.testing.assert_close(w[:, 0], torch.ones(5))  # ... but the gate is the renormalised score


def test_aux_loss_free_bias_update_and_load():
    cfg = _small("tiny-lightning")
    model = HybridLM(cfg, seed=0)
    x = _ids(cfg, B=4, L=64)
    model(x, mtp_depth=1)  # one MTP pass: its MoE layer sees every token once too
    load = model.expert_load()
    assert load.shape == (len(model.moe_layers()), cfg.moe.num_experts)
    assert torch.all(load.sum(-1) == 4 * 64 * cfg.moe.top_k)
    before = [m.gate.e_score_correction_bias.clone() for m in model.moe_layers()]
    model.update_moe_bias()
    for m, b0, l in zip(model.moe_layers(), before, load, strict=True):
        step = m.gate.e_score_correction_bias - b0
        torch.testing.assert_close(step, cfg.moe.bias_update_rate * torch.sign(l.mean() - l))
    assert model.expert_load().sum() == 0


def test_sequence_aux_loss_formula():
    cfg = ModelConfig(
        d_model=16,
        pattern="E",
        moe=MoEConfig(num_experts=4, top_k=2, aux_loss_coef=0.5, shared_expert_hidden=8),
    )
    model = HybridLM(cfg, seed=0)
    moe = model.layers[0].mixer
    x = torch.randn(3, 7, 16)
    sink = AuxSink()
    moe(x, aux_sink=sink)
    scores, idx, _ = moe.gate(x.reshape(-1, 16))
    p = (scores / scores.sum(-1, keepdim=True)).view(3, 7, 4).mean(1)
    f = torch.nn.functional.one_hot(idx, 4).sum(1).view(3, 7, 4).sum(1).float() * 4 / (2 * 7)
    assert len(sink.terms) == 1
    torch.testing.assert_close(sink.terms[0], 0.5 * (f * p).sum(-1).mean())


@pytest.mark.parametrize("name", TINY)
def test_incremental_decode_equals_full_forward(name):
    cfg = _small(name)
    cfg.mamba.chunk_size = 8
    model = HybridLM(cfg, seed=0).eval()
    x = _ids(cfg, L=27)
    with torch.no_grad():
        full = model(x).logits
        cache = HybridCache.for_pattern(cfg.pattern)
        parts = [model(x[:, :19], cache=cache).logits]
        for t in range(19, 27):
            parts.append(model(x[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-4)


def test_sliding_window_limits_context():
    cfg = _small("tiny-olmo")
    cfg.attention.sliding_window = 4
    cfg.attention.window_pattern = "SSSS"
    cfg.pattern = "*-" * 4
    model = HybridLM(cfg, seed=0).eval()
    x = _ids(cfg, L=30)
    y = x.clone()
    y[:, 2] = (y[:, 2] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    # 4 layers of window 4 see at most 4 * 3 = 12 positions back
    torch.testing.assert_close(a[:, 2 + 13 :], b[:, 2 + 13 :], rtol=0, atol=0)
    assert not torch.allclose(a[:, 2:14], b[:, 2:14])


def test_bf16_autocast_forward_backward():
    cfg = _small("tiny-super")
    model = HybridLM(cfg, seed=0)
    x = _ids(cfg)
    for fused in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, mtp_depth=model.train_mtp_depth, return_logits=not fused)
            loss, _ = causal_lm_loss(model, out, x)
        assert torch.isfinite(loss)
        loss.backward()


def test_routing_is_fp32_under_bf16_autocast():
    """Autocast would run the router's linear in bf16; scores and choices stay those of fp32."""
    cfg = _small("tiny-super")
    router = HybridLM(cfg, seed=0).layers[1].mixer.gate
    x = torch.randn(64, cfg.d_model, generator=torch.Generator().manual_seed(0))
    want = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router(x)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert torch.equal(got[1], want[1])


def test_bad_inputs():
    cfg = _small("tiny-super")
    model = HybridLM(cfg, seed=0)
    with pytest.raises(ValueError, match="batch, seq"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="labels shape"):
        out = model(torch.zeros(1, 5, dtype=torch.long))
        causal_lm_loss(model, out, torch.zeros(1, 4, dtype=torch.long))


def test_mtp_depth_override_and_no_mtp():
    cfg = _small("tiny-super")
    model = HybridLM(cfg, seed=0)
    x = _ids(cfg)
    assert len(model(x, mtp_depth=3).mtp_logits) == 3
    assert "mtp" not in causal_lm_loss(model, model(x), x)[1]
    no_mtp = HybridLM(ModelConfig(pattern="M*", mtp=MTPConfig()), seed=0)
    assert no_mtp.mtp is None


def test_router_stays_fp32_under_bf16_cast(tmp_path):
    cfg = _small("tiny-super")
    model = HybridLM(cfg, seed=0).to(torch.bfloat16)
    gate = model.layers[1].mixer.gate
    assert (
        gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    )
    assert model.layers[0].mixer.in_proj.weight.dtype == torch.bfloat16
    x = _ids(cfg)
    out = model(x, mtp_depth=model.train_mtp_depth)
    loss, _ = causal_lm_loss(model, out, x)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    save_pretrained(model, tmp_path)
    again = load_model(tmp_path)
    assert again.layers[0].mixer.in_proj.weight.dtype == torch.bfloat16
    assert again.layers[1].mixer.gate.weight.dtype == torch.float32


def test_balancing_loss_counts_every_mtp_depth_and_never_goes_stale():
    cfg = _small("tiny-super")
    model = HybridLM(cfg, seed=0)
    x = _ids(cfg)
    n_backbone = cfg.pattern.count("E")
    sink = AuxSink()
    h = model.embeddings(x)
    for block in model.layers:
        h = block(h, positions_L=torch.arange(x.shape[1]), aux_sink=sink)
    assert len(sink.terms) == n_backbone
    out = model(x, mtp_depth=2)
    backbone = sink.total()
    mtp_moe = model.mtp.layers[-1].mixer
    assert mtp_moe.__class__.__name__ == "MoE" and not hasattr(mtp_moe, "aux_losses")
    # the MTP MoE adds one loss per depth on top of the backbone's
    assert out.aux["moe_aux"] > backbone
    again = model(x, mtp_depth=2)  # two calls in a row: no state between them
    torch.testing.assert_close(again.aux["moe_aux"], out.aux["moe_aux"], rtol=0, atol=0)
    no_mtp = model(x)  # no MTP now: only the backbone's terms
    torch.testing.assert_close(no_mtp.aux["moe_aux"], backbone)
    assert not model.eval()(x).aux  # eval: no balancing term


def test_expert_load_counts_training_steps_only():
    cfg = _small("tiny-lightning")
    model = HybridLM(cfg, seed=0).eval()
    model(_ids(cfg))
    assert model.expert_load().sum() == 0


def test_chunked_prefill_equals_one_pass():
    """A prompt fed in pieces (KV appended, Mamba conv/SSM state carried) == one forward."""
    cfg = _small("tiny-super")
    cfg.mamba.chunk_size = 16
    model = HybridLM(cfg, seed=0).eval()
    x = _ids(cfg, L=70)
    with torch.no_grad():
        full = model(x).logits
        cache = HybridCache.for_pattern(cfg.pattern)
        parts = [model(x[:, a:b], cache=cache).logits for a, b in ((0, 23), (23, 24), (24, 70))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-4)
    kv = cache.layers[cfg.pattern.index("*")]
    assert kv.length == 70 and kv.k_BKSE.shape[2] == 70
    kv.truncate(60)
    assert kv.k_BKSE.shape[2] == 60
    with pytest.raises(ValueError):
        kv.truncate(61)


def test_extend_context_rescales_full_attention_rope_only():
    """Long-context extension (Olmo 3 §5, §3.6): YaRN on the full-attention RoPE layers; the
    sliding-window layers keep plain RoPE; a NoPE / Mamba hybrid has nothing to rescale."""
    from hybridlm.config import YarnConfig
    from hybridlm.model.attention import Attention
    from hybridlm.ops.rope import rope_frequencies
    from hybridlm.presets import tiny_olmo

    cfg = tiny_olmo()
    cfg.attention.yarn = None
    model = HybridLM(cfg, seed=0).eval()
    attn = {n: m for n, m in model.named_modules() if isinstance(m, Attention)}
    before = {n: m.inv_freq.clone() for n, m in attn.items()}
    ids = torch.randint(0, cfg.vocab_size, (1, 40))
    logits = model(ids).logits
    yarn = YarnConfig(factor=4.0, original_max_position_embeddings=16)
    changed = model.extend_context(4096, yarn)
    assert model.config.max_seq_len == 4096 and model.config.attention.yarn == yarn
    full = [n for n, m in attn.items() if not m.sliding]
    assert changed == full and 0 < len(full) < len(attn)
    want, scale = rope_frequencies(cfg.attention.head_dim, cfg.attention.rope_theta, yarn)
    for n, m in attn.items():
        if n in full:
            assert torch.equal(m.inv_freq, want) and m.rope_scaling == scale
        else:
            assert torch.equal(m.inv_freq, before[n]) and m.rope_scaling == 1.0
    assert not torch.allclose(model(ids).logits, logits)
    # the extended config rebuilds the same model (what a checkpoint of the run records)
    again = HybridLM(model.config, seed=1).eval()
    again.load_state_dict(model.state_dict())
    torch.testing.assert_close(again(ids).logits, model(ids).logits)
    nope = HybridLM(get_preset("tiny-super"), seed=0)
    assert nope.extend_context(8192, yarn) == [] and nope.config.max_seq_len == 8192
    with pytest.raises(ValueError, match="factor >= 1"):
        nope.extend_context(8192, YarnConfig(factor=0.5, original_max_position_embeddings=16))
