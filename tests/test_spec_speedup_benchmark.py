"""benchmarks/spec_speedup.py end to end on reduced settings (slow): trains and heals a tiny
model, then reuses both; every greedy speculative output equals plain greedy; the cost, check and
projection and engine lines exist and are sane."""

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import spec_speedup  # noqa: E402


def test_bad_arguments_exit_with_usage():
    with pytest.raises(SystemExit):
        spec_speedup.main(["--ks", "0-3"])
    with pytest.raises(SystemExit):
        spec_speedup.main(["--ks", "8"])


@pytest.mark.slow
def test_spec_speedup_trains_heals_reuses_and_projects(tmp_path, capsys):
    small = [
        "--out",
        str(tmp_path),
        "--ks",
        "1-2",
        "--prompts",
        "2",
        "--prompt-len",
        "16",
        "--new-tokens",
        "12",
        "--repeats",
        "1",
        "--cost-repeats",
        "2",
        "--e2e-tokens",
        "4",
        "--tiny-draft-vocab",
        "32",
        "--draft-vocab",
        "512",
        "--engine-batches",
        "1,2",
    ]
    train = ["--train-steps", "3", "--train-batch", "2", "--train-seq", "64"]
    heal = ["--heal-steps", "2", "--heal-sequences", "4"]
    rc = spec_speedup.main([*small, *train, *heal])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert re.search(r"^\[heal\] .* acceptance length .* -> [\d.]+$", text, re.M), text
    line = r"^\[tiny\] (\d) \| (trained|healed) \| (full|32) \| ([\d.]+) \| .* \| (\d)/(\d) \|"
    rows = re.findall(line, text, re.M)
    assert len(rows) == 6, text  # k = 1, 2 x (trained, healed, healed with 32 draft ids)
    for k, _, _, al, same, n in rows:
        assert 1.0 <= float(al) <= int(k) + 1 and same == n == "2"
    cost = re.search(r"draft \(full head\) ([\d.]+) \| draft \(512 ids\) ([\d.]+)", text)
    assert cost and 0 < float(cost[2]) < float(cost[1]), text
    assert re.search(r"^\[check\] .* identical to greedy: True$", text, re.M), text
    proj = r"^\[projection\] \d \| (trained|healed) \| (full|512) \|"
    assert len(re.findall(proj, text, re.M)) == 8, text
    kinds = {
        json.loads(x)["section"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    }
    assert kinds == {"tiny", "costs", "check", "projection", "engine"}
    eng = re.findall(r"^\[engine\] (\d) \| \d+ \| \d+ .* \| (True|False)$", text, re.M)
    assert eng == [("1", "True"), ("2", "True")], text
    assert (tmp_path / "spec_speedup.png").stat().st_size > 0
    # a second run with the same healing settings reuses the trained and healed model
    rc = spec_speedup.main([*small, *heal])
    text = capsys.readouterr().out
    assert rc == 0 and "(reused)" in text, text
