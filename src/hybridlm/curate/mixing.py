"""Swarm-based mixture optimisation (Olmo 3 §2.5; after RegMix / Data Mixing Laws / Olmix).

Shape legend: K swarm runs, D domains (sources), T tasks (here: per-domain held-out bits per
byte), F regression features.

    1. swarm: K mixtures from a Dirichlet centred on a prior (the natural distribution), alpha =
       `concentration` x prior; Olmo 3's rule of thumb K = 5 x D (`num_runs=0`);
    2. proxies: one small model per mixture, scored on every task. `TrainerProxy` trains a tiny
       `HybridLM` with the project's trainer (`run_pretrain`, sources as shard directories) and
       measures each domain's held-out bpb; `BigramProxy` is a smoothed token-bigram LM on the
       same shards (milliseconds per run; the notes' "n-gram LM" proxy), for tests and quick
       sweeps. Any callable `(weights: dict[str, float], run: int) -> dict[str, float]` works;
    3. regression: one model per task from mixture weights to loss (`MixtureRegression`):
       `loglinear` log L = b + a.w (Data Mixing Laws' exponential law, convex in w), `quadratic`
       L = b + a.w + w'Qw, or `linear`; ridge least squares;
    4. optimisation: minimise the (weighted) mean predicted loss over the simplex with repetition
       caps w_d x total_tokens <= max_repetition x available_tokens_d (Olmo 3: ~4-7x), by
       projected gradient descent started from the prior, the uniform mixture and every swarm
       mixture (guided search from the prior);
    5. output: a `DataConfig` YAML with the optimised source weights (`write_mixture`), which
       `hybridlm.data.pipeline` / the pretraining loader read as is; or a two-phase curriculum
       (`write_curriculum`, Nemotron 3 Super §2.3: phase 2 = the last 20% of tokens with a
       higher-quality blend) from two weight vectors: the swarm optimum for phase 1 and, for
       phase 2, a user-supplied vector or the optimum under a quality-weighted objective (task
       weights that favour the high-quality domains' held-out losses).

Every swarm run appends a row to `<out>/swarm.jsonl`; `plot_swarm` renders observed vs predicted
losses from it.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ..config import ModelConfig
from ..data.bpb import token_byte_lengths
from ..data.config import DataConfig, SourceConfig
from ..data.loader import IGNORE_INDEX, PackedLoader, Phase
from ..data.pipeline import build_tokenizer, prepare_shards
from ..data.shards import ShardSet
from ..data.tokenizer import ByteTokenizer
from ..io import load_model
from ..presets import get_preset
from ..report.plot import pyplot, save_figure
from ..train.config import RunConfig, TrainConfig
from ..train.objectives import causal_lm_loss
from ..train.stages.pretrain import run_pretrain

Proxy = Callable[[dict[str, float], int], dict[str, float]]
RegressionKind = Literal["loglinear", "quadratic", "linear"]


# ---------------------------------------------------------------------------- swarm sampling
def normalise(weights: Mapping[str, float]) -> dict[str, float]:
    """Weights scaled to sum to 1 (ValueError on negatives or an all-zero mapping)."""
    if any(w < 0 for w in weights.values()):
        raise ValueError(f"mixture weights must be >= 0, got {dict(weights)}")
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("mixture weights must have a positive sum")
    return {k: v / total for k, v in weights.items()}


def sample_mixtures(
    prior: Mapping[str, float], num_runs: int, *, concentration: float = 10.0, seed: int = 0
) -> np.ndarray:
    """[K, D] mixtures from Dirichlet(concentration x prior) (Olmo 3 §2.5: centred on the
    natural distribution); columns in `prior`'s order."""
    if num_runs < 1:
        raise ValueError(f"num_runs must be >= 1, got {num_runs}")
    if concentration <= 0:
        raise ValueError(f"concentration must be positive, got {concentration}")
    p_D = np.array(list(normalise(prior).values()))
    if (p_D <= 0).any():
        raise ValueError("every domain needs a positive prior weight to be sampled")
    return np.random.default_rng(seed).dirichlet(concentration * p_D, size=num_runs)


# ---------------------------------------------------------------------------- proxies
def _train_tokens(sets: ShardSet, eval_fraction: float) -> tuple[ShardSet, ShardSet]:
    return sets.split(eval_fraction=eval_fraction, method="hash")


