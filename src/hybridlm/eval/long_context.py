"""Did a context extension work? (Olmo 3 §5; Nemotron 3 Super §2.6, §3.5)

Two measurements at multiples of the length a model was trained at, for models before and after
an extension:

- `position_bpb`: held-out long documents, each scored over its first `length` tokens in one
  forward; bits per byte by position bucket (positions [0, b), [b, 2b), ...). A model that
  does not extrapolate gets worse past its training length; one that uses the longer context
  gets better.
- `ruler_by_length`: RULER-style accuracy (`hybridlm.eval.ruler`: niah variants, vt, cwe, fwe)
  per task and length, greedy, with the per-sample scores kept so two models can be compared
  sample by sample (`paired_gain`).

Memory (Nemotron 3 Super §1: a hybrid's KV cache grows in its few attention layers only):
`cache_bytes` is the inference cache after a prefill of `length` tokens (`HybridCache.nbytes`:
keys and values, Mamba conv and SSM states), `activation_bytes_per_token` the tensors autograd
keeps for the backward of one training forward, per token (distinct storages, counted once).
`copy_probe` measures in-context copying (induction): the loss on the second copy of a random
token sequence against the first.

`measure_extension` runs all of it on one model (`heldout_bpb`: a run's held-out split through
the trainer's own evaluation), `extension_verdict` compares the models before and after, and
`plot_long_context` draws RULER and bpb by position for several models in one PNG.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data.bpb import token_byte_lengths
from ..data.config import DataConfig
from ..data.pipeline import prepare_shards
from ..io import load
from ..io.checkpoint import read_meta, resolve_checkpoint
from ..model.cache import HybridCache
from ..model.model import HybridLM
from ..report.plot import pyplot, save_figure
from ..stage import Flow, Report, Stage, scalars, text_run_settings
from ..train.config import RunConfig
from ..train.text_training import HeldOutEvaluator, run_pretrain
from .loglik import LN2
from .ruler import RULER_TASKS, score_prediction
from .tasks import EvalRunner, mean_stderr, ruler_generate


@torch.no_grad()
def position_bpb(
    model: HybridLM,
    documents: Sequence[Sequence[int]],
    *,
    length: int,
    bucket: int,
    tokenizer: Any,
    batch_size: int = 4,
    cache: Callable[[], HybridCache] | None = None,
    chunk: int = 1,
) -> dict[str, Any]:
    """Bits per byte and top-1 accuracy by target position over the first `length` + 1 tokens
    of every document that has that many (BOS first, as sharded). Buckets of `bucket`
    positions; a target at position t (predicted from tokens [0, t)) falls in bucket
    (t - 1) // bucket. `cache` (a fresh `HybridCache` per batch): the tokens go through the
    inference cache `chunk` at a time, as a server decodes them (chunk 1), so what the cache
    stores (quantised KV, Mamba state precision) is what later positions read."""
    if length < 2 or bucket < 1:
        raise ValueError(f"need length >= 2 and bucket >= 1, got {length}, {bucket}")
    rows = [list(d[: length + 1]) for d in documents if len(d) >= length + 1]
    if not rows:
        raise ValueError(f"no document has {length + 1} tokens")
    nbytes = token_byte_lengths(tokenizer, model.config.vocab_size).double()
    nb = -(-length // bucket)
    per_doc = torch.zeros(len(rows), nb, 2, dtype=torch.float64)
    correct = torch.zeros(nb, dtype=torch.float64)
    bucket_of = torch.arange(length) // bucket  # target index j predicts token j + 1
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for start in range(0, len(rows), batch_size):
            ids = torch.tensor(rows[start : start + batch_size], dtype=torch.long, device=device)
            if cache is None:
                logits = model(ids[:, :-1]).logits.float()
            else:
                c, inputs = cache(), ids[:, :-1]
                logits = torch.cat(
                    [
                        model(inputs[:, s : s + chunk], cache=c).logits.float()
                        for s in range(0, length, chunk)
                    ],
                    dim=1,
                )
            hit = (logits.argmax(-1) == ids[:, 1:]).double().cpu()
            for k in range(ids.shape[0]):
                correct.index_add_(0, bucket_of, hit[k])
            nll = (
                torch.nn.functional.cross_entropy(
                    logits.transpose(1, 2), ids[:, 1:], reduction="none"
                )
                .double()
                .cpu()
            )
            b = nbytes[ids[:, 1:].cpu()]
            for k in range(ids.shape[0]):
                per_doc[start + k, :, 0].index_add_(0, bucket_of, nll[k])
                per_doc[start + k, :, 1].index_add_(0, bucket_of, b[k])
    finally:
        model.train(was_training)
    nats, byts = per_doc[..., 0].sum(0), per_doc[..., 1].sum(0)
    return {
        "length": length,
        "bucket": bucket,
        "documents": len(rows),
        "bucket_start": [i * bucket for i in range(nb)],
        "bpb": (nats / (LN2 * byts)).tolist(),
        "bpb_all": float(nats.sum() / (LN2 * byts.sum())),
        "accuracy": (
            correct / (len(rows) * torch.bincount(bucket_of, minlength=nb))
        ).tolist(),  # top-1 next-token accuracy per bucket
        # per document (nats, bytes) per bucket, for paired comparisons between models
        "per_document": per_doc.tolist(),
    }


def ruler_by_length(
    model: HybridLM,
    tokenizer: Any,
    *,
    lengths: Sequence[int],
    tasks: Sequence[str] = RULER_TASKS,
    num_samples: int = 50,
    seed: int = 0,
    gen_batch_size: int = 8,
) -> dict[str, Any]:
    """RULER string-match per (task, length), greedy until a newline, plus every sample's
    score (`scores[task][length]`, the same samples for every model). A (task, length) whose
    fixed prompt does not fit is noted in `unfit` and left out of that length's mean."""
    runner = EvalRunner(
        model=model,
        tokenizer=tokenizer,
        gen_batch_size=gen_batch_size,
        max_len=max(max(lengths), model.config.max_seq_len),
    )
    samples, outs, unfit = ruler_generate(runner, tasks, lengths, num_samples, seed=seed)
    scores: dict[str, dict[int, list[float]]] = {t: {L: [] for L in lengths} for t in tasks}
    examples: list[dict[str, Any]] = []
    for s, out in zip(samples, outs, strict=True):
        sc = score_prediction(out, s.answers)["string_match"]
        scores[s.task][s.length].append(sc)
        if s.index < 2:
            examples.append(
                {"task": s.task, "length": s.length, "prediction": out, "answers": s.answers}
            )
    mean = {t: {L: sum(v) / len(v) for L, v in by.items() if v} for t, by in scores.items()}
    overall = {}
    for L in lengths:
        fit = [mean[t][L] for t in tasks if L in mean[t]]
        overall[L] = sum(fit) / len(fit) if fit else math.nan
    return {
        "lengths": list(lengths),
        "tasks": list(tasks),
        "num_samples": num_samples,
        "mean": mean,
        "overall": overall,  # mean over the tasks whose prompt fits the length
        "unfit": unfit,
        "scores": scores,
        "examples": examples,
    }


