"""Swarm mixture optimisation: Dirichlet sampling, capped-simplex projection, regression and
optimiser against hand-computed optima, a bigram-proxy swarm and a trainer-proxy swarm on the
packaged tinyshakespeare and GSM8K, and the mixture file read back by the pretraining loader."""

import math

import numpy as np
import pytest
import torch

from _tiny import tiny_train_model
from hybridlm.curate.mixing import (
    BigramProxy,
    MixtureRegression,
    SwarmResult,
    TrainerProxy,
    optimize_mixture,
    plot_swarm,
    project_capped_simplex,
    repetition_caps,
    run_swarm,
    sample_mixtures,
    write_mixture,
)
from hybridlm.data import builtin
from hybridlm.data.config import DataConfig, SourceConfig
from hybridlm.data.loader import PackedLoader
from hybridlm.data.pipeline import build_loaders, prepare_shards

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- pure maths
def test_dirichlet_swarm():
    prior = {"web": 0.6, "code": 0.3, "math": 0.1}
    w = sample_mixtures(prior, 4000, concentration=20.0, seed=1)
    assert w.shape == (4000, 3) and np.allclose(w.sum(1), 1.0)
    np.testing.assert_allclose(w.mean(0), [0.6, 0.3, 0.1], atol=0.01)  # centred on the prior
    # Dirichlet variance: p (1 - p) / (alpha0 + 1)
    np.testing.assert_allclose(w.var(0), [0.24 / 21, 0.21 / 21, 0.09 / 21], rtol=0.1)
    assert np.array_equal(w, sample_mixtures(prior, 4000, concentration=20.0, seed=1))
    with pytest.raises(ValueError, match="positive prior"):
        sample_mixtures({"a": 1.0, "b": 0.0}, 3)


def test_projection_by_hand_and_optimality():
    np.testing.assert_allclose(project_capped_simplex([0.5, 0.5, 0.5], np.ones(3)), [1 / 3] * 3)
    np.testing.assert_allclose(
        project_capped_simplex([2.0, 0.0, 0.0], np.array([0.5, 1, 1])), [0.5, 0.25, 0.25]
    )
    with pytest.raises(ValueError, match="infeasible"):
        project_capped_simplex([1, 1], np.array([0.3, 0.3]))
    rng = np.random.default_rng(0)
    for _ in range(50):
        v = rng.normal(size=4)
        caps = rng.uniform(0.3, 1.0, size=4)
        p = project_capped_simplex(v, caps)
        assert math.isclose(p.sum(), 1.0, abs_tol=1e-9) and (p >= 0).all() and (p <= caps).all()
        # variational inequality of a projection: (v - p).(z - p) <= 0 for feasible z
        for _ in range(20):
            z = project_capped_simplex(rng.normal(size=4), caps)
            assert (v - p) @ (z - p) <= 1e-8


def test_regression_recovers_known_laws_and_gradients():
    rng = np.random.default_rng(0)
    w = rng.dirichlet(np.ones(3), size=40)
    # quadratic ground truth for two tasks
    a = np.array([[1.0, -0.5, 0.2], [0.3, 0.8, -1.0]])
    q = np.array([[[0.5, 0.1, 0.0], [0.1, -0.2, 0.3], [0.0, 0.3, 0.4]]] * 2)
    truth = 2.0 + w @ a.T + np.einsum("kd,tde,ke->kt", w, q, w)
    reg = MixtureRegression(kind="quadratic", ridge=0.0).fit(w, truth)
    test = rng.dirichlet(np.ones(3), size=10)
    expect = 2.0 + test @ a.T + np.einsum("kd,tde,ke->kt", test, q, test)
    np.testing.assert_allclose(reg.predict(test), expect, atol=1e-8)
    assert np.all(reg.r2(w, truth) > 1 - 1e-10)
    # the exponential law log L = b + a.w is recovered exactly by loglinear
    law = np.exp(0.5 + w @ a.T)
    logreg = MixtureRegression(kind="loglinear", ridge=0.0).fit(w, law)
    np.testing.assert_allclose(logreg.predict(test), np.exp(0.5 + test @ a.T), rtol=1e-8)
    # analytic gradients == central differences
    for r in (reg, logreg, MixtureRegression(kind="linear").fit(w, truth)):
        x = np.array([0.2, 0.5, 0.3])
        num = np.stack(
            [(r.predict(x + e)[0] - r.predict(x - e)[0]) / 2e-6 for e in np.eye(3) * 1e-6], 1
        )
        np.testing.assert_allclose(r.grad(x), num, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="positive losses"):
        MixtureRegression(kind="loglinear").fit(w, -truth)


