"""Initialising the one recursively shared MTP head before its warm-up (Nemotron 3.5 §1, §2.1).

    init_head(model, "consolidate", ids_BL, valid_BL)    # per-depth heads -> one shared head
    init_head(model, "fuse", ids_BL, valid_BL)           # a head built from the backbone
    head_agreement(model, ids_BL, valid_BL, depth=3)     # teacher-forced greedy acceptance

Shape legend: B batch, L sequence, D width, V vocabulary, N calibration positions.

Nemotron 3.5 Super "consolidates two non-shared MTP heads into one recursively shared head";
Lightning "initializes its head through architecture-aware projection fusion and pruning"; both
then warm the head up with the backbone frozen (here `train.mtp_boost`). The report gives no
further detail. The choices made here:

- **consolidate** (Super): the per-depth heads of a model trained with `mtp.shared: false`
  (DeepSeek-V3 §2.2 heads, one per depth; `HybridLM` starts them equal) become one shared head:
  `average` takes the parameter mean over the heads, `first` keeps the depth-1 head, which was
  trained on exact backbone hiddens (the input every draft round starts from).
- **fuse** (Lightning): a training-free head built from the backbone itself.
  - *Pruning*: the MTP layer's blocks are copies of the backbone's tail blocks of the same
    kinds. The MTP pattern is matched from its end onto the backbone's last blocks of each
    letter, so "*E" takes the last attention block and the last MoE block after it; the rest
    of the trunk is pruned away. The head's closing norm is the backbone's final norm.
  - *Projection fusion*: `eh_proj` maps [enorm(emb(x_{t+1})); hnorm(h_t)] onto what the first
    copied block reads in the backbone at position t+1, its residual stream input r_{t+1}. It
    is the ridge least-squares solution on calibration rows (the model's own generations). The
    head then starts as an approximation of the backbone's own computation one position ahead.
- **random**: the head re-drawn with the model's init laws (the baseline the two are judged by).
"""

from __future__ import annotations

from typing import Literal

import torch

from ..model.model import HybridLM, shift_left

HeadInit = Literal["keep", "consolidate", "fuse", "random"]
HEAD_INITS: tuple[str, ...] = ("keep", "consolidate", "fuse", "random")
CONSOLIDATIONS: tuple[str, ...] = ("average", "first")


def _to_shared(model: HybridLM) -> None:
    """Drop the per-depth heads: the model holds the one shared head `model.mtp`."""
    model.mtp_depths = None
    model.config.mtp.shared = True


@torch.no_grad()
def consolidate_heads(model: HybridLM, how: str = "average") -> None:
    """Per-depth heads -> one shared head, in place (`average` over heads, or the `first`)."""
    if how not in CONSOLIDATIONS:
        raise ValueError(f"consolidate must be one of {CONSOLIDATIONS}, got {how!r}")
    heads = model.mtp_heads()
    if len(heads) < 2:
        raise ValueError("init 'consolidate' needs per-depth MTP heads (mtp.shared: false)")
    if how == "average":
        states = [h.state_dict() for h in heads]
        for name, t in heads[0].state_dict().items():
            if t.is_floating_point():
                ct = torch.promote_types(t.dtype, torch.float32)
                t.copy_(torch.stack([s[name].to(ct) for s in states]).mean(0))
    _to_shared(model)


def tail_blocks(pattern: str, mtp_pattern: str) -> list[int]:
    """The backbone blocks an MTP layer of `mtp_pattern` is pruned from: its letters matched
    from the end onto the last backbone blocks of each letter, in order."""
    picks, end = [], len(pattern)
    for c in reversed(mtp_pattern):
        end = pattern.rfind(c, 0, end)
        if end < 0:
            raise ValueError(
                f"init 'fuse': the MTP pattern {mtp_pattern!r} is not a subsequence of the "
                f"backbone pattern {pattern!r}: no {c!r} block to copy"
            )
        picks.append(end)
    return picks[::-1]


