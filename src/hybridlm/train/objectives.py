"""Every training loss: the causal LM loss of pretraining, SFT loss normalisation, DPO,
Bradley-Terry reward models, distillation. The model returns values (`ModelOutput`); the losses
are computed here.

Shape legend: B rows (or pairs), L sequence, V vocabulary, T tokens (flattened), K teacher top-k.

Labels follow the transformers convention (unshifted, -100 ignored): the logits at position t
score `labels[:, t + shift]` (shift 1 for the next-token head, k + 1 for MTP depth k).

Causal LM (`causal_lm_loss`): next-token CE + `mtp.loss_weight` x the mean over MTP depths of
their CE (Nemotron 3 Super §2.1.2; in packed rows a depth-k target from the next document is
dropped) + the MoE sequence-level balancing loss the forward returned (§2.1.1). Every CE is a sum
over valid targets divided by `num_valid_tokens`, the global count of the optimizer step
(DESIGN habit 13).

SFT (Nemotron 3 Super §4.2; SPEC §3). With O_c the assistant tokens of conversation c in the
global batch (all micro-batches and ranks of one optimizer step) and l_t a token's NLL:

    token  (stage 1):  L = sum_c sum_{t in O_c} l_t / sum_c |O_c|
    sample (stage 2):  L = (1 / |C|) sum_c (1 / |O_c|) sum_{t in O_c} l_t

Both are sum_t w_t l_t with per-token weights (`sft_token_weights`) that depend only on global
counts and on counts within one conversation; a conversation never spans two rows, so every
micro-batch computes its share exactly and the shares add up to the loss of the whole step
(DESIGN habit 13: accumulation and data parallelism give the big-batch gradient).

DPO (Rafailov et al. 2023): L = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))) with
sequence log-probs; `dpo_norm` (open-instruct, used for Olmo 3 Instruct DPO with beta = 5)
uses the per-token mean log-probs instead of the sums (length-normalised).

Bradley-Terry (reward models, InstructGPT §3.5): L = -log sigmoid(r_c - r_r) with the rewards
of the chosen and rejected sequences, plus `center_coef` * (r_c + r_r)^2 to keep rewards centred
(TRL's `center_rewards_coefficient`).

Distillation (SPEC §3):
- `topk_forward_kl`: KL(p_T^K || q_S) on the teacher's top-k logits. The teacher distribution is
  *renormalised over its top k* (a softmax of the k logits; the tail mass is dropped), which is
  what a cache of k logits per token can represent. The student keeps its full softmax, gathered
  at the k ids: since sum_k q_k <= 1 the KL stays >= 0 and mass the student puts outside the
  teacher's top k is penalised (renormalising the student too would leave its tail free).
  `distill_loss` = 0.9 * that KL + 0.1 * CE on the labels (default weights).
- `skew_reverse_kl`: KL(q_S || a p_T + (1 - a) q_S), the skew reverse KL of DistiLLM (Ko et al.
  2024, §3.1), mixing a fraction `alpha` of the teacher into the student distribution. DistiLLM
  writes the mixture (1 - a') p + a' q with a' = 0.1; `alpha` here is 1 - a' (default 0.9).
- `reverse_kl`: exact token-level KL(q_S || p_T) over the vocabulary at positions of student
  samples (on-policy distillation, GKD, Agarwal et al. 2024); `on_policy_distill_loss`: the
  sampled-token estimator with per-token advantage sg[log p_T(y_t) - log q_S(y_t)] for one or
  several teachers (multi-teacher on-policy distillation: each sample scored by its teacher),
  whose expected gradient is that of the token-level reverse KL.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ..model.model import HybridLM, ModelOutput
from ..ops.cross_entropy import IGNORE_INDEX, lm_cross_entropy, shift_targets

Tensor = torch.Tensor
SFTNorm = Literal["token", "sample"]
DPOKind = Literal["dpo", "dpo_norm"]


# ---------------------------------------------------------------------------- helpers
def _fp(x: Tensor) -> Tensor:
    """Losses are computed in fp32 (fp64 inputs stay fp64, for gradient checks)."""
    return x if x.dtype == torch.float64 else x.float()


def token_nll(logits_BLV: Tensor, labels_BL: Tensor, shift: int = 1) -> Tensor:
    """Per-position NLL [B, L] (fp32) of the target `shift` ahead; 0 where it is ignored."""
    tgt_BL = shift_targets(labels_BL, shift)
    nll = F.cross_entropy(
        _fp(logits_BLV).flatten(0, 1),
        tgt_BL.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return nll.view(tgt_BL.shape)


# ---------------------------------------------------------------------------- causal LM
def causal_lm_loss(
    model: HybridLM,
    out: ModelOutput,
    labels_BL: Tensor,
    *,
    doc_ids: Tensor | None = None,
    num_valid_tokens: int | Tensor | None = None,
    mtp_weight: float | None = None,
    include_aux: bool = True,
    seq_slice: slice | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(total, parts) of a forward `out` of `model` (the bare `HybridLM`, not a wrapper) on
    `labels_BL` (module docstring). parts: `ce`, `mtp_<k>` per depth and their mean `mtp` when
    `out` holds MTP depths, `moe_aux` when it holds the balancing loss. CE comes from the
    logits when `out` has them, else fused with the LM head from the hidden states.
    `num_valid_tokens`: default, each term's own target count. `mtp_weight`: default
    `mtp.loss_weight`. `include_aux=False` leaves `moe_aux` out of the total (a trainer that
    averages it over micro-batches instead of summing it). `seq_slice`: `out` covers only
    these positions of the rows `labels_BL` / `doc_ids` describe (a context-parallel shard):
    the targets are shifted on the whole rows, then cut."""
    if labels_BL.dim() != 2:
        raise ValueError(f"labels must be [batch, seq], got shape {tuple(labels_BL.shape)}")
    W_VD = model.lm_head.weight
    denom = num_valid_tokens

    def ce(logits: Tensor | None, h_BLD: Tensor | None, targets_BL: Tensor, shift: int) -> Tensor:
        if logits is not None:
            return lm_cross_entropy(logits, targets_BL, denom, shift=shift)
        if h_BLD is None:
            raise ValueError("the forward returned neither logits nor hidden states")
        if isinstance(W_VD, DTensor) and W_VD.device_mesh.mesh_dim_names == ("tp",):
            # a vocabulary-split LM head (train.parallel.tp; FSDP2 has gathered its own shards)
            from .distributed.tensor_parallel import vocab_parallel_cross_entropy

            t_BL = shift_targets(targets_BL, shift)
            n = (t_BL != IGNORE_INDEX).sum().clamp(min=1) if denom is None else denom
            return vocab_parallel_cross_entropy(h_BLD.flatten(0, 1), t_BL.flatten(), n, W_VD)
        return lm_cross_entropy(h_BLD, targets_BL, denom, lm_head_VD=W_VD, shift=shift)

    own = slice(None) if seq_slice is None else seq_slice

    def targets(shift: int) -> Tensor:
        """Targets aligned with the output's positions (shift 0 for `lm_cross_entropy`)."""
        t_BL = shift_targets(labels_BL, shift)
        if doc_ids is not None and shift > 1:  # packed rows: no target from the next document
            doc_BL = doc_ids.to(labels_BL.device)
            t_BL = t_BL.masked_fill(shift_targets(doc_BL, shift) != doc_BL, IGNORE_INDEX)
        return t_BL[:, own]

    x_BL = out.logits if out.logits is not None else out.hidden
    if x_BL is None or x_BL.shape[:2] != labels_BL[:, own].shape:
        got = None if x_BL is None else tuple(x_BL.shape[:2])
        raise ValueError(f"labels shape {tuple(labels_BL.shape)} != the output's [B, L] {got}")
    parts = {"ce": ce(out.logits, out.hidden, targets(1), 0)}
    total = parts["ce"]
    if out.mtp_hidden:
        mtp_terms = []
        for k, h_k in enumerate(out.mtp_hidden, start=1):
            logits_k = out.mtp_logits[k - 1] if out.mtp_logits else None
            parts[f"mtp_{k}"] = ce(logits_k, h_k, targets(k + 1), 0)
            mtp_terms.append(parts[f"mtp_{k}"])
        parts["mtp"] = torch.stack(mtp_terms).mean()
        w = model.config.mtp.loss_weight if mtp_weight is None else mtp_weight
        total = total + w * parts["mtp"]
    aux = out.aux.get("moe_aux")
    if aux is not None:
        parts["moe_aux"] = aux
        if include_aux:
            total = total + aux
    return total, parts


