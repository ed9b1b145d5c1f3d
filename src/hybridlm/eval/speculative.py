"""Speculative-decoding evaluation (SPEED-Bench protocol; Nemotron 3 Super §2.1.2, Table 2):
average acceptance length and per-position acceptance of the MTP drafter, by prompt category,
greedy and at T=1, next to plain-vs-speculative engine throughput and latency.

    hybridlm eval --checkpoint runs/quickstart --tasks spec_bench --limit 8 --max-new-tokens 64
    run_spec_bench(model, tokenizer, build_prompts(...), SpecBenchConfig())

Protocol (SPEED-Bench: fixed draft length 7, acceptance length = tokens emitted per
verification step = accepted drafts + 1, reported per category and as their mean):

1. **Prompts** (`build_prompts`), built locally and deterministically from a seed, in five
   categories: `code` (Python standard-library function heads: signature + docstring),
   `math` (GSM8K test questions, the packaged copy or `<data_dir>/gsm8k`; generated arithmetic
   word problems when a `data_dir` has none), `writing` (tinyshakespeare passages from the
   held-out last 10%, packaged or `<data_dir>/tinyshakespeare`; standard-library docstrings
   when a `data_dir` has none), `chat` (chat-template
   conversations ending in the assistant header) and `repetitive` (lists, tables and sequences
   to continue). `prompt_format="chat"` wraps the non-chat prompts as a user turn too.
2. **Acceptance** (`measure_prompts`): every prompt is decoded by `speculative_generate` with
   draft length `draft_len` for `new_tokens` tokens (no EOS) at each temperature: temperature 0
   verifies drafts by exact match; T=1 by rejection sampling (Leviathan et al. 2023 Alg. 1),
   seeded per prompt. Per-request `SpecStats` are merged with `infer.speculative.merge_stats`
   (ratio of sums over verify steps, so long prompts weigh by their steps). The overall figure
   is the mean over categories, as SPEED-Bench's "Average" row (Table 2: the mean of the 11
   category rows, 3.45 for Super); the pooled ratio over all prompts is reported too.
   Standard errors are over prompts: bootstrap of the ratio of sums within a category
   (`tasks.bootstrap_ratio_stderr`), and sqrt(sum of squared category errors) / C for the mean
   over C independent categories.
   `distinct_4grams:<tag>` (share of distinct token 4-grams in a continuation, mean over
   prompts) flags looping outputs, whose drafts are trivially accepted.
   Identity (`SpecStats`): acceptance length = 1 + sum_i rate_i * drafted_i / steps, with rate_i
   the accepted share of the drafts made at position i; = 1 + sum_i rate_i when no round is cut
   short by the token limit.
3. **Greedy equality**: at temperature 0 the speculative tokens must equal plain greedy
   decoding (`infer.generate.generate`) token for token (SPEC §6); `greedy_mismatches` counts the
   prompts that differ and must be 0. The engine runs below are compared the same way.
4. **Engine speed** (`time_engine`): the continuous-batching `Engine` decodes the prompts in
   groups of `timing_batch_size` concurrent requests, plain (`speculative=0`) and speculative
   (`speculative=draft_len`), greedy, `new_tokens` each, interleaved with alternating order per
   group and repeat so machine noise hits both alike (as `benchmarks/decode.py`). Per request:
   time to first token (from submission to the `Engine.step` that returns it: for a plain
   request that step also runs its first decode step, a speculative one returns after the
   prefill), inter-token latency ((t_last - t_first) / (n - 1)), and overall
   tokens/s = tokens / wall time. Reported with the speculative / plain ratios;
   absolute times depend on the machine and are never asserted by the tests.

Shape suffixes: L prompt tokens (with BOS), N generated tokens.

Results go to results.json / metrics.jsonl through the harness (`hybridlm eval`), metric names
`acceptance_length:<greedy|T1>[:<category>]` and `acceptance@<position>:<greedy|T1>[:<category>]`;
`plot_spec_bench` renders acceptance by position per category from metrics.jsonl.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import random
import statistics
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data import builtin
from ..data.chat import render
from ..infer.engine import Engine
from ..infer.generate import generate
from ..infer.sampling import SamplingParams
from ..infer.speculative import MAX_DRAFT_LEN, SpecStats, merge_stats, speculative_generate
from ..model.model import HybridLM
from ..report.plot import pyplot, read_metrics, save_figure
from .tasks import (
    PROMPT_FORMATS,
    EvalRunner,
    Task,
    TaskResult,
    bootstrap_ratio_stderr,
    mean_stderr,
    register_task,
)

CATEGORIES = ("code", "math", "writing", "chat", "repetitive")
# Standard-library modules whose documented top-level functions make the `code` prompts (and
# whose docstrings are the `writing` fallback): small, pure-Python, stable across 3.10-3.13.
CODE_MODULES = (
    "base64.py",
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "difflib.py",
    "fnmatch.py",
    "genericpath.py",
    "glob.py",
    "heapq.py",
    "ntpath.py",
    "posixpath.py",
    "shlex.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
)
SYSTEM_PROMPT = "You are a helpful assistant."


# ---------------------------------------------------------------------- prompts
@dataclass(frozen=True, kw_only=True)
class SpecPrompt:
    """One benchmark prompt: `text` is what the model continues (BOS is added at encoding)."""

    id: str
    category: str
    text: str
    source: str  # where it comes from: a data file and row, a stdlib file, or "generated"


def _stdlib_functions() -> list[tuple[str, str, str]]:
    """(file, function head with its docstring, the docstring) of the documented top-level
    functions of `CODE_MODULES`, in file and line order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in CODE_MODULES:
        path = root / name
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node, clean=True)
            if not doc or not isinstance(node.body[0], ast.Expr):
                continue
            head = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno]) + "\n"
            out.append((name, head, doc))
    return out


