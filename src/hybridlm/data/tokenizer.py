"""Byte-level tokenizer: the embedded default that needs no vocabulary file.

Ids 0-255 are the UTF-8 bytes; `bos_id` / `eos_id` follow. Any model with vocab_size >= 258 can
use it. Trained BPE tokenizers come from the `tokenizers` library for real data.

`save(dir)` writes it as a transformers tokenizer (`AutoTokenizer.from_pretrained(dir)` encodes and
decodes identically): a byte-level BPE without merges whose 256 tokens are the bytes, plus
`<|bos|>` (256) and `<|endoftext|>` (257). The chat markers stay text (several byte tokens each),
as `encode` spells them. `write_hf_tokenizer` writes the files of both tokenizers, with the chat
template of `hybridlm.data.chat`.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from .chat import CHAT_TEMPLATE

_UNLIMITED = 1_000_000_000_000_000_019_884_624_838_656  # transformers' "no maximum length"


def write_hf_tokenizer(
    path: str | Path,
    tokenizer_json: str,
    *,
    bos_token: str | None,
    eos_token: str,
    pad_token: str | None,
    added_tokens: list[dict[str, Any]],
    model_max_length: int | None = None,
) -> Path:
    """Write a directory `transformers.AutoTokenizer` loads alone: `tokenizer.json`,
    `tokenizer_config.json` (`PreTrainedTokenizerFast`, special-token names, the chat template)
    and `chat_template.jinja` (where transformers 5 looks first). `added_tokens`: the
    `added_tokens` entries of `tokenizer_json` (id, content, flags)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json)
    flags = ("lstrip", "rstrip", "normalized", "single_word", "special")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": eos_token,
        "pad_token": pad_token,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length or _UNLIMITED,
        "added_tokens_decoder": {
            str(t["id"]): {"content": t["content"], **{k: t[k] for k in flags}}
            for t in sorted(added_tokens, key=lambda t: t["id"])
        },
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@cache
def byte_level_chars() -> tuple[str, ...]:
    """GPT-2's printable stand-in character of every byte (the `ByteLevel` pre-tokenizer's)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return tuple(chars[b] for b in range(256))


class ByteTokenizer:
    bos_id = 256
    eos_id = 257
    vocab_size = 258
    # names of the two non-byte ids in a saved (transformers) tokenizer; the BPE's names. There is
    # no padding token: transformers is told to pad with EOS.
    bos_token = "<|bos|>"
    eos_token = "<|endoftext|>"
    pad_token = eos_token

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        """The id of a named token (BOS / EOS); None for anything else (text is bytes)."""
        return {self.bos_token: self.bos_id, self.eos_token: self.eos_id}.get(token)

    # ------------------------------------------------------------------ files
    @classmethod
    def tokenizer_json(cls) -> dict[str, Any]:
        """The `tokenizers` JSON of this tokenizer (built here: no `tokenizers` import)."""

        def added(tid: int, content: str) -> dict[str, Any]:
            flags = dict(single_word=False, lstrip=False, rstrip=False, normalized=False)
            return {"id": tid, "content": content, **flags, "special": True}

        def seq(name: str) -> dict[str, Any]:
            return {"Sequence": {"id": name, "type_id": 0}}

        bos = {"SpecialToken": {"id": cls.bos_token, "type_id": 0}}
        byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": False}
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [added(cls.bos_id, cls.bos_token), added(cls.eos_id, cls.eos_token)],
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", **byte_level},
            "post_processor": {  # encode(add_bos=True) == tokenizer(text)
                "type": "TemplateProcessing",
                "single": [bos, seq("A")],
                "pair": [bos, seq("A"), bos, seq("B")],
                "special_tokens": {
                    cls.bos_token: {
                        "id": cls.bos_token,
                        "ids": [cls.bos_id],
                        "tokens": [cls.bos_token],
                    }
                },
            },
            "decoder": {"type": "ByteLevel", **byte_level},
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {c: b for b, c in enumerate(byte_level_chars())},
                "merges": [],
            },
        }

    def save(self, path: str | Path, *, model_max_length: int | None = None) -> Path:
        """Write `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`."""
        data = self.tokenizer_json()
        return write_hf_tokenizer(
            path,
            json.dumps(data, indent=2, ensure_ascii=False),
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            pad_token=self.pad_token,
            added_tokens=data["added_tokens"],
            model_max_length=model_max_length,
        )

    @classmethod
    def is_saved(cls, path: str | Path) -> bool:
        """Whether `path` (a directory or its `tokenizer.json`) holds this tokenizer."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            if file.stat().st_size > 2**16:  # ours is ~10 KB; a trained BPE is far larger
                return False
            return json.loads(file.read_text()) == cls.tokenizer_json()
        except (OSError, ValueError):
            return False
