"""The copy-formation benchmark: its masks cover exactly the tokens a copy predicts, and it runs
end to end for a HybridLM pattern and the plain PyTorch peer."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import copy_formation as cf  # noqa: E402


def test_masked_targets_are_copies_of_earlier_tokens():
    g = torch.Generator().manual_seed(0)
    for task in ("gap", "rep"):
        ids, mask = cf.batch(task, g)
        assert ids.shape[0] == mask.shape[0] == cf.ROWS and mask.shape[1] == ids.shape[1] - 1
        for row, m in zip(ids, mask, strict=True):
            tgt = row[1:]
            pos = m.nonzero()[:, 0]
            assert len(pos) > 0
            # each masked target continues, one step on, an earlier occurrence of its prefix
            for p in pos.tolist():
                prev, nxt = row[p], tgt[p]
                earlier = [j for j in range(p) if row[j] == prev and row[j + 1] == nxt]
                assert earlier, (task, p)
        if task == "gap":  # the offset between the copies differs between rows
            offsets = {int(m.nonzero()[0]) for m in mask}
            assert len(offsets) > 1


def test_benchmark_runs_and_records_provenance(tmp_path):
    cf.main(["--runs", "M*:rep:2", "reference:gap:2", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    assert [r["model"] for r in report["runs"]] == ["M*", "reference"]
    assert all(len(r["curve"]) == 1 and r["final"] > 0 for r in report["runs"])
    assert report["command"] and "torch" in report["versions"]
