"""MTP healing / boosting: train only the MTP head on the model's own generations, so that its
drafts match what the backbone will verify (Nemotron 3 Super §4.7 "MTP healing"; Nemotron 3.5
§2.1 MTP warm-up and §3.7 "MTP boosting").

    hybridlm mtp-boost --checkpoint runs/quickstart --set steps=300
    run_mtp_boost(model, tokenizer, train_prompts, eval_prompts, MTPBoostConfig(), out_dir)

Shape legend: B batch, L sequence, D width, V vocabulary.

Recipe:
1. **Self-generated data.** The frozen model continues `num_sequences` prompts for `gen_len`
   tokens (sampled at `gen_temperature` with the continuous-batching engine). After RL or SFT
   the backbone's distribution has moved away from the pretraining text the head was trained
   on; its own generations are exactly the distribution the drafts will be verified against.
2. **Backbone frozen**: only `model.mtp` is trained (the embeddings and the LM head it shares
   stay fixed). Per depth k = 1..D the head predicts token t+k+1 from (h^{k-1}_t, emb(x_{t+k})).
   The loss on generated targets is `(1 - w) * NLL + w * T^2 * KL(p_backbone || q_mtp)`: the NLL
   of the generated token, and distillation from the backbone's own next-token distribution at
   position t+k (the distribution that verifies the draft: matching it raises acceptance under
   greedy verification and, more so, under rejection sampling; Nemotron 3.5 §3.7).
3. **Hidden-state mixing** (Nemotron 3.5 §2.1): at depth k >= 2 the head's input hidden is, per
   position, the backbone's true hidden of the position it stands for (h^0_{t+k-1}, what depth 1
   sees) with probability `mix_true`, and its own recursive output h^{k-1}_t otherwise (what
   deeper drafts see at inference), so it is conditioned on both kinds of state.
4. **Acceptance before and after** with the speculative decoder on held-out prompts, greedy and
   at T=1, by draft position; the result goes to `metrics.jsonl` and `acceptance.png`.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..infer.engine import Engine
from ..infer.sampling import SamplingParams
from ..infer.speculative import SpecStats, speculative_generate
from ..model.model import HybridLM
from ..model.moe import MoE


@dataclass(kw_only=True)
class MTPBoostConfig:
    steps: int = 300
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 20
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    depth: int = 0  # MTP depths trained; 0 = draft_len (train the recursion as deep as used)
    mix_true: float = 0.5  # hidden-state mixing: P(true backbone hidden) at depth >= 2
    distill_weight: float = 0.5  # w: (1 - w) * NLL + w * KL(backbone || head)
    distill_temperature: float = 1.0
    num_sequences: int = 128  # self-generated training sequences
    prompt_len: int = 64
    gen_len: int = 128
    gen_temperature: float = 1.0
    eval_prompts: int = 16
    eval_new_tokens: int = 96
    draft_len: int = 3
    eval_temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    log_interval: int = 10
    seed: int = 0
    # where prompts come from: "data" (the checkpoint's training data; the stdlib corpus for
    # transformers directories) or an RL environment kind (e.g. "sft_arithmetic", "arithmetic"):
    # healing after RL reuses the RL prompts (Nemotron 3 Super §4.7)
    prompts: str = "data"

    def validate(self) -> MTPBoostConfig:
        for name in ("steps", "batch_size", "num_sequences", "prompt_len", "gen_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.mix_true <= 1.0:
            raise ValueError(f"mix_true must be in [0, 1], got {self.mix_true}")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"distill_weight must be in [0, 1], got {self.distill_weight}")
        if self.distill_temperature <= 0:
            raise ValueError("distill_temperature must be > 0")
        if not 1 <= self.draft_len <= 16:
            raise ValueError(f"draft_len must be in [1, 16], got {self.draft_len}")
        return self


def _shift_left(x: torch.Tensor, k: int, fill: float | int = 0) -> torch.Tensor:
    """x[:, t + k] at position t (along dim 1), `fill` past the end."""
    if k == 0:
        return x
    out = torch.full_like(x, fill)
    out[:, :-k] = x[:, k:]
    return out


def mtp_boost_loss(
    model: HybridLM,
    ids_BL: torch.Tensor,
    target_mask_BL: torch.Tensor,
    *,
    depth: int,
    mix_true: float,
    distill_weight: float,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over depths of `(1 - w) * NLL + w * T^2 * KL(p_backbone || q_head)` on the tokens
    whose `target_mask_BL` is set (a target at position j is predicted at depth k from position
    j - k - 1). The backbone runs without gradients; only the MTP head gets them."""
    if model.mtp is None:
        raise ValueError("the model has no MTP head (mtp.pattern is empty)")
    _, L = ids_BL.shape
    with torch.no_grad():
        out = model(ids_BL, return_hidden=True)
        ct = torch.promote_types(out.logits.dtype, torch.float32)  # fp32 (fp64 in references)
        h0_BLD, teacher_BLV = out.hidden, out.logits.to(ct)
    ctx = {"positions_L": torch.arange(L, device=ids_BL.device)}
    h_BLD, losses, metrics = h0_BLD, [], {}
    for k in range(1, depth + 1):
        if k >= 2 and mix_true > 0:
            true_BLD = _shift_left(h0_BLD, k - 1)  # the backbone's hidden of position t+k-1
            pick_BL = torch.rand(h_BLD.shape[:2], generator=generator, device=h_BLD.device)
            h_BLD = torch.where((pick_BL < mix_true)[..., None], true_BLD, h_BLD)
        emb_BLD = model.embeddings(_shift_left(ids_BL, k))
        h_BLD = model.mtp(h_BLD, emb_BLD, **ctx)
        valid_BL = _shift_left(target_mask_BL, k + 1, False)
        logits_NV = model.lm_head(h_BLD[valid_BL]).to(ct)
        target_N = _shift_left(ids_BL, k + 1)[valid_BL]
        nll = F.cross_entropy(logits_NV, target_N)
        t = temperature
        p_NV = torch.softmax(_shift_left(teacher_BLV, k)[valid_BL] / t, -1)
        kl = F.kl_div(torch.log_softmax(logits_NV / t, -1), p_NV, reduction="batchmean") * t * t
        losses.append((1 - distill_weight) * nll + distill_weight * kl)
        with torch.no_grad():
            acc = (logits_NV.argmax(-1) == target_N).float().mean()
            top1 = (logits_NV.argmax(-1) == p_NV.argmax(-1)).float().mean()
        metrics |= {f"nll_{k}": nll.item(), f"kl_{k}": kl.item(), f"acc_{k}": acc.item()}
        metrics[f"agree_{k}"] = top1.item()  # head's argmax == the backbone's (greedy accept)
    for m in model.moe_layers():
        m.aux_losses.clear()
    loss = torch.stack(losses).mean()
    metrics["loss"] = loss.item()
    return loss, metrics


