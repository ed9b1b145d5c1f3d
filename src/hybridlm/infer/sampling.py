"""Token sampling: temperature, top-k and top-p (nucleus) filtering, greedy at temperature 0.

Shape legend: B batch, V vocabulary.

`filtered_probs` is the one definition of the distribution a request samples from; speculative
rejection sampling uses it for both the target and the draft, so "the output distribution equals
the target's" means equal to exactly this distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor


@dataclass
class SamplingParams:
    """Per-request decoding settings (the OpenAI API's fields, plus top-k and speculation)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    speculative: int = 0  # MTP draft length; 0 = off
    logprobs: bool = False  # return each sampled token's log-prob (RL: truncated IS needs them)
    include_stop_str_in_output: bool = False  # keep the matched stop string (vLLM's flag)

    def validate(self) -> SamplingParams:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or unset), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.speculative <= 16:
            raise ValueError(f"speculative draft length must be in [0, 16], got {self.speculative}")
        if self.logprobs and self.speculative:
            raise ValueError("logprobs are not returned for speculative requests; set one of them")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def filtered_probs(
    logits_BV: Tensor, *, temperature: float, top_k: int | None = None, top_p: float = 1.0
) -> Tensor:
    """softmax(logits / T) restricted to the top-k tokens and then to the smallest set whose
    mass reaches top_p (the nucleus, Holtzman et al. 2020), renormalised; fp32."""
    if temperature <= 0:
        raise ValueError("filtered_probs needs temperature > 0 (temperature 0 is argmax)")
    logits = logits_BV.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        # keep a token if the mass strictly before it is < top_p (the first token always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_next(
    logits_BV: Tensor,
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Greedy at temperature 0, else a draw from `filtered_probs`. Returns [B] token ids."""
    if temperature <= 0:
        return logits_BV.argmax(-1)
    probs = filtered_probs(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def sampled_logprobs(logits_BV: Tensor, tokens_B: Tensor, *, temperature: float) -> Tensor:
    """log softmax(logits / T) at the sampled tokens (T = 1 when greedy), fp32: the behaviour
    policy's log-probs that an RL trainer recomputes from the same logits (before top-k / top-p,
    which truncate the proposal but are not part of the policy being trained)."""
    t = temperature if temperature > 0 else 1.0
    logp_BV = torch.log_softmax(logits_BV.float() / t, dim=-1)
    return logp_BV.gather(-1, tokens_B[:, None])[:, 0]
