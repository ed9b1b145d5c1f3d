"""AutoQuantize (precision/autoquant.py): the multiple-choice knapsack solver is optimal (brute
force on random instances), sensitivities equal an independent Δy^2 g^2 computation (at the
linear's output; at the MoE output for a layer's experts), the Q/K/V and expert groups get one
format, and the effective-bits budget holds."""

import io
import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from _tiny import tiny_train_model
from hybridlm.model.model import HybridLM
from hybridlm.precision import autoquant as aq
from hybridlm.precision import ptq
from hybridlm.train.objectives import causal_lm_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def brute_force(costs, values, budget):
    best = None
    for choice in itertools.product(*[range(len(c)) for c in costs]):
        cost = sum(costs[g][j] for g, j in enumerate(choice))
        if cost <= budget:
            value = sum(values[g][j] for g, j in enumerate(choice))
            if best is None or value < best:
                best = value
    return best


def test_solver_matches_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        G = rng.randint(1, 7)
        scale = rng.choice([1, 8, 4096])  # common factors exercise the gcd reduction
        costs = [[scale * rng.randint(0, 30) for _ in range(rng.randint(1, 3))] for _ in range(G)]
        values = [[rng.random() for _ in c] for c in costs]
        lo, hi = sum(min(c) for c in costs), sum(max(c) for c in costs)
        budget = rng.randint(lo, hi + scale)
        sol = aq.solve_mckp(costs, values, budget)
        assert sol.exact
        assert sol.cost <= budget
        assert sol.cost == sum(costs[g][j] for g, j in enumerate(sol.choice))
        assert sol.value == pytest.approx(brute_force(costs, values, budget), abs=1e-12)


def test_solver_coarse_fallback_stays_feasible():
    rng = random.Random(1)
    for _ in range(50):
        costs = [[rng.randint(0, 997) for _ in range(3)] for _ in range(5)]
        values = [[rng.random() for _ in c] for c in costs]
        budget = sum(min(c) for c in costs) + rng.randint(0, 1500)
        sol = aq.solve_mckp(costs, values, budget, max_states=40)
        assert sol.cost <= budget
        assert sol.value >= brute_force(costs, values, budget) - 1e-12


def test_solver_errors():
    with pytest.raises(ValueError, match="infeasible"):
        aq.solve_mckp([[5, 9]], [[1.0, 0.0]], 4)
    with pytest.raises(ValueError, match="integers"):
        aq.solve_mckp([[1.5]], [[0.0]], 4)
    with pytest.raises(ValueError, match="option lists"):
        aq.solve_mckp([[1, 2]], [[0.0]], 4)


@pytest.fixture(scope="module")
def calibrated():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = HybridLM(tiny_train_model(), seed=0).eval()
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 256, (2, 48), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    stats = ptq.calibrate(model, batches)
    sens = aq.measure_sensitivities(model, batches, stats)
    torch.set_num_threads(before)
    return model, batches, stats, sens


def test_sensitivity_of_a_linear_equals_direct_computation(calibrated):
    model, batches, stats, sens = calibrated
    lin = model.layers[0].mixer.out_proj
    want = dict.fromkeys(("nvfp4", "fp8"), 0.0)
    for b in batches:
        seen = {}
        h = lin.register_forward_hook(lambda m, a, y, seen=seen: seen.update(x=a[0].detach(), y=y))
        loss, _ = causal_lm_loss(model, model(b["input_ids"]), b["labels"])
        h.remove()
        (g,) = torch.autograd.grad(loss, seen["y"])
        for fmt in want:
            q = ptq.QuantLinear.from_linear(
                lin,
                fmt,
                weight_amax=float(lin.weight.detach().abs().amax()),
                input_amax=stats.input_amax["layers.0.mixer.out_proj"],
                search="mse",
            )
            with torch.no_grad():
                dy = q(seen["x"]) - F.linear(seen["x"], lin.weight)
            want[fmt] += float((dy.square() * g.square()).sum())
    got = sens["layers.0.mixer.out_proj"]
    assert got["bf16"] == 0.0
    for fmt in want:
        assert got[fmt] == pytest.approx(want[fmt], rel=1e-5)
    assert got["nvfp4"] > got["fp8"] > 0


