"""Inference benchmark: batch-1 decode vs transformers, MTP speculative decoding, cache memory.

    python benchmarks/decode.py                          # all three sections, runs/decode-bench/
    python benchmarks/decode.py --only decode --new-tokens 64 --models super-150m
    python benchmarks/decode.py --only speculative --retrain --train-steps 400
    python benchmarks/decode.py --only memory --measure-to 16384

Every figure is measured in one run and printed as one line; rows go to `OUT/metrics.jsonl`
(a rerun of a section replaces that section's rows) and the PNGs are rendered from that file.

decode       tiny-super and tiny-olmo (random weights, MTP off: transformers' NemotronH has no
             MTP module) and super-150m (`memory_bound_config`: ~150M active parameters, d 1024,
             vocab 32000, whose batch-1 decode is bound by memory bandwidth), converted with
             `interop.hf` so transformers holds identical weights. Greedy decode of
             `--new-tokens` after a `--prompt-len` random prompt, batch 1, fp32;
             `infer.generate.generate` (default path: the native kernels of `ops.native`),
             the same with the kernels off (the pure-torch references) and transformers'
             `model.generate` (its own cache, no eos), interleaved repeats, wall time of the
             whole call (prefill included), median tok/s each; also hybridlm with
             `compile_decode()` (torch.compile of the torch decode steps; compiled during the
             warm-up, --no-compile skips it). The bandwidth limit is the weight bytes a token
             reads (`active_weight_bytes`) over the copy bandwidth measured before and after
             (`measure_bandwidth`). Exits 1 if any greedy tokens differ. transformers runs its
             pure-torch Mamba path on CPU (mamba_ssm / causal_conv1d are CUDA kernels).
speculative  a byte-level Super-shaped model with a "*E" MTP head trained on tinyshakespeare
             (`_tiny_train.py`; saved under OUT/spec-model and reused unless --retrain). On prompts
             from the held-out last 10% of the text: greedy `speculative_generate(draft_len=k)`
             vs greedy `generate`, outputs compared token for token, acceptance length
             (tokens per verify step), per-position acceptance (share of drafts at position i
             accepted, i.e. with all earlier drafts), wall-time speedup; k = 1..7 sweep. The
             small model's greedy continuations loop, which flatters drafting, so each k is
             also measured on k+2-token continuations of `--real-contexts` held-out windows.
memory       backbone cache bytes per sequence vs context, hybrid vs an attention-only model of
             the same width, depth and attention config (pattern all '*'): computed from the
             config for the full-scale presets (KV bf16, Mamba state fp32), and measured for
             tiny-super (fp32) by chunked prefill through `HybridCache`, summing the real
             tensors (valid bytes, and allocated bytes: KV buffers double their capacity).
             Exits 1 if measured valid bytes != computed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybridlm import HybridLM, ModelConfig  # noqa: E402
from hybridlm.data import builtin  # noqa: E402
from hybridlm.eval.flow import attention_only  # noqa: E402
from hybridlm.eval.flow import cache_bytes as computed_bytes  # noqa: E402
from hybridlm.infer.generate import generate  # noqa: E402
from hybridlm.interop.hf import save_pretrained  # noqa: E402
from hybridlm.model.cache import HybridCache, KVState, MambaState  # noqa: E402
from hybridlm.presets import get_preset  # noqa: E402
from hybridlm.report.plot import save_figure  # noqa: E402

SECTIONS = ("decode", "speculative", "memory")
REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = builtin.path(builtin.TINYSHAKESPEARE)  # `.gz`; any UTF-8 text file works
FULL_SCALE = ("nemotron-3-super-120b-a12b", "nemotron-3.5-lightning-30b-a3b")
GiB, MiB = 2**30, 2**20


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _describe(cfg: ModelConfig) -> str:
    n = cfg.num_params()
    return (
        f"{len(cfg.pattern)} blocks {cfg.pattern}, d {cfg.d_model}, vocab {cfg.vocab_size}, "
        f"{n.total / 1e6:.1f}M params ({n.active / 1e6:.1f}M active)"
    )


# ====================================================================== 1. decode
def _pair(cfg: ModelConfig, seed: int):
    """(hybridlm model, transformers model) with identical fp32 weights."""
    from transformers import AutoModelForCausalLM

    ours = HybridLM(cfg, seed=seed).eval()
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, tmp)
        theirs = AutoModelForCausalLM.from_pretrained(tmp).eval()
    return ours, theirs


def _matching_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    return int((a[:n] == b[:n]).long().cumprod(0).sum()) if n else 0


def memory_bound_config() -> ModelConfig:
    """A ~150M-active-parameter hybrid whose batch-1 decode is bound by memory bandwidth on a
    CPU: tiny-super's pattern and proportions at d 1024 (Mamba-2 32 heads x 64, state 128;
    GQA 8 / 2 heads of 128; LatentMoE 32 experts top-4, latent 512, expert hidden 1024, shared
    expert 2048), vocab 32000, no MTP."""
    from hybridlm.config import AttentionConfig, MambaConfig, MoEConfig

    cfg = get_preset("tiny-super")
    cfg.d_model, cfg.vocab_size = 1024, 32000
    cfg.mamba = MambaConfig(num_heads=32, head_dim=64, state_size=128, n_groups=2, chunk_size=128)
    cfg.attention = AttentionConfig(num_heads=8, num_kv_heads=2, head_dim=128)
    cfg.moe = MoEConfig(
        num_experts=32,
        top_k=4,
        expert_hidden=1024,
        shared_expert_hidden=2048,
        latent_size=512,
        routed_scaling_factor=2.5,
    )
    cfg.mtp.pattern = ""
    return cfg


def active_weight_bytes(model: HybridLM) -> int:
    """Weight bytes one decoded token reads: every parameter, except one row of the embedding
    table and top_k / num_experts of each layer's routed experts (the MTP module excluded)."""
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            continue
        n = p.numel() * p.element_size()
        if name == "embeddings.weight":
            n = p.shape[1] * p.element_size()
        elif ".experts." in name:
            moe = model.config.moe
            n = n * moe.top_k // moe.num_experts
        total += n
    return total