class BigramProxy:
    """A token-bigram LM with interpolated add-k smoothing, trained on `budget` tokens drawn
    from the domains in proportion to the mixture (each domain's training documents in a seeded
    order, repeated when the share exceeds them) and scored by held-out bpb on every domain.
    Needs byte-tokenizer shards (ids are bytes, so bits per byte are exact)."""

    def __init__(
        self,
        shard_dirs: Mapping[str, str | Path],
        *,
        budget: int = 20_000,
        eval_fraction: float = 0.2,
        smoothing: float = 0.1,
        unigram_weight: float = 0.1,
        seed: int = 0,
    ) -> None:
        self.domains = list(shard_dirs)
        self.budget, self.smoothing, self.lam, self.seed = budget, smoothing, unigram_weight, seed
        self.train: dict[str, np.ndarray] = {}
        self.held: dict[str, np.ndarray] = {}
        vocab = 0
        for name, path in shard_dirs.items():
            s = ShardSet(path)
            vocab = max(vocab, s.vocab_size)
            tr, ho = _train_tokens(s, eval_fraction)
            if not len(ho) or not len(tr):
                raise ValueError(f"domain {name!r}: too few documents for a held-out split")
            order = np.random.default_rng(seed).permutation(len(tr))
            self.train[name] = np.concatenate([np.asarray(tr.document(int(i))) for i in order])
            self.held[name] = np.concatenate([np.asarray(d) for d in ho])
        if vocab != ByteTokenizer.vocab_size:
            raise ValueError(
                f"BigramProxy needs shards of the byte tokenizer ({ByteTokenizer.vocab_size} ids), "
                f"got a vocabulary of {vocab}; use TrainerProxy for BPE shards"
            )
        self.vocab = vocab

    def __call__(self, weights: dict[str, float], run: int = 0) -> dict[str, float]:
        v = self.vocab
        pair_VV = np.zeros((v, v))
        for name, w in normalise(weights).items():
            n = int(round(w * self.budget))
            if n < 2:
                continue
            src = self.train[name]
            toks = np.resize(src, n)  # repeats the domain when its share exceeds it
            np.add.at(pair_VV, (toks[:-1], toks[1:]), 1.0)
        uni_V = (pair_VV.sum(0) + self.smoothing) / (pair_VV.sum() + self.smoothing * v)
        row_V = pair_VV.sum(1, keepdims=True)
        cond_VV = (pair_VV + self.smoothing * uni_V) / (row_V + self.smoothing)
        prob_VV = (1 - self.lam) * cond_VV + self.lam * uni_V
        out = {}
        for name, held in self.held.items():
            # BOS opens a document (context only); EOS is scored but has no bytes
            tgt = held[1:] != ByteTokenizer.bos_id
            nll = -np.log2(prob_VV[held[:-1][tgt], held[1:][tgt]])
            n_bytes = int((held[1:] < 256).sum())
            out[f"{name}_bpb"] = float(nll.sum() / n_bytes)
        return out


@torch.no_grad()
def held_out_bpb(
    model: torch.nn.Module,
    sets: ShardSet,
    *,
    seq_len: int,
    batch_size: int,
    token_bytes: torch.Tensor,
    max_batches: int = 0,
) -> float:
    """Bits per byte of `model` on the documents of `sets` (read once, packed best-fit)."""
    loader = PackedLoader(sets, seq_len=seq_len, batch_size=batch_size, sequential=True)
    nats, n_bytes = 0.0, 0.0
    model.eval()
    for k, batch in enumerate(loader):
        if max_batches and k >= max_batches:
            break
        out = model(batch["input_ids"], return_logits=False)
        # num_valid_tokens=1: the CE is then the sum of nats
        _, parts = causal_lm_loss(model, out, batch["labels"], num_valid_tokens=1)
        nats += float(parts["ce"])
        tgt = batch["labels"][:, 1:]
        n_bytes += float(token_bytes[tgt[tgt != IGNORE_INDEX]].sum())
    return nats / (math.log(2) * n_bytes) if n_bytes else math.nan


