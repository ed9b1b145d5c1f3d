"""Golden runs (as torchtitan's golden-loss tests): every training stage replays its short,
seeded fp32 run recorded in `tests/golden/<stage>.json` and must reproduce every recorded number
(the loss and its logged parts at every step, and the stage's other rows) to a relative 1e-6
(absolute 1e-7 near zero; `golden/stages.py` says why), or 1e-4 on a CPU whose kernel family
(AVX2 / AVX512) differs from the recording's, or 1e-3 without the native CPU kernels the
recording used (no C compiler, `HYBRIDLM_NATIVE=0`) or with them on another CPU model (they are
compiled for the machine). They pin the behaviour of the training
code so that a refactor can show it changed nothing; `python tests/golden/record.py` re-records
them after an intended change. ~15 s on 2 cores for all six."""

import json
from pathlib import Path

import pytest
import torch

from golden.stages import (
    OTHER_KERNELS_RTOL,
    OTHER_NATIVE_RTOL,
    RTOL,
    STAGES,
    mismatches,
    run_stage,
    settings_diff,
    split_rows,
)
from hybridlm.ops import native
from hybridlm.provenance import cpu_info

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_replays_its_golden_run(stage, tmp_path):
    path = GOLDEN / f"{stage}.json"
    golden = json.loads(path.read_text())
    settings, rows = run_stage(stage, tmp_path)
    steps, other = split_rows(rows)
    assert steps, f"{stage} logged no per-step rows"
    rec = golden["recorded_with"]
    recorded_on, here = rec.get("cpu_capability"), torch.backends.cpu.get_cpu_capability()
    native_then, native_now = rec.get("native_kernels", False), native.available()
    cpu_then, cpu_now = rec.get("cpu"), cpu_info()["model"]
    other_cpu = cpu_then is not None and cpu_then != cpu_now
    if native_then != native_now or (native_now and other_cpu):
        rtol = OTHER_NATIVE_RTOL
    else:
        rtol = RTOL if recorded_on == here else OTHER_KERNELS_RTOL
    bad = mismatches("steps", golden["steps"], steps, rtol)
    bad += mismatches("other_rows", golden["other_rows"], other, rtol)
    if bad:
        changed = settings_diff(golden["settings"], settings)
        hint = (
            f"\nthe run's settings differ from the recorded ones at: {', '.join(changed)}"
            if changed
            else "\nthe run's settings are the recorded ones"
        )
        if native_then != native_now:
            hint += (
                f"\nrecorded {'with' if native_then else 'without'} the native CPU kernels,"
                f" replayed {'with' if native_now else 'without'} them: compared at a relative"
                f" {OTHER_NATIVE_RTOL:g}"
            )
        if native_now and other_cpu:
            hint += (
                f"\nrecorded on {cpu_then}, replayed on {cpu_now}: the native kernels are "
                f"compiled for the machine, compared at a relative {OTHER_NATIVE_RTOL:g}"
            )
        if recorded_on != here:
            hint += (
                f"\nrecorded on {recorded_on} CPU kernels, replayed on {here}: compared at a "
                f"relative {OTHER_KERNELS_RTOL:g} (softmax-family kernels round differently per "
                "vector width); compare on a machine of the recorded kind for 1e-6"
            )
        pytest.fail(
            f"{stage} does not replay {path.name} (recorded with "
            f"{golden['recorded_with']}): {len(bad)} value(s) differ, the first:\n  "
            + "\n  ".join(bad[:5])
            + hint,
            pytrace=False,
        )
