"""Speculative decoding with the shared-weight MTP head (Nemotron 3 Super §2.1.2): greedy, or
sampled with rejection sampling so that the output distribution is exactly the target's.

Shape legend: B batch (1 here), L length, D model width, V vocabulary, K draft length,
J = K + 1 verified positions.

`SpeculativeDecoder` holds one request and advances it by one draft + verify round per `step()`
(the first call prefills and returns the first token), so a serving loop can interleave it with
other work; `speculative_generate` runs it to the end. Each round, with backbone hidden h_t of
the last processed position t and the next token x_{t+1} (emitted, not yet run):

1. draft: the MTP module runs autoregressively over positions t, t+1, ...: position t takes
   (h_t, emb(x_{t+1})) and predicts d_1 = x_{t+2}; position t+j takes its own previous output in
   place of the backbone hidden and emb(d_j), predicting d_{j+1} (the recursion the shared
   weights are trained for). The MTP attention keeps its own KV cache over positions. A draft
   is the argmax of the MTP logits (temperature 0) or a draw from q_j = `filtered_probs` of them
   with the request's temperature / top-k / top-p.
2. verify: one backbone forward over [x_{t+1}, d_1..d_K] gives the target p_j of every draft
   and p_{K+1} after the last one, filtered with the same settings.
   - temperature 0: drafts are accepted while they equal the backbone's argmax; the first
     disagreement (or the argmax after K accepted) is the next token. The output is the
     backbone's greedy output, token for token.
   - temperature > 0, rejection sampling (Leviathan et al. 2023, "Fast Inference from
     Transformers via Speculative Decoding", Alg. 1; Chen et al. 2023, "Accelerating LLM Decoding
     with Speculative Sampling", Alg. 2): accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
     at the first rejection emit a draw from the residual norm(max(0, p_j - q_j)) and stop; if
     all K are accepted emit a bonus draw from p_{K+1}. Every emitted token is then distributed
     exactly as p given its prefix (Leviathan et al. Appendix A.1), whatever q is. Greedy is the
     limit of one-hot p and q: p(d)/q(d) is 1 on a match and 0 otherwise, and the residual is
     the one-hot of p's argmax.
   All randomness (drafts, acceptance uniforms, residual / bonus draws) comes from one
   `torch.Generator`, so a seed reproduces the output.
3. rollback of rejected drafts, two ways (`rollback=`):
   - "history" (default), a state per draft position: the verify pass runs the Mamba layers'
     decode recurrence token by token and keeps the conv and SSM state after every position
     (`HybridCache.record_history`); on rejection the cache is rewound to the last accepted
     position (`HybridCache.rewind`: attention KV truncated, Mamba states picked from the
     history). One backbone forward per round; costs K+1 SSM states per Mamba layer while the
     round lasts (the choice of Nemotron 3 Super §4.3's serving path and vLLM's Mamba
     speculative decoding, which also keep per-position states).
   - "recompute": the cache is restored to its `HybridCache.snapshot()` from before the verify
     pass and the accepted tokens run again: no extra state, but a second short forward on
     every round with a rejection.
   The MTP cache is truncated to its last exact position; the accepted positions rerun with true
   hiddens in the same MTP call as the next round's first draft.

Reduced draft vocabulary (`DraftVocab`; FR-Spec, Zhao et al. 2025, "FR-Spec: Accelerating
Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling"): the drafter scores
only the N most frequent token ids (rows of the LM head gathered once), so a draft reads N x D
head weights instead of V x D, the largest part of a draft's cost at a 32k+ vocabulary. A draft
is the argmax / a draw over the N ids; the verify pass still scores the full vocabulary, so the
output is unchanged: greedy equals plain greedy, and rejection sampling stays exact with q zero
outside the N ids (the residual covers them). Only the acceptance can drop, when the target's
token is outside the N.

In a serving batch (`infer.engine`) the same pieces run per row (`SpeculativeDecoder.
sample` / `draft` / `judge` / `advance`) while the engine owns the backbone cache: the
drafts of all speculative rows come from one MTP call per draft position (`draft_batch`, the
rows' MTP caches kept as one right-aligned batch), one forward verifies every row, and the batch
cache keeps each row's accepted prefix (`HybridCache.rewind_rows`).

Drafts are capped so a request never emits more than `max_new_tokens`: with r tokens left a
round drafts min(K, max(r - 1, 1)) (a full round emits its drafts plus one), and emitted tokens
stop after the first stop token.

`SpecStats` follows SPEED-Bench: acceptance length = tokens emitted per verify step (accepted
drafts + 1), and the acceptance rate of each draft position.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..model.cache import HybridCache
from ..model.model import HybridLM
from ..model.slots import SlotCache
from ..model.stock import project
from ..precision.kv_cache import kv_codecs
from .graphs import DecodeGraphs
from .sampling import SamplingParams, filtered_probs

Tensor = torch.Tensor
MAX_DRAFT_LEN = 16
ROLLBACKS = ("history", "recompute")


@dataclass
class SpecStats:
    """Acceptance counters of one request. Rounds near `max_new_tokens` draft fewer than
    `draft_len` tokens; each position's rate counts only the drafts actually made there."""

    draft_len: int
    steps: int = 0  # verify forwards
    accepted: int = 0  # accepted drafts, over all steps
    accepted_at: list[int] = field(default_factory=list)  # per draft position
    drafted_at: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_at = self.accepted_at or [0] * self.draft_len
        self.drafted_at = self.drafted_at or [0] * self.draft_len

    def record(self, n_drafted: int, n_accepted: int) -> None:
        self.steps += 1
        self.accepted += n_accepted
        for i in range(n_drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verify step (accepted drafts + the verified token)."""
        return (self.accepted + self.steps) / max(self.steps, 1)

    def acceptance_by_position(self) -> list[float]:
        """Fraction of the drafts at each position (1..K) that were accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]

    def to_dict(self) -> dict[str, int | float | list[float]]:
        """JSON-ready summary for the API and CLI (`accepted_tokens`: accepted drafts)."""
        return {
            "draft_len": self.draft_len,
            "steps": self.steps,
            "acceptance_length": self.acceptance_length,
            "acceptance_by_position": self.acceptance_by_position(),
            "accepted_tokens": self.accepted,
        }


