"""Fused LM-head + cross-entropy: the loss and its gradients without materialising the logits.

Shape legend: T tokens, D model width, V vocabulary, C tokens per chunk.

`linear_cross_entropy(h_TD, W_VD, targets_T, denom)` equals
`F.cross_entropy(h @ W.T, targets, ignore_index=-100, reduction="sum") / denom`. It walks the
tokens in chunks of C: each chunk's logits live only while its loss and d(loss)/d(logits) =
(softmax - onehot) / denom are formed, and d/dh, d/dW are accumulated right away (the trick of
Liger's FusedLinearCrossEntropy and torchtune's chunked CE). Peak memory drops from T x V to
C x V floats and the logits' backward passes disappear. `linear_cross_entropy_ref` is the plain
composition it must equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
IGNORE_INDEX = -100


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, h_TD: Tensor, W_VD: Tensor, targets_T: Tensor, denom: Tensor, chunk: int
    ) -> Tensor:
        T = h_TD.shape[0]
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
            safe_C = t_C.clamp(min=0)
            max_C = logits_CV.amax(dim=-1)
            picked_C = logits_CV.gather(1, safe_C[:, None])[:, 0] - max_C
            p_CV = logits_CV.sub_(max_C[:, None]).exp_()  # in place: unnormalised softmax
            sum_C = p_CV.sum(-1)
            total += torch.where(valid_C, sum_C.log() - picked_C, 0.0).sum()
            if need_h or need_w:
                p_CV.mul_((valid_C.to(ct) * scale / sum_C)[:, None])  # softmax / denom
                rows = torch.arange(p_CV.shape[0], device=p_CV.device)
                p_CV[rows, safe_C] -= valid_C.to(ct) * scale
                g_CV = p_CV.to(h_TD.dtype)
                if need_h:
                    grad_h[i : i + chunk] = g_CV @ W_VD
                if need_w:
                    grad_w.add_(g_CV.T.to(ct) @ h_CD.to(ct))
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
        return grad_h, grad_w, None, None, None


def linear_cross_entropy(
    h_TD: Tensor, W_VD: Tensor, targets_T: Tensor, denom: Tensor | int, chunk: int | None = None
) -> Tensor:
    """Sum of token cross-entropies over targets != -100, divided by `denom`."""
    if chunk is None:  # ~8 MiB of fp32 logits per chunk
        chunk = max(16, (2**21) // W_VD.shape[0])
    denom = torch.as_tensor(denom, device=h_TD.device)
    return _LinearCrossEntropy.apply(h_TD, W_VD, targets_T, denom, chunk)


def linear_cross_entropy_ref(
    h_TD: Tensor, W_VD: Tensor, targets_T: Tensor, denom: Tensor | int
) -> Tensor:
    logits = h_TD @ W_VD.T
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits, targets_T, ignore_index=IGNORE_INDEX, reduction="sum") / denom