@dataclass(kw_only=True)
class TrainerProxy:
    """A tiny model per mixture, trained by `hybridlm.train.run_pretrain` on the domains' shard
    directories (sources of kind `shards`), then scored by held-out bpb on every domain (the
    held-out documents are the hash split the run itself leaves out)."""

    shard_dirs: dict[str, str]
    model: ModelConfig
    out_dir: str
    steps: int = 30
    seq_len: int = 64
    batch_size: int = 4
    lr: float = 3e-3
    warmup_steps: int = 3
    eval_fraction: float = 0.2
    eval_batches: int = 4  # per domain; 0 = all held-out documents
    tokenizer: str = "byte"
    seed: int = 0
    last_result: dict[str, Any] = field(default_factory=dict, repr=False)  # run_pretrain's

    def run_config(self, weights: Mapping[str, float], run: int) -> RunConfig:
        data = DataConfig(
            sources=[
                SourceConfig(name=n, kind="shards", path=str(p), weight=float(weights.get(n, 0)))
                for n, p in self.shard_dirs.items()
            ],
            tokenizer=self.tokenizer,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            eval_fraction=self.eval_fraction,
            num_workers=0,
            seed=self.seed,
        )
        train = TrainConfig(
            lr=self.lr,
            min_lr=self.lr / 10,
            warmup_steps=self.warmup_steps,
            max_steps=self.steps,
            eval_interval=0,
            eval_batches=self.eval_batches,
            log_interval=max(1, self.steps // 5),
            checkpoint_interval=0,
            keep_last_n=1,
            out_dir=str(Path(self.out_dir) / f"run_{run:03d}"),
            seed=self.seed,
            device="cpu",
            peak_flops=1e12,
            progress=False,
            plot=False,
        )
        return RunConfig(model=copy.deepcopy(self.model), data=data, train=train)

    def __call__(self, weights: dict[str, float], run: int = 0) -> dict[str, float]:
        run_cfg = self.run_config(weights, run)
        # a proxy run's directory belongs to this swarm: a rerun of the swarm replaces it
        result = self.last_result = run_pretrain(run_cfg, overwrite=True)
        model = load_model(result["checkpoint"])
        model_cfg = model.config
        token_bytes = token_byte_lengths(build_tokenizer(run_cfg.data), model_cfg.vocab_size)
        out = {}
        for name, path in self.shard_dirs.items():
            _, held = _train_tokens(ShardSet(path), self.eval_fraction)
            if not len(held):
                raise ValueError(f"domain {name!r} has no held-out documents; raise eval_fraction")
            out[f"{name}_bpb"] = held_out_bpb(
                model,
                held,
                seq_len=self.seq_len,
                batch_size=self.batch_size,
                token_bytes=token_bytes,
                max_batches=self.eval_batches,
            )
        return out


# ---------------------------------------------------------------------------- swarm
@dataclass(kw_only=True)
class SwarmResult:
    """Mixtures [K, D] and task losses [K, T] of a swarm."""

    domains: list[str]
    tasks: list[str]
    weights: np.ndarray
    losses: np.ndarray

    @classmethod
    def from_jsonl(cls, path: str | Path) -> SwarmResult:
        rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        rows = [r for r in rows if r.get("kind") == "swarm_run"]
        if not rows:
            raise ValueError(f"no swarm runs in {path}")
        domains, tasks = list(rows[0]["weights"]), list(rows[0]["losses"])
        return cls(
            domains=domains,
            tasks=tasks,
            weights=np.array([[r["weights"][d] for d in domains] for r in rows]),
            losses=np.array([[r["losses"][t] for t in tasks] for r in rows]),
        )


def run_swarm(
    prior: Mapping[str, float],
    proxy: Proxy,
    *,
    num_runs: int = 0,
    concentration: float = 10.0,
    seed: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = True,
) -> SwarmResult:
    """Sample the swarm (K = 5 x D when `num_runs` is 0), run the proxy on every mixture, and
    append one `swarm_run` row per run to `<out_dir>/swarm.jsonl`."""
    domains = list(prior)
    k = num_runs or 5 * len(domains)
    w_KD = sample_mixtures(prior, k, concentration=concentration, seed=seed)
    sink = None
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        sink = (Path(out_dir) / "swarm.jsonl").open("w")
    rows: list[dict[str, float]] = []
    try:
        from rich.progress import Progress

        with Progress(disable=not progress) as bar:
            task = bar.add_task("swarm", total=k)
            for run in range(k):
                weights = dict(zip(domains, w_KD[run].tolist(), strict=True))
                losses = proxy(weights, run)
                rows.append(losses)
                if sink is not None:
                    row = {"kind": "swarm_run", "run": run, "weights": weights, "losses": losses}
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                bar.update(task, advance=1)
    finally:
        if sink is not None:
            sink.close()
    tasks = list(rows[0])
    return SwarmResult(
        domains=domains,
        tasks=tasks,
        weights=w_KD,
        losses=np.array([[r[t] for t in tasks] for r in rows]),
    )


# ---------------------------------------------------------------------------- regression
@dataclass(kw_only=True)
class MixtureRegression:
    """One regression per task from mixture weights to loss (see the module docstring)."""

    kind: RegressionKind = "quadratic"
    ridge: float = 1e-3
    coef: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [F, T]

    def features(self, w_ND: np.ndarray) -> np.ndarray:
        """[N, F]: 1, w, and (quadratic) the products w_i w_j for i <= j."""
        w_ND = np.atleast_2d(np.asarray(w_ND, dtype=np.float64))
        cols = [np.ones((len(w_ND), 1)), w_ND]
        if self.kind == "quadratic":
            i, j = np.triu_indices(w_ND.shape[1])
            cols.append(w_ND[:, i] * w_ND[:, j])
        return np.concatenate(cols, axis=1)

    def fit(self, w_KD: np.ndarray, y_KT: np.ndarray) -> MixtureRegression:
        if self.kind not in ("loglinear", "quadratic", "linear"):
            raise ValueError(f"regression kind must be loglinear, quadratic or linear: {self.kind}")
        x_KF = self.features(w_KD)
        y_KT = np.asarray(y_KT, dtype=np.float64)
        if y_KT.ndim != 2 or len(y_KT) != len(x_KF):
            raise ValueError(f"need losses [K, T] for {len(x_KF)} mixtures, got {y_KT.shape}")
        if self.kind == "loglinear":
            if (y_KT <= 0).any():
                raise ValueError("loglinear regression needs positive losses")
            y_KT = np.log(y_KT)
        # ridge on everything but the intercept; lstsq is stable when K < F
        pen_F = np.full(x_KF.shape[1], math.sqrt(self.ridge))
        pen_F[0] = 0.0
        a = np.concatenate([x_KF, np.diag(pen_F)])
        b = np.concatenate([y_KT, np.zeros((x_KF.shape[1], y_KT.shape[1]))])
        self.coef = np.linalg.lstsq(a, b, rcond=None)[0]
        return self

    def predict(self, w_ND: np.ndarray) -> np.ndarray:
        """Predicted losses [N, T]."""
        out = self.features(w_ND) @ self.coef
        return np.exp(out) if self.kind == "loglinear" else out

    def grad(self, w_D: np.ndarray) -> np.ndarray:
        """d prediction / d w, [T, D], at one mixture."""
        d = len(w_D)
        lin_TD = self.coef[1 : 1 + d].T
        if self.kind == "linear":
            return lin_TD
        if self.kind == "loglinear":
            return self.predict(w_D)[0][:, None] * lin_TD
        i, j = np.triu_indices(d)
        q_T = self.coef[1 + d :].T  # [T, pairs]
        g_TD = lin_TD.copy()
        np.add.at(g_TD.T, i, (q_T * w_D[j]).T)
        np.add.at(g_TD.T, j, (q_T * w_D[i]).T)
        return g_TD

    def r2(self, w_KD: np.ndarray, y_KT: np.ndarray) -> np.ndarray:
        """Coefficient of determination per task [T]."""
        resid = ((self.predict(w_KD) - y_KT) ** 2).sum(0)
        total = ((y_KT - y_KT.mean(0)) ** 2).sum(0)
        return 1.0 - resid / np.maximum(total, 1e-300)


# ---------------------------------------------------------------------------- optimisation
def project_capped_simplex(v_D: np.ndarray, caps_D: np.ndarray) -> np.ndarray:
    """Euclidean projection onto {w : sum w = 1, 0 <= w <= caps}: w = clip(v - tau, 0, caps)
    with tau found by bisection (sum is monotone in tau)."""
    v_D, caps_D = np.asarray(v_D, np.float64), np.asarray(caps_D, np.float64)
    if caps_D.sum() < 1 - 1e-12:
        raise ValueError(f"caps {caps_D.tolist()} sum to {caps_D.sum():.4f} < 1: infeasible")
    lo, hi = float((v_D - caps_D).min()) - 1.0, float(v_D.max())
    while hi - lo > 1e-14 * max(1.0, abs(hi)):
        tau = 0.5 * (lo + hi)
        if np.clip(v_D - tau, 0, caps_D).sum() > 1:
            lo = tau
        else:
            hi = tau
    w = np.clip(v_D - 0.5 * (lo + hi), 0, caps_D)
    return w / w.sum() if abs(w.sum() - 1) > 1e-9 else w


def repetition_caps(
    domains: Sequence[str],
    available_tokens: Mapping[str, float] | None,
    total_tokens: float,
    max_repetition: float,
) -> np.ndarray:
    """Upper bound on each weight: w_d <= max_repetition x available_d / total (Olmo 3 §2.5:
    ~4-7x repetition per domain), and <= 1."""
    if not available_tokens:
        return np.ones(len(domains))
    if total_tokens <= 0 or max_repetition <= 0:
        raise ValueError("total_tokens and max_repetition must be positive to cap repetition")
    missing = [d for d in domains if d not in available_tokens]
    if missing:
        raise ValueError(f"available_tokens lacks domains {missing}")
    caps = np.array([max_repetition * available_tokens[d] / total_tokens for d in domains])
    if caps.sum() < 1.0:
        raise ValueError(
            f"total_tokens {total_tokens:.4g} needs more than max_repetition {max_repetition} "
            f"x the {sum(available_tokens[d] for d in domains):.4g} available tokens; raise "
            "max_repetition, lower total_tokens or add data"
        )
    return np.minimum(caps, 1.0)


@dataclass(kw_only=True)
class MixtureOptimum:
    weights: dict[str, float]
    predicted: dict[str, float]  # task -> predicted loss at the optimum
    objective: float
    caps: dict[str, float]


def optimize_mixture(
    reg: MixtureRegression,
    domains: Sequence[str],
    *,
    prior: Mapping[str, float] | None = None,
    starts: np.ndarray | None = None,
    available_tokens: Mapping[str, float] | None = None,
    total_tokens: float = 0.0,
    max_repetition: float = 4.0,
    task_weights: Sequence[float] | None = None,
    tasks: Sequence[str] | None = None,
    steps: int = 500,
) -> MixtureOptimum:
    """Minimise the weighted mean predicted task loss over the capped simplex (see the module
    docstring), by projected gradient descent with backtracking from several starts."""
    d = len(domains)
    caps_D = repetition_caps(domains, available_tokens, total_tokens, max_repetition)
    n_tasks = reg.coef.shape[1]
    tw_T = np.full(n_tasks, 1.0 / n_tasks) if task_weights is None else np.asarray(task_weights)
    tw_T = tw_T / tw_T.sum()

    def f(w_D: np.ndarray) -> float:
        return float(reg.predict(w_D)[0] @ tw_T)

    inits = [np.full(d, 1.0 / d)]
    if prior is not None:
        inits.insert(0, np.array([normalise(prior)[k] for k in domains]))
    if starts is not None:
        inits += list(np.asarray(starts))
    best_w, best_f = None, math.inf
    for w0 in inits:
        w = project_capped_simplex(w0, caps_D)
        fw, lr = f(w), 1.0
        for _ in range(steps):
            g_D = tw_T @ reg.grad(w)
            while True:  # backtracking (Armijo) on the projected step
                cand = project_capped_simplex(w - lr * g_D, caps_D)
                fc = f(cand)
                if fc <= fw - 1e-4 / lr * float(((cand - w) ** 2).sum()) or lr < 1e-10:
                    break
                lr *= 0.5
            if np.abs(cand - w).max() < 1e-10:
                break
            w, fw, lr = cand, fc, min(lr * 2.0, 1e3)
        if fw < best_f:
            best_w, best_f = w, fw
    assert best_w is not None
    names = list(tasks) if tasks is not None else [f"task{t}" for t in range(n_tasks)]
    return MixtureOptimum(
        weights=dict(zip(domains, best_w.tolist(), strict=True)),
        predicted=dict(zip(names, reg.predict(best_w)[0].tolist(), strict=True)),
        objective=best_f,
        caps=dict(zip(domains, caps_D.tolist(), strict=True)),
    )


# ---------------------------------------------------------------------------- output
def write_mixture(path: str | Path, base: DataConfig, weights: Mapping[str, float]) -> DataConfig:
    """`base` with its source weights replaced by `weights` (curriculum phases cleared), saved
    as YAML / JSON in `DataConfig`'s schema: `DataConfig.load(path)` and the pretraining loader
    read it directly."""
    names = [s.name for s in base.sources]
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"weights for unknown sources {unknown}; the config has {names}")
    cfg = copy.deepcopy(base)
    w = normalise({n: float(weights.get(n, 0.0)) for n in names})
    for src in cfg.sources:
        src.weight = round(w[src.name], 6)
    cfg.phases = []
    cfg.validate()
    cfg.save(path)
    return cfg