def merge_stats(stats: list[SpecStats]) -> dict[str, int | float | list[float]]:
    """Acceptance over many requests: length = tokens per verify step; rates per position."""
    k = max(s.draft_len for s in stats)
    total = SpecStats(draft_len=k)
    for s in stats:
        total.steps += s.steps
        total.accepted += s.accepted
        for i in range(s.draft_len):
            total.accepted_at[i] += s.accepted_at[i]
            total.drafted_at[i] += s.drafted_at[i]
    return total.to_dict()


def residual_probs(p_V: Tensor, q_V: Tensor) -> Tensor:
    """norm(max(0, p - q)): the distribution of the token emitted after a draft from q is
    rejected against p (Leviathan et al. 2023 Alg. 1). Where p <= q everywhere (p == q up to
    rounding, so a rejection had probability ~0) it is p itself. Works on [..., V]."""
    r_V = (p_V - q_V).clamp_min(0.0)
    mass = r_V.sum(-1, keepdim=True)
    return torch.where(mass > 0, r_V / mass.clamp_min(torch.finfo(r_V.dtype).tiny), p_V)


def _draw(probs_V: Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs_V, 1, generator=generator))


def rejection_verify(
    p_JV: Tensor, q_KV: Tensor, drafts_K: Tensor, generator: torch.Generator
) -> tuple[int, int]:
    """Speculative sampling of K drafts (Leviathan et al. 2023 Alg. 1; Chen et al. 2023 Alg. 2).
    `p_JV`: target distributions at the K draft positions and after the last draft (J = K + 1);
    `q_KV`: the draft distributions the drafts were sampled from. Returns (accepted, next):
    draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); `next` is drawn from the
    residual norm(max(0, p - q)) at the first rejection, else from p_{K+1} (the bonus token)."""
    K = drafts_K.shape[0]
    if p_JV.shape[0] != K + 1 or q_KV.shape[0] != K:
        raise ValueError(f"need K + 1 target and K draft rows for K={K} drafts")
    u_K = torch.rand(K, generator=generator, device=p_JV.device, dtype=p_JV.dtype)
    idx_K = torch.arange(K, device=p_JV.device)
    p_d, q_d = p_JV[idx_K, drafts_K], q_KV[idx_K, drafts_K]
    # u < p/q written without the division: q(d) > 0 for a sampled d, and p(d) = 0 never accepts
    rejected = (u_K * q_d >= p_d).tolist()
    m = rejected.index(True) if True in rejected else K
    if m == K:
        return K, _draw(p_JV[K], generator)
    return m, _draw(residual_probs(p_JV[m], q_KV[m]), generator)


def greedy_verify(target_logits_JV: Tensor, drafts_K: Tensor) -> tuple[int, int]:
    """Temperature 0: drafts are accepted while they equal the target's argmax; returns
    (accepted, next) with `next` the argmax after the accepted prefix."""
    K = drafts_K.shape[0]
    best_J = target_logits_JV.argmax(-1)
    mismatch = (best_J[:K] != drafts_K).tolist()
    m = mismatch.index(True) if True in mismatch else K
    return m, int(best_J[m])


