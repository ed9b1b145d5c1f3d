"""Interval estimates and curve summaries of the report card: Wilson intervals for rates measured
on samples (Wilson 1927), bootstrap intervals over prompts for acceptance rates, and the windows
that summarise a reward curve by its two ends."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

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


# -- unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", §2.1)
# With n samples per problem of which c pass, the probability that at least one of k samples
# drawn without replacement passes is 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n}
# (1 - k / i); the product form (the paper's numerically stable estimator) avoids the huge
# binomials. A benchmark's score is the mean over problems; its standard error the sample
# standard deviation of the per-problem estimates over sqrt(#problems).


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from `n` samples with `c` correct (needs k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples, got n={n}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(
    num_samples: Sequence[int], num_correct: Sequence[int], k: int
) -> tuple[float, float]:
    """(mean pass@k over problems, its standard error: sample std / sqrt(#problems))."""
    if len(num_samples) != len(num_correct) or not num_samples:
        raise ValueError("give one (n, c) pair per problem, at least one problem")
    vals = [pass_at_k(n, c, k) for n, c in zip(num_samples, num_correct, strict=True)]
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return mean, math.sqrt(var / len(vals))


def env_changes(
    evals: list[dict[str, Any]], metric: str = "solved"
) -> dict[str, tuple[float, float, float, int]]:
    """Per environment (and `all`), the held-out solve rate at the first and last eval
    (`metric`: `solved` greedy, `sampled` at the RL temperature, averaged over a problem's
    samples) and the standard error of the change, (start, end, se, n): two proportions of n
    problems each, conservative for the sampled rate, whose samples of one problem are
    correlated (evaluation noise of one run; training noise needs several seeds,
    rl_learns.py)."""
    if len(evals) < 2:
        return {}
    a, b = evals[0], evals[-1]
    out = {}
    for key in sorted(k for k in a if k.endswith(f"/{metric}") and k in b):
        env = key.removesuffix(f"/{metric}")
        n = int(a.get(f"{env}/count") or 0)
        if n:
            p, q = a[key], b[key]
            se = ((p * (1 - p) + q * (1 - q)) / n) ** 0.5
            out[env] = (p, q, se, n)
    return out


def change_text(delta: float, se: float) -> str:
    """A change with its standard error, and plainly when it is within noise (< 2 SE)."""
    if se <= 0:
        return f"{delta:+.2f}"
    z = delta / se
    verdict = "within noise" if abs(z) < 2 else ("up" if z > 0 else "down")
    return f"{delta:+.2f} ± {se:.2f}, {verdict}"
