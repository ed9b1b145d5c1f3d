"""Byte-level BPE tokenizers (Hugging Face `tokenizers`): train from documents, save, load.

`BPETokenizer` has the interface of `hybridlm.data.tokenizer.ByteTokenizer`
(`encode(text, add_bos=True)`, `decode(ids)`, `bos_id`, `eos_id`, `vocab_size`) plus `save(dir)` /
`load(dir)`. A saved directory holds `tokenizer.json` and a `tokenizer_config.json` that
transformers' `AutoTokenizer` / `PreTrainedTokenizerFast` loads and encodes identically (the
`tokenizer.json` post-processor prepends `<|bos|>`, as `encode(add_bos=True)` does), with the
chat template of `hybridlm.data.chat` (also in `chat_template.jinja`).

The pipeline is Llama-3 / Qwen2's: split with the GPT-4 (cl100k) regex, map bytes to unicode
(GPT-2 byte-level), BPE without unknown tokens (all 256 bytes are in the initial alphabet), no
normaliser, so `decode(encode(text)) == text` for every string. Special tokens take ids 0..11,
reserved up front so a trained vocabulary and the chat template agree:

    0 <|bos|>    1 <|endoftext|> (EOS)    2 <|pad|>    3 <|im_start|>    4 <|im_end|>
    5 <think>    6 </think>    7 <tool_call>    8 </tool_call>
    9 <|fim_prefix|>    10 <|fim_middle|>    11 <|fim_suffix|>

BOS, EOS, PAD and the FIM tokens are *special* (dropped by `decode`); the chat tokens are added
tokens that `decode` keeps, so a decoded assistant turn still shows `<think>` and `<|im_end|>`
(the stop string of `hybridlm.data.chat`). Text that contains a special token's string is encoded
as that token, as transformers does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .sources import Document
from .tokenizer import ByteTokenizer, write_hf_tokenizer

BOS = "<|bos|>"
EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"

SPECIAL_TOKENS: tuple[str, ...] = (
    BOS,
    EOS,
    PAD,
    IM_START,
    IM_END,
    THINK_OPEN,
    THINK_CLOSE,
    TOOL_OPEN,
    TOOL_CLOSE,
    FIM_PREFIX,
    FIM_MIDDLE,
    FIM_SUFFIX,
)
# Added tokens that stay in decoded text (the chat template is parsed from text).
TEXT_TOKENS = frozenset({IM_START, IM_END, THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE})

# GPT-4 (cl100k) pre-tokenisation regex, as in Llama 3's and Qwen 2's tokenizer.json: letters
# with one leading non-letter, digits in groups of up to 3, punctuation runs, newlines, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The same with one digit per token (Llama 2 / DeepSeek-V3 split numbers into digits): every
# number is spelt out digit by digit, which small models need to learn column arithmetic.
SPLIT_PATTERN_DIGITS = SPLIT_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


def _tokenizers():
    try:
        import tokenizers
    except ImportError as err:  # pragma: no cover - tokenizers is a [data] dependency
        raise ImportError("BPE tokenizers need `tokenizers`: pip install 'hybridlm[data]'") from err
    return tokenizers


def _texts(
    documents: Iterable[Document | str], max_docs: int | None, max_chars: int | None
) -> Iterator[str]:
    chars = 0
    for k, doc in enumerate(documents):
        if max_docs is not None and k >= max_docs:
            return
        text = doc.text if isinstance(doc, Document) else doc
        if max_chars is not None and chars + len(text) > max_chars:
            if chars == 0:
                yield text[:max_chars]
            return
        chars += len(text)
        yield text


def train_bpe(
    documents: Iterable[Document | str],
    *,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    max_docs: int | None = None,
    max_chars: int | None = None,
    split_digits: bool = False,
    show_progress: bool = False,
) -> BPETokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens (special tokens and the 256 byte
    tokens included; fewer when the text has no more pairs seen `min_frequency` times) on the
    texts of `documents`, stopping after `max_docs` documents or `max_chars` characters.
    Training is deterministic: the same texts give the same `tokenizer.json`. `split_digits`
    pre-splits numbers into single digits (no multi-digit tokens) instead of groups of 3."""
    tk = _tokenizers()
    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size < floor:
        raise ValueError(
            f"vocab_size must be at least {floor} (256 bytes + {len(SPECIAL_TOKENS)} special "
            f"tokens), got {vocab_size}"
        )
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence(
        [
            tk.pre_tokenizers.Split(
                tk.Regex(SPLIT_PATTERN_DIGITS if split_digits else SPLIT_PATTERN),
                behavior="isolated",
                invert=False,
            ),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(_texts(documents, max_docs, max_chars), trainer=trainer)
    if tok.get_vocab_size() <= floor:
        raise ValueError(
            "BPE training learned no merges: the documents were empty or too few "
            f"(vocab {tok.get_vocab_size()}); pass more text or lower min_frequency"
        )
    tok.post_processor = tk.processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    # The trainer marks every reserved token special; the chat tokens must survive decode.
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        if entry["content"] in TEXT_TOKENS:
            entry["special"] = False
    return BPETokenizer(tk.Tokenizer.from_str(json.dumps(data)))


def _token_name(value: Any) -> str | None:
    """A tokenizer_config / special_tokens_map entry: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class BPETokenizer:
    """A `tokenizers.Tokenizer` with `ByteTokenizer`'s interface. `bos_token` / `eos_token` /
    `pad_token` name tokens of its vocabulary; for a tokenizer without a BOS token pass the EOS
    string as `bos_token` (GPT-2's convention)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_token: str = BOS,
        eos_token: str = EOS,
        pad_token: str | None = PAD,
    ) -> None:
        self._tok = tokenizer
        ids = {}
        for role, token in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token)):
            if token is None:
                ids[role] = None
                continue
            tid = tokenizer.token_to_id(token)
            if tid is None:
                if role == "pad":
                    ids[role] = None
                    pad_token = None
                    continue
                raise ValueError(
                    f"{role}_token {token!r} is not in the tokenizer's vocabulary; set "
                    f"{role}_token in tokenizer_config.json or pass {role}_token=..."
                )
            ids[role] = tid
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.bos_id: int = ids["bos"]
        self.eos_id: int = ids["eos"]
        self.pad_id: int | None = ids["pad"]
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._sha256: str | None = None

    # ------------------------------------------------------------------ ByteTokenizer interface
    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def encode_batch(self, texts: Sequence[str], *, add_bos: bool = True) -> list[list[int]]:
        """`encode` of many texts (multi-threaded inside `tokenizers` unless
        TOKENIZERS_PARALLELISM=false)."""
        out = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [[self.bos_id, *e.ids] if add_bos else e.ids for e in out]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ vocabulary
    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    @property
    def special_tokens(self) -> dict[str, int]:
        """Every added token (special or not) -> id."""
        return {t.content: i for i, t in sorted(self._tok.get_added_tokens_decoder().items())}

    @property
    def tokenizer(self) -> Any:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def sha256(self) -> str:
        """Content hash of `tokenizer.json` and the BOS/EOS/PAD choice (keys shard manifests)."""
        if self._sha256 is None:
            h = hashlib.sha256(self._tok.to_str().encode())
            h.update(json.dumps([self.bos_token, self.eos_token, self.pad_token]).encode())
            self._sha256 = h.hexdigest()
        return self._sha256

    def __getstate__(self) -> dict[str, Any]:  # worker processes receive the JSON
        return {
            "json": self._tok.to_str(),
            "tokens": (self.bos_token, self.eos_token, self.pad_token),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        bos, eos, pad = state["tokens"]
        self.__init__(
            _tokenizers().Tokenizer.from_str(state["json"]),
            bos_token=bos,
            eos_token=eos,
            pad_token=pad,
        )

    def __repr__(self) -> str:
        return (
            f"BPETokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, pad={self.pad_token!r})"
        )

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path, *, model_max_length: int | None = None) -> Path:
        """Write `tokenizer.json`, `tokenizer_config.json` (PreTrainedTokenizerFast, with the
        chat template) and `chat_template.jinja`."""
        added = self._tok.get_added_tokens_decoder()
        return write_hf_tokenizer(
            path,
            self._tok.to_str(pretty=True),
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            pad_token=self.pad_token,
            added_tokens=[
                {
                    "id": i,
                    "content": t.content,
                    "lstrip": t.lstrip,
                    "rstrip": t.rstrip,
                    "normalized": t.normalized,
                    "single_word": t.single_word,
                    "special": t.special,
                }
                for i, t in sorted(added.items())
            ],
            model_max_length=model_max_length,
        )

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """Load a directory with `tokenizer.json` (ours or any Hugging Face one). BOS / EOS / PAD
        come from `tokenizer_config.json` or `special_tokens_map.json` when present, else this
        module's names; without a BOS token the EOS token doubles as BOS."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(
                f"no tokenizer.json at {path}: pass a Hugging Face tokenizer directory, or train "
                "one with hybridlm.data.bpe.train_bpe(...).save(dir)"
            )
        tk = _tokenizers()
        try:
            tok = tk.Tokenizer.from_file(str(file))
        except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
            raise ValueError(f"cannot read {file}: {err}") from None
        names: dict[str, str | None] = {}
        for meta in ("special_tokens_map.json", "tokenizer_config.json"):  # config wins
            meta_file = file.parent / meta
            if meta_file.is_file():
                try:
                    data = json.loads(meta_file.read_text())
                except json.JSONDecodeError as err:
                    raise ValueError(f"cannot parse {meta_file}: {err}") from None
                for key in ("bos_token", "eos_token", "pad_token"):
                    if key in data:
                        names[key] = _token_name(data[key])
        eos = names.get("eos_token") or EOS
        bos = names.get("bos_token") or (BOS if tok.token_to_id(BOS) is not None else eos)
        pad = names.get("pad_token") if "pad_token" in names else PAD
        return cls(tok, bos_token=bos, eos_token=eos, pad_token=pad)


def tokenizer_sha256(tokenizer: Any) -> str:
    """A content hash of any tokenizer with the ByteTokenizer interface: `.sha256` when it has
    one, else its class, ids and the encoding of a probe text (catches a changed vocabulary)."""
    own = getattr(tokenizer, "sha256", None)
    if isinstance(own, str):
        return own
    probe = "Hybrid models: Mamba-2 + attention. ½ → ü 你好 0123456789\n\t"
    desc = {
        "class": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}",
        "vocab_size": int(tokenizer.vocab_size),
        "bos_id": int(tokenizer.bos_id),
        "eos_id": int(tokenizer.eos_id),
        "probe": [int(i) for i in tokenizer.encode(probe, add_bos=True)],
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def load_tokenizer(spec: str | Path) -> Any:
    """`"byte"` or a saved byte tokenizer -> `ByteTokenizer()`; another directory or
    `tokenizer.json` path -> `BPETokenizer`."""
    if not str(spec):
        raise ValueError(
            "no tokenizer named: give 'byte' or a tokenizer directory (a run's empty "
            "data.tokenizer is its starting model's, resolved by train.trainer.run_tokenizer)"
        )
    if str(spec) == "byte" or ByteTokenizer.is_saved(spec):
        return ByteTokenizer()
    return BPETokenizer.load(spec)
