"""The training-step benchmark runs end to end and reports a ratio measured in the same run."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.slow
def test_train_step_benchmark_reports_ratio(tmp_path):
    import train_step

    out = tmp_path / "bench.json"
    rc = train_step.main(
        [
            "--batch",
            "1",
            "--seq",
            "128",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--dtypes",
            "fp32",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    run = res["runs"]["fp32"]
    assert res["max_logit_diff"] < 1e-4
    assert (
        run["ratio"] > 0
        and run["tokens_per_s"]["hybridlm"] > 0
        and run["tokens_per_s"]["transformers"] > 0
    )
    assert 0 < run["peak_fraction"]
