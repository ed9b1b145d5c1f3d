"""benchmarks/pretrain_throughput.py runs end to end at tiny settings and prints a sane ratio."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_pretrain_throughput_benchmark_prints_a_finite_ratio(tmp_path):
    out = tmp_path / "r.json"
    code = (
        "import sys, torch; torch.set_num_threads(1); "
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import pretrain_throughput as b; "
        "raise SystemExit(b.main(sys.argv[1:]))"
    )
    args = ["--tiny", "--batch", "2", "--seq", "64", "--steps", "2", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [x for x in proc.stdout.splitlines() if "ratio" in x]
    assert len(line) == 1, proc.stdout
    m = re.search(r"hybridlm (\d+) tok/s \| transformers (\d+) tok/s \| ratio ([\d.]+)x", line[0])
    assert m, line[0]
    ratio = float(m.group(3))
    assert math.isfinite(ratio) and ratio > 0
    assert "MFU hybridlm" in line[0] and "matmul peak" in line[0]
    report = json.loads(out.read_text())
    assert report["max_logit_diff"] <= 1e-4
    assert all(v > 0 and math.isfinite(v) for v in report["tokens_per_s"].values())
