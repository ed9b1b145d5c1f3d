"""The GRPO objective as used by OlmoRL and Nemotron 3 Super RL, as pure torch functions.

OlmoRL (Olmo 3 §4.4.1) is GRPO with: zero-gradient (zero-variance) group filtering and active
sampling (DAPO), token-level loss normalisation, no KL term, clip-higher (ε_high > ε_low), truncated
importance sampling between the inference engine's and the trainer's log-probs, and no std
normalisation of advantages (Dr GRPO). The objective, per token t of completion i:

    J = 1/(Σ_i |y_i|) Σ_i Σ_t  w_it · min(r_it A_i, clip(r_it, 1-ε_low, 1+ε_high) A_i)
    w_it = min(π_old(y_it | ·) / π_rollout(y_it | ·), ρ)      (truncated IS, detached)
    r_it = π_θ(y_it | ·) / π_old(y_it | ·),   A_i = R_i - mean_j R_j   (over the group)

Nemotron 3 Super RLVR (§3.2.4; NeMo-RL `stage1_rlvr.yaml`) uses the same asymmetric clip
(0.2 / 0.28), token-level loss, and truncated importance sampling; its RLHF stage adds a k3 KL
penalty to a reference (1e-4). Defaults here: ε_low 0.2, ε_high 0.28, ρ = 2 (open-instruct's
`truncated_importance_sampling_ratio_cap`), β = 0.

Shapes: B completions (sequences) in the batch, T completion positions (right-padded),
N groups (prompts), G completions per group. `*_BT` log-probs are per-token log-probabilities of
the sampled tokens; `mask_BT` is 1 on completion tokens that count (0 on padding / prompt).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """Loss settings (defaults: OlmoRL / Nemotron 3 Super RLVR)."""

    eps_low: float = 0.2  # PPO clip below 1
    eps_high: float = 0.28  # clip-higher above 1 (DAPO; open-instruct 0.272, NeMo-RL 0.28)
    tis_cap: float | None = 2.0  # ρ of truncated importance sampling; None turns it off
    tis_mode: Literal["truncate", "mask"] = "truncate"  # mask: drop tokens with ratio > ρ
    kl_coef: float = 0.0  # β of the k3 KL penalty to a reference policy (0: no reference)
    loss_agg: Literal["token", "sequence"] = "token"  # token: Σ/num tokens; sequence: mean of means
    std_normalize: bool = False  # divide advantages by the group std (original GRPO)
    # mean: A_i = R_i - mean_j R_j (Dr GRPO); leave_one_out: R_i - mean_{j != i} R_j (RLOO)
    baseline: Literal["mean", "leave_one_out"] = "mean"

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 (or None), got {self.tis_cap}")
        if self.tis_mode not in ("truncate", "mask"):
            raise ValueError(f"tis_mode must be 'truncate' or 'mask', got {self.tis_mode!r}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.loss_agg not in ("token", "sequence"):
            raise ValueError(f"loss_agg must be 'token' or 'sequence', got {self.loss_agg!r}")
        if self.baseline not in ("mean", "leave_one_out"):
            raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {self.baseline!r}")


def group_advantages(
    rewards_NG: Tensor,
    *,
    std_normalize: bool = False,
    baseline: str = "mean",
    eps: float = 1e-6,
) -> Tensor:
    """A_ij = R_ij - mean_j R_ij (Dr GRPO: no std division, Olmo 3 §4.4.1), or with
    `baseline="leave_one_out"` R_ij - mean_{k != j} R_ik (RLOO, Ahmadian et al. 2024: the
    baseline is independent of the sample it judges; = G/(G-1) times the mean-baseline
    advantage); with `std_normalize`, divided by the group's sample std (Bessel-corrected) + eps."""
    if rewards_NG.ndim != 2 or rewards_NG.shape[1] < 2:
        raise ValueError(f"rewards must be [num_groups, group_size >= 2], got {rewards_NG.shape}")
    r = rewards_NG.float()
    if baseline == "mean":
        adv_NG = r - r.mean(dim=1, keepdim=True)
    elif baseline == "leave_one_out":
        G = r.shape[1]
        adv_NG = r - (r.sum(dim=1, keepdim=True) - r) / (G - 1)
    else:
        raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
    if std_normalize:
        adv_NG = adv_NG / (r.std(dim=1, keepdim=True) + eps)
    return adv_NG


def nonzero_variance_groups(rewards_NG: Tensor) -> Tensor:
    """Bool [N]: groups whose rewards are not all equal. A group with equal rewards has zero
    advantage everywhere and so no gradient (DAPO dynamic sampling, OlmoRL zero-gradient
    filtering)."""
    if rewards_NG.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got {rewards_NG.shape}")
    return (rewards_NG != rewards_NG[:, :1]).any(dim=1)


