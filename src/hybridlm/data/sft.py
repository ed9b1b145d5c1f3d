"""Chat data for supervised fine-tuning: readers, reasoning-mode transforms, tokenisation with an
assistant-only loss mask, and best-fit packing of whole conversations.

Shape legend: B rows per micro-batch, L `seq_len`.

Tokenisation (`encode_chat`): the conversation is rendered with the ChatML template of
`hybridlm.data.chat` and encoded *segment by segment*: text outside the assistant spans and each
assistant span (body + `<|im_end|>`) are encoded separately and concatenated after BOS. The
token span of every assistant turn is therefore exact (no token straddles a span edge), the mask
is exactly those tokens, and the prompt is tokenised as at inference, where the model continues
from the generation prompt `<|im_start|>assistant\\n`. For the byte tokenizer this is identical
to encoding the whole text; for a BPE it can differ from it only at span edges.

A packed batch (`SFTLoader`, `collate_rows`):

    input_ids     [B, L]  conversations back to back, padding after them
    labels        [B, L]  the model's convention (unshifted; `HybridLM.forward` shifts):
                          labels[:, t] = input_ids[:, t] on assistant tokens, else -100
    doc_ids       [B, L]  0, 1, ... per conversation in the row; padding is one more segment
                          (attention and Mamba state never cross a conversation)
    position_ids  [B, L]  restart at 0 at every conversation
    conv_ids      [B, L]  global index of each token's conversation (-1 for padding), for the
                          per-conversation (sample) loss normalisation
    num_loss_tokens       assistant tokens of this micro-batch (sum over micro-batches = |O|)
    num_conversations     conversations with >= 1 assistant token in this micro-batch

Conversations are never split across rows; one longer than L is dropped (`overflow="drop"`,
counted) or cut to L tokens (`overflow="truncate"`). Packing is best-fit decreasing over the whole
dataset (Olmo 3's SFT packing), re-shuffled every epoch from the seed; `state_dict()` /
`load_state_dict()` resume exactly.

Reasoning modes (`ReasoningModes`, Nemotron 3 Super §4.4) are seeded data transforms applied per
conversation before tokenisation: reasoning-off strips the traces of a fraction of the samples
(3%) and puts `/no_think` in the system prompt; low-effort tags a fraction (2%) with
`/low_effort`; budget control truncates the traces of a fraction (12%) to a random budget of
tokens stated in the system prompt (`Reasoning budget: N tokens.`), the truncated trace then
closed by `</think>` and followed by the answer, as in the budget-control SFT stage.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from . import builtin
from .chat import render_with_spans, validate
from .loader import IGNORE_INDEX, best_fit_decreasing

Message = Mapping[str, Any]
Conversation = list[dict[str, Any]]

REASONING_OFF_TAG = "/no_think"
LOW_EFFORT_TAG = "/low_effort"
BUDGET_TEMPLATE = "Reasoning budget: {budget} tokens."
STATE_VERSION = 1


# ---------------------------------------------------------------------------- tokenisation
@dataclass(frozen=True)
class ChatExample:
    """One tokenised conversation: ids (BOS first), a per-token loss mask (True on the assistant
    bodies and their stop tokens) and the token span `[start, end)` of every assistant turn."""

    input_ids: list[int]
    loss_mask: list[bool]
    spans: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def _char_spans_from(spans: Sequence[tuple[int, int]], first_char: int) -> list[tuple[int, int]]:
    return [(a, b) for a, b in spans if a >= first_char]


def encode_chat(
    messages: Sequence[Message],
    tokenizer: Any,
    *,
    add_bos: bool = True,
    loss_from_char: int = 0,
) -> ChatExample:
    """Render `messages` and tokenise them with an assistant-only loss mask.

    `loss_from_char`: only assistant spans starting at or after this character of the rendered
    text get loss (DPO: the completion after a multi-turn prompt)."""
    text, char_spans = render_with_spans(messages)
    char_spans = _char_spans_from(char_spans, loss_from_char)
    ids: list[int] = [tokenizer.bos_id] if add_bos else []
    mask: list[bool] = [False] * len(ids)
    tok_spans: list[tuple[int, int]] = []
    pos = 0
    for a, b in char_spans:
        if a > pos:
            seg = tokenizer.encode(text[pos:a], add_bos=False)
            ids += seg
            mask += [False] * len(seg)
        seg = tokenizer.encode(text[a:b], add_bos=False)
        tok_spans.append((len(ids), len(ids) + len(seg)))
        ids += seg
        mask += [True] * len(seg)
        pos = b
    if pos < len(text):
        seg = tokenizer.encode(text[pos:], add_bos=False)
        ids += seg
        mask += [False] * len(seg)
    return ChatExample(input_ids=ids, loss_mask=mask, spans=tok_spans)


# ---------------------------------------------------------------------------- readers
@dataclass
class ReadReport:
    """Rows read, kept and skipped: reason -> count, and the first row index and detail of
    each reason."""

    rows: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_row: dict[str, int] = field(default_factory=dict)
    first_detail: dict[str, str] = field(default_factory=dict)

    def skip(self, reason: str, row: int, detail: str = "") -> None:
        self.skipped[reason] += 1
        if reason not in self.first_row:
            self.first_row[reason], self.first_detail[reason] = row, detail

    def summary(self) -> str:
        parts = [f"{self.kept}/{self.rows} rows kept"]
        for reason, n in self.skipped.most_common():
            detail = self.first_detail.get(reason)
            at = f"first at row {self.first_row[reason]}" + (f": {detail}" if detail else "")
            parts.append(f"{n} skipped: {reason} ({at})")
        return "; ".join(parts)


def check_messages(
    row: Any, messages_field: str = "messages"
) -> tuple[Conversation | None, str, str]:
    """(the row's validated messages, "", "") or (None, reason it is unusable, detail)."""
    if not isinstance(row, Mapping):
        return None, "row is not an object", type(row).__name__
    messages = row.get(messages_field)
    if messages is None:
        return None, f"no {messages_field!r} field", ""
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as err:
            return None, f"{messages_field!r} is a string that is not JSON", str(err)
    try:
        turns = validate(messages)
    except ValueError as err:
        return None, "invalid messages", str(err)
    if not any(t.is_assistant for t in turns):
        return None, "no assistant turn", ""
    # drop keys parquet fills with None so the row renders like its JSON form
    clean = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    return clean, "", ""


def _raw_rows(path: str, kind: str, split: str) -> Iterator[tuple[Any, str]]:
    """(row, "") or (None, reason) for every row of a JSONL / Parquet file or an HF dataset."""
    p = Path(path)
    if kind == "auto":
        if p.suffix in (".jsonl", ".json") or p.name.endswith(".jsonl.gz"):
            kind = "jsonl"
        elif p.suffix == ".parquet":
            kind = "parquet"
        else:
            kind = "hf"
    if kind == "jsonl":
        if not p.is_file():
            raise ValueError(f"chat data file not found: {path}")
        # bytes, decoded line by line: one bad line is one skipped row, not a failed file
        opener = gzip.open if p.name.endswith(".gz") else open
        try:
            with opener(p, "rb") as f:
                for raw in f:
                    if not raw.strip():
                        continue
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError:
                        yield None, "invalid UTF-8"
                        continue
                    try:
                        yield json.loads(line.removeprefix("\ufeff")), ""
                    except json.JSONDecodeError:
                        yield None, "invalid JSON line"
        except (OSError, EOFError):  # a truncated or corrupt .gz: the rows before it count
            yield None, "unreadable rest of file (truncated or corrupt gzip)"
    elif kind == "parquet":
        if not p.is_file():
            raise ValueError(f"chat data file not found: {path}")
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(p).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield row, ""
    elif kind == "hf":
        try:
            import datasets
        except ImportError as err:  # pragma: no cover - datasets is a [data] dependency
            raise ImportError("HF datasets need `datasets`: pip install 'hybridlm[data]'") from err
        if p.is_dir():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"{path} has splits {list(ds)}, not {split!r}")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(path, split=split)
        for row in ds:
            yield row, ""
    else:
        raise ValueError(f"unknown chat data kind {kind!r}; use auto, jsonl, parquet or hf")


