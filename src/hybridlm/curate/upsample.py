"""Quality-aware up-sampling curves (Olmo 3 §2.6).

Instead of keeping a flat top quantile (DCLM), every topic gets a monotone curve
f(x) = repetition factor of a document at quality percentile x in [0, 1]:

    f(x) = 0                                 x < drop_below        (drop the bottom)
    f(x) = min(max_factor, c * g(u))         u = (x - drop_below) / (1 - drop_below)

with a fixed shape g (`exp`: e^(k u), `power`: u^k, `linear`: u) and a scale c solved by
bisection so that the curve meets its constraint. Olmo 3's constraints, all checked in tests:

  1. the curve is monotone non-decreasing (higher quality is never repeated less);
  2. max up-sampling factor 7 (`max_factor`);
  3. its integral matches the topic's target: either the mean repetition `fit_mean(m)` (a token
     share relative to the pool, buckets of equal size) or, with the tokens each bucket holds,
     `fit_tokens(bucket_tokens, target)`: sum_b rate_b * tokens_b == target tokens.

A bucket's rate is the curve's integral over the bucket's percentile range divided by its width
(Olmo 3 §2.6), computed by Gauss-Legendre quadrature between the kinks of f (`drop_below` and the
point where the cap starts), so it is exact up to float rounding for the linear and power
shapes and to ~1e-12 for exp. A fractional rate r becomes floor(r) copies plus one more with
probability r - floor(r), drawn from a hash of (seed, document id) (`repeat_count`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..report.plot import pyplot, save_figure
from .core import CurateDoc, Decision, GlobalStage, register_stage

Shape = Literal["exp", "power", "linear"]
_GL_X, _GL_W = np.polynomial.legendre.leggauss(16)


@dataclass(kw_only=True)
class CurveConfig:
    """The curve family: `shape` with `steepness` k, `drop_below` percentile, `max_factor`
    (Olmo 3 §2.6: 7), `num_buckets` (vingtiles: 20)."""

    shape: Shape = "exp"
    steepness: float = 4.0
    drop_below: float = 0.0
    max_factor: float = 7.0
    num_buckets: int = 20

    def __post_init__(self) -> None:
        if self.shape not in ("exp", "power", "linear"):
            raise ValueError(f"curve shape must be exp, power or linear, got {self.shape!r}")
        if self.steepness <= 0:
            raise ValueError(f"curve steepness must be positive, got {self.steepness}")
        if not 0.0 <= self.drop_below < 1.0:
            raise ValueError(f"drop_below must be in [0, 1), got {self.drop_below}")
        if self.max_factor <= 0:
            raise ValueError(f"max_factor must be positive, got {self.max_factor}")
        if self.num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {self.num_buckets}")


@dataclass(kw_only=True)
class UpsampleCurve:
    """A fitted curve: the family and its scale `c`."""

    cfg: CurveConfig = field(default_factory=CurveConfig)
    scale: float = 0.0

    # ------------------------------------------------------------------ the curve
    def _g(self, u: np.ndarray) -> np.ndarray:
        k = self.cfg.steepness
        if self.cfg.shape == "exp":
            return np.exp(k * u)
        if self.cfg.shape == "power":
            return u**k
        return u

    def __call__(self, x: Sequence[float] | np.ndarray | float) -> np.ndarray:
        """Repetition factor at quality percentile(s) x in [0, 1]."""
        x = np.asarray(x, dtype=np.float64)
        x0 = self.cfg.drop_below
        u = np.clip((x - x0) / (1.0 - x0), 0.0, 1.0)
        y = np.minimum(self.cfg.max_factor, self.scale * self._g(u))
        return np.where(x < x0, 0.0, y)

    def _kinks(self) -> list[float]:
        """Percentiles where f is not smooth: drop_below and the start of the cap."""
        x0, cfg = self.cfg.drop_below, self.cfg
        points = [x0]
        if self.scale > 0:
            # g(u*) = max_factor / c, with g increasing
            target = cfg.max_factor / self.scale
            if cfg.shape == "exp":
                u_star = math.log(target) / cfg.steepness if target > 0 else -1.0
            elif cfg.shape == "power":
                u_star = target ** (1.0 / cfg.steepness)
            else:
                u_star = target
            if 0.0 < u_star < 1.0:
                points.append(x0 + u_star * (1.0 - x0))
        return points

    def integral(self, a: float, b: float) -> float:
        """Integral of f over [a, b] (Gauss-Legendre on each smooth piece)."""
        cuts = [a, *sorted(p for p in self._kinks() if a < p < b), b]
        total = 0.0
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            mid, half = 0.5 * (lo + hi), 0.5 * (hi - lo)
            total += half * float(np.sum(_GL_W * self(mid + half * _GL_X)))
        return total

    def rates(self) -> np.ndarray:
        """Repetition rate of each of the `num_buckets` equal-width percentile buckets:
        integral over the bucket / its width (Olmo 3 §2.6)."""
        n = self.cfg.num_buckets
        return np.array([self.integral(b / n, (b + 1) / n) * n for b in range(n)])

    def mean(self) -> float:
        """Mean repetition over the pool (the curve's integral over [0, 1])."""
        return float(self.rates().mean())

    def to_dict(self) -> dict[str, Any]:
        return {"cfg": asdict(self.cfg), "scale": self.scale}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UpsampleCurve:
        return cls(cfg=CurveConfig(**data["cfg"]), scale=float(data["scale"]))

    # ------------------------------------------------------------------ fitting
    @classmethod
    def fit_tokens(
        cls,
        bucket_tokens: Sequence[float],
        target_tokens: float,
        cfg: CurveConfig | None = None,
        *,
        rtol: float = 1e-10,
    ) -> UpsampleCurve:
        """The curve whose bucket rates produce `target_tokens` from buckets holding
        `bucket_tokens` (bucket b = percentiles [b/B, (b+1)/B))."""
        cfg = cfg or CurveConfig(num_buckets=len(bucket_tokens))
        t_B = np.asarray(bucket_tokens, dtype=np.float64)
        if len(t_B) != cfg.num_buckets:
            raise ValueError(f"{len(t_B)} bucket token counts for {cfg.num_buckets} buckets")
        if (t_B < 0).any():
            raise ValueError("bucket token counts must be >= 0")
        if target_tokens < 0:
            raise ValueError(f"target tokens must be >= 0, got {target_tokens}")

        def produced(scale: float) -> float:
            return float(UpsampleCurve(cfg=cfg, scale=scale).rates() @ t_B)

        # the supremum: every bucket above drop_below at max_factor
        ceiling = produced(1e300)
        if target_tokens > ceiling * (1 + 1e-12):
            raise ValueError(
                f"target of {target_tokens:.6g} tokens is out of reach: at most "
                f"{ceiling:.6g} with max_factor {cfg.max_factor} and drop_below "
                f"{cfg.drop_below}; lower the target or raise max_factor"
            )
        if target_tokens == 0:
            return cls(cfg=cfg, scale=0.0)
        lo, hi = 0.0, 1.0
        while produced(hi) < target_tokens and hi < 1e300:
            hi *= 2.0
        for _ in range(200):  # produced(scale) is continuous and non-decreasing
            mid = 0.5 * (lo + hi)
            if produced(mid) < target_tokens:
                lo = mid
            else:
                hi = mid
            if hi - lo <= rtol * hi:
                break
        return cls(cfg=cfg, scale=hi)

    @classmethod
    def fit_mean(cls, mean_repetition: float, cfg: CurveConfig | None = None) -> UpsampleCurve:
        """The curve whose mean repetition over equal-size buckets is `mean_repetition`
        (= topic share x total training tokens / the topic's pool tokens)."""
        cfg = cfg or CurveConfig()
        return cls.fit_tokens([1.0] * cfg.num_buckets, mean_repetition * cfg.num_buckets, cfg)


def plan_upsampling(
    bucket_tokens: Mapping[str, Sequence[float]],
    target_tokens: Mapping[str, float],
    cfg: CurveConfig | None = None,
) -> dict[str, UpsampleCurve]:
    """One curve per topic (Olmo 3: 24 web topics), each meeting its topic's token target."""
    missing = sorted(set(bucket_tokens) ^ set(target_tokens))
    if missing:
        raise ValueError(f"topics {missing} need both bucket tokens and a target")
    out = {}
    for topic, tokens in bucket_tokens.items():
        c = cfg or CurveConfig(num_buckets=len(tokens))
        try:
            out[topic] = UpsampleCurve.fit_tokens(tokens, target_tokens[topic], c)
        except ValueError as err:
            raise ValueError(f"topic {topic!r}: {err}") from None
    return out


def repeat_count(rate: float, key: str, seed: int = 0) -> int:
    """floor(rate) copies, plus one with probability rate - floor(rate) (a hash of seed, key):
    the expected count is `rate`."""
    if rate < 0:
        raise ValueError(f"rate must be >= 0, got {rate}")
    base = math.floor(rate)
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "little") >> 11) / float(1 << 53)
    return base + int(u < rate - base)