def measure_bandwidth(mib: int = 256, repeats: int = 7) -> dict[str, float]:
    """Memory bandwidth in bytes/s, median of `repeats`, on initialised buffers far larger than
    the caches: "copy" counts bytes read + written (STREAM's convention) by `b.copy_(a)`,
    "read" the bytes read by `a.sum()`."""
    a = torch.randn(mib * MiB // 4)
    b = torch.randn_like(a)
    out = {}
    for name, fn, nbytes in (
        ("copy", lambda: b.copy_(a), 2 * a.numel() * 4),
        ("read", lambda: a.sum(), a.numel() * 4),
    ):
        out[name] = nbytes / median_seconds(fn, repeats)
    return out


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of `repeats` calls of `fn`, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def greedy_config(new_tokens: int):
    """transformers' `GenerationConfig` for exactly `new_tokens` greedy tokens (no eos)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        use_cache=True,
        eos_token_id=None,
        pad_token_id=0,
    )


def bench_decode_one(
    name: str,
    cfg: ModelConfig,
    *,
    new_tokens: int,
    prompt_len: int,
    repeats: int,
    seed: int = 0,
    compiled: bool = False,
) -> dict:
    """Greedy batch-1 decode timed for hybridlm's default path (native kernels where they
    qualify, `ops.native`), its pure-torch path (the kernels off: the references), and
    transformers on the same weights, interleaved. `compiled`: also a copy of the model with
    `compile_decode()` (torch.compile of the torch decode steps), skipped with a note if
    compilation fails. The machine's memory bandwidth is measured before and after."""
    from hybridlm.ops import native

    ours, theirs = _pair(cfg, seed)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=g)
    gen_cfg = greedy_config(new_tokens)
    mask = torch.ones_like(x)

    def run_theirs() -> torch.Tensor:
        with torch.no_grad():
            out = theirs.generate(x, attention_mask=mask, generation_config=gen_cfg)
        return out[:, prompt_len:]

    def run_torch() -> torch.Tensor:
        with native.enabled(False):
            return generate(ours, x, new_tokens)

    runners = {
        "hybridlm": lambda: generate(ours, x, new_tokens),
        "hybridlm-torch": run_torch,
        "transformers": run_theirs,
    }
    note = None
    if compiled:
        fast = HybridLM(cfg, seed=seed).eval().compile_decode()
        runners["hybridlm-compiled"] = lambda: generate(fast, x, new_tokens)
    bw = [measure_bandwidth()]
    load = [_loadavg()]
    tokens = {}
    for k, fn in list(runners.items()):  # warm-up (and compilation), and the tokens compared
        try:
            tokens[k] = fn()
        except Exception as err:  # inductor needs a working C++ toolchain
            if k != "hybridlm-compiled":
                raise
            note = f"compile_decode failed: {type(err).__name__}: {str(err)[:80]}"
            del runners[k]
    times: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(repeats):  # interleaved, alternating order, so machine noise hits both alike
        for k in list(runners)[:: 1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            runners[k]()
            times[k].append(time.perf_counter() - t0)
    bw.append(measure_bandwidth())
    load.append(_loadavg())
    b = tokens["transformers"][0]
    agree = {k: _matching_prefix(t[0], b) for k, t in tokens.items() if k != "transformers"}
    tps = {k: new_tokens / statistics.median(v) for k, v in times.items()}
    nbytes = active_weight_bytes(ours)
    copy_bw = statistics.median([m["copy"] for m in bw])
    read_bw = statistics.median([m["read"] for m in bw])
    return {
        "section": "decode",
        "model": name,
        "config": _describe(cfg),
        "new_tokens": new_tokens,
        "prompt_len": prompt_len,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "native": native.status(),
        "loadavg_1min": load,
        "tok_s": tps,
        "times_s": times,
        "ratio": tps["hybridlm"] / tps["transformers"],
        "ratio_torch": tps["hybridlm-torch"] / tps["transformers"],
        "ratio_compiled": tps["hybridlm-compiled"] / tps["transformers"]
        if "hybridlm-compiled" in tps
        else None,
        "compile_note": note,
        "active_weight_bytes": nbytes,
        "copy_bw": copy_bw,
        "read_bw": read_bw,
        "limit_tok_s": copy_bw / nbytes,
        "share_of_limit": tps["hybridlm"] * nbytes / copy_bw,
        "share_of_read_limit": tps["hybridlm"] * nbytes / read_bw,
        "tokens_agree": min(agree.values()),
        "tokens_agree_each": agree,
        "tokens_compared": len(b),
    }


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


MODELS = ("tiny-super", "tiny-olmo", "super-150m")


def bench_config(name: str) -> ModelConfig:
    """The config of one of MODELS, MTP off (transformers' NemotronH has no MTP module)."""
    if name == "super-150m":
        return memory_bound_config()
    cfg = get_preset(name)
    cfg.mtp.pattern = ""
    return cfg


def section_decode(args) -> tuple[list[dict], bool]:
    import transformers

    transformers.logging.set_verbosity_error()  # the CUDA-kernel fallback notices
    transformers.logging.disable_progress_bar()
    rows, ok = [], True
    for name in args.models:
        cfg = bench_config(name)
        row = bench_decode_one(
            name,
            cfg,
            new_tokens=args.new_tokens,
            prompt_len=args.prompt_len,
            repeats=args.repeats,
            compiled=not args.no_compile and any(c in cfg.pattern for c in "ME"),
        )
        rows.append(row)
        peer = "Olmo3" if name == "tiny-olmo" else "NemotronH"
        same = row["tokens_agree"] == row["tokens_compared"] == args.new_tokens
        ok &= same
        t = row["tok_s"]
        print(
            f"[decode] {name} ({row['config']}; MTP off, fp32, {row['threads']} threads), batch 1,"
            f" prompt {args.prompt_len}, {args.new_tokens} new tokens, median of {args.repeats},"
            f" load {row['loadavg_1min'][0]:.1f}/{row['loadavg_1min'][1]:.1f}:"
            f" hybridlm {t['hybridlm']:.1f} tok/s | transformers {peer}"
            f" {t['transformers']:.1f} tok/s | ratio {row['ratio']:.2f}x"
            f" | greedy tokens agree {row['tokens_agree']}/{row['tokens_compared']}"
            f" | hybridlm pure-torch path {t['hybridlm-torch']:.1f} tok/s"
            f" ({row['ratio_torch']:.2f}x)"
            + (
                f" | hybridlm compile_decode() {t['hybridlm-compiled']:.1f} tok/s,"
                f" ratio {row['ratio_compiled']:.2f}x"
                if row["ratio_compiled"] is not None
                else ""
            )
            + (f" | {row['compile_note']}" if row["compile_note"] else "")
        )
        print(
            f"[decode] {name} bandwidth limit: {row['active_weight_bytes'] / MiB:.1f} MiB of"
            f" weights per token / copy bandwidth {row['copy_bw'] / 1e9:.1f} GB/s ="
            f" {row['limit_tok_s']:.1f} tok/s; hybridlm at {100 * row['share_of_limit']:.0f}%"
            f" of it ({100 * row['share_of_read_limit']:.0f}% of the read-bandwidth limit,"
            f" {row['read_bw'] / 1e9:.1f} GB/s), pure-torch path at"
            f" {100 * t['hybridlm-torch'] * row['active_weight_bytes'] / row['copy_bw']:.0f}%"
        )
    return rows, ok


# ====================================================================== 2. speculative
def _merge(stats_list, k: int) -> dict:
    steps = sum(s.steps for s in stats_list)
    accepted = sum(s.accepted for s in stats_list)
    acc_at, dr_at = [0] * k, [0] * k
    for s in stats_list:
        for i, (a, d) in enumerate(zip(s.accepted_at, s.drafted_at, strict=True)):
            acc_at[i] += a
            dr_at[i] += d
    return {
        "steps": steps,
        "accepted": accepted,
        "acceptance_length": (accepted + steps) / max(steps, 1),
        "by_position": [a / d if d else 0.0 for a, d in zip(acc_at, dr_at, strict=True)],
    }


def _prompts(held: torch.Tensor, n: int, length: int) -> list[torch.Tensor]:
    """`n` prompts spread over the held-out text, each starting at a line start."""
    newline = ord("\n")
    out = []
    for i in range(n):
        s = int(i * (len(held) - length - 1) / max(n, 1))
        while s < len(held) - length - 1 and int(held[s]) != newline:
            s += 1
        out.append(held[s + 1 : s + 1 + length][None])
    return out


def section_speculative(args) -> tuple[list[dict], bool]:
    from _tiny_train import load_or_train, load_split, read_rows
    from hybridlm.infer.speculative import speculative_generate

    data = Path(args.data)
    if not data.is_file():
        print(f"[speculative] skipped: training text {data} not found (--data)")
        return [], True
    out = Path(args.out)
    ckpt = out / "spec-model"
    t0 = time.perf_counter()
    model, trained = load_or_train(
        ckpt,
        data,
        retrain=args.retrain,
        steps=args.train_steps,
        batch=args.train_batch,
        seq=args.train_seq,
        lr=args.lr,
        mtp_depth=args.mtp_depth,
        mtp_loss_weight=args.mtp_loss_weight,
        log=lambda s: print(s, flush=True),
    )
    cfg = model.config
    train_rows = read_rows(ckpt / "metrics.jsonl") if (ckpt / "metrics.jsonl").is_file() else []
    last = [r for r in train_rows if r["split"] == "train"][-1:] or [{}]
    held_last = [r for r in train_rows if r["split"] == "held_out"][-1:] or [{}]
    print(
        f"[train] {'trained' if trained else 'reused'} {ckpt} "
        f"({_describe(cfg)} + MTP {cfg.mtp.pattern!r} depth {cfg.mtp.depth}, "
        f"loss weight {cfg.mtp.loss_weight}): {last[0].get('step', '?')} steps, "
        f"{last[0].get('tokens', 0) / 1e6:.2f}M tokens"
        + (f" in {time.perf_counter() - t0:.0f} s" if trained else "")
        + f" | final train ce {last[0].get('ce', float('nan')):.3f}"
        f" mtp {last[0].get('mtp', float('nan')):.3f}"
        f" | held-out ce {held_last[0].get('ce', float('nan')):.3f}"
        f" mtp {held_last[0].get('mtp', float('nan')):.3f} (nats/byte)"
    )

    _, held = load_split(data)
    prompts = _prompts(held, args.prompts, args.spec_prompt_len)
    starts = torch.linspace(0, len(held) - args.spec_prompt_len - 1, args.real_contexts)
    contexts = [held[s : s + args.spec_prompt_len][None] for s in starts.long().tolist()]
    n, k0 = args.spec_new_tokens, args.draft_len
    generate(model, prompts[0][:, :8], 4)  # warm-up of both paths
    speculative_generate(model, prompts[0][:, :8], 8, draft_len=k0)
    # main figure: plain vs speculative at k0, interleaved repeats per prompt
    refs, t_plain, t_spec, stats0, same0 = [], [], [], [], 0
    for x in prompts:
        tp, ts = [], []
        for r in range(args.spec_repeats):
            for which in ("plain", "spec") if r % 2 == 0 else ("spec", "plain"):
                t = time.perf_counter()
                if which == "plain":
                    ref = generate(model, x, n)
                    tp.append(time.perf_counter() - t)
                else:
                    got, st = speculative_generate(model, x, n, draft_len=k0)
                    ts.append(time.perf_counter() - t)
        refs.append(ref)
        stats0.append(st)
        same0 += torch.equal(got, ref)
        t_plain.append(statistics.median(tp))
        t_spec.append(statistics.median(ts))
    plain_total, spec_total = sum(t_plain), sum(t_spec)
    m0 = _merge(stats0, k0)
    distinct = _distinct_ngrams([r[0].tolist() for r in refs], 8)
    rows = [
        {
            "section": "speculative",
            "kind": "main",
            "draft_len": k0,
            "prompts": len(prompts),
            "prompt_len": args.spec_prompt_len,
            "new_tokens": n,
            "plain_s": plain_total,
            "spec_s": spec_total,
            "speedup": plain_total / spec_total,
            "identical": same0,
            "distinct_8grams": distinct,
            **m0,
        }
    ]
    ok = same0 == len(prompts)
    pos = " ".join(f"{p:.2f}" for p in m0["by_position"])
    print(
        f"[speculative] k={k0}, {len(prompts)} held-out prompts x {n} new tokens, greedy, fp32:"
        f" acceptance length {m0['acceptance_length']:.2f} (target >= 2.5) | accepted by"
        f" position {pos} | plain {plain_total:.2f} s, speculative {spec_total:.2f} s,"
        f" speedup {plain_total / spec_total:.2f}x | outputs identical {same0}/{len(prompts)}"
    )
    # Greedy continuations of a small model fall into loops, which drafts predict easily, and
    # in a periodic text the round starts lock onto a few phases of the loop. So each k is also
    # measured on short continuations (k+2 tokens: the prefill token and one full round) from
    # many real held-out contexts: acceptance length = 1 + the sum of the per-position rates
    # (a later round cut short by the token limit drafts fewer positions).
    print(
        "[speculative] k | acc. length, continuations | by position"
        " | acc. length, real contexts | by position | speedup | same"
    )
    for k in args.ks:
        stats, t_k, t_p, same = [], 0.0, 0.0, 0
        for i, (x, ref) in enumerate(zip(prompts, refs, strict=True)):
            for which in ("plain", "spec") if i % 2 == 0 else ("spec", "plain"):
                t = time.perf_counter()
                if which == "plain":
                    generate(model, x, n)
                    t_p += time.perf_counter() - t
                else:
                    got, st = speculative_generate(model, x, n, draft_len=k)
                    t_k += time.perf_counter() - t
            stats.append(st)
            same += torch.equal(got, ref)
        m = _merge(stats, k)
        fresh = _merge([speculative_generate(model, c, k + 2, draft_len=k)[1] for c in contexts], k)
        fresh_len = 1 + sum(fresh["by_position"])
        ok &= same == len(prompts)
        rows.append(
            {
                "section": "speculative",
                "kind": "sweep",
                "draft_len": k,
                "spec_s": t_k,
                "plain_s": t_p,
                "speedup": t_p / t_k,
                "identical": same,
                "prompts": len(prompts),
                **m,
                "real_contexts": len(contexts),
                "real_acceptance_length": fresh_len,
                "real_by_position": fresh["by_position"],
            }
        )
        pos = " ".join(f"{p:.2f}" for p in m["by_position"])
        fpos = " ".join(f"{p:.2f}" for p in fresh["by_position"])
        print(
            f"[speculative] {k} | {m['acceptance_length']:.2f} | {pos} | {fresh_len:.2f}"
            f" | {fpos} | {t_p / t_k:.2f}x | {same}/{len(prompts)}"
        )
    real = [r for r in rows if r["kind"] == "sweep" and r["draft_len"] == k0]
    if real:
        print(
            f"[speculative] k={k0} from {len(contexts)} real held-out contexts (no"
            f" self-generated loops): acceptance length {real[0]['real_acceptance_length']:.2f}"
            f" | the {n}-token greedy continuations have {100 * distinct:.0f}% distinct"
            " byte 8-grams (loops)"
        )
    sample = bytes(t for t in refs[0][0].tolist() if t < 256).decode(errors="replace")
    print(f"[speculative] prompt 0 greedy continuation: {sample[:100]!r}")
    return rows, ok


def _distinct_ngrams(seqs: list[list[int]], n: int) -> float:
    total = distinct = 0
    for s in seqs:
        grams = [tuple(s[i : i + n]) for i in range(len(s) - n + 1)]
        total += len(grams)
        distinct += len(set(grams))
    return distinct / max(total, 1)


# ====================================================================== 3. memory
def cache_bytes(cache: HybridCache) -> tuple[int, int]:
    """(valid, allocated) bytes of the real tensors held by a cache."""
    valid = alloc = 0
    for st in cache.layers:
        if isinstance(st, KVState):
            valid += st.nbytes()
            alloc += st.allocated_nbytes()  # the whole doubling buffer, not only the valid prefix
        elif isinstance(st, MambaState):
            n = st.ssm_nbytes()
            if st.conv_BSX is not None:
                n += st.conv_BSX.numel() * st.conv_BSX.element_size()
            valid += n
            alloc += n
    return valid, alloc


@torch.no_grad()
def measure_memory(
    cfg: ModelConfig,
    contexts: list[int],
    *,
    chunk: int = 2048,
    seed: int = 0,
    trace: list[dict] | None = None,
) -> list[dict]:
    """Prefill random tokens through `cfg`'s model in chunks, recording the cache's real bytes
    at each context in `contexts` (fp32 weights and activations); with `trace`, also append
    {context, measured_bytes, allocated_bytes} after every chunk."""
    cfg = ModelConfig.from_dict(cfg.to_dict())
    cfg.mtp.pattern = ""
    cfg.max_seq_len = max(cfg.max_seq_len, max(contexts))
    model = HybridLM(cfg, seed=seed).eval()
    cache = HybridCache.for_pattern(cfg.pattern)
    g = torch.Generator().manual_seed(seed)
    rows, pos, t0 = [], 0, time.perf_counter()
    for target in sorted(contexts):
        while pos < target:
            n = min(chunk, target - pos)
            model(torch.randint(0, cfg.vocab_size, (1, n), generator=g), cache=cache)
            pos += n
            if trace is not None:
                valid, alloc = cache_bytes(cache)
                trace.append({"context": pos, "measured_bytes": valid, "allocated_bytes": alloc})
        valid, alloc = cache_bytes(cache)
        rows.append(
            {
                "context": target,
                "measured_bytes": valid,
                "allocated_bytes": alloc,
                "computed_bytes": computed_bytes(cfg, target, 4, 4),
                "prefill_s": time.perf_counter() - t0,
            }
        )
    return rows


def section_memory(args) -> tuple[list[dict], bool]:
    rows, ok = [], True
    contexts = args.contexts
    for name in FULL_SCALE:
        hyb = get_preset(name)
        att = attention_only(hyb)
        for ctx in contexts:
            h, a = computed_bytes(hyb, ctx, 2, 4), computed_bytes(att, ctx, 2, 4)
            rows.append(
                {
                    "section": "memory",
                    "kind": "computed",
                    "model": name,
                    "context": ctx,
                    "hybrid_bytes": h,
                    "attention_only_bytes": a,
                }
            )
        mine = rows[-len(contexts) :]
        at = " | ".join(
            f"{_k(r['context'])}: {r['hybrid_bytes'] / GiB:.3f} vs "
            f"{r['attention_only_bytes'] / GiB:.3f} GiB "
            f"({r['attention_only_bytes'] / r['hybrid_bytes']:.2f}x)"
            for r in (mine[0], mine[-1])
        )
        print(
            f"[memory] {name} ({len(hyb.pattern)} layers: {hyb.pattern.count('*')} attention, "
            f"{hyb.pattern.count('M')} Mamba; d {hyb.d_model}; KV bf16, Mamba state fp32), "
            f"computed cache per sequence, hybrid vs attention-only ({len(hyb.pattern)} x '*') "
            f"(attention-only / hybrid): {at}"
        )
    tiny = get_preset("tiny-super")
    tiny.mtp.pattern = ""
    checks = 0
    for label, cfg, upto in (
        ("hybrid", tiny, args.measure_to),
        ("attention-only", attention_only(tiny), args.measure_attn_to),
    ):
        ctxs = [c for c in contexts if c <= upto]
        trace: list[dict] = []
        measured = measure_memory(cfg, ctxs, chunk=args.chunk, trace=trace) if ctxs else []
        for r in trace:
            rows.append({"section": "memory", "kind": "trace", "model": f"tiny-super {label}", **r})
        for r in measured:
            same = r["measured_bytes"] == r["computed_bytes"]
            ok &= same
            checks += same
            rows.append(
                {"section": "memory", "kind": "measured", "model": f"tiny-super {label}", **r}
            )
        for c in contexts:
            rows.append(
                {
                    "section": "memory",
                    "kind": "computed",
                    "model": f"tiny-super {label}",
                    "context": c,
                    "computed_bytes": computed_bytes(cfg, c, 4, 4),
                }
            )
        if measured:
            r = measured[-1]
            agree = sum(x["measured_bytes"] == x["computed_bytes"] for x in measured)
            peak = max(trace, key=lambda x: x["allocated_bytes"] / x["measured_bytes"])
            print(
                f"[memory] tiny-super {label} ({cfg.pattern}, fp32), measured by chunked prefill"
                f" to {r['context']} tokens in {r['prefill_s']:.0f} s: valid {r['measured_bytes']}"
                f" B ({r['measured_bytes'] / MiB:.1f} MiB), allocated {r['allocated_bytes']} B"
                f" ({r['allocated_bytes'] / MiB:.1f} MiB; at most"
                f" {peak['allocated_bytes'] / peak['measured_bytes']:.2f}x valid, at"
                f" {peak['context']} tokens) | computed {r['computed_bytes']} B |"
                f" measured == computed at {agree}/{len(measured)} contexts"
                f" ({', '.join(str(x['context']) for x in measured)})"
            )
    meas = {
        (r["model"], r["context"]): r["measured_bytes"] for r in rows if r["kind"] == "measured"
    }
    both = [c for c in contexts if ("tiny-super hybrid", c) in meas]
    both = [c for c in both if ("tiny-super attention-only", c) in meas]
    if both:
        c = both[-1]
        h, a = meas[("tiny-super hybrid", c)], meas[("tiny-super attention-only", c)]
        print(
            f"[memory] tiny-super measured at {c} tokens: hybrid {h / MiB:.2f} MiB vs "
            f"attention-only {a / MiB:.2f} MiB = {a / h:.1f}x less"
        )
    return rows, ok


# ====================================================================== plots
def plot_acceptance(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in rows if r["section"] == "speculative"]
    sweep = sorted((r for r in spec if r["kind"] == "sweep"), key=lambda r: r["draft_len"])
    curves = sweep or [r for r in spec if r["kind"] == "main"]
    if not curves:
        return
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in curves:
        k = r["draft_len"]
        ax1.plot(range(1, k + 1), r["by_position"], marker="o", label=f"k={k}")
        if "real_by_position" in r:
            ax2.plot(range(1, k + 1), r["real_by_position"], marker="o", label=f"k={k}")
    ax1.set(title="greedy continuations of held-out prompts")
    n_ctx = sweep[0].get("real_contexts", 0) if sweep else 0
    ax2.set(title=f"k+2-token runs from {n_ctx} real held-out contexts")
    for ax in (ax1, ax2):
        ax.set(xlabel="draft position", ylabel="share of drafts accepted", ylim=(0, 1.02))
    if sweep:
        ks = [r["draft_len"] for r in sweep]
        ax3.plot(ks, [r["acceptance_length"] for r in sweep], marker="o", label="AL, continuations")
        ax3.plot(
            ks, [r["real_acceptance_length"] for r in sweep], marker="o", label="AL, real contexts"
        )
        ax3.plot(ks, [k + 1 for k in ks], ls=":", color="gray", label="upper bound k+1")
        ax3.plot(ks, [r["speedup"] for r in sweep], marker="s", label="wall-time speedup")
    ax3.axhline(1, color="k", lw=0.5)
    ax3.set(xlabel="draft length k", ylabel="tokens / verify step; speedup", title="vs k")
    for ax in (ax1, ax2, ax3):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, png, dpi=120)


