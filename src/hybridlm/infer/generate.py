"""Autoregressive generation with the hybrid cache (prefill once, then one token per step).

Shape legend: B batch, L prompt length, V vocabulary.
"""

from __future__ import annotations

import torch

from ..model.cache import HybridCache
from ..model.model import HybridLM
from ..precision.kv_cache import kv_codecs
from .graphs import decode_graphs
from .sampling import sample_next

__all__ = ["generate", "left_align", "sample_next"]


def left_align(
    input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every row's tokens to the right end (left padding), whatever padding it came with;
    the hybrid cache keeps batches right-aligned (`model.cache`)."""
    mask = attention_mask_BL.bool()
    if bool(mask.any(1).logical_not().any()):
        raise ValueError("every row of attention_mask needs at least one token")
    L = mask.shape[1]
    # stable sort puts padding first and keeps token order within a row
    order = torch.sort(mask.long(), dim=1, stable=True).indices
    ids = input_ids_BL.gather(1, order)
    new_mask = mask.gather(1, order)
    ids = ids.masked_fill(~new_mask, 0)
    assert new_mask[:, L - 1].all()
    return ids, new_mask


@torch.no_grad()
def generate(
    model: HybridLM,
    input_ids_BL: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int | None = None,
    ssm_precision: str = "fp32",
    kv_cache_dtype: str = "auto",
    attention_mask: torch.Tensor | None = None,
    cuda_graphs: bool | None = None,
) -> torch.Tensor:
    """Returns the generated tokens [B, <= max_new_tokens] (stops early once all rows hit eos;
    rows that finished earlier are filled with eos).

    `attention_mask` [B, L] marks padding (0) of a batch of prompts of different lengths; left or
    right padding (or any mix) gives each row the tokens it would get alone. `ssm_precision` is
    the storage precision of the Mamba state cache (`model.state_precision`), `kv_cache_dtype`
    that of the attention KV cache (`precision.kv_cache`). After the prefill the rows decode
    over static slots with captured steps (`infer.graphs`): on CUDA by default, `cuda_graphs=
    False` keeps the growing cache (True on the CPU runs the slot steps eagerly). For serving many
    requests (continuous batching, stop strings, prefix reuse) use `infer.engine.Engine`."""
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
        codecs = kv_codecs(model, kv_cache_dtype)
        cache = HybridCache.for_pattern(
            model.config.pattern, ssm_precision=ssm_precision, seed=seed or 0, kv_codecs=codecs
        )
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids_BL.shape:
                raise ValueError("attention_mask must have the shape of input_ids")
            if not bool(attention_mask.bool().all()):
                input_ids_BL, mask = left_align(input_ids_BL, attention_mask)
        logits = model(input_ids_BL, cache=cache, attention_mask=mask).logits[:, -1]
        columns = input_ids_BL.shape[1] + max_new_tokens + 1
        graphs = decode_graphs(
            model,
            input_ids_BL.shape[0],
            -(-columns // 256) * 256,  # whole column buckets: later calls reuse the graphs
            ssm_precision=ssm_precision,
            kv_codecs=codecs,
            cuda_graphs=cuda_graphs,
            reuse=(kv_cache_dtype,),
        )
        if graphs is not None:  # the prefilled rows move into the slots
            for row in range(input_ids_BL.shape[0]):
                graphs.slots.put(row, cache, row)
            cache = None
        done = torch.zeros(input_ids_BL.shape[0], dtype=torch.bool, device=input_ids_BL.device)
        out = []
        for _ in range(max_new_tokens):
            nxt = sample_next(
                logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen
            )
            if eos_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                done |= nxt == eos_id
            out.append(nxt)
            if eos_id is not None and bool(done.all()):
                break
            if graphs is not None:
                logits = graphs.forward(nxt[:, None])[0][:, -1]
            else:
                logits = model(nxt[:, None], cache=cache).logits[:, -1]
    finally:
        model.train(was_training)
    if not out:
        return input_ids_BL.new_zeros(input_ids_BL.shape[0], 0)
    return torch.stack(out, dim=1)
