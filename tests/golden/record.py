"""Record the golden runs of the training stages (`stages.py`) for this platform, or check them.

    python tests/golden/record.py                     # record every stage for this platform
    python tests/golden/record.py --stage sft --stage dpo
    python tests/golden/record.py --check             # replay every stage and say which
                                                      # recording it differs from; writes nothing,
                                                      # exits 1 when one differs
    python tests/golden/record.py --platform          # this platform and its directory

Recordings are per platform, `tests/golden/recordings/<platform>/<stage>.json`; `recordings.py`
says what a platform is (what decides the float results) and what a recording holds. Recording
writes this platform's directory and leaves the other platforms' recordings alone; it then says,
per stage, whether the numbers changed from this platform's previous recording and how far they
are from every other platform's (at the stage's `CROSS_PLATFORM_RTOL`). `--check` compares a
replay with this platform's recording at `RTOL` and with the others at `CROSS_PLATFORM_RTOL`, as
`tests/test_golden.py` does.

Re-record only for an intended change of behaviour, and say why in the commit:
`tests/test_golden.py` exists to prove that a refactor changes none of these numbers. When the
numbers changed, the other platforms' recordings are stale: re-record on those machines, or
delete the directories of the ones you cannot (this script names them), so that no machine
compares with numbers of the old behaviour. Record from a tree whose src/ is committed:
`recorded_with.hybridlm_commit` says "(src/ modified)" otherwise.

Where the runs repeat: bit for bit across torch 2.13 and 2.14.1 and across thread counts (1 or
2) on one platform. Not across platforms (`stages.py` has the measured differences): softmax,
log_softmax and SDPA round differently per CPU kernel family (`ATEN_CPU_CAPABILITY=avx2` or
`default` replays another family on an AVX512 machine), the native CPU kernels
(`hybridlm.ops.native`, off with `HYBRIDLM_NATIVE=0`) round differently from torch's composite
ops, and they are compiled for the CPU model (`-march=native`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: `golden.stages`, `_tiny`

from hybridlm.threads import configure_threads  # noqa: E402

configure_threads(1)  # before torch starts its pool; as tests/conftest.py pins it

from golden import recordings as rec  # noqa: E402
from golden.stages import (  # noqa: E402
    CROSS_PLATFORM_RTOL,
    RTOL,
    STAGES,
    largest_difference,
    run_stage,
    split_rows,
)


def replay(stage: str) -> tuple[dict, list[dict], float]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        settings, rows = run_stage(stage, Path(tmp))
        return settings, rows, time.perf_counter() - t0


def _verdict(d: float, where: str, tol: float) -> str:
    status = "agrees" if d <= tol else "DIFFERS"
    return f"{status} at rel {tol:g}: largest difference {d:.3g} ({where or 'all equal'})"


def record(stage: str, here: rec.Platform) -> tuple[bool, list[str]]:
    """Record `stage` for this platform; (whether its numbers changed from this platform's
    previous recording, the other platforms' directories)."""
    recordings = rec.load(stage)
    previous = rec.own(recordings, here)
    settings, rows, seconds = replay(stage)
    steps, other = split_rows(rows)
    golden = {
        "stage": stage,
        "recorded_with": rec.recorded_with(),
        "settings": settings,
        "steps": steps,
        "other_rows": other,
    }
    directory = rec.RECORDINGS / (previous[0] if previous else rec.slug(here))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{stage}.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"{stage}: {len(steps)} steps in {seconds:.1f} s -> {directory / f'{stage}.json'}")
    changed = False
    if previous is None:
        print("  the first recording of this platform")
    else:
        d, where = largest_difference(previous[1], rows)
        changed = d > RTOL
        print(
            f"  {'CHANGED' if changed else 'unchanged'} from the previous recording: "
            + _verdict(d, where, RTOL)
        )
    others = [name for name in recordings if previous is None or name != previous[0]]
    for name in others:
        d, where = largest_difference(recordings[name], rows)
        print(f"  {name}: " + _verdict(d, where, CROSS_PLATFORM_RTOL[stage]))
    return changed, others


def check(stage: str, here: rec.Platform) -> int:
    """Replay `stage` once, compare it with every recording; the number that differ."""
    recordings = rec.load(stage)
    mine = rec.own(recordings, here)
    _, rows, seconds = replay(stage)
    print(f"{stage}: replayed in {seconds:.1f} s")
    if mine is None:
        print(
            f"  no recording of this platform ({rec.slug(here)}): the test compares with the "
            "nearest recording at the cross-platform tolerance only; "
            "`python tests/golden/record.py` records it"
        )
    failures = 0
    for name, golden in recordings.items():
        is_mine = mine is not None and name == mine[0]
        tol = RTOL if is_mine else CROSS_PLATFORM_RTOL[stage]
        d, where = largest_difference(golden, rows)
        failures += d > tol
        label = f"{name} ({'this platform' if is_mine else 'other platform'})"
        print(f"  {label}: {_verdict(d, where, tol)}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--stage", action="append", choices=list(STAGES), help="a stage (repeat; default: all)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="replay and compare with the recordings instead"
    )
    mode.add_argument("--platform", action="store_true", help="print this platform and exit")
    args = parser.parse_args()
    here = rec.current_platform()
    print(f"platform: {rec.describe(here)} -> {rec.RECORDINGS / rec.slug(here)}")
    if args.platform:
        return
    stages = args.stage or list(STAGES)
    if args.check:
        failures = sum(check(stage, here) for stage in stages)
        print(f"{failures} comparison(s) differ" if failures else "every comparison agrees")
        sys.exit(1 if failures else 0)
    stale: set[str] = set()
    for stage in stages:
        changed, others = record(stage, here)
        if changed:
            stale.update(others)
    if stale:
        print(
            "the numbers changed on this platform, so these platforms' recordings are stale: "
            "re-record them on their machines, or delete the ones you cannot:\n  "
            + "\n  ".join(str(rec.RECORDINGS / name) for name in sorted(stale))
        )


if __name__ == "__main__":
    main()