def z_loss(logits_BLV: Tensor, labels_BL: Tensor, denom: int) -> Tensor:
    """sum over CE targets of logsumexp(logits)^2 / denom (Olmo 3 z-loss, PaLM §5)."""
    mask = labels_BL[:, 1:] != IGNORE_INDEX  # target of position t is labels[t + 1]
    lse = torch.logsumexp(logits_BLV[:, :-1].float(), dim=-1)
    return (lse.square() * mask).sum() / denom


# ---------------------------------------------------------------------------- SFT
def sft_token_weights(
    labels_BL: Tensor,
    conv_ids_BL: Tensor,
    *,
    mode: SFTNorm,
    num_tokens: int | Tensor,
    num_conversations: int | Tensor,
) -> Tensor:
    """Per-label weights w [B, L] (float32) such that sum_t w_t l_t is this micro-batch's share
    of the step's SFT loss (module docstring). `num_tokens` / `num_conversations`: global counts
    of assistant tokens / conversations with at least one, over the whole optimizer step."""
    mask_BL = labels_BL != IGNORE_INDEX
    if mode == "token":
        return mask_BL.float() / max(1, int(num_tokens))
    if mode != "sample":
        raise ValueError(f"SFT loss normalisation must be 'token' or 'sample', got {mode!r}")
    conv = torch.where(mask_BL, conv_ids_BL, -1)
    flat = conv[mask_BL]
    w = torch.zeros(labels_BL.shape, dtype=torch.float32, device=labels_BL.device)
    if flat.numel() == 0:
        return w
    uniq, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
    del uniq
    # |O_c| of each token's conversation
    w[mask_BL] = 1.0 / (counts[inverse].float() * max(1, int(num_conversations)))
    return w


