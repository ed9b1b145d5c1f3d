"""Log-likelihood of continuations: batched, padded, length-sorted; rolling windows for documents.

Shape legend: B batch rows, L padded sequence length, V vocabulary.

A request is `(context_ids, continuation_ids)`; its answer is the sum over the continuation of
log p(token | everything before it) and whether greedy decoding would have produced the whole
continuation (lm-evaluation-harness `loglikelihood` semantics). The model sees
`(context + continuation)[:-1]` and is scored on the continuation tokens; the last continuation
token is never fed.

Requests are grouped by context, the groups sorted by length (longest first, so the first
batch shows the memory peak) and packed into batches under a token budget (a group only splits
when it alone exceeds the budget); rows are right-padded and the model gets the
`attention_mask`. Right padding keeps the real tokens exactly where an unpadded forward puts
them (positions, causal attention, the Mamba scan and conv are all causal), which the tests
check against one-at-a-time forwards in fp64.

Grouping puts the answers of one multiple-choice question in the same batch. The hybrid cache is
not forked at the end of a shared context: Mamba state can only be snapshotted at block
boundaries (`infer.engine` prefix reuse), so the shared prefix is recomputed per answer, batched.

`rolling_windows` splits a long document into windows of at most `max_len` model inputs that
predict every token exactly once, each with as much preceding context as fits
(`stride` new tokens per window); their scores sum to the document's log-likelihood.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..model.model import HybridLM

LN2 = math.log(2.0)


@dataclass(frozen=True, kw_only=True)
class LoglikResult:
    logprob: float  # sum of log p over the continuation tokens (nats)
    is_greedy: bool  # every continuation token is the argmax of its distribution
    num_tokens: int  # continuation tokens scored


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of `(context, continuation)` as one text would be tokenised: encode the
    concatenation and split it after the context's tokens, so a BPE merge across the boundary
    is not broken. Trailing whitespace of the context moves to the continuation (lm-eval's
    convention: " Paris" is one token in most BPE vocabularies). The context starts with BOS."""
    n_space = len(context) - len(context.rstrip())
    if n_space:
        continuation = context[-n_space:] + continuation
        context = context[:-n_space]
    whole = tokenizer.encode(context + continuation, add_bos=True)
    ctx = tokenizer.encode(context, add_bos=True)
    if whole[: len(ctx)] != ctx:  # the context's last token merged into the continuation
        return ctx, tokenizer.encode(continuation, add_bos=False)
    return ctx, whole[len(ctx) :]


def _model_dtype_device(model: HybridLM) -> tuple[torch.dtype, torch.device]:
    w = model.embeddings.weight
    return w.dtype, w.device


def _batches(
    lengths: Sequence[int], groups: Sequence[list[int]], max_tokens: int, max_rows: int
) -> list[list[int]]:
    """Pack groups of request indices into batches whose padded size (rows x longest) stays
    <= max_tokens and rows <= max_rows; a group is split only when it alone does not fit."""

    def fits(rows: int, longest: int) -> bool:
        return rows <= max_rows and rows * longest <= max_tokens

    out: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for g in groups:
        g_longest = max(lengths[i] for i in g)
        if batch and not fits(len(batch) + len(g), max(longest, g_longest)):
            out.append(batch)
            batch, longest = [], 0
        for i in g:  # row by row: splits only a group that is too big on its own
            if batch and not fits(len(batch) + 1, max(longest, lengths[i])):
                out.append(batch)
                batch, longest = [], 0
            batch.append(i)
            longest = max(longest, lengths[i])
    if batch:
        out.append(batch)
    return out


