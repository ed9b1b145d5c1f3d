"""The Ray Data executor on a local two-CPU Ray instance gives the in-process result, document
for document (text, metadata and provenance), through per-document and global stages."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from hybridlm.curate.pipeline import CurateConfig, CurateInput, iter_output, run_curate

ray = pytest.importorskip("ray")

from test_curate_core import make_corpus  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    if started:
        ray.shutdown()


def test_ray_executor_matches_local(tmp_path, local_ray):
    make_corpus(tmp_path / "in")
    cfg = CurateConfig(
        inputs=[
            CurateInput(
                name="web",
                kind="jsonl",
                path=str(tmp_path / "in"),
                id_field="id",
                metadata_fields=["url", "date"],
            )
        ],
        stages=[
            {"stage": "normalize"},
            {"stage": "length", "min_chars": 200},
            {"stage": "gopher_repetition"},
            {"stage": "exact_dedup"},
            {"stage": "minhash_dedup"},
        ],
        output_dir=str(tmp_path / "local"),
        max_doc_chars=20_000,
        progress=False,
    )
    local = run_curate(cfg)
    remote = run_curate(
        dataclasses.replace(cfg, output_dir=str(tmp_path / "ray"), executor="ray", num_workers=2)
    )
    assert remote.data["executor"]["name"] == "ray" and remote.shards_run == local.shards_run

    def records(folder):
        return [json.dumps(d.to_record(), sort_keys=True) for d in iter_output(folder)]

    got, want = records(tmp_path / "ray"), records(tmp_path / "local")
    assert len(want) > 40 and got == want
    for a, b in zip(local.data["stages"], remote.data["stages"], strict=True):
        assert (a["docs_in"], a["docs_out"], a["dropped"]) == (
            b["docs_in"],
            b["docs_out"],
            b["dropped"],
        )
    assert remote.data["inputs"] == local.data["inputs"]


# `hybridlm` with a module made unimportable, as in an install without the extra providing it
WITHOUT = """
import sys
sys.modules[sys.argv.pop(1)] = None  # `import` of it raises ImportError
from hybridlm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_without_the_data_extra_the_ray_executor_names_it(tmp_path):
    """`ray` alone (the [rl] / [speedrun] extras) lacks pandas, which Ray Data imports: the
    command stops with one line naming the [data] extra instead of an ImportError traceback."""
    argv = ["curate", "--executor", "ray", "--output", str(tmp_path / "out"), "--no-progress"]
    res = subprocess.run(
        [sys.executable, "-c", WITHOUT, "pandas", *argv, "--num-cpus", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert last.startswith("hybridlm curate: error: executor ray needs Ray Data"), last
    assert 'pip install -e ".[data]"' in last, last
