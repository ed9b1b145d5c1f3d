"""MTP speculative decoding: acceptance of a healed head, what a round costs, and the speed-up.

    python benchmarks/spec_speedup.py                        # runs/spec-speedup/
    python benchmarks/spec_speedup.py --ks 1-7 --draft-vocab 4096 --tiny-draft-vocab 64
    python benchmarks/spec_speedup.py --plot-only

Every figure is measured in this run (the trained and healed models are reused from OUT); rows
go to OUT/metrics.jsonl and `spec_speedup.png` is rendered from that file.

1. acceptance  The byte-level Super-shaped model of `_tiny_train` ("MEM*EME", d 192, a "*E" MTP
   head trained at depth 3 on the first 90% of tinyshakespeare; OUT/model), with its MTP head
   healed on the model's own T=1 continuations of training-text prompts (`train.mtp_boost`,
   Nemotron 3 Super §4.7, at depth max(k); OUT/healed). On `--prompts` held-out prompts (the
   last 10% of the text), for k = 1..7: greedy `speculative_generate` with the full head and with
   a reduced draft vocabulary (`DraftVocab`, the `--tiny-draft-vocab` ids most frequent in the
   model's own continuations), each output compared with plain greedy token for token;
   acceptance length (tokens per verify step), per-position acceptance, and the wall speed-up
   over `generate`, interleaved.
2. costs       What one round costs, in decode steps, on the same model and on super-150m
   (`decode.memory_bound_config()`, ~136M active parameters at vocab 32000, given a "*E" MTP
   head): a decode step, one MTP draft with the full head and with a `--draft-vocab`-id head,
   and a verify pass over j = 1..8 tokens (with the per-position state history and the restore
   a rejection needs); interleaved medians. super-150m has random weights: it cannot be trained
   to a useful model on this machine (one fwd+bwd+AdamW step of 1k tokens takes ~27 s), and
   a round's cost does not depend on the weights' values, only on how many distinct experts
   its tokens route to (random routing is close to uniform, the costly case: 4 tokens top-4 of
   32 read ~13 experts' weights per layer, 1 token 4).
3. speed-up    round(k) = k c_draft + c_verify(k+1) + c_other, speed-up = AL_k / round(k).
   The model is checked where both sides are measured: the tiny model's wall speed-ups, and an
   end-to-end run of super-150m with its random head (AL ~ 1). super-150m's speed-up at the
   tiny model's measured acceptance lengths is then a projection (labelled as such), with the
   acceptance length each k would need for the issue's 2x.
4. engine      Serving throughput of the healed model in `infer.engine.Engine` for batches of B
   held-out prompts (`--engine-batches`), interleaved: plain greedy requests (one [B, 1] decode
   step each), speculative requests in the batch (k = `--engine-k`: the drafts of all rows in
   one MTP call per position, one [B, k + 1] verify forward), and the same speculative requests
   decoded one at a time at batch 1 (`speculative_generate`, how the engine ran them before
   they joined the batch), and speculative requests with `spec_max_batch=1` (speculation only
   when alone); generated tokens per second of wall time, prefills included, every output
   checked against plain greedy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tiny_train import load_or_train, load_split, read_rows  # noqa: E402
from decode import (  # noqa: E402
    DEFAULT_DATA,
    _describe,
    _ints,
    _loadavg,
    _prompts,
    memory_bound_config,
)
from hybridlm import HybridLM  # noqa: E402
from hybridlm.data.tokenizer import ByteTokenizer  # noqa: E402
from hybridlm.infer import speculative as spec  # noqa: E402
from hybridlm.infer.engine import Engine  # noqa: E402
from hybridlm.infer.generate import generate  # noqa: E402
from hybridlm.infer.sampling import SamplingParams  # noqa: E402
from hybridlm.infer.speculative import DraftVocab, merge_stats, speculative_generate  # noqa: E402
from hybridlm.io import load_model  # noqa: E402
from hybridlm.model.cache import HybridCache  # noqa: E402
from hybridlm.report.plot import pyplot, save_figure  # noqa: E402
from hybridlm.train.mtp_boost import (  # noqa: E402
    MTPBoostConfig,
    MTPBoostDataConfig,
    MTPBoostRunConfig,
    MTPBoostTrainConfig,
    run_mtp_boost,
    self_generate,
)

REPO = Path(__file__).resolve().parents[1]
TARGET = 2.0  # the wall speed-up target on the memory-bound model


# ====================================================================== models
def healed_model(args, log=print) -> tuple[HybridLM, dict]:
    """The tiny model with its MTP head healed on its own continuations (reused from OUT)."""
    out = Path(args.out)
    healed, summary = out / "healed" / "model", out / "healed" / "summary.json"
    settings = {
        "heal_steps": args.heal_steps,
        "depth": max(args.ks),
        "sequences": args.heal_sequences,
        "temperature": args.heal_temperature,
    }
    if (healed / "config.json").is_file() and summary.is_file() and not args.retrain:
        info = json.loads(summary.read_text())
        if all(info.get(k) == v for k, v in settings.items()):
            return load_model(healed).eval(), {**info, "reused": True}
    model, _ = load_or_train(
        out / "model",
        Path(args.data),
        retrain=args.retrain,
        steps=args.train_steps,
        batch=args.train_batch,
        seq=args.train_seq,
        log=log,
    )
    train_ids, held = load_split(args.data)
    g = torch.Generator().manual_seed(0)
    L = args.prompt_len
    starts = torch.randint(0, len(train_ids) - L, (args.heal_sequences,), generator=g).tolist()
    train_prompts = [train_ids[s : s + L].tolist() for s in starts]
    eval_prompts = [p[0].tolist() for p in _prompts(held, 8, L)]
    cfg = MTPBoostRunConfig(
        train=MTPBoostTrainConfig(max_steps=args.heal_steps, out_dir=str(out / "healed")),
        data=MTPBoostDataConfig(
            num_sequences=args.heal_sequences,
            prompt_len=L,
            gen_len=args.new_tokens,
            gen_temperature=args.heal_temperature,
            eval_prompts=len(eval_prompts),
        ),
        mtp_boost=MTPBoostConfig(
            draft_len=max(args.ks), eval_new_tokens=args.new_tokens, eval_temperatures=[0.0]
        ),
    )
    t0 = time.perf_counter()
    res = run_mtp_boost(model, ByteTokenizer(), train_prompts, eval_prompts, cfg, overwrite=True)
    info = {
        **settings,
        "seconds": time.perf_counter() - t0,
        "acceptance_before": res["before"][0]["acceptance_length"],
        "acceptance_after": res["after"][0]["acceptance_length"],
    }
    summary.write_text(json.dumps(info))
    return load_model(Path(res["model"])).eval(), {**info, "reused": False}


def memory_bound_model() -> HybridLM:
    cfg = memory_bound_config()
    cfg.mtp.pattern, cfg.mtp.depth = "*E", 1  # one shared head, applied recursively
    cfg.validate()
    return HybridLM(cfg, seed=0).eval()


# ====================================================================== costs
@torch.no_grad()
def round_costs(
    model: HybridLM, prompt_BL: torch.Tensor, js: list[int], vocabs: dict, repeats: int
) -> dict[str, float]:
    """Median seconds of: a decode step (`step`), one MTP draft per entry of `vocabs` (name ->
    DraftVocab or None: `draft:<name>`), and a verify pass over j tokens with the state history
    a rejection rewinds to (`verify:<j>`); each restores the caches, so every call sees the same
    context. Calls are interleaved, `repeats` rounds after one warm-up round."""
    cfg = model.config
    cache = HybridCache.for_pattern(cfg.pattern)
    mtp_cache = HybridCache.for_pattern(cfg.mtp.pattern)
    pre = model(prompt_BL, cache=cache, return_hidden=True)
    spec._mtp(model, pre.hidden[:, :-1], prompt_BL[:, 1:], mtp_cache)
    h_B1D, tok_B1 = pre.hidden[:, -1:], pre.logits[:, -1:].argmax(-1)
    seq_BJ = torch.cat([tok_B1, prompt_BL[:, : max(js) - 1]], dim=1)

    def step():
        snap = cache.snapshot()
        model(tok_B1, cache=cache).logits.argmax(-1)
        cache.restore(snap)

    def verify(j):
        snap = cache.snapshot()
        cache.record_history(True)
        model(seq_BJ[:, :j], cache=cache, return_hidden=True).logits.argmax(-1)
        cache.record_history(False)
        cache.restore(snap)

    def draft(dv):
        seen = mtp_cache.seen_tokens
        spec._mtp(model, h_B1D, tok_B1, mtp_cache, dv)[1].argmax(-1)
        mtp_cache.truncate(seen)

    ops = {"step": step}
    ops.update({f"draft:{n}": (lambda dv=dv: draft(dv)) for n, dv in vocabs.items()})
    ops.update({f"verify:{j}": (lambda j=j: verify(j)) for j in js})
    times: dict[str, list[float]] = {k: [] for k in ops}
    names = list(ops)
    for r in range(repeats + 1):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            ops[name]()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def predicted_round(costs: dict[str, float], k: int, vocab: str) -> float:
    """A round in decode steps: k drafts and a verify of k + 1 tokens."""
    return (k * costs[f"draft:{vocab}"] + costs[f"verify:{k + 1}"]) / costs["step"]


# ====================================================================== measured speed-ups
def sweep(
    variants: dict[str, tuple[HybridLM, DraftVocab | None]],
    prompts: list[torch.Tensor],
    ks: list[int],
    new_tokens: int,
    repeats: int,
) -> tuple[list[dict], bool]:
    """Greedy plain vs speculative decoding for each k and each variant (name -> (model, draft
    vocabulary); the models share one backbone) on every prompt, interleaved per prompt. The
    decode phase only: each time minus the prompt's prefill (`generate` of 1 token), sums of
    per-prompt medians."""
    base = next(iter(variants.values()))[0]
    pre, plain = 0.0, 0.0
    runs = {(k, n): {"s": 0.0, "stats": [], "same": 0} for k in ks for n in variants}
    for x in prompts:
        t_pre, t_plain, t_spec = [], [], {key: [] for key in runs}
        for r in range(repeats):
            order = list(runs) if r % 2 == 0 else list(runs)[::-1]
            t0 = time.perf_counter()
            generate(base, x, 1)
            t1 = time.perf_counter()
            out = generate(base, x, new_tokens)
            t_pre.append(t1 - t0)
            t_plain.append(time.perf_counter() - t1)
            if r == 0:  # the first plain run is the greedy reference
                ref = out
            for key in order:
                k, n = key
                model, dv = variants[n]
                t0 = time.perf_counter()
                got, st = speculative_generate(model, x, new_tokens, draft_len=k, draft_vocab=dv)
                t_spec[key].append(time.perf_counter() - t0)
                if r == 0:
                    runs[key]["stats"].append(st)
                    runs[key]["same"] += int(torch.equal(got, ref))
        p = statistics.median(t_pre)
        pre, plain = pre + p, plain + statistics.median(t_plain) - p
        for key in runs:
            runs[key]["s"] += statistics.median(t_spec[key]) - p
    rows, ok = [], True
    for (k, n), run in runs.items():
        st = merge_stats(run["stats"])
        head, _, vocab = n.partition("/")
        rows.append(
            {
                "section": "tiny",
                "k": k,
                "head": head,
                "vocab": vocab,
                "acceptance_length": st["acceptance_length"],
                "by_position": st["acceptance_by_position"],
                "prefill_s": pre,
                "plain_s": plain,
                "spec_s": run["s"],
                "speedup": plain / run["s"],
                "identical": run["same"],
                "prompts": len(prompts),
            }
        )
        ok &= run["same"] == len(prompts)
    return rows, ok


def engine_throughput(
    model: HybridLM,
    prompts: list[torch.Tensor],
    batches: list[int],
    k: int,
    new_tokens: int,
    repeats: int,
) -> tuple[list[dict], bool]:
    """Section 4: tokens/s of plain and speculative requests in one engine batch of B, and of
    the speculative requests decoded one at a time (batch 1), interleaved; medians."""
    tok = ByteTokenizer()
    lists = [x[0].tolist() for x in prompts]

    def engine(b: int, spec: int, limit: int | None = None) -> list[list[int]]:
        eng = Engine(model, tok, max_batch_size=b, prefix_cache_size=0, spec_max_batch=limit)
        sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True, speculative=spec)
        return [o.token_ids for o in eng.generate(lists[:b], sp)]

    def alone(b: int) -> list[list[int]]:
        return [
            speculative_generate(model, x, new_tokens, draft_len=k)[0][0].tolist()
            for x in prompts[:b]
        ]

    rows, ok = [], True
    for b in batches:
        modes = {"plain": lambda b=b: engine(b, 0), "spec": lambda b=b: engine(b, k)}
        modes["spec_max1"] = lambda b=b: engine(b, k, limit=1)
        modes["spec_batch1"] = lambda b=b: alone(b)
        times: dict[str, list[float]] = {m: [] for m in modes}
        outs = {}
        for r in range(repeats):
            for m in list(modes) if r % 2 == 0 else list(modes)[::-1]:
                t0 = time.perf_counter()
                outs[m] = modes[m]()
                times[m].append(time.perf_counter() - t0)
        same = all(outs[m] == outs["plain"] for m in modes)
        ok &= same
        med = {m: statistics.median(t) for m, t in times.items()}
        rows.append(
            {
                "section": "engine",
                "batch": b,
                "k": k,
                "tokens": b * new_tokens,
                **{f"{m}_tok_s": b * new_tokens / t for m, t in med.items()},
                "identical": same,
            }
        )
    return rows, ok


# ====================================================================== report
def plot(rows: list[dict], png: Path) -> Path:
    plt = pyplot()
    eng = sorted((r for r in rows if r["section"] == "engine"), key=lambda r: r["batch"])
    fig, axes = plt.subplots(
        1,
        3 if eng else 2,
        figsize=(20 if eng else 14, 4.8),
        width_ratios=(1, 1.2, 1)[: 2 + bool(eng)],
    )
    a1, a2 = axes[:2]
    if eng:
        a3, bs = axes[2], [r["batch"] for r in eng]
        for key, label in (
            ("plain_tok_s", "plain requests, one batch"),
            ("spec_tok_s", f"speculative (k={eng[0]['k']}), one batch"),
            ("spec_max1_tok_s", f"speculative (k={eng[0]['k']}), spec_max_batch=1"),
            ("spec_batch1_tok_s", f"speculative (k={eng[0]['k']}), one at a time"),
        ):
            a3.plot(bs, [r[key] for r in eng], "o-", label=label)
        a3.set(xlabel="requests in the batch", ylabel="generated tokens / s", ylim=(0, None))
        a3.set_xticks(bs)
        a3.set_title("engine throughput, tiny healed model")
        a3.legend(fontsize=7, loc="lower right")
        a3.grid(alpha=0.3)
    tiny = [r for r in rows if r["section"] == "tiny"]
    proj = [r for r in rows if r["section"] == "projection"]
    for v in sorted({(r["head"], r["vocab"]) for r in tiny}):
        rs = sorted((r for r in tiny if (r["head"], r["vocab"]) == v), key=lambda r: r["k"])
        ks, name = [r["k"] for r in rs], "/".join(v)
        a1.plot(
            ks, [r["acceptance_length"] for r in rs], "o-", label=f"{v[0]} head, draft vocab {v[1]}"
        )
        a2.plot(ks, [r["speedup"] for r in rs], "o-", label=f"tiny {name}, measured")
        a2.plot(ks, [r["predicted_speedup"] for r in rs], "x:", label=f"tiny {name}, cost model")
    for v in sorted({(r["head"], r["vocab"]) for r in proj}):
        rs = sorted((r for r in proj if (r["head"], r["vocab"]) == v), key=lambda r: r["k"])
        a2.plot(
            [r["k"] for r in rs],
            [r["speedup"] for r in rs],
            "s--",
            label=f"super-150m {'/'.join(v)}, projected",
        )
    ks = sorted({r["k"] for r in tiny})
    a1.plot(ks, [k + 1 for k in ks], color="grey", lw=0.8, ls=":", label="every draft accepted")
    a1.set(xlabel="draft length k", ylabel="tokens per verify step", ylim=(0, None))
    a1.set_title("acceptance length, held-out prompts (greedy)")
    a2.axhline(1.0, color="grey", lw=0.8)
    a2.axhline(TARGET, color="red", lw=0.8, ls="--", label=f"target {TARGET:g}x")
    a2.set(xlabel="draft length k", ylabel="wall speed-up over plain decode", ylim=(0, None))
    a2.set_title("speed-up")
    a1.legend(fontsize=7, loc="upper left")
    a2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: no overlap
    for a in (a1, a2):
        a.grid(alpha=0.3)
    return save_figure(fig, png)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "runs" / "spec-speedup"))
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--retrain", action="store_true", help="train and heal even if OUT has them")
    p.add_argument("--train-steps", type=int, default=250)
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-seq", type=int, default=256)
    p.add_argument("--heal-steps", type=int, default=200)
    p.add_argument("--heal-sequences", type=int, default=96)
    p.add_argument(
        "--heal-temperature",
        type=float,
        default=0.0,
        help="of the own continuations the head heals on (0: greedy, as this benchmark decodes)",
    )
    p.add_argument("--ks", type=_ints, default=list(range(1, 8)), help="e.g. 1-7 or 1,3")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cost-repeats", type=int, default=15)
    p.add_argument("--draft-vocab", type=int, default=4096, help="super-150m's reduced head")
    p.add_argument("--tiny-draft-vocab", type=int, default=64, help="the byte model's")
    p.add_argument("--e2e-tokens", type=int, default=48, help="super-150m end-to-end check")
    p.add_argument("--engine-batches", type=_ints, default=[1, 4, 8], help="e.g. 1,4,8")
    p.add_argument("--engine-k", type=int, default=3)
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args(argv)
    if min(args.ks) < 1 or max(args.ks) > 7:
        p.error("--ks must lie in 1..7")
    out = Path(args.out)
    metrics = out / "metrics.jsonl"
    if args.plot_only:
        if not metrics.is_file():
            p.error(f"--plot-only needs {metrics} from an earlier run")
        rows = read_rows(metrics)
        print(plot(rows, out / "spec_speedup.png"))
        return 0
    if not Path(args.data).is_file():
        print(f"[spec] skipped: training text {args.data} not found (--data)")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    print(f"[spec] torch {torch.__version__}, {threads} threads, load {_loadavg():.2f}")

    # 1. the healed tiny model, its acceptance and measured speed-ups
    model, heal = healed_model(args, log=lambda s: print(s, flush=True))
    print(
        f"[heal] {_describe(model.config)}; MTP head healed {heal['heal_steps']} steps at depth"
        f" {heal['depth']} on {heal['sequences']} own continuations (T={heal['temperature']:g}):"
        f" acceptance length (k ="
        f" {heal['depth']}, greedy) {heal['acceptance_before']:.2f}"
        f" -> {heal['acceptance_after']:.2f}" + (" (reused)" if heal["reused"] else "")
    )
    train_ids, held = load_split(args.data)
    prompts = _prompts(held, args.prompts, args.prompt_len)
    g = torch.Generator().manual_seed(1)
    L = args.prompt_len
    starts = torch.randint(0, len(train_ids) - L, (32,), generator=g).tolist()
    own = self_generate(
        model,
        ByteTokenizer(),
        [train_ids[s : s + L].tolist() for s in starts],
        gen_len=args.new_tokens,
        temperature=1.0,
        seed=1,
    )
    small = str(args.tiny_draft_vocab)
    dv = DraftVocab.from_tokens(model, [s[L:] for s in own], args.tiny_draft_vocab)
    trained = load_model(Path(args.out) / "model").eval()  # the head before healing
    variants = {"trained/full": (trained, None), "healed/full": (model, None)}
    variants[f"healed/{small}"] = (model, dv)
    speculative_generate(model, prompts[0][:, :8], 8, draft_len=3)  # warm-up
    rows, ok = sweep(variants, prompts, args.ks, args.new_tokens, args.repeats)
    tiny_costs = round_costs(
        model,
        prompts[0],
        list(range(1, max(args.ks) + 2)),
        {"full": None, small: dv},
        args.cost_repeats,
    )
    print(
        f"[tiny] {len(prompts)} held-out prompts x {args.new_tokens} tokens, greedy, fp32; heads:"
        f" trained (before healing) and healed; draft vocabularies: full (258) and the {small}"
        " ids most frequent in the model's own continuations; speed-up of the decode phase"
        " (prefill excluded), measured and from the cost model"
    )
    print("[tiny] k | head | vocab | acc. length | by position | identical | speed-up (model)")
    for r in rows:
        r["predicted_speedup"] = r["acceptance_length"] / predicted_round(
            tiny_costs, r["k"], r["vocab"]
        )
        pos = " ".join(f"{a:.2f}" for a in r["by_position"])
        print(
            f"[tiny] {r['k']} | {r['head']} | {r['vocab']} | {r['acceptance_length']:.2f} |"
            f" {pos} | {r['identical']}/{r['prompts']} | {r['speedup']:.2f}x"
            f" ({r['predicted_speedup']:.2f}x)"
        )

    # 2. costs on the memory-bound model
    big = memory_bound_model()
    x = torch.randint(0, big.config.vocab_size, (1, args.prompt_len), generator=g)
    big_vocabs = {
        "full": None,
        str(args.draft_vocab): DraftVocab(
            big, torch.randperm(big.config.vocab_size, generator=g)[: args.draft_vocab]
        ),
    }
    costs = round_costs(big, x, list(range(1, max(args.ks) + 2)), big_vocabs, args.cost_repeats)
    st = costs["step"]
    print(
        f"[cost] super-150m ({_describe(big.config)}, MTP '*E'), one decode step"
        f" {st * 1e3:.1f} ms ({1 / st:.1f} tok/s); in decode steps:"
    )
    print(
        "[cost] draft (full head) {:.2f} | draft ({} ids) {:.2f} | verify j=1..{}: {}".format(
            costs["draft:full"] / st,
            args.draft_vocab,
            costs[f"draft:{args.draft_vocab}"] / st,
            max(args.ks) + 1,
            " ".join(f"{costs[f'verify:{j}'] / st:.2f}" for j in range(1, max(args.ks) + 2)),
        )
    )
    rows.append(
        {
            "section": "costs",
            "model": "super-150m",
            "step_s": st,
            **{k: v / st for k, v in costs.items() if k != "step"},
        }
    )
    # end-to-end check of the cost model where acceptance is whatever the random head gets
    k0 = min(3, max(args.ks))
    [check], same = sweep({"random/full": (big, None)}, [x], [k0], args.e2e_tokens, args.repeats)
    check["section"] = "check"
    check["predicted_speedup"] = check["acceptance_length"] / predicted_round(costs, k0, "full")
    ok &= same
    print(
        f"[check] super-150m end-to-end, random MTP head, k={k0}, {args.e2e_tokens} tokens:"
        f" acceptance length {check['acceptance_length']:.2f}, decode-phase speed-up measured"
        f" {check['speedup']:.2f}x vs cost model {check['predicted_speedup']:.2f}x"
        f" | identical to greedy: {same}"
    )
    rows.append(check)

    # 3. projection at the tiny model's measured acceptance
    print(
        "[projection] super-150m at the tiny model's measured acceptance lengths (each head's"
        f" full-vocabulary acceptance, with a full and a {args.draft_vocab}-id draft vocabulary):"
    )
    print("[projection] k | head | draft vocab | AL | round (steps) | speed-up | AL for 2x")
    tiny_full = [r for r in rows if r["section"] == "tiny" and r["vocab"] == "full"]
    for r, vocab in [(r, v) for r in tiny_full for v in ("full", str(args.draft_vocab))]:
        rnd = predicted_round(costs, r["k"], vocab)
        sp = r["acceptance_length"] / rnd
        need = TARGET * rnd
        rows.append(
            {
                "section": "projection",
                "k": r["k"],
                "head": r["head"],
                "vocab": vocab,
                "acceptance_length": r["acceptance_length"],
                "round_steps": rnd,
                "speedup": sp,
                "needed_for_target": need,
            }
        )
        reach = "" if need <= r["k"] + 1 else " (> k+1: out of reach)"
        print(
            f"[projection] {r['k']} | {r['head']} | {vocab} | {r['acceptance_length']:.2f} |"
            f" {rnd:.2f} |"
            f" {sp:.2f}x | {need:.2f}{reach}"
        )
    # 4. serving: speculative requests in the engine's batch
    eng_rows, same = engine_throughput(
        model, prompts, args.engine_batches, args.engine_k, args.new_tokens, args.repeats
    )
    ok &= same
    rows += eng_rows
    print(
        f"[engine] healed model, greedy, {args.new_tokens} new tokens per request, prefills"
        f" included; k={args.engine_k}; tokens/s (speculative in one batch / plain in one batch,"
        " / speculative with spec_max_batch=1 / speculative one at a time)"
    )
    print(
        "[engine] batch | plain | spec, batched | spec_max_batch=1 | spec, one at a time"
        " | identical"
    )
    for r in eng_rows:
        print(
            f"[engine] {r['batch']} | {r['plain_tok_s']:.0f} | {r['spec_tok_s']:.0f}"
            f" ({r['spec_tok_s'] / r['plain_tok_s']:.2f}x) | {r['spec_max1_tok_s']:.0f} |"
            f" {r['spec_batch1_tok_s']:.0f}"
            f" ({r['spec_tok_s'] / r['spec_batch1_tok_s']:.2f}x batched) | {r['identical']}"
        )
    best = max((r for r in rows if r["section"] == "projection"), key=lambda r: r["speedup"])
    verdict = "met" if best["speedup"] >= TARGET else "missed"
    print(
        f"[spec] best projected super-150m speed-up {best['speedup']:.2f}x (k={best['k']},"
        f" {best['head']} head, draft vocab {best['vocab']}); target {TARGET:g}x: {verdict}"
    )
    with metrics.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"[spec] {metrics} | {plot(rows, out / 'spec_speedup.png')}")
    if not ok:
        print("[spec] FAILED: a greedy speculative output differs from plain greedy")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