@torch.no_grad()
def loglikelihood(
    model: HybridLM,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    max_len: int | None = None,
    max_batch_tokens: int = 16_384,
    max_batch_rows: int = 64,
    progress: bool = False,
) -> list[LoglikResult]:
    """Score `(context_ids, continuation_ids)` requests; results in request order.

    Inputs longer than `max_len` (default: the model's `max_seq_len`) lose context tokens from
    the left; a continuation that alone exceeds it is an error (score it with
    `rolling_windows`). Log-softmax runs in fp32 (fp64 for an fp64 model)."""
    max_len = max_len or model.config.max_seq_len
    if max_batch_tokens < max_len:
        max_batch_tokens = max_len  # one row of the longest allowed input always fits
    seqs: list[list[int]] = []
    n_cont: list[int] = []
    for ctx, cont in requests:
        if len(cont) == 0:
            raise ValueError("a continuation must have at least one token")
        if len(ctx) == 0:
            raise ValueError("a context must have at least one token (e.g. BOS)")
        if len(cont) > max_len:
            raise ValueError(
                f"a continuation of {len(cont)} tokens exceeds max_len {max_len}; "
                "score long texts with rolling_windows"
            )
        full = [*ctx, *cont][-(max_len + 1) :]  # left-truncate the context
        seqs.append(full)
        n_cont.append(len(cont))
    lengths = [len(s) - 1 for s in seqs]
    # requests with the same context (one question's answers) stay together, groups longest
    # first, so a question's shared prefix is computed within one batch
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(requests):
        groups.setdefault(tuple(ctx), []).append(i)
    ordered = [
        sorted(g, key=lambda i: (-lengths[i], i))
        for g in sorted(groups.values(), key=lambda g: (-max(lengths[i] for i in g), g[0]))
    ]
    dtype, device = _model_dtype_device(model)
    sm_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    results: list[LoglikResult | None] = [None] * len(seqs)
    batches = _batches(lengths, ordered, max_batch_tokens, max_batch_rows)
    it: Any = batches
    if progress:
        from rich.progress import track

        it = track(batches, description=f"log-likelihood ({len(seqs)} requests)")
    model.eval()
    for batch in it:
        L = max(lengths[i] for i in batch)
        ids_BL = torch.zeros(len(batch), L, dtype=torch.long)
        mask_BL = torch.zeros(len(batch), L, dtype=torch.bool)
        for r, i in enumerate(batch):
            ids_BL[r, : lengths[i]] = torch.tensor(seqs[i][:-1])
            mask_BL[r, : lengths[i]] = True
        ids_BL, mask_BL = ids_BL.to(device), mask_BL.to(device)
        full_mask = bool(mask_BL.all())
        logits_BLV = model(ids_BL, attention_mask=None if full_mask else mask_BL).logits
        for r, i in enumerate(batch):
            n, k = lengths[i], n_cont[i]
            logp_KV = torch.log_softmax(logits_BLV[r, n - k : n].to(sm_dtype), dim=-1)
            target_K = torch.tensor(seqs[i][-k:], device=device)
            lp = logp_KV.gather(1, target_K[:, None]).sum()
            greedy = bool((logp_KV.argmax(-1) == target_K).all())
            results[i] = LoglikResult(logprob=float(lp), is_greedy=greedy, num_tokens=k)
    return results  # type: ignore[return-value]


def rolling_windows(
    token_ids: Sequence[int], *, prefix_id: int, max_len: int, stride: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """`(context, continuation)` requests whose continuations tile `token_ids` exactly once.

    The first window is conditioned on `prefix_id` (BOS) alone; every later one predicts the
    next `stride` tokens (default `max_len`: disjoint windows, the cheapest) given the
    `max_len - stride` tokens before them (at least one), so a smaller stride buys more context
    per prediction at proportionally more compute."""
    stride = max_len if stride is None else stride
    if not 1 <= stride <= max_len:
        raise ValueError(f"stride must be in [1, max_len={max_len}], got {stride}")
    seq = [int(prefix_id), *(int(t) for t in token_ids)]  # predict seq[1:]
    out: list[tuple[list[int], list[int]]] = []
    start = 1
    while start < len(seq):
        end = min(len(seq), start + (max_len if start == 1 else stride))
        out.append((seq[max(0, end - max_len - 1) : start], seq[start:end]))
        start = end
    return out


def loglikelihood_rolling(
    model: HybridLM,
    documents: Sequence[Sequence[int]],
    *,
    prefix_id: int,
    max_len: int | None = None,
    stride: int | None = None,
    **kw: Any,
) -> list[float]:
    """Log-likelihood (nats) of each whole document, conditioned on `prefix_id`, through
    `rolling_windows`; all windows of all documents are batched together."""
    max_len = max_len or model.config.max_seq_len
    reqs: list[tuple[list[int], list[int]]] = []
    owner: list[int] = []
    for d, doc in enumerate(documents):
        if len(doc) == 0:
            raise ValueError("a document must have at least one token")
        wins = rolling_windows(doc, prefix_id=prefix_id, max_len=max_len, stride=stride)
        reqs.extend(wins)
        owner.extend([d] * len(wins))
    totals = [0.0] * len(documents)
    for d, res in zip(owner, loglikelihood(model, reqs, max_len=max_len, **kw), strict=True):
        totals[d] += res.logprob
    return totals


def bits_per_byte(nll_nats: float, num_bytes: int) -> float:
    """NLL in nats over `num_bytes` UTF-8 bytes -> bits per byte (OLMES "Base Easy" BPB)."""
    if num_bytes <= 0:
        raise ValueError("bits per byte needs at least one byte of text")
    return nll_nats / (LN2 * num_bytes)
