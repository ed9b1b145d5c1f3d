"""Reading text that someone else wrote: one bounded JSON reader, and short echoes.

Every place where untrusted text becomes data goes through `loads` (a whole JSON text) or
`decode_prefix` (a JSON value that starts inside a longer text, e.g. the body of a
`<tool_call>` block in generated text): request bodies of the model and environment servers,
tool-call arguments a client sends or a policy writes, structured replies a verifier reads.
Untrusted means a client of a server, or the policy in RL, which writes whatever earns reward
or breaks the loop.

The limits are checked on the raw text in linear time before anything is decoded, so the
decoder never recurses deeply and never builds more than `max_items` values:

- size: at most `max_chars` characters (a `str`) or bytes (`bytes`);
- depth: arrays and objects nest at most `max_depth` deep (Python's decoder recurses once a
  level, and a few thousand levels end in `RecursionError`);
- items: at most `max_items` array elements and object members in all;
- numbers: NaN and Infinity are not JSON (unless `allow_nan`), and an integer of more than
  4,300 digits is refused by Python itself; both are `UntrustedJSONError`.

Any failure is an `UntrustedJSONError` (a `ValueError`) whose message says which limit or which
syntax error, never a `RecursionError` or `MemoryError`. Messages start with `what`, the name
of the text ("the request body: not valid JSON (...)").

`clip(text)` is what a message may quote of untrusted input: a short prefix, never the whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_LIMITS",
    "JSONLimits",
    "UntrustedJSONError",
    "clip",
    "decode_prefix",
    "json_shape",
    "loads",
]


@dataclass(frozen=True)
class JSONLimits:
    """What one JSON text may hold (module docstring)."""

    max_depth: int = 64  # a chat request nests about 6 deep, tool-call arguments a few more
    max_chars: int = 4 << 20  # a request body's default limit (`infer.protocol`)
    max_items: int = 1 << 20
    # NaN / Infinity literals: not JSON (RFC 8259), but Python's json reads them, and a checker
    # that follows a reference built on it (IFEval's json_format) must too
    allow_nan: bool = False

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.max_chars < 1 or self.max_items < 1:
            raise ValueError(f"JSON limits must be >= 1, got {self}")


DEFAULT_LIMITS = JSONLimits()


class UntrustedJSONError(ValueError):
    """Untrusted JSON that is malformed or over a limit of `JSONLimits`."""


_DEPTH_STEP = np.zeros(256, np.int8)  # byte -> change of nesting depth
_DEPTH_STEP[list(b"[{")], _DEPTH_STEP[list(b"]}")] = 1, -1
_ITEM = np.zeros(256, np.int8)  # bytes that open an item: a container, or a separator
_ITEM[list(b"[{,")] = 1
_BLOCK = 1 << 20


def json_shape(text: str | bytes) -> tuple[int, int]:
    """(depth, items) of a JSON text: how deep arrays and objects nest (0: a scalar) and an
    upper bound on the values they hold (containers plus separators), from the raw text in
    linear time and without recursion. The escapes that could hide a quote (`\\\\`, then
    `\\"`) are cut out; a bracket or comma then counts when an even number of quotes precede it
    (outside strings). Numpy, 1 MiB at a time: a 4 MiB text costs milliseconds."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    depth = peak = quotes = items = 0
    for start in range(0, len(data), _BLOCK):
        part = np.frombuffer(data, np.uint8, count=min(_BLOCK, len(data) - start), offset=start)
        quoted = np.cumsum(part == ord('"'), dtype=np.int64) + quotes
        outside = quoted % 2 == 0
        running = np.cumsum(np.where(outside, _DEPTH_STEP[part], 0), dtype=np.int64) + depth
        peak, depth = max(peak, int(running.max())), int(running[-1])
        items += int(np.count_nonzero(outside & (_ITEM[part] == 1)))
        quotes = int(quoted[-1]) % 2
    return peak, items


def _no_constant(name: str) -> Any:
    raise UntrustedJSONError(f"{name} is not a JSON number")


