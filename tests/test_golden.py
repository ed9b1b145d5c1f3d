"""Golden runs (as torchtitan's golden-loss tests): every training stage replays a short, seeded
fp32 run (`golden/stages.py`) and must reproduce every number its recording holds: the loss and
its logged parts at every step, and the stage's other rows. They pin the behaviour of the
training code so that a refactor can show it changed nothing. ~15 s on 2 cores for all six.

Layout: fp32 results depend on the platform, so each platform has its own recordings,

    tests/golden/recordings/<platform>/<stage>.json    e.g. x86_64-avx512-native-amd-epyc/rl.json

where a platform is what decides the float results (`golden/recordings.py`): the machine, torch's
CPU kernel family (AVX512 / AVX2 / DEFAULT), whether the native CPU kernels are on and, when they
are, the CPU model (they are compiled with -march=native). Not the torch version: the runs repeat
bit for bit across torch 2.13 and 2.14.1 (a failure names it, and Python's and the native
compiler's, when they differ from the recording's).

- `test_stage_replays_its_golden_run`: on a platform with a recording, every number to a relative
  1e-6 (`RTOL`), however small; only the few fields that are 0 in exact arithmetic (`RESIDUALS`:
  rounding noise of O(1) operands, `golden/stages.py` says why) have an absolute floor of 1e-7
  (`ATOL`); counts, flags and strings exactly. On a platform without one it cannot hold
  1e-6, so it compares the replay with the nearest recording (same machine, native kernels, CPU
  model, kernel family, in that order) at the stage's cross-platform tolerance
  (`CROSS_PLATFORM_RTOL`: 4x or more the spread measured between platforms, 1e-5 for pretraining
  and MTP boost up to 2e-3 for RL): beyond it the test fails; within it the test is skipped, its
  reason saying that the 1e-6 check did not run and how to record this platform.
- `test_recordings_agree_across_platforms`: no replay; the recordings of a stage from different
  platforms agree within its cross-platform tolerance. It runs everywhere and catches a recording
  left stale after an intended change, and a tolerance too tight for a platform recorded later.

After an intended change of behaviour (say why in the commit):

    python tests/golden/record.py --check      # replay; which stages differ from which recording
    python tests/golden/record.py              # re-record this platform (others are kept);
                                               # --stage sft re-records one stage

then re-record on the machine of every other directory under `tests/golden/recordings/`, or
delete the directories you cannot re-record (`record.py` lists them when the numbers changed).
To add a platform, run `record.py` on it and commit its new directory.
"""

import pytest

from golden import recordings as rec
from golden.stages import (
    CROSS_PLATFORM_RTOL,
    RESIDUALS,
    RTOL,
    STAGES,
    largest_difference,
    mismatches,
    replay_mismatches,
    rows_of,
    run_stage,
    settings_diff,
    split_rows,
)

HOW_TO_RECORD = (
    "`python tests/golden/record.py` records this platform (tests/golden/recordings/{slug}/; "
    "commit it) so that this test holds it to a relative {rtol:g}"
)


def _settings_hint(recorded: dict, settings: dict) -> str:
    changed = settings_diff(recorded, settings)
    if changed:
        return f"\nthe run's settings differ from the recorded ones at: {', '.join(changed)}"
    return "\nthe run's settings are the recorded ones"