def _code_prompts(n: int, rng: random.Random) -> list[SpecPrompt]:
    funcs = _stdlib_functions()
    if not funcs:
        raise ValueError("no standard-library modules found for the code prompts")
    picks = rng.sample(range(len(funcs)), min(n, len(funcs)))
    return [
        SpecPrompt(
            id=f"code/{i}", category="code", text=funcs[j][1], source=f"stdlib/{funcs[j][0]}"
        )
        for i, j in enumerate(picks)
    ]


_WORD_PROBLEMS = (
    "A baker makes {a} loaves in the morning and {b} loaves in the afternoon. He sells {c} of"
    " them. How many loaves are left?",
    "Mia reads {a} pages every day for {b} days, then {c} more pages. How many pages did she"
    " read in total?",
    "A box holds {a} pencils. A school buys {b} boxes and gives away {c} pencils. How many"
    " pencils does the school keep?",
    "Tom earns ${a} an hour and works {b} hours. He spends ${c} on lunch. How much money does he"
    " have left?",
)


def _math_prompts(n: int, rng: random.Random, data_dir: Path | None) -> list[SpecPrompt]:
    path = builtin.path(builtin.GSM8K_TEST, data_dir)
    if path.is_file():
        rows = builtin.read_jsonl(path)
        picks = rng.sample(range(len(rows)), min(n, len(rows)))
        return [
            SpecPrompt(
                id=f"math/{i}",
                category="math",
                text=f"Question: {rows[j]['question']}\nAnswer:",
                source=f"gsm8k/test.jsonl:{j}",
            )
            for i, j in enumerate(picks)
        ]
    out = []
    for i in range(n):  # no GSM8K: generated arithmetic word problems
        a, b, c = rng.randint(3, 40), rng.randint(2, 12), rng.randint(1, 20)
        q = _WORD_PROBLEMS[i % len(_WORD_PROBLEMS)].format(a=a, b=b, c=c)
        out.append(
            SpecPrompt(
                id=f"math/{i}", category="math", text=f"Question: {q}\nAnswer:", source="generated"
            )
        )
    return out


def _writing_prompts(n: int, rng: random.Random, data_dir: Path | None) -> list[SpecPrompt]:
    path = builtin.path(builtin.TINYSHAKESPEARE, data_dir)
    if path.is_file():
        text = builtin.read_text(path)
        start = int(len(text) * 0.9)  # the held-out last 10% (the usual validation split)
        held = text[start:]
        out = []
        for i in range(n):
            s = rng.randrange(0, len(held) - 800)
            blank = held.find("\n\n", s)
            s = blank + 2 if blank >= 0 else s  # start at a speech
            out.append(
                SpecPrompt(
                    id=f"writing/{i}",
                    category="writing",
                    text=held[s : s + 400].rsplit("\n", 1)[0] + "\n",
                    source=f"tinyshakespeare/input.txt@{start + s}",
                )
            )
        return out
    docs = [(f, d) for f, _, d in _stdlib_functions() if len(d) > 120]  # English prose
    if not docs:
        raise ValueError("no tinyshakespeare and no standard-library docstrings for writing")
    picks = rng.sample(range(len(docs)), min(n, len(docs)))
    return [
        SpecPrompt(
            id=f"writing/{i}",
            category="writing",
            text=docs[j][1][:300],
            source=f"stdlib/{docs[j][0]} docstring",
        )
        for i, j in enumerate(picks)
    ]