def _check_shape(text: str | bytes, limits: JSONLimits, what: str) -> None:
    if isinstance(text, str):  # short texts: the bracket counts bound depth and items
        opened = text.count("[") + text.count("{")
        if opened <= limits.max_depth and opened + text.count(",") <= limits.max_items:
            return
    depth, items = json_shape(text)
    if depth > limits.max_depth:
        raise UntrustedJSONError(
            f"{what}: nests arrays/objects {depth} deep; at most {limits.max_depth} levels are "
            "accepted"
        )
    if items > limits.max_items:
        raise UntrustedJSONError(f"{what}: more than {limits.max_items} values")


def loads(text: str | bytes, limits: JSONLimits = DEFAULT_LIMITS, *, what: str = "JSON") -> Any:
    """`json.loads(text)` within `limits` (module docstring); `what` names the text in
    messages ("the request body", "tool call arguments")."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise TypeError(f"{what} must be text, got {type(text).__name__}")
    if len(text) > limits.max_chars:
        unit = "characters" if isinstance(text, str) else "bytes"
        raise UntrustedJSONError(f"{what}: longer than {limits.max_chars} {unit}")
    _check_shape(text, limits, what)
    try:
        return json.loads(text, **({} if limits.allow_nan else {"parse_constant": _no_constant}))
    except UntrustedJSONError:
        raise
    except (ValueError, RecursionError) as err:  # syntax, bad UTF-8, 4300+ digit integers
        raise UntrustedJSONError(f"{what}: not valid JSON ({err})") from None


_FIRST_WINDOW = 256
_DECODERS = {
    False: json.JSONDecoder(parse_constant=_no_constant),
    True: json.JSONDecoder(),
}


def _decoder(limits: JSONLimits) -> json.JSONDecoder:
    return _DECODERS[limits.allow_nan]


def decode_prefix(
    text: str, start: int, limits: JSONLimits = DEFAULT_LIMITS, *, what: str = "JSON"
) -> tuple[Any, int]:
    """The JSON value that starts at `text[start]` and the index just after it
    (`JSONDecoder.raw_decode`), within `limits`. `UntrustedJSONError` when no complete, valid
    value starts there.

    The cost is linear in what the decoder reads, not in the length of `text`, so a caller may
    try every position of a long text: the value is decoded from a window of the text that
    grows 4x while the decoder runs into its end (a `JSONDecodeError` on the whole text would
    count the lines before the error, a scan of everything before `start`). The value's own
    span is then checked against the depth and item limits."""
    window = _FIRST_WINDOW
    while True:
        stop = min(len(text), start + window)
        chunk = text[start:stop]
        try:
            value, end = _decoder(limits).raw_decode(chunk)
        except UntrustedJSONError:
            raise
        except json.JSONDecodeError as err:
            # the window, not the text, may have ended the value: an unterminated string is
            # reported where it starts, anything else at or near the window's end
            cut = err.pos >= len(chunk) - 8 or err.msg.startswith("Unterminated string")
            if stop < len(text) and cut and window < limits.max_chars:
                window *= 4
                continue
            if stop < len(text) and cut:
                raise UntrustedJSONError(
                    f"{what}: longer than {limits.max_chars} characters"
                ) from None
            raise UntrustedJSONError(f"{what}: not valid JSON ({err})") from None
        except RecursionError:
            raise UntrustedJSONError(
                f"{what}: nests arrays/objects deeper than {limits.max_depth} levels"
            ) from None
        if end == len(chunk) and stop < len(text):  # a number or literal may go on
            window *= 4
            continue
        break
    if end > limits.max_chars:
        raise UntrustedJSONError(f"{what}: longer than {limits.max_chars} characters")
    _check_shape(chunk[:end], limits, what)
    return value, start + end


def clip(text: Any, limit: int = 80) -> str:
    """`repr(text)` cut to about `limit` characters: what a message may echo of input it
    refuses (an echo of the whole would let one request make every reply large)."""
    if isinstance(text, str) and len(text) > limit:  # no repr of a megabyte to cut it after
        text = text[:limit]
    out = repr(text)
    return out if len(out) <= limit else out[: max(limit - 3, 1)] + "..."