@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_replays_its_golden_run(stage, tmp_path):
    recordings = rec.load(stage)
    assert recordings, f"no recording of {stage}: python tests/golden/record.py --stage {stage}"
    here = rec.current_platform()
    settings, rows = run_stage(stage, tmp_path)
    assert split_rows(rows)[0], f"{stage} logged no per-step rows"

    mine = rec.own(recordings, here)
    if mine is not None:
        name, golden = mine
        bad = replay_mismatches(golden, rows, RTOL)
        if bad:
            hint = _settings_hint(golden["settings"], settings)
            suspects = rec.informational_diff(golden["recorded_with"], rec.recorded_with())
            if suspects:
                hint += "\nrecorded with other versions: " + "; ".join(suspects)
            pytest.fail(
                f"{stage} does not replay its recording {name}/{stage}.json (this platform; "
                f"recorded with {golden['recorded_with']}) to a relative {RTOL:g}: {len(bad)} "
                "value(s) differ, the first:\n  " + "\n  ".join(bad[:5]) + hint + "\nif the "
                "change is intended, re-record (tests/test_golden.py says how)",
                pytrace=False,
            )
        return

    # no recording of this platform: the nearest one, at the cross-platform tolerance
    name, golden = rec.nearest(recordings, here)
    tol = CROSS_PLATFORM_RTOL[stage]
    differs = ", ".join(rec.differing(golden["recorded_with"], here))
    how = HOW_TO_RECORD.format(slug=rec.slug(here), rtol=RTOL)
    where = (
        f"no recording of this platform ({rec.describe(here)}); compared with the nearest, "
        f"{name} (differs in: {differs}), at the cross-platform relative {tol:g}"
    )
    bad = replay_mismatches(golden, rows, tol)
    if bad:
        pytest.fail(
            f"{stage}: {where}: {len(bad)} value(s) differ, the first:\n  "
            + "\n  ".join(bad[:5])
            + _settings_hint(golden["settings"], settings)
            + "\neither the code changed the numbers (a refactor must not), or this platform "
            "differs from the recorded ones more than CROSS_PLATFORM_RTOL allows: then "
            f"{how}, and test_recordings_agree_across_platforms says by how much",
            pytrace=False,
        )
    worst, at = largest_difference(golden, rows)
    pytest.skip(
        f"{stage}: the {RTOL:g} check did not run: {where}, which it meets (largest difference "
        f"{worst:.2g} at {at or '-'}); {how}"
    )


def _common(a: dict, b: dict) -> tuple[dict, dict]:
    """Two recordings restricted to the fields both logged, row by row: one recorded before a
    metric was added (or after one was dropped) still compares on the others; which fields a
    replay must log is the per-platform test's business."""

    def keep(rows: list, others: list) -> list:
        both = zip(rows, others, strict=False)
        return [{k: v for k, v in r.items() if k in o} for r, o in both] + rows[len(others) :]

    out = []
    for x, y in ((a, b), (b, a)):
        out.append({**x, **{s: keep(x[s], y[s]) for s in ("steps", "other_rows")}})
    return out[0], out[1]


@pytest.mark.parametrize("stage", list(STAGES))
def test_recordings_agree_across_platforms(stage):
    recordings = rec.load(stage)
    tol = CROSS_PLATFORM_RTOL[stage]
    names = list(recordings)
    failures = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ra, rb = _common(recordings[a], recordings[b])
            res = RESIDUALS.get(stage, frozenset())
            bad = mismatches("steps", ra["steps"], rb["steps"], tol, res)
            bad += mismatches("other_rows", ra["other_rows"], rb["other_rows"], tol, res)
            if bad:
                worst, at = largest_difference(ra, rows_of(rb))
                commits = [r["recorded_with"]["hybridlm_commit"] for r in (ra, rb)]
                settings = settings_diff(ra["settings"], rb["settings"])
                failures.append(
                    f"{a} vs {b}: {len(bad)} value(s) differ beyond a relative {tol:g}, the "
                    f"largest {worst:.3g} at {at} (recorded at {' / '.join(commits)}; settings "
                    f"differ at: {', '.join(settings) or 'nowhere'})\n  " + "\n  ".join(bad[:3])
                )
    if failures:
        pytest.fail(
            f"the recordings of {stage} disagree between platforms:\n"
            + "\n".join(failures)
            + "\na recording left stale by an intended change (re-record it on its machine, or "
            "delete it), or platforms that differ more than CROSS_PLATFORM_RTOL (golden/stages.py)"
            " allows (widen it with the measurement)",
            pytrace=False,
        )