def paired_gain(after: Mapping[str, Any], before: Mapping[str, Any], length: int) -> dict:
    """Mean RULER score gain at `length` over all (task, sample) pairs and its standard error
    (`mean_stderr` of the per-pair differences: NaN, and z NaN, for a single pair)."""
    diffs = [
        a - b
        for t in after["tasks"]
        for a, b in zip(after["scores"][t][length], before["scores"][t][length], strict=True)
    ]
    mean, se = mean_stderr(diffs)
    if math.isnan(se):  # one pair: no spread to judge it by
        z = math.nan
    else:  # no spread: every pair moved by the same amount (z = +-inf), or none moved (z = 0)
        z = mean / se if se > 0 else math.copysign(math.inf, mean) if mean else 0.0
    return {"gain": mean, "se": se, "z": z, "pairs": len(diffs)}


@torch.no_grad()
def cache_bytes(model: HybridLM, length: int) -> int:
    """Bytes of the inference cache after a prefill of `length` tokens (batch 1)."""
    cache = HybridCache.for_pattern(model.config.pattern)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=_gen())
    was_training = model.training
    model.eval()
    try:
        model(ids.to(next(model.parameters()).device), cache=cache, return_logits=False)
    finally:
        model.train(was_training)
    return cache.nbytes()


def activation_bytes_per_token(model: HybridLM, length: int, batch: int = 1) -> float:
    """Bytes autograd saves for the backward of one training forward of `batch` x `length`
    tokens (distinct storages), per token."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=_gen())
    ids = ids.to(next(model.parameters()).device)
    was_training = model.training
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(ids)
            out.logits.float().logsumexp(-1).mean().backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return sum(seen.values()) / (batch * length)


@torch.no_grad()
def copy_probe(model: HybridLM, *, length: int = 64, rows: int = 8, vocab: int = 26) -> dict:
    """Mean next-token loss (nats) on the first and the second copy of `rows` random sequences
    of `length` tokens drawn from `vocab` ids; a model that copies in context scores the second
    copy far below the first (log(vocab) for a model that does not)."""
    lo = min(300, model.config.vocab_size - vocab)
    seq = torch.randint(lo, lo + vocab, (rows, length), generator=_gen())
    ids = torch.cat([seq, seq], 1).to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        logp = torch.log_softmax(model(ids).logits.float(), -1)
    finally:
        model.train(was_training)
    nll = -logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].cpu()
    first = float(nll[:, : length - 1].mean())
    second = float(nll[:, length + 1 :].mean())  # from the second token of the copy on
    return {"first": first, "second": second, "uniform": math.log(vocab)}


def heldout_bpb(run: RunConfig, model_path: str | Path) -> dict[str, float]:
    """The held-out split of `run`'s data (all of it, at its `seq_len`) scored by the model at
    `model_path`, through the trainer's evaluation (`train.text_training.HeldOutEvaluator`)."""
    run = dataclasses.replace(
        run, train=dataclasses.replace(run.train, init_from=str(model_path), eval_batches=0)
    )
    with tempfile.TemporaryDirectory(prefix="hybridlm-lc-eval-") as scratch:
        return HeldOutEvaluator(run, scratch).trainer.module.evaluate()