_CHAT_REQUESTS = (
    "Explain what a {thing} is to a ten-year-old.",
    "Write a short, friendly note to {name} about the {thing}.",
    "Give me three tips for taking care of a {thing}.",
    "What is the difference between a {thing} and a {other}?",
    "Summarise the history of the {thing} in two sentences.",
    "How do I write a Python function that sorts a list of {thing}s by name?",
)
_NAMES = ("Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana")
_THINGS = ("bicycle", "garden", "telescope", "violin", "kettle", "library", "lighthouse", "robot")


def _chat_prompts(n: int, rng: random.Random) -> list[SpecPrompt]:
    out = []
    for i in range(n):
        thing, other = rng.sample(_THINGS, 2)
        req = _CHAT_REQUESTS[i % len(_CHAT_REQUESTS)]
        user = req.format(thing=thing, other=other, name=rng.choice(_NAMES))
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
        out.append(
            SpecPrompt(id=f"chat/{i}", category="chat", text=render(msgs), source="generated")
        )
    return out


_FRUITS = ("apple", "banana", "cherry", "date", "elderberry", "fig", "grape", "kiwi", "lemon")


def _repetitive_prompts(n: int, rng: random.Random) -> list[SpecPrompt]:
    """Regular structures whose continuation is predictable: numbered lists, markdown tables,
    arithmetic sequences and CSV rows with incrementing fields."""
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            items = [rng.choice(_FRUITS) for _ in range(6)]
            text = "Shopping list:\n" + "".join(f"{j + 1}. {x}\n" for j, x in enumerate(items))
        elif kind == 1:
            base = rng.randint(1, 50)
            rows = "".join(f"| {j} | item_{base + j} | {10 * (base + j)} |\n" for j in range(1, 7))
            text = "| id | name | price |\n|----|------|-------|\n" + rows
        elif kind == 2:
            a, d = rng.randint(0, 20), rng.randint(2, 9)
            text = "Sequence: " + ", ".join(str(a + d * j) for j in range(10)) + ","
        else:
            day = rng.randint(1, 9)
            text = "date,station,reading\n" + "".join(
                f"2024-03-{day + j:02d},station_{j % 3},{(j * 7) % 10}.{j}\n" for j in range(8)
            )
        out.append(
            SpecPrompt(id=f"repetitive/{i}", category="repetitive", text=text, source="generated")
        )
    return out


def build_prompts(
    *,
    data_dir: str | Path | None = None,
    per_category: int,
    prompt_format: str = "base",
    seed: int = 0,
    categories: Sequence[str] = CATEGORIES,
) -> list[SpecPrompt]:
    """`per_category` prompts of each category, deterministic for a seed and the data present
    (the category's own seeded RNG, so adding a category does not change the others).
    `data_dir`: None for the packaged GSM8K / tinyshakespeare, or a folder holding them.
    `prompt_format="chat"` renders every non-chat prompt as a user turn of the chat template
    followed by the assistant header (for post-trained models)."""
    if per_category < 1:
        raise ValueError(f"per_category must be >= 1, got {per_category}")
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    unknown = sorted(set(categories) - set(CATEGORIES))
    if unknown or not categories:
        raise ValueError(f"categories must be a non-empty subset of {CATEGORIES}, got {unknown}")
    data = Path(data_dir) if data_dir else None
    out: list[SpecPrompt] = []
    for cat in categories:
        rng = random.Random(f"spec_bench/{cat}/{seed}")
        if cat == "code":
            got = _code_prompts(per_category, rng)
        elif cat == "math":
            got = _math_prompts(per_category, rng, data)
        elif cat == "writing":
            got = _writing_prompts(per_category, rng, data)
        elif cat == "chat":
            got = _chat_prompts(per_category, rng)
        else:
            got = _repetitive_prompts(per_category, rng)
        if prompt_format == "chat" and cat != "chat":
            got = [
                SpecPrompt(
                    id=p.id,
                    category=p.category,
                    text=render([{"role": "user", "content": p.text}]),
                    source=p.source,
                )
                for p in got
            ]
        out += got
    return out