def weighted_nll(
    logits_BLV: Tensor,
    labels_BL: Tensor,
    weights_BL: Tensor,
    *,
    shift: int = 1,
    doc_ids_BL: Tensor | None = None,
) -> Tensor:
    """sum_t w[t + shift] * NLL(labels[t + shift] | logits[t]). `weights_BL` live on the label
    positions; with `doc_ids_BL` a target in another document than its position is dropped
    (MTP depth k near a packed conversation's end)."""
    nll_BL = token_nll(logits_BLV, labels_BL, shift)
    w_BL = shift_targets_float(weights_BL, shift)
    if doc_ids_BL is not None and shift > 0:
        same_BL = torch.zeros_like(w_BL, dtype=torch.bool)
        same_BL[:, :-shift] = doc_ids_BL[:, :-shift] == doc_ids_BL[:, shift:]
        w_BL = w_BL * same_BL
    return (nll_BL * w_BL).sum()


def shift_targets_float(x_BL: Tensor, shift: int) -> Tensor:
    """out[:, t] = x[:, t + shift], 0 past the end."""
    if shift == 0:
        return x_BL
    pad = x_BL.new_zeros((x_BL.shape[0], min(shift, x_BL.shape[1])))
    return torch.cat([x_BL[:, shift:], pad], dim=1)