def test_optimiser_hand_computed_optima():
    doms = ["a", "b", "c"]
    # linear loss 2 + w.(-1, 0, 1): all weight on a, but a is capped at 0.5 by repetition:
    # cap = max_repetition * available / total = 2 * 250 / 1000
    w = np.random.default_rng(0).dirichlet(np.ones(3), size=20)
    lin = MixtureRegression(kind="linear", ridge=0.0).fit(w, 2.0 + w @ np.array([[-1.0, 0, 1]]).T)
    avail = {"a": 250, "b": 1e6, "c": 1e6}
    opt = optimize_mixture(lin, doms, available_tokens=avail, total_tokens=1000, max_repetition=2)
    assert opt.caps == pytest.approx({"a": 0.5, "b": 1.0, "c": 1.0})
    assert list(opt.weights.values()) == pytest.approx([0.5, 0.5, 0.0], abs=1e-6)
    assert opt.objective == pytest.approx(1.5, abs=1e-6)
    # convex quadratic sum (w - w*)^2: the optimum is w*, or its projection when capped
    target = np.array([0.2, 0.3, 0.5])
    y = ((w - target) ** 2).sum(1, keepdims=True)
    quad = MixtureRegression(kind="quadratic", ridge=0.0).fit(w, y)
    free = optimize_mixture(quad, doms)
    assert list(free.weights.values()) == pytest.approx(target.tolist(), abs=1e-5)
    capped = optimize_mixture(
        quad,
        doms,
        available_tokens={"a": 1e9, "b": 1e9, "c": 100},
        total_tokens=1000,
        max_repetition=4,
    )
    assert list(capped.weights.values()) == pytest.approx([0.25, 0.35, 0.4], abs=1e-5)
    np.testing.assert_allclose(repetition_caps(doms, None, 0, 4), 1.0)
    with pytest.raises(ValueError, match="lacks domains"):
        repetition_caps(doms, {"a": 1}, 10, 4)
    with pytest.raises(ValueError, match="raise max_repetition"):
        repetition_caps(doms, {"a": 1, "b": 1, "c": 1}, 100, 4)


# ---------------------------------------------------------------------------- real proxies
def _shards(tmp_path, with_code: bool = True) -> tuple[DataConfig, dict]:
    # GSM8K test as a plain test.jsonl: JSONL document ids name the file (`test.jsonl:<line>`)
    # and the held-out split hashes the ids, so the figures below stay those of the original
    math_file = tmp_path / "test.jsonl"
    math_file.write_text(builtin.read_text(builtin.path(builtin.GSM8K_TEST)))
    sources = [
        SourceConfig(name="shakes", kind="tinyshakespeare", group_chars=1000),  # packaged
        SourceConfig(name="math", kind="jsonl", path=str(math_file), text_field="question"),
    ]
    if with_code:
        sources.insert(1, SourceConfig(name="code", kind="stdlib", max_files=60))
    cfg = DataConfig(sources=sources, shards_dir=str(tmp_path / "shards"), num_workers=0)
    sets = prepare_shards(cfg)
    return cfg, sets


def test_bigram_swarm_regression_optimum_and_mixture_file(tmp_path):
    cfg, sets = _shards(tmp_path)
    dirs = {k: str(v.path) for k, v in sets.items()}
    proxy = BigramProxy(dirs, budget=20_000)
    # by hand: with overwhelming smoothing the model is uniform over the 258 ids, so every
    # scored target costs log2(258) bits (BOS is never a target; EOS has no bytes)
    flat = BigramProxy(dirs, budget=2_000, smoothing=1e12)({"shakes": 1.0}, 0)
    for name, held in proxy.held.items():
        targets = int((held[1:] != 256).sum())
        expect = math.log2(258) * targets / int((held[1:] < 256).sum())
        assert flat[f"{name}_bpb"] == pytest.approx(expect, rel=1e-6)
    prior = {"shakes": 0.5, "code": 0.3, "math": 0.2}
    res = run_swarm(prior, proxy, seed=0, out_dir=tmp_path / "swarm", progress=False)
    assert res.weights.shape == (15, 3) and res.tasks == ["shakes_bpb", "code_bpb", "math_bpb"]
    again = SwarmResult.from_jsonl(tmp_path / "swarm" / "swarm.jsonl")
    np.testing.assert_allclose(again.losses, res.losses)
    reg = MixtureRegression(kind="quadratic").fit(res.weights, res.losses)
    check = run_swarm(prior, proxy, num_runs=8, seed=1, progress=False)
    r2 = reg.r2(check.weights, check.losses)
    print("held-out R^2 per task", r2.round(3))
    assert (r2 > 0.8).all()
    avail = {k: float(v.num_tokens) for k, v in sets.items()}
    opt = optimize_mixture(
        reg,
        res.domains,
        prior=prior,
        starts=res.weights,
        tasks=res.tasks,
        available_tokens=avail,
        total_tokens=2.5e6,
        max_repetition=1.0,
    )
    w = np.array(list(opt.weights.values()))
    assert math.isclose(w.sum(), 1.0, abs_tol=1e-9)
    for d in res.domains:  # repetition caps: weight x total <= max_repetition x available
        assert opt.weights[d] * 2.5e6 <= avail[d] * 1.0 * (1 + 1e-9)
    assert opt.weights["math"] == pytest.approx(avail["math"] / 2.5e6, rel=1e-6)  # binding cap
    actual = np.mean(list(proxy(opt.weights).values()))
    at_prior = np.mean(list(proxy(prior).values()))
    print(f"optimum {opt.weights}: mean bpb {actual:.4f} vs prior {at_prior:.4f}")
    assert actual < at_prior
    assert abs(actual - opt.objective) < 0.02  # the regression is accurate at the optimum
    # the mixture file is a DataConfig the loader reads; token shares follow the weights
    out = write_mixture(tmp_path / "mix.yaml", cfg, opt.weights)
    loaded = DataConfig.load(tmp_path / "mix.yaml")
    assert loaded.weights == out.weights and loaded.weights["math"] > 0
    loaded.seq_len, loaded.batch_size = 64, 4
    train, _ = build_loaders(loaded, prepare_shards(loaded))
    direct = PackedLoader(
        {k: v for k, v in sets.items() if loaded.weights[k] > 0},
        seq_len=64,
        batch_size=4,
        weights={k: w for k, w in loaded.weights.items() if w > 0},
    )
    for _ in range(5):  # the file drives the loader exactly like the weights themselves
        a, b = next(train), next(direct)
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["source_ids"], b["source_ids"])
    assert plot_swarm(tmp_path / "swarm" / "swarm.jsonl", reg, tmp_path / "s.png").is_file()
    with pytest.raises(ValueError, match="unknown sources"):
        write_mixture(tmp_path / "bad.yaml", cfg, {"nope": 1.0})


