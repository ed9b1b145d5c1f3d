"""Interval estimates and curve summaries of the report card: Wilson intervals for rates measured
on samples (Wilson 1927), bootstrap intervals over prompts for acceptance rates, and the windows
that summarise a reward curve by its two ends."""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927): sensible at 0 / n and n."""
    if n <= 0:
        return (math.nan, math.nan)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def rate_ci(p: float, n: int) -> tuple[float, float]:
    """95% Wilson interval of a rate `p` measured on `n` items (successes = round(p * n))."""
    return wilson_interval(round(p * n), n)


def bootstrap_positions(
    by_prompt: list[list[list[int]]], *, iters: int = 2000, seed: int = 0
) -> list[tuple[float, float]]:
    """95% percentile intervals of the acceptance rate at each draft position (accepted / drafted,
    a ratio of sums), resampling prompts: drafts of one prompt are not independent."""
    import numpy as np

    acc = np.array([p[0] for p in by_prompt], dtype=np.float64)  # [prompts, K]
    drafted = np.array([p[1] for p in by_prompt], dtype=np.float64)
    n = len(by_prompt)
    idx = np.random.default_rng(seed).integers(0, n, size=(iters, n))
    num, den = acc[idx].sum(1), drafted[idx].sum(1)  # [iters, K]
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = num / den
    out = []
    for k in range(acc.shape[1]):
        r = ratio[:, k][np.isfinite(ratio[:, k])]
        out.append(
            (float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))) if len(r) else (0, 0)
        )
    return out


def heal_intervals(row: dict) -> list[tuple[float, float]] | None:
    """95% intervals of a healing acceptance row by position (None: no counts recorded)."""
    if len(row.get("by_prompt") or []) >= 2:
        return bootstrap_positions(row["by_prompt"])
    return None


def reward_window(steps: int, most: int = 10) -> int:
    """Steps averaged at each end of a curve: up to `most`, at most half of them (0 for none)."""
    return min(most, max(steps // 2, 1)) if steps else 0


def reward_ends(rewards: list[float]) -> tuple[int, float | None, float | None]:
    """(k, mean of the first k, mean of the last k) of a reward curve, k = `reward_window`, so
    the two ends do not overlap; (0, None, None) for an empty curve."""
    k = reward_window(len(rewards))
    if not k:
        return 0, None, None
    return k, sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def window_text(k: int, n: int) -> str:
    """How `reward_ends` of `n` steps averaged its ends (window `k`), for a report."""
    if k == 1:
        return f"first -> last step of {n}"
    return f"mean of the first / last {k} of {n} steps"