def test_sensitivity_of_experts_is_measured_at_the_moe_output(calibrated):
    model, batches, stats, sens = calibrated
    moe = model.layers[1].mixer
    amax = {p: stats.input_amax[f"layers.1.mixer.experts.{p}"] for p in ("up_proj", "down_proj")}
    qe = ptq.QuantExperts.from_experts(moe.experts, "nvfp4", input_amax=amax, search="mse")
    want = 0.0
    for b in batches:
        seen = {}
        h = moe.register_forward_hook(lambda m, a, y, seen=seen: seen.update(x=a[0].detach(), y=y))
        loss, _ = causal_lm_loss(model, model(b["input_ids"]), b["labels"])
        h.remove()
        (g,) = torch.autograd.grad(loss, seen["y"])
        with torch.no_grad():
            y_ref = moe(seen["x"])
            kept, moe.experts = moe.experts, qe
            y_q = moe(seen["x"])
            moe.experts = kept
        want += float(((y_q - y_ref).square() * g.square()).sum())
    assert sens["layers.1.mixer.experts"]["nvfp4"] == pytest.approx(want, rel=1e-5)
    # one decision for all experts (up and down): no per-projection entries
    assert not any(k.startswith("layers.1.mixer.experts.") for k in sens)


def test_groups_budget_and_extremes(calibrated):
    model, _, _, sens = calibrated
    ops = ptq.find_ops(model)
    assert {"layers.2.mixer.qkv_proj", "layers.1.mixer.experts"} <= set(sens)
    assert "layers.2.mixer.q_proj" not in sens
    params = {op.name: op.params for op in ops}
    for budget in (4.5, 4.75, 5.5, 8.0, 16.0):
        res = aq.autoquantize(sens, ops, budget=budget)
        plan = res.plan
        assert len({plan[f"layers.2.mixer.{p}"] for p in ("q_proj", "k_proj", "v_proj")}) == 1
        bits = sum(params[n] * ptq.BITS[f] for n, f in plan.items()) / sum(params.values())
        assert bits <= budget + 1e-12 and res.param_bits == pytest.approx(bits)
        assert res.exact
        assert res.total_sensitivity == pytest.approx(
            sum(sens[r.group][r.format] for r in res.groups)
        )
    assert set(aq.autoquantize(sens, ops, budget=4.5).plan.values()) == {"nvfp4"}
    assert set(aq.autoquantize(sens, ops, budget=16).plan.values()) == {"bf16"}
    loose = aq.autoquantize(sens, ops, budget=6.0)
    tight = aq.autoquantize(sens, ops, budget=4.75)
    assert loose.total_sensitivity <= tight.total_sensitivity
    with pytest.raises(ValueError, match="infeasible"):
        aq.autoquantize(sens, ops, budget=4.0)


def test_autoquant_is_optimal_over_this_models_groups(calibrated):
    model, _, _, sens = calibrated
    ops = ptq.find_ops(model)
    res = aq.autoquantize(sens, ops, budget=5.0)
    groups = ptq.groups_of(ops)
    names = list(sens)
    weights = [sum(op.params for op in groups[g]) for g in names]
    best = None
    for choice in itertools.product(*[list(sens[g]) for g in names]):
        bits = sum(w * ptq.BITS[f] for w, f in zip(weights, choice, strict=True)) / sum(weights)
        if bits <= 5.0:
            s = sum(sens[g][f] for g, f in zip(names, choice, strict=True))
            best = s if best is None else min(best, s)
    assert res.total_sensitivity == pytest.approx(best, rel=1e-12)


def test_flops_cost_counts_active_experts_and_table_prints(calibrated):
    model, _, _, sens = calibrated
    ops = {op.name: op for op in ptq.find_ops(model)}
    e = ops["layers.1.mixer.experts"]
    top_k = model.layers[1].mixer.cfg.top_k
    assert e.params == 2 * e.macs_per_token * 8 // (2 * top_k)
    res = aq.autoquantize(sens, list(ops.values()), budget=5.0, cost="flops")
    assert res.cost_mode == "flops" and res.effective_bits <= 5.0 + 1e-12
    buf = io.StringIO()
    aq.print_table(res, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "layers.2.mixer.qkv_proj" in text and "S nvfp4" in text