def plot_memory(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem = [r for r in rows if r["section"] == "memory"]
    if not mem:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(FULL_SCALE):
        mine = sorted((r for r in mem if r["model"] == name), key=lambda r: r["context"])
        if not mine:
            continue
        x = [r["context"] for r in mine]
        short = name.rsplit("-", 2)[0]
        ax1.plot(x, [r["hybrid_bytes"] / GiB for r in mine], f"C{i}-", label=f"{short} hybrid")
        ax1.plot(
            x,
            [r["attention_only_bytes"] / GiB for r in mine],
            f"C{i}--",
            label=f"{short} attention-only",
        )
    ax1.set(
        xscale="log",
        yscale="log",
        xlabel="context (tokens)",
        ylabel="GiB per sequence",
        title="full scale, computed (KV bf16, Mamba fp32)",
    )
    for i, label in enumerate(("hybrid", "attention-only")):
        model = f"tiny-super {label}"
        comp = sorted(
            (r for r in mem if r["model"] == model and r["kind"] == "computed"),
            key=lambda r: r["context"],
        )
        meas = sorted(
            (r for r in mem if r["model"] == model and r["kind"] == "measured"),
            key=lambda r: r["context"],
        )
        if comp:
            ax2.plot(
                [r["context"] for r in comp],
                [r["computed_bytes"] / MiB for r in comp],
                f"C{i}-",
                label=f"{label} computed",
            )
        if meas:
            ax2.plot(
                [r["context"] for r in meas],
                [r["measured_bytes"] / MiB for r in meas],
                f"C{i}o",
                label=f"{label} measured (valid)",
            )
        trace = sorted(
            (r for r in mem if r["model"] == model and r["kind"] == "trace"),
            key=lambda r: r["context"],
        )
        if trace:
            ax2.plot(
                [r["context"] for r in trace],
                [r["allocated_bytes"] / MiB for r in trace],
                f"C{i}:",
                marker=".",
                label=f"{label} allocated (KV buffers double)",
            )
    ax2.set(
        xscale="log",
        yscale="log",
        xlabel="context (tokens)",
        ylabel="MiB per sequence",
        title="tiny-super, fp32: measured vs computed",
    )
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    save_figure(fig, png, dpi=120)


# ====================================================================== main
def _ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SECTIONS), help="comma list of " + "|".join(SECTIONS))
    p.add_argument("--out", default="runs/decode-bench")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--plot-only", action="store_true", help="re-render PNGs from metrics.jsonl")
    g = p.add_argument_group("decode")
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--prompt-len", type=int, default=16)
    g.add_argument("--repeats", type=int, default=5)
    g.add_argument(
        "--models",
        type=lambda t: [m.strip() for m in t.split(",") if m.strip()],
        default=list(MODELS),
        help="comma list of " + "|".join(MODELS) + " (super-150m: the memory-bound model)",
    )
    g.add_argument(
        "--no-compile", action="store_true", help="skip the compile_decode() (torch.compile) run"
    )
    g = p.add_argument_group("speculative")
    g.add_argument("--data", default=str(DEFAULT_DATA))
    g.add_argument("--retrain", action="store_true", help="train even if OUT/spec-model exists")
    g.add_argument("--train-steps", type=int, default=250)
    g.add_argument("--train-batch", type=int, default=8)
    g.add_argument("--train-seq", type=int, default=256)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--mtp-depth", type=int, default=3)
    g.add_argument("--mtp-loss-weight", type=float, default=1.0)
    g.add_argument("--prompts", type=int, default=8)
    g.add_argument("--spec-prompt-len", type=int, default=64)
    g.add_argument("--spec-new-tokens", type=int, default=128)
    g.add_argument("--spec-repeats", type=int, default=3)
    g.add_argument("--draft-len", type=int, default=3)
    g.add_argument("--real-contexts", type=int, default=64, help="short runs from each")
    g.add_argument("--ks", type=_ints, default=list(range(1, 8)), help="e.g. 1-7 or 1,3")
    g = p.add_argument_group("memory")
    g.add_argument("--contexts", type=_ints, default=[1024 * 2**i for i in range(7)])
    g.add_argument("--measure-to", type=int, default=65536, help="measured hybrid up to")
    g.add_argument("--measure-attn-to", type=int, default=16384, help="attention-only up to")
    g.add_argument("--chunk", type=int, default=2048, help="prefill chunk length")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = sorted(set(only) - set(SECTIONS))
    if bad or not only:
        p.error(f"--only takes a comma list of {', '.join(SECTIONS)}; got {args.only!r}")
    positive = ("new_tokens", "repeats", "prompt_len", "train_steps", "prompts", "chunk")
    for name in (*positive, "real_contexts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.spec_new_tokens < 1 or args.spec_repeats < 1 or args.spec_prompt_len < 1:
        p.error("--spec-new-tokens, --spec-repeats and --spec-prompt-len must be positive")
    if not args.contexts or min(args.contexts) < 1 or not 1 <= min(args.ks) <= max(args.ks) <= 16:
        p.error("--contexts must be positive and --ks within 1..16")
    if not args.models or set(args.models) - set(MODELS):
        p.error(f"--models takes a comma list of {', '.join(MODELS)}; got {args.models}")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    old = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    runners = {
        "decode": section_decode,
        "speculative": section_speculative,
        "memory": section_memory,
    }
    new, ok = [], True
    if args.plot_only:
        only = []
    for name in SECTIONS:
        if name in only:
            torch.manual_seed(0)
            rows, good = runners[name](args)
            new += rows
            ok &= good
    rows = [r for r in old if r.get("section") not in only] + new
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_acceptance(rows, out / "acceptance.png")
    if (out / "spec-model" / "metrics.jsonl").is_file():
        from _tiny_train import plot_training

        plot_training(out / "spec-model" / "metrics.jsonl", out / "train_loss.png")
    plot_memory(rows, out / "memory.png")
    print(f"wrote {metrics} and the PNGs in {out}")
    if not ok:
        print("CHECK FAILED: see the lines above (tokens differ or memory mismatch)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