class DraftVocab:
    """A reduced draft vocabulary (module docstring, FR-Spec): token `ids` (distinct, sorted) and
    the LM head's rows for them, gathered from the weights at construction (`refresh()` after
    the head's weights change). `from_counts` / `from_tokens` pick the N most frequent ids."""

    def __init__(self, model: HybridLM, ids: Sequence[int] | Tensor) -> None:
        V = model.config.vocab_size
        ids_N = torch.as_tensor(ids, dtype=torch.long).flatten().unique()  # sorted
        if ids_N.numel() == 0:
            raise ValueError("a draft vocabulary needs at least one token id")
        if int(ids_N[0]) < 0 or int(ids_N[-1]) >= V:
            raise ValueError(f"draft vocabulary ids must be in [0, {V}), got {ids_N.tolist()[:8]}")
        W = model.lm_head.weight
        self.model = model
        self.vocab_size = V
        self.ids_N = ids_N.to(W.device)
        # built on the meta device: its weight is the gathered rows, no initialisation to discard
        self.head = torch.nn.Linear(W.shape[1], len(ids_N), bias=False, device="meta")
        self.head.weight = torch.nn.Parameter(W.detach()[self.ids_N], requires_grad=False)

    def refresh(self) -> None:
        """Gather the rows again from the model's current LM head, in place (decoders holding
        this vocabulary see the new weights)."""
        with torch.no_grad():
            self.head.weight.copy_(self.model.lm_head.weight[self.ids_N])

    def __len__(self) -> int:
        return self.ids_N.numel()

    @classmethod
    def from_counts(
        cls, model: HybridLM, counts_V: Tensor, size: int, always: Iterable[int] = ()
    ) -> DraftVocab:
        """The `size` ids with the highest counts (ties: lower id first), plus `always` (e.g.
        EOS and the chat's stop tokens, so drafts can end a turn)."""
        V = model.config.vocab_size
        if counts_V.numel() != V:
            n = counts_V.numel()
            raise ValueError(f"counts must have one entry per token id ({V}), got {n}")
        if not 1 <= size <= V:
            raise ValueError(f"draft vocabulary size must be in [1, {V}], got {size}")
        # stable sort of -count: the most frequent first, ties by id
        order = torch.sort(-counts_V.double(), stable=True).indices[:size]
        return cls(model, torch.cat([order.cpu(), torch.tensor(list(always), dtype=torch.long)]))

    @classmethod
    def from_tokens(
        cls, model: HybridLM, tokens: Iterable[Sequence[int] | Tensor], size: int, **kw
    ) -> DraftVocab:
        """`from_counts` with the counts of the token id sequences `tokens` (a corpus, or the
        model's own generations)."""
        V = model.config.vocab_size
        counts = torch.zeros(V, dtype=torch.long)
        for seq in tokens:
            t = torch.as_tensor(seq, dtype=torch.long).flatten().cpu()
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= V):
                raise ValueError(f"token ids must be in [0, {V})")
            counts += torch.bincount(t, minlength=V)
        return cls.from_counts(model, counts, size, **kw)

    def logits(self, h_BLD: Tensor) -> Tensor:
        """Draft logits over the N ids [..., N]."""
        return project(self.head, h_BLD)

    def full_probs(self, q_BN: Tensor) -> Tensor:
        """Probabilities over the N ids scattered into the full vocabulary (zero elsewhere)."""
        out = q_BN.new_zeros(*q_BN.shape[:-1], self.vocab_size)
        return out.index_copy_(-1, self.ids_N, q_BN)


def _mtp(
    model: HybridLM,
    h_BLD: Tensor,
    next_BL: Tensor,
    cache: HybridCache,
    draft_vocab: DraftVocab | None = None,
    *,
    logits: bool = True,
):
    """Run the MTP module over len(next) new positions; returns (hidden, logits of the last
    position: over the vocabulary, over `draft_vocab`'s ids, or None with `logits=False`)."""
    out = _mtp_batch(model, h_BLD, next_BL, cache, None)
    if not logits:
        return out, None
    last = out[:, -1:]  # only the newest position's draft is used
    if draft_vocab is not None:
        return out, draft_vocab.logits(last)
    return out, project(model.lm_head, last)