def read_conversations(
    path: str | Path,
    *,
    kind: Literal["auto", "jsonl", "parquet", "hf"] = "auto",
    split: str = "train",
    messages_field: str = "messages",
    max_rows: int | None = None,
    report: ReadReport | None = None,
) -> Iterator[Conversation]:
    """Conversations in the OpenAI messages format from a JSONL file, a Parquet file, a saved
    HF dataset directory or an HF hub name (`messages` column). Bad rows are skipped and counted
    with their reason in `report`."""
    report = report if report is not None else ReadReport()
    for k, (row, reason) in enumerate(_raw_rows(str(path), kind, split)):
        if max_rows is not None and report.kept >= max_rows:
            return
        report.rows += 1
        detail = ""
        if not reason:
            messages, reason, detail = check_messages(row, messages_field)
        if reason:
            report.skip(reason, k, detail)
            continue
        report.kept += 1
        yield messages


# ---------------------------------------------------------------------------- generated data
def gsm8k_conversations(
    path: str | Path | None = None, *, max_rows: int | None = None
) -> list[Conversation]:
    """GSM8K rows (`question`, `answer` ending in `#### N`; `.gz` ok; the packaged train split
    when `path` is None or "") as conversations: the worked solution is the reasoning trace, the
    final number the answer. Calculator annotations `<<48/2=24>>` are removed."""
    import re

    out = []
    for row in builtin.read_jsonl(path or builtin.path(builtin.GSM8K_TRAIN), limit=max_rows):
        work, _, final = row["answer"].rpartition("####")
        work = re.sub(r"<<[^>]*>>", "", work).strip()
        out.append(
            [
                {"role": "user", "content": row["question"]},
                {"role": "assistant", "content": final.strip(), "reasoning_content": work},
            ]
        )
    return out