def truncated_importance_weights(
    old_logp_BT: Tensor, rollout_logp_BT: Tensor, cap: float, mode: str = "truncate"
) -> tuple[Tensor, Tensor]:
    """Per-token weight π_old/π_rollout, capped at ρ (`truncate`, TIS) or zeroed above ρ
    (`mask`), detached: it corrects the sampler/trainer mismatch without being optimised
    (Olmo 3 §4.4.1). Returns the weights and the bool tokens whose raw ratio exceeded ρ."""
    ratio_BT = torch.exp(old_logp_BT.detach() - rollout_logp_BT.detach())
    over_BT = ratio_BT > cap
    if mode == "truncate":
        w_BT = ratio_BT.clamp(max=cap)
    elif mode == "mask":
        w_BT = torch.where(over_BT, torch.zeros_like(ratio_BT), ratio_BT)
    else:
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    return w_BT, over_BT


def clipped_surrogate(
    logp_BT: Tensor, old_logp_BT: Tensor, adv_B: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic objective with asymmetric clipping (clip-higher, DAPO):
    min(r·A, clip(r, 1-ε_low, 1+ε_high)·A) per token, and the ratio r = exp(logp - old)."""
    ratio_BT = torch.exp(logp_BT - old_logp_BT.detach())
    adv_BT = adv_B.detach().to(ratio_BT.dtype)[:, None]
    unclipped_BT = ratio_BT * adv_BT
    clipped_BT = ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_BT
    return torch.minimum(unclipped_BT, clipped_BT), ratio_BT


def k3_kl(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(π_θ || π_ref) per token: e^d - d - 1 with d = ref - logp;
    non-negative, unbiased, and its gradient is that of the true KL in expectation."""
    d_BT = ref_logp_BT.detach() - logp_BT
    return torch.exp(d_BT) - d_BT - 1.0


def aggregate(
    x_BT: Tensor,
    mask_BT: Tensor,
    mode: str = "token",
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> Tensor:
    """Masked reduction of per-token values. `token`: Σ x·mask / num_tokens (default: the batch's
    Σ mask; pass the global count under data parallelism / accumulation, DESIGN habit 13).
    `sequence`: per-sequence masked mean, then Σ / num_sequences (default B; sequences with no
    tokens contribute 0)."""
    m_BT = mask_BT.to(x_BT.dtype)
    if mode == "token":
        denom = m_BT.sum() if num_tokens is None else torch.as_tensor(float(num_tokens))
        return (x_BT * m_BT).sum() / denom.clamp(min=1.0)
    if mode == "sequence":
        per_seq_B = (x_BT * m_BT).sum(dim=1) / m_BT.sum(dim=1).clamp(min=1.0)
        denom = x_BT.shape[0] if num_sequences is None else num_sequences
        return per_seq_B.sum() / max(float(denom), 1.0)
    raise ValueError(f"mode must be 'token' or 'sequence', got {mode!r}")


def grpo_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor | None,
    adv_B: Tensor,
    mask_BT: Tensor,
    *,
    rollout_logp_BT: Tensor | None = None,
    ref_logp_BT: Tensor | None = None,
    config: GRPOConfig | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss to minimise (−J, plus β·KL) and detached diagnostics.

    `old_logp_BT`: the trainer's log-probs before this update (None: on-policy, = logp detached).
    `rollout_logp_BT`: the inference engine's log-probs of the same tokens (enables TIS).
    `ref_logp_BT`: a reference policy's log-probs (needed when `kl_coef > 0`).
    Diagnostics (fractions over counted tokens): `clip_frac_low` (A<0, r<1-ε_low: no gradient),
    `clip_frac_high` (A>0, r>1+ε_high), `clip_frac`, `ratio_mean`, and with rollout log-probs
    `logprob_diff_mean` (mean |old − rollout|), `tis_truncated_frac`, `tis_weight_mean`;
    with a reference `kl`.
    """
    cfg = config or GRPOConfig()
    if logp_BT.ndim != 2 or mask_BT.shape != logp_BT.shape:
        raise ValueError(
            f"logp and mask must both be [B, T], got {tuple(logp_BT.shape)} and "
            f"{tuple(mask_BT.shape)}"
        )
    if adv_B.shape != logp_BT.shape[:1]:
        raise ValueError(f"advantages must be [B={logp_BT.shape[0]}], got {tuple(adv_B.shape)}")
    for name, t in (("old", old_logp_BT), ("rollout", rollout_logp_BT), ("ref", ref_logp_BT)):
        if t is not None and t.shape != logp_BT.shape:
            raise ValueError(f"{name}_logp must match logp's shape {tuple(logp_BT.shape)}")
    if cfg.kl_coef > 0 and ref_logp_BT is None:
        raise ValueError("kl_coef > 0 needs ref_logp_BT")
    old_BT = logp_BT.detach() if old_logp_BT is None else old_logp_BT.detach()
    mask_BT = mask_BT.to(logp_BT.dtype)
    obj_BT, ratio_BT = clipped_surrogate(logp_BT, old_BT, adv_B, cfg.eps_low, cfg.eps_high)
    stats: dict[str, Tensor] = {}
    if rollout_logp_BT is not None and cfg.tis_cap is not None:
        w_BT, over_BT = truncated_importance_weights(
            old_BT, rollout_logp_BT, cfg.tis_cap, cfg.tis_mode
        )
        obj_BT = obj_BT * w_BT
        stats["tis_truncated_frac"] = aggregate(over_BT.to(mask_BT.dtype), mask_BT)
        stats["tis_weight_mean"] = aggregate(w_BT, mask_BT)
    if rollout_logp_BT is not None:
        diff_BT = (old_BT - rollout_logp_BT.detach()).abs()
        stats["logprob_diff_mean"] = aggregate(diff_BT, mask_BT)
    per_token_BT = -obj_BT
    if cfg.kl_coef > 0:
        kl_BT = k3_kl(logp_BT, ref_logp_BT)
        per_token_BT = per_token_BT + cfg.kl_coef * kl_BT
    if ref_logp_BT is not None:
        stats["kl"] = aggregate(k3_kl(logp_BT.detach(), ref_logp_BT), mask_BT)
    loss = aggregate(
        per_token_BT, mask_BT, cfg.loss_agg, num_tokens=num_tokens, num_sequences=num_sequences
    )
    with torch.no_grad():
        adv_BT = adv_B[:, None].expand_as(ratio_BT)
        low_BT = ((adv_BT < 0) & (ratio_BT < 1.0 - cfg.eps_low)).to(mask_BT.dtype)
        high_BT = ((adv_BT > 0) & (ratio_BT > 1.0 + cfg.eps_high)).to(mask_BT.dtype)
        stats["clip_frac_low"] = aggregate(low_BT, mask_BT)
        stats["clip_frac_high"] = aggregate(high_BT, mask_BT)
        stats["clip_frac"] = stats["clip_frac_low"] + stats["clip_frac_high"]
        stats["ratio_mean"] = aggregate(ratio_BT.detach(), mask_BT)
    return loss, {k: v.detach() for k, v in stats.items()}


# -- active sampling ---------------------------------------------------------------------------


@dataclass
class Group:
    """The G completions of one prompt with their rewards; `data` carries whatever the learner
    needs (token ids, log-probs, ...)."""

    prompt_id: str
    rewards: Sequence[float]
    data: Any = None

    @property
    def has_variance(self) -> bool:
        return any(r != self.rewards[0] for r in self.rewards)


@dataclass
class ActiveSamplingStats:
    draws: int = 0
    kept: int = 0
    dropped_all_equal: int = 0
    dropped_all_max: int = 0  # every completion got the best reward (too easy)
    dropped_all_min: int = 0  # every completion got the worst reward (too hard)
    batches: int = 0
    short_batches: int = 0  # batches returned before they were full (max_draws reached)
    reward_sum: float = 0.0
    reward_count: int = 0

    def as_dict(self) -> dict[str, float]:
        d = {k: float(v) for k, v in self.__dict__.items()}
        d["keep_rate"] = self.kept / self.draws if self.draws else math.nan
        d["mean_reward_drawn"] = (
            self.reward_sum / self.reward_count if self.reward_count else math.nan
        )
        return d


@dataclass
class ActiveSampler:
    """Fills a batch with non-zero-variance groups (OlmoRL active sampling): groups whose
    rewards are all equal are dropped and more are drawn until `batch_groups` are kept or
    `max_draws` draws were spent on this batch. `add` takes groups pushed by rollout workers;
    `fill(draw)` pulls them from a callable."""

    batch_groups: int
    max_draws: int
    reward_range: tuple[float, float] = (0.0, 1.0)
    stats: ActiveSamplingStats = field(default_factory=ActiveSamplingStats)

    def __post_init__(self) -> None:
        if self.batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {self.batch_groups}")
        if self.max_draws < self.batch_groups:
            raise ValueError(
                f"max_draws ({self.max_draws}) must be >= batch_groups ({self.batch_groups})"
            )
        self._buffer: list[Group] = []
        self._draws_this_batch = 0

    @property
    def ready(self) -> bool:
        return len(self._buffer) >= self.batch_groups

    def add(self, group: Group) -> bool:
        """Offer one group; returns whether it was kept."""
        if len(group.rewards) < 2:
            raise ValueError("a group needs at least 2 completions")
        s = self.stats
        s.draws += 1
        self._draws_this_batch += 1
        s.reward_sum += float(sum(group.rewards))
        s.reward_count += len(group.rewards)
        if group.has_variance:
            s.kept += 1
            self._buffer.append(group)
            return True
        s.dropped_all_equal += 1
        lo, hi = self.reward_range
        if group.rewards[0] >= hi:
            s.dropped_all_max += 1
        elif group.rewards[0] <= lo:
            s.dropped_all_min += 1
        return False

    def pop_batch(self) -> list[Group]:
        """The next `batch_groups` kept groups (fewer if not ready); starts a new batch."""
        batch, self._buffer = self._buffer[: self.batch_groups], self._buffer[self.batch_groups :]
        self.stats.batches += 1
        self.stats.short_batches += len(batch) < self.batch_groups
        self._draws_this_batch = 0
        return batch

    def fill(self, draw: Callable[[], Group]) -> list[Group]:
        """Draw groups until the batch is full or `max_draws` were spent on it, then pop it."""
        while not self.ready and self._draws_this_batch < self.max_draws:
            self.add(draw())
        return self.pop_batch()
