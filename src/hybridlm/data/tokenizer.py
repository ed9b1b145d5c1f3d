"""Byte-level tokenizer: the embedded default that needs no vocabulary file.

Ids 0-255 are the UTF-8 bytes; `bos_id` / `eos_id` follow. Any model with vocab_size >= 258 can
use it. Trained BPE tokenizers come from the `tokenizers` library for real data.
"""

from __future__ import annotations


class ByteTokenizer:
    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