def write_curriculum(
    path: str | Path,
    base: DataConfig,
    phase1: Mapping[str, float],
    phase2: Mapping[str, float],
    *,
    phase2_fraction: float = 0.2,
    total_tokens: int = 0,
) -> DataConfig:
    """`base` with a two-phase curriculum in `DataConfig.phases`: the first 1 - `phase2_fraction`
    of `total_tokens` (default `base.total_tokens`) drawn from `phase1`, the rest from `phase2`
    (Nemotron 3 Super §2.3: the last 20% with a higher-quality blend). Source weights are set to
    the token-weighted average of the two blends (what the whole run sees; the loader uses the
    phases). Saved as YAML / JSON; `DataConfig.load(path)` and `build_loaders` read it."""
    if not 0.0 < phase2_fraction < 1.0:
        raise ValueError(f"phase2_fraction must be in (0, 1), got {phase2_fraction}")
    total = int(total_tokens or base.total_tokens)
    if total <= 0:
        raise ValueError(
            "a curriculum needs the training budget to place its phase boundary: pass "
            "total_tokens or set total_tokens in the data config"
        )
    names = [s.name for s in base.sources]
    blends = []
    for label, weights in (("phase1", phase1), ("phase2", phase2)):
        unknown = sorted(set(weights) - set(names))
        if unknown:
            raise ValueError(
                f"{label} weights for unknown sources {unknown}; the config has {names}"
            )
        w = normalise({n: float(weights.get(n, 0.0)) for n in names})
        blends.append({n: round(v, 6) for n, v in w.items()})
    cfg = copy.deepcopy(base)
    f2 = float(phase2_fraction)
    mean = normalise({n: (1.0 - f2) * blends[0][n] + f2 * blends[1][n] for n in names})
    for src in cfg.sources:
        src.weight = round(mean[src.name], 6)
    cfg.phases = [
        Phase(fraction=round(1.0 - f2, 9), weights={n: v for n, v in blends[0].items() if v > 0}),
        Phase(fraction=round(f2, 9), weights={n: v for n, v in blends[1].items() if v > 0}),
    ]
    cfg.total_tokens = total
    cfg.validate()
    cfg.save(path)
    return cfg