def test_trainer_proxy_tiny_swarm(tmp_path):
    """Two real proxy runs (tiny HybridLM, 10 steps each) through run_pretrain."""
    _, sets = _shards(tmp_path, with_code=False)
    proxy = TrainerProxy(
        shard_dirs={k: str(v.path) for k, v in sets.items()},
        model=tiny_train_model(mtp=False),
        out_dir=str(tmp_path / "swarm"),
        steps=10,
        eval_batches=2,
    )
    mostly_math = proxy({"shakes": 0.1, "math": 0.9}, 0)
    mostly_shakes = proxy({"shakes": 0.9, "math": 0.1}, 1)
    assert set(mostly_math) == {"shakes_bpb", "math_bpb"}
    assert all(3.0 < v < 9.0 for v in (*mostly_math.values(), *mostly_shakes.values()))
    assert mostly_math["math_bpb"] < mostly_shakes["math_bpb"]
    assert (tmp_path / "swarm" / "run_001" / "metrics.jsonl").is_file()
    # parity: with one domain, held_out_bpb equals the trainer's own held-out eval_bpb
    single = TrainerProxy(
        shard_dirs={"math": str(sets["math"].path)},
        model=tiny_train_model(mtp=False),
        out_dir=str(tmp_path / "single"),
        steps=4,
        eval_batches=3,
    )
    ours = single({"math": 1.0}, 0)["math_bpb"]
    assert ours == pytest.approx(single.last_result["eval"]["eval_bpb"], rel=1e-5)


@pytest.mark.slow
def test_trainer_swarm_end_to_end(tmp_path):
    """A real small swarm: 6 tiny-model runs of 40 steps, regression, optimum, mixture file."""
    cfg, sets = _shards(tmp_path, with_code=False)
    proxy = TrainerProxy(
        shard_dirs={k: str(v.path) for k, v in sets.items()},
        model=tiny_train_model(mtp=False),
        out_dir=str(tmp_path / "swarm"),
        steps=40,
        eval_batches=4,
    )
    prior = {"shakes": 0.5, "math": 0.5}
    res = run_swarm(prior, proxy, num_runs=6, concentration=2.0, out_dir=tmp_path, progress=False)
    # more math in the mixture -> lower math bpb (Spearman-like check on the swarm)
    math_w, math_bpb = res.weights[:, 1], res.losses[:, res.tasks.index("math_bpb")]
    assert np.corrcoef(math_w, math_bpb)[0, 1] < -0.5
    reg = MixtureRegression(kind="quadratic", ridge=1e-3).fit(res.weights, res.losses)
    opt = optimize_mixture(reg, res.domains, prior=prior, starts=res.weights, tasks=res.tasks)
    assert opt.objective <= reg.predict(res.weights).mean(1).min() + 1e-9
    write_mixture(tmp_path / "mix.yaml", cfg, opt.weights)
    assert DataConfig.load(tmp_path / "mix.yaml").weights == pytest.approx(
        {k: round(v, 6) for k, v in opt.weights.items()}, abs=1e-6
    )
