"""Token sampling: logits processors (penalties, logit bias, token masks), temperature, min-p,
top-k and top-p (nucleus) filtering, greedy at temperature 0; log-probs for RL and for the API.

Shape legend: B batch, V vocabulary, K top-k alternatives.

The order is vLLM's (v1 `Sampler.forward`), so that a request means the same on both servers:

1. raw logits -> the API log-probs (`top_logprobs` / echo `prompt_logprobs`: `log_softmax` of
   the raw logits, before any processing; vLLM's default `logprobs_mode="raw_logprobs"`);
2. `logit_bias` (added), `min_tokens` (EOS and `stop_token_ids` masked while fewer than
   `min_tokens` tokens were generated), then `apply_penalties`: repetition (CTRL, Keskar et al.
   2019, as vLLM: over prompt and generated tokens, a positive logit divided by p, a negative one
   multiplied by p), frequency and presence (OpenAI's definition, over generated tokens:
   logit[j] -= c[j] * frequency + (c[j] > 0) * presence);
3. the structured-output mask (`TokenConstraint.allowed`: disallowed ids -> -inf);
4. greedy: argmax of those logits; else `filtered_probs`: / temperature, min-p (drop tokens whose
   probability is below min_p x the largest, vLLM's `MinPLogitsProcessor`), top-k, top-p, and a
   draw.

Steps 2-3 are the same for greedy and sampled rows (a bias or a mask changes greedy output too).
`SamplingParams.logprobs` (RL) stays the sampled token's log-prob under softmax(raw logits / T),
what a trainer recomputes from the same model (`sampled_logprobs`).

`filtered_probs` is the one definition of the distribution a request samples from; speculative
rejection sampling uses it for both the target and the draft, so "the output distribution equals
the target's" means equal to exactly this distribution. Requests that need steps 2-3 (or the API
log-probs) do not decode speculatively (`SamplingParams.validate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

Tensor = torch.Tensor

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on chat top_logprobs (vLLM's default max_logprobs too)


@runtime_checkable
class TokenConstraint(Protocol):
    """A per-sequence token mask for structured outputs (JSON schema, grammar, forced tool call).

    The engine calls `allowed()` before sampling each token, `accept(token)` with every token it
    appends (not with the EOS / stop token that ends the request), and `finished()` after each
    `accept`: True ends the request with finish reason "stop"."""

    def allowed(self) -> torch.Tensor | None:
        """bool [V] over the model's vocabulary, True = allowed (a shorter mask disallows the
        ids past its end; EOS is allowed only where the mask says so); None = no restriction."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance with the sampled token."""
        ...

    def finished(self) -> bool:
        """The structure is complete: stop here."""
        ...


@dataclass
class SamplingParams:
    """Per-request decoding settings: the OpenAI API's fields, vLLM's extras (top-k, min-p,
    repetition penalty, min_tokens, stop_token_ids, ignore_eos), speculation, and the hooks of
    structured outputs (`constraint`) and the API's log-probs (`top_logprobs`,
    `prompt_logprobs`)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0  # vLLM's min-p: drop tokens with p < min_p * max p (after temperature)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings do not apply before this many
    presence_penalty: float = 0.0  # [-2, 2], OpenAI
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI
    repetition_penalty: float = 1.0  # > 0, vLLM / CTRL; 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> [-100, 100]
    speculative: int = 0  # MTP draft length; 0 = off
    # reasoning budget: at most this many tokens inside the reply's `<think>` block, then the
    # engine forces the closing tag and the answer follows (Nemotron 3 Super §4.4); None = off
    max_thinking_tokens: int | None = None
    logprobs: bool = False  # return each sampled token's log-prob (RL: truncated IS needs them)
    # the API's log-probs of the raw model distribution (vLLM's default): None = off, k >= 0 =
    # each generated token's log-prob and the k most likely alternatives
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token (completions echo)
    include_stop_str_in_output: bool = False  # keep the matched stop string (vLLM's flag)
    # structured outputs: a factory called once per sequence (each of n choices gets its own)
    constraint: Callable[[], TokenConstraint] | None = None

    def validate(self) -> SamplingParams:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not self.temperature >= 0:  # (NaN too)
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or unset), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for tid, bias in self.logit_bias.items():
            if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tid!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        for name in ("top_logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
        if self.max_thinking_tokens is not None and (
            isinstance(self.max_thinking_tokens, bool)
            or not isinstance(self.max_thinking_tokens, int)
            or self.max_thinking_tokens < 0
        ):
            raise ValueError(
                f"max_thinking_tokens must be an integer >= 0 (or unset), got "
                f"{self.max_thinking_tokens!r}"
            )
        if not 0 <= self.speculative <= 16:
            raise ValueError(f"speculative draft length must be in [0, 16], got {self.speculative}")
        if self.speculative:
            off = self.speculative_conflicts()
            if off:
                raise ValueError(
                    f"{', '.join(off)} cannot be used with speculative decoding (the MTP "
                    "drafter samples from temperature / top-k / top-p only); set speculative to 0"
                )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self

    def speculative_conflicts(self) -> list[str]:
        """The settings set here that speculative decoding cannot honour."""
        names = [
            "logprobs" * self.logprobs,
            "top_logprobs" * (self.top_logprobs is not None),
            "prompt_logprobs" * (self.prompt_logprobs is not None),
            "min_p" * (self.min_p > 0),
            "min_tokens" * (self.min_tokens > 0),
            "presence_penalty" * (self.presence_penalty != 0),
            "frequency_penalty" * (self.frequency_penalty != 0),
            "repetition_penalty" * (self.repetition_penalty != 1),
            "logit_bias" * bool(self.logit_bias),
            "constraint (structured output)" * (self.constraint is not None),
        ]
        return [n for n in names if n]

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def counts_tokens(self) -> bool:
        """Whether the engine keeps this request's token counts (a penalty is on)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


