"""Where a decoded token's time goes: per block type, per op kind, Python overhead vs kernel time,
and the bandwidth each GEMV reaches.

    python benchmarks/decode_profile.py                       # tiny-super and super-150m
    python benchmarks/decode_profile.py --models super-150m --tokens 64

For each model (random weights, fp32, batch 1, MTP off) and each decode path (`native`: the
default, with `ops.native`; `torch`: the kernels off), after a 16-token prefill and a warm-up,
`--tokens` one-token forwards are timed three ways:

- wall time per token, split by block type with forward hooks on the blocks (a hook on a Block
  leaves its mixer's fast path on), the remainder being embedding + final norm + LM head;
- torch.profiler's self time of every aten op (count per token and microseconds per token);
  the native kernels are ctypes calls that the profiler does not see, so they are timed by
  wrapping `ops.native`'s functions, each call's weight bytes giving its bandwidth;
- Python and dispatch overhead = wall - aten self time - native kernel time (three passes over
  the same steps: the wall and native times of the timed pass, the aten time of the profiled
  one; the machine's noise between passes shows up here).

The copy bandwidth (read + written, STREAM's convention) and read bandwidth are measured in the
same run (`decode.measure_bandwidth`). Rows go to `OUT/metrics.jsonl`.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import (  # noqa: E402
    active_weight_bytes,
    bench_config,
    measure_bandwidth,
    median_seconds,
)
from hybridlm import HybridLM  # noqa: E402
from hybridlm.model.cache import HybridCache  # noqa: E402
from hybridlm.ops import native  # noqa: E402

LETTERS = {"M": "Mamba-2", "*": "attention", "E": "MoE", "-": "MLP"}


class NativeTimer:
    """Wraps `ops.native.linear/experts/mamba_step`: time and weight bytes per (kind, shape)."""

    def __init__(self) -> None:
        self.calls: dict[tuple, list[float]] = collections.defaultdict(list)
        self.bytes: dict[tuple, int] = {}
        self._orig = {}

    def __enter__(self) -> NativeTimer:
        for name in ("linear", "experts", "mamba_step"):
            fn = getattr(native, name)
            self._orig[name] = fn
            setattr(native, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(native, name, fn)

    def _wrap(self, name, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            dt = time.perf_counter() - t0
            if name == "linear":
                w = args[1]
                key = ("linear", tuple(w.shape))
                nbytes = w.numel() * 4
            elif name == "experts":
                idx, up, down = args[1], args[3], args[4]
                chosen = len(set(idx.reshape(-1).tolist()))
                key = ("experts", tuple(up.shape), int(idx.numel()))
                nbytes = chosen * (up[0].numel() + down[0].numel()) * 4
            else:
                ssm = args[2]
                key = ("mamba_step", tuple(ssm.shape))
                nbytes = 2 * ssm.numel() * 4  # the state read and written
            self.calls[key].append(dt)
            self.bytes[key] = nbytes
            return out

        return timed

    def total(self) -> float:
        return sum(sum(v) for v in self.calls.values())


def profile_model(name: str, cfg, path: str, tokens: int, seed: int = 0) -> dict:
    model = HybridLM(cfg, seed=seed).eval()
    cache = HybridCache.for_pattern(cfg.pattern)
    block_time = collections.defaultdict(float)
    starts: dict[int, float] = {}

    def pre(mod, _args, i=None):
        starts[i] = time.perf_counter()

    def post(mod, _args, _out, i=None):
        block_time[LETTERS[mod.letter]] += time.perf_counter() - starts[i]

    with torch.no_grad(), native.enabled(path == "native"):
        model(torch.randint(0, cfg.vocab_size, (1, 16)), cache=cache)
        tok = torch.tensor([[7]])
        for _ in range(8):
            model(tok, cache=cache)
        # 1) wall time and per block type
        handles = []
        for i, block in enumerate(model.layers):
            handles.append(block.register_forward_pre_hook(lambda m, a, i=i: pre(m, a, i)))
            handles.append(block.register_forward_hook(lambda m, a, o, i=i: post(m, a, o, i)))
        walls = []
        for _ in range(tokens):
            t0 = time.perf_counter()
            model(tok, cache=cache)
            walls.append(time.perf_counter() - t0)
        for h in handles:
            h.remove()
        wall = sum(walls)
        # 2) native kernel time (ctypes calls), separately: the wrappers add a little time
        timer = NativeTimer()
        with timer:
            t0 = time.perf_counter()
            for _ in range(tokens):
                model(tok, cache=cache)
            wall_timed = time.perf_counter() - t0
        # 3) aten self time per op
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(tokens):
                model(tok, cache=cache)
    ops = sorted(
        (
            (e.key, e.count / tokens, e.self_cpu_time_total / tokens)
            for e in prof.key_averages()
            if e.key.startswith("aten::")
        ),
        key=lambda r: -r[2],
    )
    aten_us = sum(r[2] for r in ops)
    aten_calls = sum(r[1] for r in ops)
    native_s = timer.total() / tokens
    per_token = wall / tokens
    blocks = {k: v / tokens for k, v in block_time.items()}
    gemv = []
    for key, times in sorted(timer.calls.items(), key=lambda kv: -sum(kv[1])):
        t = statistics.median(times)
        gemv.append(
            {
                "kind": key[0],
                "shape": list(key[1]),
                "calls_per_token": len(times) / tokens,
                "us_per_call": t * 1e6,
                "bytes_per_call": timer.bytes[key],
                "gb_s": timer.bytes[key] / t / 1e9,
            }
        )
    return {
        "model": name,
        "path": path,
        "tokens": tokens,
        "ms_per_token": per_token * 1e3,
        "ms_per_token_with_timers": wall_timed / tokens * 1e3,
        "blocks_ms": {k: v * 1e3 for k, v in blocks.items()},
        "outside_blocks_ms": (per_token - sum(blocks.values())) * 1e3,
        "aten_ops_per_token": aten_calls,
        "aten_self_ms": aten_us / 1e3,
        "native_ms": native_s * 1e3,
        # the timed pass's wall minus its native time minus the profiled pass's aten time
        "overhead_ms": (wall_timed / tokens - native_s) * 1e3 - aten_us / 1e3,
        "top_ops": [{"op": k, "calls": c, "us": u} for k, c, u in ops[:8]],
        "kernels": gemv,
        "active_weight_bytes": active_weight_bytes(model),
    }


def speculative_costs(name: str, cfg, draft_lens=range(1, 8), repeats: int = 30) -> dict:
    """The costs a speculative round is made of, measured on random weights with an MTP head
    `*E` (acceptance does not change them): one plain decode step, one verification forward of
    k + 1 tokens (with the per-position Mamba history and a rewind of half the drafts, as in a
    round), one MTP draft position. A round with draft length k costs about
    verify(k + 1) + k * draft and emits the acceptance length AL, so the speed-up over plain
    decoding is AL * step / (verify(k + 1) + k * draft) (Python bookkeeping of a round aside)."""
    from hybridlm.infer.speculative import _mtp

    cfg = type(cfg).from_dict(cfg.to_dict())
    cfg.mtp.pattern, cfg.mtp.depth = "*E", 1
    model = HybridLM(cfg, seed=0).eval()
    cache = HybridCache.for_pattern(cfg.pattern)
    mtp_cache = HybridCache.for_pattern(cfg.mtp.pattern)

    def median_ms(fn) -> float:
        return median_seconds(fn, repeats) * 1e3

    with torch.no_grad():
        pre = model(torch.randint(0, cfg.vocab_size, (1, 16)), cache=cache, return_hidden=True)
        _mtp(model, pre.hidden, torch.randint(0, cfg.vocab_size, (1, 16)), mtp_cache)
        snap = cache.snapshot()
        tok = torch.tensor([[7]])

        def step() -> None:
            cache.restore(snap)
            model(tok, cache=cache)

        def verify(j: int):
            seq = torch.arange(7, 7 + j)[None]

            def run() -> None:
                cache.restore(snap)
                cache.record_history(True)
                model(seq, cache=cache, return_hidden=True)
                cache.record_history(False)
                cache.rewind(j // 2)

            return run

        h = pre.hidden[:, -1:]

        def draft() -> None:
            _mtp(model, h, tok, mtp_cache)
            mtp_cache.truncate(mtp_cache.seen_tokens - 1)

        step_ms, draft_ms = median_ms(step), median_ms(draft)
        verify_ms = {k: median_ms(verify(k + 1)) for k in draft_lens}
    return {
        "model": name,
        "kind": "speculative_costs",
        "step_ms": step_ms,
        "draft_ms": draft_ms,
        "verify_ms": verify_ms,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny-super,super-150m")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default="runs/decode-profile")
    args = p.parse_args(argv)
    if args.tokens < 1:
        p.error("--tokens must be positive")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = sorted(set(models) - {"tiny-super", "super-150m"})
    if bad or not models:
        p.error(f"--models takes tiny-super and/or super-150m; got {args.models!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = measure_bandwidth()
    print(
        f"[profile] {torch.get_num_threads()} threads; copy bandwidth {bw['copy'] / 1e9:.1f}"
        f" GB/s (read + written), read {bw['read'] / 1e9:.1f} GB/s; native: {native.status()}"
    )
    rows = []
    for name in models:
        cfg = bench_config(name)
        for path in ("native", "torch"):
            r = profile_model(name, cfg, path, args.tokens)
            r["copy_bw"], r["read_bw"] = bw["copy"], bw["read"]
            rows.append(r)
            limit_ms = r["active_weight_bytes"] / bw["copy"] * 1e3
            blocks = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["blocks_ms"].items()))
            print(
                f"[profile] {name} {path}: {r['ms_per_token']:.2f} ms/token"
                f" (bandwidth limit {limit_ms:.2f} ms: {100 * limit_ms / r['ms_per_token']:.0f}%)"
                f" | blocks ms: {blocks}; embedding + final norm + LM head"
                f" {r['outside_blocks_ms']:.2f}"
                f" | native kernels {r['native_ms']:.2f} ms, aten ops {r['aten_self_ms']:.2f} ms"
                f" ({r['aten_ops_per_token']:.0f} ops), Python/dispatch {r['overhead_ms']:.2f} ms"
            )
            tops = ", ".join(
                f"{o['op'][6:]} {o['calls']:.0f}x {o['us']:.0f}us" for o in r["top_ops"]
            )
            print(f"[profile]   top aten ops per token: {tops}")
            for k in r["kernels"][:8]:
                print(
                    f"[profile]   {k['kind']} {k['shape']}: {k['calls_per_token']:.1f}/token,"
                    f" {k['us_per_call']:.0f} us, {k['bytes_per_call'] / MB:.2f} MB ->"
                    f" {k['gb_s']:.1f} GB/s"
                )
        c = speculative_costs(name, cfg)
        rows.append(c)
        ver = " ".join(f"{k + 1}:{v / c['step_ms']:.2f}" for k, v in c["verify_ms"].items())
        be = " ".join(
            f"k={k}:{(v + k * c['draft_ms']) / c['step_ms']:.2f}" for k, v in c["verify_ms"].items()
        )
        print(
            f"[profile] {name} speculative costs, in plain decode steps ({c['step_ms']:.2f} ms):"
            f" one MTP draft {c['draft_ms'] / c['step_ms']:.2f} | verify of J tokens {ver}"
            f" | a round with k drafts (= the acceptance length needed to break even) {be}"
        )
    with open(out / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {out / 'metrics.jsonl'}")
    return 0


MB = 1e6

if __name__ == "__main__":
    raise SystemExit(main())
