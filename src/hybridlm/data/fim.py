"""Midtraining text transforms: fill-in-the-middle (FIM) and chat rendered as plain text.

FIM (Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the Middle"; the
StarCoder2 / Olmo 3 Stack-Edu FIM recipe, Olmo 3 §4.3: 50% of code documents):

    a document is cut at two uniformly drawn *character* positions (§3 of the paper: character-
    level splits, so the model learns to complete partial tokens) into prefix | middle | suffix;
    with probability `rate` it is rearranged, else kept as is.

    PSM  <|fim_prefix|>prefix<|fim_suffix|>suffix<|fim_middle|>middle
    SPM  <|fim_prefix|><|fim_suffix|>suffix<|fim_middle|>prefix middle

SPM is the variant of the paper's Appendix D (also StarCoder's): the prefix runs straight into
the middle, so the middle is always a continuation of contiguous text. `spm_rate` of the FIM
documents use SPM (the paper trains on a 50/50 mix of the two, "joint" training).

How the tokenizers see the sentinels:
  * `hybridlm.data.bpe.BPETokenizer` reserves them as special tokens (ids 9, 10, 11 for
    `<|fim_prefix|>`, `<|fim_middle|>`, `<|fim_suffix|>`); text that contains a sentinel's
    string is encoded as that one token, and `decode` drops them (they are special).
    `encode_fim` encodes the three parts separately and joins them with the sentinel ids, so no
    BPE merge can span a split point (Bavarian et al. §3: split before tokenising).
  * `hybridlm.data.tokenizer.ByteTokenizer` has no spare ids: a sentinel is its 14 (15 for
    `<|fim_middle|>`, `<|fim_suffix|>`) UTF-8 bytes, i.e. ordinary text the model learns to
    read. The transformed *text* is the same for both tokenizers.

A document that already contains a sentinel string is left untransformed (its FIM parse would
be ambiguous); `FIMResult.mode` says what happened. Randomness is a pure function of
(`seed`, document key), so a transform is reproducible and independent of document order.

Chat to plain text (Olmo 3 §4.3, "Tulu 3 SFT" in the Dolmino mix): the messages of a
conversation joined with a blank line, with no `<|im_start|>` / `<|im_end|>` or other template
tokens, so instruction data can be mixed into pretraining-style midtraining text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .bpe import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX
from .chat import validate

SENTINELS = (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)
FIMMode = Literal["psm", "spm", "none", "has_sentinel"]


@dataclass(kw_only=True)
class FIMConfig:
    """`rate`: share of documents transformed (Olmo 3 Stack-Edu FIM: 0.5); `spm_rate`: share of
    the transformed ones in SPM order (the rest PSM); `seed` keys the per-document draws."""

    rate: float = 0.5
    spm_rate: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rate", "spm_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"fim.{name} must be in [0, 1], got {value}")


@dataclass(frozen=True)
class FIMResult:
    """The training text, how it was made, and the split (character offsets into the original;
    (0, 0) when untransformed)."""

    text: str
    mode: FIMMode
    split: tuple[int, int] = (0, 0)


def _rng(seed: int, key: str | int) -> np.random.Generator:
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "little"))


def psm(prefix: str, middle: str, suffix: str) -> str:
    """Prefix-suffix-middle order (Bavarian et al. §3)."""
    return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}{middle}"


def spm(prefix: str, middle: str, suffix: str) -> str:
    """Suffix-prefix-middle order, the Appendix D variant: prefix and middle stay contiguous."""
    return f"{FIM_PREFIX}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}{prefix}{middle}"


def fim_transform(text: str, key: str | int, cfg: FIMConfig | None = None) -> FIMResult:
    """FIM-transform one document (see the module docstring); `key` (e.g. the document id)
    seeds its draws together with `cfg.seed`."""
    cfg = cfg or FIMConfig()
    if any(s in text for s in SENTINELS):
        return FIMResult(text=text, mode="has_sentinel")
    rng = _rng(cfg.seed, key)
    u_fim, u_spm = rng.random(2)
    if u_fim >= cfg.rate:
        return FIMResult(text=text, mode="none")
    # two character positions, uniform over [0, len] and sorted (Bavarian et al. §3)
    lo, hi = sorted(int(v) for v in rng.integers(0, len(text) + 1, size=2))
    prefix, middle, suffix = text[:lo], text[lo:hi], text[hi:]
    if u_spm < cfg.spm_rate:
        return FIMResult(text=spm(prefix, middle, suffix), mode="spm", split=(lo, hi))
    return FIMResult(text=psm(prefix, middle, suffix), mode="psm", split=(lo, hi))


def parse_fim(text: str) -> tuple[str, str, str] | None:
    """(prefix, middle, suffix) of a PSM text, or (prefix + middle, "", suffix) of an SPM text
    (SPM does not mark where the prefix ends); None for text that is not FIM-formatted.
    `prefix + middle + suffix` is the original document either way."""
    if text.startswith(FIM_PREFIX + FIM_SUFFIX):  # SPM
        body = text[len(FIM_PREFIX + FIM_SUFFIX) :]
        suffix, sep, rest = body.partition(FIM_MIDDLE)
        return (rest, "", suffix) if sep else None
    if text.startswith(FIM_PREFIX):  # PSM
        body = text[len(FIM_PREFIX) :]
        prefix, sep1, rest = body.partition(FIM_SUFFIX)
        suffix, sep2, middle = rest.partition(FIM_MIDDLE)
        return (prefix, middle, suffix) if sep1 and sep2 else None
    return None


def undo_fim(text: str) -> str:
    """The original document of a FIM text (identity for untransformed text)."""
    parts = parse_fim(text)
    return text if parts is None else parts[0] + parts[1] + parts[2]


def encode_fim(result: FIMResult, original: str, tokenizer: Any) -> list[int]:
    """Token ids of a FIM result without BOS: each part encoded on its own and joined with the
    sentinels' ids when the tokenizer has them (`token_to_id`, BPE), else with their bytes
    (byte tokenizer). Untransformed results are encoded whole."""
    if result.mode in ("none", "has_sentinel"):
        return tokenizer.encode(result.text, add_bos=False)
    lo, hi = result.split
    prefix, middle, suffix = original[:lo], original[lo:hi], original[hi:]
    token_to_id = getattr(tokenizer, "token_to_id", None)

    def sentinel(s: str) -> list[int]:
        tid = token_to_id(s) if token_to_id is not None else None
        return [tid] if tid is not None else tokenizer.encode(s, add_bos=False)

    def enc(s: str) -> list[int]:
        return tokenizer.encode(s, add_bos=False) if s else []

    p, s, m = sentinel(FIM_PREFIX), sentinel(FIM_SUFFIX), sentinel(FIM_MIDDLE)
    if result.mode == "psm":
        return p + enc(prefix) + s + enc(suffix) + m + enc(middle)
    return p + s + enc(suffix) + m + enc(prefix) + enc(middle)


# ---------------------------------------------------------------------------- chat to text
def _plain(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "\n".join(p["text"] for p in content if isinstance(p, Mapping))
    return ""


def chat_to_text(
    messages: Sequence[Mapping[str, Any]],
    *,
    separator: str = "\n\n",
    role_labels: bool = False,
    include_system: bool = True,
) -> str:
    """Render OpenAI-format messages as plain text for midtraining (Olmo 3 §4.3: turns joined
    with a double newline, no chat-template tokens). An assistant turn is its reasoning (if
    any), its content and its tool calls as JSON lines, each separated by a newline; with
    `role_labels` every turn starts with "User: " / "Assistant: " / "System: " / "Tool: "."""
    turns = validate(messages)  # same validation (and errors) as the chat template
    out = []
    for msg, turn in zip(messages, turns, strict=True):
        if turn.role == "system" and not include_system:
            continue
        if turn.role == "assistant":
            parts = []
            reasoning = msg.get("reasoning_content", msg.get("reasoning"))
            if reasoning:
                parts.append(reasoning)
            if msg.get("content") is not None:
                parts.append(_plain(msg["content"]))
            for call in msg.get("tool_calls") or []:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    args = json.loads(args) if args.strip() else {}
                parts.append(json.dumps({"name": fn["name"], "arguments": args}))
            body = "\n".join(p for p in parts if p)
        else:
            body = _plain(msg["content"])
        body = body.strip()
        if not body:
            continue
        out.append(f"{turn.role.capitalize()}: {body}" if role_labels else body)
    return separator.join(out)