@torch.no_grad()
def fuse_head(
    model: HybridLM, ids_BL: torch.Tensor, valid_BL: torch.Tensor, *, ridge: float = 1e-3
) -> dict[str, float]:
    """The Lightning-style head (module docstring), in place; calibration on the rows `ids_BL`
    (`valid_BL` marks real tokens). Returns the fit: the relative residual of the projection."""
    cfg = model.config
    if model.mtp is None:
        raise ValueError("the model has no MTP module (mtp.pattern is empty)")
    picks = tail_blocks(cfg.pattern, cfg.mtp.pattern)
    _to_shared(model)
    head = model.mtp
    for block, i in zip(head.layers, picks, strict=True):
        block.load_state_dict(model.layers[i].state_dict())
    head.final_layernorm.load_state_dict(model.norm_f.state_dict())
    head.enorm.reset_parameters()
    head.hnorm.reset_parameters()

    # the normal equations' sums, accumulated over batches (memory: O(D^2), not O(N D))
    D = cfg.d_model
    ZZ = torch.zeros(2 * D, 2 * D, dtype=torch.float64)
    ZR = torch.zeros(2 * D, D, dtype=torch.float64)
    r_sum, rr, n = torch.zeros(D, dtype=torch.float64), 0.0, 0
    seen: list[torch.Tensor] = []
    hook = model.layers[picks[0]].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        for rows in torch.split(torch.arange(len(ids_BL)), 16):
            ids, valid = ids_BL[rows], valid_BL[rows]
            seen.clear()
            h_BLD = model(ids, return_hidden=True, return_logits=False).hidden
            pair_BL = valid & shift_left(valid, 1, False)  # t and t+1 are both real tokens
            emb_BLD = model.embeddings(shift_left(ids, 1))
            z = torch.cat([head.enorm(emb_BLD), head.hnorm(h_BLD)], -1)[pair_BL].double().cpu()
            r = shift_left(seen[0], 1)[pair_BL].double().cpu()
            ZZ += z.T @ z
            ZR += z.T @ r
            r_sum += r.sum(0)
            rr += float(r.pow(2).sum())
            n += len(z)
    finally:
        hook.remove()
    if n == 0:
        raise ValueError("init 'fuse' needs calibration rows of at least two tokens")
    lam = ridge * ZZ.diagonal().mean()
    W_2DD = torch.linalg.solve(ZZ + lam * torch.eye(2 * D, dtype=ZZ.dtype), ZR)
    head.eh_proj.weight.copy_(W_2DD.T.to(head.eh_proj.weight))
    # ||Z W - R||^2 from the sums, relative to the variance of R
    sse = float((W_2DD * (ZZ @ W_2DD)).sum() - 2 * (W_2DD * ZR).sum()) + rr
    var = rr - float(r_sum.pow(2).sum()) / n
    return {"fuse_positions": n, "fuse_relative_residual": sse / var}


@torch.no_grad()
def random_head(model: HybridLM, seed: int) -> None:
    """The shared head re-drawn with the model's init laws (`HybridLM.init_units`)."""
    _to_shared(model)
    mine = {id(m) for m in model.mtp.modules()}
    device = model.mtp.eh_proj.weight.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for unit, init in model.init_units():
            if id(unit) in mine:
                init(unit)


def init_head(
    model: HybridLM,
    how: str,
    ids_BL: torch.Tensor,
    valid_BL: torch.Tensor,
    *,
    consolidate: str = "average",
    ridge: float = 1e-3,
    seed: int = 0,
) -> dict[str, float]:
    """Give `model` one shared MTP head by `how` (HEAD_INITS; `keep`: as it is, which must be
    shared); the calibration rows are used by `fuse`. Returns what the init measured."""
    if model.mtp is None:
        raise ValueError("the model has no MTP module (mtp.pattern is empty)")
    if how == "keep":
        model.check_drafter("init 'keep'")
    elif how == "consolidate":
        consolidate_heads(model, consolidate)
    elif how == "fuse":
        return fuse_head(model, ids_BL, valid_BL, ridge=ridge)
    elif how == "random":
        random_head(model, seed)
    else:
        raise ValueError(f"init must be one of {HEAD_INITS}, got {how!r}")
    return {}


@torch.no_grad()
def head_agreement(
    model: HybridLM, ids_BL: torch.Tensor, valid_BL: torch.Tensor, *, depth: int
) -> dict[str, float | list[float]]:
    """Teacher-forced greedy acceptance of the MTP heads on the rows `ids_BL`: at depth k the
    head's argmax at position t against the backbone's argmax at t+k (what greedy verification
    accepts), over positions whose targets are real tokens (`valid_BL`), and the chain length
    1 + E[leading agreements] (the acceptance length of greedy drafting of `depth` tokens when
    the rows are the model's greedy output, up to the MTP attention's context: drafting attends
    over earlier exact positions, the teacher-forced forward over the same depth's outputs).
    Works for per-depth heads too (`depth` <= mtp.depth), which cannot draft."""
    agree = torch.zeros(depth, dtype=torch.float64)
    chain, counted = 0.0, 0
    for rows in torch.split(torch.arange(len(ids_BL)), 16):
        ids, valid = ids_BL[rows], valid_BL[rows]
        out = model(ids, mtp_depth=depth)
        target_BL = out.logits.argmax(-1)
        ok = valid & shift_left(valid, depth, False)  # positions t..t+depth are real tokens
        run_BL = torch.ones_like(ok)
        n = int(ok.sum())
        counted += n
        for k in range(1, depth + 1):
            hit = out.mtp_logits[k - 1].argmax(-1) == shift_left(target_BL, k)
            agree[k - 1] += (hit & ok).sum().item()
            run_BL = run_BL & hit
            chain += (run_BL & ok).sum().item()
    n = max(counted, 1)
    return {
        "agreement_by_depth": (agree / n).tolist(),
        "chain_length": 1.0 + chain / n,
        "positions": counted,
    }
