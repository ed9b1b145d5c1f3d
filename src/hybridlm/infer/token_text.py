"""What each token id stands for, as the OpenAI API shows it: the bytes it adds to decoded text,
its `token` string and `bytes` in log-probs, its vocabulary string, and character offsets.

For the two tokenizers of `hybridlm.data` (and any `tokenizers` byte-level BPE):

- `piece(id)`: the UTF-8 bytes the id contributes to `tokenizer.decode(ids)`, so that decoding
  is the concatenation of the pieces (b"" for special tokens, which `decode` drops). A byte-level
  BPE token maps back through GPT-2's byte <-> character table; an added token is its content.
- `token(id)`: the log-probs' `token` string: the piece as text when it is valid UTF-8 on its own,
  else `"bytes:\\xe2\\x80"` (OpenAI's spelling for part of a character: the bytes as `\\xNN`
  escapes); a special token is its name (`<|endoftext|>`), as vLLM shows it.
  `token_bytes(id)`: the log-probs' `bytes`, the piece's bytes (the name's for a special token).
- `vocab_token(id)`: the vocabulary's own string (transformers' `convert_ids_to_tokens`: `Ġthe`),
  for `/tokenize`'s `token_strs`.
- `offsets(ids, start)`: each token's character offset in `decode(ids)` (plus `start`): the
  characters completed before it, counted with an incremental UTF-8 decoder, so a character split
  over tokens belongs to the token that completes it (OpenAI's `text_offset`).

Other tokenizers (duck-typed `encode` / `decode`) fall back to `decode([id])`, which loses the
bytes of partial characters; `<0xNN>` byte-fallback tokens (SentencePiece) are read as their
byte. Results are cached per id.
"""

from __future__ import annotations

import bisect
import codecs
import re
import threading
from typing import Any

from ..data.tokenizer import ByteTokenizer, byte_level_chars

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenText:
    """Per-id strings and bytes of one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pieces: dict[int, bytes] = {}
        self._names: dict[int, str] = {}  # special tokens: id -> name
        self._byte_tok = isinstance(tokenizer, ByteTokenizer)
        self._hf = getattr(tokenizer, "tokenizer", None) if not self._byte_tok else None
        self._added: dict[int, Any] = {}
        self._byte_level = False
        if self._byte_tok:
            self._names = {
                tokenizer.bos_id: tokenizer.bos_token,
                tokenizer.eos_id: tokenizer.eos_token,
            }
        elif self._hf is not None and hasattr(self._hf, "get_added_tokens_decoder"):
            self._added = dict(self._hf.get_added_tokens_decoder())
            self._names = {i: t.content for i, t in self._added.items() if t.special}
            self._byte_level = type(getattr(self._hf, "decoder", None)).__name__ == "ByteLevel"
        self._from_char = {c: b for b, c in enumerate(byte_level_chars())}

    # ------------------------------------------------------------------ per id
    def piece(self, tid: int) -> bytes:
        """The bytes `tid` adds to the decoded text."""
        got = self._pieces.get(tid)
        if got is None:
            got = self._pieces[tid] = self._piece(tid)
        return got

    def _piece(self, tid: int) -> bytes:
        if self._byte_tok:
            return bytes([tid]) if 0 <= tid < 256 else b""
        if tid in self._names:
            return b""  # special: `decode` skips it
        if tid in self._added:
            return self._added[tid].content.encode("utf-8")
        vocab = self.vocab_token(tid)
        if self._byte_level and vocab and all(c in self._from_char for c in vocab):
            return bytes(self._from_char[c] for c in vocab)
        m = _BYTE_FALLBACK.fullmatch(vocab or "")
        if m:
            return bytes([int(m.group(1), 16)])
        try:
            return self.tokenizer.decode([tid]).encode("utf-8")
        except Exception:  # an id the tokenizer does not know (model vocab > tokenizer's)
            return b""

    def token(self, tid: int) -> str:
        """The log-probs' `token` string of `tid`."""
        name = self._names.get(tid)
        if name is not None:
            return name
        raw = self.piece(tid)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def token_bytes(self, tid: int) -> list[int]:
        """The log-probs' `bytes` of `tid`."""
        name = self._names.get(tid)
        return list(name.encode("utf-8") if name is not None else self.piece(tid))

    def vocab_token(self, tid: int) -> str:
        """The vocabulary's string for `tid` ("" for an id it does not have)."""
        if self._byte_tok:
            if 0 <= tid < 256:
                return byte_level_chars()[tid]
            return self._names.get(tid, "")
        id_to_token = getattr(self.tokenizer, "id_to_token", None)
        if id_to_token is not None:
            return id_to_token(tid) or ""
        return self.tokenizer.decode([tid])

    # ------------------------------------------------------------------ sequences
    def offsets(self, ids: list[int], start: int = 0) -> list[int]:
        """Character offset of each token in `decode(ids)`, plus `start`."""
        offs = Offsets(self, start).extend(ids)
        return [offs.offset(i) for i in range(len(ids))]


# The UTF-8 decoder reports each invalid run (a maximal subpart, which becomes one U+FFFD) to
# this handler, so that every decoded character's byte span is known.
_ERRORS = threading.local()


def _record(err: UnicodeDecodeError) -> tuple[str, int]:
    _ERRORS.spans.append((err.start, err.end))
    return "\ufffd", err.end


codecs.register_error("hybridlm.record_spans", _record)


class Offsets:
    """Character offsets of a growing token sequence in its decoded text (plus `start`).

    A token's offset is the number of characters that end before its first byte: a character
    split over tokens belongs to the token that completes it, and an invalid byte run (one
    U+FFFD, as `bytes.decode(errors="replace")` writes it) to the token that holds it.
    Incremental (an incremental UTF-8 decoder that reports its replacements), so a stream
    costs O(its length); the offsets of tokens already seen never change as more arrive."""

    def __init__(self, text: TokenText, start: int = 0) -> None:
        self._text = text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="hybridlm.record_spans")
        self.start = start
        self._token_bytes: list[int] = []  # byte offset where each token starts
        self._char_starts: list[int] = []  # byte offset where each decoded character starts
        self._char_ends: list[int] = []  # ... and where it ends
        self._fed = 0

    def extend(self, ids: list[int]) -> Offsets:
        for tid in ids:
            piece = self._text.piece(tid)
            self._token_bytes.append(self._fed)
            base = self._fed - len(self._decoder.getstate()[0])  # where the decoder's input starts
            _ERRORS.spans = []
            chars = self._decoder.decode(piece)
            spans, _ERRORS.spans = _ERRORS.spans, []
            self._fed += len(piece)
            pos = base
            for ch in chars:
                if spans and spans[0][0] == pos - base:
                    pos = base + spans.pop(0)[1]
                else:
                    pos += len(ch.encode("utf-8"))
                self._char_starts.append(self._char_ends[-1] if self._char_ends else 0)
                self._char_ends.append(pos)
        return self

    def __len__(self) -> int:
        """Tokens seen."""
        return len(self._token_bytes)

    def offset(self, i: int) -> int:
        """Token i's character offset (plus `start`)."""
        return self.start + bisect.bisect_right(self._char_ends, self._token_bytes[i])

    def touched(self, n: int) -> int | None:
        """How many characters (after `start`) the bytes of tokens[:n] reach into, or None while
        some of those bytes wait for the rest of their character."""
        end = self._token_bytes[n] if n < len(self._token_bytes) else self._fed
        if end > self._fed - len(self._decoder.getstate()[0]):
            return None
        return bisect.bisect_left(self._char_starts, end)