def apply_penalties(
    logits_BV: Tensor,
    counts_BV: Tensor,
    seen_BV: Tensor,
    *,
    repetition_B: Tensor,
    frequency_B: Tensor,
    presence_B: Tensor,
) -> Tensor:
    """vLLM's `apply_penalties` (model_executor/layers/utils.py): for tokens in `seen_BV` (the
    prompt's and the generated ones) a positive logit is divided by the repetition penalty and a
    negative one multiplied (CTRL, Keskar et al. 2019); then, with `counts_BV` the counts among
    the *generated* tokens, logit -= count * frequency + (count > 0) * presence (OpenAI's
    definition). Pure torch; fp32 out (fp64 for fp64 logits)."""
    logits = _fp(logits_BV)
    rep = torch.where(seen_BV, repetition_B.to(logits)[:, None], 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    counts = counts_BV.to(logits)
    frequency, presence = frequency_B.to(logits)[:, None], presence_B.to(logits)[:, None]
    return logits - frequency * counts - presence * (counts > 0)


def _fp(x: Tensor) -> Tensor:
    """fp32, or fp64 when it already is (the engine's fp64 parity tests)."""
    return x if x.dtype == torch.float64 else x.float()


def filtered_probs(
    logits_BV: Tensor,
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> Tensor:
    """softmax(logits / T) without the tokens below min_p x the largest probability (vLLM's
    min-p, applied first as in vLLM), restricted to the top-k tokens and then to the smallest set
    whose mass reaches top_p (the nucleus, Holtzman et al. 2020), renormalised; fp32."""
    if temperature <= 0:
        raise ValueError("filtered_probs needs temperature > 0 (temperature 0 is argmax)")
    logits = logits_BV.float() / temperature
    if min_p > 0:
        probs = torch.softmax(logits, -1)
        low = probs < min_p * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(low, float("-inf"))
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
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Greedy at temperature 0, else a draw from `filtered_probs`. Returns [B] token ids."""
    if temperature <= 0:
        return logits_BV.argmax(-1)
    probs = filtered_probs(
        logits_BV, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def sampled_logprobs(logits_BV: Tensor, tokens_B: Tensor, *, temperature: float) -> Tensor:
    """log softmax(logits / T) at the sampled tokens (T = 1 when greedy), fp32: the behaviour
    policy's log-probs that an RL trainer recomputes from the same logits (before top-k / top-p,
    which truncate the proposal but are not part of the policy being trained)."""
    t = temperature if temperature > 0 else 1.0
    logp_BV = torch.log_softmax(logits_BV.float() / t, dim=-1)
    return logp_BV.gather(-1, tokens_B[:, None])[:, 0]


@dataclass(frozen=True)
class TokenLogprob:
    """One position of the API's log-probs: the token there, its log-prob under the raw model
    distribution, and the k most likely tokens with theirs (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def top_logprobs(logits_BV: Tensor, tokens_B: Tensor, k: int) -> list[TokenLogprob]:
    """`TokenLogprob` of each row: log_softmax of the raw logits (fp32, fp64 for fp64 logits) at
    the row's token, and the row's k largest log-probs with their ids."""
    logp_BV = torch.log_softmax(_fp(logits_BV), dim=-1)
    tok_lp = logp_BV.gather(-1, tokens_B[:, None].to(logp_BV.device))[:, 0].tolist()
    tokens = tokens_B.tolist()
    if k <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, tok_lp, strict=True)]
    vals, ids = logp_BV.topk(min(k, logp_BV.shape[-1]), dim=-1)
    return [
        TokenLogprob(t, lp, tuple(zip(i, v, strict=True)))
        for t, lp, i, v in zip(tokens, tok_lp, ids.tolist(), vals.tolist(), strict=True)
    ]