def arithmetic_conversations(
    n: int, *, seed: int = 0, digits: int = 2, ops: str = "+-", terms: int = 2
) -> list[Conversation]:
    """`n` arithmetic questions ("What is 47 + 38?") with a short column-wise reasoning trace and
    the answer: a task a tiny model can learn in minutes, with a checkable answer. `ops` holds
    the operators drawn from ("+-*"; `*` multiplies by one digit, 2-9, and needs the
    multiplication table: a tiny model learns it partly, which leaves RL room). With `terms`
    > 2 the question chains `terms - 1` operations left to right ("What is 47 + 38 - 12?"), the
    trace works each step in turn and every intermediate value stays >= 0; the chains leave a
    tiny model room to improve (`data.tasks`)."""
    if terms < 2:
        raise ValueError(f"terms must be >= 2, got {terms}")
    if not ops or set(ops) - set("+-*") or ("*" in ops and terms > 2):
        raise ValueError(f"ops must be drawn from '+-*' ('*' with two terms), got {ops!r}")
    rng = random.Random(seed)
    out = []
    hi = 10**digits - 1
    for _ in range(n):
        if terms == 2:  # the original draw order: the same questions as before chains existed
            a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(ops)
            if op == "-" and b > a:
                a, b = b, a
            if op == "*":  # by one digit: the multiplication table, then the carries
                b = 2 + b % 8
            ans = a + b if op == "+" else a - b if op == "-" else a * b
            trace = _column_trace(a, b, op)
            question = f"{a} {op} {b}"
        else:
            value = rng.randint(0, hi)
            question, steps = str(value), []
            for _ in range(terms - 1):
                b, op = rng.randint(0, hi), rng.choice(ops)
                if op == "-" and b > value:
                    op = "+"
                nxt = value + b if op == "+" else value - b
                steps.append(f"{value} {op} {b}:\n{_column_trace(value, b, op)}\n= {nxt}")
                question, value = f"{question} {op} {b}", nxt
            ans, trace = value, "\n".join(steps)
        out.append(
            [
                {"role": "user", "content": f"What is {question}?"},
                {"role": "assistant", "content": str(ans), "reasoning_content": trace},
            ]
        )
    return out