# ---------------------------------------------------------------------------- report
def write_curves(curves: Mapping[str, UpsampleCurve], path: str | Path) -> Path:
    """One JSON row per topic: the curve, its bucket rates and a dense sample of f (the PNG is
    rendered from this file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    xs = np.linspace(0.0, 1.0, 201)
    with path.open("w") as f:
        for topic, curve in curves.items():
            row = {
                "kind": "upsample_curve",
                "topic": topic,
                **curve.to_dict(),
                "rates": curve.rates().tolist(),
                "mean": curve.mean(),
                "x": xs.tolist(),
                "y": curve(xs).tolist(),
            }
            f.write(json.dumps(row) + "\n")
    return path


def plot_curves(jsonl: str | Path, png: str | Path) -> Path:
    """Curves (lines) and bucket rates (steps) of every topic in `jsonl`, as a PNG."""
    plt = pyplot()

    rows = [json.loads(x) for x in Path(jsonl).read_text().splitlines() if x.strip()]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, row in enumerate(rows):
        color = f"C{k % 10}"
        ax.plot(
            row["x"],
            row["y"],
            color=color,
            lw=1.5,
            label=f"{row['topic']} (mean {row['mean']:.2f})",
        )
        n = len(row["rates"])
        edges = np.arange(n + 1) / n
        ax.stairs(row["rates"], edges, color=color, ls=":", lw=1)
    cap = max(r["cfg"]["max_factor"] for r in rows) if rows else 7
    ax.axhline(cap, color="gray", lw=0.8, ls="--")
    ax.set(
        xlabel="quality percentile",
        ylabel="repetition factor",
        title="quality-aware up-sampling (curve; dotted: bucket rates)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, png)


# ---------------------------------------------------------------------------- stage
@register_stage("upsample")
@dataclass(kw_only=True)
class UpsampleStage(GlobalStage):
    """Fit one curve per topic over the corpus (tokens measured as characters; buckets from
    `metadata[bucket_key]`) so each topic yields `targets[topic]` characters, then write
    `metadata["repeat"]` = the document's copy count; documents with 0 copies are dropped.
    A topic missing from `targets` keeps its documents once. The curation writer
    (`pipeline.run_curate`, `expand_repeats`) writes each document that many times."""

    targets: dict[str, float] = field(default_factory=dict)  # topic -> target characters
    topic_key: str = "topic"
    bucket_key: str = "quality_bucket"
    shape: Shape = "exp"
    steepness: float = 4.0
    drop_below: float = 0.0
    max_factor: float = 7.0
    num_buckets: int = 20
    seed: int = 0

    def _cfg(self) -> CurveConfig:
        return CurveConfig(
            shape=self.shape,
            steepness=self.steepness,
            drop_below=self.drop_below,
            max_factor=self.max_factor,
            num_buckets=self.num_buckets,
        )

    def _key(self, doc: CurateDoc) -> tuple[str, int]:
        if self.bucket_key not in doc.metadata:
            raise ValueError(
                f"document {doc.id!r} has no metadata[{self.bucket_key!r}]; run "
                "'quality_buckets' first"
            )
        return str(doc.metadata.get(self.topic_key, "")), int(doc.metadata[self.bucket_key])

    def observe(self, docs: Sequence[CurateDoc]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for doc in docs:
            topic, bucket = self._key(doc)
            out.setdefault(topic, [0.0] * self.num_buckets)[bucket] += len(doc.text)
        return out

    def plan(self, partials: Sequence[dict[str, list[float]]]) -> list[Any]:
        totals: dict[str, np.ndarray] = {}
        for part in partials:
            for topic, chars in part.items():
                totals[topic] = totals.get(topic, np.zeros(self.num_buckets)) + np.asarray(chars)
        fitted = {t: self.targets[t] for t in totals if t in self.targets}
        curves = plan_upsampling({t: totals[t] for t in fitted}, fitted, self._cfg())
        rates = {t: c.rates().tolist() for t, c in curves.items()}
        return [rates for _ in partials]

    def apply(self, doc: CurateDoc, position: int, shard_plan: Any) -> Decision:
        topic, bucket = self._key(doc)
        rate = shard_plan[topic][bucket] if topic in shard_plan else 1.0
        copies = repeat_count(rate, doc.id, self.seed)
        doc.metadata["repeat"] = copies
        if copies == 0:
            return Decision.drop(f"{self.name}:zero_rate", rate=rate)
        return Decision.ok(repeat=copies, rate=rate)
