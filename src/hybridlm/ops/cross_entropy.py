"""Fused LM-head + cross-entropy: the loss and its gradients without materialising the logits.

Shape legend: B batch, L sequence, T tokens, D model width, V vocabulary, C tokens per chunk.

`linear_cross_entropy(h_TD, W_VD, targets_T, denom)` equals
`F.cross_entropy(h @ W.T, targets, ignore_index=-100, reduction="sum") / denom`. It walks the
tokens in chunks of C: each chunk's logits live only while its loss and d(loss)/d(logits) =
(softmax - onehot) / denom are formed, and d/dh, d/dW are accumulated right away (the trick of
Liger's FusedLinearCrossEntropy and torchtune's chunked CE). Peak memory drops from T x V to
C x V floats and the logits' backward passes disappear. `linear_cross_entropy_ref` is the plain
composition it must equal.

With `shard` (a `VocabShard`), `W_VD` is this rank's rows of a vocabulary split over ranks
(tensor parallelism, Megatron-LM's vocabulary-parallel cross-entropy): each chunk's row max, sum
of exponentials and target logit are reduced over the ranks through the callables it carries
(this module imports no collectives), d/dh is summed over them once at the end, and d/dW stays
local; every rank returns the same loss.

`shift_targets` / `lm_cross_entropy` are the one next-token CE of a language model's output
(logits, or hidden states fused with the LM head) that every stage builds its losses from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
IGNORE_INDEX = -100


@dataclass(frozen=True)
class VocabShard:
    """Rows [start, start + V_local) of a vocabulary split over ranks, and in-place reductions
    over those ranks (module docstring)."""

    start: int
    all_reduce_max: Callable[[Tensor], object]
    all_reduce_sum: Callable[[Tensor], object]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        h_TD: Tensor,
        W_VD: Tensor,
        targets_T: Tensor,
        denom: Tensor,
        chunk: int,
        shard: VocabShard | None,
    ) -> Tensor:
        T, V = h_TD.shape[0], W_VD.shape[0]
        ct = torch.float64 if h_TD.dtype == torch.float64 else torch.float32  # logits precision
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h_TD) if need_h else None
        grad_w = torch.zeros(W_VD.shape, dtype=ct, device=W_VD.device) if need_w else None
        total = torch.zeros((), dtype=ct, device=h_TD.device)
        scale = 1.0 / denom.to(ct)
        for i in range(0, T, chunk):
            h_CD, t_C = h_TD[i : i + chunk], targets_T[i : i + chunk]
            logits_CV = (h_CD @ W_VD.T).to(ct)
            valid_C = t_C != IGNORE_INDEX
            local_C = t_C if shard is None else t_C - shard.start
            mine_C = valid_C if shard is None else valid_C & (local_C >= 0) & (local_C < V)
            safe_C = local_C.clamp(min=0) if shard is None else local_C.clamp(0, V - 1)
            max_C = logits_CV.amax(dim=-1)
            if shard is not None:
                shard.all_reduce_max(max_C)
            picked_C = logits_CV.gather(1, safe_C[:, None])[:, 0] - max_C
            if shard is not None:  # the target's logit, from the rank that holds it
                picked_C = torch.where(mine_C, picked_C, 0.0)
                shard.all_reduce_sum(picked_C)
            p_CV = logits_CV.sub_(max_C[:, None]).exp_()  # in place: unnormalised softmax
            sum_C = p_CV.sum(-1)
            if shard is not None:
                shard.all_reduce_sum(sum_C)
            total += torch.where(valid_C, sum_C.log() - picked_C, 0.0).sum()
            if need_h or need_w:
                p_CV.mul_((valid_C.to(ct) * scale / sum_C)[:, None])  # softmax / denom
                rows = torch.arange(p_CV.shape[0], device=p_CV.device)
                p_CV[rows, safe_C] -= mine_C.to(ct) * scale
                g_CV = p_CV.to(h_TD.dtype)
                if need_h:
                    grad_h[i : i + chunk] = g_CV @ W_VD
                if need_w:
                    grad_w.add_(g_CV.T.to(ct) @ h_CD.to(ct))
        if shard is not None and need_h:  # h feeds every rank's rows
            shard.all_reduce_sum(grad_h)
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.need = (need_h, need_w)
        ctx.w_dtype = W_VD.dtype
        return total * scale

    @staticmethod
    def backward(ctx, g: Tensor):
        saved = list(ctx.saved_tensors)
        need_h, need_w = ctx.need
        grad_h = saved.pop(0) * g.to(saved[0].dtype if saved else g.dtype) if need_h else None
        grad_w = (saved.pop(0) * g).to(ctx.w_dtype) if need_w else None
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy(
    h_TD: Tensor,
    W_VD: Tensor,
    targets_T: Tensor,
    denom: Tensor | int,
    chunk: int | None = None,
    *,
    shard: VocabShard | None = None,
) -> Tensor:
    """Sum of token cross-entropies over targets != -100, divided by `denom` (`shard`: `W_VD`
    holds one rank's rows of a split vocabulary, module docstring)."""
    if chunk is None:  # fp32 logits per chunk: ~8 MiB on a CPU (cache-sized), ~512 MiB on a
        # GPU, where each chunk is a few kernel launches and small chunks leave it launch-bound
        chunk = max(16, (2**27 if h_TD.is_cuda else 2**21) // W_VD.shape[0])
    denom = torch.as_tensor(denom, device=h_TD.device)
    return _LinearCrossEntropy.apply(h_TD, W_VD, targets_T, denom, chunk, shard)


def linear_cross_entropy_ref(
    h_TD: Tensor, W_VD: Tensor, targets_T: Tensor, denom: Tensor | int
) -> Tensor:
    logits = h_TD @ W_VD.T
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits, targets_T, ignore_index=IGNORE_INDEX, reduction="sum") / denom


def shift_targets(labels_BL: Tensor, shift: int) -> Tensor:
    """out[:, t] = labels[:, t + shift], -100 past the end (labels follow the transformers
    convention: `labels[:, t]` is the token at position t, the loss shifts them)."""
    if shift == 0:
        return labels_BL
    pad = labels_BL.new_full((labels_BL.shape[0], min(shift, labels_BL.shape[1])), IGNORE_INDEX)
    return torch.cat([labels_BL[:, shift:], pad], dim=1)


def lm_cross_entropy(
    x_BLX: Tensor,
    labels_BL: Tensor,
    denom: Tensor | int | None = None,
    *,
    lm_head_VD: Tensor | None = None,
    shift: int = 1,
) -> Tensor:
    """Sum of the CE of position t against `labels[:, t + shift]` over targets != -100, divided
    by `denom` (default: this batch's target count). `x_BLX`: logits [B, L, V], or hidden states
    [B, L, D] with `lm_head_VD` (the LM head's weight), then fused (`linear_cross_entropy`)."""
    targets_BL = shift_targets(labels_BL, shift)
    if denom is None:
        denom = (targets_BL != IGNORE_INDEX).sum().clamp(min=1)
    if lm_head_VD is not None:
        return linear_cross_entropy(x_BLX.flatten(0, 1), lm_head_VD, targets_BL.flatten(), denom)
    ct = torch.promote_types(x_BLX.dtype, torch.float32)  # fp64 stays fp64
    loss_sum = F.cross_entropy(
        x_BLX.flatten(0, 1).to(ct), targets_BL.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum / denom