def parse_weights(spec: str) -> dict[str, float]:
    """`"web=0.3,code=0.7"` -> {"web": 0.3, "code": 0.7}."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, value = part.partition("=")
        try:
            if not eq:
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"weights take NAME=NUMBER,..., got {spec!r}") from None
    if not out:
        raise ValueError(f"no weights in {spec!r}")
    return out


def plot_swarm(swarm_jsonl: str | Path, reg: MixtureRegression, png: str | Path) -> Path:
    """Observed vs predicted loss of every swarm run, one marker per task."""
    plt = pyplot()

    res = SwarmResult.from_jsonl(swarm_jsonl)
    pred = reg.predict(res.weights)
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for t, task in enumerate(res.tasks):
        ax.scatter(res.losses[:, t], pred[:, t], s=14, label=task)
    lo, hi = float(min(res.losses.min(), pred.min())), float(max(res.losses.max(), pred.max()))
    ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8, ls="--")
    ax.set(xlabel="observed", ylabel=f"predicted ({reg.kind})", title="swarm regression")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, png)


# ---------------------------------------------------------------------------- the mix stage
def run_mix(
    data: str | Path,
    out: str | Path,
    *,
    proxy: Literal["bigram", "trainer"] = "trainer",
    runs: int = 0,
    steps: int = 30,
    model: str = "tiny-super",
    budget: int = 20_000,
    regression: Literal["quadratic", "loglinear", "linear"] = "quadratic",
    total_tokens: float = 0.0,
    max_repetition: float = 4.0,
    phase2_weights: str = "",
    phase2_task_weights: str = "",
    phase2_fraction: float = 0.2,
) -> dict[str, Any]:
    """Swarm -> regression -> optimised mixture file (`hybridlm mix`), for the sources of the
    DataConfig YAML `data`: writes `out`/swarm.jsonl, mixture.yaml, swarm.png and, with
    `phase2_weights` ("name=w,...") or `phase2_task_weights` ("task=w,..."), curriculum.yaml.
    `runs=0` is 5 x sources; `steps` and `model` size the trainer proxy, `budget` the bigram
    proxy; `total_tokens` > 0 caps each source at `max_repetition` x its tokens. Returns the
    optimum's weights and predicted loss, the in-sample R^2 per task and the written paths."""
    cfg = DataConfig.load(data)
    sets = prepare_shards(cfg, progress=True)
    dirs = {name: str(s.path) for name, s in sets.items()}
    out = Path(out)
    if proxy == "bigram":
        scorer: Proxy = BigramProxy(dirs, budget=budget, seed=cfg.seed)
    else:
        model_cfg = get_preset(model)
        model_cfg.vocab_size = max(model_cfg.vocab_size, max(s.vocab_size for s in sets.values()))
        scorer = TrainerProxy(
            shard_dirs=dirs,
            model=model_cfg,
            out_dir=str(out / "runs"),
            steps=steps,
            seq_len=min(cfg.seq_len, 256),
            batch_size=min(cfg.batch_size, 8),
            tokenizer=cfg.tokenizer,
        )
    prior = normalise(cfg.weights)
    prior = {k: max(v, 1e-3) for k, v in prior.items()}  # every domain explored by the swarm
    res = run_swarm(prior, scorer, num_runs=runs, seed=cfg.seed, out_dir=out)
    reg = MixtureRegression(kind=regression).fit(res.weights, res.losses)
    avail = {n: float(s.num_tokens) for n, s in sets.items()} if total_tokens else None
    optimize = functools.partial(  # phase 1 and (with task weights) phase 2 share all else
        optimize_mixture,
        reg,
        res.domains,
        prior=prior,
        starts=res.weights,
        tasks=res.tasks,
        available_tokens=avail,
        total_tokens=total_tokens,
        max_repetition=max_repetition,
    )
    opt = optimize()
    write_mixture(out / "mixture.yaml", cfg, opt.weights)
    cur, cur_path = None, None
    if phase2_weights or phase2_task_weights:
        if phase2_weights:
            phase2 = parse_weights(phase2_weights)
        else:  # the optimum under a quality-weighted objective
            tw = parse_weights(phase2_task_weights)
            unknown = sorted(set(tw) - set(res.tasks))
            if unknown:
                raise ValueError(f"--phase2-task-weights: unknown tasks {unknown}; {res.tasks}")
            opt2 = optimize(task_weights=[tw.get(t, 0.0) for t in res.tasks])
            phase2 = opt2.weights
        cur_path = out / "curriculum.yaml"
        cur = write_curriculum(
            cur_path,
            cfg,
            opt.weights,
            phase2,
            phase2_fraction=phase2_fraction,
            total_tokens=int(total_tokens or cfg.total_tokens),
        )
    plot = plot_swarm(out / "swarm.jsonl", reg, out / "swarm.png")
    r2 = dict(zip(res.tasks, reg.r2(res.weights, res.losses).round(3).tolist(), strict=True))
    return {
        "weights": opt.weights,
        "objective": opt.objective,
        "runs": len(res.weights),
        "r2": r2,
        "mixture": out / "mixture.yaml",
        "curriculum": cur,
        "curriculum_path": cur_path,
        "plot": plot,
    }