@torch.no_grad()
def self_generate(
    model: HybridLM,
    tokenizer: Any,
    prompts: list[list[int]],
    *,
    gen_len: int,
    temperature: float,
    seed: int,
    max_batch_size: int = 16,
) -> list[list[int]]:
    """The model's own continuations (prompt + generation, EOS kept off) of every prompt."""
    engine = Engine(model, tokenizer, max_batch_size=max_batch_size, prefix_cache_size=0)
    params = [
        SamplingParams(max_tokens=gen_len, temperature=temperature, seed=seed + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs = engine.generate(prompts, params)
    return [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]


def merge_stats(stats: list[SpecStats]) -> dict[str, Any]:
    """Acceptance over many requests: length = tokens per verify step; rates per position."""
    k = max(s.draft_len for s in stats)
    total = SpecStats(draft_len=k)
    for s in stats:
        total.steps += s.steps
        total.accepted += s.accepted
        for i in range(s.draft_len):
            total.accepted_at[i] += s.accepted_at[i]
            total.drafted_at[i] += s.drafted_at[i]
    return total.to_dict()


@torch.no_grad()
def measure_acceptance(
    model: HybridLM,
    prompts: list[list[int]],
    *,
    draft_len: int,
    new_tokens: int,
    temperature: float,
    seed: int = 0,
) -> dict[str, Any]:
    """Speculative decoding of every prompt with the MTP drafter; merged acceptance stats, and
    each prompt's (accepted, drafted) counts per draft position (`by_prompt`), from which a
    report draws confidence intervals by resampling prompts."""
    device = model.embeddings.weight.device
    stats = []
    for i, p in enumerate(prompts):
        x = torch.tensor([p], device=device)
        _, st = speculative_generate(
            model, x, new_tokens, draft_len=draft_len, temperature=temperature, seed=seed + i
        )
        stats.append(st)
    by_prompt = [[list(s.accepted_at), list(s.drafted_at)] for s in stats]
    return {**merge_stats(stats), "prompts": len(stats), "by_prompt": by_prompt}


def _lr(step: int, cfg: MTPBoostConfig) -> float:
    """Linear warm-up, then cosine to 10% of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _acceptance_rows(model: HybridLM, prompts, cfg: MTPBoostConfig, when: str) -> list[dict]:
    rows = []
    for t in cfg.eval_temperatures:
        m = measure_acceptance(
            model,
            prompts,
            draft_len=cfg.draft_len,
            new_tokens=cfg.eval_new_tokens,
            temperature=t,
            seed=cfg.seed,
        )
        rows.append({"kind": "acceptance", "when": when, "temperature": t, **m})
    return rows


def run_mtp_boost(
    model: HybridLM,
    tokenizer: Any,
    train_prompts: list[list[int]],
    eval_prompts: list[list[int]],
    cfg: MTPBoostConfig,
    out_dir: str | Path,
    *,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Boost the MTP head of `model` in place; writes `metrics.jsonl`, `acceptance.png` and the
    boosted model (`model/`, a transformers directory) under `out_dir`, which may hold an earlier
    boost's metrics only with `overwrite=True` (they are removed). Returns the summary."""
    from .checkpoint import METRICS, prepare_run_dir

    cfg.validate()
    if model.mtp is None:
        raise ValueError("the model has no MTP head (mtp.pattern is empty): nothing to boost")
    if not train_prompts or not eval_prompts:
        raise ValueError("need at least one training prompt and one evaluation prompt")
    out = prepare_run_dir(out_dir, overwrite=overwrite, outputs=(METRICS,))
    metrics_path = out / METRICS
    metrics_path.touch()
    (out / "boost.json").write_text(json.dumps(asdict(cfg), indent=1))

    def log(row: dict) -> None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    depth = cfg.depth or cfg.draft_len
    model.eval()
    before = _acceptance_rows(model, eval_prompts, cfg, "before")
    for row in before:
        log(row)

    t0 = time.perf_counter()
    prompts = [train_prompts[i % len(train_prompts)] for i in range(cfg.num_sequences)]
    seqs = self_generate(
        model,
        tokenizer,
        prompts,
        gen_len=cfg.gen_len,
        temperature=cfg.gen_temperature,
        seed=cfg.seed,
    )
    gen_s = time.perf_counter() - t0
    L = max(len(s) for s in seqs)
    ids_NL = torch.zeros(len(seqs), L, dtype=torch.long)
    mask_NL = torch.zeros(len(seqs), L, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        ids_NL[i, : len(s)] = torch.tensor(s)
        mask_NL[i, len(p) : len(s)] = True  # targets: the generated tokens only
    device = model.embeddings.weight.device
    ids_NL, mask_NL = ids_NL.to(device), mask_NL.to(device)

    model.requires_grad_(False)
    model.mtp.requires_grad_(True)
    model.mtp.train()
    params = [p for p in model.mtp.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    order = random.Random(cfg.seed)
    mtp_moe = [m for m in model.mtp.modules() if isinstance(m, MoE)]
    from rich.progress import Progress

    rows: list[dict] = []
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("MTP boosting", total=cfg.steps)
        perm: list[int] = []
        for step in range(cfg.steps):
            if len(perm) < cfg.batch_size:
                perm += order.sample(range(len(seqs)), len(seqs))
            idx, perm = perm[: cfg.batch_size], perm[cfg.batch_size :]
            for group in opt.param_groups:
                group["lr"] = _lr(step, cfg)
            loss, m = mtp_boost_loss(
                model,
                ids_NL[idx],
                mask_NL[idx],
                depth=depth,
                mix_true=cfg.mix_true,
                distill_weight=cfg.distill_weight,
                temperature=cfg.distill_temperature,
                generator=gen,
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            for moe in mtp_moe:  # aux-loss-free balancing of the head's own router
                moe.update_bias()
            if step % cfg.log_interval == 0 or step == cfg.steps - 1:
                row = {"kind": "train", "step": step, "lr": _lr(step, cfg), **m}
                row["grad_norm"] = float(gnorm)
                rows.append(row)
                log(row)
            bar.update(task, advance=1, description=f"MTP boosting loss {m['loss']:.3f}")
    train_s = time.perf_counter() - t0 - gen_s
    model.requires_grad_(True)
    model.eval()
    after = _acceptance_rows(model, eval_prompts, cfg, "after")
    for row in after:
        log(row)
    model.save_pretrained(out / "model", tokenizer=tokenizer)
    plot_acceptance(metrics_path, out / "acceptance.png")
    return {
        "before": before,
        "after": after,
        "first": rows[0],
        "last": rows[-1],
        "generation_s": gen_s,
        "train_s": train_s,
        "sequences": len(seqs),
        "metrics": str(metrics_path),
        "plot": str(out / "acceptance.png"),
        "model": str(out / "model"),
    }


def plot_acceptance(metrics_path: str | Path, png: str | Path) -> None:
    """Acceptance by draft position before/after (one panel per temperature) and the loss."""
    from .plot import pyplot, save_figure

    plt = pyplot()

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line]
    acc = [r for r in rows if r["kind"] == "acceptance"]
    train = [r for r in rows if r["kind"] == "train"]
    temps = sorted({r["temperature"] for r in acc})
    fig, axes = plt.subplots(1, len(temps) + 1, figsize=(4.2 * (len(temps) + 1), 3.4))
    for ax, t in zip(axes, temps, strict=False):
        for r in (r for r in acc if r["temperature"] == t):
            pos = list(range(1, len(r["acceptance_by_position"]) + 1))
            label = f"{r['when']} (AL {r['acceptance_length']:.2f})"
            ax.plot(pos, r["acceptance_by_position"], marker="o", label=label)
        ax.set(title=f"T={t:g}", xlabel="draft position", ylabel="accepted fraction", ylim=(0, 1))
        ax.set_xticks(range(1, max(len(r["acceptance_by_position"]) for r in acc) + 1))
        ax.legend()
    ax = axes[-1]
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="loss")
        for k in range(1, 9):
            if f"kl_{k}" in train[0]:
                ax.plot([r["step"] for r in train], [r[f"kl_{k}"] for r in train], label=f"KL d{k}")
        ax.set(title="MTP boosting", xlabel="step")
        ax.legend()
    save_figure(fig, png)


# ---------------------------------------------------------------------- prompts
def prompts_from_checkpoint(
    path: str | None, tokenizer: Any, *, n_train: int, n_eval: int, prompt_len: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt windows from the documents of the checkpoint's training data (its run config's
    sources; the embedded stdlib corpus otherwise), split by document into boosting prompts and
    held-out evaluation prompts (every 5th document, by a hash of its id)."""
    import zlib

    from ..data.config import SourceConfig
    from ..data.pipeline import build_source

    sources = [SourceConfig(name="stdlib", kind="stdlib")]
    if path is not None:
        from .checkpoint import read_meta, resolve_checkpoint

        try:
            data = read_meta(resolve_checkpoint(path))["run_config"].get("data") or {}
            usable = [s for s in data.get("sources", []) if s.get("kind") != "shards"]
            sources = [SourceConfig(**s) for s in usable] or sources
        except ValueError:  # a transformers directory: no run config
            pass
    rng = random.Random(seed)
    train, held = [], []
    for src in sources:
        for doc in build_source(src):
            ids = tokenizer.encode(doc.text, add_bos=False)
            if len(ids) < 2 * prompt_len:
                continue
            start = rng.randrange(0, len(ids) - prompt_len)
            window = [tokenizer.bos_id, *ids[start : start + prompt_len - 1]]
            pool = held if zlib.crc32(doc.id.encode()) % 5 == 0 else train
            if len(pool) < (n_eval if pool is held else n_train):
                pool.append(window)
            if len(train) >= n_train and len(held) >= n_eval:
                return train, held
    if not train or not held:
        raise ValueError("the training data has too few documents long enough for prompts")
    return train, held


def prompts_from_environment(
    kind: str, tokenizer: Any, *, n_train: int, n_eval: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Chat prompts of an RL environment (`rl.learner.EnvConfig(kind=...)`): boosting prompts
    from one seed, held-out evaluation prompts from another."""
    from ..rl.learner import EnvConfig, build_environment

    def prompts(env_seed: int, n: int) -> list[list[int]]:
        env = build_environment(EnvConfig(kind=kind, seed=env_seed), tokenizer=tokenizer)
        return [tokenizer.encode(p.prompt) for p in env.sample(n, seed=env_seed)]

    return prompts(seed, n_train), prompts(seed + 1, n_eval)


def boost_checkpoint(
    checkpoint: str | Path,
    cfg: MTPBoostConfig,
    out: str | Path,
    *,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Boost the MTP head of a checkpoint (run, training checkpoint or transformers directory)
    with its own tokenizer, on prompts from its training data or from an RL environment
    (`cfg.prompts`); writes under `out` as `run_mtp_boost` does (`overwrite` as there)."""
    from .checkpoint import tokenizer_for

    cfg.validate()
    torch.manual_seed(cfg.seed)
    model = HybridLM.from_pretrained(checkpoint).float()
    tok = tokenizer_for(checkpoint)
    if cfg.prompts == "data":
        train, held = prompts_from_checkpoint(
            str(checkpoint),
            tok,
            n_train=cfg.num_sequences,
            n_eval=cfg.eval_prompts,
            prompt_len=cfg.prompt_len,
            seed=cfg.seed,
        )
    else:  # the RL environment's prompts (healing after RL, Nemotron 3 Super §4.7)
        train, held = prompts_from_environment(
            cfg.prompts, tok, n_train=cfg.num_sequences, n_eval=cfg.eval_prompts, seed=cfg.seed
        )
    res = run_mtp_boost(model, tok, train, held, cfg, out, progress=progress, overwrite=overwrite)
    return {**res, "eval_prompts": len(held)}