class MTPDrafter:
    """The MTP side of one request (module docstring, step 1): its MTP cache over the exact
    positions and the exact inputs not yet run, (backbone hidden h_t, token x_{t+1}) pairs.
    `feed` queues pairs, `consume` runs the queued pairs now (a prompt's positions, so that a
    prefix cache can keep the MTP cache at a block boundary); `draft_batch` runs the queue and
    K recursive draft positions, and forgets the latter."""

    def __init__(
        self,
        model: HybridLM,
        draft_vocab: DraftVocab | None = None,
        cache: HybridCache | None = None,
    ) -> None:
        self.model = model
        self.draft_vocab = draft_vocab
        self.cache = cache or HybridCache.for_pattern(model.config.mtp.pattern)
        self._h_BLD: Tensor | None = None
        self._tok_BL: Tensor | None = None

    def feed(self, h_BLD: Tensor, tok_BL: Tensor) -> None:
        """Queue exact (hidden, next token) pairs of the next positions."""
        if h_BLD.shape[:2] != tok_BL.shape:
            raise ValueError("feed one next token per hidden state")
        if h_BLD.shape[1] == 0:
            return
        if self._h_BLD is None:
            self._h_BLD, self._tok_BL = h_BLD, tok_BL
        else:
            self._h_BLD = torch.cat([self._h_BLD, h_BLD], dim=1)
            self._tok_BL = torch.cat([self._tok_BL, tok_BL], dim=1)

    def queued(self) -> int:
        """Exact pairs queued, not yet run."""
        return 0 if self._h_BLD is None else self._h_BLD.shape[1]

    def consume(self) -> None:
        """Run the queued pairs through the MTP module (no logits)."""
        if self._h_BLD is not None:
            _mtp(self.model, self._h_BLD, self._tok_BL, self.cache, logits=False)
            self._h_BLD = self._tok_BL = None


