"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", §2.1).

With n samples per problem of which c pass, the probability that at least one of k samples drawn
without replacement passes is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i),

the product form (the paper's numerically stable estimator) avoids the huge binomials. The
benchmark score is the mean over problems; its standard error is the sample standard deviation
of the per-problem estimates over sqrt(#problems) (the sampling noise within a problem is
already averaged by the estimator).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


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