def _column_trace(a: int, b: int, op: str) -> str:
    """Digit-by-digit addition (carry), subtraction (borrow) or multiplication by one digit
    (carry), least significant first."""
    steps, carry, i = [], 0, 0
    if op == "*":
        while not steps or a // 10**i or carry:  # one step at least (0 * b)
            da = a // 10**i % 10
            s = da * b + carry
            steps.append(f"{da}*{b}+{carry}={s}, write {s % 10} carry {s // 10}")
            carry, i = s // 10, i + 1
        return "\n".join(steps)
    while a // 10**i or b // 10**i or (carry and op == "+"):
        da, db = a // 10**i % 10, b // 10**i % 10
        if op == "+":
            s = da + db + carry
            steps.append(f"{da}+{db}+{carry}={s}, write {s % 10} carry {s // 10}")
            carry = s // 10
        else:
            s = da - db - carry
            borrow = int(s < 0)
            steps.append(f"{da}-{db}-{carry}={s}, write {s % 10} borrow {borrow}")
            carry = borrow
        i += 1
    return "\n".join(steps) if steps else "0"


# ---------------------------------------------------------------------------- reasoning modes
@dataclass(kw_only=True)
class ReasoningModes:
    """Fractions of conversations (those with a reasoning trace) put in each mode, Nemotron 3
    Super §4.4: reasoning-off 3%, low-effort 2%, budget control 12% (the budget-control SFT
    stage). The modes are exclusive; a conversation's mode is a pure function of
    (seed, index)."""

    reasoning_off: float = 0.03
    low_effort: float = 0.02
    budget: float = 0.12
    min_budget: int = 1  # budgets are drawn uniformly from [min_budget, trace tokens - 1]
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("reasoning_off", "low_effort", "budget"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"reasoning.{name} must be in [0, 1], got {v}")
        if self.reasoning_off + self.low_effort + self.budget > 1 + 1e-9:
            raise ValueError("reasoning.reasoning_off + low_effort + budget must be <= 1")
        if self.min_budget < 1:
            raise ValueError(f"reasoning.min_budget must be >= 1, got {self.min_budget}")


def _u01(*keys: int) -> float:
    data = struct.pack(f"<{len(keys)}Q", *(k & 0xFFFFFFFFFFFFFFFF for k in keys))
    h = hashlib.blake2b(data, digest_size=8).digest()
    return (int.from_bytes(h, "little") >> 11) / float(1 << 53)