def _prompt_BL(prompt_ids: Sequence[int] | Tensor, vocab_size: int, device) -> Tensor:
    shape_msg = "speculative decoding takes one non-empty prompt of shape [1, seq]"
    if isinstance(prompt_ids, Tensor):
        ids = prompt_ids[None] if prompt_ids.dim() == 1 else prompt_ids
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ValueError(f"{shape_msg}, got shape {tuple(prompt_ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise TypeError(f"prompt token ids must be integers, got {ids.dtype}")
        ids = ids.to(device=device, dtype=torch.long)
    else:
        ids_list = list(prompt_ids)
        if not ids_list or not all(isinstance(t, int) for t in ids_list):
            raise ValueError(f"{shape_msg} (or a non-empty list of ints)")
        ids = torch.tensor([ids_list], dtype=torch.long, device=device)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got [{lo}, {hi}]")
    return ids


class SpeculativeDecoder:
    """One request decoded speculatively with MTP drafts, one draft + verify round per `step()`.

    `temperature` 0 is greedy (output == plain greedy decoding); above 0 drafts are verified by
    rejection sampling, so the output is distributed as `filtered_probs(backbone logits,
    temperature, top_k, top_p)`. Randomness comes from `generator`, else a generator seeded by
    `seed` (unseeded: nondeterministic). Decoding ends after `max_new_tokens` (None: no limit)
    or after emitting `eos_id` or one of `stop_token_ids` (the stop token is emitted).
    `draft_vocab` restricts the drafts to a `DraftVocab` (cheaper drafts, same output).
    `kv_cache_dtype`: the backbone's KV cache storage (`precision.kv_cache`; the drafter's stays
    unquantised), as plain decoding stores it so that greedy output stays equal.
    `tokens` holds everything emitted so far, `stats` the acceptance statistics."""

    def __init__(
        self,
        model: HybridLM,
        prompt_ids: Sequence[int] | Tensor,
        *,
        draft_len: int = 3,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        eos_id: int | None = None,
        stop_token_ids: Iterable[int] = (),
        rollback: str = "history",
        draft_vocab: DraftVocab | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        cfg = model.config
        self.kv_codecs = kv_codecs(model, kv_cache_dtype)
        if rollback not in ROLLBACKS:
            raise ValueError(f"rollback must be one of {ROLLBACKS}, got {rollback!r}")
        self.rollback = rollback
        model.check_drafter("speculative decoding")
        if "M" in cfg.mtp.pattern:
            # the MTP cache is rolled back by truncation, which Mamba states cannot do
            raise ValueError(
                "speculative drafting supports MTP layers of attention and MoE/MLP blocks"
            )
        if not 1 <= draft_len <= MAX_DRAFT_LEN:
            raise ValueError(f"draft_len must be in [1, {MAX_DRAFT_LEN}], got {draft_len}")
        if max_new_tokens is not None and max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p).validate()
        if seed is not None and generator is not None:
            raise ValueError("pass either seed or generator, not both")
        device = model.embeddings.weight.device
        if draft_vocab is not None and (
            draft_vocab.vocab_size != cfg.vocab_size
            or draft_vocab.head.weight.shape[1] != cfg.d_model
        ):
            raise ValueError("draft_vocab was built for a different model")
        self.draft_vocab = draft_vocab
        self.model = model
        self.prompt_BL = _prompt_BL(prompt_ids, cfg.vocab_size, device)
        self.draft_len = draft_len
        self.max_new_tokens = max_new_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        if generator is None:
            generator = torch.Generator(device=device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
        elif generator.device.type != device.type:
            raise ValueError(f"generator is on {generator.device}, the model on {device}")
        self.generator = generator
        self.stop_ids = set(stop_token_ids) | ({eos_id} if eos_id is not None else set())
        self.tokens: list[int] = []
        self.stats = SpecStats(draft_len)
        self.finished = max_new_tokens == 0
        self.drafter = MTPDrafter(model, draft_vocab)
        self._cache: HybridCache | None = None  # backbone (`step()`; a serving batch holds its own)
        self.next_token: int | None = None  # emitted, not yet run through the backbone

    @classmethod
    def from_params(
        cls,
        model: HybridLM,
        prompt_ids: Sequence[int] | Tensor,
        params: SamplingParams,
        *,
        eos_id: int | None = None,
        draft_vocab: DraftVocab | None = None,
    ) -> SpeculativeDecoder:
        """A decoder for a request's `SamplingParams` (draft length `params.speculative`; stop
        strings are the caller's, they need the detokenizer)."""
        params.validate()
        if params.speculative < 1:
            raise ValueError("SamplingParams.speculative must be >= 1 for speculative decoding")
        stops = list(params.stop_token_ids)
        if eos_id is not None and not params.ignore_eos:
            stops.append(eos_id)
        return cls(
            model,
            prompt_ids,
            draft_len=params.speculative,
            max_new_tokens=params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            stop_token_ids=stops,
            draft_vocab=draft_vocab,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def tokens_left(self) -> int | None:
        """Tokens this request may still emit (None: no limit)."""
        return self._remaining()

    def _remaining(self) -> int | None:
        return None if self.max_new_tokens is None else self.max_new_tokens - len(self.tokens)

    def _probs(self, logits_BV: Tensor) -> Tensor:
        return filtered_probs(
            logits_BV, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p
        )

    @torch.no_grad()
    def step(self) -> list[int]:
        """Prefill (first call, returns the first token) or one draft + verify round (returns
        the 1..K+1 tokens it emits). Returns [] once finished."""
        if self.finished:
            return []
        was_training = self.model.training
        if was_training:  # train()/eval() walk every module: only when the mode changes
            self.model.eval()
        try:
            new = self._prefill() if self._cache is None else self._round()
        finally:
            if was_training:
                self.model.train()
        return self.emit(new)

    # The pieces of a round, shared by `step()` and a serving engine that verifies the drafts
    # of many requests in one batched forward (`infer.engine`): sample (the first token, or a
    # step without drafts) / draft / judge / advance; the caller runs the backbone and rolls
    # its cache back to the accepted prefix.
    def sample(self, logits_1V: Tensor) -> int:
        """A token from the backbone's logits without drafts (argmax or a draw): the first
        token after the prompt, or a step decoded without speculation."""
        if self.greedy:
            return int(logits_1V.argmax(-1))
        return _draw(self._probs(logits_1V)[0], self.generator)

    def round_drafts(self) -> int:
        """Drafts this round makes: `draft_len`, capped by the tokens left."""
        r = self._remaining()
        return self.draft_len if r is None else min(self.draft_len, max(r - 1, 1))

    def draft(self) -> tuple[list[int], Tensor | None]:
        """This round's drafts and, when sampling, the [K, V] distributions they were drawn
        from (`draft_batch` of this request alone, on its own MTP cache)."""
        return draft_batch([self], self.drafter.cache)[0]

    def judge(
        self, logits_JV: Tensor, drafts: list[int], q_KV: Tensor | None
    ) -> tuple[int, list[int]]:
        """Verify the drafts against the backbone logits of [next_token, *drafts] (J = K + 1
        rows): returns (accepted m, the m accepted drafts followed by the next token)."""
        drafts_K = torch.tensor(drafts, dtype=torch.long, device=logits_JV.device)
        if self.greedy:
            m, nxt = greedy_verify(logits_JV, drafts_K)
        else:
            m, nxt = rejection_verify(self._probs(logits_JV), q_KV, drafts_K, self.generator)
        self.stats.record(len(drafts), m)
        return m, drafts[:m] + [nxt]

    def advance(self, hidden_1MD: Tensor, new: list[int]) -> None:
        """After the backbone kept [next_token, *accepted drafts] (hidden states [1, m + 1, D]):
        queue their exact MTP inputs; the last of `new` is the next token."""
        tok_1M = torch.tensor([new], dtype=torch.long, device=hidden_1MD.device)
        self.drafter.feed(hidden_1MD, tok_1M)
        self.next_token = new[-1]

    def emit(self, new: list[int]) -> list[int]:
        """Append `new` up to the token limit and the first stop token; set `finished`."""
        out = []
        for tok in new:
            out.append(tok)
            if tok in self.stop_ids:
                self.finished = True
                break
            if self._remaining() is not None and len(out) == self._remaining():
                break
        self.tokens.extend(out)
        if self._remaining() == 0:
            self.finished = True
        return out

    def finishes(self, new: list[int]) -> bool:
        """Whether emitting `new` ends the request (its caches are then not used again)."""
        r = self._remaining()
        return (r is not None and len(new) >= r) or any(t in self.stop_ids for t in new)

    def _prefill(self) -> list[int]:
        model, x_BL = self.model, self.prompt_BL
        self._cache = HybridCache.for_pattern(model.config.pattern, kv_codecs=self.kv_codecs)
        pre = model(x_BL, cache=self._cache, return_hidden=True)
        nxt = self.sample(pre.logits[:, -1])
        # MTP position t sees (h_t, x_{t+1}); run with the first draft of the next round
        self.drafter.feed(pre.hidden, torch.cat([x_BL[:, 1:], x_BL.new_full((1, 1), nxt)], 1))
        self.next_token = nxt
        return [nxt]

    def _round(self) -> list[int]:
        model, cache = self.model, self._cache
        assert cache is not None
        drafts, q_KV = self.draft()  # 1) draft
        # 2) verify all drafts in one backbone forward
        seq_BJ = torch.tensor([[self.next_token, *drafts]], device=self.prompt_BL.device)
        history = self.rollback == "history"
        if history:
            cache.record_history(True)
        else:
            snap = cache.snapshot()
        ver = model(seq_BJ, cache=cache, return_hidden=True)
        if history:
            cache.record_history(False)
        m, new = self.judge(ver.logits[0], drafts, q_KV)
        if self.finishes(new):
            return new  # the caches are not used again
        # 3) rollback of rejected drafts: to the states kept per position, or by recompute
        K = len(drafts)
        if m < K and history:
            cache.rewind(K - m)
        elif m < K:
            cache.restore(snap)
            ver = model(seq_BJ[:, : m + 1], cache=cache, return_hidden=True)
        self.advance(ver.hidden[:, : m + 1], new)
        return new


@torch.no_grad()
def draft_batch(
    decoders: list[SpeculativeDecoder],
    cache: HybridCache,
    limits: Sequence[int | None] | None = None,
) -> list[tuple[list[int], Tensor | None]]:
    """`draft()` of several requests in one MTP call per draft position: `cache` holds their
    MTP caches as the rows of one batch (right-aligned, `HybridCache.cat`), in the order of
    `decoders`, whose own drafter caches are then unused. The queued exact pairs of the rows
    (one or more each) run right-padded in the first call (the padding stays masked in the
    cache), every row drafts max(K) positions, and the draft columns are dropped at the end. A
    row samples only its own K drafts, from its own generator in `draft()`'s order, so each
    row's drafts are those `draft()` would make alone (up to batched float rounding).
    `limits[b]` (not None) caps row b's drafts this round (0: it only runs its queue)."""
    dec0 = decoders[0]
    model, dv = dec0.model, dec0.drafter.draft_vocab
    B = len(decoders)
    ks = [d.round_drafts() for d in decoders]
    if limits is not None:
        ks = [k if cap is None else min(k, cap) for k, cap in zip(ks, limits, strict=True)]
    K = max(ks)
    x_BPD, n_B = _run_queued(decoders, cache, keep_last=False)
    h_B1D = x_BPD[torch.arange(B), n_B - 1][:, None]  # each row's last real position
    drafts: list[list[int]] = [[] for _ in range(B)]
    q_rows: list[list[Tensor]] = [[] for _ in range(B)]
    tok_B = n_B  # each position's drafts, set below before the next position reads them
    for j in range(K):
        if j > 0:
            h_B1D = _mtp_batch(model, h_B1D, tok_B[:, None], cache, None)
        if dv is not None:
            logits_BN = dv.logits(h_B1D)[:, 0]
        else:
            logits_BN = project(model.lm_head, h_B1D)[:, 0]
        tok_B = logits_BN.argmax(-1)
        for b, d in enumerate(decoders):
            if j < ks[b] and not d.greedy:
                q_1N = d._probs(logits_BN[b : b + 1])
                tok_B[b] = torch.multinomial(q_1N, 1, generator=d.generator)[0, 0]
                q_rows[b].append(q_1N if dv is None else dv.full_probs(q_1N))
        if dv is not None:
            tok_B = dv.ids_N[tok_B]
        for b, t in enumerate(tok_B.tolist()):
            if j < ks[b]:
                drafts[b].append(t)
    # forget the draft positions; they rerun with true hiddens once verified
    cache.truncate(cache.seen_tokens - max(K - 1, 0))
    return [(drafts[b], torch.cat(q_rows[b]) if q_rows[b] else None) for b in range(B)]


@torch.no_grad()
def consume_batch(decoders: list[SpeculativeDecoder], cache: HybridCache) -> None:
    """Run every row's queued exact pairs but the last (the next draft starts from it) through
    the MTP module in one call, so that queues stay short while rows decode without drafting
    (a serving engine that pauses speculation under load)."""
    if any(d.drafter._h_BLD is not None and d.drafter._h_BLD.shape[1] > 1 for d in decoders):
        _run_queued(decoders, cache, keep_last=True)


def _run_queued(
    decoders: list[SpeculativeDecoder], cache: HybridCache, *, keep_last: bool
) -> tuple[Tensor, Tensor]:
    """One MTP call over the rows' queued pairs, right-padded to the longest (`keep_last`: all
    but each row's last pair, which stays queued). Returns (outputs [B, P, D], pairs per row)."""
    pend = []
    for d in decoders:
        dr = d.drafter
        if dr._h_BLD is None:
            raise ValueError("draft needs each row's last hidden state and next token")
        n = dr._h_BLD.shape[1] - int(keep_last)
        pend.append((dr._h_BLD[:, :n], dr._tok_BL[:, :n]))
        if keep_last:
            dr._h_BLD, dr._tok_BL = dr._h_BLD[:, n:], dr._tok_BL[:, n:]
        else:
            dr._h_BLD = dr._tok_BL = None
    n_B = torch.tensor([h.shape[1] for h, _ in pend])
    P = int(n_B.max())
    pad = torch.nn.functional.pad
    h_BPD = torch.cat([pad(h, (0, 0, 0, P - h.shape[1])) for h, _ in pend])
    tok_BP = torch.cat([pad(t, (0, P - t.shape[1])) for _, t in pend])
    ragged = bool((n_B < P).any())  # rows queued different numbers of pairs
    mask = (torch.arange(P)[None] < n_B[:, None]).to(tok_BP.device) if ragged else None
    return _mtp_batch(decoders[0].model, h_BPD, tok_BP, cache, mask), n_B


def _mtp_batch(
    model: HybridLM, h_BLD: Tensor, tok_BL: Tensor, cache: HybridCache, mask_BL: Tensor | None
) -> Tensor:
    """The MTP module over L new columns of a batch cache (padded rows: per-row positions and
    masks as `HybridLM.forward` builds them; `mask_BL` False on padding in this call)."""
    out = _mtp_call(model, h_BLD, tok_BL, cache, mask_BL)
    cache.advance(tok_BL.shape[1])
    return out


def _mtp_call(
    model: HybridLM,
    h_BLD: Tensor,
    tok_BL: Tensor,
    cache: HybridCache | SlotCache,
    mask_BL: Tensor | None = None,
) -> Tensor:
    """The MTP module over L new positions of a cache's rows, with the context the backbone's
    forward would build for them (`HybridLM._block_context`); the caller advances the cache
    (a `SlotCache`'s rows by their own counts)."""
    ctx = model._block_context(tok_BL, None, mask_BL, cache)
    return model.mtp(h_BLD, model.embeddings(tok_BL), states=cache.layers, **ctx)


def _queued_slots(
    decoders: dict[int, SpeculativeDecoder], b: int, *, keep_last: bool
) -> tuple[tuple[Tensor, Tensor, Tensor], list[int]]:
    """The rows' queued (hidden, token) pairs right-padded into [b, P] inputs, rows indexed as
    the batch (rows without a decoder: one zero pair, their slots inactive), with the pairs
    per row (a tensor, and a list for the host); `keep_last` leaves each row's last pair
    queued."""
    dec0 = next(iter(decoders.values()))
    device = dec0.model.embeddings.weight.device
    pend: dict[int, tuple[Tensor, Tensor]] = {}
    for r, d in decoders.items():
        dr = d.drafter
        if dr._h_BLD is None:
            raise ValueError("draft needs each row's last hidden state and next token")
        m = dr._h_BLD.shape[1] - int(keep_last)
        pend[r] = (dr._h_BLD[0, :m], dr._tok_BL[0, :m])
        if keep_last:
            dr._h_BLD, dr._tok_BL = dr._h_BLD[:, m:], dr._tok_BL[:, m:]
        else:
            dr._h_BLD = dr._tok_BL = None
    P = max(1, max(h.shape[0] for h, _ in pend.values()))
    h0 = next(iter(pend.values()))[0]
    h_bPD = h0.new_zeros(b, P, h0.shape[-1])
    tok_bP = torch.zeros(b, P, dtype=torch.long, device=device)
    cnt = [1] * b
    for r, (h, t) in pend.items():
        h_bPD[r, : h.shape[0]] = h
        tok_bP[r, : t.shape[0]] = t
        cnt[r] = h.shape[0]
    return (h_bPD, tok_bP, torch.tensor(cnt, device=device)), cnt


@torch.no_grad()
def draft_slots(
    decoders: dict[int, SpeculativeDecoder],
    n: int,
    graphs: DecodeGraphs,
    limits: dict[int, int | None] | None = None,
) -> dict[int, tuple[list[int], Tensor | None]]:
    """`draft_batch` over the MTP module's slots (`graphs.slots`, rows indexed as the serving
    batch of n rows; `decoders`: row -> the speculative rows' decoders): one call runs every
    row's queued pairs and the K recursive draft positions and forgets the latter. When every
    speculative row is greedy the call is one captured graph (`infer.graphs`); sampled rows
    draw from their own generators, eagerly. Each row's drafts are those `draft()` would make
    alone (up to batched float rounding)."""
    dec0 = next(iter(decoders.values()))
    model, dv = dec0.model, dec0.drafter.draft_vocab
    ks = {r: d.round_drafts() for r, d in decoders.items()}
    if limits is not None:
        ks = {r: k if limits.get(r) is None else min(k, limits[r]) for r, k in ks.items()}
    K = max(1, max(ks.values()))
    P = max(d.drafter.queued() for d in decoders.values())
    sl = graphs.slots
    b, s = graphs.bucket(n, P + K)
    inputs, cnt = _queued_slots(decoders, b, keep_last=False)
    sampled = {r: d for r, d in decoders.items() if not d.greedy}
    q_rows: dict[int, list[Tensor]] = {r: [] for r in sampled}

    def pick(j: int, logits_bN: Tensor) -> Tensor:
        tok_b = logits_bN.argmax(-1)
        for r, d in sampled.items():
            if j < ks[r]:
                q_1N = d._probs(logits_bN[r : r + 1])
                tok_b[r] = torch.multinomial(q_1N, 1, generator=d.generator)[0, 0]
                q_rows[r].append(q_1N if dv is None else dv.full_probs(q_1N))
        return tok_b if dv is None else dv.ids_N[tok_b]

    def draft(h_bPD: Tensor, tok_bP: Tensor, cnt_b: Tensor) -> tuple[Tensor]:
        x_bPD = _mtp_call(model, h_bPD, tok_bP, sl)
        sl.advance(cnt_b)
        h_b1D = x_bPD[torch.arange(b, device=x_bPD.device), cnt_b - 1][:, None]
        head = dv.logits if dv is not None else lambda h: project(model.lm_head, h)
        toks = []
        for j in range(K):
            if j > 0:
                h_b1D = _mtp_call(model, h_b1D, toks[-1][:, None], sl)
                sl.advance(1)
            toks.append(pick(j, head(h_b1D)[:, 0]))
        sl.advance(-(K - 1))  # forget the draft positions; they rerun once verified
        return (torch.stack(toks, dim=1),)

    key = ("draft", b, s, P, K, dv is not None)
    (toks_bK,) = graphs.run(key, (b, s), draft, inputs, capture=not sampled)
    for r in decoders:
        sl.host_len[r] += cnt[r]
    toks = toks_bK.tolist()
    return {
        r: (toks[r][: ks[r]], torch.cat(q_rows[r]) if q_rows.get(r) else None) for r in decoders
    }


@torch.no_grad()
def consume_slots(decoders: dict[int, SpeculativeDecoder], n: int, graphs: DecodeGraphs) -> None:
    """`consume_batch` over the MTP module's slots (rows as in `draft_slots`)."""
    if not any(d.drafter.queued() > 1 for d in decoders.values()):
        return
    P = max(d.drafter.queued() for d in decoders.values()) - 1
    sl = graphs.slots
    b, s = graphs.bucket(n, P)
    (h_bPD, tok_bP, cnt_b), cnt = _queued_slots(decoders, b, keep_last=True)
    sl.bucket = (b, s)
    _mtp_call(decoders[next(iter(decoders))].model, h_bPD, tok_bP, sl)
    sl.advance(cnt_b)
    for r in decoders:
        sl.host_len[r] += cnt[r]


@torch.no_grad()
def speculative_generate(
    model: HybridLM,
    input_ids_BL: Tensor,
    max_new_tokens: int,
    *,
    draft_len: int = 3,
    eos_id: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int | None = None,
    rollback: str = "history",
    draft_vocab: DraftVocab | None = None,
) -> tuple[Tensor, SpecStats]:
    """Speculative decoding of one prompt [1, L] to the end; returns (tokens [1, n], stats).
    At temperature 0 the tokens equal greedy `generate`; above 0 they are a sample of the
    backbone's filtered distribution (reproducible with `seed`)."""
    if input_ids_BL.dim() != 2 or input_ids_BL.shape[0] != 1 or input_ids_BL.shape[1] == 0:
        raise ValueError("speculative decoding takes one non-empty prompt of shape [1, seq]")
    dec = SpeculativeDecoder(
        model,
        input_ids_BL,
        draft_len=draft_len,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_id=eos_id,
        rollback=rollback,
        draft_vocab=draft_vocab,
    )
    while not dec.finished:
        dec.step()
    return torch.tensor([dec.tokens], dtype=torch.long, device=input_ids_BL.device), dec.stats
