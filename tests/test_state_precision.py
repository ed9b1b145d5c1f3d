"""SSM state cache precisions: rounding properties, decode agreement, and the drift study."""

import json
import sys
from pathlib import Path

import pytest
import torch

from hybridlm import HybridLM
from hybridlm.model.cache import HybridCache, MambaState
from hybridlm.model.state_precision import (
    SSM_PRECISIONS,
    StoredState,
    counter_uniform,
    fp16_stochastic_round,
)
from hybridlm.presets import get_preset


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    x = torch.tensor([1.0 + 1e-4, -3.3333, 1e-6, 6.0e4, 0.1])
    n = 40000
    xs = x.repeat(n, 1)
    q = fp16_stochastic_round(xs, torch.rand(xs.shape, generator=torch.Generator().manual_seed(0)))
    lo_hi = torch.stack(
        [
            torch.nextafter(x.half(), torch.tensor(-float("inf")).half()).float(),
            x.half().float(),
            torch.nextafter(x.half(), torch.tensor(float("inf")).half()).float(),
        ]
    )
    assert all(
        ((q[:, j].float()[:, None] == lo_hi[:, j][None]).any(1)).all() for j in range(len(x))
    )
    gap = (lo_hi[2] - lo_hi[0]) / 2
    # mean of n Bernoulli-rounded values: 5 standard errors of a two-point distribution
    assert torch.all((q.float().mean(0) - x).abs() <= 5 * gap / (2 * n**0.5) + 1e-12)
    # round-to-nearest is biased on the first value: it always returns 1.0
    assert x[0].half().float() == 1.0


def test_counter_stream_is_reproducible_and_keyed():
    a = counter_uniform(torch.Size([64]), seed=3, layer=1, step=7, device="cpu")
    assert torch.equal(a, counter_uniform(torch.Size([64]), seed=3, layer=1, step=7, device="cpu"))
    for other in ((4, 1, 7), (3, 2, 7), (3, 1, 8)):
        assert not torch.equal(a, counter_uniform(torch.Size([64]), *other, device="cpu"))


def test_int16_block_error_within_half_a_step():
    x = torch.randn(2, 3, 4, 256, generator=torch.Generator().manual_seed(0))
    x = x * torch.logspace(-3, 2, 256)
    s = StoredState.store(x, "int16-block")
    assert s.data.dtype == torch.int16 and s.scale.shape == (2, 3, 4, 2, 1)
    err = (s.load() - x).reshape(2, 3, 4, 2, 128).abs()
    # half a quantisation step, plus fp32 rounding of x / scale near the block maximum
    assert torch.all(err <= s.scale * (0.5 + 1e-3))
    assert s.nbytes() == x.numel() * 2 + 2 * 3 * 4 * 2 * 4


@pytest.mark.parametrize(
    "precision,tol", [("fp16", 2e-2), ("fp16-sr", 2e-2), ("int16-block", 2e-3)]
)
def test_low_precision_decode_tracks_fp32(precision, tol):
    cfg = get_preset("tiny-super")
    cfg.vocab_size = 300
    model = HybridLM(cfg, seed=0).eval()
    x = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))

    def decode(prec):
        cache = HybridCache.for_pattern(cfg.pattern, ssm_precision=prec, seed=5)
        with torch.no_grad():
            outs = [model(x[:, :8], cache=cache).logits]
            outs += [model(x[:, t : t + 1], cache=cache).logits for t in range(8, 40)]
        return torch.cat(outs, 1)

    ref, low = decode("fp32"), decode(precision)
    assert (low - ref).abs().max() / ref.abs().max() < tol
    if precision == "fp16-sr":
        torch.testing.assert_close(decode(precision), low, rtol=0, atol=0)  # same seed, same tokens


def test_unknown_precision_is_a_value_error():
    with pytest.raises(ValueError, match="SSM state precision"):
        MambaState("bf8")
    assert set(SSM_PRECISIONS) == {"fp32", "fp16", "fp16-sr", "int16-block"}


def _study(tmp_path, steps):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import ssm_state_precision

    assert (
        ssm_state_precision.main(["--steps", str(steps), "--every", "64", "--out", str(tmp_path)])
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (tmp_path / "drift.png").stat().st_size > 10_000
    return {r["precision"]: r for r in rows if r["step"] == steps}


def test_drift_study_writes_metrics_and_plot(tmp_path):
    last = _study(tmp_path, 128)
    assert set(last) == {"fp16", "fp16-sr", "int16-block"}


@pytest.mark.slow
def test_round_to_nearest_drifts_and_stochastic_rounding_does_not(tmp_path):
    last = _study(tmp_path, 4096)
    assert abs(last["fp16"]["bias"]) > 20 * abs(last["fp16-sr"]["bias"])
    assert last["fp16"]["rel_error"] > 3 * last["fp16-sr"]["rel_error"]
    assert last["int16-block"]["rel_error"] < last["fp16-sr"]["rel_error"]