# ---------------------------------------------------------------------------- DPO
def sequence_logps(logits_BLV: Tensor, labels_BL: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of log p(label) over each row's targets [B] in fp32, number of targets [B])."""
    tgt_BL = shift_targets(labels_BL, 1)
    mask_BL = tgt_BL != IGNORE_INDEX
    logp_BLV = torch.log_softmax(_fp(logits_BLV), dim=-1)
    lp_BL = logp_BLV.gather(-1, tgt_BL.clamp(min=0)[..., None])[..., 0]
    return (lp_BL * mask_BL).sum(1), mask_BL.sum(1)


def dpo_loss(
    policy_chosen_B: Tensor,
    policy_rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float,
    kind: DPOKind = "dpo",
    chosen_tokens_B: Tensor | None = None,
    rejected_tokens_B: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair DPO losses [B] and detached metrics (rewards, margins, accuracy per pair).

    Inputs are summed sequence log-probs; `dpo_norm` divides each by its token count first."""
    if beta <= 0:
        raise ValueError(f"DPO beta must be positive, got {beta}")
    if kind == "dpo_norm":
        if chosen_tokens_B is None or rejected_tokens_B is None:
            raise ValueError("dpo_norm needs chosen_tokens_B and rejected_tokens_B")
        nc, nr = chosen_tokens_B.clamp(min=1).float(), rejected_tokens_B.clamp(min=1).float()
        policy_chosen_B, ref_chosen_B = policy_chosen_B / nc, ref_chosen_B / nc
        policy_rejected_B, ref_rejected_B = policy_rejected_B / nr, ref_rejected_B / nr
    elif kind != "dpo":
        raise ValueError(f"DPO loss kind must be 'dpo' or 'dpo_norm', got {kind!r}")
    chosen_B = policy_chosen_B - ref_chosen_B  # implicit reward / beta
    rejected_B = policy_rejected_B - ref_rejected_B
    losses_B = -F.logsigmoid(beta * (chosen_B - rejected_B))
    with torch.no_grad():
        metrics = {
            "reward_chosen": beta * chosen_B,
            "reward_rejected": beta * rejected_B,
            "reward_margin": beta * (chosen_B - rejected_B),
            "reward_accuracy": (chosen_B > rejected_B).float(),
        }
    return losses_B, metrics


# ---------------------------------------------------------------------------- reward models
def bradley_terry_loss(
    r_chosen: Tensor, r_rejected: Tensor, *, center_coef: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair -log sigmoid(r_c - r_r) (+ center_coef (r_c + r_r)^2) and per-pair metrics."""
    diff = r_chosen - r_rejected
    loss = -F.logsigmoid(diff)
    if center_coef:
        loss = loss + center_coef * (r_chosen + r_rejected) ** 2
    metrics = {
        "accuracy": (diff > 0).float(),
        "margin": diff.detach(),
        "reward_chosen": r_chosen.detach(),
        "reward_rejected": r_rejected.detach(),
    }
    return loss, metrics


# ---------------------------------------------------------------------------- distillation
def topk_forward_kl(
    student_logits_TV: Tensor,
    teacher_topk_logits_TK: Tensor,
    teacher_topk_ids_TK: Tensor,
    mask_T: Tensor | None = None,
    *,
    temperature: float = 1.0,
    denom: int | Tensor | None = None,
) -> Tensor:
    """sum_t KL(p_T^K,t || q_S,t) / denom, p_T^K = softmax(teacher top-k logits / tau) over the
    k ids, q_S the student's full softmax (/ tau) gathered at those ids (module docstring)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if teacher_topk_logits_TK.shape != teacher_topk_ids_TK.shape:
        raise ValueError("teacher top-k logits and ids must have the same shape")
    logp_T_TK = torch.log_softmax(_fp(teacher_topk_logits_TK) / temperature, dim=-1)
    logq_TV = torch.log_softmax(_fp(student_logits_TV) / temperature, dim=-1)
    logq_TK = logq_TV.gather(-1, teacher_topk_ids_TK)
    kl_T = (logp_T_TK.exp() * (logp_T_TK - logq_TK)).sum(-1)
    return _reduce(kl_T, mask_T, denom)


def distill_loss(
    student_logits_TV: Tensor,
    targets_T: Tensor,
    teacher_topk_logits_TK: Tensor,
    teacher_topk_ids_TK: Tensor,
    *,
    kl_weight: float = 0.9,
    ce_weight: float = 0.1,
    temperature: float = 1.0,
    denom: int | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """kl_weight * top-k forward KL + ce_weight * CE on `targets_T` (-100 ignored; the KL uses
    the same positions), both summed over tokens / denom (SPEC §3 distillation, 0.9 / 0.1)."""
    mask_T = targets_T != IGNORE_INDEX
    if denom is None:
        denom = mask_T.sum().clamp(min=1)
    kl = topk_forward_kl(
        student_logits_TV,
        teacher_topk_logits_TK,
        teacher_topk_ids_TK,
        mask_T,
        temperature=temperature,
        denom=denom,
    )
    ce = (
        F.cross_entropy(
            _fp(student_logits_TV), targets_T, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        / denom
    )
    return kl_weight * kl + ce_weight * ce, {"kl": kl.detach(), "ce": ce.detach()}


def hidden_mse(
    student_hidden_TD: Tensor,
    teacher_hidden_TD: Tensor,
    mask_T: Tensor | None = None,
    *,
    denom: int | Tensor | None = None,
) -> Tensor:
    """sum_t mean_d (h_S,t,d - h_T,t,d)^2 / denom: the distance of the student's final hidden
    states from the teacher's (same width), e.g. a quantised student from its own unquantised
    model in quantisation-aware distillation (ModelOpt's optional intermediate-output loss)."""
    if student_hidden_TD.shape != teacher_hidden_TD.shape:
        raise ValueError(
            f"hidden-state distillation needs equal shapes, got {tuple(student_hidden_TD.shape)} "
            f"and {tuple(teacher_hidden_TD.shape)}"
        )
    mse_T = (_fp(student_hidden_TD) - _fp(teacher_hidden_TD)).square().mean(-1)
    return _reduce(mse_T, mask_T, denom)


def skew_reverse_kl(
    student_logits_TV: Tensor,
    teacher_logits_TV: Tensor,
    mask_T: Tensor | None = None,
    *,
    alpha: float = 0.9,
    denom: int | Tensor | None = None,
) -> Tensor:
    """sum_t KL(q_S,t || alpha p_T,t + (1 - alpha) q_S,t) / denom (DistiLLM's skew reverse KL;
    gradients flow through both occurrences of q_S). alpha = 1 is the plain reverse KL."""
    if not 0 < alpha <= 1:
        raise ValueError(f"skew alpha must be in (0, 1], got {alpha}")
    logq_TV = torch.log_softmax(_fp(student_logits_TV), dim=-1)
    logp_TV = torch.log_softmax(_fp(teacher_logits_TV), dim=-1)
    if alpha == 1:
        logm_TV = logp_TV
    else:  # log(alpha p + (1 - alpha) q), stably
        logm_TV = torch.logaddexp(logp_TV + math.log(alpha), logq_TV + math.log1p(-alpha))
    kl_T = (logq_TV.exp() * (logq_TV - logm_TV)).sum(-1)
    return _reduce(kl_T, mask_T, denom)


def reverse_kl(
    student_logits_TV: Tensor,
    teacher_logits_TV: Tensor,
    mask_T: Tensor | None = None,
    *,
    denom: int | Tensor | None = None,
) -> Tensor:
    """Exact token-level reverse KL sum_t KL(q_S,t || p_T,t) / denom at the positions of student
    samples (on-policy distillation with the teacher's full distribution)."""
    return skew_reverse_kl(student_logits_TV, teacher_logits_TV, mask_T, alpha=1.0, denom=denom)


def on_policy_distill_loss(
    student_logprobs_T: Tensor,
    teacher_logprobs_T: Tensor,
    mask_T: Tensor | None = None,
    *,
    denom: int | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sampled-token on-policy distillation: tokens y_t were sampled from the student;
    `student_logprobs_T` = log q_S(y_t) (with grad), `teacher_logprobs_T` = log p_T(y_t) from
    the teacher that scores this sample. Loss = -sum_t A_t log q_S(y_t) / denom with
    A_t = sg[log p_T(y_t) - log q_S(y_t)]; E_{y~q}[grad] = grad of the token-level reverse KL
    (score-function identity, E_q[grad log q] = 0). Also returns the per-token reverse-KL
    estimate log q - log p averaged over the tokens."""
    adv_T = (_fp(teacher_logprobs_T) - _fp(student_logprobs_T)).detach()
    surrogate_T = -adv_T * _fp(student_logprobs_T)
    loss = _reduce(surrogate_T, mask_T, denom)
    with torch.no_grad():
        kl = _reduce(-adv_T, mask_T, None)
    return loss, {"reverse_kl": kl}


def _reduce(x_T: Tensor, mask_T: Tensor | None, denom: int | Tensor | None) -> Tensor:
    if mask_T is None:
        mask_T = torch.ones_like(x_T, dtype=torch.bool)
    if denom is None:
        denom = mask_T.sum().clamp(min=1)
    return (x_T * mask_T).sum() / denom