def _with_system_line(messages: Conversation, line: str) -> Conversation:
    """Append `line` to the system prompt (a new system message when there is none)."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") in ("system", "developer"):
        content = out[0].get("content") or ""
        if not isinstance(content, str):
            from .chat import _text

            content = _text(content, "messages[0]")
        out[0]["content"] = f"{content}\n{line}" if content else line
    else:
        out.insert(0, {"role": "system", "content": line})
    return out


def _reasoning_of(m: Message) -> str | None:
    r = m.get("reasoning_content")
    if r is None:  # as `chat.validate` reads it
        r = m.get("reasoning")
    return r if isinstance(r, str) and r else None


def strip_reasoning(messages: Sequence[Message]) -> Conversation:
    """Reasoning-off: traces removed from every assistant turn, `/no_think` in the system
    prompt."""
    out = []
    for m in messages:
        m = dict(m)
        m.pop("reasoning_content", None)
        m.pop("reasoning", None)
        out.append(m)
    return _with_system_line(out, REASONING_OFF_TAG)


def truncate_prefix(text: str, budget: int, count: Callable[[str], int]) -> str:
    """The longest prefix of `text` with at most `budget` tokens under `count` (binary search
    over characters; token counts are monotone in the prefix length for byte-level tokenizers)."""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def budget_truncate(
    messages: Sequence[Message], budget: int, count: Callable[[str], int]
) -> Conversation:
    """Budget control: every assistant trace cut to at most `budget` tokens and the budget
    stated in the system prompt; the answer after the trace is kept."""
    out = []
    for m in messages:
        m = dict(m)
        r = _reasoning_of(m)
        if m.get("role") == "assistant" and r is not None:
            m.pop("reasoning", None)
            m["reasoning_content"] = truncate_prefix(r, budget, count)
        out.append(m)
    return _with_system_line(out, BUDGET_TEMPLATE.format(budget=budget))


def apply_reasoning_modes(
    conversations: Sequence[Conversation],
    modes: ReasoningModes,
    tokenizer: Any,
) -> tuple[list[Conversation], Counter]:
    """The conversations with each one's mode applied; returns them and the count per mode
    ("regular", "reasoning_off", "low_effort", "budget")."""

    def count(s: str) -> int:
        return len(tokenizer.encode(s, add_bos=False))

    out, counts = [], Counter()
    cut_off = modes.reasoning_off
    cut_low = cut_off + modes.low_effort
    cut_budget = cut_low + modes.budget
    for i, conv in enumerate(conversations):
        traces = [r for m in conv if m.get("role") == "assistant" and (r := _reasoning_of(m))]
        u = _u01(modes.seed, 0x5F7, i)
        if not traces or u >= cut_budget:
            out.append(conv)
            counts["regular"] += 1
        elif u < cut_off:
            out.append(strip_reasoning(conv))
            counts["reasoning_off"] += 1
        elif u < cut_low:
            out.append(_with_system_line(conv, LOW_EFFORT_TAG))
            counts["low_effort"] += 1
        else:
            longest = max(count(r) for r in traces)
            if longest <= modes.min_budget:
                out.append(conv)
                counts["regular"] += 1
                continue
            rng = random.Random(_u01(modes.seed, 0xB0D, i))
            budget = rng.randint(modes.min_budget, longest - 1)
            out.append(budget_truncate(conv, budget, count))
            counts["budget"] += 1
    return out, counts


# ---------------------------------------------------------------------------- dataset + packing
@dataclass
class TokenizedChats:
    """Tokenised conversations plus what was dropped on the way."""

    examples: list[ChatExample]
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0


def tokenize_conversations(
    conversations: Iterable[Conversation],
    tokenizer: Any,
    *,
    max_len: int,
    overflow: Literal["drop", "truncate"] = "drop",
) -> TokenizedChats:
    """`encode_chat` of each conversation; longer than `max_len` tokens: dropped or cut."""
    if overflow not in ("drop", "truncate"):
        raise ValueError(f"overflow must be 'drop' or 'truncate', got {overflow!r}")
    out = TokenizedChats(examples=[])
    for conv in conversations:
        ex = encode_chat(conv, tokenizer)
        if len(ex) > max_len:
            if overflow == "drop":
                out.dropped[f"longer than {max_len} tokens"] += 1
                continue
            spans = [(a, min(b, max_len)) for a, b in ex.spans if a < max_len]
            ex = ChatExample(ex.input_ids[:max_len], ex.loss_mask[:max_len], spans)
            out.truncated += 1
        if ex.num_loss_tokens == 0:
            out.dropped["no assistant tokens"] += 1
            continue
        out.examples.append(ex)
    return out


def pack_best_fit(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Rows of example indices, each row's total length <= `seq_len` (best-fit decreasing)."""
    too_long = [i for i, n in enumerate(lengths) if n > seq_len]
    if too_long:
        raise ValueError(f"example {too_long[0]} has {lengths[too_long[0]]} > {seq_len} tokens")
    pieces = [(0, i, 0, int(n)) for i, n in enumerate(lengths)]
    return [[p[1] for p in row] for row in best_fit_decreasing(pieces, seq_len)]


def collate_rows(
    examples: Sequence[ChatExample],
    rows: Sequence[Sequence[int]],
    seq_len: int,
    *,
    pad_id: int = 0,
) -> dict[str, torch.Tensor]:
    """Materialise packed rows (lists of example indices) as a batch (module docstring)."""
    B, L = len(rows), seq_len
    ids_BL = np.full((B, L), pad_id, dtype=np.int64)
    labels_BL = np.full((B, L), IGNORE_INDEX, dtype=np.int64)
    doc_BL = np.zeros((B, L), dtype=np.int64)
    pos_BL = np.zeros((B, L), dtype=np.int64)
    conv_BL = np.full((B, L), -1, dtype=np.int64)
    n_tok = n_conv = 0
    for b, row in enumerate(rows):
        a = 0
        for k, i in enumerate(row):
            ex = examples[i]
            n = len(ex)
            if a + n > L:
                raise ValueError(f"row {b} holds {a + n} > seq_len={L} tokens")
            ids = np.asarray(ex.input_ids, dtype=np.int64)
            mask = np.asarray(ex.loss_mask, dtype=bool)
            # a conversation's first token (BOS) is context only: no target crosses rows/convs
            mask[0] = False
            ids_BL[b, a : a + n] = ids
            labels_BL[b, a : a + n] = np.where(mask, ids, IGNORE_INDEX)
            doc_BL[b, a : a + n] = k
            pos_BL[b, a : a + n] = np.arange(n)
            conv_BL[b, a : a + n] = i
            n_tok += int(mask.sum())
            n_conv += int(mask.any())
            a += n
        doc_BL[b, a:] = len(row)
        pos_BL[b, a:] = np.arange(L - a)
    return {
        "input_ids": torch.from_numpy(ids_BL),
        "labels": torch.from_numpy(labels_BL),
        "doc_ids": torch.from_numpy(doc_BL),
        "position_ids": torch.from_numpy(pos_BL),
        "conv_ids": torch.from_numpy(conv_BL),
        "num_loss_tokens": torch.tensor(n_tok, dtype=torch.int64),
        "num_conversations": torch.tensor(n_conv, dtype=torch.int64),
    }


