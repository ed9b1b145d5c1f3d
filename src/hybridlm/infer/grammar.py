"""Grammar-constrained decoding: structured outputs (JSON mode, JSON Schema, Lark grammars).

Shape legend: V the model's vocabulary (logit columns), N the tokenizer's vocabulary (N <= V
normally; extra model ids are never allowed), W = ceil(N / 32) mask words.

The grammar engine is llguidance (guidance-ai/llguidance, the one behind vLLM's and llama.cpp's
structured outputs): an Earley parser over a lexer compiled against the tokenizer's trie, which
gives the set of allowed next tokens as an N-bit mask in tens of microseconds. A request compiles
its grammar once (`json_constraint`, `grammar_constraint`, `tools.tool_call_constraint`); the
returned factory makes one `GrammarConstraint` per generated sequence by copying the compiled
matcher (well under a microsecond). The engine calls, per step,

    mask_V = constraint.allowed()   # bool [V], True = allowed
    ... sample token t from the logits with the other tokens masked out ...
    constraint.accept(t)            # advance; ValueError if t was not allowed
    if constraint.finished(): stop  # nothing but an end token can follow

End of sequence: the end tokens (`end_token_ids`: the tokenizer's EOS, plus the chat stop
`<|im_end|>` where it is one token, as in the project's BPE and most HF chat tokenizers) are
allowed exactly when the grammar can end; `finished()` is true once the grammar cannot be
extended (a JSON value ends at its closing brace: llguidance allows no trailing whitespace) or an
end token was accepted. For the byte tokenizer `<|im_end|>` is text, so a finished constraint is
the end of the turn; the engine stops there without the model writing the stop string.

JSON Schema support (llguidance docs/json_schema.md, Draft 2020-12): `type` (one or a list),
`enum`, `const`, `anyOf`, `oneOf` (when provably disjoint), `allOf` (most intersections), local
`$ref` / `$defs`; objects: `properties` (generated in schema order), `required`,
`additionalProperties`, `patternProperties` (disjoint), `min/maxProperties` (only over
additional properties); arrays: `items`, `prefixItems`, `minItems`, `maxItems`; strings:
`minLength`, `maxLength`, `pattern` (no look-around), `format` (date-time, time, date,
duration, email, hostname, ipv4, ipv6, uuid, uri); numbers: `minimum`, `maximum`,
`exclusiveMinimum`, `exclusiveMaximum`, `multipleOf`. Annotations (`title`, `description`,
`default`, `examples`, `$schema`) are ignored. Anything else (`not`, `uniqueItems`,
`if`/`then`/`else`, `dependentRequired`, remote `$ref`, unknown formats) is an error, as is an
unsatisfiable schema (`minimum` > `maximum`, `enum: []`). As in JSON Schema, objects accept
extra properties unless `additionalProperties` is false (OpenAI's strict mode requires false).

Spelling: JSON is generated as `json.dumps` writes it by default (`", "` and `": "` separators,
no other whitespace): the spelling of tool-call arguments in the chat template, and no room for
the whitespace runs a weak model can loop on under llguidance's default flexible whitespace. A
schema's top-level `"x-guidance"` object overrides this (llguidance's `JsonCompileOptions`, e.g.
`{"whitespace_flexible": true}`).
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..data.chat import STOP

__all__ = [
    "JSON_OPTIONS",
    "GrammarConstraint",
    "GrammarFactory",
    "end_token_ids",
    "grammar_constraint",
    "json_constraint",
    "llg_tokenizer",
    "token_literal",
]

# json.dumps' default spelling (see the module docstring); llguidance treats the separators as
# regexes, and these two match only themselves.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_MAX_ERROR = 300  # characters of an llguidance error kept in a ValueError


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as err:  # pragma: no cover - llguidance is a [serve] dependency
        raise ImportError(
            "structured outputs need `llguidance`: pip install 'hybridlm[serve]'"
        ) from err
    return llguidance


def _one_line(message: str) -> str:
    text = " ".join(message.split())
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 3] + "..."


# ---------------------------------------------------------------------------- tokenizers
class _Vocab:
    """What llguidance needs of a tokenizer: its `tokenizer.json`, named tokens and EOS."""

    def __init__(self, tokenizer: Any) -> None:
        self.json = _tokenizer_json(tokenizer)
        data = json.loads(self.json)
        # llguidance treats every added token as special (one token, never spelt by bytes)
        self.added: dict[str, int] = {t["content"]: int(t["id"]) for t in data["added_tokens"]}
        eos = getattr(tokenizer, "eos_id", None)
        if eos is None:
            eos = getattr(tokenizer, "eos_token_id", None)  # transformers
        self.eos_id: int | None = None if eos is None else int(eos)
        self.by_ends: dict[tuple[int, ...], Any] = {}


def _tokenizer_json(tokenizer: Any) -> str:
    """`tokenizer.json` of the project's tokenizers, a `tokenizers.Tokenizer` or a transformers
    fast tokenizer."""
    if hasattr(tokenizer, "tokenizer_json"):  # ByteTokenizer: built without `tokenizers`
        return json.dumps(tokenizer.tokenizer_json())
    backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers (fast)
    if backend is None:
        inner = getattr(tokenizer, "tokenizer", None)  # BPETokenizer wraps a tokenizers.Tokenizer
        backend = inner if hasattr(inner, "to_str") else tokenizer
    if not hasattr(backend, "to_str"):
        raise TypeError(
            f"structured outputs need a ByteTokenizer, BPETokenizer, tokenizers.Tokenizer or a "
            f"transformers fast tokenizer, got {type(tokenizer).__name__}"
        )
    # padding / truncation settings would change encodings llguidance computes (as llguidance.hf)
    backend = copy.copy(backend)
    if hasattr(backend, "no_padding"):
        backend.no_padding()
        backend.no_truncation()
    return backend.to_str()


_VOCABS: weakref.WeakKeyDictionary[Any, _Vocab] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _vocab(tokenizer: Any) -> _Vocab:
    with _LOCK:
        try:
            vocab = _VOCABS.get(tokenizer)
        except TypeError:  # not weak-referenceable: no caching
            return _Vocab(tokenizer)
        if vocab is None:
            vocab = _VOCABS[tokenizer] = _Vocab(tokenizer)
        return vocab


def end_token_ids(tokenizer: Any, extra: Iterable[int] = ()) -> list[int]:
    """The ids that end a constrained sequence: the tokenizer's EOS, the chat stop `<|im_end|>`
    when it is one token (the project's BPE: id 4; the byte tokenizer spells it in bytes), then
    `extra` (e.g. a request's `stop_token_ids`), without repeats."""
    for i in extra:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"stop_token_ids must be non-negative integers, got {i!r}")
    vocab = _vocab(tokenizer)
    ids = [vocab.eos_id, vocab.added.get(STOP), *extra]
    return list(dict.fromkeys(i for i in ids if i is not None))


def llg_tokenizer(tokenizer: Any, end_ids: Sequence[int] | None = None) -> Any:
    """The `llguidance.LLTokenizer` of `tokenizer` with `end_ids` (default `end_token_ids`) as
    its EOS tokens; built once per tokenizer object and end-id set (~1 s for a 150k vocabulary,
    llguidance.hf), then cached."""
    llg = _llguidance()
    vocab = _vocab(tokenizer)
    ends = tuple(end_token_ids(tokenizer) if end_ids is None else end_ids)
    if not ends:
        raise ValueError("the tokenizer has no EOS token: pass stop_token_ids to end sequences")
    with _LOCK:
        tok = vocab.by_ends.get(ends)
        if tok is None:
            try:
                tok = llg.LLTokenizer(vocab.json, eos_token=list(ends))
            except ValueError as err:  # an end id past the tokenizer's vocabulary
                raise ValueError(f"stop_token_ids: {_one_line(str(err))}") from None
            vocab.by_ends[ends] = tok
        return tok


def token_literal(tokenizer: Any, text: str) -> str:
    """A Lark term matching `text` as the model writes it: `<[id]>` when the tokenizer has it as
    one (added) token, which llguidance never lets be spelt byte by byte, else a string
    literal."""
    tid = _vocab(tokenizer).added.get(text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


# ---------------------------------------------------------------------------- constraints
class GrammarConstraint:
    """One sequence's grammar state: the engine's `TokenConstraint` (`allowed`, `accept`,
    `finished`). Not thread-safe; one per sequence (from a `GrammarFactory`)."""

    def __init__(self, matcher: Any, vocab_size: int, n_tokens: int, end_ids: Sequence[int]):
        self._matcher = matcher
        self._V = vocab_size
        self._N = n_tokens
        self._words_W = np.zeros((n_tokens + 31) // 32, dtype=np.int32)
        self._bytes = self._words_W.view(np.uint8)
        self._ptr = self._words_W.ctypes.data  # (a 2 us property: read once)
        self._fresh = False  # _words_W is the mask of the current state
        self._ends = [i for i in end_ids if 0 <= i < vocab_size]

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows next (a new tensor each call)."""
        # the matcher writes its N-bit mask straight into our buffer (llguidance.numpy's
        # fill_next_token_bitmask without the per-call asserts); bits past N are 0, and
        # unpackbits pads with 0 up to V (or cuts at V)
        self._matcher.unsafe_compute_mask_ptr(self._ptr, self._bytes.nbytes)
        self._fresh = True
        bits_V = np.unpackbits(self._bytes, count=self._V, bitorder="little")
        mask_V = torch.from_numpy(bits_V.view(np.bool_))
        if (self._V < self._N or self._matcher.is_error()) and not bits_V.any():
            # an error state, or the grammar needs a token the model lacks (ids >= V): end the
            # sequence rather than sample from an empty set
            mask_V[self._ends] = True
        return mask_V

    def accept(self, token_id: int) -> None:
        """Advance the grammar with the sampled token; ValueError (and no change) if the grammar
        does not allow it here."""
        t = int(token_id)
        if self._fresh:
            ok = 0 <= t < min(self._N, self._V) and bool((self._words_W[t >> 5] >> (t & 31)) & 1)
        else:  # accept() without allowed() first: ask the matcher
            ok = 0 <= t < min(self._N, self._V) and self._matcher.validate_tokens([t]) == 1
        if not ok:
            raise ValueError(f"token {t} is not allowed by the grammar here")
        if not self._matcher.consume_token(t):
            raise ValueError(f"grammar error: {_one_line(self._matcher.get_error())}")
        self._fresh = False

    def finished(self) -> bool:
        """The grammar is complete and cannot be extended (or an end token was accepted)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        """llguidance's error message ('' when none), e.g. a parser resource limit."""
        return self._matcher.get_error()


class GrammarFactory:
    """A compiled grammar: calling it gives a fresh `GrammarConstraint` (the engine's factory,
    one per generated sequence)."""

    def __init__(self, lltok: Any, grammar: str, *, vocab_size: int, what: str) -> None:
        llg = _llguidance()
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        # compiling never raises: a bad grammar leaves the matcher in an error state
        self._template = llg.LLMatcher(lltok, grammar, log_level=0)
        if self._template.is_error():
            raise ValueError(
                f"unsupported or invalid {what}: {_one_line(self._template.get_error())}"
            )
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.n_tokens = int(lltok.vocab_size)
        self.end_ids = [int(i) for i in lltok.eos_tokens]

    def __call__(self) -> GrammarConstraint:
        return GrammarConstraint(
            self._template.deep_copy(), self.vocab_size, self.n_tokens, self.end_ids
        )


def json_constraint(
    tokenizer: Any,
    schema: Mapping[str, Any] | None,
    *,
    vocab_size: int,
    stop_token_ids: Iterable[int] | None = None,
) -> GrammarFactory:
    """The factory of constraints for OpenAI `response_format`: `schema=None` is
    `{"type": "json_object"}` (any JSON object), else `{"type": "json_schema"}`'s schema.
    ValueError (one line) for a schema that is not an object, is invalid, unsupported (see the
    module docstring) or unsatisfiable. `stop_token_ids` end a sequence besides
    `end_token_ids(tokenizer)`."""
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, Mapping):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the JSON schema is not JSON: {err}") from None
    llg = _llguidance()
    lltok = llg_tokenizer(tokenizer, end_token_ids(tokenizer, stop_token_ids or ()))
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    except ValueError as err:
        raise ValueError(f"unsupported or invalid JSON schema: {_one_line(str(err))}") from None
    return GrammarFactory(lltok, grammar, vocab_size=vocab_size, what="JSON schema")


def grammar_constraint(
    tokenizer: Any,
    grammar: str,
    *,
    vocab_size: int,
    syntax: str = "lark",
    stop_token_ids: Iterable[int] | None = None,
) -> GrammarFactory:
    """The factory of constraints for a grammar in llguidance's Lark dialect (`syntax="lark"`,
    llguidance docs/syntax.md: `%json {...}` inlines a schema, `<[id]>` names a token) or a
    regular expression (`syntax="regex"`, Rust regex syntax, no look-around)."""
    llg = _llguidance()
    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError("a grammar must be a non-empty string")
    builders: dict[str, Callable[[str], str]] = {
        "lark": llg.LLMatcher.grammar_from_lark,
        "regex": llg.LLMatcher.grammar_from_regex,
    }
    if syntax not in builders:
        raise ValueError(f"grammar syntax must be one of {sorted(builders)}, got {syntax!r}")
    lltok = llg_tokenizer(tokenizer, end_token_ids(tokenizer, stop_token_ids or ()))
    what = "Lark grammar" if syntax == "lark" else "regular expression"
    return GrammarFactory(lltok, builders[syntax](grammar), vocab_size=vocab_size, what=what)