def encode_prompt(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    """BOS + the prompt's tokens, keeping the last `max_tokens - 1` when longer."""
    ids = tokenizer.encode(text, add_bos=True)
    return ids if len(ids) <= max_tokens else [ids[0], *ids[-(max_tokens - 1) :]]


# ---------------------------------------------------------------------- config
@dataclass(kw_only=True)
class SpecBenchConfig:
    """What `run_spec_bench` measures (defaults: the SPEED-Bench protocol at toy scale)."""

    draft_len: int = 7  # fixed draft length K (SPEED-Bench)
    new_tokens: int = 64  # generated tokens per prompt (no EOS)
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    prompts_per_category: int = 8
    categories: list[str] = field(default_factory=lambda: list(CATEGORIES))
    prompt_format: str = "base"  # "base" (plain text) or "chat" (every prompt as a user turn)
    max_prompt_tokens: int = 256
    seed: int = 0
    timing: bool = True  # plain vs speculative engine throughput / latency
    timing_batch_size: int = 1  # concurrent requests per engine group
    timing_repeats: int = 1
    bootstrap_iters: int = 1000

    def validate(self) -> SpecBenchConfig:
        if not 1 <= self.draft_len <= MAX_DRAFT_LEN:
            raise ValueError(f"draft_len must be in [1, {MAX_DRAFT_LEN}], got {self.draft_len}")
        for name in (
            "new_tokens",
            "prompts_per_category",
            "max_prompt_tokens",
            "timing_batch_size",
            "timing_repeats",
            "bootstrap_iters",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.new_tokens < 2:
            raise ValueError("new_tokens must be >= 2 (the first token comes from the prefill)")
        if not self.temperatures or min(self.temperatures) < 0:
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        if len(set(self.temperatures)) != len(self.temperatures):
            raise ValueError(f"temperatures repeat: {self.temperatures}")
        if self.max_prompt_tokens < 2:
            raise ValueError("max_prompt_tokens must be >= 2 (BOS and one prompt token)")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}")
        unknown = sorted(set(self.categories) - set(CATEGORIES))
        if unknown or not self.categories:
            raise ValueError(f"categories must be a non-empty subset of {CATEGORIES}")
        return self


def temperature_tag(t: float) -> str:
    """Metric-name tag of a temperature: `greedy` for 0, else `T<t>` (T1, T0.7)."""
    return "greedy" if t <= 0 else f"T{t:g}"


# ---------------------------------------------------------------------- statistics
def acceptance_summary(
    stats: Sequence[SpecStats], *, iters: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """Merged acceptance of many requests (`merge_stats`: tokens per verify step and the rate
    at each draft position, ratios of sums) with bootstrap standard errors over requests."""
    if not stats:
        raise ValueError("no requests to summarise")
    merged = merge_stats(list(stats))
    k = merged["draft_len"]
    emitted = [s.accepted + s.steps for s in stats]
    steps = [s.steps for s in stats]
    se_pos = []
    for i in range(k):
        acc = [s.accepted_at[i] if i < s.draft_len else 0 for s in stats]
        dr = [s.drafted_at[i] if i < s.draft_len else 0 for s in stats]
        se_pos.append(bootstrap_ratio_stderr(acc, dr, iters=iters, seed=seed) if sum(dr) else 0.0)
    drafted = [sum(s.drafted_at[i] for s in stats if i < s.draft_len) for i in range(k)]
    return {
        "draft_len": k,
        "requests": len(stats),
        "steps": merged["steps"],
        "accepted_tokens": merged["accepted_tokens"],
        "drafted_at": drafted,
        "acceptance_length": merged["acceptance_length"],
        "acceptance_length_se": bootstrap_ratio_stderr(emitted, steps, iters=iters, seed=seed),
        "acceptance_by_position": merged["acceptance_by_position"],
        "acceptance_by_position_se": se_pos,
    }


def mean_over_categories(per_cat: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """SPEED-Bench's "Average": the mean of the category acceptance lengths, with the standard
    error of a mean of independent estimates, sqrt(sum se_c^2) / C (NaN if any is NaN)."""
    vals = [s["acceptance_length"] for s in per_cat.values()]
    ses = [s["acceptance_length_se"] for s in per_cat.values()]
    mean = sum(vals) / len(vals)
    if any(math.isnan(x) for x in ses):
        return mean, float("nan")
    return mean, math.sqrt(sum(x * x for x in ses)) / len(vals)


# ---------------------------------------------------------------------- measurement
@dataclass(kw_only=True)
class PromptRun:
    """One prompt decoded speculatively at one temperature."""

    prompt: SpecPrompt
    temperature: float
    stats: SpecStats
    tokens: list[int]
    greedy_match: bool | None = None  # temperature 0: == plain greedy decoding
    first_mismatch: int | None = None

    @property
    def distinct_4grams(self) -> float:
        """Share of distinct token 4-grams in the continuation: near 0 for an output stuck in a
        loop, whose drafts are trivially accepted (small greedy models loop; such acceptance
        lengths say little about the head)."""
        grams = [tuple(self.tokens[i : i + 4]) for i in range(len(self.tokens) - 3)]
        return len(set(grams)) / len(grams) if grams else 1.0


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def measure_prompts(
    model: HybridLM,
    tokenizer: Any,
    prompts: Sequence[SpecPrompt],
    cfg: SpecBenchConfig,
    *,
    progress: bool = False,
) -> list[PromptRun]:
    """Speculative decoding of every prompt at every temperature (seed `cfg.seed + index`,
    the index of the prompt in `prompts`), and at temperature 0 the plain greedy reference."""
    from rich.progress import Progress

    device = model.embeddings.weight.device
    runs: list[PromptRun] = []
    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task("spec_bench acceptance", total=len(prompts) * len(cfg.temperatures))
        for i, p in enumerate(prompts):
            ids = encode_prompt(tokenizer, p.text, cfg.max_prompt_tokens)
            x_1L = torch.tensor([ids], dtype=torch.long, device=device)
            for t in cfg.temperatures:
                out_1N, st = speculative_generate(
                    model,
                    x_1L,
                    cfg.new_tokens,
                    draft_len=cfg.draft_len,
                    temperature=t,
                    seed=cfg.seed + i,
                )
                run = PromptRun(prompt=p, temperature=t, stats=st, tokens=out_1N[0].tolist())
                if t <= 0:
                    ref = generate(model, x_1L, cfg.new_tokens)[0].tolist()
                    run.first_mismatch = _first_mismatch(run.tokens, ref)
                    run.greedy_match = run.first_mismatch is None
                runs.append(run)
                bar.advance(job)
    return runs


def _run_engine(
    model: HybridLM, tokenizer: Any, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[dict[str, float]], list[list[int]], float]:
    """All `prompts` submitted at once to a fresh engine (no prefix cache, so repeats do not
    reuse each other's prefills); per request (TTFT, ITL, tokens), the tokens, the wall time."""
    engine = Engine(model, tokenizer, max_batch_size=len(prompts), prefix_cache_size=0)
    t0 = time.perf_counter()
    rids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.delta_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
            tokens[o.request_id] = o.token_ids
    wall = time.perf_counter() - t0
    per = []
    for r in rids:
        n = len(tokens.get(r, []))
        itl = (last[r] - first[r]) / (n - 1) if n > 1 else float("nan")
        per.append({"ttft_s": first[r] - t0 if r in first else wall, "itl_s": itl, "tokens": n})
    return per, [tokens.get(r, []) for r in rids], wall


@torch.no_grad()
def time_engine(
    model: HybridLM,
    tokenizer: Any,
    prompt_ids: Sequence[list[int]],
    *,
    new_tokens: int,
    draft_len: int,
    batch_size: int = 1,
    repeats: int = 1,
    progress: bool = False,
) -> dict[str, Any]:
    """Plain vs speculative greedy decoding in the `Engine`, interleaved: for every group of
    `batch_size` prompts and repeat, both modes run back to back, in alternating order. Returns
    per mode the tokens/s (all tokens / all wall time), median TTFT and median ITL over
    requests, the speculative / plain ratios, and how many requests' greedy tokens differ."""
    from rich.progress import Progress

    if not prompt_ids:
        raise ValueError("no prompts to time")
    modes = {
        "plain": SamplingParams(max_tokens=new_tokens, ignore_eos=True),
        "speculative": SamplingParams(
            max_tokens=new_tokens, ignore_eos=True, speculative=draft_len
        ),
    }
    warm = [list(prompt_ids[0][:8])]
    for sp in modes.values():  # warm-up of both paths (allocator, first-call overheads)
        _run_engine(
            model,
            tokenizer,
            warm,
            SamplingParams(max_tokens=4, ignore_eos=True, speculative=sp.speculative),
        )
    groups = [list(prompt_ids[i : i + batch_size]) for i in range(0, len(prompt_ids), batch_size)]
    per: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    wall = dict.fromkeys(modes, 0.0)
    toks = dict.fromkeys(modes, 0)
    mismatches = 0
    order = list(modes)
    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task("spec_bench engine timing", total=len(groups) * repeats)
        for r in range(repeats):
            for g, group in enumerate(groups):
                outs = {}
                for m in order if (g + r) % 2 == 0 else order[::-1]:
                    reqs, outs[m], secs = _run_engine(model, tokenizer, group, modes[m])
                    per[m] += reqs
                    wall[m] += secs
                    toks[m] += sum(x["tokens"] for x in reqs)
                mismatches += sum(
                    a != b for a, b in zip(outs["plain"], outs["speculative"], strict=True)
                )
                bar.advance(job)

    def med(m: str, key: str) -> float:
        vals = [x[key] for x in per[m] if not math.isnan(x[key])]
        return statistics.median(vals) if vals else float("nan")

    res: dict[str, Any] = {"requests": len(prompt_ids) * repeats, "batch_size": batch_size}
    for m in modes:
        res[m] = {
            "tokens": toks[m],
            "wall_s": wall[m],
            "tokens_per_s": toks[m] / wall[m],
            "ttft_s": med(m, "ttft_s"),
            "itl_s": med(m, "itl_s"),
        }
    p, s = res["plain"], res["speculative"]
    res["speedup"] = s["tokens_per_s"] / p["tokens_per_s"]
    res["ttft_ratio"] = s["ttft_s"] / p["ttft_s"]
    res["itl_ratio"] = s["itl_s"] / p["itl_s"]
    res["greedy_mismatches"] = mismatches
    return res


@dataclass(kw_only=True)
class SpecBenchResult:
    """Acceptance by temperature tag and category (`acceptance_summary` dicts), the category
    mean and pooled figures, the greedy-equality counts, the engine timing and the runs."""

    config: SpecBenchConfig
    by_category: dict[str, dict[str, dict[str, Any]]]  # tag -> category -> summary
    overall: dict[str, dict[str, Any]]  # tag -> {mean, mean_se, pooled summary}
    greedy_checked: int
    greedy_mismatches: int
    timing: dict[str, Any] | None
    runs: list[PromptRun]

    def metrics(self) -> tuple[dict[str, float], dict[str, float]]:
        """Flat (metrics, standard errors) for the harness: names in the module docstring."""
        m: dict[str, float] = {}
        se: dict[str, float] = {}
        for tag, cats in self.by_category.items():
            ov = self.overall[tag]
            m[f"acceptance_length:{tag}"] = ov["mean"]
            se[f"acceptance_length:{tag}"] = ov["mean_se"]
            pooled = ov["pooled"]
            m[f"acceptance_length_pooled:{tag}"] = pooled["acceptance_length"]
            se[f"acceptance_length_pooled:{tag}"] = pooled["acceptance_length_se"]
            m[f"distinct_4grams:{tag}"], se[f"distinct_4grams:{tag}"] = ov["distinct"]
            for i, (v, e) in enumerate(
                zip(
                    pooled["acceptance_by_position"],
                    pooled["acceptance_by_position_se"],
                    strict=True,
                ),
                start=1,
            ):
                m[f"acceptance@{i}:{tag}"], se[f"acceptance@{i}:{tag}"] = v, e
            for cat, s in cats.items():
                m[f"acceptance_length:{tag}:{cat}"] = s["acceptance_length"]
                se[f"acceptance_length:{tag}:{cat}"] = s["acceptance_length_se"]
                for i, (v, e) in enumerate(
                    zip(s["acceptance_by_position"], s["acceptance_by_position_se"], strict=True),
                    start=1,
                ):
                    m[f"acceptance@{i}:{tag}:{cat}"], se[f"acceptance@{i}:{tag}:{cat}"] = v, e
        if self.greedy_checked:
            m["greedy_mismatches"] = float(self.greedy_mismatches)
        if self.timing is not None:
            t = self.timing
            m["engine_greedy_mismatches"] = float(t["greedy_mismatches"])
            for mode in ("plain", "speculative"):
                for key in ("tokens_per_s", "ttft_s", "itl_s"):
                    m[f"{key}:{mode}"] = t[mode][key]
            for key in ("speedup", "ttft_ratio", "itl_ratio"):
                m[key] = t[key]
        return m, se

    def samples(self) -> list[dict[str, Any]]:
        """Per (prompt, temperature) rows for samples/spec_bench.jsonl."""
        return [
            {
                "id": r.prompt.id,
                "category": r.prompt.category,
                "source": r.prompt.source,
                "temperature": r.temperature,
                "steps": r.stats.steps,
                "accepted": r.stats.accepted,
                "accepted_at": r.stats.accepted_at,
                "drafted_at": r.stats.drafted_at,
                "acceptance_length": r.stats.acceptance_length,
                "greedy_match": r.greedy_match,
                "first_mismatch": r.first_mismatch,
                "num_tokens": len(r.tokens),
                "distinct_4grams": r.distinct_4grams,
            }
            for r in self.runs
        ]


def run_spec_bench(
    model: HybridLM,
    tokenizer: Any,
    prompts: Sequence[SpecPrompt],
    cfg: SpecBenchConfig,
    *,
    progress: bool = False,
) -> SpecBenchResult:
    """Acceptance by category and temperature, greedy equality and (cfg.timing) engine speed."""
    cfg.validate()
    model.check_drafter("spec_bench")
    if not prompts:
        raise ValueError("no prompts")
    was_training = model.training
    model.eval()
    try:
        runs = measure_prompts(model, tokenizer, prompts, cfg, progress=progress)
        timing = None
        if cfg.timing:
            ids = [encode_prompt(tokenizer, p.text, cfg.max_prompt_tokens) for p in prompts]
            timing = time_engine(
                model,
                tokenizer,
                ids,
                new_tokens=cfg.new_tokens,
                draft_len=cfg.draft_len,
                batch_size=cfg.timing_batch_size,
                repeats=cfg.timing_repeats,
                progress=progress,
            )
    finally:
        model.train(was_training)
    cats = list(dict.fromkeys(p.category for p in prompts))
    by_cat: dict[str, dict[str, dict[str, Any]]] = {}
    overall: dict[str, dict[str, Any]] = {}
    for t in cfg.temperatures:
        tag = temperature_tag(t)
        mine = [r for r in runs if r.temperature == t]
        by_cat[tag] = {
            c: acceptance_summary(
                [r.stats for r in mine if r.prompt.category == c],
                iters=cfg.bootstrap_iters,
                seed=cfg.seed,
            )
            for c in cats
        }
        mean, mean_se = mean_over_categories(by_cat[tag])
        pooled = acceptance_summary(
            [r.stats for r in mine], iters=cfg.bootstrap_iters, seed=cfg.seed
        )
        distinct = mean_stderr([r.distinct_4grams for r in mine])
        overall[tag] = {"mean": mean, "mean_se": mean_se, "pooled": pooled, "distinct": distinct}
    greedy = [r for r in runs if r.greedy_match is not None]
    return SpecBenchResult(
        config=cfg,
        by_category=by_cat,
        overall=overall,
        greedy_checked=len(greedy),
        greedy_mismatches=sum(not r.greedy_match for r in greedy),
        timing=timing,
        runs=runs,
    )


# ---------------------------------------------------------------------- harness task
@dataclass(kw_only=True)
class SpecBenchTask(Task):
    """`spec_bench` in `hybridlm eval`: `limit` is the number of prompts per category."""

    name: str = "spec_bench"
    data_dir: Path | None = None  # None: the packaged data sets
    config: SpecBenchConfig
    kind: str = "speculative"

    def run(self, runner: EvalRunner, limit: int | None = None) -> TaskResult:
        if limit is not None and limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        cfg = self.config
        if limit is not None:
            cfg = dataclasses.replace(cfg, prompts_per_category=limit)
        cfg.validate()
        prompts = build_prompts(
            data_dir=self.data_dir,
            per_category=cfg.prompts_per_category,
            prompt_format=cfg.prompt_format,
            seed=cfg.seed,
            categories=cfg.categories,
        )
        res = run_spec_bench(runner.model, runner.tokenizer, prompts, cfg, progress=runner.progress)
        metrics, stderr = res.metrics()
        notes = []
        if res.greedy_mismatches:
            notes.append(
                f"{res.greedy_mismatches}/{res.greedy_checked} greedy speculative outputs differ"
                " from plain greedy decoding"
            )
        return TaskResult(
            metrics=metrics,
            stderr=stderr,
            num_items=len(prompts),
            samples=res.samples(),
            stderr_method=(
                "bootstrap over prompts of the ratio of sums (per category and pooled); category"
                " mean: sqrt(sum se_c^2) / C; none for counts and engine timing"
            ),
            notes=notes,
        )


@register_task("spec_bench")
def _spec_bench(data_dir: Path | None, **kw: Any) -> Task:
    """SPEED-Bench protocol: draft length 7, greedy and T=1; `max_tokens` new tokens each."""
    return SpecBenchTask(
        data_dir=data_dir,
        config=SpecBenchConfig(
            new_tokens=int(kw.get("max_tokens", 64)),
            prompt_format=kw.get("prompt_format", "base"),
            seed=int(kw.get("seed", 0)),
        ),
    )


# ---------------------------------------------------------------------- plot
def plot_spec_bench(metrics_path: str | Path, png: str | Path) -> Path | None:
    """Acceptance by draft position, one line per category (and the pooled overall), one panel
    per temperature, with standard-error bars; from the newest `spec_bench` rows of each model
    in a harness metrics.jsonl. Returns None when the file has no such rows."""
    plt = pyplot()
    rows = [
        r
        for r in read_metrics(metrics_path)
        if r.get("kind") == "eval" and str(r.get("metric", "")).startswith("acceptance@")
    ]
    if not rows:
        return None
    newest: dict[str, float] = {}
    for r in rows:
        newest[r["model"]] = max(newest.get(r["model"], 0.0), r.get("time", 0.0))
    rows = [r for r in rows if r.get("time", 0.0) == newest[r["model"]]]
    # curves[(model, tag, category)][position] = (value, stderr)
    curves: dict[tuple[str, str, str], dict[int, tuple[float, float | None]]] = {}
    for r in rows:
        pos, *rest = r["metric"].removeprefix("acceptance@").split(":")
        tag, cat = rest[0], (rest[1] if len(rest) > 1 else "overall")
        if r["value"] is not None:
            curves.setdefault((r["model"], tag, cat), {})[int(pos)] = (r["value"], r["stderr"])
    tags = sorted({k[1] for k in curves}, key=lambda t: (t != "greedy", t))
    models = sorted({k[0] for k in curves})
    fig, axes = plt.subplots(1, len(tags), figsize=(5.5 * len(tags), 4.2), squeeze=False)
    order = {c: i for i, c in enumerate([*CATEGORIES, "overall"])}
    for ax, tag in zip(axes[0], tags, strict=True):
        keys = sorted(curves, key=lambda k: (k[0], order.get(k[2], len(order)), k[2]))
        for model, t, cat in keys:
            pts = curves[(model, t, cat)]
            if t != tag:
                continue
            xs = sorted(pts)
            err = [pts[x][1] or 0.0 for x in xs]
            label = cat if len(models) == 1 else f"{model} {cat}"
            style = {"color": "k", "lw": 2.2} if cat == "overall" else {}
            ax.errorbar(
                xs,
                [pts[x][0] for x in xs],
                yerr=err,
                marker="o",
                ms=3,
                capsize=2,
                label=label,
                **style,
            )
        shown = "greedy (T=0)" if tag == "greedy" else tag.replace("T", "T=", 1)
        ax.set(
            title=f"{shown}: acceptance by draft position",
            xlabel="draft position",
            ylabel="share of drafts accepted",
            ylim=(-0.02, 1.02),
        )
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, png, dpi=120)
    return Path(png)