def held_out_documents(data: DataConfig, source: str) -> list[list[int]]:
    """Token ids of the held-out documents of `source` (the data's own hash split)."""
    sets = prepare_shards(data)
    if source not in sets:
        raise ValueError(f"no source {source!r} in the data config ({sorted(sets)})")
    _, held = sets[source].split(
        eval_fraction=data.eval_fraction, eval_docs=data.eval_docs, method=data.eval_split
    )
    return [held.document(i).tolist() for i in range(len(held))]


def measure_extension(
    model_path: str | Path,
    *,
    original: int,
    short_run: RunConfig,
    documents: Sequence[Sequence[int]],
    tasks: Sequence[str] = RULER_TASKS,
    num_samples: int = 40,
    bucket: int = 128,
) -> dict[str, Any]:
    """Everything this module measures, for the model at `model_path`: RULER at 1x, 2x and 4x
    `original` tokens, bpb by position over `documents` up to 4x, short-context bpb on
    `short_run`'s held-out split, the copy probe, cache bytes at 4x and activation bytes per
    token at 1x and 4x."""
    loaded = load(model_path)
    model, tok = loaded.model.float().eval(), loaded.tokenizer
    lengths = [original, 2 * original, 4 * original]
    return {
        "model": str(model_path),
        "params": model.count_params(),
        "ruler": ruler_by_length(model, tok, lengths=lengths, tasks=tasks, num_samples=num_samples),
        # None when no held-out document reaches 4x the length
        "position_bpb": position_bpb(
            model, documents, length=4 * original, bucket=bucket, tokenizer=tok
        )
        if any(len(d) > 4 * original for d in documents)
        else None,
        "short_bpb": heldout_bpb(short_run, model_path),
        "copy": copy_probe(model),
        "cache_bytes_4x": cache_bytes(model, 4 * original),
        "activation_bytes_per_token": {
            str(L): activation_bytes_per_token(model, L) for L in (original, 4 * original)
        },
    }


