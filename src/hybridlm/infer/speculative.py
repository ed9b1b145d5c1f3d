"""Greedy speculative decoding with the shared-weight MTP head (Nemotron 3 Super §2.1.2).

Shape legend: B batch (1 here), L length, D model width, K draft length.

Each round, with backbone hidden h_t of the last processed position t and the next token x_{t+1}:

1. draft: the MTP module runs autoregressively over positions t, t+1, ...: position t takes
   (h_t, emb(x_{t+1})) and predicts d_1 = x_{t+2}; position t+j takes its own previous output in
   place of the backbone hidden and emb(d_j), predicting d_{j+1} (the recursion the shared
   weights are trained for). The MTP attention keeps its own KV cache over positions.
2. verify: one backbone forward over [x_{t+1}, d_1..d_K]; drafts are accepted while they equal
   the backbone's greedy choice, and the first disagreement (or the bonus after K accepted)
   becomes the next token. Output is therefore the backbone's greedy output, token for token.
3. rollback, by recompute: if a draft was rejected, the backbone cache is restored to its
   `HybridCache.snapshot()` from before the verify pass (attention KV truncated, Mamba conv and
   SSM states put back) and the accepted tokens are run again. This costs a second short
   forward on rejection but needs no per-position Mamba states. The MTP cache is truncated to
   its last exact position and refilled with true hiddens.

`SpecStats` follows SPEED-Bench: acceptance length = tokens emitted per verify step (accepted
drafts + 1), and the acceptance rate of each draft position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.model import HybridLM
from .cache import HybridCache


@dataclass
class SpecStats:
    draft_len: int
    steps: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # per draft position
    drafted_at: list[int] = field(default_factory=list)

    def record(self, n_drafted: int, n_accepted: int) -> None:
        if not self.accepted_at:
            self.accepted_at = [0] * self.draft_len
            self.drafted_at = [0] * self.draft_len
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
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]


def _mtp(model: HybridLM, h_BLD: torch.Tensor, next_BL: torch.Tensor, cache: HybridCache):
    """Run the MTP module over len(next) new positions; returns (hidden, logits)."""
    L = next_BL.shape[1]
    pos = torch.arange(cache.seen_tokens, cache.seen_tokens + L, device=next_BL.device)
    out = model.mtp(h_BLD, model.embeddings(next_BL), states=cache.layers, positions_L=pos)
    cache.seen_tokens += L
    return out, model.lm_head(out)


@torch.no_grad()
def speculative_generate(
    model: HybridLM,
    input_ids_BL: torch.Tensor,
    max_new_tokens: int,
    *,
    draft_len: int = 3,
    eos_id: int | None = None,
) -> tuple[torch.Tensor, SpecStats]:
    """Greedy decoding with MTP drafts; returns (tokens [1, n], stats). Equals greedy `generate`."""
    cfg = model.config
    if model.mtp is None:
        raise ValueError("speculative decoding needs a model with an MTP module (mtp.pattern)")
    if "M" in cfg.mtp.pattern:
        raise ValueError("speculative drafting supports MTP layers of attention and MoE/MLP blocks")
    if input_ids_BL.dim() != 2 or input_ids_BL.shape[0] != 1 or input_ids_BL.shape[1] == 0:
        raise ValueError("speculative decoding takes one non-empty prompt of shape [1, seq]")
    if not 1 <= draft_len <= 16:
        raise ValueError(f"draft_len must be in [1, 16], got {draft_len}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    was_training = model.training
    model.eval()
    stats = SpecStats(draft_len)
    out_tokens: list[int] = []
    try:
        cache = HybridCache.for_pattern(cfg.pattern)
        mtp_cache = HybridCache.for_pattern(cfg.mtp.pattern)
        pre = model(input_ids_BL, cache=cache, return_hidden=True)
        if input_ids_BL.shape[1] > 1:  # MTP positions 0..n-2 see (h_t, x_{t+1})
            _mtp(model, pre.hidden[:, :-1], input_ids_BL[:, 1:], mtp_cache)
        h_last = pre.hidden[:, -1:]
        nxt = pre.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        while len(out_tokens) < max_new_tokens:
            out_tokens.append(int(nxt))
            if int(nxt) == eos_id or len(out_tokens) == max_new_tokens:
                break
            # 1) draft
            exact = mtp_cache.seen_tokens + 1  # the first draft position has exact inputs
            drafts, hh, tok = [], h_last, nxt
            for _ in range(min(draft_len, max_new_tokens - len(out_tokens))):
                hh, logits = _mtp(model, hh, tok, mtp_cache)
                tok = logits[:, -1].argmax(-1, keepdim=True)
                drafts.append(tok)
            # 2) verify all drafts in one forward
            seq = torch.cat([nxt, *drafts], dim=1)
            snap = cache.snapshot()
            ver = model(seq, cache=cache, return_hidden=True)
            greedy = ver.logits[0].argmax(-1)
            m = 0
            while m < len(drafts) and int(drafts[m]) == int(greedy[m]):
                m += 1
            stats.record(len(drafts), m)
            # 3) rollback rejected drafts by recompute
            if m < len(drafts):
                cache.restore(snap)
                ver = model(seq[:, : m + 1], cache=cache, return_hidden=True)
            hidden = ver.hidden[:, : m + 1]
            mtp_cache.truncate(exact)
            if m:
                _mtp(model, hidden[:, :m], seq[:, 1 : m + 1], mtp_cache)
            for j in range(m):
                if len(out_tokens) == max_new_tokens:
                    break
                out_tokens.append(int(seq[0, j + 1]))
                if out_tokens[-1] == eos_id:
                    break
            if out_tokens and (out_tokens[-1] == eos_id or len(out_tokens) >= max_new_tokens):
                break
            h_last = hidden[:, m : m + 1]
            nxt = greedy[m].view(1, 1)
    finally:
        model.train(was_training)
    return torch.tensor([out_tokens], dtype=torch.long, device=input_ids_BL.device), stats
