"""Autoregressive generation with the hybrid cache (prefill once, then one token per step).

Shape legend: B batch, L prompt length, V vocabulary.
"""

from __future__ import annotations

import torch

from ..model.model import HybridLM
from .cache import HybridCache


def sample_next(
    logits_BV: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Greedy at temperature 0, else softmax sampling (optionally restricted to the top k)."""
    if temperature <= 0:
        return logits_BV.argmax(-1)
    logits = logits_BV.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(
    model: HybridLM,
    input_ids_BL: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
    ssm_precision: str = "fp32",
) -> torch.Tensor:
    """Returns the generated tokens [B, <= max_new_tokens] (stops early once all rows hit eos).
    `ssm_precision` is the storage precision of the Mamba state cache (`infer.state_precision`)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if input_ids_BL.dim() != 2 or input_ids_BL.shape[1] == 0:
        raise ValueError("input_ids must be a non-empty [batch, seq] tensor")
    gen = (
        torch.Generator(device=input_ids_BL.device).manual_seed(seed) if seed is not None else None
    )
    was_training = model.training
    model.eval()
    try:
        cache = HybridCache.for_pattern(
            model.config.pattern, ssm_precision=ssm_precision, seed=seed or 0
        )
        logits = model(input_ids_BL, cache=cache).logits[:, -1]
        done = torch.zeros(input_ids_BL.shape[0], dtype=torch.bool, device=input_ids_BL.device)
        out = []
        for _ in range(max_new_tokens):
            nxt = sample_next(logits, temperature=temperature, top_k=top_k, generator=gen)
            if eos_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                done |= nxt == eos_id
            out.append(nxt)
            if eos_id is not None and bool(done.all()):
                break
            logits = model(nxt[:, None], cache=cache).logits[:, -1]
    finally:
        model.train(was_training)
    if not out:
        return input_ids_BL.new_zeros(input_ids_BL.shape[0], 0)
    return torch.stack(out, dim=1)