def position_change(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """Change of bpb (after - before) per position bucket: the mean over documents of each
    document's change, with its standard error (the same documents in both; NaN for one)."""
    a, b = after["per_document"], before["per_document"]
    if len(a) != len(b):
        raise ValueError("the two position_bpb results cover different documents")
    per_bucket = [
        mean_stderr(
            [
                (x[k][0] / x[k][1] - y[k][0] / y[k][1]) / LN2
                for x, y in zip(a, b, strict=True)
                if x[k][1] > 0
            ]
        )
        for k in range(len(before["bucket_start"]))
    ]
    return {
        "bucket_start": list(before["bucket_start"]),
        "mean": [m for m, _ in per_bucket],
        "se": [e for _, e in per_bucket],
        "docs": len(a),
    }


def extension_verdict(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The targets of a context extension at tiny scale: RULER at the longest length rises by
    >= 3 standard errors (paired over tasks and samples), short-context bpb degrades < 2%."""
    longest = max(before["ruler"]["lengths"])
    gain = paired_gain(after["ruler"], before["ruler"], longest)
    change = after["short_bpb"]["eval_bpb"] / before["short_bpb"]["eval_bpb"] - 1
    by_position = None
    if before.get("position_bpb") and after.get("position_bpb"):
        by_position = position_change(before["position_bpb"], after["position_bpb"])
    return {
        "length": longest,
        "bpb_change_by_position": by_position,
        "ruler_before": before["ruler"]["overall"][longest],
        "ruler_after": after["ruler"]["overall"][longest],
        "ruler_gain": gain,
        "short_bpb_before": before["short_bpb"]["eval_bpb"],
        "short_bpb_after": after["short_bpb"]["eval_bpb"],
        "short_bpb_change": change,
        "met": gain["z"] >= 3 and change < 0.02,
    }


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def plot_long_context(
    results: Mapping[str, Mapping[str, Any]],
    out_png: str | Path,
    changes: Mapping[str, Mapping[str, Any]] | None = None,
    original: int | None = None,
) -> Path:
    """RULER score vs context length and held-out bpb by position, one line per model
    (`results[name]` holds `ruler` from `ruler_by_length` and `position_bpb`); with `changes`
    (name -> `position_change`) a third panel: the change of bpb by position after an
    extension, +-1 standard error over documents. `original` marks the training length."""
    plt = pyplot()
    ncols = 3 if changes else 2
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4.2))
    ax1, ax2 = axes[0], axes[1]
    for name, res in results.items():
        if "ruler" in res:
            r = res["ruler"]
            xs = [int(L) for L in r["lengths"]]
            ax1.plot(xs, [r["overall"][L] for L in r["lengths"]], marker="o", label=name)
        if res.get("position_bpb"):
            p = res["position_bpb"]
            mids = [s + p["bucket"] / 2 for s in p["bucket_start"]]
            ax2.plot(mids, p["bpb"], marker=".", label=name)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("context length (tokens)")
    ax1.set_ylabel("RULER string match (mean over tasks)")
    ax1.set_ylim(-0.02, 1)
    ax1.set_title("RULER accuracy vs context length")
    ax2.set_xlabel("token position in the document")
    ax2.set_ylabel("held-out bits per byte")
    ax2.set_title("held-out bpb by position")
    used = [ax1, ax2]
    if changes:
        ax3 = axes[2]
        for name, ch in changes.items():
            width = (
                ch["bucket_start"][1] - ch["bucket_start"][0] if len(ch["bucket_start"]) > 1 else 1
            )
            mids = [s + width / 2 for s in ch["bucket_start"]]
            ax3.errorbar(mids, ch["mean"], yerr=ch["se"], marker="o", capsize=3, label=name)
        ax3.axhline(0, color="grey", lw=0.8)
        ax3.set_xlabel("token position in the document")
        ax3.set_ylabel("bpb after - bpb before")
        ax3.set_title(f"change by position ({next(iter(changes.values()))['docs']} documents)")
        used.append(ax3)
    for ax in used:
        if original and ax is not ax1:
            ax.axvline(original, color="grey", ls=":", lw=1)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if original:
        ax1.axvline(original, color="grey", ls=":", lw=1)
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out_png)


# ---------------------------------------------------------------------------- the flow's stage
@dataclass(kw_only=True)
class LongContextStageConfig(RunConfig):
    """The extension run (`configs/long_context.yaml`'s sections; its start is the newest model
    before it) and what measures it: RULER (`ruler_tasks`, `ruler_samples` per task and length)
    at 1x, 2x, 4x the starting model's training length, bpb by position over the held-out
    documents of `eval_source`, short-context bpb on the starting run's held-out split."""

    WHAT = "long_context stage config"

    ruler_samples: int = 20
    ruler_tasks: list[str] = field(
        default_factory=lambda: ["niah_single", "niah_multikey", "vt", "cwe", "fwe"]
    )
    eval_source: str = "code"

    def run_config(self) -> RunConfig:
        """The training run alone (what its checkpoints record)."""
        return RunConfig(model=self.model, data=self.data, train=self.train)


def _stage_run(flow: Flow) -> dict[str, Any]:
    cfg = LongContextStageConfig.from_dict(flow.settings("long_context"))
    run = cfg.run_config()
    out = flow.stage_dir("long_context")
    result = flow.continue_or_start("long_context", lambda **kw: run_pretrain(run, **kw))
    # before / after on the same samples: the starting model, trained at its run's length
    start = run.train.init_from
    start_run = RunConfig.from_dict(read_meta(resolve_checkpoint(start))["run_config"])
    original = start_run.data.seq_len
    measure = functools.partial(
        measure_extension,
        original=original,
        short_run=start_run,
        documents=held_out_documents(run.data, cfg.eval_source),
        tasks=cfg.ruler_tasks,
        num_samples=cfg.ruler_samples,
    )
    before, after = measure(start), measure(out)
    verdict = extension_verdict(before, after)
    change = verdict["bpb_change_by_position"]
    plot_long_context(
        {"before": before, "after": after},
        out / "long_context.png",
        changes={"after - before": change} if change else None,
        original=original,
    )
    (out / "measurements.json").write_text(
        json.dumps({"before": before, "after": after, "verdict": verdict}, default=str) + "\n"
    )
    lengths = before["ruler"]["lengths"]
    return {
        "model": str(out),
        **scalars(result),
        "original_length": original,
        "ruler_before": {str(L): before["ruler"]["overall"][L] for L in lengths},
        "ruler_after": {str(L): after["ruler"]["overall"][L] for L in lengths},
        "ruler_gain": verdict["ruler_gain"],
        "short_bpb_before": verdict["short_bpb_before"],
        "short_bpb_after": verdict["short_bpb_after"],
        "short_bpb_change": verdict["short_bpb_change"],
        "target_met": verdict["met"],
    }


def _headline(s: dict[str, Any], report: Report) -> str:
    L, g = 4 * s["original_length"], s["ruler_gain"]
    return (
        f"RULER at {L} tokens: {s['ruler_before'][str(L)]:.3f} -> "
        f"{s['ruler_after'][str(L)]:.3f} ({g['z']:+.1f} SE); short-context bpb "
        f"{s['short_bpb_before']:.3f} -> {s['short_bpb_after']:.3f} "
        f"({100 * s['short_bpb_change']:+.2f}%)"
    )


# extension to 4x the training length on long documents and synthetic tasks, long and short
# sequences in turn (Olmo 3 §5, Nemotron 3 Super §2.6), RULER and bpb by position before and
# after
STAGE = Stage(
    "long_context",
    inputs=("curate", "tokenizer"),
    config=LongContextStageConfig,
    settings=lambda flow: text_run_settings(flow, "long_context"),
    run=_stage_run,
    model="model",
    headline=_headline,
)
