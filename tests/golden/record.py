"""Record the golden runs of the training stages (`stages.py`) as `tests/golden/<stage>.json`.

    python tests/golden/record.py                     # every stage
    python tests/golden/record.py --stage sft --stage dpo
    python tests/golden/record.py --compare           # replay, print the largest relative
                                                      # difference per stage, write nothing

A golden holds `stage`, `recorded_with` (torch and Python versions, the hybridlm commit, the
CPU kernels torch used), `settings` (the run's configuration), `steps` (one row per optimizer
step: the loss and every part the stage logs, e.g. ce / mtp / moe_aux / grad_norm / lr) and
`other_rows` (what the stage logs besides steps: data summary, evals, teacher reference,
acceptance). Re-record only for an intended change of behaviour, and say why in the commit:
`tests/test_golden.py` exists to prove that a refactor changes none of these numbers.

Where they repeat: bit for bit across torch 2.13 and 2.14.1 and across thread counts (1 or 2)
on the recording machine (x86-64, AVX512 kernels). Not across CPU kernel families: softmax,
log_softmax and SDPA round differently per vector width: replayed with
`ATEN_CPU_CAPABILITY=avx2` the SFT, DPO and RL runs drift past 1e-6 (up to 2e-5 by step 20;
with `default`, distillation too). Nor between runs with and without the native CPU kernels
(`hybridlm.ops.native`, the default when a C compiler is present; `HYBRIDLM_NATIVE=0` turns
them off): their fused Mamba-2 conv + SiLU and gated norm round differently from torch's
composite ops. `--compare` names the kernel family of the recording and of the replay; compare
on a machine of the recorded kind.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: `golden.stages`, `_tiny`

from hybridlm.threads import configure_threads  # noqa: E402

configure_threads(1)  # before torch starts its pool; as tests/conftest.py pins it

import torch  # noqa: E402

from golden.stages import RTOL, STAGES, largest_difference, run_stage, split_rows  # noqa: E402
from hybridlm.ops import native  # noqa: E402
from hybridlm.provenance import cpu_info  # noqa: E402


def golden_path(stage: str) -> Path:
    return HERE / f"{stage}.json"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.strip()


def recorded_with() -> dict[str, str]:
    changed = _git("status", "--porcelain", "--", str(HERE.parents[1] / "src"))
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "hybridlm_commit": _git("rev-parse", "HEAD") + (" (src/ modified)" if changed else ""),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_kernels": native.available(),
        "machine": platform.machine(),
        "cpu": cpu_info()["model"],
    }


def record(stage: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        settings, rows = run_stage(stage, Path(tmp))
        seconds = time.perf_counter() - t0
    steps, other = split_rows(rows)
    golden = {
        "stage": stage,
        "recorded_with": recorded_with(),
        "settings": settings,
        "steps": steps,
        "other_rows": other,
    }
    golden_path(stage).write_text(json.dumps(golden, indent=1) + "\n")
    print(f"{stage}: {len(steps)} steps in {seconds:.1f} s -> {golden_path(stage)}")
    return golden


def compare(stage: str) -> float:
    """Replay a stage and print the largest difference from its recording (every number,
    measured as the test does: relative, against 0.1 for values below 0.1)."""
    golden = json.loads(golden_path(stage).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        _, rows = run_stage(stage, Path(tmp))
        seconds = time.perf_counter() - t0
    worst, where = largest_difference(golden, rows)
    verdict = "passes" if worst <= RTOL else "FAILS"
    print(
        f"{stage}: largest difference {worst:.3g} ({where or 'all equal'}; {verdict} at "
        f"{RTOL:g}); recorded with torch {golden['recorded_with']['torch']} on "
        f"{golden['recorded_with']['cpu_capability']} ({golden['recorded_with'].get('cpu')}), now "
        f"{torch.__version__} on {torch.backends.cpu.get_cpu_capability()} "
        f"({cpu_info()['model']}); {seconds:.1f} s"
    )
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--stage", action="append", choices=list(STAGES), help="a stage (repeat; default: all)"
    )
    parser.add_argument(
        "--compare", action="store_true", help="replay and compare with the recordings instead"
    )
    args = parser.parse_args()
    for stage in args.stage or list(STAGES):
        if args.compare:
            compare(stage)
        else:
            record(stage)


if __name__ == "__main__":
    main()
