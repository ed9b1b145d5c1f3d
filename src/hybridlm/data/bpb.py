"""Bits per byte: the bytes of text each token id stands for, and the held-out sums behind
held-out CE and bits per byte (nats / (ln 2 * bytes)).

Byte tokenizer: ids 0-255 are one byte each, BOS/EOS none. Byte-level BPE: the bytes of each
token's byte-level string (exact); special tokens count 0 and added text tokens their UTF-8
length.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops.cross_entropy import IGNORE_INDEX
from .tokenizer import byte_level_chars


def token_byte_lengths(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """Bytes of text each token id stands for (0 for special tokens), for bits per byte."""
    out = torch.zeros(vocab_size, dtype=torch.float64)
    if not hasattr(tokenizer, "id_to_token"):  # ByteTokenizer: ids 0-255 are the bytes
        out[: min(256, vocab_size)] = 1
        return out
    inverse = set(byte_level_chars())
    added = {i: t for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items()}
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        if i in added:
            out[i] = 0 if added[i].special else len(added[i].content.encode("utf-8"))
            continue
        tok = tokenizer.id_to_token(i) or ""
        if all(c in inverse for c in tok):
            out[i] = len(tok)  # one byte per byte-level character
        else:  # not a byte-level token: decode it
            out[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return out


def eval_sums(
    batch_nats: Any, batches: Any, token_bytes: torch.Tensor, *, max_batches: int = 0
) -> tuple[float, int, float]:
    """(nats, label tokens, bytes they stand for) over held-out batches, the sums behind eval
    CE and bits per byte. `batch_nats(batch)`: the summed next-token CE of the batch's labels
    (e.g. `ops.cross_entropy.lm_cross_entropy` with denom 1); `max_batches` 0 reads them all."""
    nats, n_tok, n_bytes = 0.0, 0, 0.0
    for k, batch in enumerate(batches):
        if max_batches and k >= max_batches:
            break
        nats += float(batch_nats(batch))
        tgt = batch["labels"][:, 1:]
        tgt = tgt[tgt != IGNORE_INDEX]
        n_tok += tgt.numel()
        n_bytes += float(token_bytes[tgt.cpu()].sum())
    return nats, n_tok, n_bytes