class SFTLoader:
    """Infinite iterator of packed micro-batches of `batch_size` rows of `seq_len` tokens.

    Each epoch the examples are shuffled (seed, epoch), packed best-fit decreasing, and the
    rows emitted in a seeded order; the last rows of an epoch are followed by the first of the
    next. `sequential=True`: one pass in a fixed order, then StopIteration (evaluation)."""

    def __init__(
        self,
        examples: Sequence[ChatExample],
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        pad_id: int = 0,
        sequential: bool = False,
    ) -> None:
        if not examples:
            raise ValueError("SFTLoader needs at least one tokenised conversation")
        if seq_len < 2 or batch_size < 1:
            raise ValueError(f"need seq_len >= 2 and batch_size >= 1, got {seq_len}, {batch_size}")
        self.examples = list(examples)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.shuffle, self.pad_id, self.sequential = shuffle, pad_id, sequential
        self.epoch, self.cursor, self.step = 0, 0, 0
        self._rows: list[list[int]] | None = None
        self._rows_epoch = -1

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        if self._rows is not None and self._rows_epoch == epoch:
            return self._rows
        order = np.arange(len(self.examples))
        shuffle = self.shuffle and not self.sequential
        if shuffle:
            order = np.random.default_rng([self.seed, 3, epoch]).permutation(len(self.examples))
        lengths = [len(self.examples[i]) for i in order]
        rows = [[int(order[j]) for j in row] for row in pack_best_fit(lengths, self.seq_len)]
        if shuffle and len(rows) > 1:
            perm = np.random.default_rng([self.seed, 4, epoch]).permutation(len(rows))
            rows = [rows[j] for j in perm]
        self._rows, self._rows_epoch = rows, epoch
        return rows

    @property
    def rows_per_epoch(self) -> int:
        return len(self._epoch_rows(0))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows: list[list[int]] = []
        while len(rows) < self.batch_size:
            epoch_rows = self._epoch_rows(self.epoch)
            if self.cursor >= len(epoch_rows):
                if self.sequential:
                    break
                self.epoch, self.cursor = self.epoch + 1, 0
                continue
            rows.append(epoch_rows[self.cursor])
            self.cursor += 1
        if not rows:
            raise StopIteration
        self.step += 1
        batch = collate_rows(self.examples, rows, self.seq_len, pad_id=self.pad_id)
        batch["epoch"] = torch.tensor(self.epoch)
        return batch

    def _fingerprint(self) -> list[Any]:
        h = hashlib.sha256()
        for ex in self.examples:
            h.update(np.asarray(ex.input_ids, dtype=np.int64).tobytes())
            h.update(np.asarray(ex.loss_mask, dtype=np.bool_).tobytes())
        return [self.seq_len, self.batch_size, self.seed, self.shuffle, h.hexdigest()]

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "step": self.step,
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"SFT loader state version {state.get('version')} != {STATE_VERSION}")
        if list(state.get("fingerprint", [])) != self._fingerprint():
            raise ValueError(
                "SFT loader state was saved for other data or settings (seq_len, batch_size, "
                "seed, shuffle or the tokenised conversations differ)"
            )
        self.epoch, self.cursor, self.step = state["epoch"], state["cursor"], state["step"]
